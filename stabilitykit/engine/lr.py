"""The learning rate a step really used, per param group: ``<prefix>/lr/<group index>`` on logging steps.

Read from the optimizer's param groups inside the optimizer step, so it is what the step used: a
rollback's lowered LR included (recovery scales the groups around the step and puts the schedule's
values back after it, so ``param_groups[i]["lr"]`` read outside the step shows the schedule's), and a
held scheduler's value on a skipped step. Host values only: a float ``lr``, or a CPU tensor one; an
``lr`` on an accelerator (a capturable optimizer's) would cost a sync to read and is left out, as is a
group without an ``lr``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def group_lrs(optimizer: Any) -> dict[str, float]:
    """``{"lr/<i>": lr}`` for each param group ``i`` of ``optimizer`` whose ``lr`` is readable without a sync."""
    found: dict[str, float] = {}
    for i, group in enumerate(getattr(optimizer, "param_groups", ())):
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            found[f"lr/{i}"] = float(lr)
        elif isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.numel() == 1:
            found[f"lr/{i}"] = float(lr)  # host memory: no device sync
    return found


@contextmanager
def noting_lr(optimizer: Any, decision_of: Callable[[], Any]) -> Iterator[None]:
    """Around the optimizer step (inside any scaling of the LR): the LRs in force as it starts, given to the
    step's decision when it is a logging step (``StepDecision.lr_metrics``; a closure step decides inside)."""
    lrs = group_lrs(optimizer)
    try:
        yield
    finally:
        decision = decision_of()
        if decision is not None and decision.logging:
            decision.lr_metrics = lrs
