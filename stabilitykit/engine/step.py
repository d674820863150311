"""The step engine: norms, clipping, the skip decision, on the device; bookkeeping on the host.

A driver (through ``stabilitykit.core.DriverCore``) calls, once per optimizer step and after the
grads are final:

1. ``record_loss(loss)`` for each micro-batch (optional),
2. ``decision = evaluate(...)``: one fused norm pass, clipping in place, the skip flag on the
   device, and one journal row (see ``journal.py``),
3. ``apply(decision, step_fn, optimizer)``: the optimizer step, or the skip,
4. ``hold_scheduler(decision)`` before stepping an LR scheduler,
5. ``finish(decision)``: rows the host read are folded into the ledger (events, counters,
   divergence) and, on logging steps, the metrics go to the sinks.

The state machine of one step, in one place:

* The host KNOWS the skip decision at the step when it read the row then: a logging step (the
  journal is read in ``evaluate``), a non-fused optimizer with skipping on (it cannot skip on the
  device, so it pays one read, as GradScaler does), or a driver that asked (``resolve``).
  Then a skip means: the optimizer step is not called and the scheduler is held this step.
* Otherwise the decision stays on the device (``skip_known is None``): a fused optimizer skips
  through ``found_inf``; the scheduler steps; at the next read the ledger learns of the skip and
  records one step of scheduler debt, paid by holding the scheduler on the next steps.
* With skipping off and no data guard, nothing is ever skipped (``skip_known is False``).

Host syncs: none on a non-logging step when the optimizer is fused or skipping is off; one per
step for other optimizers with skipping on; one per logging step.

With ``GradNormConfig.update_ratio`` the step before each logging step copies the parameters at
the end of ``evaluate`` and measures its update at the start of ``finish``; the logging step reads
it with its journal (``engine/updates.py``), so it adds no sync.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.distributed import all_ranks_agree, is_distributed, reducer_for
from stabilitykit.engine.clipping import PerTensorClip, make_clip_strategy
from stabilitykit.engine.journal import COLUMNS, MAX_JOURNAL_ROWS, Journal, Row, RowInfo
from stabilitykit.engine.layers import build_layer_map
from stabilitykit.engine.ledger import Divergence, Ledger
from stabilitykit.engine.overflow import remeasure_overflow
from stabilitykit.engine.updates import UpdateMonitor
from stabilitykit.events import Event
from stabilitykit.grads import GradNormPlan, apply_clip_coefficient, clip_coefficient
from stabilitykit.hooks import HookManager
from stabilitykit.nn.qk_clip import QKClip
from stabilitykit.report import StepReport
from stabilitykit.spike_skip import SpikeSkipRule

__all__ = ["StabilityEngine", "StepDecision", "StepGate", "is_fused"]


def is_fused(optimizer: Any | None) -> bool:
    """True for optimizers that skip on the device through ``found_inf`` (fused Adam/AdamW/SGD).

    A subclass that overrides ``step`` (to keep a weight EMA, say) would still run its own extra
    work on a step skipped through ``found_inf``, so it counts as non-fused: the host reads the
    decision and does not call ``step`` at all.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    step = getattr(type(optimizer), "step", None)
    return str(getattr(step, "__module__", "")).startswith("torch.optim")


@dataclass
class StepDecision:
    """What ``evaluate`` decided for one optimizer step."""

    report: StepReport
    skip: Tensor  # 0-d bool on the device
    skip_known: bool | None  # True/False when the host read it, None while it is on the device only
    logging: bool = False
    rows: list[Row] = field(default_factory=list)  # journal rows the host read during this step
    loss_scale: float | None = None
    module_metrics: dict[str, float] = field(default_factory=dict)
    update_metrics: dict[str, float] = field(default_factory=dict)  # update ratio and weight norms (logging steps)


