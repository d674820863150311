"""Run by test_deepspeed.py under ``torchrun --nproc_per_node 2``: the HF Trainer with ``deepspeed=``
(ZeRO-2, DeepSpeed's CPU accelerator over gloo) and ``stabilize(trainer, cfg)``.

A tiny random-init ``LlamaForCausalLM`` trains 8 steps; at global step 3 rank 1 alone has a NaN loss.
Both ranks must skip that step (the engine not advancing for it), end with finite and identical
parameters, and find the guard's rows in ``trainer.state.log_history``. The run saves a checkpoint at
step 4; a second Trainer resumes from it (``resume_from_checkpoint``) and must end bitwise where the
first ended, each rank's guard state back (its own, from ``trainer_state.json``) and equal at the end.
Rank 0 also checks that ``stabilize`` refuses two clippers (``max_grad_norm`` > 0 with ``ClipConfig``).

Then, in the same process group, the fault cells the test names (``SK_HF_CELLS``): for each (ZeRO stage,
precision, fault), a 4-step run with the fault on one rank only at its second step (NaN loss on rank 1, Inf
loss on rank 0, a loss x 1e6 on rank 1), each step's decision, reason and norm recorded and the state compared
around a skip, against a run without the guard (for NaN and Inf over the batches without the faulty step's,
for the huge grad DeepSpeed's own ``gradient_clipping`` over the same batches). And the recovery cells
(``SK_HF_RECOVERY``): a NaN streak on rank 1 only (two skips in a row) with ``RecoveryConfig``, the rollback's
state compared with the snapshot's, the run going on to its end.
Each rank writes ``rank<r>.json`` to ``SK_OUT``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

import stabilitykit as sk
from stabilitykit.integrations import stabilize
from stabilitykit.state import to_json
from tests.deepspeed_script import _diff, _same, _state
from tests.hf_models import tiny_llama, token_batches

BAD_STEP = 3
STEPS = 8
SAVE_STEPS = 4


def _args(out: Path, max_grad_norm: float, restore_callbacks: bool = False) -> Any:
    from transformers import TrainingArguments

    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    return TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        logging_steps=2,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_only_model=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds,
        max_grad_norm=max_grad_norm,
        restore_callback_states_from_checkpoint=restore_callbacks,
    )


# ---------------------------------------------------------------------------------------------------- fault cells
#: The cells come from the test (``SK_HF_CELLS``: ``stage<s>-<precision>-<fault>``, comma-separated; ``SK_HF_RECOVERY``:
#: ``stage<s>-<precision>``), which runs a covering set, or every cell with STABILITYKIT_FULL_MATRIX=1.
CELL_STEPS = 4
FAULT_STEP = 1  # the Trainer's global_step (optimizer steps done) when the fault comes
FAULT_RANK = {"nan": 1, "inf": 0, "huge": 1}
RECOVERY_STEPS = 8
RECOVERY_NAN = (3, 4)  # NaN on rank 1 at these global steps: two skips in a row, diverged


def _parse(names: str) -> list[tuple[Any, ...]]:
    """``"stage0-fp32-nan,stage3-bf16"`` -> ``[(0, "fp32", "nan"), (3, "bf16")]``."""
    out: list[tuple[Any, ...]] = []
    for name in filter(None, names.split(",")):
        stage, *rest = name.split("-")
        out.append((int(stage.removeprefix("stage")), *rest))
    return out


def cell_name(stage: int, precision: str, fault: str) -> str:
    return f"stage{stage}-{precision}-{fault}"


def _cell_args(out: Path, name: str, stage: int, bf16: bool, steps: int, max_grad_norm: float) -> Any:
    """A short run's TrainingArguments: sequential batches (so a reference can leave one step's rows out),
    a constant LR (so a run that skips a step and one that never saw it step the same schedule), no saves."""
    from transformers import TrainingArguments

    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": "auto"},
        "steps_per_print": 10**9,
    }
    return TrainingArguments(
        output_dir=str(out / name),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds,
        bf16=bf16,
        max_grad_norm=max_grad_norm,
    )


class _Faults:
    """A Trainer's ``compute_loss`` with faults on one rank: ``{global_step: (kind, rank)}``."""

    MULTIPLIER = {"nan": math.nan, "inf": math.inf, "huge": 1e6}

    def __init__(self, faults: dict[int, tuple[str, int]]) -> None:
        self.faults = faults

    def trainer(self, **kwargs: Any) -> Any:
        from transformers import Trainer

        faults = self.faults

        class FaultTrainer(Trainer):
            def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
                loss = super().compute_loss(model, inputs, *args, **kw)
                fault = faults.get(self.state.global_step)
                if fault is not None and self.args.process_index == fault[1]:
                    loss = loss * _Faults.MULTIPLIER[fault[0]]
                return loss

        return FaultTrainer(**kwargs)


