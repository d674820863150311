"""The step engine: norms, clipping, the skip decision, counters and logging. No Lightning, no W&B.

A driver (``StabilityGuard`` or ``StabilityCallback``) calls, once per optimizer step and after
the grads are final:

1. ``record_loss(loss)`` for each micro-batch (optional),
2. ``decision = evaluate(grad_scale=...)``: one fused norm pass, clipping in place, the skip
   flag on the device, and one row of numbers (total norm, loss, skip flag, clip coefficient,
   threshold, per-layer norms) written into a small device journal,
3. ``apply(decision, step_fn)``: the optimizer step, or the skip,
4. ``finish(decision)``: on logging steps the journal is copied to the host in ONE read; the
   counters, spike detectors and events catch up over its rows there, in plain Python, and the
   metrics go to the sinks; then the divergence check.

Keeping the bookkeeping off the step path is what makes the engine cost about as much as
``torch.nn.utils.clip_grad_norm_``: a step adds a fixed ~20 small device ops, not a hundred.

Host syncs: none on a non-logging step when the optimizer is fused (it skips on the device
through ``found_inf``) or when skipping is off; one per step for other optimizers with skipping
on (the decision must reach Python, as GradScaler does); one per logging step.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.distributed import all_ranks_agree, is_distributed, reducer_for
from stabilitykit.events import Event, TrainingDivergedError
from stabilitykit.grads import GradNormPlan, apply_clip_coefficient, clip_coefficient, layer_names_for
from stabilitykit.hooks import HookManager
from stabilitykit.report import OVERFLOW as _OVERFLOW
from stabilitykit.report import SKIP as _SKIP
from stabilitykit.report import StepReport, pack_code, reason_from_code
from stabilitykit.spikes import RobustDetector, SpikeScore

__all__ = ["Counters", "RowInfo", "StabilityEngine", "StepDecision", "is_fused"]


#: Name parts that wrappers (FSDP1, activation checkpointing, torch.compile) add to parameter paths.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_layer_name(name: str, model: nn.Module | None = None) -> str:
    """A layer name without wrapper parts: ``blocks.0``, not ``_fsdp_wrapped_module.blocks.0``."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    name = name.removesuffix("._fsdp_wrapped_module").removesuffix("._orig_mod")
    if name in ("_fsdp_wrapped_module", "_orig_mod", "_flat_param"):
        name = ""
    if model is not None and isinstance(model, nn.parallel.DistributedDataParallel) and name.startswith("module."):
        name = name[len("module.") :]
    return name or "root"


