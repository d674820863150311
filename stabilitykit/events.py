"""Events the engine emits (spikes, skips, non-finite values, divergence) and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Every event kind the engine emits; ``HookManager.on`` accepts these and ``"*"``.
EVENT_KINDS = (
    "spike_warning",
    "spike_alert",
    "loss_spike",
    "nonfinite",
    "skipped",
    "clipped",
    "diverged",
    "fp16_overflow",
    "fp16_warning",
    "precision",
    "bad_batch",
    "rollback",
    "fp8_warning",
    "rerun",
    "replica_mismatch",
    "router_collapse",
    "recovery",
)


@dataclass
class Event:
    """Something a person should know about: what happened, at which optimizer step, and details."""

    kind: str
    step: int
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping: kind, step, message and the details."""
        return {"kind": self.kind, "step": self.step, "message": self.message, **self.details}

    def __str__(self) -> str:
        return f"[{self.kind} @ step {self.step}] {self.message}"


class TrainingDivergedError(RuntimeError):
    """Raised after too many consecutive skipped steps: the run is not recovering by itself."""

    def __init__(self, step: int, consecutive: int, layer: str | None, reason: str | None) -> None:
        self.step = step
        self.consecutive = consecutive
        self.layer = layer
        self.reason = reason
        where = f"; first non-finite layer: {layer}" if layer else ""
        super().__init__(
            f"training diverged at step {step}: {consecutive} consecutive steps skipped "
            f"(reason: {reason or 'non-finite'}){where}. Lower the learning rate, enable clipping, "
            "or resume from an earlier checkpoint."
        )


class RollbackLimitError(TrainingDivergedError):
    """Raised when recovery gives up: a divergence after ``max_rollbacks`` rollbacks within ``window`` steps that
    lowering the learning rate did not fix (``RecoveryConfig.lr_backoff``; ``tried`` says what was tried).

    ``last_good_step``: the step of the last healthy snapshot, which ``guard.restore_last_good()`` puts
    back; ``last_good_path``: its file (``last-good-<step>.pt``), when it could be kept on disk.
    """

    def __init__(
        self,
        step: int,
        rollbacks: int,
        window: int,
        trigger: str,
        clipping: bool = False,
        last_good_step: int | None = None,
        last_good_path: str | None = None,
        tried: str | None = None,
    ) -> None:
        self.step = step
        self.consecutive = 0
        self.layer = None
        self.reason = "rollback_limit"
        self.tried = tried
        self.rollbacks = rollbacks
        self.window = window
        self.trigger = trigger
        self.last_good_step = last_good_step
        self.last_good_path = last_good_path
        advice = "Lower the learning rate, " + ("" if clipping else "enable clipping, ")
        kept = ""
        if last_good_step is not None:
            kept = f" The last healthy state (before step {last_good_step}) is restored by guard.restore_last_good()"
            kept += f" and kept in {last_good_path}." if last_good_path else "."
        lowered = f" Lowering the learning rate did not help ({tried})." if tried else ""
        RuntimeError.__init__(
            self,
            f"training diverged at step {step}: {trigger} again after {rollbacks} rollback(s) within {window} "
            f"steps (RecoveryConfig.max_rollbacks).{lowered} {advice}or inspect the skipped data ranges "
            f"(skipped_batches.json).{kept}",
        )


class SnapshotUnavailableError(TrainingDivergedError):
    """Raised when a rollback is due and every snapshot it could restore is missing or damaged.

    Nothing was restored: the parameters and optimizer are as the trigger found them. ``files``: the
    snapshot files that could not be restored, each with what is wrong with it.
    """

    def __init__(self, step: int, trigger: str, problems: list[str]) -> None:
        self.step = step
        self.consecutive = 0
        self.layer = None
        self.reason = "snapshot_unavailable"
        self.trigger = trigger
        self.files = problems
        RuntimeError.__init__(
            self,
            f"training diverged at step {step}: {trigger}, and no snapshot could be restored: "
            + "; ".join(problems)
            + ". Nothing was restored; resume from an earlier checkpoint.",
        )


class BadBatchError(ValueError):
    """A batch holds values that cannot be trained on; the message names the path inside the batch."""

    def __init__(self, path: str, problem: str, step: int | None = None) -> None:
        self.path = path
        self.problem = problem
        self.step = step
        at = f" at step {step}" if step is not None else ""
        super().__init__(f"bad batch{at}: {path} {problem}")


class TransientFaultError(RuntimeError):
    """Raised when one rank's computation went wrong and came out right when recomputed too often
    (``RerunConfig.max_transient``): a device that keeps corrupting its results."""

    def __init__(self, step: int, rank: int | None, count: int) -> None:
        self.step = step
        self.rank = rank
        self.count = count
        who = f"rank {rank}" if rank is not None else "an unnamed rank"
        super().__init__(
            f"step {step}: {count} transient faults on {who} (a step whose recomputation gave other values): "
            "the device is unreliable. Take it out of the job (its host is in the rerun record) and resume "
            "from the last checkpoint"
        )


class ReplicaMismatchError(RuntimeError):
    """Raised by ``ReplicaCheckConfig(on_mismatch="raise")`` when a data-parallel replica holds other weights."""

    def __init__(self, step: int, rank: int, tensor: str) -> None:
        self.step = step
        self.rank = rank
        self.tensor = tensor
        super().__init__(
            f"after step {step}: rank {rank} holds another {tensor} than its replicas (a silent corruption). "
            "Resume from the last checkpoint, or broadcast the weights from a healthy replica"
        )