def _recorder(engine_of: Any, guard_of: Any = None) -> Any:
    """A TrainerCallback that keeps, per optimizer step, the guard's report (decision, reason, norm), whether a
    skip left the state bitwise as it was, DeepSpeed's own norm, and the state after the step."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.skipped: list[bool] = []
            self.reasons: list[Any] = []
            self.norms: list[Any] = []
            self.ds_norms: list[float | None] = []
            self.unchanged: list[bool] = []
            self.diff: list[Any] = []
            self.states: dict[int, dict[str, Any]] = {}  # by the guard's step count (a rollback rewinds it)
            self.history: list[dict[str, Any]] = []  # after each optimizer step, in order
            self.before: dict[str, Any] | None = None

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.before = _state(engine_of())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            engine = engine_of()
            norm = engine.get_global_grad_norm()
            self.ds_norms.append(None if norm is None else float(norm))
            self.history.append(_state(engine))
            guard = guard_of() if guard_of is not None else None
            if guard is None:
                return
            report = guard.engine.last_report
            self.skipped.append(bool(report.skipped))
            self.reasons.append(report.reason)
            value = float(report.grad_norm)
            self.norms.append(value if math.isfinite(value) else repr(value))
            after = _state(engine)
            if report.skipped and self.before is not None:
                self.unchanged.append(_same(self.before, after))
                if not self.unchanged[-1]:
                    self.diff.append(_diff(self.before, after))
            self.states[guard.step_count] = after

    return Recorder()


def _whole_params(engine: Any, stage: int) -> torch.Tensor:
    """The module's parameters, whole (gathered for reading at stage 3), flattened in fp32."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return torch.cat([p.detach().float().flatten() for p in params])


