"""Tensor-parallel building blocks.

Every projection of the model goes through these wrappers so that tp_size = 1
on a laptop and tp_size = 8 on a node are the same code. The process group is
an argument (``TPContext``), never a global.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TPContext:
    """Which shard of the model this process holds.

    ``group`` is the torch.distributed process group of the tensor-parallel
    ranks; ``None`` with ``size == 1`` means single-process.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("tensor-parallel size > 1 needs a process group")

    def shard(self, total: int, what: str) -> int:
        """Per-rank share of ``total`` (heads, experts, intermediate columns)."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=getattr(_thread, "group", None) or self.group)
        return x


_thread = threading.local()


@contextmanager
def collectives_on(group):
    """Run this thread's all-reduces on ``group`` instead of the model's own (`models.two_batch`: each
    micro-batch has a process group of its own, so the two threads' collectives never interleave)."""
    before = getattr(_thread, "group", None)
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = before


SINGLE = TPContext()


class ReplicatedLinear(nn.Module):
    """A projection every rank holds whole (small latent projections, routers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across ranks; the result stays sharded.

    ``full_out`` is the unsharded output size; the checkpoint loader slices rows
    ``[rank * shard, (rank + 1) * shard)`` of the full weight into it.
    """

    def __init__(self, in_features: int, full_out: int, tp: TPContext, bias: bool = False, dtype=None):
        super().__init__(in_features, tp.shard(full_out, "output features"), bias, dtype)
        self.tp, self.full_out = tp, full_out
        self.shard_dim = 0


class RowParallelLinear(ReplicatedLinear):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, full_in: int, out_features: int, tp: TPContext, bias: bool = False, dtype=None):
        super().__init__(tp.shard(full_in, "input features"), out_features, bias, dtype)
        self.tp, self.full_in = tp, full_in
        self.shard_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction, not once per rank.
        y = F.linear(x.to(self.weight.dtype), self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
