"""How a rerun computes a DeepSpeed step again (``DeepSpeedGuard.step(replay=...)``).

Under ZeRO 1-3 a backward reduces this rank's grads into DeepSpeed's partitioned buffers as it runs, so a
second backward in the same step would add to the first pass's. Before the replay's forward, the first
pass's grads, partitions and micro-step count are dropped as DeepSpeed's own overflow clean-up drops them
(``compat.deepspeed.drop_grads``, without marking the step as not applied); DeepSpeed's own ``backward``
then fills them afresh (its routed ``backward`` records the loss) and this rank's pieces are bound again
for the guard to measure.

``watch`` gives the rerun policy what it needs from the engine from the first step on: the random state each
step's first forward starts with (a forward pre-hook on the engine), and at ZeRO 0 this rank's own grads before
DeepSpeed's all-reduce (``rerun/local.py``), so that a fault in one rank's local gradient names its rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from stabilitykit.compat.deepspeed import drop_grads, grads_before_allreduce
from stabilitykit.rerun.policy import Rerun
from stabilitykit.rerun.refusals import refuse_rerun as refuse_rerun  # for the DeepSpeed drivers: one import there


def watch(rerun: Rerun | None, deepspeed_engine: Any) -> None:
    """A ``DeepSpeedGuard``'s rerun (None: off) sees the engine's forward and, at ZeRO 0, this rank's local grads."""
    if rerun is not None:
        rerun.watch_forward(deepspeed_engine)
        rerun.local.watch_params(grads_before_allreduce(deepspeed_engine))


def recompute(
    guard: Any,
    replay: Callable[[], Tensor] | None,
    backward: Callable[[Tensor], None] | None,
    rerun_replay: Callable[[], Tensor] | None,
) -> tuple[Callable[[Tensor], None] | None, Callable[[], Tensor] | None]:
    """``Driver.decide``'s ``backward`` and ``rerun_replay`` for a ``DeepSpeedGuard`` step that ``replay`` (from
    ``guard.step(replay=...)``) computes again: the first pass's grads dropped before the forward, DeepSpeed's
    own backward (its routed ``backward`` records the loss), then this rank's pieces of the new grads bound
    (``guard.partitions``). Without ``replay``: ``backward`` and ``rerun_replay`` as given."""
    if replay is None:
        return backward, rerun_replay
    deepspeed_engine, partitions = guard.deepspeed_engine, guard.partitions

    def again() -> Tensor:
        drop_grads(deepspeed_engine.optimizer, partitions.stage)
        return replay()

    def backward_again(loss: Tensor) -> None:
        deepspeed_engine.backward(loss)
        partitions.bind()

    return backward_again, again
