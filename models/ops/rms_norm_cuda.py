"""RMSNorm, and residual add + RMSNorm, as one Triton kernel per call on CUDA tensors.

`models.norms.RMSNorm` in torch is seven kernels a call (cast to fp32, square, mean, add eps,
rsqrt, scale, cast back, weight multiply); a DeepSeek-V3.2 layer has four norms, and on the H100
a batch-1 decode step of the 4-layer checkpoint ran ~150 small kernels besides its GEMMs and
attention (docs/perf.md, session 12), the norms' fp32 reductions alone 17 a step. One program per
row computes the same math in the same order of roundings as the torch module (which stays the
spec: CPU tensors, and the tests here):

* ``x + residual`` rounded to x's dtype (as ``torch.add`` of two bf16 tensors) and stored;
* in fp32: ``x * rsqrt(mean(x^2) + eps)``, cast to x's dtype;
* times the weight, rounded to x's dtype.

Only the fp32 sum's order differs from torch's reduction (a row's result may differ by one unit in
the last place of the output dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, w_ptr, out_ptr, out_stride, sum_ptr, sum_stride,
                     N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.math.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes ``x``: a float tensor of the weight's dtype, its last dim contiguous
    and equal to the weight's length."""
    return (x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and x.dim() >= 1 and x.shape[-1] == weight.shape[0] and x.stride(-1) == 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, N]`` with unit column stride, without a copy where its rows are evenly spaced."""
    if t.dim() == 2:
        return t
    return t.reshape(-1, t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., N]`` (`supports`) -> the normed rows, contiguous, x's shape and dtype. With
    ``residual`` (x's shape and dtype): ``(x + residual, norm(x + residual))``, the sum rounded to the
    dtype first, as ``RMSNorm(x + residual)`` in torch."""
    N = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2, total = x2, out  # unused: HAS_RES is off
    if x2.shape[0]:
        BLOCK = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2.stride(0), r2, r2.stride(0), weight, out, out.stride(0), total, total.stride(0), N, float(eps),
            HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 512)))
    if residual is None:
        return out.view(x.shape)
    return total.view(x.shape), out.view(x.shape)
