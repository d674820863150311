"""Monitors on models we did not write: tiny random-init Hugging Face models of many families, each
trained a few steps with the guard and ``MonitorConfig``, with every logged attention max,
``logits_max`` and log Z compared with values computed independently from the model's own forward:
the q, k, mask, scaling, soft-cap and position bias the model hands its attention function, and the
model's own output logits. With and without left padding; sliding windows and soft-caps where the
model has them. No step may raise because of a monitor."""

from __future__ import annotations

import functools
import io
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import stabilitykit as sk

VOCAB, SEQ, BATCH = 128, 12, 2
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
REFERENCE: dict[int, float] = {}  # id(attention module) -> max pre-softmax logit of its last call


def _reference(implementation: str) -> Callable[..., Any]:
    """Record the max logit from what the model hands its attention function, then run the real one."""

    def forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, given: Any, **kw: Any) -> Any:
        mask = given
        keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scaling = kw.get("scaling")
        logits = (query @ keys.transpose(-2, -1)).detach().float()
        logits = logits * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        if implementation == "eager" and kw.get("softcap") is not None:
            logits = torch.tanh(logits / kw["softcap"]) * kw["softcap"]
        bias = kw.get("position_bias")
        if bias is not None:
            logits = logits + bias.detach()
        if mask is None and implementation == "sdpa" and getattr(module, "is_causal", True) and query.shape[2] > 1:
            mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()
        if mask is not None:
            mask = mask[..., : keys.shape[2]]
            logits = logits.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else logits + mask.float()
        REFERENCE[id(module)] = max(REFERENCE.get(id(module), -torch.inf), float(logits.amax()))
        if implementation == "sdpa":
            return sdpa_attention_forward(module, query, key, value, given, **kw)
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value, given, **kw)

    return forward


AttentionInterface.register("sk_matrix_eager", _reference("eager"))
AttentionInterface.register("sk_matrix_sdpa", _reference("sdpa"))


def _causal(name: str, **extra: Any) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        config_cls = getattr(transformers, f"{name}Config")
        model_cls = getattr(transformers, f"{name}ForCausalLM")
        kwargs = dict(TINY, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0) | extra
        return model_cls(config_cls(**kwargs))

    return make


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _causal("Llama"),
    "mistral_window": _causal("Mistral", sliding_window=4),
    "qwen2": _causal("Qwen2"),
    "qwen3": _causal("Qwen3", head_dim=8),
    "gemma2_window_softcap": _causal(
        "Gemma2", head_dim=8, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
    ),
    "phi3": _causal("Phi3"),
    "olmo2": _causal("Olmo2"),
    "cohere_qk_norm": _causal("Cohere", use_qk_norm=True),
    "mixtral": _causal("Mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _causal("Qwen2Moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)
    ),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**TINY)),
    "bert_mlm": lambda: transformers.BertForMaskedLM(transformers.BertConfig(**TINY)),
    "t5_self_and_cross": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0)),
}  # fmt: skip


