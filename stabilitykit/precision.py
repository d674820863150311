"""Capability-based precision choice (bf16 / fp16 + GradScaler / fp32, TF32) and determinism knobs.

``select_precision()`` looks at the device and returns what to train with and why: bf16 autocast
on Ampere and newer GPUs (no loss scaling needed), fp16 autocast with a GradScaler on Volta and
Turing, fp32 where neither helps; on the CPU bf16 autocast where the CPU build supports it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from stabilitykit.section import Section


class PrecisionConfig(Section):
    """Precision knobs the drivers apply when they start (they do not own autocast: see sk.select_precision)."""

    report_choice: bool = Field(
        False,
        description=(
            "Add sk.select_precision()'s advice for the model's device to the start-of-run 'precision' event "
            "(which always says what the run uses: parameter dtypes, whether a GradScaler scales the loss)."
        ),
    )
    tf32: bool = Field(False, description="Call sk.configure_tf32() (matmul precision 'high' unless already chosen).")
    deterministic_seed: int | None = Field(None, description="Call sk.set_determinism(seed) before training.")


log = logging.getLogger("stabilitykit")
_LOGGED: set[str] = set()


@dataclass(frozen=True)
class PrecisionChoice:
    """What to train with on one device, and why."""

    device: str
    amp_dtype: torch.dtype | None  # None: no autocast (fp32)
    use_grad_scaler: bool
    tf32: bool
    lightning_precision: str  # the matching ``Trainer(precision=...)``
    reason: str
    #: Whether this device can train linear layers in FP8 with torchao (compute capability 8.9 or
    #: newer and torchao importable). Reported, never chosen: FP8 is a model change (a module swap).
    fp8_capable: bool = False
    #: The torchao recipe this project tested ("tensorwise": dynamic per-tensor scales, e4m3 input
    #: and weight, e5m2 output gradient) when ``fp8_capable``, else None.
    fp8_recipe: str | None = None
    #: Why FP8 is or is not available here, in words.
    fp8_reason: str = ""

    def autocast(self) -> Any:
        """A ready ``torch.autocast`` context for this choice (a no-op context for fp32)."""
        enabled = self.amp_dtype is not None
        device_type = self.device.split(":", 1)[0]
        return torch.autocast(device_type, dtype=self.amp_dtype or torch.float32, enabled=enabled)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only when this choice needs loss scaling (fp16)."""
        return torch.amp.GradScaler(self.device.split(":", 1)[0], enabled=self.use_grad_scaler)


def _cpu_supports_bf16() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.ones(2, 2) @ torch.ones(2, 2)
        return out.dtype == torch.bfloat16
    except (RuntimeError, AssertionError):
        return False