class StepGate:
    """One optimizer step's skip, applied around the step (see ``StabilityEngine.open_step``)."""

    def __init__(self, decision: StepDecision, fused_optimizer: Any | None, qk_clip: QKClip | None) -> None:
        self.decision = decision
        self.skip_now = decision.skip_known is True
        self._qk_clip = qk_clip
        self._optimizer = None
        self._previous: Tensor | None = None
        if not self.skip_now and decision.skip_known is None and fused_optimizer is not None:
            self._optimizer = fused_optimizer
            self._previous = getattr(fused_optimizer, "found_inf", None)
            flag = decision.skip.to(torch.float32)
            previous = self._previous
            fused_optimizer.found_inf = flag if previous is None else torch.maximum(previous, flag.to(previous))

    def close(self) -> None:
        """The step ran (or was skipped): restore ``found_inf``, then QK-clip on a step that was taken."""
        optimizer, self._optimizer = self._optimizer, None
        if optimizer is not None:
            if self._previous is None:
                del optimizer.found_inf
            else:
                optimizer.found_inf = self._previous
        qk_clip, self._qk_clip = self._qk_clip, None
        if qk_clip is not None:
            skip = self.decision.skip
            qk_clip.apply(skip=torch.ones_like(skip) if self.skip_now else skip)


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
        extra_group: Any | None = None,
    ) -> None:
        self.config = config or StabilityConfig()
        self.hooks = hooks or HookManager()
        self.fused = fused
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("StabilityEngine needs at least one parameter that requires grad")
        gcfg = self.config.grad_norm
        layers = build_layer_map(self.params, model, gcfg.grouping, names)
        self.param_names = layers.param_names
        self.layer_names = layers.layer_names
        self.per_layer = gcfg.per_layer
        self.plan = GradNormPlan(
            self.params,
            layers.layer_of if self.per_layer else None,
            self.layer_names if self.per_layer else None,
            norm_type=gcfg.norm_type,
            reducer=reducer_for(self.params, model, extra_group),
            per_tensor=self.config.clip.mode == "per_tensor_adaptive",
        )
        self.logged_layers = [i for i, n in enumerate(self.layer_names) if self._layer_logged(n)]
        self.updates = UpdateMonitor(self.plan) if gcfg.update_ratio else None  # see engine/updates.py
        self.device = self.params[0].device
        self.step = 0  # optimizer steps attempted so far (skipped ones included)
        self.clip = make_clip_strategy(self.config.clip, self.device, len(self.params), gcfg.norm_type)
        scfg = self.config.skip
        self.spike_rule = (
            SpikeSkipRule(scfg.spike_z, scfg.spike_alpha, scfg.spike_warmup_steps, self.device, scfg.spike_on_loss)
            if scfg.spike
            else None
        )
        rank = torch.distributed.get_rank() if is_distributed() else None
        self.ledger = Ledger(self.config, self.layer_names if self.per_layer else [], fused, rank)
        capacity = min(self.config.log_every_n_steps or 1, MAX_JOURNAL_ROWS)
        self.journal = Journal(capacity, len(self.layer_names) if self.per_layer else 0, self.device)
        self._false = torch.zeros((), dtype=torch.bool, device=self.device)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        self._nan = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        self._loss_sum: Tensor | None = None
        self.last_host_metrics: dict[str, float] = {}
        #: Where a driver's tracer saw the first non-finite value; named by this step's skip events.
        self.source_hint: Any | None = None
        #: Modules with ``stability_metrics()`` (ZLoss, QKNormAttention): read on logging steps.
        self.metric_sources: list[Any] = []
        if model is not None and self.config.module_metrics:
            self.metric_sources = [m for m in model.modules() if callable(getattr(m, "stability_metrics", None))]
        #: QK-clip (``config.qk_clip``) over the attention modules this optimizer updates, else None.
        self.qk_clip = QKClip.from_config(self.config.qk_clip, model, self.params)
        if self.qk_clip is not None and self.config.module_metrics:
            self.metric_sources.append(self.qk_clip)
        self._mark_measure()

    # ----------------------------------------------------------------------------- helpers

    def _layer_logged(self, name: str) -> bool:
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
    def counters(self) -> Any:
        """The ledger's counters (exact after a logging step, and always for non-fused optimizers)."""
        return self.ledger.counters

    @property
    def skipped_total(self) -> int:
        """Skipped steps the host knows of."""
        return int(self.ledger.counters.skipped_total)

    @property
    def consecutive(self) -> int:
        """The current run of skipped steps, as far as the host knows."""
        return int(self.ledger.counters.consecutive)

    # ----------------------------------------------------------------------------- the step

    def record_loss(self, loss: Tensor) -> None:
        """Add one micro-batch's loss (detached, on the device) to this optimizer step's loss.

        The step's loss is the sum of the losses backpropagated into its grads: with the usual
        ``loss / accumulate`` per micro-batch (Lightning, Accelerate and the HF Trainer divide for
        you) that is the mean loss of the whole batch.
        """
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def evaluate(
        self,
        grad_scale: Tensor | None = None,
        scaler_active: bool = False,
        loss_scale: Tensor | None = None,
        force_skip: Tensor | None = None,
    ) -> StepDecision:
        """Measure, clip and decide this step; its numbers go into the device journal.

        ``grad_scale``: the loss scale still applied to the grads (fused optimizer + fp16), so norms
        are reported unscaled. ``scaler_active``: a GradScaler is in use, so a non-finite grad is an
        fp16 overflow. ``loss_scale``: the GradScaler's scale, logged on logging steps.
        ``force_skip``: a 0-d device bool (the data guard's verdict) that skips the step when true.
        """
        cfg = self.config
        step = self.step
        logging = self.is_logging_step(step)
        update_sums = self.updates.to_fold(step) if self.updates is not None else None
        norms, grouped = self.plan.compute(grad_scale, extra=update_sums)
        total = norms.total
        finite = norms.finite if norms.finite is not None else torch.isfinite(total)
        loss = self._loss_sum  # the sum of what was backpropagated: with ``loss / accumulate`` the batch mean
        self._loss_sum = None
        skip = self._false
        all_finite = finite & torch.isfinite(loss) if loss is not None else finite
        if cfg.skip.nonfinite:
            skip = ~all_finite
        if force_skip is not None:
            skip = skip | force_skip
        spike = self.spike_rule.decide(total, loss, all_finite) if self.spike_rule is not None else None
        if spike is not None:
            skip = skip | spike
        can_skip = cfg.skip.nonfinite or force_skip is not None or spike is not None
        if can_skip and cfg.skip.sync_ranks:
            skip = all_ranks_agree(skip)
        skip_column = skip.float()
        if force_skip is not None:
            skip_column = skip_column + 2 * force_skip.float()
        if spike is not None:
            skip_column = skip_column + 4 * spike.float()

        coef, threshold = self._one, self._nan
        if isinstance(self.clip, PerTensorClip):  # AdaGC: one coefficient per tensor; coef = post / pre total
            clipped = self.clip.clip_tensors(norms, all_finite & ~skip)  # a skipped step leaves the EMAs alone
            coef, threshold = clipped.coef, clipped.threshold
            self.plan.scale_tensors(grouped, clipped.coefs)
        elif self.clip is not None:
            threshold, active = self.clip.threshold(total, finite)
            coef = torch.where(active, clip_coefficient(total, threshold, finite), 1.0)
            apply_clip_coefficient(grouped, coef)

        scalars = [total, loss if loss is not None else self._nan, skip_column, coef, threshold]
        self.journal.write(RowInfo(step, loss is not None, scaler_active), scalars, norms.layer_norms)
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
            spike=spike,
        )
        decision = StepDecision(report=report, skip=skip, skip_known=None, logging=logging)
        if logging or self.journal.full:
            self._read_journal(decision, loss_scale)
        elif can_skip and not self.fused:
            self.resolve(decision)  # the one sync a non-fused optimizer pays to skip
        elif not can_skip:
            decision.skip_known = False
        if decision.skip_known and self._overflowed(decision):
            self._remeasure(decision, grouped, grad_scale, force_skip)
        if self.updates is not None and self.is_logging_step(step + 1):
            self.updates.snapshot(step)  # the parameters before this step's update, read at the next step
        return decision

    def _overflowed(self, decision: StepDecision) -> bool:
        """The host read a skip with a non-finite norm while clipping is on: maybe an fp32 overflow of finite grads.

        Only the globally reduced total decides, so every rank takes the same branch (across ranks an
        overflow arrives as NaN, like a real NaN, so both are re-measured). With skip-on-spike on,
        such a step is skipped as a spike anyway; an fp16 overflow has Inf grads and stays skipped.
        """
        row = decision.rows[-1] if decision.rows and decision.rows[-1].step == decision.report.step else None
        return (
            row is not None
            and not math.isfinite(row.total)
            and self.clip is not None
            and not isinstance(self.clip, PerTensorClip)
            and self.spike_rule is None
            and self.config.skip.nonfinite
        )

    def _remeasure(
        self, decision: StepDecision, grouped: list[list[Tensor]], grad_scale: Tensor | None, force_skip: Tensor | None
    ) -> None:
        """Re-measure an overflowed step in fp64 (``overflow.py``); finite grads are clipped and the step runs."""
        assert self.clip is not None and not isinstance(self.clip, PerTensorClip)
        report = decision.report
        found = remeasure_overflow(
            self.plan, self.clip, grouped, grad_scale, report.loss, force_skip, self.config.skip.sync_ranks
        )
        if found is None:
            return
        report.grad_norm, report.clip_coef, report.layer_norms = found.total, found.coef, found.layer_norms
        report.skipped = decision.skip = self._false
        row = decision.rows[-1]
        row.total, row.coef, row.threshold, row.code = float(found.total), float(found.coef), float(found.threshold), 0
        row.layers = found.layer_norms.tolist() if found.layer_norms is not None else []
        self._know(decision, row)
        self.journal.rewrite_last(self._row_scalars(report, found.threshold), found.layer_norms)

    def _row_scalars(self, report: StepReport, threshold: Tensor) -> list[Tensor]:
        """The journal's scalar columns for ``report`` (see ``journal.COLUMNS``)."""
        loss = report.loss if report.loss is not None else self._nan
        return [report.grad_norm, loss, report.skipped.float(), report.clip_coef, threshold]

    def resolve(self, decision: StepDecision) -> bool:
        """Read this step's decision now (one sync); the skip is then applied and reported at once."""
        if decision.skip_known is not None:
            return decision.skip_known
        row = self.journal.read_last()
        decision.rows.append(row)
        self._know(decision, row)
        return bool(decision.skip_known)

    def _know(self, decision: StepDecision, row: Row) -> None:
        decision.report._code_value = row.code
        decision.skip_known = row.skipped

    def _read_journal(self, decision: StepDecision, loss_scale: Tensor | None = None) -> None:
        """Copy the journal rows since the last read to the host: the logging step's one sync."""
        names: list[str] = []
        extras: list[Tensor] = []
        if decision.logging:
            for key, value in self._module_metrics().items():
                names.append(key)
                extras.append(value)
        if loss_scale is not None:
            names.append("scaler/scale")
            extras.append(loss_scale)
        updates = self.updates if decision.logging else None
        update = updates.values(decision.report.step) if updates is not None else None
        if update is not None:
            extras = [*extras, update]  # a vector: the update ratio and weight norms, read in the same copy
        rows, tail = self.journal.read(extras, current_step=decision.report.step)
        if updates is not None and update is not None:
            decision.update_metrics = updates.named(tail[len(names) :], self.layer_names, self.logged_layers)
        values = dict(zip(names, tail[: len(names)], strict=True))
        decision.loss_scale = values.pop("scaler/scale", None)
        decision.module_metrics = values
        decision.rows.extend(rows)
        if rows and rows[-1].step == decision.report.step and decision.skip_known is None:
            self._know(decision, rows[-1])

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

    def open_step(self, decision: StepDecision, optimizer: Any | None = None) -> StepGate:
        """Prepare the optimizer step for ``decision``; ``close()`` the gate after the step (or instead of it).

        A skip the host knows: ``skip_now`` is true and the optimizer step must not run. A skip still
        on the device, with a fused optimizer: OR-ed into ``found_inf`` until ``close()`` (GradScaler's
        own flag, when it set one, is kept and restored, so its bookkeeping is untouched). QK-clip
        (``config.qk_clip``) rescales at ``close()``, and nothing on a skipped step.
        """
        return StepGate(decision, optimizer if self.fused else None, self.qk_clip)

    def apply(self, decision: StepDecision, step_fn: Callable[[], Any], optimizer: Any | None = None) -> Any:
        """Run the optimizer step unless this step is skipped; fused optimizers skip on the device."""
        gate = self.open_step(decision, optimizer)
        if gate.skip_now:
            gate.close()
            return None
        try:
            return step_fn()
        finally:
            gate.close()

    def hold_scheduler(self, decision: StepDecision) -> bool:
        """True when the LR scheduler must not advance this step (skipped now, or skips learned late)."""
        return self.ledger.hold_scheduler(decision.skip_known)

    def finish(self, decision: StepDecision, log_step: int | None = None) -> StepReport:
        """Host-side bookkeeping after the step: the ledger, events, sinks, then the divergence check.

        ``log_step``: the step number sinks see (a framework's global step); default the engine's.
        """
        step = self.step
        self.step += 1
        if self.updates is not None:
            self.updates.measure()  # after the optimizer step: this step's update, if it was snapshotted
        self._mark_measure()
        divergence = self._fold(decision.rows, step, decision.module_metrics)
        if decision.logging:
            self._log_metrics(decision, step if log_step is None else log_step)
        if divergence is not None:
            self._diverged(divergence, raise_error=True)
        return decision.report

    def _fold(self, rows: list[Row], step: int, signals: dict[str, float] | None = None) -> Divergence | None:
        """Fold rows the ledger has not taken yet; emit their events; the first divergence among them.

        ``signals``: module metrics measured at ``step`` (max attention logit, log Z), scored with its row.
        """
        first: Divergence | None = None
        for row in rows:
            if row.folded:
                continue
            source, row_signals = None, None
            if row.step == step:
                source, self.source_hint = self.source_hint, None
                row_signals = signals
            events, divergence = self.ledger.fold(row, source, row_signals)
            for event in events:
                self.hooks.emit(event)
            first = first or divergence
        return first

    def _diverged(self, divergence: Divergence, raise_error: bool) -> None:
        err = divergence.error()
        details = {"consecutive": divergence.consecutive, "layer": divergence.layer, "reason": divergence.reason}
        self.hooks.emit(Event("diverged", divergence.step, str(err), details))
        if raise_error:
            raise err

    def flush(self) -> None:
        """Read and fold the journal now (one sync): counters, detectors and events catch up.

        Drivers call it at the end of training and ``summary()`` relies on it. A run of skips that
        reached ``max_consecutive`` is reported as a "diverged" event, not raised.
        """
        if not len(self.journal):
            return
        rows, _ = self.journal.read()
        divergence = self._fold(rows, self.step)
        if divergence is not None:
            self._diverged(divergence, raise_error=False)

    def _log_metrics(self, decision: StepDecision, step: int) -> None:
        """The logging step's metrics, from the rows just read, to every sink."""
        c = self.ledger.counters
        last = decision.rows[-1]
        metrics: dict[str, float] = {
            "grad_norm/total": last.total,
            "grad_norm/max": c.max_norm_recent,
            "skipped/total": c.skipped_total,
            "skipped/recent": c.skipped_recent,
            "skipped/consecutive": c.consecutive,
            "nonfinite/total": c.nonfinite_total,
        }
        if last.loss is not None:
            metrics["loss"] = last.loss
        if self.clip is not None:
            metrics["clip/coef"] = last.coef
            metrics["clip/threshold"] = last.threshold
            metrics["clip/clipped_total"] = c.clipped_total
            metrics["clip/clipped_recent"] = c.clipped_recent
        if decision.loss_scale is not None:
            metrics["scaler/scale"] = decision.loss_scale
            metrics["scaler/overflow_rate"] = self.ledger.fp16.rate(last.step)
            for event in self.ledger.fp16_events(last.step, decision.loss_scale, self.source_hint):
                self.hooks.emit(event)
        metrics.update(decision.module_metrics)
        metrics.update(decision.update_metrics)
        if self.ledger.spikes is not None:
            metrics.update(self.ledger.spikes.metrics())
        if self.per_layer:
            for i in self.logged_layers:
                metrics[f"grad_norm/{self.layer_names[i]}"] = last.layers[i]
        if c.clipped_recent:
            count = c.clipped_recent
            self.hooks.emit(
                Event("clipped", step, f"{count} step(s) clipped since the last logging step", {"count": count})
            )
        c.reset_recent()
        named = {self.key(k): float(v) for k, v in metrics.items()}
        self.last_host_metrics = dict(named)
        self.hooks.log_metrics(named, step)

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The step, the ledger, the clipping state and journal rows not read yet (no host sync)."""
        return {
            "step": self.step,
            "ledger": self.ledger.state_dict(),
            "clip": self.clip.state_dict() if self.clip is not None else {},
            "spike_rule": self.spike_rule.state_dict() if self.spike_rule is not None else None,
            "journal": self.journal.state_dict(),
            "layer_names": list(self.layer_names),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (tensors move to this engine's device).

        Everything is loaded into fresh objects first and swapped in only when all of it loaded, so
        a state that does not fit leaves the engine exactly as it was.
        """
        saved_layers = list(state.get("layer_names", self.layer_names))
        if saved_layers != self.layer_names:
            raise ValueError(
                "engine state was saved for other layers: "
                f"{saved_layers[:3]}... vs {self.layer_names[:3]}... (different model or grouping)"
            )
        ledger = Ledger(self.config, self.ledger.layer_names, self.fused, self.ledger.rank)
        ledger.load_state_dict(state["ledger"])
        clip = make_clip_strategy(self.config.clip, self.device, len(self.params), self.config.grad_norm.norm_type)
        if clip is not None and state.get("clip"):
            clip.load_state_dict(state["clip"])
        journal = Journal(self.journal.capacity, self.journal.width - len(COLUMNS), self.device)
        journal.load_state_dict(state.get("journal", {}))
        rule = self.spike_rule
        if rule is not None and state.get("spike_rule"):
            scfg = self.config.skip
            rule = SpikeSkipRule(
                scfg.spike_z, scfg.spike_alpha, scfg.spike_warmup_steps, self.device, scfg.spike_on_loss
            )
            rule.load_state_dict(state["spike_rule"])
        self.step = int(state["step"])
        self.ledger, self.clip, self.journal, self.spike_rule = ledger, clip, journal, rule
        if self.updates is not None:
            self.updates.reset()
        self._mark_measure()
