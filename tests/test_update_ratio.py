"""The update-to-weight ratio ``||Δw|| / ||w||``: logged values against a hand computation (weights
copied before the step, norms after), through StabilityGuard and a real Lightning Trainer, read back
from real JSONL logs and real offline W&B runs; a skipped step's update is exactly 0; host syncs
counted; the report and the dashboard show it; 2 gloo processes (DDP, FSDP2, FSDP1) match one process."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import stabilitykit as sk
from stabilitykit.cli import main
from stabilitykit.report_plot import load_run_log, report_figure
from stabilitykit.sinks import JsonlSink, WandbRunFile, WandbSink, read_jsonl
from stabilitykit.testing.syncs import count_host_syncs
from tests.conftest import batches
from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

PREFIX = "stability"
RTOL = 1e-5

Weights = dict[str, torch.Tensor]


def _weights(model: torch.nn.Module) -> Weights:
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def _tiny_gpt_layer(name: str) -> str:
    """The layer of a tiny-GPT parameter, by the naming rule the docs give (blocks are layers)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def _lightning_layer(name: str) -> str:
    parts = name.split(".")  # "model.blocks.0.attn.qkv.weight": the LightningModule holds the GPT as .model
    return ".".join(parts[:3]) if parts[1] == "blocks" else ".".join(parts[:2])


def hand_metrics(before: Weights, after: Weights, layer_of: Callable[[str], str]) -> dict[str, float]:
    """``update_ratio`` and ``weight_norm``, total and per layer, in float64 from two copies of the weights."""
    update: dict[str, float] = {}
    weight: dict[str, float] = {}
    for name, w in after.items():
        layer = layer_of(name)
        update[layer] = update.get(layer, 0.0) + float((w - before[name]).square().sum())
        weight[layer] = weight.get(layer, 0.0) + float(w.square().sum())

    def ratio(u: float, w: float) -> float:
        return 0.0 if u == 0 else math.sqrt(u) / math.sqrt(w)

    out = {
        "update_ratio": ratio(sum(update.values()), sum(weight.values())),
        "weight_norm": math.sqrt(sum(weight.values())),
    }
    for layer in update:
        out[f"update_ratio/{layer}"] = ratio(update[layer], weight[layer])
        out[f"weight_norm/{layer}"] = math.sqrt(weight[layer])
    return out


def _logged(row: dict[str, Any]) -> dict[str, float]:
    head = f"{PREFIX}/"
    return {k[len(head) :]: v for k, v in row.items() if k.startswith((f"{head}update_ratio", f"{head}weight_norm"))}


def assert_matches(got: dict[str, float], want: dict[str, float], where: str) -> None:
    assert got.keys() == want.keys(), f"{where}: {sorted(got.keys() ^ want.keys())}"
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=RTOL, abs_tol=0.0), (
            f"{where} {key}: logged {got[key]}, hand {value}"
        )


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, fused=True),
}


def _guarded_run(
    opt_name: str,
    log: Path,
    every: int,
    steps: int,
    poison: dict[int, float],
    sinks: list[Any] | None = None,
    **grad: Any,
) -> tuple[dict[int, dict[str, float]], sk.StabilityGuard]:
    """Train a tiny GPT under the guard; the hand metrics of every step's update, by step."""
    model = sk.testing.tiny_gpt()
    opt = OPTIMIZERS[opt_name](model.parameters())
    cfg = sk.StabilityConfig(log_every_n_steps=every, grad_norm=sk.GradNormConfig(update_ratio=True, **grad))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[JsonlSink(log), *(sinks or [])])
    hand: dict[int, dict[str, float]] = {}
    for i, (x, y) in enumerate(batches(steps)):
        guard.backward(model.loss(x, y) * poison.get(i, 1.0))
        before = _weights(model)
        guard.step()
        hand[i] = hand_metrics(before, _weights(model), _tiny_gpt_layer)
        guard.zero_grad()
    guard.close()
    return hand, guard


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_guard_logs_the_update_of_the_step_before_each_logging_step(tmp_path: Path, opt_name: str) -> None:
    log = tmp_path / "run.jsonl"
    hand, guard = _guarded_run(opt_name, log, every=3, steps=10, poison={5: math.nan})
    assert guard.skipped_total == 1
    rows, _ = read_jsonl(log)
    logged = {r["step"]: _logged(r) for r in rows}
    assert list(logged) == [0, 3, 6, 9]
    assert logged[0] == {}  # no step before step 0
    for step in (3, 6, 9):
        assert_matches(logged[step], hand[step - 1], f"{opt_name} step {step}")
    assert logged[3]["update_ratio"] > 1e-5
    skipped = logged[6]  # step 5 was skipped: its update is exactly 0, its weights are those of step 4
    assert {k: v for k, v in skipped.items() if k.startswith("update_ratio")} == dict.fromkeys(
        [k for k in skipped if k.startswith("update_ratio")], 0.0
    )
    assert skipped["weight_norm"] > 0


