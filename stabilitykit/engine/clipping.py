"""Clipping strategies, each owning its state: a fixed max norm, an adaptive threshold, or per tensor.

A global strategy turns this step's total norm into a threshold and says whether it applies; the
engine turns that into one clip coefficient and multiplies the grads in place. The per-tensor
strategy (AdaGC) turns the vector of per-tensor norms into a vector of coefficients instead.
Everything stays on the device; a non-finite norm never enters the adaptive statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from pydantic import Field, field_validator
from torch import Tensor

from stabilitykit.grads import NormResult, clip_coefficient
from stabilitykit.section import Section


class ClipConfig(Section):
    """Gradient clipping: off, a fixed max_norm, an adaptive global threshold, or per-tensor adaptive (AdaGC)."""

    @field_validator("max_norm", mode="before")
    @classmethod
    def _zero_means_off_elsewhere(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise ValueError(
                "max_norm=0 is how nanoGPT and the Hugging Face Trainer say 'no clipping'; here that is "
                "ClipConfig(mode='off')"
            )
        return value

    mode: Literal["off", "fixed", "adaptive", "per_tensor_adaptive"] = Field(
        "off",
        description=(
            "Clipping mode. 'fixed': clip the total norm to max_norm. 'adaptive': clip the total norm to "
            "mean + z_threshold * std of its EMAs. 'per_tensor_adaptive' (AdaGC): clip each parameter tensor to "
            "per_tensor_ratio times the EMA of its own past clipped norms."
        ),
    )
    max_norm: float = Field(1.0, gt=0, description="Fixed mode: the largest total grad norm after clipping.")
    z_threshold: float = Field(2.5, gt=0, description="Adaptive mode: clip norms above mean + z_threshold * std.")
    ema_decay: float = Field(0.97, gt=0, lt=1, description="Adaptive mode: EMA decay of the norm mean and variance.")
    warmup_steps: int = Field(
        25,
        ge=1,
        description=(
            "Adaptive modes: finite steps that only collect statistics before the adaptive threshold applies "
            "(per_tensor_adaptive: finite steps the engine did not skip; each tensor's threshold starts from its "
            "smallest clipped norm in them)."
        ),
    )
    warmup_max_norm: float | None = Field(
        None,
        gt=0,
        description=(
            "Adaptive modes: fixed max_norm of the total norm during warmup (None: no clipping during warmup). "
            "per_tensor_adaptive: AdaGC's lambda_abs (1.0 is the usual choice)."
        ),
    )
    per_tensor_ratio: float = Field(
        1.05,
        ge=1,
        allow_inf_nan=False,
        description=(
            "per_tensor_adaptive (AdaGC's lambda_rel): a tensor whose norm exceeds this times its EMA is scaled "
            "down to exactly that; at least 1 (below 1 every step is clipped and the thresholds shrink to 0)."
        ),
    )
    per_tensor_decay: float = Field(
        0.98,
        gt=0,
        lt=1,
        description="per_tensor_adaptive (AdaGC's beta): EMA decay of each tensor's clipped norm.",
    )


class ClipStrategy(Protocol):
    """Decides the clipping threshold of each step."""

    #: ``threshold`` always says active (a fixed max norm): the engine skips selecting on the flag.
    always_active: bool

    def threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """``(threshold, active)``: 0-d device tensors; grads are clipped to ``threshold`` when ``active``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (device tensors allowed)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


