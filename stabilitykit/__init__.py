"""stabilitykit: keep PyTorch training runs finite and warn before they diverge.

``import stabilitykit`` needs only torch and pydantic. Lightning (``stabilitykit.lightning``) and
W&B (``stabilitykit.sinks.WandbSink``) are optional extras imported on first use.
"""

from __future__ import annotations

from stabilitykit import nn, precision_eval, sinks, testing
from stabilitykit.config import (
    ClipConfig,
    DataGuardConfig,
    Fp8MonitorConfig,
    Fp16Config,
    GradNormConfig,
    MonitorConfig,
    NaNTraceConfig,
    PrecisionConfig,
    QKClipConfig,
    RecoveryConfig,
    ReplicaCheckConfig,
    RerunConfig,
    SkipConfig,
    SpikeConfig,
    StabilityConfig,
)
from stabilitykit.dashboard import wandb_dashboard
from stabilitykit.drivers.base import record
from stabilitykit.drivers.loop import StabilityGuard
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.events import (
    BadBatchError,
    Event,
    ReplicaMismatchError,
    RollbackLimitError,
    SnapshotUnavailableError,
    TrainingDivergedError,
    TransientFaultError,
)
from stabilitykit.grads import clip_grad_norm_, grad_norms
from stabilitykit.hooks import HookManager
from stabilitykit.monitors.routers import RouterConfig
from stabilitykit.nan import NaNTracer, NonFiniteRecord, batch_is_bad, check_batch, replay_nonfinite
from stabilitykit.precision import PrecisionChoice, configure_tf32, select_precision, set_determinism
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipContext, SkipRule, StepValues
from stabilitykit.run_log import RunSummary

__version__ = "0.1.0"

__all__ = [
    "BadBatchError",
    "ClipConfig",
    "DataGuardConfig",
    "Event",
    "Fp8MonitorConfig",
    "Fp16Config",
    "GradNormConfig",
    "HookManager",
    "MonitorConfig",
    "NaNTraceConfig",
    "NaNTracer",
    "NonFiniteRecord",
    "PrecisionChoice",
    "PrecisionConfig",
    "QKClipConfig",
    "RecoveryConfig",
    "ReplicaCheckConfig",
    "ReplicaMismatchError",
    "RerunConfig",
    "RollbackLimitError",
    "RouterConfig",
    "RunSummary",
    "SkipConfig",
    "SkipContext",
    "SkipRule",
    "SnapshotUnavailableError",
    "SpikeConfig",
    "StabilityConfig",
    "StabilityEngine",
    "StabilityGuard",
    "StepReport",
    "StepValues",
    "TrainingDivergedError",
    "TransientFaultError",
    "__version__",
    "batch_is_bad",
    "check_batch",
    "clip_grad_norm_",
    "configure_tf32",
    "grad_norms",
    "nn",
    "precision_eval",
    "record",
    "replay_nonfinite",
    "select_precision",
    "set_determinism",
    "sinks",
    "testing",
    "wandb_dashboard",
]