def test_every_step_with_log_every_1_and_the_layer_filters(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    hand, _ = _guarded_run("adamw-fused", log, every=1, steps=5, poison={2: math.inf}, exclude=[r"^blocks\.[12]$"])
    rows, _ = read_jsonl(log)
    logged = {r["step"]: _logged(r) for r in rows}
    for step in range(1, 5):
        want = {k: v for k, v in hand[step - 1].items() if not k.endswith(("blocks.1", "blocks.2"))}
        assert_matches(logged[step], want, f"step {step}")  # the totals still count the filtered layers
    assert logged[3]["update_ratio"] == 0.0 and logged[4]["update_ratio"] > 0


def test_without_per_layer_only_the_totals(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    hand, _ = _guarded_run("sgd-foreach", log, every=2, steps=5, poison={}, per_layer=False)
    rows, _ = read_jsonl(log)
    for row in rows[1:]:
        want = {k: hand[row["step"] - 1][k] for k in ("update_ratio", "weight_norm")}
        assert_matches(_logged(row), want, f"step {row['step']}")


def test_off_by_default_and_no_keys(tmp_path: Path) -> None:
    assert sk.GradNormConfig().update_ratio is False
    model = sk.testing.tiny_gpt()
    guard = sk.StabilityGuard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sk.StabilityConfig(log_every_n_steps=1)
    )
    assert guard.engine.updates is None
    for x, y in batches(2):
        guard.backward(model.loss(x, y))
        guard.step()
    assert not _logged(guard.engine.readout.last_host_metrics)


def test_fused_adamw_syncs_zero_off_logging_steps_one_on_with_the_update_ratio() -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=5, grad_norm=sk.GradNormConfig(update_ratio=True))
    guard = sk.StabilityGuard(model, opt, cfg)
    counts = []
    for i, (x, y) in enumerate(batches(16)):
        loss = model.loss(x, y) * (math.nan if i == 9 else 1.0)  # a skip on a measured step
        with count_host_syncs() as counter:
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        counts.append(counter.count)
    assert [counts[i] for i in (0, 5, 10, 15)] == [1, 1, 1, 1], counts
    assert all(counts[i] == 0 for i in range(16) if i % 5), counts  # measured steps 4, 9 and 14 included
    assert guard.engine.readout.last_host_metrics[f"{PREFIX}/update_ratio"] > 0
    assert guard.skipped_total == 1


def test_guard_to_an_offline_wandb_run(tmp_path: Path) -> None:
    import wandb

    run = wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline", reinit="create_new")
    hand, _ = _guarded_run("adamw-fused", tmp_path / "run.jsonl", every=4, steps=9, poison={}, sinks=[WandbSink(run)])
    run.finish()
    logged = WandbRunFile.read(Path(run.dir).parent)
    rows = [r for r in logged.history if f"{PREFIX}/grad_norm/total" in r]
    assert [r["trainer/global_step"] for r in rows] == [0, 4, 8]
    assert _logged(rows[0]) == {}
    for row in rows[1:]:
        step = row["trainer/global_step"]
        assert_matches(_logged(row), hand[step - 1], f"wandb step {step}")


class _Weights(pl.Callback):
    """The module's weights before each optimizer step and after it, by global step."""

    def __init__(self) -> None:
        self.before: dict[int, Weights] = {}
        self.after: dict[int, Weights] = {}

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.before[trainer.global_step] = _weights(module)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[trainer.global_step - 1] = _weights(module)


@pytest.mark.parametrize("fused", [True, False])
def test_lightning_trainer_jsonl_and_wandb_logger(tmp_path: Path, fused: bool) -> None:
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    logger = WandbLogger(project="stabilitykit-tests", save_dir=str(tmp_path), offline=True)
    cfg = sk.StabilityConfig(grad_norm=sk.GradNormConfig(update_ratio=True))
    callback = StabilityCallback(cfg, sinks=[JsonlSink(tmp_path / "run.jsonl")])
    weights = _Weights()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=10,
        log_every_n_steps=3,
        logger=logger,
        callbacks=[callback, weights],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(fused=fused, poison={4: math.nan}), gpt_dataloader(10))
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    hand = {s: hand_metrics(weights.before[s], weights.after[s], _lightning_layer) for s in weights.after}
    rows, _ = read_jsonl(tmp_path / "run.jsonl")
    from_wandb = [r for r in WandbRunFile.read(run_dir).history if f"{PREFIX}/grad_norm/total" in r]
    # Lightning's own logging rows (global steps 2, 5, 8 with log_every_n_steps=3)
    assert [r["step"] for r in rows] == [r["trainer/global_step"] for r in from_wandb] == [2, 5, 8]
    for row, wrow in zip(rows, from_wandb, strict=True):
        step = row["step"]
        assert_matches(_logged(row), hand[step - 1], f"jsonl step {step}")
        assert_matches(_logged(wrow), hand[step - 1], f"wandb step {step}")
    assert "update_ratio/model.blocks.0" in _logged(rows[0])
    assert _logged(rows[1])["update_ratio"] == 0.0 and hand[4]["update_ratio"] == 0.0  # step 4 was skipped