class FixedClip:
    """Clip to ``max_norm`` on every step."""

    always_active = True

    def __init__(self, max_norm: float, device: torch.device) -> None:
        self._threshold = torch.full((), max_norm, dtype=torch.float32, device=device)
        self._active = torch.ones((), dtype=torch.bool, device=device)

    def threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """The fixed threshold, always active."""
        return self._threshold, self._active

    def state_dict(self) -> dict[str, Any]:
        """Nothing to keep: the threshold comes from the config."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class AdaptiveClip:
    """ZClip-class threshold ``mean + z * std`` from EMAs of the total norm.

    The statistics take the clipped value, so a spike cannot poison them; NaN/Inf never enter.
    """

    always_active = False

    def __init__(self, config: ClipConfig, device: torch.device) -> None:
        self.config = config
        self.mean = torch.zeros((), dtype=torch.float32, device=device)
        self.var = torch.zeros((), dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)

    def threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """This step's threshold from the statistics so far, then fold the (clipped) norm in."""
        cfg = self.config
        warmed = self.count >= cfg.warmup_steps
        threshold = self.mean + cfg.z_threshold * self.var.clamp(min=0).sqrt()
        fallback = cfg.warmup_max_norm if cfg.warmup_max_norm is not None else math.inf
        threshold = torch.where(warmed, threshold, fallback)
        active = warmed if cfg.warmup_max_norm is None else torch.ones_like(warmed)
        value = torch.where(finite, torch.where(warmed, torch.minimum(total, threshold), total), self.mean)
        a = cfg.ema_decay
        first = self.count == 0
        delta = value - self.mean
        new_mean = torch.where(first, value, self.mean + (1 - a) * delta)
        new_var = torch.where(first, 0.0, a * (self.var + (1 - a) * delta * delta))
        self.mean = torch.where(finite, new_mean, self.mean)
        self.var = torch.where(finite, new_var, self.var)
        self.count = self.count + finite
        return threshold, active

    def state_dict(self) -> dict[str, Any]:
        """The EMAs and the count (device tensors, cloned)."""
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the EMAs and count onto this strategy's device."""
        self.mean = state["mean"].to(self.mean).clone()
        self.var = state["var"].to(self.var).clone()
        self.count = state["count"].to(self.count).clone()


@dataclass
class TensorClip:
    """One step of per-tensor clipping: what to multiply each grad by, and the journal's two columns."""

    coefs: Tensor  # (n_tensors,) in the plan's parameter order
    coef: Tensor  # 0-d: post-clip total norm / pre-clip total norm (< 1 exactly when a tensor was clipped)
    threshold: Tensor  # 0-d: the warmup max norm, then the p-norm of the per-tensor thresholds


#: The largest fp32 below 1: the journal's ``coef`` of a step where some tensor was clipped is at most this.
_BELOW_ONE = 1.0 - 2.0**-24


