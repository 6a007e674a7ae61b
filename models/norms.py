"""Normalisation layers with the exact numerics of the reference checkpoints."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.ops import cuda_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the weight
    multiply (the order DeepSeek's and transformers' implementations use)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., dim]`` -> normed, x's shape and dtype. On CUDA one fused Triton kernel
        (`models.ops.rms_norm_cuda`: the same roundings; torch here is the spec it is tested against)."""
        ops = self._fused(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, self(x + delta))``: a residual stream's update and its pre-norm, one kernel on CUDA."""
        ops = self._fused(x)
        if ops is not None and delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(-1) == 1:
            return ops.rms_norm(x, self.weight, self.eps, residual=delta)
        x = x + delta
        return x, self(x)

    def _fused(self, x: torch.Tensor):
        if not x.is_cuda:
            return None
        ops = cuda_ops("rms_norm_cuda")
        return ops if ops is not None and ops.supports(x, self.weight) else None


class LayerNorm(nn.Module):
    """LayerNorm with bias (the indexer's key norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
