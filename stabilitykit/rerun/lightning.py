"""How a rerun computes a Lightning step again under manual optimization (``automatic_optimization = False``).

Under manual optimization ``training_step`` does the whole step itself: the forward, ``manual_backward``
and ``optimizer.step()``. A rerun calls it again on the kept batch (through the strategy: its DDP wrapper
and precision context) and stops it where it steps the optimizer: Lightning calls the callback's
``on_before_optimizer_step`` there, with the grads final, and for the recomputation that hook raises
``Recomputed`` (the callback's own hook, shadowed on the instance for the call and put back after). The
grads of the recomputation stay for the engine to measure; the first pass's ``optimizer.step()`` then
applies or skips the step as the recomputation decided. What ``training_step`` does after its
``optimizer.step()`` runs once, in the first pass.

Only with one optimizer: with several, a recomputation would reach another optimizer's step first.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


class Recomputed(Exception):  # not an error: the end of a recomputation
    """The recomputed ``training_step`` reached its ``optimizer.step()``: the grads are final."""


def _stop(*_args: Any) -> None:
    raise Recomputed


def manual_rerun(callback: Any, trainer: Any, batch: tuple[Any, int] | None) -> dict[str, Any]:
    """``Driver.decide``'s rerun arguments for a manually optimized step (none without a batch or with several
    optimizers): ``training_step`` again up to its ``optimizer.step()``, the losses its ``manual_backward``
    recorded taken by the optimizer's engine."""
    if batch is None or len(trainer.optimizers) != 1:
        return {}
    driver = callback.driver

    def again() -> Tensor | None:
        callback.on_before_optimizer_step = _stop
        try:
            trainer.strategy.training_step(*batch)
        except Recomputed:
            pass
        finally:
            del callback.on_before_optimizer_step
        driver.claim_losses(driver.find_engine(trainer.optimizers[0]))
        return None

    return {"rerun_replay": again, "backward": lambda _loss: None}