def _fault_cell(out: Path, rows: list[Any], stage: int, precision: str, fault: str) -> dict[str, Any]:
    """One fault on one rank under the Trainer with ``deepspeed=``: the guarded run against a run without the
    guard (NaN, Inf: over the batches without the faulty step's; a huge grad: DeepSpeed's gradient_clipping on
    the same batches)."""
    name = cell_name(stage, precision, fault)
    bf16 = precision == "bf16"
    faults = {FAULT_STEP: (fault, FAULT_RANK[fault])}
    clip = sk.ClipConfig(mode="fixed", max_norm=1.0) if fault == "huge" else sk.ClipConfig(mode="off")
    trainer = _Faults(faults).trainer(
        model=tiny_llama(), args=_cell_args(out, name, stage, bf16, CELL_STEPS, 0.0), train_dataset=rows
    )
    callback = stabilize(trainer, sk.StabilityConfig(log_every_n_steps=1, clip=clip))
    recorder = _recorder(lambda: trainer.model_wrapped, lambda: callback.guard)
    trainer.add_callback(recorder)
    trainer.train()
    engine = trainer.model_wrapped
    mine = _state(engine)
    # the run without the guard
    if fault == "huge":  # the same batches, DeepSpeed clipping (gradient_clipping=1)
        ref_rows, ref_steps, ref_clip, ref_faults = rows, CELL_STEPS, 1.0, faults
    else:  # the faulty step's rows left out (2 rows a rank, 2 ranks, sequential)
        per_step = 2 * 2
        ref_rows = rows[: FAULT_STEP * per_step] + rows[(FAULT_STEP + 1) * per_step :]
        ref_steps, ref_clip, ref_faults = CELL_STEPS - 1, 0.0, {}
    reference = _Faults(ref_faults).trainer(
        model=tiny_llama(),
        args=_cell_args(out, name + "-ref", stage, bf16, ref_steps, ref_clip),
        train_dataset=ref_rows,
    )
    theirs = _recorder(lambda: reference.model_wrapped)
    reference.add_callback(theirs)
    reference.train()
    ref_state = _state(reference.model_wrapped)
    result: dict[str, Any] = {
        "skipped": recorder.skipped,
        "reasons": recorder.reasons,
        "norms": recorder.norms,
        "unchanged_by_skip": recorder.unchanged,
        "diff": recorder.diff,
        "global_steps": engine.global_steps,
        "ds_norms": theirs.ds_norms,
        "digest": hashlib.sha256(_whole_params(engine, stage).numpy().tobytes()).hexdigest(),
    }
    if fault == "huge":
        # right after the clipped step (the runs' later steps in bf16 drift apart by more than one step's rounding)
        rtol, atol = (2e-2, 1e-3) if bf16 else (1e-4, 1e-6)
        mine_at, ref_at = recorder.history[FAULT_STEP], theirs.history[FAULT_STEP]
        result["params_close"] = all(
            torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)
            for a, b in zip(mine_at["tensors"], ref_at["tensors"], strict=True)
        )
        result["clipped"] = bool(callback.guard is not None and callback.guard.summary().clipped)
    else:
        result["end_equals_reference"] = _same(mine, ref_state)
        if not result["end_equals_reference"]:
            result["end_diff"] = _diff(mine, ref_state)
    return result


def _recovery_cell(out: Path, rows: list[Any], stage: int, precision: str) -> dict[str, Any]:
    """A NaN streak on rank 1 only under the Trainer with ``deepspeed=`` and recovery: every rank rolls back
    together to the same snapshot, its state bitwise what it was there; the run finishes with every rank's
    parameters equal."""
    name = f"recovery-stage{stage}-{precision}"
    recovery = sk.RecoveryConfig(
        enabled=True,
        snapshot_every=2,
        keep=2,
        trigger=["diverged"],
        min_lookback=0,
        skip_after=0,
        max_lookback_share=1.0,  # a few steps: any snapshot but the first's (the rollback is agreed at step 5)
    )
    cfg = sk.StabilityConfig(
        log_every_n_steps=1, skip=sk.SkipConfig(nonfinite=True, max_consecutive=2), recovery=recovery
    )
    trainer = _Faults({s: ("nan", 1) for s in RECOVERY_NAN}).trainer(
        model=tiny_llama(),
        args=_cell_args(out, name, stage, precision == "bf16", RECOVERY_STEPS, 0.0),
        train_dataset=rows,
    )
    callback = stabilize(trainer, cfg)
    rollbacks: list[Any] = []
    restored: list[bool] = []
    recorder = _recorder(lambda: trainer.model_wrapped, lambda: callback.guard)

    def on_rollback(event: Any) -> None:
        rollbacks.append(event)

    callback.hooks.on("rollback", on_rollback)

    from transformers import TrainerCallback

    class Check(TrainerCallback):  # type: ignore[misc]
        """After the step that rolled back: the state is the restored snapshot's, bitwise."""

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            if rollbacks and not restored:
                step = rollbacks[0].details["restored_step"]
                restored.append(_same(_state(trainer.model_wrapped), recorder.states[step]))

    trainer.add_callback(Check())
    trainer.add_callback(recorder)  # after Check: it overwrites the restored step's state
    trainer.train()
    params = _whole_params(trainer.model_wrapped, stage)
    return {
        "rollbacks": len(rollbacks),
        "at_step": rollbacks[0].step if rollbacks else None,
        "restored_step": rollbacks[0].details["restored_step"] if rollbacks else None,
        "restored": restored == [True],
        "skipped": recorder.skipped,
        "global_step": trainer.state.global_step,
        "finite": bool(torch.isfinite(params).all()),
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    }


