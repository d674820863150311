"""A small residual MLP and its DDP / FSDP1 / FSDP2 wrappings, shared by the 2-process test scripts."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """``x + proj(tanh(fc(x)))``: two Linears per block, so a layer holds several tensors."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class ResidualNet(nn.Module):
    """``depth`` blocks and a classifier head, initialised from seed 0 (the same on every rank)."""

    def __init__(self, width: int, hidden: int, depth: int, classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(width, hidden) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def wrap(net: ResidualNet, kind: str, use_orig_params: bool = True) -> nn.Module:
    """``net`` under DDP (``"ddp"``), FSDP1 per block and at the root (``"fsdp1"``) or FSDP2 (anything else)."""
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        cpu = torch.device("cpu")
        for i, block in enumerate(net.blocks):
            net.blocks[i] = FSDP(block, use_orig_params=use_orig_params, device_id=cpu)
        return FSDP(net, use_orig_params=use_orig_params, device_id=cpu)
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    return net
