"""DeepSpeedGuard on 2 real gloo processes: ZeRO stages 0-3 x (fp32, bf16) x (NaN on one rank, Inf on
one rank, a huge finite grad on one rank). One process group runs every case (tests/deepspeed_script.py);
each test reads its case from both ranks' results. The HF Trainer with ``deepspeed=`` runs in one torchrun
launch (tests/hf_deepspeed_script.py): its resume, a covering set of its fault cells and a rollback
(every cell with STABILITYKIT_FULL_MATRIX=1).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.distributed_script_runner import run_torchrun, run_world
from tests.time_limits import limit, timeout_for

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed: pip install 'stabilitykit[deepspeed]' (bash scripts/setup.sh installs it)",
    ),
    # whichever test uses ``ranks`` first waits for the whole launch (tests/time_limits.py)
    pytest.mark.timeout(timeout_for("deepspeed_script")),
]

SCRIPT = Path(__file__).parent / "deepspeed_script.py"
CASES = [f"stage{s}-{p}" for s in (0, 1, 2, 3) for p in ("fp32", "bf16")]
PLAN_FAULTS = ["clean", "clean", "nan", "clean", "inf", "clean"]  # tests/deepspeed_script.py PLAN

FULL = os.environ.get("STABILITYKIT_FULL_MATRIX") == "1"
#: The HF Trainer's fault cells (stage, precision, fault): a covering set (every stage, every fault, both
#: precisions), every cell with STABILITYKIT_FULL_MATRIX=1. All run in the one torchrun launch.
HF_CELLS = (
    [f"stage{s}-{p}-{f}" for s in (0, 1, 2, 3) for p in ("fp32", "bf16") for f in ("nan", "inf", "huge")]
    if FULL
    else ["stage0-fp32-nan", "stage1-bf16-inf", "stage2-bf16-huge", "stage3-fp32-nan"]
)
HF_RECOVERY = [f"stage{s}-{p}" for s in (0, 1, 2, 3) for p in ("fp32", "bf16")] if FULL else ["stage3-bf16"]
HF_CELL_STEPS, HF_FAULT_STEP = 4, 1  # tests/hf_deepspeed_script.py


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(SCRIPT, 2, tmp_path_factory.mktemp("deepspeed"), timeout=limit("deepspeed_script"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("case", CASES)
def test_fault_on_one_rank_is_skipped_on_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    """NaN on rank 1 only, Inf on rank 0 only: both ranks skip exactly those steps, leave the state
    (parameters, fp32 partitions, moments, LR scheduler, engine counters) bitwise as it was, and end
    bitwise where DeepSpeed alone ends over the clean batches."""
    expected = [f != "clean" for f in PLAN_FAULTS]
    for rank in ranks:
        got = rank[case]
        assert got["skipped"] == expected, f"rank {ranks.index(rank)}: {got['reasons']}"
        assert got["unchanged_by_skip"] == [True, True], got.get("diff")
        assert got["end_equals_reference"]
        assert got["summary"]["skipped"] == 2 and got["summary"]["steps"] == len(PLAN_FAULTS)


@pytest.mark.parametrize("case", CASES)
def test_global_norm_is_deepspeeds_own(ranks: list[dict[str, Any]], case: str) -> None:
    """Each clean step's norm equals DeepSpeed's get_global_grad_norm() (stage 0 in fp32, where
    DeepSpeed computes none: the norm of the whole averaged grads), the same on both ranks."""
    for rank in ranks:
        got = rank[case]
        for mine, theirs in zip(got["clean_norms"], got["ref_norms"], strict=True):
            assert _rel(mine, theirs) < 2e-6, (mine, theirs)
    assert ranks[0][case]["norms"] == ranks[1][case]["norms"]


@pytest.mark.parametrize("case", CASES)
def test_layer_norms_are_global_under_partitioning(ranks: list[dict[str, Any]], case: str) -> None:
    """Per-layer norms are the same on both ranks and the same as with whole grads (stage 0), also
    where a parameter's grad is split across the two ranks (stages 1-3)."""
    stage0 = ranks[0][case.replace(case[:6], "stage0")]["layer_norms"]
    for rank in ranks:
        layers = rank[case]["layer_norms"]
        assert layers.keys() == stage0.keys()
        for name, value in layers.items():
            assert _rel(value, stage0[name]) < 2e-6, (name, value, stage0[name])
        total = math.sqrt(sum(v * v for v in layers.values()))
        assert _rel(total, rank[case]["norms"][0]) < 2e-6


