"""Rerun in one process: verdicts, the random state, the record, the limits; fault injection; fingerprints.

The distributed cells (faults on rank 1 only, DDP and HSDP) are in ``test_rerun_distributed.py``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk
from stabilitykit.replicas import fingerprint
from stabilitykit.testing import flip_bit, inject_fault

STEPS, FAULT_STEP = 10, 4


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(STEPS)]


def _train(
    fault: dict[str, Any] | None = None, record: Path | None = None, huge: bool = False, **rerun: Any
) -> dict[str, Any]:
    torch.manual_seed(0)  # dropout and batch norm: the recomputation must start from the step's random state
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # FAULT_STEP is a logging step: re-run after the logging read (non-logging steps: the distributed cells)
    cfg = sk.StabilityConfig(log_every_n_steps=2, rerun=sk.RerunConfig(record_path=record and str(record), **rerun))
    events: list[sk.Event] = []
    fired = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with sk.StabilityGuard(model, opt, cfg) as guard:
            guard.hooks.on("*", events.append)
            injected = inject_fault(model, **fault) if fault else None
            skipped = []
            for step, (x, y) in enumerate(_data()):
                if huge and step == FAULT_STEP:
                    x = x * 3e38

                def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    return nn.functional.cross_entropy(model(x), y)

                guard.backward(loss_of())
                if guard.step(replay=loss_of).skipped:
                    skipped.append(step)
                guard.zero_grad()
            fired = injected.fired if injected is not None else None
    return {
        "state": [t.clone() for t in model.state_dict().values()],
        "reruns": [e for e in events if e.kind == "rerun"],
        "skipped": skipped,
        "fired": fired,
    }


@pytest.fixture(scope="module")
def clean() -> dict[str, Any]:
    return _train()


def _bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["state"], b["state"], strict=True))


@pytest.mark.parametrize("kind", ["nan", "bitflip"])
def test_a_one_time_fault_is_transient_and_the_recomputed_step_ends_bitwise_clean(clean: dict, kind: str) -> None:
    """The fault hits the logits once (a NaN, or the exponent's top bit of a value in [1, 2): Inf/NaN)."""
    fault = {"target": "activation", "name": "4", "step": FAULT_STEP, "kind": kind}
    if kind == "bitflip":
        fault = {**fault, "kind": "value", "value": math.inf}
    run = _train(fault)
    assert [(e.step, e.details["verdict"], e.details["rank"]) for e in run["reruns"]] == [(FAULT_STEP, "transient", 0)]
    assert run["skipped"] == []
    assert run["fired"] == 1
    assert _bitwise(run, clean)  # weights and batch-norm statistics: dropout drew the same masks again


def test_a_fault_every_time_the_batch_is_computed_is_reproducible_and_skipped(clean: dict, tmp_path: Path) -> None:
    fault = {"target": "grad", "name": "4.weight", "step": FAULT_STEP, "kind": "nan", "repeat": True}
    run = _train(fault, record=tmp_path / "rerun.jsonl")
    assert [(e.step, e.details["verdict"], e.details["rank"]) for e in run["reruns"]] == [
        (FAULT_STEP, "reproducible", None)
    ]
    assert run["skipped"] == [FAULT_STEP]
    assert run["fired"] == 2  # the first pass and the recomputation
    line = json.loads((tmp_path / "rerun.jsonl").read_text())
    assert (line["step"], line["batch"], line["verdict"]) == (FAULT_STEP, FAULT_STEP, "reproducible")


def test_a_run_started_again_with_the_record_skips_the_known_bad_batch_without_a_rerun(tmp_path: Path) -> None:
    record = tmp_path / "rerun.jsonl"
    first = _train(huge=True, record=record)
    assert first["skipped"] == [FAULT_STEP]
    assert [e.details["verdict"] for e in first["reruns"]] == ["reproducible"]
    again = _train(record=record)  # the same batch, clean this time: still skipped, as recorded
    assert again["skipped"] == [FAULT_STEP]
    assert again["reruns"] == []


def test_too_many_transient_faults_on_one_rank_raise(clean: dict) -> None:
    fault = {"target": "activation", "name": "4", "step": FAULT_STEP, "kind": "nan"}
    with pytest.raises(sk.TransientFaultError, match="1 transient faults on rank 0"):
        _train(fault, max_transient=1)


def test_rules_see_a_rerun_step_once_and_steps_not_flagged_are_not_rerun(clean: dict) -> None:
    run = _train(on=["spike"])  # nothing is a spike: nothing re-run, nothing changed
    assert run["reruns"] == [] and _bitwise(run, clean)
    nan = {"target": "activation", "name": "4", "step": FAULT_STEP, "kind": "nan"}
    run = _train(nan, on=["spike"])  # a NaN is not among the reasons: skipped, not re-run
    assert run["reruns"] == [] and run["skipped"] == [FAULT_STEP]


def test_transient_counts_per_rank_survive_a_resume() -> None:
    """``max_transient=2``: one fault before the resume and one after it make two on rank 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    cfg = sk.StabilityConfig(rerun=sk.RerunConfig(max_transient=2))
    state: dict[str, Any] = {}
    for run in range(2):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with sk.StabilityGuard(model, opt, cfg) as guard:
            if state:
                guard.load_state_dict(state)
            inject_fault(model, "activation", "2", step=guard.engine.step, kind="nan")
            x, y = _data()[run]

            def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return nn.functional.cross_entropy(model(x), y)

            guard.backward(loss_of())
            if run == 0:
                with pytest.warns(RuntimeWarning, match="transient"):
                    guard.step(replay=loss_of)
                state = guard.state_dict()  # without the count in it, the second fault would only warn
            else:
                with (
                    pytest.raises(sk.TransientFaultError, match="2 transient faults on rank 0"),
                    warnings.catch_warnings(),
                ):
                    warnings.simplefilter("ignore")
                    guard.step(replay=loss_of)


def test_a_step_with_gradient_accumulation_is_not_rerun_and_it_says_so() -> None:
    """Two micro-batches per step: a replay recomputes one batch, so a flagged step is skipped, not re-run."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sk.StabilityGuard(model, opt, sk.StabilityConfig(rerun=sk.RerunConfig())) as guard:
        reruns: list[sk.Event] = []
        guard.hooks.on("rerun", reruns.append)
        (x, y), (x2, y2) = _data()[:2]

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y) / 2

        guard.backward(loss_of() * float("nan"))
        guard.backward(nn.functional.cross_entropy(model(x2), y2) / 2)
        with pytest.warns(RuntimeWarning, match="gradient accumulation \\(2 micro-batches"):
            assert bool(guard.step(replay=loss_of).skipped)
        assert reruns == []


