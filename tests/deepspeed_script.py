"""DeepSpeed (ZeRO stages 0-3, fp32 and bf16) under DeepSpeedGuard on real gloo processes.

Run by tests/test_deepspeed.py: ``python tests/deepspeed_script.py WORLD OUT PORT``. One process
group runs every case (DeepSpeed's import and set-up are slow); each rank writes what it saw, and
the test compares the ranks and the runs. Per (stage, precision):

* a reference run of DeepSpeed alone over the clean batches (its own global grad norm each step);
* a guarded run over the same batches (stages 0 and 2 through ``guard.backward``/``guard.step``,
  stages 1 and 3 through the engine's own ``backward``/``step``, which the guard routes) with
  faults in between (NaN on rank 1 only, Inf on rank 0 only): every fault skipped, the state
  bitwise unchanged by each skip, the end state bitwise the reference's, each clean step's norm
  equal to DeepSpeed's own;
* a huge finite grad on rank 0 only, clipped by the guard (max_norm 1) against DeepSpeed clipping the
  same batch itself (gradient_clipping 1): not skipped, the same norm, the same parameters;
* resume: saved through ``save_checkpoint`` (client state), two more steps, loaded, the same two
  steps again: the same parameters and the same guard state.
"""

from __future__ import annotations

import copy
import io
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from distributed_script_runner import launch
from torch import nn

CLEAN = [0, 1, 3, 5]  # the batches the reference run sees
PLAN = [(0, None), (1, None), (2, "nan"), (3, None), (4, "inf"), (5, None)]  # (batch, fault) of the guarded run
#: The (stage, bf16) cells that rerun (all eight passed once; stages 1 and 2 drop grads alike, so stage 1 is left
#: out: 1.8 CPU s per rank under bf16).
RERUN_CELLS = [(0, False), (2, False), (3, True)]
#: With STABILITYKIT_FULL_MATRIX=1, each rerun cell also trains CLEAN_STEPS clean steps with rerun and replica
#: checks on: no event (``_clean_long``).
FULL = os.environ.get("STABILITYKIT_FULL_MATRIX") == "1"
CLEAN_STEPS = 500


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(i: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(2, 8, generator=g).to(dtype)


def _ds_config(stage: int, bf16: bool, clipping: float = 0.0, accumulate: int = 1) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulate,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    cfg["gradient_clipping"] = clipping  # DeepSpeed's default is 1.0: off unless a case asks
    return cfg


def _engine(stage: int, bf16: bool, clipping: float = 0.0, accumulate: int = 1) -> Any:
    import deepspeed

    model = _model()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(stage, bf16, clipping, accumulate)
    )
    return engine


def _loss(engine: Any, i: int, rank: int, dtype: torch.dtype, fault: str | None, faulty_rank: int) -> torch.Tensor:
    loss = engine(_batch(i, rank, dtype)).float().pow(2).mean()
    if fault is not None and rank == faulty_rank:
        loss = loss * {"nan": math.nan, "inf": math.inf, "huge": 1e6}[fault]
    return loss