@pytest.mark.parametrize("case", CASES)
def test_huge_finite_grad_on_one_rank_is_clipped_like_deepspeed(ranks: list[dict[str, Any]], case: str) -> None:
    """A huge finite grad (loss x 1e6 on rank 0): not skipped, the norm DeepSpeed measures, and the
    guard's clip (max_norm 1) lands where DeepSpeed's gradient_clipping=1 does."""
    for rank in ranks:
        huge = rank[case]["huge"]
        assert not huge["skipped"]
        assert _rel(huge["norm"], huge["ds_norm"]) < 1e-6
        assert huge["params_close"]


@pytest.mark.parametrize("case", CASES)
def test_resume_through_deepspeed_checkpoint_is_exact(ranks: list[dict[str, Any]], case: str) -> None:
    """save_checkpoint (each rank's guard state in the client state), two steps, load_checkpoint, the
    same two steps: the same parameters and the same guard state, on every rank."""
    for rank in ranks:
        assert rank[case]["resume_exact"]
        assert rank[case]["resume_guard_state"], rank[case].get("guard_diff")


@pytest.mark.parametrize("case", CASES)
def test_rollback_restores_every_rank_partitions(ranks: list[dict[str, Any]], case: str) -> None:
    """Recovery: NaN on rank 1 only at steps 3 and 4 (diverged at the second skip). Both ranks roll back
    once, together, to the same snapshot: each rank's own partitions, fp32 masters, moments, LR scheduler
    and DeepSpeed's step counters bitwise what they were at it; the next step, fed the restored step's own
    batch, ends bitwise where that step first ended (the forward sees the restored weights); the run goes on."""
    got = [rank[case]["rollback"] for rank in ranks]
    for mine in got:
        assert mine["rollbacks"] == 1
        assert mine["restored"], mine.get("diff")
        assert mine["replayed"]
        assert mine["skipped"] == [False, False, False, True, True, False, False, False]
        assert mine["finite"]
    assert got[0]["restored_step"] == got[1]["restored_step"] and got[0]["at_step"] == got[1]["at_step"]


@pytest.mark.parametrize("stage", [2, 3])
def test_per_tensor_clipping_under_partitioning(ranks: list[dict[str, Any]], stage: int) -> None:
    """Per-tensor clipping (``per_tensor_adaptive``) with the grads partitioned: a huge grad on rank 0 only
    after the warm-up is clipped on both ranks, and the parameters end where they end at stage 0 (whole
    grads) within fp32 rounding: each tensor's norm is global, its pieces summed over the ranks."""
    reference = [x for t in ranks[0]["per-tensor-stage0"]["params"] for x in t]
    for rank in ranks:
        got = rank[f"per-tensor-stage{stage}"]
        assert got["clipped"] == [False, False, False, False, True]
        flat = [x for t in got["params"] for x in t]
        assert len(flat) == len(reference)
        assert all(abs(a - b) <= 1e-6 * max(abs(b), 1e-3) for a, b in zip(flat, reference, strict=True))


@pytest.mark.parametrize("stage", [2, 3])
def test_skip_under_gradient_accumulation(ranks: list[dict[str, Any]], stage: int) -> None:
    """Two micro-batches per step, a NaN in one micro-batch on rank 1 only: that step skipped on both
    ranks with the state unchanged, guard.step() None on the first micro-batch of each step, and the
    steps after it accumulating afresh (the end state bitwise DeepSpeed's alone over the clean steps)."""
    for rank in ranks:
        got = rank[f"accumulate-stage{stage}"]
        assert got["skipped"] == [False, True, False, False]
        assert got["unchanged"] == [True] and got["nones"] == 4
        assert got["end_equals_reference"]


