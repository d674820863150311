"""DeepSpeed's internals the DeepSpeed driver must reach: its grads, a skipped step's clean-up, its counters.

Where the grads are when they are final (after ``engine.backward`` on the accumulation boundary):
stage 0 in the module's parameters (``p.grad``, whole and averaged); stages 1 and 2 this rank's
partition of the averaged grads, one piece per parameter it owns (``optimizer.averaged_gradients``,
a parameter split across two ranks in two pieces); stage 3 this rank's partition of every parameter.
``GradPartitions`` hands those pieces to the step as they are: one fused norm pass over this rank's
pieces and the step record's one all-reduce, which sums their p-th powers over the ranks per layer,
give DeepSpeed's own global norm and exact per-layer norms with nothing gathered; clipping scales
the pieces in place before DeepSpeed builds its fp32 grad partition from them.

DeepSpeed has no public way to drop a step: after its own fp16 overflow its ZeRO optimizers run
private clean-up (``_overflow_clean_up`` at stage 3, resetting the micro-step and the flat grad
buffers at stages 1 and 2). A step the guard skips takes the same path, written here against
DeepSpeed 0.19; a release that renames them breaks this file (and ``tests/test_deepspeed.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.compat.tensors import mark_shard
from stabilitykit.recovery.snapshot import TrainingObjects

#: The engine's counters an applied step advances and a skipped step leaves as they were.
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def engine_counters(engine: Any) -> dict[str, Any]:
    """The engine's step counters now (``global_steps``, ``global_samples``, ``skipped_steps``)."""
    return {name: getattr(engine, name) for name in ENGINE_COUNTERS}


def put_engine_counters(engine: Any, counters: dict[str, Any]) -> None:
    """Put back what ``engine_counters`` returned (a skipped step is not counted by DeepSpeed)."""
    for name, value in counters.items():
        setattr(engine, name, value)


def clear_overflow_mark(optimizer: Any) -> None:
    """Remove the ``overflow`` mark a skip left on a plain torch optimizer (stage 0 in fp32)."""
    if isinstance(optimizer, torch.optim.Optimizer) and "overflow" in vars(optimizer):
        delattr(optimizer, "overflow")


def drop_step(optimizer: Any, stage: int) -> None:
    """A skipped step: drop its grads and mark it as not applied, as DeepSpeed does after its own overflow.

    DeepSpeed's engine then zeroes the grads, does not step its LR scheduler, and counts the step
    (counters the guard puts back). Nothing else of the optimizer's step runs: no fp32 partition,
    moment or parameter is touched.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):  # stage 0 in fp32: the engine zeroes the module's grads
        drop_grads(optimizer, stage)
    optimizer.overflow = True  # the engine: not applied, no LR scheduler step


def drop_grads(optimizer: Any, stage: int) -> None:
    """Drop the step's grads, partitions and micro-step count, as DeepSpeed's overflow clean-up does, so that
    the next backward fills them afresh (a skipped step; a step computed again by a rerun)."""
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

        optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
        optimizer.zero_grad(set_to_none=True)
        release = getattr(optimizer, "_release_preflattened_grad_buffers", None)
        if callable(release):
            release()
        for k in list(optimizer.averaged_gradients.keys()):
            optimizer.averaged_gradients[k] = None
            if k in getattr(optimizer, "all_grad_tensors", {}):
                optimizer.all_grad_tensors[k] = None
    elif stage == 3:
        optimizer._pre_step()
        optimizer._partition_all_parameters()
        optimizer._overflow_clean_up(optimizer.loss_scale)
    elif hasattr(optimizer, "fp32_groups"):  # stage 0 with bf16: DeepSpeed's unfused mixed-precision wrapper
        optimizer.zero_grad(set_to_none=True)
        for group in optimizer.fp32_groups:
            for param in group:
                param.grad = None
    else:  # stage 0 in fp32: the engine's optimizer is the torch one, over the module's parameters
        optimizer.zero_grad(set_to_none=True)


def grads_before_allreduce(engine: Any) -> list[Tensor]:
    """The parameters whose ``.grad`` holds this rank's own gradient once backward has accumulated it and before
    DeepSpeed reduces it: at ZeRO stage 0 (all-reduced at the end of ``engine.backward``), unless DeepSpeed's
    optimizer has hooks of its own after the accumulation (its bf16 optimizer's ``immediate_grad_update`` moves
    each gradient into its fp32 buffer there). Under ZeRO 1-3 none: DeepSpeed's hooks take them first."""
    if engine.zero_optimization_stage() != 0 or getattr(engine.optimizer, "_grad_acc_hooks", None):
        return []
    return [p for p in engine.module.parameters() if p.requires_grad]


