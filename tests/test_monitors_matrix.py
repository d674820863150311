"""Monitors on models we did not write: tiny random-init Hugging Face models of many families, each
trained a few steps with the guard and ``MonitorConfig``, with every logged attention max,
``logits_max`` and log Z compared with values computed independently from the model's own forward:
the q, k, mask, scaling, soft-cap and position bias the model hands its attention function, and the
model's own output logits. With and without left padding; sliding windows and soft-caps where the
model has them. No step may raise because of a monitor."""

from __future__ import annotations

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

    def forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any) -> Any:
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
            return sdpa_attention_forward(module, query, key, value, mask if bias is None else mask, **kw)
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value, mask, **kw)

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
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**TINY)),
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
        metrics = guard.engine.last_host_metrics
        assert REFERENCE, "the model did not call its attention function"
        for module_id, reference in REFERENCE.items():
            value = metrics[f"stability/monitors/attn_logit_max/{names[module_id]}"]
            assert value == pytest.approx(reference, rel=1e-4), names[module_id]
            checked += 1
        logits = out.logits.detach().float()
        mask = batch.get("attention_mask") if logits.shape[:-1] == batch["input_ids"].shape else None
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