def _state(engine: Any) -> dict[str, Any]:
    """Everything a skip must leave bitwise as it was: parameters (this rank's partition), the fp32
    master partitions, optimizer state, the LR and the engine's counters."""
    opt = engine.optimizer
    # stage 3: a parameter's own partition (its full tensor is gathered and released around forward)
    params = [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]
    if hasattr(opt, "fp16_partitioned_groups_flat"):  # stage 3: this rank's partition of every parameter
        params += [t.detach().clone() for t in opt.fp16_partitioned_groups_flat]
    masters = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups"):
        for t in getattr(opt, name, None) or []:
            masters += [x.detach().clone() for x in (t if isinstance(t, list) else [t])]
    inner = getattr(opt, "optimizer", opt)
    moments_list = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "tensors": params + masters + [v.detach().clone() for v in moments_list],
        "lr": [g["lr"] for g in inner.param_groups],
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
        "sched": copy.deepcopy(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors = len(a["tensors"]) == len(b["tensors"]) and all(
        x.shape == y.shape
        and torch.equal(
            x.view(-1).view(torch.uint8) if x.numel() else x, y.view(-1).view(torch.uint8) if y.numel() else y
        )
        for x, y in zip(a["tensors"], b["tensors"], strict=True)
    )
    return tensors and a["lr"] == b["lr"] and a["counters"] == b["counters"] and a["sched"] == b["sched"]


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    found = [
        f"tensor {i} {tuple(x.shape)} {tuple(y.shape)}"
        for i, (x, y) in enumerate(zip(a["tensors"], b["tensors"], strict=False))
        if x.shape != y.shape or not torch.equal(x, y)
    ]
    return found + [k for k in ("lr", "counters", "sched") if a[k] != b[k]]


def _full_norm(engine: Any) -> float:
    """Stage 0 in fp32: DeepSpeed computes no norm; the whole averaged grads' norm is the reference."""
    grads = [p.grad.float() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _ds_norm(engine: Any, before: float | None) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float(before)  # type: ignore[arg-type]


def _reference(stage: int, bf16: bool, rank: int, dtype: torch.dtype) -> tuple[dict[str, Any], list[float]]:
    engine = _engine(stage, bf16)
    norms = []
    for i in CLEAN:
        engine.backward(_loss(engine, i, rank, dtype, None, 0))
        before = _full_norm(engine) if stage == 0 else None
        engine.step()
        norms.append(_ds_norm(engine, before))
    # the counters a run of clean steps only has: the guarded run must end with the same
    return _state(engine), norms


def _case(stage: int, bf16: bool, rank: int) -> dict[str, Any]:
    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    dtype = torch.bfloat16 if bf16 else torch.float32
    ref_state, ref_norms = _reference(stage, bf16, rank, dtype)
    engine = _engine(stage, bf16)
    cfg = sk.StabilityConfig(log_every_n_steps=2, skip=sk.SkipConfig(nonfinite=True, max_consecutive=5))
    guard = DeepSpeedGuard(engine, config=cfg)
    out: dict[str, Any] = {"skipped": [], "reasons": [], "norms": [], "unchanged_by_skip": [], "layer_norms": None}
    for i, fault in PLAN:
        before = _state(engine)
        loss = _loss(engine, i, rank, dtype, fault, 1 if fault == "nan" else 0)
        if stage % 2:  # stages 1 and 3: the loop calls the engine's own backward and step (routed)
            engine.backward(loss)
            engine.step()
            report = guard.engine.last_report
        else:
            guard.backward(loss)
            report = guard.step()
        assert report is not None
        skipped = bool(report.skipped)
        out["skipped"].append(skipped)
        out["reasons"].append(report.reason)
        norm = float(report.grad_norm)
        out["norms"].append(norm if math.isfinite(norm) else repr(norm))
        if skipped:
            after = _state(engine)
            out["unchanged_by_skip"].append(_same(before, after))
            if not _same(before, after):
                out.setdefault("diff", []).append(_diff(before, after))
        if i == 0 and report.layer_norms is not None:
            out["layer_norms"] = dict(zip(report.layer_names, [float(x) for x in report.layer_norms], strict=False))
    out["end_equals_reference"] = _same(_state(engine), ref_state)
    out["ref_norms"] = ref_norms
    out["clean_norms"] = [out["norms"][k] for k, (_, f) in enumerate(PLAN) if f is None]
    summary = guard.summary()
    out["summary"] = {"steps": summary.steps, "skipped": summary.skipped, "nonfinite": summary.nonfinite_steps}

    # resume: save, two steps, load, the same two steps again
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        torch.distributed.broadcast_object_list(shared, src=0)
        guard.save_checkpoint(shared[0], tag="t")
        for i in (6, 7):
            guard.backward(_loss(engine, i, rank, dtype, None, 0))
            guard.step()
        first = _state(engine)["tensors"]
        first_guard = _plain(guard.state_dict())
        guard.load_checkpoint(shared[0], tag="t")
        for i in (6, 7):
            guard.backward(_loss(engine, i, rank, dtype, None, 0))
            guard.step()
        again = _state(engine)["tensors"]
        out["resume_exact"] = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        second_guard = _plain(guard.state_dict())
        out["resume_guard_state"] = second_guard == first_guard
        if second_guard != first_guard:
            out["guard_diff"] = _where(first_guard, second_guard)
        torch.distributed.barrier()
    guard.close()
    out["rollback"] = _rollback(engine, rank, dtype)  # on the same engine: a new guard, with recovery
    return out


ROLLBACK_PLAN = [None, None, None, "nan", "nan", None, None, None]  # a divergence at step 4: 2 skips in a row


def _short_run_recovery() -> Any:
    """Rollback on a divergence in a few-step run: a snapshot every 2 steps, any but the first's restorable
    (the rollback is agreed at step 5), no cooldown; one config for the rollback and the fp16 cells."""
    import stabilitykit as sk

    return sk.RecoveryConfig(
        enabled=True,
        snapshot_every=2,
        keep=2,
        trigger=["diverged"],
        min_lookback=0,
        skip_after=0,
        max_lookback_share=1.0,
        cooldown_steps=0,
    )


def _rollback(engine: Any, rank: int, dtype: torch.dtype) -> dict[str, Any]:
    """Recovery: NaN on rank 1 only at steps 3 and 4 (two skips in a row: diverged). Both ranks roll back
    together to the same snapshot, every rank's own partitions, fp32 masters, moments, LR scheduler and the
    engine's counters bitwise what they were at that snapshot; the next step, on the restored step's own
    batch, ends bitwise where that step ended (at stage 3 it gathers the restored partitions afresh)."""
    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    recovery = _short_run_recovery()
    cfg = sk.StabilityConfig(
        log_every_n_steps=1, skip=sk.SkipConfig(nonfinite=True, max_consecutive=2), recovery=recovery
    )
    guard = DeepSpeedGuard(engine, config=cfg)
    events: list[Any] = []
    guard.hooks.on("rollback", events.append)
    states: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {"skipped": [], "restored": None, "replayed": None}
    replay: int | None = None  # after the rollback: the restored step's own batch again
    for k, fault in enumerate(ROLLBACK_PLAN):
        batch = 20 + (replay if replay is not None else k)
        guard.backward(_loss(engine, batch, rank, dtype, fault, 1))
        report = guard.step()
        assert report is not None
        out["skipped"].append(bool(report.skipped))
        if replay is not None and out["replayed"] is None:  # the same step as from the snapshot, bitwise
            out["replayed"] = _same(_state(engine), states[replay + 1])
        if events and out["restored"] is None:
            replay = events[0].details["restored_step"]
            out.update(at_step=events[0].step, restored_step=replay)
            out["restored"] = _same(_state(engine), states[replay])
            if not out["restored"]:
                out["diff"] = _diff(_state(engine), states[replay])
        states[guard.step_count] = _state(engine)
    out["rollbacks"] = len(events)
    out["finite"] = all(bool(torch.isfinite(t.float()).all()) for t in _state(engine)["tensors"])
    guard.close()
    return out


def _where(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [w for k in a for w in _where(a[k], b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [w for i, (x, y) in enumerate(zip(a, b, strict=True)) for w in _where(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]


def _plain(state: Any) -> Any:
    """A state dict as comparable plain values (tensors to lists)."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    if torch.is_tensor(state):
        return _plain(state.tolist())
    if isinstance(state, float) and math.isnan(state):
        return "nan"
    return state


def _huge(stage: int, bf16: bool, rank: int) -> dict[str, Any]:
    """A huge finite grad on rank 0 only: the guard clips it as DeepSpeed's gradient_clipping would."""
    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    dtype = torch.bfloat16 if bf16 else torch.float32
    theirs = _engine(stage, bf16, clipping=1.0)
    theirs.backward(_loss(theirs, 0, rank, dtype, "huge", 0))
    before = _full_norm(theirs) if stage == 0 else None
    theirs.step()
    their_norm = _ds_norm(theirs, before)
    engine = _engine(stage, bf16)
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    guard = DeepSpeedGuard(engine, config=cfg)
    guard.backward(_loss(engine, 0, rank, dtype, "huge", 0))
    report = guard.step()
    assert report is not None
    mine = _state(engine)["tensors"]
    ref = _state(theirs)["tensors"]
    rtol, atol = (2e-2, 1e-3) if bf16 else (1e-4, 1e-6)
    close = all(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol) for a, b in zip(mine, ref, strict=True))
    guard.close()
    return {
        "skipped": bool(report.skipped),
        "norm": float(report.grad_norm),
        "ds_norm": their_norm,
        "params_close": close,
    }


def _unguarded_nan(stage: int, bf16: bool, rank: int) -> dict[str, Any]:
    """DeepSpeed alone, a NaN loss on rank 1 only: what it does with the step (no guard)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine = _engine(stage, bf16)
    engine.backward(_loss(engine, 0, rank, dtype, "nan", 1))
    engine.step()
    finite = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters())
    return {"params_finite": finite, "skipped_steps": engine.skipped_steps}


def _accumulating(stage: int, rank: int) -> dict[str, Any]:
    """Two micro-batches per step, a NaN in the second micro-batch of step 1 on rank 1 only: that step
    skipped on both ranks, the state bitwise unchanged by it, the next steps accumulating afresh (the
    end state bitwise DeepSpeed's alone over the clean steps)."""
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    dtype = torch.float32
    steps = [(0, None), (1, "nan"), (2, None), (3, None)]
    reference = _engine(stage, False, accumulate=2)
    for i, fault in steps:
        if fault is None:
            for micro in (0, 1):
                reference.backward(_loss(reference, 10 * i + micro, rank, dtype, None, 0))
                reference.step()
    engine = _engine(stage, False, accumulate=2)
    guard = DeepSpeedGuard(engine)
    skipped, unchanged, nones = [], [], 0
    for i, fault in steps:
        before = _state(engine)
        for micro in (0, 1):
            guard.backward(_loss(engine, 10 * i + micro, rank, dtype, fault if micro == 1 else None, 1))
            report = guard.step()
            if micro == 0:
                nones += report is None
        assert report is not None
        skipped.append(bool(report.skipped))
        if report.skipped:
            unchanged.append(_same(before, _state(engine)))
    out = {
        "skipped": skipped,
        "unchanged": unchanged,
        "nones": nones,
        "end_equals_reference": _same(_state(engine), _state(reference)),
    }
    guard.close()
    return out


def _user_rule(stage: int, rank: int) -> dict[str, Any]:
    """A user's skip rule over a metric recorded with ``sk.record`` (rank 1 alone records a bad value
    at step 2): that step skipped on both ranks with the state unchanged; a metric recorded with
    reduce "sum" is agreed across ranks."""
    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    class QualityGate(sk.SkipRule):
        name = "quality_gate"

        def flag(self, values: sk.StepValues) -> torch.Tensor:
            return values["quality"] < 0.5

    engine = _engine(stage, False)
    guard = DeepSpeedGuard(engine, config=sk.StabilityConfig(log_every_n_steps=1), rules=[QualityGate()])
    rows: list[dict[str, float]] = []

    class Rows:
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            rows.append(dict(metrics))

    guard.hooks.add_sink(Rows())
    skipped, reasons, unchanged, used = [], [], [], []
    for i in range(4):
        before = _state(engine)
        sk.record("quality", torch.tensor(0.0 if (rank == 1 and i == 2) else 1.0))
        sk.record("rank_id", torch.tensor(float(rank + 1)), reduce="sum")
        guard.backward(_loss(engine, i, rank, torch.float32, None, 0))
        used.append(float(engine.get_lr()[0]))  # the LR this step runs with (DeepSpeed's WarmupLR)
        report = guard.step()
        assert report is not None
        skipped.append(bool(report.skipped))
        reasons.append(report.reason)
        if report.skipped:
            unchanged.append(_same(before, _state(engine)))
    guard.close()
    sums = sorted({r["stability/metrics/rank_id"] for r in rows if "stability/metrics/rank_id" in r})
    lrs = [r.get("stability/lr/0") for r in rows if "stability/metrics/rank_id" in r]  # every step's row
    return {
        "skipped": skipped,
        "reasons": reasons,
        "unchanged": unchanged,
        "rank_id_sums": sums,
        "lrs": lrs,
        "used": used,
    }


FP16_PLAN = [(0, None), (1, None), (2, "overflow"), (3, None), (4, "nan"), (5, None)]  # (batch, fault)
#: After FP16_PLAN, with recovery: an overflow (scale halved), then two NaN losses in a row (diverged), a
#: clean step (the rollback, agreed), then the restored step's own batch again.
FP16_ROLLBACK = [(6, "overflow"), (7, "nan"), (8, "nan"), (9, None)]


def _rerun(stage: int, bf16: bool, rank: int) -> dict[str, Any]:
    """Rerun (``guard.step(replay=...)``) over batches 0-2, a NaN loss at batch 1 on rank 1 only: once (gone when
    computed again: transient, rank 1 named, the recomputed step taken, the end state bitwise DeepSpeed's own
    over the clean batches 0-2) or every time it is computed (reproducible, skipped on both ranks, the end state
    bitwise DeepSpeed's over batches 0 and 2). Then a NaN in rank 1's local gradient at batch 1, once: transient,
    rank 1 named at ZeRO 0 (measured before DeepSpeed's all-reduce), no rank at ZeRO 1-3 (DeepSpeed reduces it
    into every rank's partitions before any point the guard can measure it), the step taken, the end state
    DeepSpeed's over the clean batches 0-2."""
    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard
    from stabilitykit.testing import inject_fault

    dtype = torch.bfloat16 if bf16 else torch.float32
    out: dict[str, Any] = {}
    cases = (("transient", [0, 1, 2], True), ("reproducible", [0, 2], False), ("local-grad", [0, 1, 2], True))
    references: dict[tuple[int, ...], Any] = {}  # DeepSpeed's own run over the clean batches, one per list
    rng: dict[tuple[int, ...], torch.Tensor] = {}  # the global random state at its end
    for name, clean, once in cases:
        theirs = references.get(tuple(clean))
        if theirs is None:
            theirs = references[tuple(clean)] = _engine(stage, bf16)
            for i in clean:  # each forward draws once from the global generator, as dropout would
                theirs.backward(_loss(theirs, i, rank, dtype, None, 0) + 0 * torch.rand(()))
                theirs.step()
            rng[tuple(clean)] = torch.get_rng_state()
        engine = _engine(stage, bf16)
        guard = DeepSpeedGuard(engine, config=sk.StabilityConfig(log_every_n_steps=2, rerun=sk.RerunConfig()))
        events: list[Any] = []
        guard.hooks.on("rerun", events.append)
        computed, skipped, nan_loss = [0], [], name != "local-grad"
        if name == "local-grad":  # a NaN in rank 1's local gradient at step 1, once
            inject_fault(engine.module, "grad", "2.weight", step=1, rank=1, kind="nan")
        for i in range(3):

            def loss_of(
                i: int = i,
                engine: Any = engine,
                computed: list[int] = computed,
                once: bool = once,
                bad: bool = nan_loss,
            ) -> Any:
                computed[0] += i == 1
                fault = "nan" if bad and i == 1 and (computed[0] == 1 or not once) else None
                return _loss(engine, i, rank, dtype, fault, 1) + 0 * torch.rand(())

            guard.backward(loss_of())
            report = guard.step(replay=loss_of)
            assert report is not None
            skipped += [i] if bool(report.skipped) else []
        out[name] = {
            "events": [[e.step, e.details["verdict"], e.details["rank"]] for e in events],
            "skipped": skipped,
            "same": _same(_state(engine), _state(theirs)),
            "diff": _diff(_state(engine), _state(theirs)),
            # a rerun draws again from the state its step's forward started with: a clean run's draws in the end
            "rng_same": torch.equal(torch.get_rng_state(), rng[tuple(clean)]),
        }
        guard.close()
    return out


def _clean_long(stage: int, bf16: bool, rank: int) -> dict[str, Any]:
    """CLEAN_STEPS clean steps (cross-entropy on random labels, each rank its own batches) with rerun on
    (``replay`` given), skip-on-spike on and a replica check every 5 steps: the rerun, replica_mismatch and
    skipped events of the run (none expected), its steps and skips."""
    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    dtype = torch.bfloat16 if bf16 else torch.float32
    engine = _engine(stage, bf16)
    cfg = sk.StabilityConfig(
        log_every_n_steps=50,
        rerun=sk.RerunConfig(),
        skip=sk.SkipConfig(spike=True),
        replicas=sk.ReplicaCheckConfig(every_n_steps=5),
    )
    guard = DeepSpeedGuard(engine, config=cfg)
    events: list[Any] = []
    guard.hooks.on("*", events.append)
    for i in range(CLEAN_STEPS):
        g = torch.Generator().manual_seed(7919 * i + rank)
        x, y = torch.randn(2, 8, generator=g).to(dtype), torch.randint(0, 4, (2,), generator=g)

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y, engine: Any = engine) -> torch.Tensor:
            return nn.functional.cross_entropy(engine(x).float(), y)

        guard.backward(loss_of())
        guard.step(replay=loss_of)
    summary = guard.summary()
    guard.close()
    kept = ("rerun", "replica_mismatch", "skipped")
    return {
        "events": [[e.kind, e.step] for e in events if e.kind in kept],
        "steps": summary.steps,
        "skipped": summary.skipped,
    }


def _fp16_engine(stage: int) -> Any:
    import deepspeed

    cfg = _ds_config(stage, False)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000}
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _fp16_loss(engine: Any, i: int, rank: int, fault: str | None) -> torch.Tensor:
    """An fp16 overflow on rank 1 (a finite loss whose scaled grads exceed fp16), a NaN loss on rank 0."""
    loss = engine(_batch(i, rank, torch.float16)).float().pow(2).mean()
    if fault == "overflow" and rank == 1:
        loss = loss * 1e6
    if fault == "nan" and rank == 0:
        loss = loss * math.nan
    return loss


def _fp16(stage: int, rank: int) -> dict[str, Any]:
    """DeepSpeed's fp16 with its dynamic loss scaler (on the CPU through an accelerator that declares
    fp16): an overflow on rank 1 only is DeepSpeed's own skip, reported once as fp16_overflow (its scale
    lowered, its counters its own); a NaN loss on rank 0 only is the guard's skip (the scale untouched).
    The end state is bitwise DeepSpeed's alone over the batches without the NaN loss. Then recovery: an
    overflow halves the scale, a NaN streak diverges, and the rollback puts the partitions, masters,
    moments, counters and DeepSpeed's loss scaler back bitwise; the restored step's own batch (an
    overflow again) then ends where it ended the first time."""
    import stabilitykit as sk
    from stabilitykit.compat.deepspeed import loss_scaler_state
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    def state() -> dict[str, Any]:
        return {**_state(engine), "scaler": loss_scaler_state(engine)}

    reference = _fp16_engine(stage)
    ref_norms = []
    for i, fault in FP16_PLAN:
        if fault != "nan":
            reference.backward(_fp16_loss(reference, i, rank, fault))
            reference.step()
            if fault is None:
                ref_norms.append(_ds_norm(reference, None))
    engine = _fp16_engine(stage)
    recovery = _short_run_recovery()
    # no spike detection: the overflow is injected as a loss 1e6x on rank 1, which its detectors would
    # rightly call a jump, and the agreed health would then drop the snapshot after it (step 6's), the one
    # whose halved loss scale this case restores
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        skip=sk.SkipConfig(max_consecutive=2),
        spikes=sk.SpikeConfig(enabled=False),
        recovery=recovery,
    )
    guard = DeepSpeedGuard(engine, config=cfg)
    logged: list[dict[str, float]] = []

    class Rows:
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            logged.append(dict(metrics))

    guard.hooks.add_sink(Rows())
    rollbacks: list[Any] = []
    guard.hooks.on("rollback", rollbacks.append)
    states: dict[int, dict[str, Any]] = {}
    kinds: list[str] = []
    guard.hooks.on("*", lambda e: kinds.append(e.kind))
    reasons, scales, norms = [], [], []
    used = []
    for i, fault in FP16_PLAN:
        guard.backward(_fp16_loss(engine, i, rank, fault))
        used.append(float(engine.get_lr()[0]))  # the LR this step runs with (DeepSpeed's WarmupLR)
        report = guard.step()
        assert report is not None
        reasons.append(report.reason)
        scales.append(float(engine.optimizer.loss_scale))
        if fault is None:
            norms.append(float(report.grad_norm))
        states[guard.step_count] = state()
    end_equals_reference = _same(_state(engine), _state(reference))
    lrs = [r.get("stability/lr/0") for r in logged[: len(FP16_PLAN)]]  # FP16_PLAN's steps, one row each
    summary = guard.summary()
    skipped_steps = engine.skipped_steps
    plan = dict(enumerate([*FP16_PLAN, *FP16_ROLLBACK]))  # step -> (batch, fault)
    replay: int | None = None
    restored = replayed = False
    for i, fault in [*FP16_ROLLBACK, (None, None)]:
        if replay is not None:  # the restored step's own batch, and fault, again
            i, fault = plan[replay]
        guard.backward(_fp16_loss(engine, i, rank, fault))
        guard.step()
        if replay is not None:
            replayed = _same(state(), states[replay + 1]) and state()["scaler"] == states[replay + 1]["scaler"]
            break
        if rollbacks:
            replay = rollbacks[0].details["restored_step"]
            restored = _same(state(), states[replay]) and state()["scaler"] == states[replay]["scaler"]
        else:
            states[guard.step_count] = state()
    guard.close()
    return {
        "rollbacks": len(rollbacks),
        "restored_step": replay,
        "restored": restored,
        "replayed": replayed,
        "reasons": reasons,
        "scales": scales,
        "ref_scale": float(reference.optimizer.loss_scale),
        "norms": norms,
        "ref_norms": ref_norms,
        "end_equals_reference": end_equals_reference,
        "kinds": sorted(set(kinds) - {"precision"}),
        "skipped_steps": skipped_steps,
        "skipped": summary.skipped,
        "lrs": lrs,
        "used": used,
    }


def _fp16_cases(rank: int) -> dict[str, Any]:
    """Every fp16 case, after the rest (the accelerator is set for the process from here on)."""
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    class Fp16Cpu(CPU_Accelerator):  # type: ignore[misc]
        """DeepSpeed's CPU accelerator, declaring fp16 (it declares it only where oneDNN has fp16 kernels)."""

        def is_fp16_supported(self) -> bool:
            return True

        def supported_dtypes(self) -> list[torch.dtype]:
            return [torch.float, torch.bfloat16, torch.float16]

    set_accelerator(Fp16Cpu())
    results: dict[str, Any] = {f"fp16-stage{stage}": _fp16(stage, rank) for stage in (0, 1, 2, 3)}
    try:  # rerun with DeepSpeed's own loss scaler: refused by name (stabilitykit/rerun/refusals.py)
        DeepSpeedGuard(_fp16_engine(0), config=sk.StabilityConfig(rerun=sk.RerunConfig()))
        results["fp16-rerun-refused"] = ""
    except ValueError as exc:
        results["fp16-rerun-refused"] = str(exc)
    return results


def _per_tensor(stage: int, rank: int) -> dict[str, Any]:
    """Per-tensor clipping (AdaGC, ``per_tensor_adaptive``) where the grads are partitioned: four clean steps
    (the warm-up), then a huge grad on rank 0 only. Each parameter's norm is global (its pieces summed over
    the ranks), so the clipped tensors and the end parameters are those of stage 0 (whole grads)."""
    import deepspeed

    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    engine = _engine(stage, False)
    clip = sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=2, per_tensor_ratio=1.05)
    guard = DeepSpeedGuard(engine, config=sk.StabilityConfig(log_every_n_steps=1, clip=clip))
    clipped = []
    for i in range(5):
        loss = _loss(engine, i, rank, torch.float32, None, 0)
        guard.backward(loss * 1e3 if (i == 4 and rank == 0) else loss)
        report = guard.step()
        assert report is not None and not bool(report.skipped)
        clipped.append(bool(report.clipped))
    guard.close()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):  # stage 3: whole for reading only
        whole = [p.detach().flatten().tolist() for p in params]
    return {"clipped": clipped, "params": whole}


def _refusals() -> dict[str, str]:
    """What the guard refuses by name: two clippers; rerun under a framework's DeepSpeed integration
    (``stabilitykit/rerun/refusals.py``; with DeepSpeed's fp16: ``_fp16_cases``)."""
    import stabilitykit as sk
    from stabilitykit.drivers.deepspeed import DeepSpeedLater
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    found = dict.fromkeys(("two_clippers", "rerun_framework"), "")
    rerun = sk.StabilityConfig(rerun=sk.RerunConfig())
    attempts = {
        "two_clippers": lambda: DeepSpeedGuard(
            _engine(2, False, clipping=1.0), config=sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
        ),
        "rerun_framework": lambda: DeepSpeedLater(rerun),  # what the HF Trainer's and Lightning's callbacks build on
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as exc:
            found[name] = str(exc)
    return found


def worker(rank: int, world: int) -> dict[str, Any]:
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_SIZE": str(world)})
    import deepspeed  # noqa: F401  (after the env: DeepSpeed reads it at import)
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    stages = [int(s) for s in os.environ.get("SK_DS_STAGES", "0,1,2,3").split(",") if s]
    results: dict[str, Any] = {}
    quiet = io.StringIO()
    for stage in stages:
        for bf16 in (False, True):
            key = f"stage{stage}-{'bf16' if bf16 else 'fp32'}"
            old = sys.stdout
            sys.stdout = quiet  # DeepSpeed prints its config on every initialize
            try:
                results[key] = _case(stage, bf16, rank)
                results[key]["huge"] = _huge(stage, bf16, rank)
                results[key]["unguarded"] = _unguarded_nan(stage, bf16, rank)
                if (stage, bf16) in RERUN_CELLS:
                    results[key]["rerun"] = _rerun(stage, bf16, rank)
                    if FULL:
                        results[key]["clean-long"] = _clean_long(stage, bf16, rank)
            finally:
                sys.stdout = old
        if stage in (0, 2, 3):
            old = sys.stdout
            sys.stdout = quiet
            try:
                results[f"per-tensor-stage{stage}"] = _per_tensor(stage, rank)
            finally:
                sys.stdout = old
        if stage in (2, 3):
            old = sys.stdout
            sys.stdout = quiet
            try:
                results[f"accumulate-stage{stage}"] = _accumulating(stage, rank)
                results[f"rule-stage{stage}"] = _user_rule(stage, rank)
            finally:
                sys.stdout = old
    results["refusals"] = _refusals()
    old = sys.stdout
    sys.stdout = quiet
    try:
        results.update(_fp16_cases(rank))
    finally:
        sys.stdout = old
    return results


if __name__ == "__main__":
    launch(worker, sys.argv[1:])
