"""The step engine: norms, clipping, the skip decision, on the device; bookkeeping on the host.

One engine guards one optimizer. The driver base (``stabilitykit.drivers.base``) builds it, attaches
what a driver needs around it (the optimizer, its GradScaler adapter, buffers, tracing, recovery,
rerun, replica checks: public attributes, None on a bare engine) and calls, once per optimizer step
and after the grads are final:

1. ``inputs.add_loss(loss)`` for each micro-batch (optional; ``inputs.py``),
2. ``decision = evaluate(...)``, top to bottom: one fused norm pass (``grads.GradNormPlan``); the
   step record agreed across ranks in ONE collective (``engine/step_record.py``, every rank,
   every step); the decision code (``rules/registry.py``); clipping in place (``clipping.py``); one
   journal row (``journal.py``); the host reads the row now only where it must (below),
3. ``gate = StepGate(decision, optimizer, qk_clip)``, the optimizer step unless ``gate.skip_now``,
   then ``gate.close()`` (``gate.py``; the driver's step routes do this, ``drivers/routing.py``),
4. ``holds_scheduler()`` before stepping an LR scheduler (decided once per step),
5. ``book_step(decision)``: rows the host read are folded into the ledger (events, counters,
   divergence) and, on logging steps, the metrics (``metrics.py``) go to the sinks; both are the
   host side's job (``readout.py``), which also does the logging step's read.

What the host knows of a step is explicit (``decision.outcome``):

* ``Known(code)``: the host read the row at this step: a logging step (the journal is read in
  ``evaluate``), a non-fused optimizer with skipping on (it cannot skip on the device, so it pays
  one read, as GradScaler does), or a driver that asked (``resolve``). A skip then means: the
  optimizer step is not called and the scheduler is held this step.
* ``PENDING``: the code stays on the device; a fused optimizer skips through ``found_inf``; the
  scheduler steps; at the next read the ledger learns of the skip and records one step of
  scheduler debt, paid by holding the scheduler on the next steps.
* With skipping off and no data guard nothing is ever skipped: ``TAKEN`` without a read.

Every branch the host takes on a step (a read, the fp64 re-measure of an overflow) depends only on
the configuration, the step number and values agreed across ranks, so every rank runs the same
collectives in the same order.

Host syncs: none on a non-logging step when the optimizer is fused or skipping is off; one per
step for other optimizers with skipping on; one per logging step.

With ``GradNormConfig.update_ratio`` the step before each logging step copies the parameters at
the end of ``evaluate`` and measures its update at the start of ``book_step``; the logging step reads
it with its journal (``engine/updates.py``), so it adds no sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from stabilitykit.buffers import BufferGuard
from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.compat.private import supports_amp_scaling
from stabilitykit.distributed import is_distributed, mark_collective_step, reducer_for
from stabilitykit.engine.clipping import ClipStrategy, PerTensorClip, make_clip_strategy
from stabilitykit.engine.decision import NO_ASK, TAKEN, Known, RecoveryAnswer, RecoveryAsk, StepDecision
from stabilitykit.engine.gate import NewStateCheck
from stabilitykit.engine.inputs import StepInputs
from stabilitykit.engine.journal import MAX_JOURNAL_ROWS, Journal, RowInfo
from stabilitykit.engine.layers import build_layer_map
from stabilitykit.engine.ledger import Ledger
from stabilitykit.engine.metrics import MetricNames
from stabilitykit.engine.overflow import remeasure_overflow
from stabilitykit.engine.readout import Readout
from stabilitykit.engine.sources import MetricSources
from stabilitykit.engine.updates import UpdateMonitor
from stabilitykit.grads import GradNormPlan, NormResult, apply_clip_coefficient, clip_coefficient
from stabilitykit.hooks import HookManager
from stabilitykit.monitors import ModelMonitor
from stabilitykit.nn.qk_clip import QKClip
from stabilitykit.report import StepReport
from stabilitykit.rules import RuleSet, SkipRule, builtin_rules
from stabilitykit.rules.spike import Spike

if TYPE_CHECKING:  # the config module imports the sections' owners, this package among them
    from stabilitykit.config import StabilityConfig
    from stabilitykit.replicas import ReplicaCheck
    from stabilitykit.rerun import Rerun
    from stabilitykit.tracing import NaNTracing


def is_fused(optimizer: Any | None) -> bool:
    """True for optimizers that skip on the device through ``found_inf`` (fused Adam/AdamW/SGD).

    A subclass that overrides ``step`` (to keep a weight EMA, say) would still run its own extra
    work on a step skipped through ``found_inf``, so it counts as non-fused: the host reads the
    decision and does not call ``step`` at all.
    """
    if not supports_amp_scaling(optimizer):
        return False
    step = getattr(type(optimizer), "step", None)
    return str(getattr(step, "__module__", "")).startswith("torch.optim")


#: One measurement of a step: norms, grouped grads, loss, metrics, the agreed values, the decision code, the skip.
_Measured = tuple[NormResult, list[list[Tensor]], Tensor | None, dict[str, Tensor], dict[str, Tensor], Tensor, Tensor]


@dataclass
class _Parts:
    """The engine's stateful parts, built fresh by ``StabilityEngine._fresh_parts`` (construction and load)."""

    ledger: Ledger
    clip: ClipStrategy | PerTensorClip | None
    rules: RuleSet
    journal: Journal

    @property
    def spike_rule(self) -> Spike | None:
        """The built-in skip-on-spike rule (``SkipConfig(spike=True)``), or None."""
        rule = self.rules.by_name("spike")
        return rule if isinstance(rule, Spike) else None


