"""The step engine: norms, clipping, the skip decision, counters and logging. No Lightning, no W&B.

A driver (``StabilityGuard`` or ``StabilityCallback``) calls, once per optimizer step and after
the grads are final:

1. ``record_loss(loss)`` for each micro-batch (optional),
2. ``decision = evaluate(grad_scale=...)``: one fused norm pass, clipping in place, the skip
   flag and every counter updated on the device; on logging steps ONE device-to-host copy,
3. ``apply(decision, step_fn)``: the optimizer step, or the skip,
4. ``finish(decision)``: sinks, events, the divergence check.

Host syncs: none on a non-logging step when the optimizer is fused (it skips on the device
through ``found_inf``) or when skipping is off; one per step for other optimizers with skipping
on (the decision must reach Python, as GradScaler does); one per logging step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.distributed import all_ranks_agree, reducer_for
from stabilitykit.events import Event, TrainingDivergedError
from stabilitykit.grads import GradNormPlan, apply_clip_coefficient, clip_coefficient, layer_names_for
from stabilitykit.hooks import HookManager
from stabilitykit.report import BAD_GRAD as _BAD_GRAD
from stabilitykit.report import BAD_LOSS as _BAD_LOSS
from stabilitykit.report import OVERFLOW as _OVERFLOW
from stabilitykit.report import SKIP as _SKIP
from stabilitykit.report import StepReport, reason_from_code
from stabilitykit.spikes import RobustDetector

__all__ = ["StabilityEngine", "StepDecision", "is_fused"]


def is_fused(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for optimizers that honour ``found_inf`` inside their step (fused Adam/AdamW/SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@dataclass
class StepDecision:
    """What ``evaluate`` decided for one optimizer step."""

    report: StepReport
    skip: Tensor  # 0-d bool on the device
    skip_known: bool | None  # the host's view: True/False when read, None when left on the device
    host_metrics: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_INT_SLOTS = (
    "skipped_total",
    "clipped_total",
    "nonfinite_total",
    "overflow_total",
    "skipped_pending",
    "clipped_pending",
    "deferred_skips",
    "consecutive",
    "max_run_pending",
    "last_bad_step",
    "last_bad_code",
)
_FLOAT_SLOTS = ("max_norm_pending", "max_norm", "max_z_grad_pending", "max_z_loss_pending")
# flags vector: [skip, bad_loss, bad_grad, overflow, clipped]; each counter slot adds one flag.
_INCREMENT_FROM_FLAG = (0, 4, 2, 3, 0, 4, 0)
_PENDING_INTS = slice(4, 7)


class _Counters:
    """Device-side counters packed in two vectors so a step updates them in a handful of ops.

    ``*_pending`` slots are reset each time the host reads them. Slots read as 0-d views
    (``counters.skipped_total``).
    """

    def __init__(self, device: torch.device) -> None:
        self.ints = torch.zeros(len(_INT_SLOTS), dtype=torch.int64, device=device)
        self.ints[_INT_SLOTS.index("last_bad_step")] = -1
        self.floats = torch.zeros(len(_FLOAT_SLOTS), dtype=torch.float32, device=device)
        self.bad_layer_norms: Tensor | None = None  # layer norms of the last skipped step
        self._increment_index = torch.tensor(_INCREMENT_FROM_FLAG, device=device)
        self._code_weights = torch.tensor([_SKIP, _BAD_LOSS, _BAD_GRAD, _OVERFLOW], device=device)

    def __getattr__(self, name: str) -> Tensor:
        if name in _INT_SLOTS:
            return self.ints[_INT_SLOTS.index(name)]
        if name in _FLOAT_SLOTS:
            return self.floats[_FLOAT_SLOTS.index(name)]
        raise AttributeError(name)

    def update(
        self,
        flags: Tensor,
        step: int,
        finite_total: Tensor,
        layer_norms: Tensor | None,
        deferred: bool,
        z: Tensor | None,
    ) -> Tensor:
        """Fold one step's flags (int64 [skip, bad_loss, bad_grad, overflow, clipped]) in; returns its code."""
        code = (flags[:4] * self._code_weights).sum()
        increments = flags.index_select(0, self._increment_index)
        if not deferred:
            increments[-1] = 0
        ints = self.ints
        ints[:7] += increments
        skip, overflow = flags[0], flags[3]
        # fp16 overflows are GradScaler's business: they neither extend nor break a run of skips.
        consecutive = (ints[7] + skip - overflow) * skip
        ints[7] = consecutive
        ints[8] = torch.maximum(ints[8], consecutive)
        ints[9:11] = torch.where(skip.bool(), torch.stack([torch.full_like(code, step), code]), ints[9:11])
        self.floats[:2] = torch.maximum(self.floats[:2], finite_total)
        if z is not None:
            self.floats[2 : 2 + len(z)] = torch.maximum(self.floats[2 : 2 + len(z)], z)
        if layer_norms is not None:
            if self.bad_layer_norms is None:
                self.bad_layer_norms = torch.zeros_like(layer_norms)
            self.bad_layer_norms = torch.where(skip.bool(), layer_norms, self.bad_layer_norms)
        return code

    def state(self) -> dict[str, Tensor]:
        out = {"ints": self.ints.clone(), "floats": self.floats.clone()}
        if self.bad_layer_norms is not None:
            out["bad_layer_norms"] = self.bad_layer_norms.clone()
        return out

    def load(self, state: dict[str, Tensor]) -> None:
        self.ints = state["ints"].to(self.ints.device, torch.int64).clone()
        self.floats = state["floats"].to(self.floats.device, torch.float32).clone()
        if "bad_layer_norms" in state:
            self.bad_layer_norms = state["bad_layer_norms"].to(self.floats.device).clone()

    def reset_pending(self) -> None:
        self.ints[_PENDING_INTS] = 0
        self.ints[8] = 0
        self.floats[0] = 0
        self.floats[2:] = 0


