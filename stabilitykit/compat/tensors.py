"""Marks stabilitykit leaves on tensors a framework owns (the only attribute it sets on one).

DeepSpeed ZeRO's grad partitions carry no DTensor or FSDP layout of their own; the DeepSpeed
driver marks each stand-in tensor with the process groups its grad is a shard over, and
``distributed.reduce_groups_for`` reads the mark.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from stabilitykit.distributed import SHARD_GROUPS_ATTR


def mark_shard(tensor: Tensor, groups: tuple[Any, ...]) -> None:
    """Say that ``tensor``'s grad is this rank's shard over ``groups`` (summed per layer across them)."""
    setattr(tensor, SHARD_GROUPS_ATTR, groups)
