"""The driver core: one guarded optimizer around the engine, one per optimizer of a run.

The driver base (``drivers/base.py``) builds one ``DriverCore`` per optimizer. The core owns
precision setup, the GradScaler adapter (stage-aware unscale), the data guard across
micro-batches, the NaN tracing policy and replay, the optimizer step wrapper (the skip, OR-ed into
a fused optimizer's ``found_inf``), the scheduler hold decision, recovery, rerun and replica
checks, and its state. A driver only says when: a micro-batch's loss, grads are final, the
optimizer steps, the step is over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.buffers import BufferGuard, running_stat_buffers
from stabilitykit.compat.attributes import replace_attribute
from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.compat.private import wrapped_optimizer
from stabilitykit.config import coerce_config, warn_contradictions
from stabilitykit.engine import StepDecision, StepGate
from stabilitykit.engine.gate import NewStateCheck
from stabilitykit.engine.lr import noting_lr
from stabilitykit.engine.step import StabilityEngine, is_fused
from stabilitykit.events import Event
from stabilitykit.hooks import HookManager
from stabilitykit.nan import batch_is_bad, check_batch
from stabilitykit.precision import PrecisionChoice, apply_precision_config
from stabilitykit.recovery.controller import Recovery
from stabilitykit.replicas import ReplicaCheck
from stabilitykit.report import StepReport
from stabilitykit.rerun import Rerun
from stabilitykit.rules import SkipRule
from stabilitykit.run_log import RunSummary
from stabilitykit.state import STATE_VERSION, validate_state
from stabilitykit.tracing import NaNTracing


def check_supported(model: nn.Module | None, optimizer: Any, params: list[Tensor]) -> None:
    """Refuse, at construction and by name, what the step cannot guard."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "stabilitykit cannot guard torch.optim.LBFGS: its step() re-evaluates a closure several times, "
            "so there is no single set of final grads to measure, clip or skip. Clip inside your closure "
            "(torch.nn.utils.clip_grad_norm_) or use an optimizer that steps once per batch."
        )
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for i, p in enumerate(params):
        if p.is_complex():
            name = names.get(id(p), f"param_{i}")
            raise TypeError(
                f"parameter {name!r} is complex ({p.dtype}); stabilitykit's fused norms are real-valued. "
                "Keep it out of the guarded optimizer, or store it as a real view (torch.view_as_real)."
            )
    if model is not None:
        ids = {id(p) for p in params}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if getattr(module, "sparse", False) and isinstance(weight, Tensor) and id(weight) in ids:
                raise TypeError(
                    f"module {name!r} ({type(module).__name__}(sparse=True)) makes sparse gradients, which "
                    "fused norms cannot read; use sparse=False, or give its parameters their own optimizer"
                )


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside framework wrappers (Lightning, Accelerate, Fabric, HF)."""
    seen: set[int] = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            inner = wrapped_optimizer(optimizer)
        if inner is None or not hasattr(inner, "param_groups") or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def _refuse_non_optimizer(optimizer: Any) -> None:
    """A clear error when the optimizer argument is something else (a config passed in its place)."""
    if hasattr(optimizer, "param_groups"):
        return
    name = type(optimizer).__name__
    hint = ""
    if name == "StabilityConfig" or isinstance(optimizer, (Mapping, str)):
        hint = (
            f"; a {name} was given where the optimizer goes: the optimizer comes second, "
            "e.g. StabilityGuard(model, optimizer, config)"
        )
    raise TypeError(f"stabilitykit needs a torch optimizer (an object with param_groups), got {name}{hint}")


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """Every parameter the optimizer updates, in param-group order, without duplicates."""
    seen: set[int] = set()
    params: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


class _StepSkipped(Exception):
    """Raised from a guarded closure to stop the optimizer before its update (a skip the host knows)."""


class DriverCore:
    """One guarded optimizer: the engine plus what every driver needs around it."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: Any,
        config: Any = None,
        hooks: HookManager | None = None,
        scaler: Any | None = None,
        tracing: bool = True,
        apply_precision: bool = True,
        extra_group: Any | None = None,
        engine_cls: type[StabilityEngine] = StabilityEngine,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        """``extra_group``: a process group the norms also sum over, one torch.distributed cannot infer
        from the model (pipeline stages, each holding different layers). ``engine_cls``: a
        ``StabilityEngine`` subclass, for a driver whose framework logs on another cadence (the
        Hugging Face Trainer logs after global steps ``n, 2n, ...``). ``rules``: the user's skip rules
        (``stabilitykit.SkipRule``), run after the built-in ones."""
        self.config = coerce_config(config)  # the driver's config, coerced by the base: returned as is
        warn_contradictions(self.config)
        self.model = model
        self.optimizer = unwrap_optimizer(optimizer)
        #: The optimizer whose param groups hold the learning rates the step uses (``lr/<group>`` on logging
        #: steps): the one guarded, unless the driver steps another behind stand-ins (DeepSpeed's).
        self.lr_optimizer: Any = self.optimizer
        _refuse_non_optimizer(self.optimizer)
        params = optimizer_params(self.optimizer)
        if not params:
            raise ValueError(
                f"stabilitykit has nothing to guard: {type(self.optimizer).__name__} holds no parameters "
                "(check what configure_optimizers / your optimizer was given)"
            )
        if not any(p.requires_grad for p in params):
            # not an error: a fine-tuning schedule (Lightning's BaseFinetuning) unfreezes them later
            warnings.warn(
                f"stabilitykit: none of the {len(params)} parameters {type(self.optimizer).__name__} holds "
                "requires grad (the model is frozen): no step changes them until something unfreezes them "
                "(p.requires_grad_(True))",
                UserWarning,
                stacklevel=3,
            )
        check_supported(model, self.optimizer, params)
        self._param_count = self._count_params()
        #: Steps a fused optimizer would create state on are decided on the host (``engine/gate.py``).
        self.new_state = NewStateCheck()
        self.hooks = hooks or HookManager()
        self.scaler = ScalerAdapter(scaler)
        self.engine = engine_cls(
            params,
            self.config,
            model=model,
            hooks=self.hooks,
            fused=is_fused(self.optimizer),
            extra_group=extra_group,
            rules=rules,
        )
        self.buffers = BufferGuard(running_stat_buffers(model, self.config.skip.restore_buffers))
        self.precision_choice: PrecisionChoice | None = None
        #: Start-of-run events (the precision event), emitted at the first step with its number, so
        #: a resumed run's sinks see them at the step it resumes from, not at 0.
        self._start_events: list[Event] = []
        if apply_precision:
            self.precision_choice = apply_precision_config(
                self.config.precision,
                self.engine.device,
                types.SimpleNamespace(emit=self._start_events.append),
                self.scaler.enabled,
                params,
            )
        self.decision: StepDecision | None = None
        self.last_report: StepReport | None = None
        self._bad_batch: Tensor | None = None
        self._hold: bool | None = None
        self.held_steps = 0  # steps an LR scheduler was held for (schedule_step = steps - held_steps)
        self._log_step: int | None = None
        #: The NaN tracing policy (``config.nan_trace``): the tracer's hooks, the replay, the newest source.
        self.tracing = NaNTracing(model, self.config.nan_trace, enabled=tracing)
        self._closers: list[Callable[[], None]] = []  # run once by release(): hooks and recovery
        self._closers.append(self.engine.close_monitors)  # the monitors' forward hooks (config.monitors)
        self._routes: dict[int, Callable[[], None]] = {}  # optimizer id -> undo of its routed step
        self._in_closure_step = False
        #: ``optimizer.step()`` calls made directly, outside a step of this driver (a warning names the first).
        self.unguarded_steps = 0
        self._released = False  # release() ran: a wrapper of ours still reached is inert
        #: Rollback past a divergence (``config.recovery``), or None when it is off.
        self.recovery: Recovery | None = None
        if self.config.recovery.enabled:
            self.recovery = Recovery(
                self.config.recovery,
                self.engine,
                model,
                self.optimizer,
                self.scaler,
                self.hooks,
                guard_state=self._recovery_state,
                restore_guard=self._recovered,
            )
            self._closers.append(self.recovery.close)
        #: Re-running a flagged step (``config.rerun``), or None when it is off.
        self.rerun: Rerun | None = None
        if self.config.rerun is not None:
            if self.scaler.enabled:
                raise ValueError(
                    "stabilitykit: RerunConfig cannot be used with a GradScaler yet (a recomputed step would unscale "
                    "the grads a second time); use bf16 autocast, or leave rerun off"
                )
            self.rerun = self.engine.rerun = Rerun(self.config.rerun, model, self.engine.device, self.hooks)
            self._closers.append(self.rerun.close)
        self._warned_no_replay = False
        #: Replica consistency checks (``config.replicas``), or None when off.
        self.replicas: ReplicaCheck | None = None
        if self.config.replicas is not None:
            self.replicas = ReplicaCheck(
                self.config.replicas, self.engine.params, self.engine.param_names, self.optimizer, model, self.hooks
            )
        self.tracing.attach_for(self.engine.step)

    # ------------------------------------------------------------------ micro-batches
    def check_batch(self, batch: Any) -> None:
        """The data guard (``config.data``) on one micro-batch.

        ``"raise"``: ``BadBatchError`` naming the path (one sync). ``"skip"``: a device flag, OR-ed
        over every micro-batch of the step, skips the step when any was bad (no sync).
        """
        dcfg = self.config.data
        if dcfg.mode == "skip":
            bad = batch_is_bad(batch, dcfg.num_classes, dcfg.label_keys)
            if bad is not None:
                self._bad_batch = bad if self._bad_batch is None else self._bad_batch | bad
        elif dcfg.mode == "raise":
            check_batch(batch, dcfg.num_classes, step=self.engine.step, label_keys=dcfg.label_keys)

    def record_loss(self, loss: Tensor) -> None:
        """Remember one micro-batch's loss (stays on the device)."""
        self.engine.inputs.add_loss(loss)

    # ------------------------------------------------------------------ the step
    def evaluate(
        self,
        replay: Callable[[], Tensor] | None = None,
        log_step: int | None = None,
        backward: Callable[[Tensor], None] | None = None,
        rerun_replay: Callable[[], Tensor] | None = None,
    ) -> StepDecision:
        """Grads are final: measure, clip and decide this step (a step still in flight is finished first).

        ``replay`` recomputes this batch's loss (forward only); with ``nan_trace.mode="on_nonfinite"``
        a skipped step is replayed once to name where it went non-finite (one sync per step); with
        ``config.rerun`` a flagged step is computed again through it and ``backward`` (how the driver
        backpropagates and records a loss; a driver that passes none does not re-run).
        ``rerun_replay``: the forward a rerun uses instead of ``replay`` (a framework's own training step).
        ``log_step``: the step number sinks see for this step (a framework's global step).
        Inside a step whose closure already decided (a closure evaluated twice), that decision stands.
        """
        if self.decision is not None:
            if self._in_closure_step:
                return self.decision
            self.finish()
        self._follow_param_groups()
        grad_scale = self.scaler.grads_scale(self.optimizer, self.engine.fused)
        force_skip = self._bad_batch
        if self.rerun is not None:
            self.rerun.arm(self._recompute(rerun_replay or replay, backward))
            if self.rerun.known_bad(self.engine.step):  # judged reproducible before: not trained on again
                force_skip = self.engine.inputs.true if force_skip is None else force_skip | True
        decision = self.engine.evaluate(
            grad_scale=grad_scale,
            scaler_active=self.scaler.enabled,
            loss_scale=self.scaler.loss_scale(),
            force_skip=force_skip,
            skip_ahead=self.recovery is not None and self.recovery.skips_batch(self.engine.step),
            request=self.recovery.request(self.engine.step) if self.recovery is not None else 0,
            verdict=self.recovery.verdict(self.engine.step) if self.recovery is not None else 0,
        )
        self._bad_batch = None
        self._hold = None
        self._log_step = log_step
        self.decision = decision
        replay = replay if self.tracing.replays(replay) else None
        engine = self.engine  # a fused optimizer's step asks on every step until settled (logging steps too)
        creates_state = engine.fused and self.new_state.creates_state(
            self.optimizer, engine.params, engine.plan.present
        )
        if decision.pending and (replay is not None or creates_state):
            engine.resolve(decision)  # one sync: the replay, or state a skipped step must not create
        if decision.pending:
            self.buffers.restore(decision.skip)  # on the device: restored where the skip flag is set
        elif decision.skipped_now:  # the host knows the skip and its reason (no read of a pending code)
            source = self.tracing.source_of(decision.report, replay, engine.params)
            if source is not None:
                engine.readout.source_hint = source  # named by this step's skip events
            self.buffers.restore(True)  # after a replay's forward: its running statistics go too
        return decision

    def _recompute(
        self, replay: Callable[[], Tensor] | None, backward: Callable[[Tensor], None] | None
    ) -> Callable[[], None] | None:
        """How a rerun computes this step again: running statistics put back, grads dropped, the batch's
        forward (``replay``) and the driver's backward (``backward``, which records the loss) again.
        None when the driver gave either not (with one warning): its flagged steps are not re-run."""
        if replay is None or backward is None:
            if not self._warned_no_replay:
                self._warned_no_replay = True
                how = (
                    "pass guard.step(replay=...)"
                    if backward is not None
                    else "this driver cannot re-run a step yet (the plain loop, Accelerate, Fabric and Lightning's "
                    "automatic optimization can)"
                )
                warnings.warn(
                    f"stabilitykit: RerunConfig is on but a step's batch cannot be computed again ({how}): "
                    "flagged steps are skipped without a rerun",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return None

        def recompute() -> None:
            self.buffers.restore(True)
            self.optimizer.zero_grad(set_to_none=True)
            backward(replay())

        return recompute

    def _count_params(self) -> int:
        return sum(len(group["params"]) for group in self.optimizer.param_groups)

    def _follow_param_groups(self) -> None:
        """A param group added since the last step (Lightning's ``BaseFinetuning``, ``add_param_group``):
        the engine measures the optimizer's new set from this step on. Frozen parameters are in the
        set from the start, so unfreezing one (``requires_grad`` flipped) needs nothing here."""
        count = self._count_params()
        if count != self._param_count:
            params = optimizer_params(self.optimizer)
            check_supported(self.model, self.optimizer, params)
            self.engine.follow_params(params)
            self._param_count = count
            if self.recovery is not None:
                self.recovery.forget()

    def run_optimizer_step(self, step_fn: Callable[[], Any]) -> Any:
        """Run the optimizer step for the step in flight, or skip it (no step in flight: just run it, and say so)."""
        if self.decision is None:
            if not self._released:  # a wrapper of ours left under someone else's after release just runs
                self._unguarded_step()
            return step_fn()
        with self._recovery_lr():
            return self.engine.apply(self.decision, step_fn, self.optimizer)

    def _unguarded_step(self) -> None:
        """``optimizer.step()`` called directly, not through the driver: counted, and named once."""
        self.unguarded_steps += 1
        if self.unguarded_steps == 1:
            warnings.warn(
                f"stabilitykit: {type(self.optimizer).__name__}.step() was called directly, behind the guard's back "
                f"(after step {self.engine.step}): that step was not measured, clipped, skipped or counted, and "
                "recovery cannot undo it. Call guard.step() instead (it steps the optimizer)",
                RuntimeWarning,
                stacklevel=4,
            )

    @contextlib.contextmanager
    def _recovery_lr(self) -> Iterator[None]:
        """Around the optimizer step: the LR lowered after a rollback (nothing without recovery), and the LR
        the step used noted for the logging step's ``lr/<group>`` metrics (``engine/lr.py``)."""
        scaled = self.recovery.scaled_lr() if self.recovery is not None else contextlib.nullcontext()
        with scaled, noting_lr(self.lr_optimizer, lambda: self.decision):
            yield

    def should_hold_scheduler(self) -> bool:
        """True when LR schedulers must not advance this step; decided once per step, whoever asks."""
        if self.decision is None:
            return False
        if self._hold is None:
            # not a query: a hold for a skip learned late is paid off here, once per step
            self._hold = self.engine.ledger.consume_scheduler_hold(self.decision.skipped_now)
            self.held_steps += int(self._hold)
        return self._hold

    @property
    def schedule_step(self) -> int:
        """The step an LR schedule should be at: steps so far less the held ones (skips).

        What a held ``torch.optim.lr_scheduler`` counts, for an LR set by hand each iteration
        (``lr = get_lr(guard.schedule_step)``). Exact at once for non-fused optimizers; a skip made on
        the device by a fused optimizer is learned at the next logging read and held then.
        """
        return self.engine.step - self.held_steps

    def finish(self) -> StepReport | None:
        """The step is over: events, sinks, the divergence check, tracing for the next step."""
        decision, self.decision = self.decision, None
        if decision is None:
            return None
        if self._start_events:
            for event in self._start_events:
                self.hooks.emit(dataclasses.replace(event, step=decision.report.step))
            self._start_events = []
        self.buffers.save()
        self.should_hold_scheduler()  # decided once per step even when no scheduler asks (schedule_step)
        if self.engine.fused:
            self.new_state.after_step(decision, self.optimizer, self.engine.plan.present)
        try:
            recovery = self.recovery
            self.last_report = self.engine.finish(decision, log_step=self._log_step, raise_divergence=recovery is None)
            if self.rerun is not None:
                self.rerun.end_step()
            if self.replicas is not None and self.replicas.due(decision.report.step):
                self.replicas.check(decision.report.step)
            if recovery is not None:
                recovery.after_step(decision)
        finally:
            self.tracing.after_step(decision, self.engine.step)
        return self.last_report

    # ------------------------------------------------------------------ wrapping framework objects
    def run_closure_step(self, step_fn: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any]) -> Any:
        """Run ``step_fn(guarded_closure)``: the optimizer calls the closure itself, as it would without us.

        The grads are final when the closure returns (Lightning measures them in its
        ``on_before_optimizer_step``, inside the closure). The first return of the closure decides
        the step: a skip the host knows stops the optimizer right there (before its update), a skip
        still on the device goes to a fused optimizer's ``found_inf``. An optimizer that evaluates
        its closure again in the same step (a SAM-style two-pass step) gets each evaluation's real
        result; only the first is measured, clipped and decides. An optimizer that never calls its
        closure is left to notice that itself (Lightning raises).
        """
        gate: StepGate | None = None
        result: Any = None

        def guarded() -> Any:
            nonlocal gate, result
            result = closure()
            if gate is None and self.decision is not None:
                gate = self.engine.open_step(self.decision, self.optimizer)
                if gate.skip_now:
                    raise _StepSkipped
            return result

        self._in_closure_step = True
        try:
            with self._recovery_lr():
                return step_fn(guarded)
        except _StepSkipped:
            return result
        finally:
            self._in_closure_step = False
            if gate is not None:
                gate.close()

    def wrap_optimizer_step(self, optimizer: Any) -> Callable[[], None]:
        """Route ``optimizer.step`` through this core (once: a second call returns the same undo).

        The wrapper is a bound method on the instance, so torch's LR schedulers built later (they
        need ``optimizer.step.__func__``) and anyone who wraps it after us keep working; it never
        reaches ``optimizer.state_dict()``. Without a step in flight it just runs the step. Undoing
        restores exactly what was there before (an instance attribute such as an LR scheduler's
        patch, or none); the driver that installed it keeps the undo (``Driver.route_steps``).
        """
        target = unwrap_optimizer(optimizer)
        self._released = False
        installed = self._routes.get(id(target))
        if installed is not None:
            return installed
        original = target.step
        core = self

        @functools.wraps(getattr(original, "__func__", original))
        def step(_optimizer: Any, *args: Any, closure: Any = None, **kwargs: Any) -> Any:
            if closure is None:
                return core.run_optimizer_step(lambda: original(*args, **kwargs))
            return core.run_closure_step(lambda guarded: original(*args, closure=guarded, **kwargs), closure)

        restore = replace_attribute(target, "step", types.MethodType(step, target))

        def undo() -> None:
            self._routes.pop(id(target), None)
            restore()  # someone who wrapped it again on top keeps theirs (ours then just runs the step)

        self._routes[id(target)] = undo
        return undo

    def _recovery_state(self) -> dict[str, Any]:
        """What a recovery snapshot keeps of this core: the engine's state and the held steps."""
        return {"engine": self.engine.state_dict(), "held_steps": self.held_steps}

    def _recovered(self, state: dict[str, Any]) -> None:
        """A rollback restored a snapshot whose core state is ``state``.

        The engine gets the snapshot's statistics while its step count goes on
        (``StabilityEngine.rewind``); ``schedule_step`` becomes the snapshot's again, as the restored
        LR schedulers' counts do; the restored buffers are what a later skip puts back.
        """
        self.engine.rewind(state["engine"])
        self.held_steps = int(state["held_steps"]) + self.engine.step - int(state["engine"]["step"])
        self.buffers.save()

    def track_scheduler(self, scheduler: Any) -> None:
        """``scheduler`` drives this optimizer: recovery saves and restores it with every snapshot."""
        if self.recovery is not None:
            self.recovery.track_scheduler(scheduler)

    def release(self) -> None:
        """Remove the monitors' hooks and close recovery (idempotent; safe after an exception); a routed
        step still reached runs unguarded and silently from now on."""
        self._released = True
        while self._closers:
            self._closers.pop()()

    # ------------------------------------------------------------------ state
    def summary(self) -> RunSummary:
        """This optimizer's totals (reads the steps since the last logging step first: one sync)."""
        self.flush()
        c = self.engine.counters
        found = self.tracing.last_nonfinite
        source = str(found) if found is not None else None
        monitor = self.engine.monitor
        unmeasured = tuple(f"{n}: {r}" for n, r in monitor.unmeasured.items()) if monitor is not None else ()
        summary = RunSummary(
            self.engine.step,
            c.skipped_total,
            c.clipped_total,
            c.max_norm,
            c.nonfinite_total,
            nonfinite_source=source,
            unmeasured=unmeasured,
            skipped_ahead=c.skipped_ahead_total,
        )
        records = self.recovery.log.records if self.recovery is not None else []
        return summary.with_rollbacks(records)

    def flush(self, final_row: bool = False) -> None:
        """Fold the steps since the last logging step now (one sync); ``final_row``: and log their row."""
        rows = self.engine.readout.flush(self.engine.step, final_row=final_row)
        if self.recovery is not None:
            self.recovery.flush(rows)

    def close(self, final_row: bool = True) -> None:
        """Fold what is left, remove tracing hooks and every wrapper (monitor hooks included); the
        wrappers and hooks go even when finishing the last step raises (a divergence). ``final_row``:
        the steps since the last logging step get a metrics row (drivers whose framework has its own
        logging rows pass False)."""
        try:
            if self.decision is not None:
                self.finish()
        finally:
            try:
                self.flush(final_row=final_row)
            finally:
                self.tracing.detach()
                self.release()

    def state_dict(self) -> dict[str, Any]:
        """Everything that must survive a resume (plain values and small device tensors)."""
        state = {
            "version": STATE_VERSION,
            "engine": self.engine.state_dict(),
            "trace_left": self.tracing.left,
            "held_steps": self.held_steps,
        }
        if self.recovery is not None:
            state["recovery"] = self.recovery.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned: validated as a whole first, then loaded all at once."""
        validate_state(state, reference=self.state_dict())
        self.engine.load_state_dict(dict(state["engine"]))
        self.tracing.left = int(state["trace_left"])
        self.held_steps = int(state["held_steps"])
        if self.recovery is not None:  # a resume: snapshots from before it are dropped in any case
            self.recovery.load_state_dict(dict(state.get("recovery") or {}))
        self.tracing.attach_for(self.engine.step)
