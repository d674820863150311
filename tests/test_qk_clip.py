"""QK-clip: the per-head rescale against a hand computation, its guarantees (heads under tau and
skipped steps bitwise unchanged, non-finite maxima never rescale, no host sync), the config path
through StabilityGuard on a run whose logits grow, and a real Hugging Face Llama."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import stabilitykit as sk
from stabilitykit.testing.syncs import count_host_syncs
from tests.qk_models import AttnNet, UserAttention, per_head_logit_max
from tests.time_limits import limit, waits_for

WIDTH = 16


def _x(seed: int = 0, batch: int = 2, t: int = 6) -> Tensor:
    return torch.randn(batch, t, WIDTH, generator=torch.Generator().manual_seed(seed))


def _layer(fused: bool, kv_heads: int | None, seed: int = 0) -> UserAttention:
    torch.manual_seed(seed)
    layer = UserAttention(WIDTH, 4, kv_heads, fused)
    with torch.no_grad():  # logits of a few units, heads well apart
        lay = layer.qk_clip_layout()
        lay.q_weight.mul_(3.0)
        if lay.k_weight is not lay.q_weight:
            lay.k_weight.mul_(3.0)
    return layer


def _expected(layer: UserAttention, head_max: Tensor, tau: float, alpha: float) -> dict[str, Tensor]:
    """Every parameter after QK-clip, computed head by head."""
    lay = layer.qk_clip_layout()
    d, hq, hkv = lay.head_dim, lay.num_heads, lay.kv_heads
    group = hq // hkv
    tau_t = torch.tensor(tau)
    expected = {n: p.detach().clone() for n, p in layer.named_parameters()}
    names = {id(p): n for n, p in layer.named_parameters()}
    for g in range(hkv):
        worst = head_max[g * group : (g + 1) * group].max()
        if not (torch.isfinite(worst) and worst > tau):
            continue
        eta = tau_t / worst
        for h in range(g * group, (g + 1) * group):
            for param in (p for p in (lay.q_weight, lay.q_bias) if p is not None):
                rows = slice(lay.q_row + h * d, lay.q_row + (h + 1) * d)
                expected[names[id(param)]][rows] = param.detach()[rows] * eta.pow(alpha)
        for param in (p for p in (lay.k_weight, lay.k_bias) if p is not None):
            rows = slice(lay.k_start + g * d, lay.k_start + (g + 1) * d)
            expected[names[id(param)]][rows] = param.detach()[rows] * eta.pow(1.0 - alpha)
    return expected


def _params(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("alpha", [0.5, 0.3])
@pytest.mark.parametrize(("fused", "kv_heads"), [(True, None), (False, None), (True, 2), (False, 2), (False, 1)])
def test_rescale_matches_the_hand_computation(alpha: float, fused: bool, kv_heads: int | None) -> None:
    layer = _layer(fused, kv_heads)
    qk = sk.nn.QKClip(layer, threshold=1.0, query_share=alpha)
    x = _x()
    layer(x)
    head_max = layer.head_max
    assert head_max is not None
    torch.testing.assert_close(head_max, per_head_logit_max(layer, x), rtol=1e-5, atol=1e-5)
    group = 4 // (kv_heads or 4)
    group_max = head_max.view(-1, group).amax(1)
    ranked = group_max.sort().values
    tau = float(ranked[:2].mean()) if len(ranked) > 1 else float(ranked[0]) / 2  # the lowest group stays
    qk.threshold = tau
    expected = _expected(layer, head_max, tau, alpha)
    qk.apply()
    for name, param in layer.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name
    after = per_head_logit_max(layer, x)
    clipped = group_max.repeat_interleave(group) > tau
    assert clipped.any() and (not clipped.all() or len(ranked) == 1)
    assert (after[clipped] <= tau * (1 + 1e-5)).all()  # a clipped group's worst head lands on tau
    worst = after.view(-1, group).amax(1)[group_max > tau]
    torch.testing.assert_close(worst, torch.full_like(worst, tau), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[~clipped], head_max[~clipped], rtol=1e-5, atol=1e-6)


def test_heads_under_tau_and_the_value_rows_are_bitwise_unchanged() -> None:
    layer = _layer(fused=True, kv_heads=None)
    qk = sk.nn.QKClip(layer, threshold=1.0)
    layer(_x())
    assert layer.head_max is not None
    order = layer.head_max.argsort()
    qk.threshold = float(layer.head_max[order[1:3]].mean())
    low = order[:2].tolist()
    before = _params(layer)
    qk.apply()
    d, c = layer.head_dim, WIDTH
    for h in range(4):
        q_rows, k_rows = slice(h * d, (h + 1) * d), slice(c + h * d, c + (h + 1) * d)
        same = torch.equal(layer.qkv.weight[q_rows], before["qkv.weight"][q_rows]) and torch.equal(
            layer.qkv.weight[k_rows], before["qkv.weight"][k_rows]
        )
        assert same == (h in low), h
    assert torch.equal(layer.qkv.weight[2 * c :], before["qkv.weight"][2 * c :])  # values
    assert torch.equal(layer.qkv.bias[2 * c :], before["qkv.bias"][2 * c :])
    assert torch.equal(layer.o_proj.weight, before["o_proj.weight"])


def test_a_skipped_step_changes_nothing_and_drops_its_maxima() -> None:
    layer = _layer(fused=False, kv_heads=2)
    qk = sk.nn.QKClip(layer, threshold=0.01)
    layer(_x())
    before = _params(layer)
    qk.apply(skip=torch.tensor(True))
    for name, param in layer.named_parameters():
        assert torch.equal(param, before[name]), name
    assert float(qk.stability_metrics()["qk_clip/heads_clipped"]) == 0
    qk.apply()  # no forward since: nothing to clip
    for name, param in layer.named_parameters():
        assert torch.equal(param, before[name]), name
    layer(_x())
    qk.apply(skip=torch.tensor(False))
    assert not torch.equal(layer.q_proj.weight, before["q_proj.weight"])
    assert float(qk.stability_metrics()["qk_clip/heads_clipped"]) == 4


def test_non_finite_max_logits_never_rescale_and_never_write_nan() -> None:
    layer = _layer(fused=False, kv_heads=None)
    qk = sk.nn.QKClip(layer, threshold=0.01)
    before = _params(layer)
    x = _x()
    x[0, 2] = math.nan  # every head's max is NaN
    layer(x)
    qk.apply()
    for name, param in layer.named_parameters():
        assert torch.equal(param, before[name]), name
    layer(_x() * 1e30)  # overflowing logits: +inf maxima
    qk.apply()
    for name, param in layer.named_parameters():
        assert torch.equal(param, before[name]), name

    with torch.no_grad():  # one head NaN through its own bias: that head is left alone, the others clip
        layer.q_proj.bias[layer.head_dim : 2 * layer.head_dim] = math.nan
    layer(_x())
    assert layer.head_max is not None and layer.head_max.isnan().tolist() == [False, True, False, False]
    qk.apply()
    d = layer.head_dim
    assert torch.equal(layer.q_proj.weight[d : 2 * d], before["q_proj.weight"][d : 2 * d])
    assert torch.equal(layer.k_proj.weight[d : 2 * d], before["k_proj.weight"][d : 2 * d])
    assert not torch.equal(layer.q_proj.weight[:d], before["q_proj.weight"][:d])
    assert torch.isfinite(layer.q_proj.weight).all() and torch.isfinite(layer.k_proj.weight).all()
    assert torch.isfinite(layer.k_proj.bias).all()


def test_apply_makes_no_host_sync() -> None:
    model = AttnNet(WIDTH, 4, 2)
    qk = sk.nn.QKClip(model, threshold=0.1)
    model(_x())
    with count_host_syncs() as counter:
        qk.apply(skip=torch.tensor(False))
        model(_x(1))
        qk.apply()
    assert counter.count == 0, counter.sites


def test_running_max_spans_micro_batches_and_ignores_eval_forwards() -> None:
    a, b = _layer(False, 2), _layer(False, 2)
    qa, qb = sk.nn.QKClip(a, threshold=0.5), sk.nn.QKClip(b, threshold=0.5)
    x1, x2 = _x(1), _x(2)
    a(x1)
    a(x2)  # two micro-batches
    b(torch.cat([x1, x2]))  # one batch
    b.eval()
    b(_x(3) * 100)  # a validation forward: not this step's training logits
    b.train()
    torch.testing.assert_close(qa.stability_metrics(), qb.stability_metrics())
    qa.apply()
    qb.apply()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)


def test_parameters_replaced_by_load_state_dict_are_the_ones_clipped() -> None:
    model = AttnNet(WIDTH, 4)
    qk = sk.nn.QKClip(model, threshold=0.1)
    old = model.layers[0].q_proj.weight
    old_copy = old.detach().clone()
    fresh = AttnNet(WIDTH, 4).state_dict()
    fresh_copy = fresh["layers.0.q_proj.weight"].clone()
    model.load_state_dict(fresh, assign=True)
    assert model.layers[0].q_proj.weight is not old
    model(_x())
    qk.apply()
    assert torch.equal(old, old_copy)
    assert not torch.equal(model.layers[0].q_proj.weight, fresh_copy)


def test_metrics_per_layer_and_heads_clipped() -> None:
    model = AttnNet(WIDTH, 4)
    qk = sk.nn.QKClip(model, threshold=1e-3)
    assert qk.stability_metrics() == {}
    model(_x())
    pending = qk.stability_metrics()
    assert set(pending) == {"qk_clip/heads_clipped", "qk_clip/max_logit/layers.0", "qk_clip/max_logit/layers.1"}
    assert float(pending["qk_clip/heads_clipped"]) == 8
    layer0 = model.layers[0].head_max
    assert layer0 is not None and float(pending["qk_clip/max_logit/layers.0"]) == float(layer0.max())
    qk.apply()
    assert float(qk.stability_metrics()["qk_clip/heads_clipped"]) == 8
    qk.remove()
    assert not model.layers[0].qk_clip_tracking


def test_errors_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="no module of Sequential implements"):
        sk.nn.QKClip(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="qk_norm=False"):
        sk.nn.QKClip(sk.nn.QKNormAttention(16, 4))
    with pytest.raises(ValueError, match="query_share"):
        sk.nn.QKClip(AttnNet(), query_share=1.5)
    with pytest.raises(ValueError, match="threshold"):
        sk.nn.QKClip(AttnNet(), threshold=0.0)

    class Wrong(UserAttention):
        def qk_clip_layout(self) -> sk.nn.QKLayout:
            return sk.nn.QKLayout.separate(self.q_proj, self.k_proj, 8, self.head_dim)  # 8 heads of 4 rows: too many

    with pytest.raises(ValueError, match=r"'0' \(Wrong\).*do not fit"):
        sk.nn.QKClip(nn.Sequential(Wrong(WIDTH, 4)))
    with pytest.raises(ValueError, match=r"StabilityConfig.qk_clip.enabled is True, but QKClip: no module of Linear"):
        model = nn.Linear(2, 2)
        cfg = sk.StabilityConfig(qk_clip=sk.QKClipConfig(enabled=True))
        sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    with pytest.raises(ValueError):
        sk.QKClipConfig(query_share=-0.1)
    with pytest.raises(ValueError):
        sk.QKClipConfig(threshold=0)


def test_only_the_optimizer_that_owns_the_projections_clips() -> None:
    model = AttnNet(WIDTH, 4)
    cfg = sk.QKClipConfig(enabled=True)
    assert sk.nn.QKClip.from_config(cfg, model, params=model.head.parameters()) is None
    assert sk.nn.QKClip.from_config(cfg, model, params=model.parameters()) is not None
    assert sk.nn.QKClip.from_config(sk.QKClipConfig(), model) is None


# --------------------------------------------------------------------------- through the guard


class ListSink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


def _clip_gpt() -> nn.Module:
    model = sk.testing.tiny_gpt(seed=0)
    torch.manual_seed(1)
    for block in model.blocks:  # type: ignore[union-attr]
        block.attn = sk.nn.QKNormAttention(64, 4, qk_norm=False)
    return model


def _train(qk_clip: bool, steps: int = 40, tau: float = 8.0) -> tuple[nn.Module, ListSink, list[float], list[int]]:
    model = _clip_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, fused=True)  # high: logits grow fast
    cfg = sk.StabilityConfig(log_every_n_steps=5, qk_clip=sk.QKClipConfig(enabled=qk_clip, threshold=tau))
    sink = ListSink()
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sink])
    data = sk.testing.char_batches(seed=0)
    maxima: list[float] = []
    syncs: list[int] = []
    for _ in range(steps):
        x, y = next(data)
        loss = model.loss(x, y)  # type: ignore[operator]
        with count_host_syncs() as counter:
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        syncs.append(counter.count)
        with torch.no_grad():  # the max logit of the weights just written, on the batch just seen
            model.eval()
            for block in model.blocks:  # type: ignore[union-attr]
                block.attn.measure_metrics = True
            model.loss(x, y)  # type: ignore[operator]
            maxima.append(max(float(b.attn.stability_metrics()["attention/max_logit"]) for b in model.blocks))
            model.train()
    return model, sink, maxima, syncs


def test_guard_with_the_config_section_holds_growing_logits_under_tau() -> None:
    _, _, free, _ = _train(qk_clip=False)
    _, sink, clipped, syncs = _train(qk_clip=True)
    tau = 8.0
    assert max(free) > 3 * tau  # without QK-clip the logits run away at this learning rate (to 36)
    # The clip uses the logits of the forward before the update, so the weights just written may give
    # a little more than tau (the step's growth: up to 1.45x here), never a runaway.
    assert max(clipped) < 1.6 * tau, clipped
    assert sorted(clipped[-20:])[10] < 1.25 * tau, clipped
    assert all(s == 0 for i, s in enumerate(syncs) if i % 5), syncs  # no sync off logging steps
    logged = dict(sink.rows)
    keys = {k for _, row in sink.rows for k in row}
    assert {"stability/qk_clip/heads_clipped", "stability/qk_clip/max_logit/blocks.0.attn"} <= keys
    assert sum(row.get("stability/qk_clip/heads_clipped", 0) for row in logged.values()) > 0
    late = logged[35]  # the same forward feeds both metrics
    per_layer = [late[f"stability/qk_clip/max_logit/blocks.{i}.attn"] for i in range(4)]
    assert max(per_layer) == late["stability/attention/max_logit"]


def test_guard_skip_leaves_attention_weights_bitwise_unchanged() -> None:
    model = _clip_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=100, qk_clip=sk.QKClipConfig(enabled=True, threshold=0.01))
    guard = sk.StabilityGuard(model, opt, cfg)
    data = sk.testing.char_batches(seed=0)
    for i in range(3):
        x, y = next(data)
        before = _params(model)
        loss = model.loss(x, y) * (math.nan if i == 2 else 1.0)  # type: ignore[operator]
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
        changed = any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "attn.qkv" in n)
        assert changed == (i != 2), i
    assert guard.summary()["skipped"] == 1


def test_lightning_trainer_clips_after_each_step_and_not_on_a_skipped_one(tmp_path) -> None:
    import csv
    from pathlib import Path

    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader
    from tests.lightning_checks import StateAt

    module = GPTModule(lr=2e-2, poison={7: math.nan})
    torch.manual_seed(1)
    for block in module.model.blocks:  # type: ignore[union-attr]
        block.attn = sk.nn.QKNormAttention(64, 4, qk_norm=False)
    cfg = sk.StabilityConfig(log_every_n_steps=5, qk_clip=sk.QKClipConfig(enabled=True, threshold=2.0))
    callback, snap = StabilityCallback(cfg), StateAt(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=12,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[callback, snap],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    trainer.fit(module, gpt_dataloader())
    snap.assert_unchanged()  # the NaN step: no optimizer step and no rescale
    assert callback.engine is not None and callback.engine.qk_clip is not None
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))  # type: ignore[union-attr]
    clipped = [float(r["stability/qk_clip/heads_clipped"]) for r in rows if r.get("stability/qk_clip/heads_clipped")]
    assert len(clipped) == 2 and sum(clipped) > 0  # Lightning's logging rows: global steps 4 and 9
    last_apply = callback.engine.qk_clip.stability_metrics()  # no forward since the last step's apply
    assert float(last_apply["qk_clip/heads_clipped"]) > 0


# --------------------------------------------------------------------------- a real Hugging Face Llama


def test_hugging_face_llama_with_grouped_query_attention() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml

    def eager_with_max(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, **kw):  # type: ignore[no-untyped-def]
        if module.qk_clip_tracking and module.training:
            scores = query @ ml.repeat_kv(key, module.num_key_value_groups).transpose(2, 3) * kw["scaling"]
            if mask is not None:
                scores = scores + mask if mask.dtype != torch.bool else scores.masked_fill(~mask, -math.inf)
            module.head_max = scores.detach().amax(dim=(0, 2, 3))
        return ml.eager_attention_forward(module, query, key, value, mask, **kw)

    class ClippedLlamaAttention(ml.LlamaAttention):
        qk_clip_tracking = False
        head_max: Tensor | None = None

        def qk_clip_layout(self) -> sk.nn.QKLayout:
            c = self.config
            return sk.nn.QKLayout.separate(
                self.q_proj, self.k_proj, c.num_attention_heads, self.head_dim, c.num_key_value_heads
            )

        def qk_clip_max_logits(self) -> Tensor | None:
            return self.head_max

    transformers.AttentionInterface.register("qk_clip_eager", eager_with_max)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="qk_clip_eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.__class__ = ClippedLlamaAttention
    qk = sk.nn.QKClip(model, threshold=1.0)
    assert [e.name for e in qk.entries] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    attn = model.model.layers[0].self_attn
    for step in range(4):
        if step < 3:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        else:  # a forward and the clip with no update between: the same batch's logits end at tau
            with torch.no_grad():
                model(input_ids=ids)
        head_max = attn.head_max.clone()
        tau = float(head_max.sort().values[1])  # at least one group over
        qk.threshold = tau
        expected = _expected(attn, head_max, tau, 0.5)  # type: ignore[arg-type]
        qk.apply()
        for name, param in attn.named_parameters():
            assert torch.equal(param.detach(), expected[name]), (step, name)
    with torch.no_grad():
        model(input_ids=ids)
    assert float(attn.head_max.max()) <= tau * (1 + 1e-5)


# --------------------------------------------------------------------------- FSDP2 and tensor parallel


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from pathlib import Path

    from tests.distributed_script_runner import run_world

    script = Path(__file__).parent / "distributed_qk_clip_script.py"
    return run_world(script, 2, tmp_path_factory.mktemp("qk_clip"), timeout=limit("distributed_qk_clip_script"))


@pytest.mark.parametrize("case", ["fsdp2_fused", "fsdp2_separate_gqa"])
@waits_for("distributed_qk_clip_script")
def test_fsdp2_rescale_equals_the_single_process_bitwise(ranks: list[dict], case: str) -> None:
    for r, rank in enumerate(ranks):
        result = rank[case]
        assert result["sharded"], "the projection weights were not sharded"
        for i, row in enumerate(result["iterations"]):
            assert row["bitwise"], f"rank {r} iteration {i}: off by {row['max_abs_diff']}"
            assert 0 < row["heads_clipped"] == row["ref_heads_clipped"] < 8
        assert result["nan_on_rank1_unchanged"], f"rank {r}: a NaN on rank 1 rescaled weights"


@waits_for("distributed_qk_clip_script")
def test_tensor_parallel_rescale_equals_the_single_process_bitwise(ranks: list[dict]) -> None:
    for r, rank in enumerate(ranks):
        for i, row in enumerate(rank["tp"]["iterations"]):
            assert row["local_heads_match"], f"rank {r} iteration {i}: local heads' logits differ"
            assert row["bitwise"], f"rank {r} iteration {i}: off by {row['max_abs_diff']}"
    for i in range(len(ranks[0]["tp"]["iterations"])):  # each rank counts its own heads
        rows = [rank["tp"]["iterations"][i] for rank in ranks]
        assert sum(row["heads_clipped"] for row in rows) == rows[0]["ref_heads_clipped"] > 0


@waits_for("distributed_qk_clip_script")
def test_guard_on_fsdp2_matches_the_single_process(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["guard_fsdp2"]["max_abs_diff"] < 1e-6
        assert sum(rank["guard_fsdp2"]["heads_clipped"]) > 0
    assert ranks[0]["guard_fsdp2"]["heads_clipped"] == ranks[1]["guard_fsdp2"]["heads_clipped"]