def test_report_draws_the_update_ratio_panel_and_old_logs_still_draw(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    _guarded_run("adamw-fused", log, every=2, steps=12, poison={7: math.nan})
    run = load_run_log(log)
    assert run.has_update_ratio and list(run.update_layers)[:2] == ["tok_emb", "pos_emb"]
    assert run.series("update_ratio")[0] == [2, 4, 6, 8, 10]  # step 8 holds the skipped step's 0
    fig = report_figure(run)
    titles = [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("update / weight ratio") for t in titles)
    panel = next(ax for ax in fig.axes if ax.get_title().startswith("update / weight ratio"))
    assert panel.get_yscale() == "log" and "total" in [t.get_text() for t in panel.get_legend().get_texts()]
    assert main(["report", str(log), "-o", str(tmp_path / "with.png")]) == 0
    assert (tmp_path / "with.png").stat().st_size > 30_000

    old = tmp_path / "old.jsonl"  # a log from before the feature: the picture keeps its panels
    old.write_text("".join(line + "\n" for line in log.read_text().splitlines() if "update_ratio" not in line))
    old_run = load_run_log(old)
    assert not old_run.has_update_ratio
    old_fig = report_figure(old_run)
    assert not any(ax.get_title().startswith("update / weight ratio") for ax in old_fig.axes)
    assert len(old_fig.axes) == len(fig.axes) - 1
    assert main(["report", str(old), "-o", str(tmp_path / "old.png")]) == 0


def test_dashboard_has_the_update_ratio_section() -> None:
    workspace = sk.wandb_dashboard("team", "project", layers=["blocks.0"])
    section = workspace.sections[-1]
    assert section.name == "update ratio"
    keys = [y for p in section.panels for y in (p.y or [])]
    assert keys == ["stability/update_ratio", "stability/weight_norm", "stability/update_ratio/blocks.0"]
    regexes = [p.metric_regex for p in section.panels if p.metric_regex]
    assert regexes == ["^stability/update_ratio/.*", "^stability/weight_norm/.*"]
    assert all(p.x == "trainer/global_step" for p in section.panels)


@waits_for("distributed_update_script")
def test_ddp_fsdp2_and_fsdp1_on_two_processes_match_one_process(tmp_path: Path) -> None:
    script = Path(__file__).parent / "distributed_update_script.py"
    ranks = run_world(script, 2, tmp_path, timeout=limit("distributed_update_script"))
    assert set(ranks[0]) == {"ddp|2.0", "fsdp2|2.0", "fsdp2|inf", "fsdp1-orig|2.0", "fsdp1-flat|2.0"}
    for case in ranks[0]:
        reference = ranks[0][case]["reference"]  # one process, by hand: metrics after steps 1, 3 (skipped), 5
        if case.startswith("fsdp1-flat"):  # flat parameters: a layer per FSDP unit, the root unit holds the head
            reference = [{k.replace("/head", "/root"): v for k, v in want.items()} for want in reference]
        for r, rank in enumerate(ranks):
            logged = rank[case]["logged"]
            assert [row["step"] for row in logged] == [2, 4, 6], case
            for row, want in zip(logged, reference, strict=True):
                got = row["metrics"]
                assert got.keys() == want.keys(), case
                for key, value in want.items():
                    assert math.isclose(got[key], value, rel_tol=1e-4), f"rank {r} {case} step {row['step']} {key}"
            assert all(v == 0.0 for k, v in logged[1]["metrics"].items() if k.startswith("update_ratio"))
        if case.startswith("fsdp1"):
            continue
        counts = [rank[case]["collectives"] for rank in ranks]  # all-reduces of the whole run
        assert counts[0] == counts[1], case
        if case.endswith("|2.0"):
            assert counts[0]["with"] == counts[0]["without"], f"{case}: the sums did not ride in the grad reduction"
        else:
            assert counts[0]["with"] == counts[0]["without"] + 3, case  # inf-norm: one SUM per measured step