class StabilityEngine:
    """One guarded optimizer: the stability step every driver shares, and what is attached to it."""

    def __init__(
        self,
        params: Sequence[nn.Parameter | Tensor],
        config: StabilityConfig,
        model: nn.Module | None = None,
        hooks: HookManager | None = None,
        fused: bool = False,
        names: Sequence[str] | None = None,
        extra_group: Any | None = None,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        self.config = config
        self.user_rules = list(rules)
        self.hooks = hooks or HookManager()
        self.fused = fused
        self._model, self._names, self._extra_group = model, names, extra_group
        self._bind_params(params)
        #: The step in flight's losses and recorded metrics, and the step record built from them.
        self.inputs = StepInputs(self.device)
        self.rank = torch.distributed.get_rank() if is_distributed() else None
        self.step = 0  # optimizer steps attempted so far (skipped ones included)
        #: The host side: journal reads, rows folded into the ledger, events and metrics out (``readout.py``).
        self.readout = Readout(self.hooks)
        self._install(self._fresh_parts())
        #: Whether anything can ever skip a step (configuration and rules only, so the same on every rank).
        self.can_skip = self.config.can_skip or bool(self.user_rules)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        #: Re-running a flagged step (``config.rerun``, ``rerun/policy.py``): set by the driver base, or None.
        self.rerun: Rerun | None = None
        #: Modules that measure themselves, QK-clip and the model monitor (``engine/sources.py``).
        self.sources = MetricSources(self.config, model, self.params)
        self.sources.begin_step(self.step, self.is_logging_step())
        # What the driver base attaches (``drivers/build.py``); a bare engine (benchmarks, tests) keeps these.
        #: The torch optimizer this engine guards (framework wrappers looked through), or None; and the one
        #: whose param groups hold the LRs the step uses (``lr/<group>``): another where the driver steps
        #: one behind stand-ins (DeepSpeed's).
        self.optimizer: Any = None
        self.lr_optimizer: Any = None
        #: The GradScaler (``compat/grad_scaler.py``): stage-aware unscale, the scale to log.
        self.scaler = ScalerAdapter(None)
        #: Running statistics (BatchNorm) put back on a skipped step (``config.skip.restore_buffers``).
        self.buffers = BufferGuard([])
        #: The NaN tracing policy (``config.nan_trace``), rollback (``config.recovery``: a
        #: ``recovery.controller.Recovery``, typed loosely here because the recovery package imports the
        #: engine) and replica checks (``config.replicas``), or None when off.
        self.tracing: NaNTracing | None = None
        self.recovery: Any = None
        self.replicas: ReplicaCheck | None = None
        #: Steps a fused optimizer would create state on are decided on the host (``engine/gate.py``).
        self.new_state = NewStateCheck()
        #: The step decided and not finished yet (between a driver's ``decide`` and ``end_step``), or None.
        self.in_flight: StepDecision | None = None
        self.last_report: StepReport | None = None
        #: Steps an LR scheduler was held for (``schedule_step = step - held_steps``), and this step's hold.
        self.held_steps = 0
        self._hold: bool | None = None
        #: ``optimizer.step()`` calls made directly, outside a step of the driver (a warning names the first).
        self.unguarded_steps = 0

    def _bind_params(self, params: Sequence[nn.Parameter | Tensor]) -> None:
        """Measure ``params`` (every parameter the optimizer holds, frozen ones too: a parameter without
        a grad this step simply drops out of the pass): their layers, the norm plan, metric names."""
        self.params = list(params)
        if not self.params:
            raise ValueError(
                "stabilitykit has nothing to guard: the optimizer holds no parameters (check what "
                "configure_optimizers / your optimizer was given)"
            )
        gcfg = self.config.grad_norm
        layers = build_layer_map(self.params, self._model, gcfg.grouping, self._names)
        self.param_names = layers.param_names
        self.layer_names = layers.layer_names
        self.per_layer = gcfg.per_layer
        self.plan = GradNormPlan(
            self.params,
            layers.layer_of if self.per_layer else None,
            self.layer_names if self.per_layer else None,
            norm_type=gcfg.norm_type,
            reducer=reducer_for(self.params, self._model, self._extra_group),
            per_tensor=self.config.clip.mode == "per_tensor_adaptive",
        )
        self.names = MetricNames(self.config, self.layer_names)
        self.updates = UpdateMonitor(self.plan) if gcfg.update_ratio else None  # see engine/updates.py
        self.device = self.params[0].device

    def follow_params(self, params: Sequence[nn.Parameter | Tensor]) -> None:
        """The optimizer's parameters changed (a param group added mid-run, as Lightning's
        ``BaseFinetuning`` does): measure the new set from the next step on.

        The steps so far are folded first (one sync, only when the set changes). Counters, scheduler
        debt, the fp16 monitor, clipping and skip-on-spike statistics carry over; the spike monitor
        carries over when the layers are the same, else starts afresh (the norm's scale changed);
        per-tensor clipping state starts afresh (it is per parameter).
        """
        self.readout.flush(self.step)
        if self._names is not None and len(self._names) != len(params):
            self._names = None  # names given for the old set: name the new one from the model
        old = _Parts(self.ledger, self.clip, self.rules, self.journal)
        old_layers = self.layer_names
        self._bind_params(params)
        parts = self._fresh_parts()
        parts.ledger.carry_over(old.ledger, spikes=self.layer_names == old_layers)
        if not isinstance(old.clip, PerTensorClip):
            parts.clip = old.clip
        parts.rules = old.rules
        self._install(parts)
        self.sources.follow_params(self.params)

    def _install(self, parts: _Parts) -> None:
        """Swap ``parts`` in (all at once, after they were built and loaded); whether an LR scheduler is
        held on skips (named in a late skip's event) carries over from the ledger it replaces."""
        previous = vars(self).get("ledger")  # None at construction
        parts.ledger.has_scheduler = previous is not None and previous.has_scheduler
        self.ledger, self.clip = parts.ledger, parts.clip
        self.rules, self.journal = parts.rules, parts.journal
        self.spike_rule = parts.spike_rule
        #: A skip the host read with a non-finite norm may be an fp32 overflow of finite grads, re-measured in
        #: fp64 (``overflow.py``): with clipping by the total norm, non-finite steps skipped and skip-on-spike
        #: off (it skips such a step as a spike anyway; an fp16 overflow has Inf grads and stays skipped).
        self._overflow_possible = (
            parts.clip is not None
            and not isinstance(parts.clip, PerTensorClip)
            and parts.spike_rule is None
            and self.config.skip.nonfinite
        )
        self.readout.bind(parts.ledger, parts.journal, parts.rules, self.names, self.updates, parts.clip is not None)

    def _fresh_parts(self) -> _Parts:
        """The stateful parts, new: the one place they are built (at construction and to load a state)."""
        cfg = self.config
        rules = RuleSet([*builtin_rules(cfg, self.device), *self.user_rules])
        capacity = min(cfg.log_every_n_steps or 1, MAX_JOURNAL_ROWS)
        n_layers = len(self.layer_names) if self.per_layer else 0
        return _Parts(
            ledger=Ledger(cfg, self.layer_names if self.per_layer else [], self.fused, self.rank, rules),
            clip=make_clip_strategy(cfg.clip, self.device, len(self.params), cfg.grad_norm.norm_type),
            rules=rules,
            journal=Journal(capacity, n_layers, self.device, self.inputs.layout.names),
        )

    def _parts_from(self, state: dict[str, Any]) -> _Parts:
        """Fresh parts holding a saved engine state's ledger, clipping, skip rule and journal rows
        (for ``load_state_dict`` and a rollback's ``rewind``); nothing is installed yet."""
        parts = self._fresh_parts()
        parts.ledger.load_state_dict(state["ledger"])
        if parts.clip is not None and state["clip"]:
            parts.clip.load_state_dict(state["clip"])
        parts.journal.load_state_dict(state["journal"])
        if parts.spike_rule is not None and state["spike_rule"]:
            parts.spike_rule.load_state_dict(state["spike_rule"])
        for rule in self.user_rules:
            saved = state["rules"].get(rule.name)
            if saved:
                rule.load_state_dict(saved)
        return parts

    # ----------------------------------------------------------------------------- helpers

    @property
    def monitor(self) -> ModelMonitor | None:
        """The sampled model monitor (``config.monitors``), or None."""
        return self.sources.monitor

    @property
    def qk_clip(self) -> QKClip | None:
        """QK-clip over the attention modules this optimizer updates (``config.qk_clip``), or None."""
        return self.sources.qk_clip

    def is_logging_step(self, step: int | None = None) -> bool:
        """True when ``step`` (default: the coming one) copies metrics to the host."""
        every = self.config.log_every_n_steps or 1
        return (self.step if step is None else step) % every == 0

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

    def record_metric(self, name: str, value: Tensor | float, reduce: str = "mean") -> None:
        """Record a user metric for the step in flight (a 0-d device tensor; no sync).

        It goes into this step's record: rules see this rank's value, the journal keeps the value
        agreed across ranks with ``reduce``, logging steps log it as ``<prefix>/metrics/<name>`` and
        the spike detector watches it. Recording the same name twice in a step keeps the last value.
        """
        self.inputs.add_metric(name, value, reduce, self.step)

    def evaluate(
        self,
        grad_scale: Tensor | None = None,
        scaler_active: bool = False,
        loss_scale: Tensor | None = None,
        force_skip: Tensor | None = None,
        ask: RecoveryAsk = NO_ASK,
    ) -> StepDecision:
        """Measure, agree, decide, clip and record this step; the host reads it now only where it must.

        ``grad_scale``: the loss scale still applied to the grads (fused optimizer + fp16), so norms
        are reported unscaled. ``scaler_active``: a GradScaler is in use, so a non-finite grad is an
        fp16 overflow. ``loss_scale``: the GradScaler's scale, logged on logging steps.
        ``force_skip``: a 0-d device bool (the data guard's flag) that skips the step when true.
        ``ask``: what recovery asks of this step (``RecoveryAsk``: a batch a rollback skips, a rollback
        request, a snapshot's health), agreed in this step's collective with the rest.
        """
        step = self.step
        mark_collective_step(step)
        update_sums = self.updates.to_fold(step) if self.updates is not None else None

        def measure() -> _Measured:
            norms, grouped = self.plan.compute(grad_scale, extra=update_sums)
            loss, metrics, layout_fixed_now = self.inputs.take()
            if layout_fixed_now:
                self.journal.relayout(self.inputs.layout.names)
            observed = self.sources.step_values()  # the monitors' values of this step, for the rules
            record = self.inputs.build_record(
                norms,
                loss,
                metrics,
                self.rules,
                step,
                force_skip,
                ask,
                scaler_active,
                observed,
            )
            agreed = record.agree(self.config.skip.sync_ranks)
            code, skip = self.rules.code(*self.inputs.rule_flags(record, agreed, self.rules))
            return norms, grouped, loss, metrics, agreed, code, skip

        rerun = self.rerun if self.rerun is not None and self.rerun.armed and self.can_skip else None
        saved = _saved_statistics(self.rules, self.clip) if rerun is not None else None
        measured = measure()
        decision = self._decide(step, measured, scaler_active)
        if ask.skip_ahead:
            decision.settle(self.rules.constant("after_rollback"), "after_rollback")  # known on the host: no sync
        if decision.logging or self.journal.full:
            self.readout.read(decision, self.sources, loss_scale)
        elif self.can_skip and (not self.fused or (rerun is not None and rerun.config.read_every_step)):
            self.resolve(decision)  # the one sync a non-fused optimizer pays to skip (or rerun asked for it)
        elif not self.can_skip and not ask.skip_ahead:
            decision.settle(TAKEN.code, None)
        outcome = decision.outcome
        if (
            rerun is not None
            and isinstance(outcome, Known)
            and rerun.wanted(outcome.code, self.rules, self.inputs.micro_batches)
        ):
            # a step the host reads anyway is re-run (no read of its own): see ``rerun/policy.py``
            assert saved is not None
            first = (measured[2], measured[0].total)  # this rank's own loss and norm, before they were agreed
            _load_statistics(self.rules, self.clip, saved)  # the rules and clipping see the step once
            rerun.recompute()  # the batch's forward and backward again, from the step's random state
            measured = measure()
            again = self._decide(step, measured, scaler_active, rewrite=True)
            decision = _redecide(self.journal, self.reason_of, decision, again)
            rerun.judge(step, first, (measured[2], measured[0].total))  # transient: this recomputed step goes on
        if decision.skipped_now and self._overflow_possible and _read_nonfinite(decision):
            self._remeasure(decision, measured[1], grad_scale, force_skip)
        if self.updates is not None and self.is_logging_step(step + 1):
            self.updates.snapshot(step)  # the parameters before this step's update, read at the next step
        return decision

    def _decide(self, step: int, measured: _Measured, scaler_active: bool, rewrite: bool = False) -> StepDecision:
        """Clip from a measurement and write its journal row; the decision, not read yet (no sync).

        ``rewrite``: the step was measured again (a rerun): its row replaces the one written before, if the
        journal still holds it.
        """
        norms, grouped, loss, metrics, agreed, code, skip = measured
        total = agreed["grad_norm"]
        coef, threshold = self._clip(norms, grouped, total, agreed["grads_finite"], agreed["loss_finite"], skip)
        layer_norms = norms.layer_norms
        agreed_metrics = {name: agreed[f"metric/{name}"] for name in metrics} if metrics else {}
        if rewrite:
            self.journal.drop_last(step)
        self.journal.write(
            RowInfo(step, loss is not None, scaler_active),
            [
                total,
                self.inputs.nan if loss is None else loss,
                code,
                coef,
                threshold,
                agreed["request"],
                agreed["health"],
            ],
            list(agreed_metrics.values()),
            layer_norms,
        )
        report = StepReport(
            step=step,
            grad_norm=total,
            clip_coef=coef,
            skipped=skip,
            loss=loss,
            layer_norms=layer_norms,
            layer_names=self.layer_names,
            scaler_active=scaler_active,
            code=code,
            decode=self.reason_of,
            values=agreed_metrics,
        )
        return StepDecision(report=report, skip=skip, code=code, logging=self.is_logging_step(step))

    def reason_of(self, code: int) -> str | None:
        """Why a step with decision ``code`` was skipped (None: taken): the rule set decodes it."""
        return self.rules.decode(code).reason

    def _clip(
        self,
        norms: NormResult,
        grouped: list[list[Tensor]],
        total: Tensor,
        grads_finite: Tensor,
        loss_finite: Tensor,
        skip: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Clip the grads in place from the agreed norm; returns (coefficient, threshold) as device tensors."""
        if isinstance(self.clip, PerTensorClip):  # AdaGC: one coefficient per tensor; coef = post / pre total
            all_finite = grads_finite & loss_finite
            clipped = self.clip.clip_tensors(norms, all_finite & ~skip)  # a skipped step leaves the EMAs alone
            self.plan.scale_tensors(grouped, clipped.coefs)
            return clipped.coef, clipped.threshold
        if self.clip is None:
            return self._one, self.inputs.nan
        threshold, active = self.clip.threshold(total, grads_finite)
        one: Tensor | None = self._one
        if total.dtype != self._one.dtype or total.device != self._one.device:
            one = None
        coef = clip_coefficient(total, threshold, grads_finite, one)
        if not self.clip.always_active:
            coef = torch.where(active, coef, 1.0 if one is None else one)
        apply_clip_coefficient(grouped, coef)
        return coef, threshold

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
        report.skipped = decision.skip = self.inputs.false
        report.code = decision.code = torch.zeros_like(decision.code)
        row = decision.rows[-1]
        row.total, row.coef, row.threshold, row.code = float(found.total), float(found.coef), float(found.threshold), 0
        row.layers = found.layer_norms.tolist() if found.layer_norms is not None else []
        decision.settle(0, None)
        scalars = [found.total, self.inputs.or_nan(report.loss), decision.code, found.coef, found.threshold]
        self.journal.rewrite_last(scalars, found.layer_norms)

    def resolve(self, decision: StepDecision) -> bool:
        """Read this step's decision now (one sync); the skip is then applied and reported at once."""
        if decision.pending:
            row = self.journal.read_last()
            decision.rows.append(row)
            decision.settle(row.code, self.reason_of(row.code))
        return decision.skipped_now

    def holds_scheduler(self) -> bool:
        """True when LR schedulers must not advance after the step in flight; decided once per step,
        whoever asks (a hold for a skip learned late is paid off here), and counted in ``held_steps``."""
        if self.in_flight is None:
            return False
        if self._hold is None:
            self._hold = self.ledger.consume_scheduler_hold(self.in_flight.skipped_now)
            self.held_steps += int(self._hold)
        return self._hold

    def book_step(self, decision: StepDecision, raise_divergence: bool = True) -> StepReport:
        """Host-side bookkeeping after the step: the ledger, events, sinks, then the divergence check.

        Sinks see the step as ``decision.log_step`` (a framework's global step) when set, else the engine's.
        ``raise_divergence=False``: a divergence is left in ``decision.divergence`` for the caller
        (recovery) instead of being reported and raised; ``readout.report_divergence`` does that.
        Recovery's agreed answer in the rows read for this step is left in ``decision.answer``.
        """
        step = self.step
        self.step += 1
        if self.updates is not None:
            self.updates.measure()  # after the optimizer step: this step's update, if it was snapshotted
        self._hold = None
        if self.sources.sources:
            self.sources.begin_step(self.step, self.is_logging_step())
        if decision.rows:  # rows the host read at this step (none on an ordinary step)
            divergence = self.readout.fold(decision.rows, step, decision.signals)
            decision.answer = RecoveryAnswer.of(decision.rows)
        else:
            divergence = None
        if decision.logging:
            for event in self.sources.events(step, decision.module_metrics):
                self.readout.hooks.emit(event)
            extra = [decision.module_metrics, decision.update_metrics, decision.lr_metrics]
            log_step = step if decision.log_step is None else decision.log_step
            self.readout.log(decision.rows[-1], log_step, decision.loss_scale, extra)
        if divergence is not None:
            if not raise_divergence:
                decision.divergence = divergence
            else:
                self.readout.report_divergence(divergence, raise_error=True)
        return decision.report

    def flush(self, final_row: bool = False) -> None:
        """Fold the steps since the last logging step now (one sync); ``final_row``: and log their row."""
        rows = self.readout.flush(self.step, final_row=final_row)
        if self.recovery is not None:
            self.recovery.flush(rows, RecoveryAnswer.of(rows))

    # ----------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The step, the ledger, the clipping state and journal rows not read yet (no host sync)."""
        return {
            "step": self.step,
            "ledger": self.ledger.state_dict(),
            "clip": self.clip.state_dict() if self.clip is not None else {},
            "spike_rule": self.spike_rule.state_dict() if self.spike_rule is not None else None,
            "rules": {rule.name: rule.state_dict() for rule in self.user_rules if rule.state_dict()},
            "journal": self.journal.state_dict(),
            "layer_names": list(self.layer_names),
            **({"monitors": monitors} if (monitors := self.sources.state_dict()) else {}),
            **({"rerun": self.rerun.state_dict()} if self.rerun is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (tensors move to this engine's device).

        Everything is loaded into fresh parts first and swapped in only when all of it loaded, so
        a state that does not fit leaves the engine exactly as it was.
        """
        saved_layers = list(state["layer_names"])
        if saved_layers != self.layer_names:
            raise ValueError(
                "engine state was saved for other layers: "
                f"{saved_layers[:3]}... vs {self.layer_names[:3]}... (different model or grouping)"
            )
        parts = self._parts_from(state)
        self.sources.load_state_dict(state.get("monitors") or {})  # raises before changing anything
        self.step = int(state["step"])
        if self.rerun is not None:
            self.rerun.load_state_dict(state.get("rerun") or {})
        self._install(parts)
        if self.updates is not None:
            self.updates.reset()
        self.sources.begin_step(self.step, self.is_logging_step())

    def rewind(self, state: dict[str, Any]) -> None:
        """A rollback to a snapshot whose engine state is ``state``: its statistics come back, the count goes on.

        The clipping statistics, the skip-on-spike rule and the spike and fp16 monitors are the
        snapshot's, so nothing learned from the undone steps stays. The step number and the run's
        counters go on (skips and clips of the undone steps stay counted; the skip streak ends). The
        journal is read first (one sync), so every row so far is counted once; the snapshot's unread
        rows were among them, and the scheduler debt is the snapshot's plus the skips among those
        rows that a fused optimizer's scheduler stepped past. Costs one or two syncs; rollbacks are rare.
        """
        rows, _ = self.journal.read()
        self.readout.fold(rows, self.step)  # count them; a divergence among them is the one being rolled back
        counters = self.ledger.counters
        parts = self._parts_from(state)
        parts.ledger.counters = counters
        counters.consecutive = 0
        unread, _ = parts.journal.read()  # the snapshot's unread rows: counted above, read here for their debt
        if self.fused:
            parts.ledger.scheduler_debt += sum(1 for r in unread if r.skipped and not r.on_time)
        self._install(parts)
        self.readout.source_hint = None
        if self.updates is not None:
            self.updates.reset()
        self.sources.discard()  # values measured on the undone steps are not the restored model's
        self.sources.begin_step(self.step, self.is_logging_step())


def reads_coming_step(engine: StabilityEngine) -> bool:
    """The host will read the decision of ``engine``'s step about to start in ``evaluate`` (the only place a
    flagged step can be re-run): a logging step, a journal full after its row, or every step (a non-fused
    optimizer that can skip; ``RerunConfig.read_every_step``). A step still in flight (Lightning starts the
    next batch before it ends this step) counts as the one before it."""
    coming = engine.step + (engine.in_flight is not None)
    every = engine.rerun is not None and engine.rerun.config.read_every_step
    journal = engine.journal
    return (
        engine.is_logging_step(coming)
        or len(journal.infos) + 1 >= journal.capacity
        or (engine.can_skip and (not engine.fused or every))
    )


def _redecide(journal: Journal, decode: Any, first: StepDecision, again: StepDecision) -> StepDecision:
    """The decision of a step measured again (``again``, its row just written) in place of ``first``, whose
    reads it keeps (earlier rows, a logging step's metrics): its own row read now (the rerun's one read)."""
    # the step's own read emptied the journal (a logging step): empty it again; else rows held and taken
    # (a non-fused optimizer's reads): it stays held, taken, as theirs
    emptied = len(journal.infos) == 1
    row = journal.read(current_step=again.report.step)[0][-1] if emptied else journal.read_last()
    again.keep_reads(first, row)
    again.settle(row.code, decode(row.code))
    return again


def _saved_statistics(rules: RuleSet, clip: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The skip rules' and the clipping's state before a step (device copies, no sync): a rerun puts them
    back so that the step is seen once."""
    saved = clip.state_dict() if clip is not None else None
    return [rule.state_dict() for rule in rules], saved


def _load_statistics(rules: RuleSet, clip: Any, saved: tuple[list[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Put back what ``_saved_statistics`` kept."""
    states, clip_state = saved
    for rule, state in zip(rules, states, strict=True):
        if state:
            rule.load_state_dict(state)
    if clip is not None and clip_state:
        clip.load_state_dict(clip_state)


def _read_nonfinite(decision: StepDecision) -> bool:
    """The host read this step's row and its norm is not finite (maybe an fp32 overflow of finite grads).

    The row's total is agreed across ranks, so every rank takes the same branch (across ranks an
    overflow arrives as NaN, like a real NaN, so both are re-measured).
    """
    row = decision.rows[-1] if decision.rows and decision.rows[-1].step == decision.report.step else None
    return row is not None and not math.isfinite(row.total)