def _batch(padding: bool, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    if padding:
        mask[0, :5] = 0  # left padding: the first row's first five positions are pads
        ids[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grow_qk(model: torch.nn.Module) -> None:
    """Larger attention logits than the random init gives, so the comparison means something."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight", "qkv_proj.weight",
                              "query_key_value.weight", ".q.weight", ".k.weight")):  # fmt: skip
                param.mul_(6.0)


def _train_and_compare(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    names = {id(m): n for n, m in model.named_modules()}
    cfg = sk.StabilityConfig(log_every_n_steps=1, spikes=sk.SpikeConfig(enabled=False),
                             monitors=sk.MonitorConfig(log_z_positions=None))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sk.StabilityGuard(model, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
    checked = 0
    for batch in batches:
        REFERENCE.clear()
        out = model(**batch)
        guard.backward(out.loss)
        guard.step()
        guard.zero_grad()
        metrics = guard.engine.readout.last_host_metrics
        assert REFERENCE, "the model did not call its attention function"
        for module_id, reference in REFERENCE.items():
            value = metrics[f"stability/monitors/attn_logit_max/{names[module_id]}"]
            assert value == pytest.approx(reference, rel=1e-4), names[module_id]
            checked += 1
        logits = out.logits.detach().float()
        encoder_decoder = model.config.is_encoder_decoder  # its logits are the decoder's: no mask given
        mask = None if encoder_decoder else batch["attention_mask"]
        weights = torch.ones(logits.shape[:-1]) if mask is None else mask.float()
        real = logits[weights.bool()]
        head = [k for k in metrics if "/monitors/logits_max/" in k]
        assert len(head) == 1
        assert metrics[head[0]] == pytest.approx(float(real.abs().max()), rel=1e-4)
        log_z = metrics[head[0].replace("logits_max", "log_z")]
        assert log_z == pytest.approx(float(torch.logsumexp(real, -1).mean()), rel=1e-4)
    guard.close()
    assert checked >= 2
    return metrics


@pytest.mark.parametrize("padding", [False, True], ids=["full", "left_padded"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_logged_value_matches_the_models_own_forward(family: str, implementation: str, padding: bool) -> None:
    if implementation == "sdpa" and "softcap" in family:
        pytest.skip("SDPA has no soft-cap: Hugging Face runs soft-capped models eagerly")
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.set_attn_implementation(f"sk_matrix_{implementation}")
    _grow_qk(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no module may go unmeasured
        _train_and_compare(model, [_batch(padding, seed) for seed in range(2)])


def _guard(model: torch.nn.Module, **monitors: Any) -> sk.StabilityGuard:
    cfg = sk.StabilityConfig(log_every_n_steps=1, spikes=sk.SpikeConfig(enabled=False),
                             monitors=sk.MonitorConfig(**monitors))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return sk.StabilityGuard(model, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])


def test_blocks_of_every_stack_are_measured_encoder_and_decoder() -> None:
    torch.manual_seed(0)
    model = FAMILIES["t5_self_and_cross"]()
    guard = _guard(model)
    guard.backward(model(**_batch(False, 0)).loss)
    guard.step()
    logged = {k.split("/", 3)[3] for k in guard.engine.readout.last_host_metrics if "/resid_norm/" in k}
    assert logged == {"encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"}
    attention = {k.split("/", 3)[3] for k in guard.engine.readout.last_host_metrics if "/attn_logit_max/" in k}
    assert "decoder.block.0.layer.1.EncDecAttention" in attention  # cross-attention too
    assert "encoder.block.0.layer.0.SelfAttention" in attention


class _RopeQKNormAttention(torch.nn.Module):
    """A nanoGPT-style attention with a fused qkv, rotary embeddings and QK-norm, ending in SDPA."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.q_norm, self.k_norm = torch.nn.RMSNorm(self.head_dim), torch.nn.RMSNorm(self.head_dim)
        self.proj = torch.nn.Linear(width, width)
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q) * 4.0, self.k_norm(k) * 4.0
        angle = torch.arange(t)[:, None] * (1e-2 ** (torch.arange(self.head_dim // 2) / (self.head_dim // 2)))
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
        half = self.head_dim // 2
        rotate = lambda z: z * cos + torch.cat([-z[..., half:], z[..., :half]], -1) * sin
        q, k = rotate(q), rotate(k)
        logits = (q @ k.transpose(-2, -1)) / self.head_dim**0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        self.seen.append(float(logits.detach().masked_fill(~causal, -torch.inf).amax()))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Stack(torch.nn.Module):
    """Embedding, two blocks of a given attention, a head."""

    def __init__(self, attention: Callable[[], torch.nn.Module]) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"attn": attention()}) for _ in range(2))
        self.lm_head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            attn = block["attn"]
            if isinstance(attn, torch.nn.MultiheadAttention):
                out, _ = attn(x, x, x, need_weights=True, average_attn_weights=False)
            else:
                out = attn(x)
            x = x + out
        return self.lm_head(x)


def test_a_plain_sdpa_module_with_rope_and_qk_norm_is_measured_from_its_own_call() -> None:
    torch.manual_seed(0)
    model = _Stack(_RopeQKNormAttention)
    guard = _guard(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    guard.backward(torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
    guard.step()
    for i in range(2):
        reference = model.blocks[i]["attn"].seen[-1]
        value = guard.engine.readout.last_host_metrics[f"stability/monitors/attn_logit_max/blocks.{i}.attn"]
        assert reference > 2.0 and value == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_is_measured_on_both_of_its_paths(need_weights: bool) -> None:
    torch.manual_seed(0)
    model = _Stack(lambda: torch.nn.MultiheadAttention(32, 4, batch_first=True))
    captured: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        block["attn"].register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0].detach()))
    guard = _guard(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    if not need_weights:
        for block in model.blocks:
            block["attn"].forward = functools.partial(_no_weights, block["attn"])
    guard.backward(torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
    references = {}
    with torch.no_grad():  # before the step updates the weights
        for i, x in captured.items():
            attn = model.blocks[i]["attn"]
            q, k, _ = torch.nn.functional.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
            q, k = (z.unflatten(-1, (4, 8)).transpose(1, 2) for z in (q, k))
            references[i] = float(((q @ k.transpose(-2, -1)) / 8**0.5).amax())
    guard.step()
    for i, reference in references.items():
        value = guard.engine.readout.last_host_metrics[f"stability/monitors/attn_logit_max/blocks.{i}.attn"]
        assert value == pytest.approx(reference, rel=1e-4)


def _no_weights(attn: torch.nn.MultiheadAttention, *args: Any, **kwargs: Any) -> Any:
    kwargs["need_weights"] = False
    return torch.nn.MultiheadAttention.forward(attn, *args, **kwargs)


class _Sparse(torch.nn.Module):
    """Returns a sparse tensor: the activation statistics cannot measure it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse()


def test_a_measurement_that_raises_disables_itself_with_one_warning_and_the_step_goes_on() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Sparse())
    guard = _guard(model, modules=["1"], attention=False, logits=False, residual=False)
    with (
        pytest.warns(RuntimeWarning, match=r"monitors: not measured: 1: measuring it raised"),  # the list, once
        pytest.warns(RuntimeWarning, match=r"1 is not measured: measuring it raised") as record,
    ):
        for _ in range(3):
            out = model(torch.randn(2, 4)).to_dense()
            guard.backward(out.square().sum())
            guard.step()
    assert len([w for w in record if "is not measured: measuring" in str(w.message)]) == 1
    assert guard.engine.step == 3
    monitor = guard.engine.monitor
    assert monitor is not None and "1" in monitor.unmeasured


class _KernelAttention(torch.nn.Module):
    """An attention computed by a kernel the monitors cannot see into (here: ``Tensor.softmax``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v


def test_an_attention_that_cannot_be_measured_is_named_once_and_in_the_run_summary() -> None:
    torch.manual_seed(0)
    model = _Stack(_KernelAttention)
    guard = _guard(model)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with pytest.warns(RuntimeWarning, match=r"not measured: blocks\.0\.attn: no scaled_dot_product_attention") as got:
        for _ in range(3):
            guard.backward(torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
            guard.step()
            guard.zero_grad()
    assert len([w for w in got if "not measured" in str(w.message)]) == 1
    assert not [k for k in guard.engine.readout.last_host_metrics if "/attn_logit_max/" in k]
    summary = guard.summary()
    assert [u.split(":")[0] for u in summary.unmeasured] == ["blocks.0.attn", "blocks.1.attn"]
    assert "not measured by the monitors: blocks.0.attn" in summary.line()


class _Bottleneck(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.conv(x))


class _Stage(torch.nn.Module):
    """A CNN stage as timm's ConvNeXt builds it: a downsample, then a Sequential of blocks."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.downsample = torch.nn.Conv2d(channels, channels, 2, stride=2)
        self.blocks = torch.nn.Sequential(_Bottleneck(channels), _Bottleneck(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


def test_every_cnn_stage_has_its_blocks_measured_over_channels_per_pixel() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("stem", torch.nn.Conv2d(3, 8, 1))
    model.add_module("stages", torch.nn.Sequential(_Stage(8), _Stage(8)))
    model.add_module(
        "head", torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    )
    outputs: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.count(".") == 3:  # stages.i.blocks.j
            module.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out.detach()))
    guard = _guard(model)
    x = torch.randn(2, 3, 8, 8)
    guard.backward(model(x).square().mean())
    guard.step()
    metrics = guard.engine.readout.last_host_metrics
    resid = {k.split("/", 3)[3]: v for k, v in metrics.items() if "/resid_norm/" in k}
    assert sorted(resid) == ["stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0", "stages.1.blocks.1"]
    for name, out in outputs.items():  # the mean over pixels of the L2 norm over channels
        assert resid[name] == pytest.approx(float(out.norm(dim=1).mean()), rel=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_hf_vit_attention_and_class_logits_match_its_own_forward(implementation: str) -> None:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        num_labels=5,
        **{k: v for k, v in TINY.items() if k != "vocab_size"},
    )
    model = transformers.ViTForImageClassification(config)
    model.set_attn_implementation(f"sk_matrix_{implementation}")
    _grow_qk(model)
    names = {id(m): n for n, m in model.named_modules()}
    guard = _guard(model, log_z_positions=None)
    REFERENCE.clear()
    pixels = torch.randn(BATCH, 3, 16, 16)
    out = model(pixel_values=pixels, labels=torch.tensor([1, 3]))
    guard.backward(out.loss)
    guard.step()
    metrics = guard.engine.readout.last_host_metrics
    assert len(REFERENCE) == 2
    for module_id, reference in REFERENCE.items():
        value = metrics[f"stability/monitors/attn_logit_max/{names[module_id]}"]
        assert value == pytest.approx(reference, rel=1e-4)
    logits = out.logits.detach()
    assert metrics["stability/monitors/logits_max/logits"] == pytest.approx(float(logits.abs().max()), rel=1e-4)
    log_z = float(torch.logsumexp(logits, -1).mean())
    assert metrics["stability/monitors/log_z/logits"] == pytest.approx(log_z, rel=1e-4)


def test_torch_transformer_encoder_layers_are_measured_from_their_sdpa_call() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    )
    inputs: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model[1].layers):
        block.self_attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
    guard = _guard(model, logits=False)
    x = torch.randn(BATCH, SEQ, 8) * 4
    guard.backward(model(x).square().mean())
    references = {}
    with torch.no_grad():
        for i, h in inputs.items():
            attn = model[1].layers[i].self_attn
            q, k, _ = torch.nn.functional.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
            q, k = (z.unflatten(-1, (4, 8)).transpose(1, 2) for z in (q, k))
            references[i] = float(((q @ k.transpose(-2, -1)) / 8**0.5).amax())
    guard.step()
    metrics = guard.engine.readout.last_host_metrics
    for i, reference in references.items():
        value = metrics[f"stability/monitors/attn_logit_max/1.layers.{i}.self_attn"]
        assert value == pytest.approx(reference, rel=1e-4)
    assert {k.split("/", 3)[3] for k in metrics if "/resid_norm/" in k} == {"1.layers.0", "1.layers.1"}