def inner_optimizer(engine: Any) -> Any:
    """The torch optimizer under DeepSpeed's wrapper (ZeRO, or the mixed-precision wrapper at stage 0), whose
    param groups hold the fp32 master partitions and whose state holds the moments; the engine's optimizer
    itself when it is a torch optimizer (stage 0 in fp32)."""
    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return optimizer.optimizer


def master_partitions(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partitions, the keys of the inner optimizer's state. Stage 3 puts each in its
    param group only for the length of its own step (the groups are empty between steps), so they are
    read from ZeRO-3's flat list there; elsewhere they are the inner optimizer's parameters."""
    if int(engine.zero_optimization_stage()) == 3:
        return list(engine.optimizer.fp32_partitioned_groups_flat)
    return [p for group in inner_optimizer(engine).param_groups for p in group["params"]]


def rank_tensors(engine: Any) -> list[torch.Tensor]:
    """This rank's own parameter tensors, restored in place by a rollback (the fp32 masters are the inner
    optimizer's state keys, see ``master_partitions``).

    Stages 0-2: the module's parameters, whole on every rank (at stages 1 and 2 views into DeepSpeed's
    flat bit16 buffers). Stage 3: this rank's partition of every parameter (the flat bit16 partitions
    the parameters' ``ds_tensor`` views point into); the whole copies it keeps gathered between steps
    are dropped after a restore (``release_gathered``).
    """
    if int(engine.zero_optimization_stage()) < 3:
        return list(engine.module.parameters())
    return list(engine.optimizer.fp16_partitioned_groups_flat)


def release_gathered(engine: Any) -> None:
    """Stage 3, after this rank's partitions were put back: drop the whole copies of parameters it keeps
    gathered between steps (the small, persistent ones), so the next forward gathers the restored
    partitions, as after DeepSpeed's own overflow skip (no collective here). Nothing at stages 0-2."""
    if int(engine.zero_optimization_stage()) == 3:
        engine.optimizer._partition_all_parameters()


def grads_loss_scale(engine: Any) -> float:
    """The loss scale still applied to this step's grads when they are final (fp16).

    DeepSpeed 0.19's ``engine.backward`` scales the loss for its ZeRO optimizers only (stages 1-3); at
    stage 0 the fp16 wrapper's own ``backward``, which would scale it, is not called, so the grads are
    not scaled there (1.0), while that wrapper's step still divides them by its scale.
    """
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = engine.optimizer
    return float(optimizer.loss_scale) if isinstance(optimizer, ZeROOptimizer) else 1.0