@pytest.mark.parametrize("stage", [2, 3])
def test_user_rule_on_a_recorded_metric(ranks: list[dict[str, Any]], stage: int) -> None:
    """A user's SkipRule over ``sk.record("quality", ...)``, bad on rank 1 only at step 2: skipped on
    both ranks (reason quality_gate), the state unchanged; a metric recorded with reduce="sum" is
    logged agreed (1 + 2 = 3) on both ranks."""
    for rank in ranks:
        got = rank[f"rule-stage{stage}"]
        assert got["skipped"] == [False, False, True, False]
        assert got["reasons"][2] == "quality_gate" and got["unchanged"] == [True]
        assert got["rank_id_sums"] == [3.0]
        assert got["lrs"] == got["used"] and len(got["used"]) == 4  # stability/lr/0, the skipped step's too


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_is_deepspeeds_own_skip(ranks: list[dict[str, Any]], stage: int) -> None:
    """DeepSpeed's fp16 with its dynamic loss scaler (on the CPU through an accelerator that declares fp16):
    an overflow on rank 1 only is skipped by DeepSpeed's own step, reported as fp16_overflow on both ranks
    (the reduction has spread the inf to rank 0's grads), its scale halved once, counted once by
    DeepSpeed; a NaN loss on rank 0 only is the guard's skip, the scale untouched. Each clean norm is
    DeepSpeed's own (the grads' loss scale divided out), and the end state (parameters, fp32 masters,
    moments, scale, counters) is bitwise DeepSpeed's alone over the batches without the NaN loss: not a
    second skip, not a divergence."""
    for r, rank in enumerate(ranks):
        got = rank[f"fp16-stage{stage}"]
        assert got["reasons"][2] == "fp16_overflow"
        assert got["reasons"][4] == ("nonfinite_loss" if r == 0 else "fp16_overflow")  # rank 1: NaN grads, reduced
        assert [x is None for x in got["reasons"]] == [True, True, False, True, False, True]
        assert got["scales"] == [256.0, 256.0, 128.0, 128.0, 128.0, 128.0] and got["ref_scale"] == 128.0
        assert got["end_equals_reference"]
        assert got["skipped_steps"] == 1 and got["skipped"] == 2
        assert "diverged" not in got["kinds"] and "fp16_overflow" in got["kinds"]
        assert got["lrs"] == got["used"] and len(got["used"]) == 6  # stability/lr/0, on DeepSpeed's own skip too
        for mine, theirs in zip(got["norms"], got["ref_norms"], strict=True):
            assert _rel(mine, theirs) < 1e-6, (mine, theirs)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_rollback_restores_deepspeeds_loss_scaler(ranks: list[dict[str, Any]], stage: int) -> None:
    """Recovery in fp16: after an overflow halved DeepSpeed's scale, a NaN streak on rank 0 only diverges and
    both ranks roll back once to the same snapshot: partitions, fp32 masters, moments, counters and DeepSpeed's
    loss scaler (scale, iteration, last overflow, hysteresis) bitwise the snapshot's; the restored step's own
    batch (the overflow again) then ends bitwise where it ended the first time."""
    got = [rank[f"fp16-stage{stage}"] for rank in ranks]
    for mine in got:
        assert mine["rollbacks"] == 1 and mine["restored"] and mine["replayed"]
    assert got[0]["restored_step"] == got[1]["restored_step"] == 6


def test_deepspeed_alone_applies_a_nan_step_at_stage_0(ranks: list[dict[str, Any]]) -> None:
    """Why the guard is there: DeepSpeed alone at ZeRO stage 0 in fp32 applies rank 1's NaN step and
    every parameter on both ranks is NaN, where the guarded run (above) skips it and stays finite."""
    for rank in ranks:
        assert not rank["stage0-fp32"]["unguarded"]["params_finite"]
        assert rank["stage0-fp32"]["skipped"][2]


def test_two_clippers_are_refused(ranks: list[dict[str, Any]]) -> None:
    message = ranks[0]["refusals"]["two_clippers"]
    assert "gradient_clipping" in message and "ClipConfig(mode='off')" in message


def test_rerun_is_refused_with_deepspeeds_fp16_and_under_a_frameworks_deepspeed_integration(
    ranks: list[dict[str, Any]],
) -> None:
    fp16, framework = ranks[0]["fp16-rerun-refused"], ranks[0]["refusals"]["rerun_framework"]
    assert "StabilityConfig.rerun" in fp16 and "DeepSpeed's fp16" in fp16
    assert "StabilityConfig.rerun" in framework and "deepspeed=" in framework