class PerTensorClip:
    """AdaGC (arXiv 2502.11034): each tensor clipped against an EMA of its own past clipped norms.

    The statistics are one device vector ``gamma`` (one entry per parameter tensor). Warmup
    (``warmup_steps`` accepted steps): the total norm is clipped to ``warmup_max_norm`` (when set)
    and ``gamma_i`` keeps the smallest clipped norm of tensor ``i``. Then a tensor whose norm exceeds
    ``per_tensor_ratio * gamma_i`` is scaled to exactly that, and ``gamma_i`` takes its clipped norm
    with weight ``1 - per_tensor_decay``. Only accepted steps (finite grads and loss, not skipped by
    the engine) update the statistics, and only for tensors with a non-zero grad: a zero norm carries
    no scale, and a zero ``gamma`` would freeze a tensor for good (a zero-initialised LoRA ``B`` gives
    ``A`` a zero grad on its first step). A tensor without statistics yet is not clipped; its first
    accepted norm starts them.
    """

    def __init__(self, config: ClipConfig, n_tensors: int, device: torch.device, norm_type: float = 2.0) -> None:
        if n_tensors < 1:
            raise ValueError(f"per-tensor clipping needs at least one parameter tensor, got {n_tensors}")
        self.config = config
        self.n_tensors = n_tensors
        self.norm_type = float(norm_type)
        self.gamma = torch.zeros(n_tensors, dtype=torch.float32, device=device)
        self.seen = torch.zeros(n_tensors, dtype=torch.bool, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        limit = config.warmup_max_norm
        self._warmup_threshold = torch.full((), limit if limit is not None else math.inf, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)

    def _total(self, norms: Tensor) -> Tensor:
        """The p-norm of a vector of per-tensor p-norms (their combined norm)."""
        p = self.norm_type
        if p == math.inf:
            return norms.amax() if norms.numel() else torch.zeros((), device=norms.device)
        return norms.pow(p).sum().pow(1.0 / p)

    def clip_tensors(self, norms: NormResult, accept: Tensor) -> TensorClip:
        """This step's per-tensor coefficients from the statistics so far, then fold the clipped norms in.

        ``norms``: from a ``per_tensor`` plan (global per-tensor norms). ``accept``: 0-d bool, this step
        is finite and not skipped, so its norms may enter the statistics.
        """
        cfg = self.config
        tensor_norms, present = norms.tensor_norms, norms.tensor_present
        if tensor_norms is None or present is None:
            raise ValueError("per-tensor clipping needs per-tensor norms: build the GradNormPlan with per_tensor=True")
        if tensor_norms.shape != self.gamma.shape:
            got = tensor_norms.numel()
            raise ValueError(f"per-tensor clipping was built for {self.n_tensors} parameter tensors, got {got} norms")
        finite = norms.finite if norms.finite is not None else torch.isfinite(norms.total)
        warm = self.count < cfg.warmup_steps
        if cfg.warmup_max_norm is not None:
            global_coef = clip_coefficient(norms.total, cfg.warmup_max_norm, finite)
        else:
            global_coef = self._one
        had = self.seen  # tensors with a threshold this step
        limit = cfg.per_tensor_ratio * self.gamma
        over = had & (tensor_norms > limit)
        local = torch.where(over, limit / tensor_norms.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
        coefs = torch.where(warm, global_coef, local)
        coefs = torch.where(finite, coefs, 1.0)  # never multiply by a coefficient made from NaN/Inf
        clipped = coefs * tensor_norms

        update = accept & finite & present & (tensor_norms > 0)
        beta = cfg.per_tensor_decay
        kept = torch.where(warm, torch.minimum(self.gamma, clipped), beta * self.gamma + (1 - beta) * clipped)
        self.gamma = torch.where(update, torch.where(had, kept, clipped), self.gamma)
        self.seen = had | update
        self.count = self.count + (accept & finite)

        pre, post = self._total(tensor_norms), self._total(clipped)
        ratio = torch.where(pre > 0, post / pre.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
        any_clipped = finite & (present & (coefs < 1)).any()
        coef = torch.where(warm, global_coef, torch.where(any_clipped, ratio.clamp(max=_BELOW_ONE), 1.0))
        limited = torch.where(present & had, limit, 0.0)
        threshold = torch.where(warm, self._warmup_threshold, self._total(limited))
        return TensorClip(coefs, coef, threshold)

    def state_dict(self) -> dict[str, Any]:
        """The per-tensor EMAs, which tensors have one, and the accepted-step count (device tensors, cloned)."""
        return {"gamma": self.gamma.clone(), "seen": self.seen.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the statistics; a state saved for another number of parameter tensors is refused."""
        missing = [k for k in ("gamma", "seen", "count") if k not in state]
        if missing:
            raise ValueError(
                f"clip state has no {missing[0]!r}: it was not saved with ClipConfig(mode='per_tensor_adaptive') "
                f"(keys: {sorted(state)})"
            )
        gamma, seen = state["gamma"], state["seen"]
        if tuple(gamma.shape) != (self.n_tensors,) or tuple(seen.shape) != (self.n_tensors,):
            raise ValueError(
                f"clip state holds per-tensor statistics for {gamma.numel()} parameter tensors, this engine clips "
                f"{self.n_tensors} (a different model, or a different set of trainable parameters)"
            )
        self.gamma = gamma.to(self.gamma).clone()
        self.seen = seen.to(self.seen).clone()
        self.count = state["count"].to(self.count).clone()


def make_clip_strategy(
    config: ClipConfig, device: torch.device, n_tensors: int = 0, norm_type: float = 2.0
) -> ClipStrategy | PerTensorClip | None:
    """The strategy for ``config.mode`` (None when clipping is off).

    ``n_tensors`` and ``norm_type``: the engine's parameter count and norm, for per-tensor clipping.
    """
    if config.mode == "fixed":
        return FixedClip(config.max_norm, device)
    if config.mode == "adaptive":
        return AdaptiveClip(config, device)
    if config.mode == "per_tensor_adaptive":
        return PerTensorClip(config, n_tensors, device, norm_type)
    return None
