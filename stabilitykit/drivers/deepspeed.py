"""DeepSpeedGuard: the driver for loops that drive a DeepSpeed engine themselves (ZeRO stages 0-3).

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds_config, ...)
    guard = DeepSpeedGuard(engine, config=cfg)
    for batch in loader:
        loss = engine(batch)...
        engine.backward(loss)   # routed through the guard: the loss recorded (or guard.backward(loss))
        engine.step()           # grads final: measure, clip, decide, then apply or skip (or guard.step())

Where the grads are when they are final (after ``engine.backward`` on the accumulation boundary):

* stage 0: in the module's parameters (``p.grad``), already averaged across ranks;
* stages 1 and 2: this rank's partition of the averaged grads, one piece per parameter it owns
  (``optimizer.averaged_gradients``), a parameter split across two ranks in two pieces;
* stage 3: this rank's partition of every parameter (``optimizer.averaged_gradients``).

The guard measures those pieces where they are: one fused norm pass over this rank's pieces and the
step record's one all-reduce, which sums the pieces' p-th powers over the ranks per layer. The
global norm is then DeepSpeed's own (``engine.get_global_grad_norm()``) and per-layer norms are
exact, with no parameter or grad gathered. Clipping scales the pieces in place before DeepSpeed
builds its fp32 grad partition from them.

A skipped step runs none of DeepSpeed's optimizer step: the ZeRO optimizer's ``step`` is routed
through the guard, and on a skip it only drops the step's grads, as DeepSpeed does after its own
fp16 overflow. Parameters, fp32 master partitions, optimizer moments, the LR scheduler (DeepSpeed
does not step it after an overflow) and the engine's step counters (``global_steps``,
``global_samples``, ``skipped_steps``) are left as they were. Every rank takes the same decision
(the step record is agreed across ranks), so every rank runs the same collectives.

fp16 (DeepSpeed's dynamic loss scaler): the grads are still scaled when final, so the
norms divide by DeepSpeed's scale; a step whose only fault is a non-finite grad is an fp16 overflow,
handed to DeepSpeed's own step, which skips it, counts it and lowers its scale (reported once, as
``fp16_overflow``, never toward divergence); any other skip (a NaN loss, a user's rule) is the
guard's, DeepSpeed's scale untouched.

Recovery: each rank snapshots its own state (``rank_state``) and every rank rolls back at the same
step (the rollback is agreed in the step record); nothing is gathered.

Not supported yet, refused by name at construction: CPU offload of the optimizer, the pipeline
engine, monitors and update ratios.
NaN tracing is off (the guard does not hook the module); the skip event still names the first
non-finite layer from the norms.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stabilitykit.compat.deepspeed import (
    clear_overflow_mark,
    drop_step,
    engine_counters,
    grads_loss_scale,
    inner_optimizer,
    loss_scaler_state,
    master_partitions,
    put_engine_counters,
    put_loss_scaler_state,
    rank_tensors,
    release_gathered,
)
from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.compat.tensors import mark_shard
from stabilitykit.config import StabilityConfig
from stabilitykit.drivers._extras import missing
from stabilitykit.drivers.base import Driver
from stabilitykit.drivers.loop import StabilityGuard
from stabilitykit.engine.lr import noting_lr
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.recovery import TrainingObjects
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink

try:
    from deepspeed.runtime.engine import DeepSpeedEngine
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    base = missing("stabilitykit.drivers.deepspeed", "deepspeed", "deepspeed")
    raise ImportError(
        f"{base}; DeepSpeed is a source distribution: install it after torch with --no-build-isolation "
        "(pip install --no-build-isolation deepspeed), or pip builds it against a CUDA torch it downloads; "
        "bash scripts/setup.sh does this"
    ) from exc

__all__ = ["DeepSpeedGuard"]

#: The key of the guard's state in a DeepSpeed checkpoint's ``client_state``.
CLIENT_STATE_KEY = "stabilitykit"


def _stand_in(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` with no memory of its own (one zero, expanded) that can hold a ``.grad``."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape).requires_grad_(True)


class GradPartitions:
    """This rank's final grads as the engine measures them: one stand-in tensor per model parameter.

    Every rank holds one stand-in per parameter of the model, in the same order, so layer names and
    the per-layer columns of the step record are the same everywhere; a parameter whose grad this
    rank does not own has no grad here this step. ``bind()`` points each stand-in's ``.grad`` at the
    piece of the grad this rank owns now (DeepSpeed builds new grad tensors every step).
    """

    def __init__(self, engine: DeepSpeedEngine) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.optimizer = engine.optimizer
        names = {id(p): n for n, p in engine.module.named_parameters()}
        if self.stage == 0:
            self.params: list[Tensor] = [p for p in engine.module.parameters() if p.requires_grad]
            self.tensors = self.params  # the grads are the parameters' own, whole and averaged
        else:
            groups = self.optimizer.fp16_groups if self.stage == 3 else self.optimizer.bit16_groups
            self.params = [p for group in groups for p in group]
            self.tensors = [_stand_in((0,), p.dtype, p.device) for p in self.params]
            group = getattr(self.optimizer, "dp_process_group", None) or torch.distributed.group.WORLD
            for t in self.tensors:  # each grad is a shard over the data-parallel group: sum per layer
                mark_shard(t, (group,))
        self.names = [names.get(id(p), f"param_{i}") for i, p in enumerate(self.params)]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    @property
    def partitioned(self) -> bool:
        """The grads are split across ranks (stages 1-3): the norms sum over the data-parallel group."""
        return self.stage > 0

    def _group_params(self, i: int) -> list[Tensor]:
        if self.stage == 3:
            return list(self.optimizer.fp16_groups[i])
        return list(self.optimizer.params_in_partition[i])

    def bind(self) -> None:
        """Point every stand-in's grad at this rank's piece of its parameter's final grad."""
        if not self.partitioned:
            return
        for t in self.tensors:
            t.grad = None
        grads = self.optimizer.averaged_gradients
        n_groups = len(self.optimizer.fp16_groups if self.stage == 3 else self.optimizer.bit16_groups)
        for i in range(n_groups):
            pieces = grads.get(i) if isinstance(grads, Mapping) else grads[i]
            if not pieces:
                continue
            for p, piece in zip(self._group_params(i), pieces, strict=True):
                if piece is None:
                    continue
                held = self.tensors[self._index[id(p)]]
                if held.shape != piece.shape or held.dtype != piece.dtype:
                    # the same tensor object (the engine holds it) takes this rank's piece's shape once
                    held.data = _stand_in(piece.shape, piece.dtype, piece.device).detach()
                held.grad = piece


