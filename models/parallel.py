"""Tensor-parallel building blocks.

Every projection of the model goes through these wrappers so that tp_size = 1
on a laptop and tp_size = 8 on a node are the same code. The process group is
an argument (``TPContext``), never a global.
"""

from __future__ import annotations

import math
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
            turns = getattr(_thread, "turns", None)
            if turns is None:
                dist.all_reduce(x, group=self.group)
            else:  # a two-batch overlap micro-batch: launch, let the other micro-batch compute, then wait
                work = dist.all_reduce(x, group=self.group, async_op=True)
                turns[0].pass_turn(turns[1])
                work.wait()
        return x


_thread = threading.local()


@contextmanager
def taking_turns(turns, me: int):
    """This thread's all-reduces, inside the block, hand ``turns`` (a `models.two_batch.Turns`) to the
    other micro-batch while they are on the wire (`models.two_batch`)."""
    before = getattr(_thread, "turns", None)
    _thread.turns = (turns, me)
    try:
        yield
    finally:
        _thread.turns = before


SINGLE = TPContext()


class ReplicatedLinear(nn.Module):
    """A projection every rank holds whole (small latent projections, routers).

    ``weight [out, in]`` in ``dtype``, or, after `to_fp8`, float8_e4m3fn with
    ``weight_scale_inv [ceil(out / b0), ceil(in / b1)]`` float32 (the checkpoint's
    block scales, kept as stored): the forward then runs `models.ops.fp8_linear`
    and returns ``dtype`` (the activations' dtype).
    """

    # False where a caller reads ``weight`` itself (MLA's absorbed ``kv_b_proj``): such a
    # projection is dequantized on load even when the checkpoint stores it in fp8.
    fp8_ok = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.weight_scale_inv = None
        self.quant_block: tuple[int, int] | None = None

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the weight as fp8 with block scales (on the weight's device, normally meta, before loading).

        Raises ValueError where this rank's shard would cut a scale block (the
        checkpoint's scales then cannot be sliced with it)."""
        if not self.fp8_ok:
            raise ValueError(f"{type(self).__name__} reads its weight directly; it cannot be held in fp8")
        b0, b1 = block
        shard = getattr(self, "shard_dim", None)
        if shard == 0 and self.tp.size > 1 and self.out_features % b0:
            raise ValueError(f"output shard of {self.out_features} rows is not a multiple of the fp8 block {b0}")
        if shard == 1 and self.tp.size > 1 and self.in_features % b1:
            raise ValueError(f"input shard of {self.in_features} columns is not a multiple of the fp8 block {b1}")
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=torch.float8_e4m3fn,
                                               device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(math.ceil(self.out_features / b0), math.ceil(self.in_features / b1), dtype=torch.float32,
                        device=device), requires_grad=False)
        self.quant_block = (b0, b1)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_block is None:
            return F.linear(x.to(self.weight.dtype), self.weight)
        from models.ops.fp8_linear import fp8_linear

        return fp8_linear(x.to(self.dtype), self.weight, self.weight_scale_inv, self.quant_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_block is None:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias


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
        y = self.tp.all_reduce(self._matmul(x))
        return y if self.bias is None else y + self.bias
