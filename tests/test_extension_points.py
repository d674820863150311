"""The public extension points in every driver, with the real frameworks: a user's skip rule
(``rules=[...]``) and a user's recorded metric (``sk.record`` / ``driver.record``).

The metric is recorded from inside the model (a forward hook on the HF model's ``lm_head``, as a
user records an MoE router statistic); the rule skips a step whose "quality" metric is low. Each
driver must skip exactly that step, bitwise (weights and optimizer state), name the rule in its
events and JSONL, log the metric at logging steps, and close the user's sinks when the run ends,
whether it finished or raised.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hf_models import tiny_llama, token_batches
from lightning_checks import StateAt
from lightning_hf import HFModule, hf_dataloader
from torch import Tensor

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.testing.syncs import count_host_syncs
from tests.conftest import assert_bitwise_equal, snapshot
from tests.custom_rules import QualityGate
from tests.time_limits import limit, waits_for

BAD_STEP = 3


class Quality:
    """Records ``quality`` (0 on the bad step, else 1) and the logits' max from the model's own output."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.step = 0
        self.handle = model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, out: Tensor) -> None:
        sk.record("quality", torch.tensor(0.0 if self.step == BAD_STEP else 1.0))
        sk.record("logit_max", out.detach().float().amax(), reduce="max")