class _Partitions:
    """What the driver base takes for an optimizer: the stand-ins as its one param group.

    DeepSpeed's optimizer is stepped by the engine, never through this object."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.param_groups = [{"params": tensors}]
        self.state: dict[Any, Any] = {}

    def step(self) -> None:  # pragma: no cover - never called: the engine steps DeepSpeed's optimizer
        raise RuntimeError("stabilitykit: the DeepSpeed engine steps its own optimizer")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: DeepSpeed's step drops its grads itself (``guard.zero_grad()`` is harmless)."""


def _named_engine(names: list[str]) -> type[StabilityEngine]:
    """A ``StabilityEngine`` whose parameters carry the model's names (the stand-ins have none)."""

    class _NamedEngine(StabilityEngine):
        def __init__(self, params: Sequence[Tensor], *args: Any, **kwargs: Any) -> None:
            kwargs["names"] = names
            super().__init__(params, *args, **kwargs)

    return _NamedEngine


def _refuse_unsupported(engine: Any, config: StabilityConfig) -> None:
    """Refuse, by name and with the fix, what the DeepSpeed driver does not handle (yet)."""
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(
            f"DeepSpeedGuard needs the engine deepspeed.initialize returned (a DeepSpeedEngine), got "
            f"{type(engine).__name__}; for a plain torch model use stabilitykit.StabilityGuard"
        )
    if engine.optimizer is None:
        raise ValueError(
            "DeepSpeedGuard needs an engine with an optimizer: give deepspeed.initialize an optimizer (or an "
            '"optimizer" section in its config)'
        )
    if type(engine).__name__ == "PipelineEngine":
        raise NotImplementedError(
            "DeepSpeedGuard does not support DeepSpeed's pipeline engine (PipelineEngine.train_batch steps "
            "inside its own schedule); use it with a DeepSpeedEngine from deepspeed.initialize without a "
            "PipelineModule"
        )
    if engine.zero_cpu_offload():
        raise NotImplementedError(
            "DeepSpeedGuard does not support ZeRO optimizer offload (offload_optimizer) yet: the grads then "
            "live in CPU buffers the guard does not read; remove offload_optimizer from the ZeRO config"
        )
    if engine.gradient_clipping() > 0.0 and config.clip.mode != "off":
        raise ValueError(
            f"two clippers: DeepSpeed's gradient_clipping={engine.gradient_clipping()} and stabilitykit's "
            f"ClipConfig(mode={config.clip.mode!r}) are both on. Keep one: remove gradient_clipping from the "
            "DeepSpeed config (stabilitykit then clips), or set ClipConfig(mode='off')"
        )
    if config.monitors is not None:
        raise NotImplementedError(
            "DeepSpeedGuard does not run monitors (MonitorConfig) yet: it does not hook the module; remove monitors"
        )
    if config.grad_norm.update_ratio:
        raise NotImplementedError(
            "DeepSpeedGuard does not measure update ratios (GradNormConfig(update_ratio=...)): the parameters "
            "are partitioned inside DeepSpeed; turn update_ratio off"
        )