class StabilityEngine:
    """One implementation of the stability step shared by every driver."""

    def __init__(
        self,
        params: Sequence[nn.Parameter | Tensor],
        config: StabilityConfig | None = None,
        model: nn.Module | None = None,
        hooks: HookManager | None = None,
        fused: bool = False,
        names: Sequence[str] | None = None,
    ) -> None:
        self.config = config or StabilityConfig()
        self.hooks = hooks or HookManager()
        self.fused = fused
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("StabilityEngine needs at least one parameter that requires grad")
        if names is None:
            by_id = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
            names = [by_id.get(id(p), f"param_{i}") for i, p in enumerate(self.params)]
        self.param_names = list(names)
        gcfg = self.config.grad_norm
        layer_of_param = layer_names_for(list(zip(self.param_names, self.params, strict=False)), model, gcfg.grouping)
        self.layer_names = list(dict.fromkeys(layer_of_param))
        index = {name: i for i, name in enumerate(self.layer_names)}
        self.plan = GradNormPlan(
            self.params,
            [index[n] for n in layer_of_param] if gcfg.per_layer else None,
            self.layer_names if gcfg.per_layer else None,
            norm_type=gcfg.norm_type,
            reducer=reducer_for(self.params),
        )
        self.logged_layers = [i for i, n in enumerate(self.layer_names) if self._layer_logged(n)]
        self.device = self.params[0].device
        self.step = 0  # optimizer steps attempted so far (skipped ones included)
        self.scheduler_debt = 0  # scheduler steps still to hold for skips learned late
        self.host_skipped_total = 0
        self.host_consecutive = 0
        self.counters = _Counters(self.device)
        self.adaptive = {
            "mean": torch.zeros((), dtype=torch.float32, device=self.device),
            "var": torch.zeros((), dtype=torch.float32, device=self.device),
            "count": torch.zeros((), dtype=torch.int64, device=self.device),
        }
        scfg = self.config.spikes
        self.detector = RobustDetector(scfg.alpha, scfg.warmup_steps, self.device, size=2)  # [grad norm, loss]
        self._fixed_threshold = torch.full((), self.config.clip.max_norm, dtype=torch.float32, device=self.device)
        self._false = torch.zeros((), dtype=torch.bool, device=self.device)
        self._nan = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        self.last_host_metrics: dict[str, float] = {}
        #: Where a driver's tracer saw the first non-finite value; used once by the next skip event.
        self.source_hint: Any | None = None

    # ----------------------------------------------------------------------------- helpers

    def _layer_logged(self, name: str) -> bool:
        import re

        gcfg = self.config.grad_norm
        if gcfg.include and not any(re.search(p, name) for p in gcfg.include):
            return False
        return not (gcfg.exclude and any(re.search(p, name) for p in gcfg.exclude))

    def is_logging_step(self, step: int | None = None) -> bool:
        """True when ``step`` (default: the coming one) copies metrics to the host."""
        every = self.config.log_every_n_steps or 1
        return (self.step if step is None else step) % every == 0

    def key(self, name: str) -> str:
        """The full metric name: ``<prefix>/<name>``."""
        prefix = self.config.metric_prefix
        return f"{prefix}/{name}" if prefix else name

    # ----------------------------------------------------------------------------- the step

    def record_loss(self, loss: Tensor) -> None:
        """Remember one micro-batch's loss (detached, on the device) for this optimizer step."""
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def _threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The clip threshold for this step (device tensor) and whether clipping applies."""
        ccfg = self.config.clip
        if ccfg.mode == "off":
            return None, None
        if ccfg.mode == "fixed":
            return self._fixed_threshold, None
        # Adaptive (ZClip-class): EMA mean/std of the total norm, threshold mean + z * std.
        st = self.adaptive
        warmed = st["count"] >= ccfg.warmup_steps
        std = st["var"].clamp(min=0).sqrt()
        threshold = st["mean"] + ccfg.z_threshold * std
        if ccfg.warmup_max_norm is not None:
            threshold = torch.where(warmed, threshold, torch.full_like(threshold, ccfg.warmup_max_norm))
            active = torch.ones((), dtype=torch.bool, device=self.device)
        else:
            threshold = torch.where(warmed, threshold, torch.full_like(threshold, math.inf))
            active = warmed
        # Update the statistics with the clipped value so a spike cannot poison them; NaN/Inf never enter.
        value = torch.where(warmed, torch.minimum(total, threshold), total)
        value = torch.where(finite, value, st["mean"])
        a = ccfg.ema_alpha
        first = st["count"] == 0
        delta = value - st["mean"]
        new_mean = torch.where(first, value, a * st["mean"] + (1 - a) * value)
        new_var = torch.where(first, torch.zeros_like(value), a * (st["var"] + (1 - a) * delta * delta))
        st["mean"] = torch.where(finite, new_mean, st["mean"])
        st["var"] = torch.where(finite, new_var, st["var"])
        st["count"] = st["count"] + finite.to(torch.int64)
        return threshold, active

    def evaluate(self, grad_scale: Tensor | None = None, scaler_active: bool = False) -> StepDecision:
        """Measure, clip and decide this step; counters move on the device.

        ``grad_scale``: the loss scale still applied to the grads (fused optimizer + fp16), so norms
        are reported unscaled and clipping targets ``max_norm * scale``. ``scaler_active``: a
        GradScaler is in use, so a non-finite grad is an fp16 overflow it will handle.
        """
        cfg = self.config
        step = self.step
        logging = self.is_logging_step(step)
        norms, grouped = self.plan.compute(grad_scale)
        total = norms.total
        finite_grad = torch.isfinite(total)
        loss = None
        bad_loss = self._false
        if self._loss_sum is not None:
            loss = self._loss_sum / self._loss_count
            bad_loss = ~torch.isfinite(loss)
        bad_grad = ~finite_grad
        bad = bad_grad | bad_loss
        skip = bad if cfg.skip.nonfinite else self._false
        if cfg.skip.nonfinite and cfg.skip.sync_ranks:
            skip = all_ranks_agree(skip)

        threshold, adaptive_active = self._threshold(total, finite_grad)
        if threshold is not None:
            coef = clip_coefficient(total, threshold)
            if adaptive_active is not None:
                coef = torch.where(adaptive_active, coef, torch.ones_like(coef))
            apply_clip_coefficient(grouped, coef)
            clipped = (coef < 1.0) & ~skip
        else:
            coef = torch.ones_like(total)
            clipped = self._false
        overflow = bad_grad & skip if scaler_active else self._false
        flags = torch.stack([skip, bad_loss, bad_grad, overflow, clipped]).to(torch.int64)
        z = self._update_detectors(total, loss)
        deferred = not logging and cfg.skip.nonfinite and self.fused
        finite_total = torch.where(finite_grad, total, 0.0)
        code = self.counters.update(flags, step, finite_total, norms.layer_norms, deferred, z)
        z_grad = z[0] if z is not None else None
        z_loss = z[1] if z is not None and loss is not None else None

        report = StepReport(
            step=step,
            grad_norm=total,
            clip_coef=coef,
            skipped=skip,
            clipped=clipped,
            loss=loss,
            layer_norms=norms.layer_norms,
            layer_names=self.layer_names,
            code=code,
        )
        decision = StepDecision(report=report, skip=skip, skip_known=None)
        decision.extra.update(threshold=threshold, z_grad=z_grad, z_loss=z_loss)
        if logging:
            decision.host_metrics = self._read_metrics(decision, grad_scale)
        elif cfg.skip.nonfinite and not self.fused:
            code_value = int(code.item())  # the one sync a non-fused optimizer pays to skip
            report._code_value = code_value
            decision.skip_known = bool(code_value & _SKIP)
        elif not cfg.skip.nonfinite:
            decision.skip_known = False
        self._loss_sum = None
        self._loss_count = 0
        return decision

    def _update_detectors(self, total: Tensor, loss: Tensor | None) -> Tensor | None:
        """Robust z-scores of [grad norm, loss] (one detector over both; a missing loss stays out)."""
        if not self.config.spikes.enabled:
            return None
        values = torch.stack([total, loss if loss is not None else self._nan])
        return self.detector.update(values)

    def _read_metrics(self, decision: StepDecision, grad_scale: Tensor | None) -> dict[str, float]:
        """The logging step's single device-to-host copy, unpacked into named metrics."""
        report = decision.report
        c = self.counters
        assert report.code is not None
        code_tensor = report.code
        entries: list[tuple[str, Tensor]] = [
            ("grad_norm/total", report.grad_norm),
            ("grad_norm/max", c.max_norm_pending),
            ("clip/coef", report.clip_coef),
            ("clip/clipped_total", c.clipped_total),
            ("clip/clipped_recent", c.clipped_pending),
            ("skipped/total", c.skipped_total),
            ("skipped/recent", c.skipped_pending),
            ("skipped/consecutive", c.consecutive),
            ("nonfinite/total", c.nonfinite_total),
            ("_code", code_tensor),
            ("_max_run", c.max_run_pending),
            ("_deferred", c.deferred_skips),
            ("_last_bad_step", c.last_bad_step),
            ("_last_bad_code", c.last_bad_code),
        ]
        if report.loss is not None:
            entries.append(("loss", report.loss))
        threshold = decision.extra.get("threshold")
        if threshold is not None:
            entries.append(("clip/threshold", threshold))
        if grad_scale is not None:
            entries.append(("scaler/scale", grad_scale.reshape(())))
        if decision.extra.get("z_grad") is not None:
            entries.append(("spikes/z_grad_norm", decision.extra["z_grad"]))
            entries.append(("_max_z_grad", c.max_z_grad_pending))
        if decision.extra.get("z_loss") is not None:
            entries.append(("spikes/z_loss", decision.extra["z_loss"]))
            entries.append(("_max_z_loss", c.max_z_loss_pending))
        scalars = torch.stack([t.reshape(()).to(device=self.device, dtype=torch.float32) for _, t in entries])
        layer_index = self.logged_layers if report.layer_norms is not None else []
        parts = [scalars]
        if layer_index:
            assert report.layer_norms is not None
            parts.append(report.layer_norms.to(self.device)[layer_index])
        bad_norms = self.counters.bad_layer_norms
        if bad_norms is not None:
            parts.append((~torch.isfinite(bad_norms)).to(torch.float32))
        values = torch.cat(parts).tolist() if len(parts) > 1 else scalars.tolist()  # the one host sync
        raw = {name: values[i] for i, (name, _) in enumerate(entries)}
        offset = len(entries)
        for j, li in enumerate(layer_index):
            raw[f"grad_norm/{self.layer_names[li]}"] = values[offset + j]
        offset += len(layer_index)
        bad_layers = [self.layer_names[i] for i, v in enumerate(values[offset:]) if v]
        decision.extra["last_bad_layer"] = bad_layers[-1] if bad_layers else None
        report._code_value = int(raw["_code"])
        decision.skip_known = bool(report._code_value & _SKIP)
        decision.extra["internal"] = {k: v for k, v in raw.items() if k.startswith("_")}
        self.counters.reset_pending()
        return {self.key(k): v for k, v in raw.items() if not k.startswith("_")}

    def apply(
        self,
        decision: StepDecision,
        step_fn: Callable[[], Any],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Any:
        """Run the optimizer step unless this step is skipped; fused optimizers skip on the device."""
        if decision.skip_known is True:
            return None
        if decision.skip_known is None and optimizer is not None and self.fused:
            optimizer.found_inf = decision.skip.to(torch.float32)  # type: ignore[attr-defined]
            try:
                return step_fn()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        return step_fn()

    def hold_scheduler(self, decision: StepDecision) -> bool:
        """True when the LR scheduler must not advance this step (skipped now, or skips learned late)."""
        if decision.skip_known is True:
            return True
        if self.scheduler_debt > 0:
            self.scheduler_debt -= 1
            return True
        return False

    def finish(self, decision: StepDecision) -> StepReport:
        """Host-side bookkeeping after the step: sinks, events, the divergence check."""
        report = decision.report
        step = self.step
        self.step += 1
        internal = decision.extra.get("internal")
        if internal is not None:
            self._finish_logging_step(decision, internal, step)
        elif decision.skip_known:
            self._on_known_skip(report, step)
        elif decision.skip_known is False:
            self.host_consecutive = 0
        return report

    def _on_known_skip(self, report: StepReport, step: int) -> None:
        """A skip the host saw on a non-logging step (non-fused optimizers)."""
        code = report._code_value or 0
        self.host_skipped_total += 1
        if not code & _OVERFLOW:
            self.host_consecutive += 1
        layer = self._bad_layer_now(report)
        self._emit_skip(step, code, layer, count=1)
        self._check_divergence(step, self.host_consecutive, layer, code)

    def _bad_layer_now(self, report: StepReport) -> str | None:
        if report.layer_norms is None:
            return None
        bad = (~torch.isfinite(report.layer_norms)).nonzero().flatten().tolist()
        return self.layer_names[bad[-1]] if bad else None

    def _emit_skip(self, step: int, code: int, layer: str | None, count: int) -> None:
        reason = reason_from_code(code | _SKIP) or "nonfinite_grad"
        where = f" (first non-finite layer in backward order: {layer})" if layer else ""
        details: dict[str, Any] = {"reason": reason, "layer": layer, "count": count}
        source, self.source_hint = self.source_hint, None
        if source is not None:
            where = f" (first non-finite value: {source})"
            details.update(module=source.module, phase=source.phase, dtype=source.dtype, **source.stats)
        if reason == "fp16_overflow":
            self.hooks.emit(Event("fp16_overflow", step, f"fp16 overflow, GradScaler skipped the step{where}", details))
        else:
            self.hooks.emit(Event("nonfinite", step, f"non-finite {reason.split('_', 1)[1]}{where}", details))
        plural = "s" if count > 1 else ""
        self.hooks.emit(Event("skipped", step, f"{count} step{plural} skipped, last at step {step}: {reason}", details))

    def _check_divergence(self, step: int, run: int, layer: str | None, code: int) -> None:
        limit = self.config.skip.max_consecutive
        if limit is not None and run >= limit:
            reason = reason_from_code(code | _SKIP)
            err = TrainingDivergedError(step, run, layer, reason)
            self.hooks.emit(Event("diverged", step, str(err), {"consecutive": run, "layer": layer, "reason": reason}))
            raise err

    def _finish_logging_step(self, decision: StepDecision, internal: dict[str, float], step: int) -> None:
        metrics = decision.host_metrics or {}
        self.last_host_metrics = dict(metrics)
        self.scheduler_debt += int(internal["_deferred"])
        self.host_skipped_total = int(metrics[self.key("skipped/total")])
        self.host_consecutive = int(metrics[self.key("skipped/consecutive")])
        recent = int(metrics[self.key("skipped/recent")])
        last_code = int(internal["_last_bad_code"])
        layer = decision.extra.get("last_bad_layer") if recent else None
        if recent:
            self._emit_skip(int(internal["_last_bad_step"]), last_code, layer, count=recent)
        clipped = int(metrics[self.key("clip/clipped_recent")])
        if clipped:
            self.hooks.emit(
                Event("clipped", step, f"{clipped} step(s) clipped since the last logging step", {"count": clipped})
            )
        scfg = self.config.spikes
        z_grad = internal.get("_max_z_grad", 0.0)
        if scfg.enabled and z_grad >= scfg.z_warning:
            self.hooks.emit(
                Event(
                    "spike_warning",
                    step,
                    f"grad-norm z-score reached {z_grad:.1f} (warning at {scfg.z_warning})",
                    {"z": z_grad},
                )
            )
        z_loss = internal.get("_max_z_loss", 0.0)
        if scfg.enabled and z_loss >= scfg.z_spike:
            self.hooks.emit(
                Event("loss_spike", step, f"loss z-score reached {z_loss:.1f} (spike at {scfg.z_spike})", {"z": z_loss})
            )
        self.hooks.log_metrics(metrics, step)
        self._check_divergence(step, int(internal["_max_run"]), layer, last_code)

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Every counter, EMA and detector state, plus the step; tensors are cloned."""
        return {
            "step": self.step,
            "scheduler_debt": self.scheduler_debt,
            "host_skipped_total": self.host_skipped_total,
            "host_consecutive": self.host_consecutive,
            "counters": self.counters.state(),
            "adaptive": {k: v.clone() for k, v in self.adaptive.items()},
            "detector": self.detector.state_dict(),
            "layer_names": list(self.layer_names),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (tensors move to this engine's device)."""
        self.step = int(state["step"])
        self.scheduler_debt = int(state.get("scheduler_debt", 0))
        self.host_skipped_total = int(state.get("host_skipped_total", 0))
        self.host_consecutive = int(state.get("host_consecutive", 0))
        self.counters.load(state["counters"])
        for key, value in state["adaptive"].items():
            self.adaptive[key] = value.to(device=self.device, dtype=self.adaptive[key].dtype).clone()
        self.detector.load_state_dict(state["detector"])