def main() -> None:
    from transformers import Trainer

    out = Path(os.environ["SK_OUT"])
    torch.set_num_threads(1)
    rows = [{k: v[0] for k, v in batch.items()} for batch in token_batches(64, batch_size=1, seed=3)]

    class NaNTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.args.process_index == 1 and self.state.global_step == BAD_STEP:
                loss = loss * float("nan")
            return loss

    refused = ""
    try:
        clipping = NaNTrainer(model=tiny_llama(), args=_args(out, 1.0), train_dataset=rows)
        stabilize(clipping, sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0)))
    except ValueError as exc:
        refused = str(exc)

    trainer = NaNTrainer(model=tiny_llama(), args=_args(out, 0.0), train_dataset=rows)
    skipped: list[int] = []
    callback = stabilize(trainer, sk.StabilityConfig(log_every_n_steps=2))
    callback.hooks.on("skipped", lambda e: skipped.append(e.step))
    trainer.train()
    engine = trainer.model_wrapped
    params = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    ours = [h for h in trainer.state.log_history if "stability/grad_norm/total" in h]
    assert callback.guard is not None
    end_state = to_json(callback.guard.state_dict())

    # resume from the step-4 checkpoint: the same end, bitwise, and the same guard state
    resumed = NaNTrainer(model=tiny_llama(), args=_args(out, 0.0), train_dataset=rows)
    again = stabilize(resumed, sk.StabilityConfig(log_every_n_steps=2))
    loaded: list[int] = []
    again.hooks.on("skipped", lambda e: loaded.append(e.step))
    resumed.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{SAVE_STEPS}"))
    assert again.guard is not None
    params_again = torch.cat([p.detach().float().flatten() for p in resumed.model_wrapped.module.parameters()])

    # resume from the last checkpoint with restore_callback_states_from_checkpoint=True: the Trainer rebuilds
    # the callback from its saved args, which hands back the attached one; its state is what step 8 saved
    from transformers import TrainerCallback

    restoring = NaNTrainer(model=tiny_llama(), args=_args(out, 0.0, restore_callbacks=True), train_dataset=rows)
    third = stabilize(restoring, sk.StabilityConfig(log_every_n_steps=2))
    seen: dict[str, Any] = {}

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if "loaded" not in seen and third.guard is not None:
                seen["loaded"] = to_json(third.guard.state_dict())

    restoring.add_callback(Probe())
    restoring.args.max_steps = STEPS + 1
    restoring.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{STEPS}"))
    assert callback.guard.checkpoint_states is not None
    saved_at_end = to_json(callback.guard.checkpoint_states[trainer.args.process_index])
    result = {
        "callback": type(callback).__name__,
        "skipped": skipped,
        "global_steps": engine.global_steps,
        "finite": bool(torch.isfinite(params).all()),
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "rows": len(ours),
        "refused": refused,
        "resume_exact": bool(torch.equal(params, params_again)),
        "resume_guard_state": to_json(again.guard.state_dict()) == end_state,
        "resume_skipped": again.guard.summary().skipped,
        "resume_global_steps": resumed.model_wrapped.global_steps,
        "restored_into_attached": any(cb is third for cb in restoring.callback_handler.callbacks),
        "restored_state": seen.get("loaded") == saved_at_end,
    }
    result["cells"] = {cell_name(*c): _fault_cell(out, rows, *c) for c in _parse(os.environ.get("SK_HF_CELLS", ""))}
    result["recovery"] = {
        f"stage{s}-{p}": _recovery_cell(out, rows, s, p) for s, p in _parse(os.environ.get("SK_HF_RECOVERY", ""))
    }
    (out / f"rank{trainer.args.process_index}.json").write_text(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