@pytest.fixture(scope="module")
def hf_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One torchrun launch of tests/hf_deepspeed_script.py: the ZeRO-2 run with its resumes, then every cell."""
    script = Path(__file__).parent / "hf_deepspeed_script.py"
    out = tmp_path_factory.mktemp("hf_deepspeed")
    env = {"DS_ACCELERATOR": "cpu", "SK_HF_CELLS": ",".join(HF_CELLS), "SK_HF_RECOVERY": ",".join(HF_RECOVERY)}
    return run_torchrun(script, 2, out, timeout=1500 if FULL else limit("hf_deepspeed_script"), **env)


#: The first test to use hf_ranks waits for the launch (tests/time_limits.py).
_HF_TIMEOUT = pytest.mark.timeout(1800 if FULL else timeout_for("hf_deepspeed_script"))


@_HF_TIMEOUT
def test_hf_trainer_with_deepspeed_is_stabilized(hf_ranks: list[dict[str, Any]]) -> None:
    """``stabilize(trainer, cfg)`` on the real HF Trainer with ``deepspeed=`` (ZeRO-2, 2 processes under
    ``torchrun``): rank 1's NaN step is skipped on both ranks (DeepSpeed's engine does not count it),
    the replicas end finite and identical, the guard's rows are in ``log_history``, and two clippers
    (``max_grad_norm`` with ``ClipConfig``) are refused by name. Resume: a second Trainer resumed from the
    step-4 checkpoint (``resume_from_checkpoint``) ends bitwise where the first ended, with every rank's
    own guard state back (the skip before the checkpoint counted) and equal to the first run's at the end;
    with ``restore_callback_states_from_checkpoint=True`` the attached callback gets the state step 8 saved."""
    ranks = hf_ranks
    for rank in ranks:
        assert rank["callback"] == "DeepSpeedTrainerCallback"
        assert rank["skipped"] == [3]
        assert rank["global_steps"] == 7  # 8 steps, the skipped one not counted by DeepSpeed
        assert rank["finite"] and rank["rows"] >= 3
        assert rank["resume_exact"] and rank["resume_guard_state"]
        assert rank["resume_skipped"] == 1 and rank["resume_global_steps"] == 7
        assert rank["restored_into_attached"] and rank["restored_state"]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert "max_grad_norm=0" in ranks[0]["refused"]


@_HF_TIMEOUT
@pytest.mark.parametrize("cell", HF_CELLS)
def test_hf_trainer_fault_on_one_rank(hf_ranks: list[dict[str, Any]], cell: str) -> None:
    """The HF Trainer with ``deepspeed=`` and ``stabilize``, a fault on one rank only at the second of 4 steps
    (NaN loss on rank 1, Inf loss on rank 0, a huge finite grad on rank 1): the same decision and the same norm
    on every rank. NaN and Inf: that step skipped on both ranks with the state (partitions, fp32 masters,
    moments, LR scheduler, DeepSpeed's counters) bitwise unchanged, the run ending bitwise where the Trainer
    without the guard ends over the batches without that step, each clean norm DeepSpeed's own there. Huge:
    not skipped, clipped, its norm DeepSpeed's, the state after it where DeepSpeed's gradient_clipping puts it."""
    got = [rank["cells"][cell] for rank in hf_ranks]
    fault = cell.rsplit("-", 1)[1]
    for mine in got:
        assert len(mine["skipped"]) == HF_CELL_STEPS
        assert mine["skipped"] == [fault != "huge" and k == HF_FAULT_STEP for k in range(HF_CELL_STEPS)]
        if fault == "huge":
            assert mine["clipped"] and mine["params_close"] and mine["global_steps"] == HF_CELL_STEPS
            compared = list(zip(mine["norms"][: HF_FAULT_STEP + 1], mine["ds_norms"], strict=False))
        else:
            assert mine["unchanged_by_skip"] == [True], mine["diff"]
            assert mine["end_equals_reference"], mine.get("end_diff")
            assert mine["global_steps"] == HF_CELL_STEPS - 1
            clean = [n for k, n in enumerate(mine["norms"]) if k != HF_FAULT_STEP]
            compared = list(zip(clean, mine["ds_norms"], strict=True))
        for ours, theirs in compared:  # stage 0 in fp32: DeepSpeed computes no norm
            assert theirs is None or _rel(ours, theirs) < 2e-6, (ours, theirs)
    assert got[0]["skipped"] == got[1]["skipped"] and got[0]["norms"] == got[1]["norms"]
    assert got[0]["digest"] == got[1]["digest"]


@_HF_TIMEOUT
@pytest.mark.parametrize("cell", HF_RECOVERY)
def test_hf_trainer_rollback_on_every_rank(hf_ranks: list[dict[str, Any]], cell: str) -> None:
    """Recovery under the HF Trainer with ``deepspeed=``: a NaN loss on rank 1 only at two steps in a row
    (diverged). Every rank rolls back once, at the same step, to the same snapshot, its state bitwise the
    snapshot's; the Trainer runs on to its last step, every rank's parameters finite and equal."""
    got = [rank["recovery"][cell] for rank in hf_ranks]
    for mine in got:
        assert mine["rollbacks"] == 1 and mine["restored"]
        assert mine["skipped"] == [False, False, False, True, True, False, False, False]
        assert mine["global_step"] == 8 and mine["finite"]
    assert got[0]["at_step"] == got[1]["at_step"] and got[0]["restored_step"] == got[1]["restored_step"]
    assert got[0]["digest"] == got[1]["digest"]


def _tiny_module(bad_step: int | None = None) -> Any:
    import lightning.pytorch as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.net(batch[0]).pow(2).mean()
            return loss * float("nan") if batch_idx == bad_step else loss

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(32, 4))
            return torch.utils.data.DataLoader(data, batch_size=4)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny()


def test_lightning_deepspeed_strategy_needs_cuda(tmp_path: Path) -> None:
    """What the DeepSpeed guide says: Lightning's DeepSpeedStrategy refuses any accelerator but CUDA, so
    DeepSpeedStabilityCallback under it is tested in tests/cuda only."""
    import lightning.pytorch as pl

    from stabilitykit.integrations.deepspeed_lightning import DeepSpeedStabilityCallback

    trainer = pl.Trainer(
        strategy="deepspeed_stage_2",
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[DeepSpeedStabilityCallback()],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        trainer.fit(_tiny_module())


def test_lightning_deepspeed_callback_names_the_strategy_it_needs(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from stabilitykit.integrations.deepspeed_lightning import DeepSpeedStabilityCallback

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[DeepSpeedStabilityCallback()],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(TypeError, match=r"DeepSpeedStrategy.*StabilityCallback"):
        trainer.fit(_tiny_module())


@pytest.mark.parametrize("case", ["stage0-fp32", "stage2-fp32", "stage3-bf16"])
def test_rerun_judges_a_one_time_fault_transient_and_a_repeated_one_reproducible(
    ranks: list[dict[str, Any]], case: str
) -> None:
    """``guard.step(replay=...)`` with rerun on, a NaN loss at step 1 on rank 1 only: once, it is transient (rank 1
    named, the recomputed step taken, the end state bitwise DeepSpeed's own over the clean batches); every time
    it is computed, reproducible (skipped on both ranks, the end state DeepSpeed's over the other batches). A
    one-time NaN in rank 1's local gradient: transient, the step taken; at ZeRO 0 rank 1 named (measured after
    accumulation, before DeepSpeed's all-reduce), at ZeRO 2 and 3 rank None (see the rerun guide)."""
    for rank in ranks:
        cell = rank[case]["rerun"]
        assert cell["transient"]["events"] == [[1, "transient", 1]]
        assert cell["transient"]["skipped"] == []
        assert cell["transient"]["same"], cell["transient"]["diff"]
        assert cell["transient"]["rng_same"] and cell["local-grad"]["rng_same"]  # the rerun's forward drew as the first
        assert cell["reproducible"]["events"] == [[1, "reproducible", None]]
        assert cell["reproducible"]["skipped"] == [1]
        assert cell["reproducible"]["same"], cell["reproducible"]["diff"]
        # a one-time NaN in rank 1's local gradient: at ZeRO 2 and 3 reduced into every rank's partitions before
        # any point the guard can measure it, so no rank is named; transient, the step taken
        assert cell["local-grad"]["events"] == [[1, "transient", 1 if case == "stage0-fp32" else None]]
        assert cell["local-grad"]["skipped"] == []
        assert cell["local-grad"]["same"], cell["local-grad"]["diff"]


@pytest.mark.skipif(not FULL, reason="500 clean steps per rerun cell: set STABILITYKIT_FULL_MATRIX=1")
@pytest.mark.parametrize("case", ["stage0-fp32", "stage2-fp32", "stage3-bf16"])
def test_clean_runs_report_nothing_with_rerun_and_replica_checks(ranks: list[dict[str, Any]], case: str) -> None:
    """500 clean steps on 2 processes, rerun on (``replay`` given, skip-on-spike on), a replica check every 5
    steps: no rerun, no replica_mismatch, no skip on either rank."""
    for rank in ranks:
        got = rank[case]["clean-long"]
        assert got["events"] == [] and (got["steps"], got["skipped"]) == (500, 0), got