def test_without_a_replay_or_with_a_grad_scaler_it_says_so() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(rerun=sk.RerunConfig()))
    model(torch.randn(2, 4)).sum().backward()
    with pytest.warns(RuntimeWarning, match="guard.step\\(replay=...\\)"):
        guard.step()
    guard.close()
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"StabilityConfig.rerun .* GradScaler: a recomputed step would unscale"):
        sk.StabilityGuard(model, opt, sk.StabilityConfig(rerun=sk.RerunConfig()), scaler=scaler)


def test_flip_bit_flips_exactly_one_bit() -> None:
    t = torch.tensor([1.5, 0.25], dtype=torch.float32)
    flip_bit(t, 0)  # the exponent's top bit of 1.5: all exponent bits set -> not finite
    assert not math.isfinite(float(t[0])) and float(t[1]) == 0.25
    t = torch.tensor([0.25], dtype=torch.bfloat16)
    flip_bit(t, 0, bit=0)
    assert (
        float(t[0]) != 0.25
        and (t.view(torch.int16) ^ torch.tensor([0.25], dtype=torch.bfloat16).view(torch.int16)).item() == 1
    )
    with pytest.raises(ValueError, match="outside"):
        flip_bit(t, 0, bit=16)


def test_fingerprints_change_with_any_single_bit_and_not_otherwise() -> None:
    t = torch.randn(64)
    base = fingerprint(t)
    assert torch.equal(fingerprint(t.clone()), base)
    for bit in (0, 12, 23, 30, 31):
        u = t.clone()
        flip_bit(u, 17, bit)
        assert not torch.equal(fingerprint(u), base), bit
    assert fingerprint(torch.ones(3, dtype=torch.float64)).dtype == torch.int64


def test_a_replica_check_without_torch_distributed_does_nothing() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sk.StabilityGuard(model, opt, sk.StabilityConfig(replicas=sk.ReplicaCheckConfig(every_n_steps=1))) as guard:
        model(torch.randn(2, 4)).sum().backward()
        guard.step()
        assert guard.engine.replicas is not None and guard.engine.replicas.mismatches == []


def _framework_guard(
    driver: str, model: nn.Module, opt: Any, cfg: sk.StabilityConfig
) -> tuple[Any, Any, sk.StabilityGuard]:
    """The model and optimizer prepared by Accelerate (``"accelerate"``) or set up by Fabric (``"fabric"``),
    one CPU process, and that framework's guard over them."""
    if driver == "accelerate":
        from accelerate import Accelerator

        from stabilitykit.integrations import AccelerateGuard

        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        return model, opt, AccelerateGuard(accelerator, model, opt, cfg)
    from lightning.fabric import Fabric

    from stabilitykit.integrations import FabricGuard

    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = fabric.setup(model, opt)
    return model, opt, FabricGuard(fabric, model, opt, cfg)