def select_precision(device: str | torch.device | None = None, log_choice: bool = True) -> PrecisionChoice:
    """The precision to train with on ``device`` (default: the current CUDA device, else the CPU).

    This is advice for a run not started yet; the drivers never call it unless asked
    (``PrecisionConfig(report_choice=True)``). It is logged once per device on the ``stabilitykit``
    logger.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"select_precision: device {dev} requested but CUDA is not available")
        major, minor = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
        if major >= 8 and torch.cuda.is_bf16_supported():
            choice = PrecisionChoice(
                str(dev),
                torch.bfloat16,
                False,
                True,
                "bf16-mixed",
                f"{name} (sm_{major}{minor}) has native bf16: same range as fp32, no loss scaling; TF32 matmuls on",
            )
        elif major >= 7:
            choice = PrecisionChoice(
                str(dev),
                torch.float16,
                True,
                False,
                "16-mixed",
                f"{name} (sm_{major}{minor}) has fp16 tensor cores but no bf16: fp16 autocast with a GradScaler",
            )
        else:
            choice = PrecisionChoice(
                str(dev),
                None,
                False,
                False,
                "32-true",
                f"{name} (sm_{major}{minor}) has no fast half precision: fp32",
            )
    elif dev.type == "cpu":
        if _cpu_supports_bf16():
            choice = PrecisionChoice(
                "cpu",
                torch.bfloat16,
                False,
                False,
                "bf16-mixed",
                "CPU autocast supports bf16: halves activation memory, no loss scaling needed",
            )
        else:
            choice = PrecisionChoice("cpu", None, False, False, "32-true", "this CPU build has no bf16 autocast: fp32")
    else:
        choice = PrecisionChoice(str(dev), None, False, False, "32-true", f"no precision rule for {dev.type}: fp32")
    choice = dataclasses.replace(choice, **_fp8_capability(dev))
    if log_choice and choice.device not in _LOGGED:
        _LOGGED.add(choice.device)
        log.info("precision advice for %s: %s (%s)", choice.device, choice.lightning_precision, choice.reason)
    return choice


def _fp8_capability(dev: torch.device) -> dict[str, Any]:
    """FP8 training with torchao on ``dev``: possible (cc 8.9+ and torchao importable), with the tested recipe."""
    from stabilitykit.compat import torchao_float8

    if dev.type != "cuda":
        return {"fp8_reason": f"no FP8 matmuls on {dev.type} (torchao can only emulate them: for measuring, not speed)"}
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        return {"fp8_reason": f"sm_{major}{minor} has no FP8 tensor cores (compute capability 8.9 or newer needed)"}
    if not torchao_float8.available():
        return {"fp8_reason": f"sm_{major}{minor} has FP8 tensor cores; {torchao_float8.INSTALL_HINT}"}
    return {
        "fp8_capable": True,
        "fp8_recipe": torchao_float8.TESTED_RECIPE,
        "fp8_reason": (
            f"sm_{major}{minor} has FP8 tensor cores and torchao is installed: convert_to_float8_training "
            f"(recipe '{torchao_float8.TESTED_RECIPE}') pays off on large linear layers; watch it with "
            "MonitorConfig's FP8 monitors"
        ),
    }


def configure_tf32() -> bool:
    """Allow TF32 matmuls (float32 matmul precision "high") only if the user has not chosen already.

    Returns True when it changed the setting, False when the precision was not "highest".
    """
    if torch.get_float32_matmul_precision() != "highest":
        return False
    torch.set_float32_matmul_precision("high")
    if hasattr(torch.backends, "cudnn"):
        torch.backends.cudnn.allow_tf32 = True
    return True


def set_determinism(seed: int, warn_only: bool = False) -> dict[str, Any]:
    """Seed every generator and ask torch for deterministic kernels; returns what was set.

    Sets Python's, NumPy's (when installed) and torch's seeds, ``torch.use_deterministic_algorithms``,
    cuDNN's deterministic/benchmark flags, and ``CUBLAS_WORKSPACE_CONFIG`` (needed by cuBLAS for
    deterministic matmuls; it must be set before the first CUDA call to take effect).
    """
    applied: dict[str, Any] = {"seed": seed}
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
        applied["numpy_seed"] = seed % 2**32
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    applied["CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    applied["deterministic_algorithms"] = True if not warn_only else "warn_only"
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    applied["cudnn.deterministic"] = True
    applied["cudnn.benchmark"] = False
    log.info("determinism: %s", applied)
    return applied


def describe_run(device: torch.device | str, scaler_enabled: bool, params: Any = ()) -> dict[str, Any]:
    """What this run trains with, as far as the driver can see it: parameter dtypes and loss scaling.

    Autocast is entered by the user's code around each forward, so its dtype is not known here;
    a GradScaler that scales means fp16 training, and that is said plainly.
    """
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    return {
        "device": str(device),
        "param_dtype": "/".join(dtypes) if dtypes else None,
        "grad_scaler": bool(scaler_enabled),
    }


def _run_message(run: dict[str, Any]) -> str:
    params = f"{run['param_dtype']} parameters" if run["param_dtype"] else "parameters"
    scaling = "a GradScaler scales the loss (fp16 mixed precision)" if run["grad_scaler"] else "no loss scaling"
    return f"{params}, {scaling}"


def apply_precision_config(
    config: Any, device: torch.device, hooks: Any, scaler_enabled: bool = False, params: Any = ()
) -> PrecisionChoice | None:
    """What ``StabilityConfig.precision`` asks the drivers to do at start; emits one "precision" event.

    The event says what the run uses (parameter dtypes, whether a GradScaler scales the loss).
    Advice (``sk.select_precision()`` for the device) is added only when asked
    (``PrecisionConfig(report_choice=True)``), under ``advice``, and never in place of the facts.
    """
    from stabilitykit.events import Event

    details: dict[str, Any] = {}
    if config.deterministic_seed is not None:
        details["determinism"] = set_determinism(config.deterministic_seed)
    if config.tf32:
        details["tf32_set"] = configure_tf32()
    run = describe_run(device, scaler_enabled, params)
    details.update(run)
    message = f"{run['device']}: {_run_message(run)}"
    log.info("precision on %s", message)
    choice = None
    if config.report_choice:
        choice = select_precision(device, log_choice=False)
        details["advice"] = {
            "amp_dtype": str(choice.amp_dtype).replace("torch.", "") if choice.amp_dtype else None,
            "use_grad_scaler": choice.use_grad_scaler,
            "lightning_precision": choice.lightning_precision,
            "reason": choice.reason,
            "fp8_capable": choice.fp8_capable,
            "fp8_recipe": choice.fp8_recipe,
            "fp8_reason": choice.fp8_reason,
        }
        message += f"; advice for this device: {choice.lightning_precision} ({choice.reason})"
        log.info("precision advice for %s: %s (%s)", choice.device, choice.lightning_precision, choice.reason)
    hooks.emit(Event("precision", 0, message, details))
    return choice