class ClosingSink:
    """A sink that records what it got and whether it was closed."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.events: list[sk.Event] = []
        self.closed = 0

    def log_metrics(self, metrics: Any, step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def log_event(self, event: sk.Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed += 1


def _check_run(sink: ClosingSink, jsonl: Path, steps: int) -> None:
    skipped = [e for e in sink.events if e.kind == "skipped"]
    assert [(e.step, e.details["reason"]) for e in skipped] == [(BAD_STEP, "quality_gate")]
    assert "QualityGate" in skipped[0].details["rule"]
    # what tripped the rule: the values it read, as the step recorded them (not only on logging steps)
    assert skipped[0].details["inputs"] == {"quality": 0.0}
    assert "skipped: quality_gate (QualityGate flagged it) with quality=0" in skipped[0].message
    assert sink.closed == 1, "the driver closes the user's sinks once, at the end of the run"
    logged = [m for _, m in sink.rows if "stability/metrics/logit_max" in m]
    assert logged and all(m["stability/metrics/logit_max"] > 0 for m in logged)
    assert any(m.get("stability/metrics/quality") == 1.0 for m in logged)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    events = [r for r in lines if r.get("event") == "skipped"]
    assert [(r["step"], r["reason"], r["inputs"]) for r in events] == [(BAD_STEP, "quality_gate", {"quality": 0.0})]
    assert any("stability/metrics/logit_max" in r for r in lines)
    assert max(int(r["step"]) for r in lines) <= steps


# ---------------------------------------------------------------------------------- plain loop
def test_plain_guard_skips_on_a_custom_rule_bitwise_with_no_host_sync(tmp_path: Path) -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sink = ClosingSink()
    jsonl = tmp_path / "run.jsonl"
    cfg = sk.StabilityConfig(log_every_n_steps=4)
    quality = Quality(model)
    batches = token_batches(8, seed=1)
    with sk.StabilityGuard(model, opt, cfg, sinks=[sink, sk.sinks.JsonlSink(jsonl)], rules=[QualityGate()]) as guard:
        for step, batch in enumerate(batches):
            quality.step = step
            before = snapshot(model, opt) if step == BAD_STEP else None
            if step in (5, 6):  # ordinary steps: no host sync, with the rule and the metrics on
                with count_host_syncs() as syncs:
                    guard.backward(model(**batch).loss)
                    guard.step()
                assert syncs.count == 0, syncs.sites
            else:
                guard.backward(model(**batch).loss)
                guard.step()
            guard.zero_grad()
            if before is not None:
                assert_bitwise_equal(before, snapshot(model, opt))
    _check_run(sink, jsonl, 8)
    assert guard.summary().skipped == 1


def test_a_rule_that_reads_a_missing_value_or_returns_a_python_bool_is_named() -> None:
    class Wrong(sk.SkipRule):
        name = "wrong"

        def flag(self, values: sk.StepValues) -> Tensor:
            return values["not_recorded"] > 0

    class Host(sk.SkipRule):
        name = "host"

        def flag(self, values: sk.StepValues) -> Tensor:
            return False  # type: ignore[return-value]

    model = torch.nn.Linear(4, 2)
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), rules=[Wrong()])
    guard.backward(model(torch.randn(3, 4)).sum())
    with pytest.raises(KeyError, match=r"no step value named 'not_recorded'.*grad_norm"):
        guard.step()
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), rules=[Host()])
    guard.backward(model(torch.randn(3, 4)).sum())
    with pytest.raises(TypeError, match=r"skip rule 'host'.*0-d bool tensor"):
        guard.step()
    with pytest.raises(ValueError, match="two skip rules are named 'host'"):
        sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), rules=[Host(), Host()])
    with pytest.raises(TypeError, match=r"must subclass stabilitykit\.SkipRule"):
        sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), rules=[object()])  # type: ignore[list-item]


def test_a_metric_first_recorded_after_the_first_step_is_refused_by_name() -> None:
    model = torch.nn.Linear(4, 2)
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard.record("a", torch.tensor(1.0))
    guard.backward(model(torch.randn(3, 4)).sum())
    guard.step()
    with pytest.raises(ValueError, match="metric 'late' was first recorded at step 1"):
        guard.record("late", torch.tensor(1.0))
    with pytest.raises(ValueError, match="reduce must be one of"):
        guard.record("a", torch.tensor(1.0), reduce="median")
    guard.backward(model(torch.randn(3, 4)).sum())  # "a" not recorded this step: NaN, the step goes on
    assert not bool(guard.step().skipped)


def test_a_rules_state_and_the_recorded_layout_survive_a_resume() -> None:
    class Counting(sk.SkipRule):
        name = "every_third"

        def __init__(self) -> None:
            self.seen = torch.zeros((), dtype=torch.long)

        def flag(self, values: sk.StepValues) -> Tensor:
            self.seen = self.seen + 1
            return self.seen % 3 == 0

        def state_dict(self) -> dict[str, Any]:
            return {"seen": self.seen.clone()}

        def load_state_dict(self, state: Any) -> None:
            self.seen = state["seen"].clone()

    def run(resume_at: int | None) -> list[bool]:
        model = torch.nn.Linear(4, 2)
        torch.manual_seed(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = sk.StabilityGuard(model, opt, rules=[Counting()])
        skipped = []
        for i in range(7):
            if i == resume_at:
                state = copy.deepcopy(guard.state_dict())
                guard.close()
                guard = sk.StabilityGuard(model, opt, rules=[Counting()])
                guard.load_state_dict(state)
            guard.record("x", torch.tensor(float(i)), reduce="sum")
            guard.backward(model(torch.ones(2, 4)).sum())
            skipped.append(bool(guard.step().skipped))
            guard.zero_grad()
        return skipped

    assert run(None) == run(4) == [False, False, True, False, False, True, False]


# ---------------------------------------------------------------------------------- Lightning
class QualityModule(HFModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__(kind="llama", scheduler="lambda", fail_at=fail_at)
        self.quality = Quality(self.model)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.quality.step = self.global_step
        return super().training_step(batch, batch_idx)


def _lightning(tmp_path: Path, callbacks: list[Any], steps: int = 6) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=2,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )


def test_lightning_callback_runs_a_custom_rule_and_logs_a_recorded_metric(tmp_path: Path) -> None:
    sink, jsonl = ClosingSink(), tmp_path / "run.jsonl"
    callback = StabilityCallback(sk.StabilityConfig(), sinks=[sink, sk.sinks.JsonlSink(jsonl)], rules=[QualityGate()])
    state = StateAt(BAD_STEP)
    _lightning(tmp_path, [callback, state]).fit(QualityModule(), hf_dataloader(8))
    state.assert_unchanged()
    _check_run(sink, jsonl, 6)
    assert callback.summary().skipped == 1


def test_lightning_closes_the_sinks_when_the_fit_raises(tmp_path: Path) -> None:
    sink = ClosingSink()
    callback = StabilityCallback(sk.StabilityConfig(), sinks=[sink], rules=[QualityGate()])
    module = QualityModule(fail_at=4)
    with pytest.raises(RuntimeError, match="injected failure"):
        _lightning(tmp_path, [callback]).fit(module, hf_dataloader(8))
    assert sink.closed == 1


# ---------------------------------------------------------------------------------- HF Trainer
def _hf_dataset(n: int = 48) -> list[dict[str, Tensor]]:
    return [{k: v[0] for k, v in b.items()} for b in token_batches(n, batch_size=1, seed=3)]


def _hf_trainer(tmp_path: Path, model: torch.nn.Module, callbacks: list[Any], steps: int = 6) -> Any:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_grad_norm=0.0,
    )
    return Trainer(model=model, args=args, train_dataset=_hf_dataset(), callbacks=callbacks)


def test_hf_trainer_runs_a_custom_rule_and_logs_a_recorded_metric(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from stabilitykit.integrations import stabilize

    model = tiny_llama()
    quality = Quality(model)
    seen: dict[str, Any] = {}

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            quality.step = state.global_step
            if state.global_step == BAD_STEP:
                seen["before"] = snapshot(model, optimizer)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == BAD_STEP + 1:
                seen["after"] = snapshot(model, optimizer)

    trainer = _hf_trainer(tmp_path, model, [Steps()])
    sink, jsonl = ClosingSink(), tmp_path / "run.jsonl"
    callback = stabilize(trainer, sk.StabilityConfig(), sinks=[sink, sk.sinks.JsonlSink(jsonl)], rules=[QualityGate()])
    trainer.train()
    assert_bitwise_equal(seen["before"], seen["after"])
    _check_run(sink, jsonl, 6)
    assert callback.summary().skipped == 1


def test_hf_trainer_closes_the_sinks_when_training_raises(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    from stabilitykit.integrations import stabilize

    class Fail(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == 2:
                raise RuntimeError("injected failure")

    model = tiny_llama()
    trainer = _hf_trainer(tmp_path, model, [Fail()])
    sink = ClosingSink()
    callback = stabilize(trainer, sk.StabilityConfig(), sinks=[sink])
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train()
    assert sink.closed == 1
    assert callback.engine is not None
    assert "log" not in vars(trainer), "the Trainer's log is its class's again (every route undone)"


# ---------------------------------------------------------------------------------- Accelerate, Fabric


def test_accelerate_guard_runs_a_custom_rule_and_logs_a_recorded_metric(tmp_path: Path, fresh_accelerate: None) -> None:
    from accelerate import Accelerator

    from stabilitykit.integrations import AccelerateGuard

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_llama()
    quality = Quality(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    sink, jsonl = ClosingSink(), tmp_path / "run.jsonl"
    cfg = sk.StabilityConfig(log_every_n_steps=2)
    with AccelerateGuard(
        accelerator, model, opt, cfg, sinks=[sink, sk.sinks.JsonlSink(jsonl)], rules=[QualityGate()]
    ) as guard:
        for i, batch in enumerate(token_batches(12, seed=2)):
            step = i // 2
            quality.step = step
            if i % 2 == 0 and step == BAD_STEP:
                before = snapshot(model, opt.optimizer)
            with accelerator.accumulate(model):
                guard.backward(model(**batch).loss)
                guard.step()
                guard.zero_grad()
            if i % 2 == 1 and step == BAD_STEP:
                assert_bitwise_equal(before, snapshot(model, opt.optimizer))
    _check_run(sink, jsonl, 6)


def test_fabric_guard_runs_a_custom_rule_and_logs_a_recorded_metric(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    from stabilitykit.integrations import FabricGuard

    fabric = Fabric(accelerator="cpu", devices=1)
    model = tiny_llama()
    quality = Quality(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    sink, jsonl = ClosingSink(), tmp_path / "run.jsonl"
    with FabricGuard(
        fabric,
        model,
        opt,
        sk.StabilityConfig(log_every_n_steps=2),
        sinks=[sink, sk.sinks.JsonlSink(jsonl)],
        rules=[QualityGate()],
    ) as guard:
        for step, batch in enumerate(token_batches(6, seed=2)):
            quality.step = step
            before = snapshot(model, opt.optimizer) if step == BAD_STEP else None
            guard.backward(model(**batch).loss)
            guard.step()
            guard.zero_grad()
            if before is not None:
                assert_bitwise_equal(before, snapshot(model, opt.optimizer))
    _check_run(sink, jsonl, 6)


def test_a_guard_closed_by_an_exception_in_its_block_closes_its_sinks_and_unroutes() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = ClosingSink()
    with pytest.raises(RuntimeError, match="boom"), sk.StabilityGuard(model, opt, sinks=[sink]) as guard:
        guard.backward(model(torch.randn(3, 4)).sum())
        guard.step()
        raise RuntimeError("boom")
    assert sink.closed == 1
    assert "step" not in vars(opt), "optimizer.step is the class's again"
    with pytest.raises(RuntimeError, match=r"guard.step\(\) after guard.close\(\)"):
        guard.step()


# ---------------------------------------------------------------------------------- DDP, 2 processes
@pytest.mark.parametrize(
    ("driver", "max_only"),
    [("guard", False), ("guard", True), ("accelerate", False)],
    ids=["guard-gathered", "guard-max-all-reduce", "accelerate-gathered"],
)
@waits_for("distributed_extension_script")
def test_ddp_a_rule_raised_on_one_rank_skips_every_rank_and_metrics_are_agreed(
    tmp_path: Path, driver: str, max_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distributed_script_runner import run_world

    monkeypatch.setenv("SK_REDUCE_MAX_ONLY", "1" if max_only else "0")
    monkeypatch.setenv("SK_DRIVER", driver)
    script = Path(__file__).parent / "distributed_extension_script.py"
    ranks = run_world(script, 2, tmp_path, timeout=limit("distributed_extension_script"))
    for result in ranks:
        assert [tuple(e) for e in result["skipped"]] == [(BAD_STEP, "skipped", "quality_gate")], result["skipped"]
        assert result["unchanged"], "a skipped step changed the parameters"
    assert ranks[0]["checksum"] == ranks[1]["checksum"], "the replicas stay identical"
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    metrics = ranks[0]["metrics"]
    assert metrics["stability/metrics/rank_id_max"] == 2.0
    if not max_only:
        assert metrics["stability/metrics/rank_id_mean"] == 1.5
        assert metrics["stability/metrics/rank_id_sum"] == 3.0
        assert metrics["stability/metrics/quality"] == 1.0
    if driver == "guard" and not max_only:
        _check_ddp_router_values([r["routers"] for r in ranks])


def _router_sums(logits: list[list[float]], mask: list[list[int]]) -> tuple[Tensor, float, float, float]:
    """(tokens per expert, tokens, entropy sum, z sum) of one rank's router logits (top-2, padding left out)."""
    rows = torch.tensor(logits)
    weights = torch.tensor(mask, dtype=torch.float32).reshape(-1)
    counts = torch.zeros(rows.shape[-1])
    counts.index_add_(0, rows.topk(2, dim=-1).indices.reshape(-1), weights.repeat_interleave(2))
    p = rows.softmax(-1)
    entropy = -(p * p.log()).sum(-1) / math.log(rows.shape[-1])
    z = rows.logsumexp(-1) ** 2
    return counts, float(weights.sum()), float((entropy * weights).sum()), float((z * weights).sum())


