"""DeepSpeed's internals the DeepSpeed driver must reach: a skipped step's clean-up and the engine's counters.

DeepSpeed has no public way to drop a step: after its own fp16 overflow its ZeRO optimizers run
private clean-up (``_overflow_clean_up`` at stage 3, resetting the micro-step and the flat grad
buffers at stages 1 and 2). A step the guard skips takes the same path, written here against
DeepSpeed 0.19; a release that renames them breaks this file (and ``tests/test_deepspeed.py``).
"""

from __future__ import annotations

from typing import Any

import torch

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
    # stage 0 in fp32: the engine's optimizer is the torch one; the engine zeroes the module's grads
    optimizer.overflow = True  # the engine: not applied, no LR scheduler step


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