def is_fused(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for optimizers that honour ``found_inf`` inside their step (fused Adam/AdamW/SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@dataclass
class RowInfo:
    """What the host knows about one journal row without reading the device."""

    step: int
    has_loss: bool
    scaler_active: bool
    seen: bool = False  # the host read this row's skip flag at its own step (the scheduler was held)
    reported: bool = False  # its skip events are out already


@dataclass
class StepDecision:
    """What ``evaluate`` decided for one optimizer step."""

    report: StepReport
    skip: Tensor  # 0-d bool on the device
    skip_known: bool | None  # the host's view: True/False when read, None when left on the device
    logging: bool = False
    rows: list[list[float]] | None = None  # journal rows copied to the host on this step
    infos: list[RowInfo] | None = None
    loss_scale: float | None = None
    host_metrics: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# Columns of a journal row; the per-layer norms follow.
TOTAL, LOSS, SKIP, COEF, THRESHOLD = range(5)
_SCALARS = 5
#: Rows kept on the device between reads. A log cadence above this reads the journal early (one sync).
MAX_JOURNAL_ROWS = 1024


@dataclass
class Counters:
    """Host-side totals, brought up to date each time the journal is read."""

    skipped_total: int = 0
    clipped_total: int = 0
    nonfinite_total: int = 0
    overflow_total: int = 0
    consecutive: int = 0
    max_norm: float = 0.0
    last_bad_step: int = -1
    last_bad_reason: str | None = None
    last_bad_layer: str | None = None
    # since the last logging step
    skipped_recent: int = 0
    clipped_recent: int = 0
    max_norm_recent: float = 0.0
    max_z_grad_recent: float = 0.0
    max_z_loss_recent: float = 0.0

    def reset_recent(self) -> None:
        """Start a new logging interval."""
        self.skipped_recent = self.clipped_recent = 0
        self.max_norm_recent = self.max_z_grad_recent = self.max_z_loss_recent = 0.0

    def state(self) -> dict[str, Any]:
        """Every field, as plain values."""
        return dict(vars(self))

    def load(self, state: dict[str, Any]) -> None:
        """Restore what ``state`` returned (unknown keys are an error)."""
        for key, value in state.items():
            if not hasattr(self, key):
                raise KeyError(f"unknown counter {key!r} in engine state")
            setattr(self, key, value)


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
        layer_of_param = [clean_layer_name(n, model) for n in layer_of_param]
        self.layer_names = list(dict.fromkeys(layer_of_param))
        index = {name: i for i, name in enumerate(self.layer_names)}
        self.plan = GradNormPlan(
            self.params,
            [index[n] for n in layer_of_param] if gcfg.per_layer else None,
            self.layer_names if gcfg.per_layer else None,
            norm_type=gcfg.norm_type,
            reducer=reducer_for(self.params, model),
        )
        self.per_layer = gcfg.per_layer
        self.logged_layers = [i for i, n in enumerate(self.layer_names) if self._layer_logged(n)]
        self.device = self.params[0].device
        self.step = 0  # optimizer steps attempted so far (skipped ones included)
        self.scheduler_debt = 0  # scheduler steps still to hold for skips learned late
        self.counters = Counters()
        self._live_skips = 0  # skips the host saw at their own step since the journal was last read
        self._live_consecutive = 0
        self.adaptive = {
            "mean": torch.zeros((), dtype=torch.float32, device=self.device),
            "var": torch.zeros((), dtype=torch.float32, device=self.device),
            "count": torch.zeros((), dtype=torch.int64, device=self.device),
        }
        scfg = self.config.spikes
        self.detector = RobustDetector(scfg.alpha, scfg.warmup_steps, size=2)  # [grad norm, loss]
        n_layers = len(self.layer_names) if self.per_layer else 0
        self.layer_detector = RobustDetector(scfg.alpha, scfg.warmup_steps, size=n_layers) if scfg.per_layer else None
        self.spike_score = SpikeScore(scfg.score_window, scfg.score_sigma)
        self.last_z: tuple[float, float] = (0.0, 0.0)
        every = self.config.log_every_n_steps or 1
        self._capacity = min(every, MAX_JOURNAL_ROWS)
        self._journal = torch.zeros(self._capacity, _SCALARS + n_layers, dtype=torch.float32, device=self.device)
        self._infos: list[RowInfo] = []
        self._fixed_threshold = torch.full((), self.config.clip.max_norm, dtype=torch.float32, device=self.device)
        self._false = torch.zeros((), dtype=torch.bool, device=self.device)
        self._nan = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        self.last_host_metrics: dict[str, float] = {}
        #: Where a driver's tracer saw the first non-finite value; used once by the next skip event.
        self.source_hint: Any | None = None
        #: Modules with ``stability_metrics()`` (ZLoss, QKNormAttention): read on logging steps.
        self.metric_sources: list[Any] = []
        if model is not None and self.config.module_metrics:
            self.metric_sources = [m for m in model.modules() if callable(getattr(m, "stability_metrics", None))]
        self._mark_measure()
        self._overflow_steps: deque[int] = deque()
        self._fp16_warned_at = -(10**9)

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

    @property
    def skipped_total(self) -> int:
        """Skipped steps the host knows of (exact after a logging step, and always for non-fused optimizers)."""
        return self.counters.skipped_total + self._live_skips

    @property
    def consecutive(self) -> int:
        """The current run of skipped steps, as far as the host knows."""
        return self._live_consecutive

    # ----------------------------------------------------------------------------- the step

    def record_loss(self, loss: Tensor) -> None:
        """Remember one micro-batch's loss (detached, on the device) for this optimizer step."""
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def _adaptive_threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """ZClip-class threshold ``mean + z * std`` from EMAs of the total norm, and whether it applies.

        The statistics take the clipped value, so a spike cannot poison them; NaN/Inf never enter.
        """
        ccfg = self.config.clip
        st = self.adaptive
        warmed = st["count"] >= ccfg.warmup_steps
        threshold = st["mean"] + ccfg.z_threshold * st["var"].clamp(min=0).sqrt()
        fallback = ccfg.warmup_max_norm if ccfg.warmup_max_norm is not None else math.inf
        threshold = torch.where(warmed, threshold, fallback)
        active = warmed if ccfg.warmup_max_norm is None else torch.ones_like(warmed)
        value = torch.where(finite, torch.where(warmed, torch.minimum(total, threshold), total), st["mean"])
        a = ccfg.ema_alpha
        first = st["count"] == 0
        delta = value - st["mean"]
        new_mean = torch.where(first, value, st["mean"] + (1 - a) * delta)
        new_var = torch.where(first, 0.0, a * (st["var"] + (1 - a) * delta * delta))
        st["mean"] = torch.where(finite, new_mean, st["mean"])
        st["var"] = torch.where(finite, new_var, st["var"])
        st["count"] = st["count"] + finite
        return threshold, active

    def evaluate(
        self,
        grad_scale: Tensor | None = None,
        scaler_active: bool = False,
        loss_scale: Tensor | None = None,
        force_skip: Tensor | None = None,
    ) -> StepDecision:
        """Measure, clip and decide this step; its numbers go into the device journal.

        ``grad_scale``: the loss scale still applied to the grads (fused optimizer + fp16), so norms
        are reported unscaled and clipping targets ``max_norm * scale``. ``scaler_active``: a
        GradScaler is in use, so a non-finite grad is an fp16 overflow it will handle.
        ``loss_scale``: the GradScaler's scale, logged on logging steps. ``force_skip``: a 0-d
        device bool (the data guard's verdict on this batch) that skips the step when true.
        """
        cfg = self.config
        step = self.step
        logging = self.is_logging_step(step)
        norms, grouped = self.plan.compute(grad_scale)
        total = norms.total
        finite_grad = norms.finite if norms.finite is not None else torch.isfinite(total)
        loss = None
        if self._loss_sum is not None:
            loss = self._loss_sum if self._loss_count == 1 else self._loss_sum / self._loss_count
        if cfg.skip.nonfinite:
            skip = ~(finite_grad & torch.isfinite(loss)) if loss is not None else ~finite_grad
            if cfg.skip.sync_ranks:
                skip = all_ranks_agree(skip)
        else:
            skip = self._false
        skip_column = skip
        if force_skip is not None:
            skip = skip | force_skip
            if cfg.skip.sync_ranks:
                skip = all_ranks_agree(skip)
            skip_column = skip.float() + 2 * force_skip.float()

        mode = cfg.clip.mode
        threshold = None
        if mode == "off":
            coef = torch.ones_like(total)
        else:
            if mode == "fixed":
                threshold = self._fixed_threshold
                coef = clip_coefficient(total, threshold, finite_grad)
            else:
                threshold, active = self._adaptive_threshold(total, finite_grad)
                coef = torch.where(active, clip_coefficient(total, threshold, finite_grad), 1.0)
            apply_clip_coefficient(grouped, coef)

        row = self._journal[len(self._infos)]
        columns = [total, loss if loss is not None else self._nan, skip_column, coef]
        columns.append(threshold if threshold is not None else self._nan)
        torch.stack(columns, out=row[:_SCALARS])
        if norms.layer_norms is not None:
            row[_SCALARS:].copy_(norms.layer_norms)
        info = RowInfo(step, loss is not None, scaler_active)
        self._infos.append(info)

        report = StepReport(
            step=step,
            grad_norm=total,
            clip_coef=coef,
            skipped=skip,
            loss=loss,
            layer_norms=norms.layer_norms,
            layer_names=self.layer_names,
            scaler_active=scaler_active,
            bad_batch=force_skip,
        )
        decision = StepDecision(report=report, skip=skip, skip_known=None, logging=logging)
        if logging or len(self._infos) >= self._capacity:
            self._read_journal(decision, loss_scale)
        elif (cfg.skip.nonfinite or force_skip is not None) and not self.fused:
            self.resolve(decision)  # the one sync a non-fused optimizer pays to skip
        elif not cfg.skip.nonfinite and force_skip is None:
            decision.skip_known = False
        self._loss_sum = None
        self._loss_count = 0
        return decision

    def resolve(self, decision: StepDecision) -> bool:
        """Read this step's skip decision now (one sync); ``finish`` then reports a skip at once."""
        if decision.skip_known is not None:
            return decision.skip_known
        info = self._infos[-1]
        values = self._journal[len(self._infos) - 1, :_SCALARS].tolist()
        info.seen = info.reported = True
        decision.report._code_value = _code_of(values, info)
        decision.skip_known = bool(decision.report._code_value & _SKIP)
        return decision.skip_known

    def _read_journal(self, decision: StepDecision, loss_scale: Tensor | None = None) -> None:
        """Copy the journal rows since the last read to the host: the logging step's one sync."""
        n = len(self._infos)
        rows = self._journal[:n]
        extras: list[Tensor] = []
        names: list[str] = []
        if decision.logging:
            for key, value in self._module_metrics().items():
                names.append(key)
                extras.append(value)
        if loss_scale is not None:
            names.append("scaler/scale")
            extras.append(loss_scale.detach())
        if extras:
            tail = torch.stack([t.reshape(()).to(rows) for t in extras])
            flat = torch.cat([rows.flatten(), tail]).tolist()
            decision.extra["tail"] = dict(zip(names, flat[len(flat) - len(names) :], strict=True))
            del flat[len(flat) - len(names) :]
            decision.loss_scale = decision.extra["tail"].pop("scaler/scale", None)
        else:
            flat = rows.flatten().tolist()
        width = self._journal.shape[1]
        decision.rows = [flat[i * width : (i + 1) * width] for i in range(n)]
        decision.infos, self._infos = self._infos, []
        last = decision.infos[-1]
        code = _code_of(decision.rows[-1], last)
        if last.step == decision.report.step and decision.skip_known is None:
            decision.report._code_value = code
            decision.skip_known = bool(code & _SKIP)
            last.seen = True

    def _module_metrics(self) -> dict[str, Tensor]:
        """Device tensors from ``stability_metrics()`` modules; a key several modules share keeps the max."""
        merged: dict[str, list[Tensor]] = {}
        for module in self.metric_sources:
            for key, value in module.stability_metrics().items():
                if value is not None:
                    merged.setdefault(key, []).append(value.detach().float().reshape(()))
        return {k: v[0] if len(v) == 1 else torch.stack(v).amax() for k, v in merged.items()}

    def _mark_measure(self) -> None:
        """Tell measuring modules whether the coming step is a logging step."""
        logging = self.is_logging_step()
        for module in self.metric_sources:
            if hasattr(module, "measure_metrics"):
                module.measure_metrics = logging

    def flush(self) -> None:
        """Read and process the journal now (one sync): counters, detectors and events catch up.

        Drivers call it at the end of training and ``summary()`` relies on it. A run of skips that
        reached ``max_consecutive`` is reported as a "diverged" event, not raised.
        """
        if not self._infos:
            return
        decision = StepDecision(report=_EMPTY_REPORT, skip=self._false, skip_known=None)
        self._read_journal(decision)
        assert decision.rows is not None and decision.infos is not None
        diverged = self._process_rows(decision.rows, decision.infos, emit_divergence=False)
        if diverged is not None:
            with contextlib.suppress(TrainingDivergedError):
                self._raise_diverged(*diverged)

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
        """Host-side bookkeeping after the step: counters, detectors, events, sinks, the divergence check."""
        report = decision.report
        step = self.step
        self.step += 1
        self._mark_measure()
        if decision.rows is not None:
            assert decision.infos is not None
            diverged = self._process_rows(decision.rows, decision.infos, emit_divergence=False)
            if decision.logging:
                self._log_metrics(decision, step)
            if diverged is not None:
                self._raise_diverged(*diverged)
        elif decision.skip_known:
            self._on_known_skip(report, step)
        elif decision.skip_known is False:
            self._live_consecutive = 0
        return report

    # ----------------------------------------------------------------------------- host side

    def _process_rows(
        self, rows: list[list[float]], infos: list[RowInfo], emit_divergence: bool = True
    ) -> tuple[int, int, str | None, int] | None:
        """Fold journal rows into the counters and detectors and emit their events.

        Returns where a run of skips reached ``max_consecutive`` (raised here unless the caller
        asked to raise it after logging).
        """
        c = self.counters
        limit = self.config.skip.max_consecutive
        scfg = self.config.spikes
        diverged: tuple[int, int, str | None, int] | None = None
        for values, info in zip(rows, infos, strict=True):
            total, loss = values[TOTAL], values[LOSS]
            code = _code_of(values, info)
            if not math.isfinite(total) or (info.has_loss and not math.isfinite(loss)):
                c.nonfinite_total += 1
            if code & _SKIP:
                layer = self._bad_layer(values)
                c.skipped_total += 1
                c.skipped_recent += 1
                if code & _OVERFLOW:
                    c.overflow_total += 1
                    self._overflow_steps.append(info.step)
                else:
                    c.consecutive += 1
                c.last_bad_step, c.last_bad_reason, c.last_bad_layer = info.step, reason_from_code(code), layer
                if not info.seen and self.fused:
                    self.scheduler_debt += 1  # the scheduler already stepped past this skip
                if not info.reported:
                    self._emit_skip(info.step, code, layer)
                if limit is not None and c.consecutive >= limit and diverged is None:
                    diverged = (info.step, c.consecutive, layer, code)
            else:
                c.consecutive = 0
                if values[COEF] < 1.0:
                    c.clipped_total += 1
                    c.clipped_recent += 1
            if math.isfinite(total):
                c.max_norm = max(c.max_norm, total)
                c.max_norm_recent = max(c.max_norm_recent, total)
            if scfg.enabled:
                self._score(values, info)
        self._live_skips = 0
        self._live_consecutive = c.consecutive
        if diverged is not None and emit_divergence:
            self._raise_diverged(*diverged)
        return diverged

    def _score(self, values: list[float], info: RowInfo) -> None:
        """Spike detectors over one row: z-scores, the spike score, and their events."""
        scfg = self.config.spikes
        c = self.counters
        total = values[TOTAL]
        loss = values[LOSS] if info.has_loss else math.nan
        z_grad, z_loss = self.detector.update([total, loss])
        self.last_z = (z_grad, z_loss)
        c.max_z_grad_recent = max(c.max_z_grad_recent, z_grad)
        c.max_z_loss_recent = max(c.max_z_loss_recent, z_loss)
        self.spike_score.update(total)
        leading: str | None = None
        if self.layer_detector is not None:
            layer_z = self.layer_detector.update(values[_SCALARS:])
            if layer_z and max(layer_z) >= scfg.z_warning:
                leading = self.layer_names[max(range(len(layer_z)), key=layer_z.__getitem__)]
        if z_grad >= scfg.z_warning:
            where = f"; largest layer z-score: {leading}" if leading else ""
            self.hooks.emit(
                Event(
                    "spike_warning",
                    info.step,
                    f"grad-norm z-score {z_grad:.1f} at step {info.step} (warning at {scfg.z_warning}){where}",
                    {"z": z_grad, "grad_norm": total, "layer": leading},
                )
            )
        if z_loss >= scfg.z_spike:
            self.hooks.emit(
                Event(
                    "loss_spike",
                    info.step,
                    f"loss z-score {z_loss:.1f} at step {info.step} (spike at {scfg.z_spike})",
                    {"z": z_loss, "loss": loss},
                )
            )

    def _bad_layer(self, values: list[float]) -> str | None:
        """The non-finite layer seen first in backward order (the last one in model order)."""
        bad = [i for i, v in enumerate(values[_SCALARS:]) if not math.isfinite(v)]
        return self.layer_names[bad[-1]] if bad else None

    def _on_known_skip(self, report: StepReport, step: int) -> None:
        """A skip the host saw at its own step (non-fused optimizers): events now, divergence now."""
        code = report._code_value or _SKIP
        self._live_skips += 1
        if not code & _OVERFLOW:
            self._live_consecutive += 1
        layer = None
        if report.layer_norms is not None:  # one more sync, on a skipped step only
            bad = (~torch.isfinite(report.layer_norms)).nonzero().flatten().tolist()
            layer = self.layer_names[bad[-1]] if bad else None
        self._emit_skip(step, code, layer)
        limit = self.config.skip.max_consecutive
        if limit is not None and self._live_consecutive >= limit:
            self._raise_diverged(step, self._live_consecutive, layer, code)

    def _emit_skip(self, step: int, code: int, layer: str | None) -> None:
        reason = reason_from_code(code | _SKIP) or "nonfinite_grad"
        where = f" (first non-finite layer in backward order: {layer})" if layer else ""
        details: dict[str, Any] = {"reason": reason, "layer": layer}
        if is_distributed():
            rank = torch.distributed.get_rank()
            details["rank"] = rank
            where += f" on rank {rank}"
        source, self.source_hint = self.source_hint, None
        if source is not None:
            where = f" (first non-finite value: {source})"
            details.update(module=source.module, phase=source.phase, dtype=source.dtype, **source.stats)
        if reason == "fp16_overflow":
            self.hooks.emit(Event("fp16_overflow", step, f"fp16 overflow, GradScaler skipped the step{where}", details))
        elif reason == "bad_batch":
            self.hooks.emit(
                Event("bad_batch", step, "the data guard found non-finite values or bad labels in the batch", details)
            )
        elif reason == "nonfinite_on_other_rank":
            self.hooks.emit(Event("nonfinite", step, "another rank saw a non-finite value; every rank skips", details))
        else:
            self.hooks.emit(Event("nonfinite", step, f"non-finite {reason.split('_', 1)[1]}{where}", details))
        self.hooks.emit(Event("skipped", step, f"step {step} skipped: {reason}", details))

    def _raise_diverged(self, step: int, run: int, layer: str | None, code: int) -> None:
        reason = reason_from_code(code | _SKIP)
        err = TrainingDivergedError(step, run, layer, reason)
        self.hooks.emit(Event("diverged", step, str(err), {"consecutive": run, "layer": layer, "reason": reason}))
        raise err

    def _log_metrics(self, decision: StepDecision, step: int) -> None:
        """The logging step's metrics, from the rows just read, to every sink."""
        assert decision.rows is not None
        c = self.counters
        last = decision.rows[-1]
        metrics: dict[str, float] = {
            "grad_norm/total": last[TOTAL],
            "grad_norm/max": c.max_norm_recent,
            "skipped/total": c.skipped_total,
            "skipped/recent": c.skipped_recent,
            "skipped/consecutive": c.consecutive,
            "nonfinite/total": c.nonfinite_total,
        }
        if decision.infos and decision.infos[-1].has_loss:
            metrics["loss"] = last[LOSS]
        if self.config.clip.mode != "off":
            metrics.update(
                {
                    "clip/coef": last[COEF],
                    "clip/threshold": last[THRESHOLD],
                    "clip/clipped_total": c.clipped_total,
                    "clip/clipped_recent": c.clipped_recent,
                }
            )
        if decision.loss_scale is not None:
            metrics["scaler/scale"] = decision.loss_scale
            metrics["scaler/overflow_rate"] = self._overflow_rate(step)
            self._check_fp16(step, decision.loss_scale, metrics["scaler/overflow_rate"])
        metrics.update(decision.extra.get("tail", {}))
        if self.config.spikes.enabled:
            metrics["spikes/z_grad_norm"], metrics["spikes/z_loss"] = self.last_z
            metrics["spikes/max_z_grad_norm"] = c.max_z_grad_recent
            metrics["spikes/score"] = self.spike_score.score()
        for i in self.logged_layers if self.per_layer else []:
            metrics[f"grad_norm/{self.layer_names[i]}"] = last[_SCALARS + i]
        clipped = c.clipped_recent
        if clipped:
            self.hooks.emit(
                Event("clipped", step, f"{clipped} step(s) clipped since the last logging step", {"count": clipped})
            )
        c.reset_recent()
        named = {self.key(k): float(v) for k, v in metrics.items()}
        decision.host_metrics = named
        self.last_host_metrics = dict(named)
        self.hooks.log_metrics(named, step)

    def _overflow_rate(self, step: int) -> float:
        """Share of the last ``fp16.window`` steps that GradScaler skipped for overflow."""
        window = self.config.fp16.window
        while self._overflow_steps and self._overflow_steps[0] <= step - window:
            self._overflow_steps.popleft()
        return len(self._overflow_steps) / max(1, min(window, step + 1))

    def _check_fp16(self, step: int, scale: float, rate: float) -> None:
        """Warn (at most once per window) when fp16 overflows too often or the loss scale collapses."""
        fcfg = self.config.fp16
        if step - self._fp16_warned_at < fcfg.window:
            return
        problems = []
        if rate > fcfg.max_overflow_rate and len(self._overflow_steps) >= 2:
            problems.append(f"GradScaler skipped {rate:.0%} of the last {min(fcfg.window, step + 1)} steps")
        if scale < fcfg.scale_floor:
            problems.append(f"the loss scale fell to {scale:g} (floor {fcfg.scale_floor:g})")
        if not problems:
            return
        self._fp16_warned_at = step
        layer = self.counters.last_bad_layer
        source = self.source_hint
        where = ""
        if source is not None:
            where = f"; first overflow in {source}"
        elif layer:
            where = f"; the first layer to overflow in backward order: {layer}"
        message = (
            f"fp16 is unstable here: {' and '.join(problems)}{where}. Train in bf16 where the device supports it "
            "(sk.select_precision()), or lower the learning rate."
        )
        details = {"overflow_rate": rate, "loss_scale": scale, "layer": layer, "recommendation": "bf16"}
        self.hooks.emit(Event("fp16_warning", step, message, details))

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Counters, EMAs, detector state, the step, and journal rows not read yet (no host sync)."""
        n = len(self._infos)
        return {
            "step": self.step,
            "scheduler_debt": self.scheduler_debt,
            "counters": self.counters.state(),
            "live": {"skips": self._live_skips, "consecutive": self._live_consecutive},
            "adaptive": {k: v.clone() for k, v in self.adaptive.items()},
            "detector": self.detector.state_dict(),
            "layer_detector": self.layer_detector.state_dict() if self.layer_detector is not None else None,
            "spike_score": self.spike_score.state_dict(),
            "journal": self._journal[:n].clone(),
            "journal_info": [vars(info).copy() for info in self._infos],
            "layer_names": list(self.layer_names),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (tensors move to this engine's device)."""
        if list(state.get("layer_names", self.layer_names)) != self.layer_names:
            raise ValueError(
                "engine state was saved for other layers: "
                f"{state['layer_names'][:3]}... vs {self.layer_names[:3]}... (different model or grouping)"
            )
        self.step = int(state["step"])
        self.scheduler_debt = int(state.get("scheduler_debt", 0))
        self.counters = Counters()
        self.counters.load(dict(state["counters"]))
        live = state.get("live", {})
        self._live_skips = int(live.get("skips", 0))
        self._live_consecutive = int(live.get("consecutive", self.counters.consecutive))
        for key, value in state["adaptive"].items():
            self.adaptive[key] = value.to(device=self.device, dtype=self.adaptive[key].dtype).clone()
        self.detector.load_state_dict(state["detector"])
        if self.layer_detector is not None and state.get("layer_detector") is not None:
            self.layer_detector.load_state_dict(state["layer_detector"])
        if "spike_score" in state:
            self.spike_score.load_state_dict(state["spike_score"])
        rows = state.get("journal")
        infos = [RowInfo(**info) for info in state.get("journal_info", [])]
        if rows is not None and infos:
            if len(infos) > self._capacity or rows.shape[1] != self._journal.shape[1]:
                raise ValueError("engine state holds a journal of another shape (log cadence or layers changed)")
            self._journal[: len(infos)].copy_(rows.to(self._journal))
        self._infos = infos


def _code_of(values: list[float], info: RowInfo) -> int:
    """The packed reason code of one journal row (0 when the step was not skipped).

    The skip column holds 1 for a skip, plus 2 when the data guard forced it.
    """
    return pack_code(
        skipped=values[SKIP] > 0.5,
        grad_finite=math.isfinite(values[TOTAL]),
        loss_finite=not info.has_loss or math.isfinite(values[LOSS]),
        scaler_active=info.scaler_active,
        bad_batch=values[SKIP] > 1.5,
    )


_EMPTY_REPORT = StepReport(
    step=-1,
    grad_norm=torch.zeros(()),
    clip_coef=torch.ones(()),
    skipped=torch.zeros((), dtype=torch.bool),
)