def _router_values(counts: Tensor, tokens: float, entropy: float, z: float) -> dict[str, float]:
    return {
        "expert_load_max": float(counts.max() * counts.numel() / counts.sum()),
        "experts_dead": float((counts == 0).float().mean()),
        "router_entropy": entropy / tokens,
        "router_z": z / tokens,
    }


def _check_ddp_router_values(ranks: list[dict[str, Any]]) -> None:
    """Router values under DDP on 2 ranks with different batches: the global values (counts summed across
    ranks) on both ranks by default; each rank's own with ``across_ranks=False``; and the two differ."""
    names = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    for layer, name in enumerate(names):
        own = [_router_sums(r["True"]["router_logits"][layer], r["True"]["mask"]) for r in ranks]
        summed = _router_values(own[0][0] + own[1][0], *(a + b for a, b in zip(own[0][1:], own[1][1:], strict=True)))
        for rank, result in enumerate(ranks):
            for setting, expected in (("True", summed), ("False", _router_values(*own[rank]))):
                logged = result[setting]["logged"]
                for signal, value in expected.items():
                    got = logged[f"stability/monitors/{signal}/{name}"]
                    assert got == pytest.approx(value, abs=1e-4), (rank, setting, signal, name, got, value)
    # the cell tells them apart: some expert idle on a rank is fed on the other
    dead = [[r[s]["logged"][f"stability/monitors/experts_dead/{names[0]}"] for s in ("True", "False")] for r in ranks]
    assert any(own > summed for summed, own in dead), dead


