"""Dense SwiGLU MLP (the first ``first_k_dense_replace`` layers and shared experts)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.parallel import ColumnParallelLinear, RowParallelLinear, TPContext


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp, dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
