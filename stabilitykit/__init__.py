"""stabilitykit: keep PyTorch training runs finite and warn before they diverge.

``import stabilitykit`` needs only torch and pydantic. Lightning (``stabilitykit.lightning``) and
W&B (``stabilitykit.sinks.WandbSink``) are optional extras imported on first use.
"""

from __future__ import annotations

from stabilitykit import sinks
from stabilitykit.config import (
    ClipConfig,
    GradNormConfig,
    NaNTraceConfig,
    SkipConfig,
    SpikeConfig,
    StabilityConfig,
)
from stabilitykit.engine import StabilityEngine
from stabilitykit.events import BadBatchError, Event, TrainingDivergedError
from stabilitykit.grads import clip_grad_norm_, grad_norms
from stabilitykit.guard import StabilityGuard
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NaNTracer, NonFiniteRecord, check_batch
from stabilitykit.report import StepReport

__version__ = "0.1.0"

__all__ = [
    "BadBatchError",
    "ClipConfig",
    "Event",
    "GradNormConfig",
    "HookManager",
    "NaNTraceConfig",
    "NaNTracer",
    "NonFiniteRecord",
    "SkipConfig",
    "SpikeConfig",
    "StabilityConfig",
    "StabilityEngine",
    "StabilityGuard",
    "StepReport",
    "TrainingDivergedError",
    "__version__",
    "check_batch",
    "clip_grad_norm_",
    "grad_norms",
    "sinks",
]