def test_sk_record_feeds_the_run_started_last_and_a_closed_one_no_more() -> None:
    """A guard left open (still referenced) never receives another run's metrics through sk.record."""
    a_model, b_model = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    a = sk.StabilityGuard(
        a_model, torch.optim.SGD(a_model.parameters(), lr=0.1), sk.StabilityConfig(log_every_n_steps=1)
    )
    a.backward(a_model(torch.randn(3, 4)).sum())
    a.step()  # a's layout is fixed, with no metrics
    rows: list[dict[str, float]] = []

    class Rows:
        def log_metrics(self, metrics: Any, step: int) -> None:
            rows.append(dict(metrics))

    cfg = sk.StabilityConfig(log_every_n_steps=1)
    with sk.StabilityGuard(b_model, torch.optim.SGD(b_model.parameters(), lr=0.1), cfg, sinks=[Rows()]) as b:
        sk.record("only_b", torch.tensor(2.0))
        b.backward(b_model(torch.randn(3, 4)).sum())
        b.step()
    assert rows[0]["stability/metrics/only_b"] == 2.0
    a.backward(a_model(torch.randn(3, 4)).sum())
    a.step()  # a never saw "only_b": no error about a metric first recorded late
    a.close()
    sk.record("after_every_run", torch.tensor(1.0))  # no running driver: nothing happens