def _loss_scaler(engine: Any) -> Any | None:
    """The object that holds DeepSpeed's fp16 loss scale (read fresh: loading a checkpoint replaces it)."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    scaler = getattr(optimizer, "loss_scaler", None)  # the ZeRO optimizers
    return scaler if scaler is not None else getattr(optimizer, "loss_scale_config", None)  # stage 0's fp16 wrapper


def loss_scaler_state(engine: Any) -> dict[str, Any] | None:
    """DeepSpeed's fp16 loss scaler as plain values (scale, iteration, last overflow, hysteresis...); None
    without fp16."""
    scaler = _loss_scaler(engine)
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if v is None or isinstance(v, (bool, int, float, torch.Tensor))}


def put_loss_scaler_state(engine: Any, state: dict[str, Any] | None) -> None:
    """Put back what ``loss_scaler_state`` returned."""
    scaler = _loss_scaler(engine)
    if scaler is None or state is None:
        return
    for name, value in state.items():
        setattr(scaler, name, value)


def _stand_in(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` with no memory of its own (one zero, expanded) that can hold a ``.grad``."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape).requires_grad_(True)


class GradPartitions:
    """This rank's final grads as the step measures them: one stand-in tensor per model parameter, and
    ``param_groups`` holding them (what the driver base takes for an optimizer; DeepSpeed's own
    optimizer is stepped by its engine, never through this object).

    Every rank holds one stand-in per parameter, in the same order, so layer names and the step
    record's per-layer columns are the same everywhere; ``bind()`` points each stand-in's ``.grad``
    at the piece this rank owns now (DeepSpeed builds new grad tensors every step).
    """

    def __init__(self, engine: Any) -> None:
        self.stage = int(engine.zero_optimization_stage())
        self.zero = engine.optimizer
        names = {id(p): n for n, p in engine.module.named_parameters()}
        if self.stage == 0:
            self.params: list[Tensor] = [p for p in engine.module.parameters() if p.requires_grad]
            self.tensors = self.params  # the grads are the parameters' own, whole and averaged
        else:
            groups = self.zero.fp16_groups if self.stage == 3 else self.zero.bit16_groups
            self.params = [p for group in groups for p in group]
            self.tensors = [_stand_in((0,), p.dtype, p.device) for p in self.params]
            group = getattr(self.zero, "dp_process_group", None) or torch.distributed.group.WORLD
            for t in self.tensors:  # each grad is a shard over the data-parallel group: sum per layer
                mark_shard(t, (group,))
        self.names = [names.get(id(p), f"param_{i}") for i, p in enumerate(self.params)]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.param_groups = [{"params": self.tensors}]
        self.state: dict[Any, Any] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: DeepSpeed's step drops its grads itself (``guard.zero_grad()`` is harmless)."""

    def bind(self) -> None:
        """Point every stand-in's grad at this rank's piece of its parameter's final grad (stages 1-3)."""
        if self.stage == 0:
            return
        for t in self.tensors:
            t.grad = None
        grads = self.zero.averaged_gradients
        groups = self.zero.fp16_groups if self.stage == 3 else self.zero.params_in_partition
        for i, params in enumerate(groups):
            pieces = grads.get(i) if isinstance(grads, Mapping) else grads[i]
            if not pieces:
                continue
            for p, piece in zip(params, pieces, strict=True):
                if piece is None:
                    continue
                held = self.tensors[self._index[id(p)]]
                if held.shape != piece.shape or held.dtype != piece.dtype:
                    # the same tensor object (the engine holds it) takes this rank's piece's shape once
                    held.data = _stand_in(piece.shape, piece.dtype, piece.device).detach()
                held.grad = piece


class DeepSpeedLossScale(ScalerAdapter):
    """DeepSpeed's own dynamic loss scaler (fp16) as the step sees a loss scaler: the grads are still scaled
    when final (DeepSpeed unscales them inside its step), so the norms divide by ``grads_loss_scale``; its
    scale is logged as ``scaler/scale``; the engine's ``backward`` scales the loss."""

    def __init__(self, engine: Any) -> None:
        super().__init__(None)
        self.engine = engine
        self.enabled = True

    def grads_scale(self, optimizer: Any, fused: bool) -> Tensor | None:
        return torch.tensor(grads_loss_scale(self.engine), device=self.engine.device)

    def loss_scale(self) -> Tensor | None:
        return torch.tensor(float(self.engine.optimizer.loss_scale), device=self.engine.device)

    def scale(self, loss: Tensor) -> Tensor:
        return loss

    def state_tensors(self) -> dict[str, Tensor] | None:
        return None  # saved with DeepSpeed's own checkpoints


class _EngineState:
    """What a snapshot keeps of the engine itself: its step counters and, in fp16, its loss scaler. Restored
    after the tensors, it also drops stage 3's gathered parameter copies."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        return {"counters": engine_counters(self.engine), "loss_scaler": loss_scaler_state(self.engine)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        put_engine_counters(self.engine, dict(state["counters"]))
        put_loss_scaler_state(self.engine, state["loss_scaler"])
        release_gathered(self.engine)  # the next forward gathers the restored partitions


def rank_state(engine: Any, scaler: ScalerAdapter, guard_state: Any) -> TrainingObjects:
    """What a recovery snapshot of this rank holds under DeepSpeed: its own parameter tensors (its partitions at
    stage 3), the fp32 master partitions and moments of the torch optimizer inside DeepSpeed's, the module's
    buffers, the engine's counters and fp16 loss scaler. Each rank keeps only its own; nothing is gathered."""
    params = rank_tensors(engine)
    seen = {id(t) for t in params}
    masters = master_partitions(engine)
    params += [p for p in masters if id(p) not in seen]
    buffers = [b for b in engine.module.buffers() if b is not None]
    inner = inner_optimizer(engine)
    return TrainingObjects(params, buffers, inner, masters, scaler, guard_state, stateful=[_EngineState(engine)])