def _driver_run(driver: str, fault: bool) -> list[torch.Tensor]:
    """A transient NaN in the logits at FAULT_STEP under the Accelerate or Fabric guard (one process)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = sk.StabilityConfig(log_every_n_steps=3, rerun=sk.RerunConfig())
    model, opt, guard = _framework_guard(driver, model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("rerun", events.append)
    if fault:
        inject_fault(model, "activation", "3", step=FAULT_STEP, kind="nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in _data():

            def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return nn.functional.cross_entropy(model(x), y)

            guard.backward(loss_of())
            assert not guard.step(replay=loss_of).skipped
            guard.zero_grad()
        guard.close()
    assert [(e.step, e.details["verdict"]) for e in events] == ([(FAULT_STEP, "transient")] if fault else [])
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("driver", ["accelerate", "fabric"])
def test_the_accelerate_and_fabric_guards_rerun_through_their_own_backward(driver: str) -> None:
    clean, faulty = _driver_run(driver, False), _driver_run(driver, True)
    assert all(torch.equal(a, b) for a, b in zip(clean, faulty, strict=True))


def _lightning_run(tmp_path: Path, fault: str | None, manual: bool = False) -> dict[str, Any]:
    """The Lightning callback, 6 steps of the test GPT: a one-time NaN in ``ln_f``'s output at step 3
    (``"transient"``), or a NaN loss every time step 3's training_step runs (``"bad-batch"``). ``manual``:
    manual optimization (``training_step`` backpropagates and steps the optimizer itself)."""
    import lightning.pytorch as pl

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, ManualGPTModule, gpt_dataloader

    poison = {3: math.nan} if fault == "bad-batch" else None
    module = (ManualGPTModule if manual else GPTModule)(fused=False, poison=poison)
    record = tmp_path / f"{fault}-{manual}.jsonl"
    cfg = sk.StabilityConfig(log_every_n_steps=2, rerun=sk.RerunConfig(record_path=str(record)))
    callback = StabilityCallback(cfg)
    reruns: list[sk.Event] = []
    callback.hooks.on("rerun", reruns.append)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    if fault == "transient":
        inject_fault(module, "activation", "model.ln_f", step=3, kind="nan", step_of=lambda: trainer.global_step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, gpt_dataloader(6))
    assert callback.engine is not None
    return {
        "state": [t.clone() for t in module.state_dict().values()],
        "reruns": [(e.step, e.details["verdict"], e.details["rank"]) for e in reruns],
        "skipped": callback.engine.skipped_total,
        "record": [json.loads(line)["verdict"] for line in record.read_text().splitlines()] if record.exists() else [],
    }


@pytest.mark.parametrize("manual", [False, True])
def test_the_lightning_callback_reruns_through_training_step_and_lightnings_backward(
    tmp_path: Path, manual: bool
) -> None:
    """Automatic optimization: ``training_step`` and Lightning's backward again. Manual: ``training_step`` again
    (its ``manual_backward``), stopped at its ``optimizer.step()`` (``rerun/lightning.py``)."""
    clean = _lightning_run(tmp_path, None, manual)
    transient = _lightning_run(tmp_path, "transient", manual)
    assert transient["reruns"] == [(3, "transient", 0)] and transient["skipped"] == 0
    assert _bitwise(transient, clean)  # the recomputed step was taken: a clean run's weights, bitwise
    bad = _lightning_run(tmp_path, "bad-batch", manual)
    assert bad["reruns"] == [(3, "reproducible", None)] and bad["skipped"] == 1
    assert bad["record"] == ["reproducible"]
    assert clean["reruns"] == [] and clean["skipped"] == 0


def _hf_run(tmp_path: Path, fault: str | None) -> dict[str, Any]:
    """The Hugging Face Trainer, 4 steps of a tiny Llama: a one-time NaN in ``lm_head``'s output at step 2
    (``"transient"``), or a NaN there every time step 2 is computed (``"bad-batch"``)."""
    from hf_models import tiny_llama, token_batches
    from transformers import Trainer, TrainingArguments

    from stabilitykit.integrations import stabilize

    model = tiny_llama()
    rows = [{k: v[0] for k, v in b.items()} for b in token_batches(16, batch_size=1, seed=3)]
    args = TrainingArguments(
        output_dir=str(tmp_path / str(fault)),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    callback = stabilize(trainer, sk.StabilityConfig(rerun=sk.RerunConfig()))
    reruns: list[sk.Event] = []
    callback.hooks.on("rerun", reruns.append)
    if fault is not None:
        inject_fault(
            model, "activation", "lm_head", step=2, kind="nan", repeat=fault == "bad-batch",
            step_of=lambda: trainer.state.global_step,
        )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return {
        "state": [t.clone() for t in model.state_dict().values()],
        "reruns": [(e.step, e.details["verdict"], e.details["rank"]) for e in reruns],
        "skipped": callback.summary().skipped,
    }


def test_the_hf_trainer_reruns_its_own_training_step(tmp_path: Path) -> None:
    clean = _hf_run(tmp_path, None)
    transient = _hf_run(tmp_path, "transient")
    assert transient["reruns"] == [(2, "transient", 0)] and transient["skipped"] == 0
    assert _bitwise(transient, clean)
    bad = _hf_run(tmp_path, "bad-batch")
    assert bad["reruns"] == [(2, "reproducible", None)] and bad["skipped"] == 1
    assert clean["reruns"] == [] and clean["skipped"] == 0


#: 0 events over 500 clean steps, per driver (one process; the distributed ones: ``test_rerun_distributed.py``).
CLEAN_STEPS = 500
FULL = os.environ.get("STABILITYKIT_FULL_MATRIX") == "1"


def _clean_config() -> sk.StabilityConfig:
    """Rerun on (a spike re-run too), skip-on-spike on (its default 50-step warm-up), a replica check every 5 steps."""
    return sk.StabilityConfig(
        log_every_n_steps=50,
        rerun=sk.RerunConfig(),
        skip=sk.SkipConfig(spike=True),
        replicas=sk.ReplicaCheckConfig(every_n_steps=5),
    )


def _quiet(events: list[sk.Event], summary: Any, engine: Any) -> None:
    """No rerun, no replica mismatch, no skip; rerun and skip-on-spike were on for every step."""
    assert engine.rerun is not None and "spike" in engine.rerun.config.on
    assert [e for e in events if e.kind in ("rerun", "replica_mismatch", "skipped")] == []
    assert (summary.steps, summary.skipped) == (CLEAN_STEPS, 0)


def _clean_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(CLEAN_STEPS)]


@pytest.mark.parametrize("driver", ["accelerate", "fabric"])
def test_clean_runs_report_nothing_in_the_guards(driver: str) -> None:
    """500 clean steps of a small net under the Accelerate and Fabric guards, ``replay`` given (the plain loop's:
    500 DDP steps on 2 processes, ``test_rerun_distributed.py``)."""
    torch.manual_seed(0)
    model: Any = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 4))
    opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = _clean_config()
    model, opt, guard = _framework_guard(driver, model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("*", events.append)
    for x, y in _clean_batches():

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y)

        guard.backward(loss_of())
        guard.step(replay=loss_of)
        guard.zero_grad()
    guard.close()
    _quiet(events, guard.summary(), guard.engine)


def _lightning_clean(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from stabilitykit.lightning import StabilityCallback

    class Small(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = _clean_batches()
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])), batch_size=6)
    callback = StabilityCallback(_clean_config())
    events: list[sk.Event] = []
    callback.hooks.on("*", events.append)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=CLEAN_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Small(), loader)
    _quiet(events, callback.summary(), callback.engine)


def _hf_clean(tmp_path: Path) -> None:
    from hf_models import tiny_llama, token_batches
    from transformers import Trainer, TrainingArguments

    from stabilitykit.integrations import stabilize

    model = tiny_llama()
    rows = [{k: v[0] for k, v in b.items()} for b in token_batches(CLEAN_STEPS * 2, batch_size=1, seed=3)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf-clean"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=2,
        max_steps=CLEAN_STEPS,
        learning_rate=1e-3,
        logging_steps=50,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    callback = stabilize(trainer, _clean_config())
    events: list[sk.Event] = []
    callback.hooks.on("*", events.append)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    _quiet(events, callback.summary(), callback.engine)


def test_clean_runs_report_nothing_in_the_lightning_callback(tmp_path: Path) -> None:
    """500 clean steps of a small net under the Lightning callback (automatic optimization)."""
    _lightning_clean(tmp_path)


@pytest.mark.skipif(not FULL, reason="500 HF Trainer steps (about 6 s): set STABILITYKIT_FULL_MATRIX=1")
def test_clean_runs_report_nothing_in_the_hf_trainer(tmp_path: Path) -> None:
    """500 clean steps of a tiny Llama under the HF Trainer."""
    _hf_clean(tmp_path)
