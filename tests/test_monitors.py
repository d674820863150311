"""Monitors inside models we did not write: tiny random-init HF Llama and GPT-2 through the plain
guard, a Lightning Trainer and an HF Trainer (no mocks): names, values against the model's own
attention logits, host syncs, hooks off on unsampled steps, torch.compile, spike warnings."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama, token_batches
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import stabilitykit as sk
from stabilitykit.testing.ops import count_device_ops
from stabilitykit.testing.syncs import count_host_syncs

MAKERS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
LLAMA_SIGNALS = {
    "act_rms": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"],
    "act_max": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"],
    "resid_norm": ["model.layers.0", "model.layers.1"],
    "attn_logit_max": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
    "logits_max": ["lm_head"],
    "log_z": ["lm_head"],
}
GPT2_SIGNALS = {
    "act_rms": ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"],
    "act_max": ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"],
    "resid_norm": ["transformer.h.0", "transformer.h.1"],
    "attn_logit_max": ["transformer.h.0.attn", "transformer.h.1.attn"],
    "logits_max": ["lm_head"],
    "log_z": ["lm_head"],
}


def _keys(signals: dict[str, list[str]], prefix: str = "stability/") -> set[str]:
    return {f"{prefix}monitors/{signal}/{module}" for signal, modules in signals.items() for module in modules}


def _guard(
    model: torch.nn.Module, sinks: list[Any] | None = None, lr: float = 1e-3, **config: Any
) -> sk.StabilityGuard:
    monitors = config.pop("monitors", sk.MonitorConfig())
    cfg = sk.StabilityConfig(monitors=monitors, **config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    quiet = [sk.sinks.ConsoleSink(stream=io.StringIO())]
    return sk.StabilityGuard(model, opt, config=cfg, sinks=sinks if sinks is not None else quiet)


def _train(guard: sk.StabilityGuard, model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches:
        guard.backward(model(**batch).loss)
        guard.step()
        guard.zero_grad()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [row for row in map(json.loads, path.read_text().splitlines()) if "stability/grad_norm/total" in row]


# ------------------------------------------------------------------ a reference from the model's own attention

REFERENCE: dict[int, float] = {}  # layer index -> max q k^T * scaling over causal positions, last forward


def _reference(implementation: str) -> Any:
    """An attention function that records the max pre-softmax logit from the very q, k and mask the
    model hands its attention kernel, then runs the kernel: the model file's own eager one, or SDPA.
    The signed max (the logit that saturates a softmax), as QK-clip and QKNormAttention measure it."""

    def forward(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        groups = query.shape[1] // key.shape[1]
        keys = key.repeat_interleave(groups, dim=1)  # HF's repeat_kv
        logits = ((query @ keys.transpose(-2, -1)) * kwargs["scaling"]).detach()
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        if mask is None and implementation == "sdpa":  # sdpa_attention_forward then passes is_causal
            t = logits.shape[-1]
            mask = torch.ones(t, t, dtype=torch.bool).tril()
        if mask is not None:
            logits = logits.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else logits + mask
        REFERENCE[module.layer_idx] = float(logits.amax())
        if implementation == "sdpa":
            return sdpa_attention_forward(module, query, key, *args, **kwargs)
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, *args, **kwargs)

    return forward


AttentionInterface.register("sk_reference_eager", _reference("eager"))
AttentionInterface.register("sk_reference_sdpa", _reference("sdpa"))


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_monitor_metrics_reach_the_jsonl_sink_on_logging_steps_with_layer_names(kind: str, tmp_path: Path) -> None:
    model = MAKERS[kind]()
    guard = _guard(model, [sk.sinks.JsonlSink(tmp_path / "run.jsonl")], log_every_n_steps=3)
    _train(guard, model, token_batches(7))
    guard.close()
    rows = _rows(tmp_path / "run.jsonl")
    expected = _keys(LLAMA_SIGNALS if kind == "llama" else GPT2_SIGNALS)
    on_logging = [row for row in rows if row["step"] in (0, 3, 6)]
    assert len(on_logging) == 3
    for row in on_logging:
        found = {k for k in row if "/monitors/" in k}
        assert found == expected, found ^ expected
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in found)
    norm = "model.norm" if kind == "llama" else "transformer.ln_f"
    assert 0.5 < on_logging[-1][f"stability/monitors/act_rms/{norm}"] < 2.0  # a norm's output has RMS ~ 1
    assert on_logging[-1]["stability/monitors/log_z/lm_head"] == pytest.approx(math.log(96), abs=0.3)  # near uniform


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_attention_logit_equals_the_models_own_max_pre_softmax_logit(kind: str, implementation: str) -> None:
    model = MAKERS[kind]()
    model.set_attn_implementation(f"sk_reference_{implementation}")
    with torch.no_grad():  # larger logits than the random init gives, so the comparison means something
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight")):
                param.mul_(8.0)
    guard = _guard(model, log_every_n_steps=1, spikes=sk.SpikeConfig(enabled=False))
    for batch in token_batches(3, seed=5):
        REFERENCE.clear()
        _train(guard, model, [batch])  # the reference is recorded during this step's forward
        metrics = guard.engines[0].readout.last_host_metrics
        attention = "model.layers.{}.self_attn" if kind == "llama" else "transformer.h.{}.attn"
        assert sorted(REFERENCE) == [0, 1]
        for layer, reference in REFERENCE.items():
            value = metrics[f"stability/monitors/attn_logit_max/{attention.format(layer)}"]
            assert reference > 1.0
            assert value == pytest.approx(reference, rel=1e-5)


def test_zero_host_syncs_off_logging_steps_and_one_on_them_with_monitors_on() -> None:
    model = tiny_llama()
    guard = _guard(model, log_every_n_steps=4)
    counts = []
    for batch in token_batches(9):
        with count_host_syncs() as counter:
            loss = model(**batch).loss
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        counts.append(counter.count)
    assert counts == [1 if i % 4 == 0 else 0 for i in range(9)], counts
    assert any("/monitors/" in k for k in guard.engines[0].readout.last_host_metrics)


def _forward_ops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    with count_device_ops() as counter:
        model(**batch).loss.backward()
    model.zero_grad()
    return counter.ops


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hooks_do_nothing_on_unsampled_steps(kind: str) -> None:
    model = MAKERS[kind]()
    batch = token_batches(1)[0]
    bare = _forward_ops(model, batch)
    guard = _guard(model, log_every_n_steps=2)
    monitor = guard.engines[0].monitor
    assert monitor is not None and monitor.sampling  # step 0 is sampled
    sampled = _forward_ops(model, batch)
    assert sampled > bare  # the measurements run on the device
    monitor.stability_metrics()  # drop what the sampled forward measured
    _train(guard, model, [batch])  # step 0: sampled, logging
    assert not monitor.sampling  # step 1 is not
    assert _forward_ops(model, batch) == bare  # not one extra device op
    assert monitor.stability_metrics() == {}


def test_every_other_than_the_logging_cadence_keeps_values_until_the_next_read(tmp_path: Path) -> None:
    model = tiny_llama()
    monitors = sk.MonitorConfig(every=5)
    guard = _guard(model, [sk.sinks.JsonlSink(tmp_path / "run.jsonl")], log_every_n_steps=2, monitors=monitors)
    _train(guard, model, token_batches(11))
    guard.close()
    key = "stability/monitors/attn_logit_max/model.layers.0.self_attn"
    with_monitors = [row["step"] for row in _rows(tmp_path / "run.jsonl") if key in row]
    assert with_monitors == [0, 6, 10]  # sampled at 0, 5, 10; step 5's values read at step 6


def test_only_the_configured_precursors_feed_the_spike_detector() -> None:
    model = tiny_gpt2()
    guard = _guard(model, log_every_n_steps=1, monitors=sk.MonitorConfig(precursors=["attn_logit_max"]))
    _train(guard, model, token_batches(3))
    spikes = guard.engines[0].ledger.spikes
    assert spikes is not None
    assert sorted(spikes.trends) == [
        "monitors/attn_logit_max/transformer.h.0.attn",
        "monitors/attn_logit_max/transformer.h.1.attn",
    ]


def test_modules_by_glob_and_close_removes_every_hook() -> None:
    model = tiny_llama()
    guard = _guard(model, monitors=sk.MonitorConfig(modules=["model.layers.*.mlp"], attention=False, logits=False))
    monitor = guard.engines[0].monitor
    assert monitor is not None
    assert monitor.hooked_modules == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.0", "model.layers.1"]
    guard.close()
    hooked = [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == []


def test_a_compiled_model_does_not_recompile_every_step() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    compiled = torch.compile(model, backend="eager")
    guard = _guard(compiled, log_every_n_steps=3)
    graphs = []
    for batch in token_batches(10):
        guard.backward(compiled(**batch).loss)
        guard.step()
        guard.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    # one graph for the sampled variant (step 0), one for the unsampled one (step 1), none after
    assert graphs == [1] + [2] * 9, graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    metrics = guard.engines[0].readout.last_host_metrics
    assert metrics["stability/monitors/attn_logit_max/model.layers.0.self_attn"] > 0  # step 9 was measured
    torch._dynamo.reset()


def test_growing_attention_logits_raise_a_spike_warning_naming_the_module() -> None:
    model = tiny_llama()
    warnings: list[sk.Event] = []
    guard = _guard(model, log_every_n_steps=1, lr=1e-5)  # training barely moves the weights
    guard.hooks.on("spike_warning", warnings.append)
    target = model.model.layers[1].self_attn.q_proj.weight
    batches = token_batches(4)
    for step in range(150):  # the trend warns at 4x over its long-run level: about 60 steps of 4% growth
        if step >= 60:
            with torch.no_grad():
                target.mul_(1.04)  # the queries of one layer grow 4% a step: its logits grow with them
        _train(guard, model, [batches[step % 4]])
    signal = "monitors/attn_logit_max/model.layers.1.self_attn"
    named = [e for e in warnings if e.details.get("signal") == signal]
    assert named, [e.message for e in warnings]
    assert "model.layers.1.self_attn" in named[0].message and "attn_logit_max" in named[0].message
    assert all(e.step > 60 for e in named)


def test_lightning_callback_logs_monitor_metrics(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from lightning_hf import HFModule, hf_dataloader

    from stabilitykit.lightning import StabilityCallback

    cfg = sk.StabilityConfig(log_every_n_steps=2, monitors=sk.MonitorConfig())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=CSVLogger(tmp_path, name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        callbacks=[StabilityCallback(cfg)],
    )
    module = HFModule(kind="llama", scheduler=None)
    trainer.fit(module, hf_dataloader(4))
    assert not [n for n, m in module.named_modules() if m._forward_hooks or m._forward_pre_hooks]  # removed
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    logged = {k for row in rows if row.get("stability/monitors/log_z/model.lm_head") for k, v in row.items() if v}
    assert [int(r["step"]) for r in rows if r.get("stability/monitors/log_z/model.lm_head")] == [1, 3]
    assert "stability/monitors/attn_logit_max/model.model.layers.0.self_attn" in logged
    assert "stability/monitors/log_z/model.lm_head" in logged
    assert "stability/monitors/resid_norm/model.model.layers.1" in logged


def test_hf_trainer_callback_logs_monitor_metrics(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from stabilitykit.integrations import stabilize

    rows = [{k: v[0] for k, v in batch.items()} for batch in token_batches(32, batch_size=1, seed=3)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = tiny_gpt2()
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    stabilize(trainer, sk.StabilityConfig(monitors=sk.MonitorConfig()))
    trainer.train()
    assert not [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]  # removed
    logged = [row for row in trainer.state.log_history if "stability/grad_norm/total" in row]
    assert logged
    assert _keys(GPT2_SIGNALS) <= set(logged[-1]), set(logged[-1])


def test_report_draws_the_monitor_panel_and_the_dashboard_charts_the_signals(tmp_path: Path) -> None:
    from stabilitykit.cli import main
    from stabilitykit.report_plot import load_run_log, report_figure

    model = tiny_llama()
    guard = _guard(model, [sk.sinks.JsonlSink(tmp_path / "run.jsonl")], log_every_n_steps=2)
    _train(guard, model, token_batches(8))
    guard.close()
    run = load_run_log(tmp_path / "run.jsonl")
    assert sorted(run.monitors) == [
        "monitors/attn_logit_max/model.layers.0.self_attn",
        "monitors/attn_logit_max/model.layers.1.self_attn",
        "monitors/log_z/lm_head",
        "monitors/logits_max/lm_head",
    ]
    fig = report_figure(run)
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("precursors on sampled steps"))
    labels = {line.get_label() for line in panel.get_lines()}
    assert "max attention logit: model.layers.1.self_attn" in labels and "log Z (mean): lm_head" in labels
    assert main(["report", str(tmp_path / "run.jsonl"), "-o", str(tmp_path / "report.png")]) == 0

    pytest.importorskip("wandb_workspaces")
    workspace = sk.wandb_dashboard("team", "project", monitors=True)
    section = workspace.sections[-1]
    assert section.name == "monitors"
    regexes = [p.metric_regex for p in section.panels if p.metric_regex]
    assert "^stability/monitors/attn_logit_max/.*" in regexes and "^stability/monitors/log_z/.*" in regexes
    assert [s.name for s in sk.wandb_dashboard("team", "project").sections][-1] == "update ratio"


def test_the_example_warns_on_the_runaway_layer_before_the_loss_moves(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "monitors.py"
    spec = importlib.util.spec_from_file_location("monitors_example", path)
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--out", str(tmp_path)])
    assert [signal for _, signal in result["warnings"]] == ["monitors/attn_logit_max/model.layers.1.self_attn"]
    assert result["max_logit"][1] > 5 * result["max_logit"][0]


def test_device_statistics_against_plain_torch() -> None:
    from stabilitykit.monitors.attention import sdpa_max_logit
    from stabilitykit.monitors.stats import activation_stats, logit_stats

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, generator=gen)
    rms, top, norm = activation_stats(x)
    assert float(rms) == pytest.approx(float(x.square().mean().sqrt()), rel=1e-6)
    assert float(top) == float(x.abs().max())
    assert float(norm) == pytest.approx(float(x.norm(dim=-1).mean()), rel=1e-6)
    logits = torch.randn(2, 600, 11, generator=gen) * 3
    top, log_z = logit_stats(logits)
    assert float(top) == float(logits.abs().max())
    assert float(log_z) == pytest.approx(float(torch.logsumexp(logits, -1).mean()), rel=1e-6)
    _, sampled = logit_stats(logits, positions=100)  # 100 positions spread over all 1200, both sequences
    rows = logits.reshape(-1, 11)[[(i * 1199) // 99 for i in range(100)]]
    assert float(sampled) == pytest.approx(float(torch.logsumexp(rows, -1).mean()), rel=1e-6)
    q, k = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)  # grouped-query
    full = (q @ k.repeat_interleave(2, dim=1).transpose(-2, -1)) * 0.3
    assert float(sdpa_max_logit(q, k, scale=0.3, enable_gqa=True)) == pytest.approx(float(full.max()), rel=1e-6)
    causal = full.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -torch.inf)
    value = sdpa_max_logit(q, k, is_causal=True, scale=0.3, enable_gqa=True)
    assert float(value) == pytest.approx(float(causal.max()), rel=1e-6)


def test_a_user_written_attention_with_a_fused_qkv_is_probed_too() -> None:
    model = sk.testing.tiny_gpt(n_layer=2, n_embd=32, n_head=4)  # CausalSelfAttention: a fused qkv, no HF
    captured: dict[int, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        block.attn.qkv.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out.detach()))
    guard = _guard(model, log_every_n_steps=1, spikes=sk.SpikeConfig(enabled=False))
    x, y = next(sk.testing.char_batches(batch_size=4, block_size=16))
    guard.backward(model.loss(x, y))
    guard.step()
    metrics = guard.engine.readout.last_host_metrics
    for i, qkv in captured.items():
        q, k, _ = (z.unflatten(-1, (4, 8)).transpose(1, 2) for z in qkv.split(32, dim=-1))
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(8)
        reference = logits.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -torch.inf).max()
        value = metrics[f"stability/monitors/attn_logit_max/blocks.{i}.attn"]
        assert value == pytest.approx(float(reference), rel=1e-5)
    assert "stability/monitors/resid_norm/blocks.1" in metrics and "stability/monitors/log_z/lm_head" in metrics
    own = sk.testing.tiny_gpt(n_layer=2, n_embd=32, n_head=4, qk_norm=True)  # QKNormAttention measures itself
    monitor = _guard(own).engine.monitor
    assert monitor is not None and monitor.capture is not None
    assert not [n for n in monitor.capture.names if n.endswith(".attn")]


def test_sampling_more_often_than_logging_keeps_the_running_max_on_the_device() -> None:
    model = tiny_llama()
    model.set_attn_implementation("sk_reference_eager")
    guard = _guard(model, log_every_n_steps=3, monitors=sk.MonitorConfig(every=1))
    seen: list[float] = []
    for step, batch in enumerate(token_batches(7, seed=2)):
        REFERENCE.clear()
        with count_host_syncs() as counter:
            _train(guard, model, [batch])
        seen.append(REFERENCE[1])
        ours = counter.library_sites()  # the reference itself syncs
        assert len(ours) == (1 if step % 3 == 0 else 0)  # sampled every step, read on logging steps only
        if step % 3 == 0:
            value = guard.engine.readout.last_host_metrics["stability/monitors/attn_logit_max/model.layers.1.self_attn"]
            assert value == pytest.approx(max(seen), rel=1e-5)  # the max over the steps since the last read
            seen = []


def test_two_optimizers_hook_the_model_once() -> None:
    model = tiny_gpt2()
    blocks = [p for n, p in model.named_parameters() if n.startswith("transformer.h.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("transformer.h.")]
    optimizers = [torch.optim.AdamW(blocks, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)]
    cfg = sk.StabilityConfig(log_every_n_steps=1, monitors=sk.MonitorConfig())
    guard = sk.StabilityGuard(model, optimizers, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
    assert [engine.monitor is not None for engine in guard.engines] == [True, False]
    assert len(model.transformer.h[0]._forward_hooks) == 1


@pytest.mark.parametrize(("every", "accumulation"), [(2, 1), (None, 2)], ids=["every_2_log_4", "accumulate_2"])
def test_a_compiled_model_keeps_two_graphs_with_values_waiting_between_reads(
    every: int | None, accumulation: int
) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    compiled = torch.compile(model, backend="eager")
    guard = _guard(compiled, log_every_n_steps=4, monitors=sk.MonitorConfig(every=every))
    batches = token_batches(8 * accumulation)
    for step in range(8):
        for micro in range(accumulation):
            guard.backward(compiled(**batches[step * accumulation + micro]).loss / accumulation)
        guard.step()
        guard.zero_grad()
    # a sampled and an unsampled variant, whether values of earlier forward passes wait or not
    assert counters["stats"]["unique_graphs"] == 2
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert guard.engines[0].readout.last_host_metrics["stability/monitors/attn_logit_max/model.layers.0.self_attn"] > 0
    torch._dynamo.reset()


def test_log_z_positions_are_spread_over_the_whole_batch_and_skip_padding() -> None:
    from stabilitykit.monitors.stats import logit_stats

    logits = torch.zeros(8, 48, 16)  # 384 positions, 256 kept: every sequence must be read
    logits[6:] = 5.0  # sequences 6 and 7 alone have a larger log Z
    _, log_z = logit_stats(logits, positions=256)
    rows = torch.tensor([(i * 383) // 255 for i in range(256)])
    reference = torch.logsumexp(logits.reshape(-1, 16)[rows], -1).mean()
    assert float(log_z) == pytest.approx(float(reference), rel=1e-6)
    assert (rows >= 6 * 48).sum() > 60  # about a quarter of the kept positions are in sequences 6 and 7
    mask = torch.ones(8, 48)
    mask[0, :40] = 0  # left padding
    logits[0, :40] = 50.0  # what a pad position may hold
    top, log_z = logit_stats(logits, positions=None, mask=mask)
    real = logits[mask.bool()]
    assert float(top) == float(real.abs().max())
    assert float(log_z) == pytest.approx(float(torch.logsumexp(real, -1).mean()), rel=1e-6)
