"""One engine per guarded optimizer, with the optimizer, the GradScaler adapter, the running-statistics
guard, NaN tracing, recovery, rerun and replica checks attached, each built once from its config section."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from stabilitykit.buffers import BufferGuard, running_stat_buffers
from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.config import StabilityConfig
from stabilitykit.drivers.optimizers import guarded_params, unwrap_optimizer
from stabilitykit.engine.guard_state import guard_snapshot, restore_guard_snapshot
from stabilitykit.engine.step import StabilityEngine, is_fused, reads_coming_step
from stabilitykit.hooks import HookManager
from stabilitykit.recovery.controller import Recovery
from stabilitykit.replicas import ReplicaCheck
from stabilitykit.rerun import Rerun
from stabilitykit.rerun.refusals import refuse_rerun
from stabilitykit.rules import SkipRule
from stabilitykit.tracing import NaNTracing


def build_engine(
    model: nn.Module | None,
    optimizer: Any,
    config: StabilityConfig,
    hooks: HookManager,
    closers: list[Callable[[], None]],
    scaler: Any | None = None,
    tracing: bool = True,
    extra_group: Any | None = None,
    engine_cls: type[StabilityEngine] = StabilityEngine,
    names: Sequence[str] | None = None,
    rules: Sequence[SkipRule] = (),
    precision: Callable[[StabilityEngine], None] | None = None,
) -> StabilityEngine:
    """The engine guarding ``optimizer`` (wrappers looked through), everything attached. ``tracing``: it owns the
    NaN tracer's hooks; ``extra_group``: a group the norms also sum over; ``names``: parameter names the model
    cannot give; ``precision``: applies ``config.precision`` once the engine exists (before recovery)."""
    torch_optimizer = unwrap_optimizer(optimizer)
    params = guarded_params(model, torch_optimizer)
    engine = engine_cls(
        params,
        config,
        model=model,
        hooks=hooks,
        fused=is_fused(torch_optimizer),
        extra_group=extra_group,
        rules=rules,
        names=names,
    )
    engine.optimizer = engine.lr_optimizer = torch_optimizer
    engine.scaler = ScalerAdapter(scaler)
    engine.buffers = BufferGuard(running_stat_buffers(model, config.skip.restore_buffers))
    if precision is not None:
        precision(engine)
    engine.tracing = NaNTracing(model, config.nan_trace, enabled=tracing)
    closers.append(engine.sources.close)  # the monitors' forward hooks (config.monitors)
    if config.recovery.enabled:
        engine.recovery = Recovery(
            config.recovery,
            engine,
            model,
            torch_optimizer,
            engine.scaler,
            hooks,
            guard_state=lambda: guard_snapshot(engine),
            restore_guard=lambda state: restore_guard_snapshot(engine, state),
        )
        closers.append(engine.recovery.close)
    if config.rerun is not None:
        refuse_rerun(config, grad_scaler=engine.scaler.enabled)
        engine.rerun = Rerun(config.rerun, model, engine.device, hooks, reads=lambda: reads_coming_step(engine))
        closers.append(engine.rerun.close)
    if config.replicas is not None:
        names = engine.param_names
        engine.replicas = ReplicaCheck(config.replicas, engine.params, names, torch_optimizer, model, hooks)
    engine.tracing.attach_for(engine.step)
    return engine