class DeepSpeedLossScale(ScalerAdapter):
    """DeepSpeed's own dynamic loss scaler (fp16) as the driver base sees a loss scaler.

    The grads are still scaled when they are final at ZeRO stages 1-3 (DeepSpeed unscales them inside
    its step), so the norms divide by the scale they carry (``grads_loss_scale``); a non-finite grad
    is an fp16 overflow (rule ``fp16_overflow``), which DeepSpeed's own step skips while lowering its
    scale. Its scale is logged as ``scaler/scale``.
    """

    def __init__(self, engine: Any) -> None:
        super().__init__(None)
        self.engine = engine
        self.enabled = True

    def grads_scale(self, optimizer: Any, fused: bool) -> Tensor | None:
        return torch.tensor(grads_loss_scale(self.engine), device=self.engine.device)

    def loss_scale(self) -> Tensor | None:
        return torch.tensor(float(self.engine.optimizer.loss_scale), device=self.engine.device)

    def scale(self, loss: Tensor) -> Tensor:
        return loss  # the engine's backward scales it

    def state_tensors(self) -> dict[str, Tensor] | None:
        return None  # saved with DeepSpeed's own checkpoints


class _EngineState:
    """What a snapshot keeps of the engine itself: its step counters (``global_steps``, ``global_samples``,
    ``skipped_steps``) and, in fp16, its loss scaler. Restored after the tensors, it also drops stage 3's
    gathered parameter copies."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return {"counters": engine_counters(self.engine), "loss_scaler": loss_scaler_state(self.engine)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        put_engine_counters(self.engine, dict(state["counters"]))
        put_loss_scaler_state(self.engine, state["loss_scaler"])
        release_gathered(self.engine)  # the next forward gathers the restored partitions


def rank_state(engine: Any, scaler: ScalerAdapter, guard_state: Any) -> TrainingObjects:
    """What a recovery snapshot of this rank holds under DeepSpeed: this rank's own parameter tensors (whole at
    stages 0-2, its partitions at stage 3), the fp32 master partitions and the moments of the torch optimizer
    inside DeepSpeed's, the module's buffers, the engine's step counters and fp16 loss scaler (the LR scheduler
    is tracked by the guard). Each rank snapshots and restores only its own; nothing is gathered."""
    inner = inner_optimizer(engine)
    optimizer_params = master_partitions(engine)
    params = rank_tensors(engine)
    seen = {id(t) for t in params}
    params += [p for p in optimizer_params if id(p) not in seen]
    buffers = [b for b in engine.module.buffers() if b is not None]
    return TrainingObjects(
        params, buffers, inner, optimizer_params, scaler, guard_state, stateful=[_EngineState(engine)]
    )


class DeepSpeedGuard(StabilityGuard):
    """Keeps a loop over a DeepSpeed engine finite: norms, clipping, skip-the-batch, metrics and events.

    ``engine``: what ``deepspeed.initialize`` returned (kept as ``deepspeed_engine``; ``guard.engine`` is
    the stability engine, as on every guard). The engine's ``backward`` and ``step`` are routed
    through the guard for its life, so a loop that calls ``engine.backward(loss)`` and
    ``engine.step()`` (or a framework that does: Accelerate, the Hugging Face Trainer) is guarded
    as it is; ``guard.backward`` / ``guard.step`` do the same and ``guard.step`` returns the step's
    report (None on a micro-batch that does not end an accumulation). Everything else is the
    plain-loop guard's surface (state, ``summary()``, ``close()``, ``with``, ``record``).
    """

    def __init__(
        self,
        engine: Any,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        Driver.__init__(self, config, sinks=sinks, hooks=hooks, rules=rules)  # not a torch optimizer's guard
        cfg = self.config.model_copy(update={"nan_trace": self.config.nan_trace.model_copy(update={"mode": "off"})})
        _refuse_unsupported(engine, cfg)
        self.deepspeed_engine = engine
        self.partitions = GradPartitions(engine)
        #: DeepSpeed's fp16: its own loss scaler scales the grads and skips an overflow itself.
        self.fp16 = bool(engine.fp16_enabled())
        #: Every rank's state as the last ``save_checkpoint`` wrote it (the Hugging Face Trainer's checkpoints
        #: keep it in ``trainer_state.json`` too).
        self.checkpoint_states: list[dict[str, Any]] | None = None
        self._last_report: StepReport | None = None
        # the engine's backward, step and checkpoints and its optimizer's step routed through the guard
        # (``_route_step``): engine.step() and guard.step() are then the same step
        partitions = _Partitions(self.partitions.tensors)
        self._start(None, [partitions], config=cfg, engine_cls=_named_engine(self.partitions.names))
        if self.fp16:
            self.engine.scaler = DeepSpeedLossScale(engine)
        self.engine.lr_optimizer = inner_optimizer(engine)  # the LRs DeepSpeed's step uses, logged as lr/<group>
        if self.engine.recovery is not None:  # snapshots of this rank's partitions, not of the stand-ins
            self.engine.recovery.cover(lambda scaler, guard_state: rank_state(engine, scaler, guard_state))
        self.scheduler = engine.lr_scheduler
        self.schedulers = [engine.lr_scheduler] if engine.lr_scheduler is not None else []
        for scheduler in self.schedulers:  # DeepSpeed steps it (not after a skip); recovery restores it
            self.track_scheduler(scheduler)

    def _route_step(self, _: StabilityEngine) -> None:
        """The engine's ``backward``, ``step`` and checkpoints, and its optimizer's ``step``, through the guard
        (undone with the run's other patches)."""
        engine = self.deepspeed_engine
        self.replace(engine.optimizer, "step", self._guarded_step(engine.optimizer.step))
        self.replace(engine, "backward", self._routed_backward(engine.backward))
        self.replace(engine, "step", self._routed_step(engine.step))
        self.replace(engine, "save_checkpoint", self._routed_save(engine.save_checkpoint))
        self.replace(engine, "load_checkpoint", self._routed_load(engine.load_checkpoint))

    # ------------------------------------------------------------------ the loop API
    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> Any:
        """``engine.backward(loss)`` (the same: the engine's own ``backward`` records the loss too)."""
        self.check_open("backward")
        return self.deepspeed_engine.backward(loss, **kwargs)

    def step(self, **kwargs: Any) -> StepReport | None:  # type: ignore[override]  # DeepSpeed's own arguments
        """``engine.step()``, returning the step's report on the micro-batch that ends an accumulation, else None.

        The engine's own ``step`` is the same guarded step (measure, clip, decide, then apply or
        skip); this one only returns the report.
        """
        self.check_open("step")
        self._last_report = None
        self.deepspeed_engine.step(**kwargs)
        return self._last_report

    def _routed_backward(self, original: Any) -> Any:
        """The engine's ``backward``: the loss remembered (divided by the accumulation steps, as DeepSpeed
        scales it), then DeepSpeed's own."""

        def backward(loss: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.closed:
                steps = self.deepspeed_engine.gradient_accumulation_steps()
                self.record_loss(loss.detach() / steps if steps > 1 else loss.detach())
            return original(loss, *args, **kwargs)

        return backward

    def _routed_step(self, original: Any) -> Any:
        """The engine's ``step``: on the accumulation boundary, measure, clip and decide first; a skipped
        step leaves the engine's counters (``global_steps``, ``global_samples``, ``skipped_steps``) as they were."""

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.closed or not self.deepspeed_engine.is_gradient_accumulation_boundary():
                return original(*args, **kwargs)
            self._evaluate()
            counters = engine_counters(self.deepspeed_engine)
            decision = self.engine.in_flight
            result = original(*args, **kwargs)
            if decision is not None and decision.skipped_now and not self._deepspeed_skips(decision):
                put_engine_counters(self.deepspeed_engine, counters)
            self._last_report = self.end_step(self.engine)
            return result

        return step

    def _evaluate(self) -> None:
        """Grads are final: bind this rank's pieces, then measure, clip and decide (the host knows the decision)."""
        self.partitions.bind()
        decision = self.decide(self.engine)
        if decision.pending:  # DeepSpeed's step cannot skip on the device: the host decides
            self.engine.resolve(decision)

    def _guarded_step(self, original: Any) -> Any:
        """DeepSpeed's optimizer ``step`` through the guard: applied, or skipped with DeepSpeed's own clean-up."""

        def step(*args: Any, **kwargs: Any) -> Any:
            optimizer = self.deepspeed_engine.optimizer
            clear_overflow_mark(optimizer)  # stage 0 in fp32: the mark of the last skip, on a torch optimizer
            if self.engine.in_flight is None:  # engine.step() called directly: still measured and decided
                self._evaluate()
            decision = self.engine.in_flight
            assert decision is not None
            if self._deepspeed_skips(decision):  # DeepSpeed's own overflow skip: it also lowers its loss scale
                with noting_lr(self.engine.lr_optimizer, lambda: decision):  # the LR it held, logged all the same
                    return original(*args, **kwargs)
            result = self.routes.run(self.engine, lambda: original(*args, **kwargs))
            if decision.skipped_now:
                drop_step(self.deepspeed_engine.optimizer, self.partitions.stage)
            return result

        return step

    def _deepspeed_skips(self, decision: Any) -> bool:
        """A step skipped for an fp16 overflow alone, which DeepSpeed's own step skips (counting it and
        lowering its loss scale), so the guard hands the step to it. Decided from the agreed rules only,
        so every rank hands it over or skips it itself alike."""
        if not (self.fp16 and decision.skipped_now):
            return False
        return self.engine.rules.raised_anywhere(decision.outcome.code) == ["fp16_overflow"]

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, save_dir: str, tag: Any = None, client_state: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """``engine.save_checkpoint`` (the same: the engine's own puts the guard's state in its client state too)."""
        return self.deepspeed_engine.save_checkpoint(save_dir, tag=tag, client_state=dict(client_state or {}), **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """``engine.load_checkpoint`` (the same: the engine's own restores the guard's state from its client state)."""
        path, client_state = self.deepspeed_engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        return path, dict(client_state or {})

    def every_rank_state(self) -> list[dict[str, Any]]:
        """Every rank's ``state_dict()``, in rank order (one ``all_gather_object`` under torch.distributed; call it
        on every rank). Each rank's differs (its own loss, its own reasons), so a checkpoint keeps them all."""
        mine = self.state_dict()
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [mine]
        states: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, mine)
        return states

    def load_rank_state(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Load this rank's entry of what ``every_rank_state`` returned (the first when the world was smaller)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.load_state_dict(states[rank] if rank < len(states) else states[0])

    def _routed_save(self, original: Any) -> Any:
        """The engine's ``save_checkpoint``: every rank's guard state in the client state (key ``"stabilitykit"``),
        whoever calls it (a loop, the Hugging Face Trainer). DeepSpeed writes one rank's client state, so every
        rank's goes in, in rank order."""

        @functools.wraps(original)
        def save_checkpoint(save_dir: str, tag: Any = None, client_state: Any = None, **kwargs: Any) -> Any:
            if self.closed:
                return original(save_dir, tag=tag, client_state=client_state or {}, **kwargs)
            self.checkpoint_states = self.every_rank_state()
            state = {**(client_state or {}), CLIENT_STATE_KEY: {"ranks": self.checkpoint_states}}
            return original(save_dir, tag=tag, client_state=state, **kwargs)

        return save_checkpoint

    def _routed_load(self, original: Any) -> Any:
        """The engine's ``load_checkpoint``: this rank's guard state restored from the client state (taken out of
        what it returns)."""

        @functools.wraps(original)
        def load_checkpoint(load_dir: str, *args: Any, **kwargs: Any) -> Any:
            path, client_state = original(load_dir, *args, **kwargs)
            if self.closed or not isinstance(client_state, dict):
                return path, client_state
            saved = client_state.pop(CLIENT_STATE_KEY, None)
            if saved is not None:
                self.load_rank_state(saved["ranks"])
            return path, client_state

        return load_checkpoint
