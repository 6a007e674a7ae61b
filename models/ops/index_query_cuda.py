"""The indexer's fp8 query quantization and its weight scaling as one Triton kernel per call on CUDA tensors.

`models.indexer.quantize_query_fp8` and the weight products around it are seven torch kernels a layer
(abs, amax, clamp, two divisions, the cast, the scale products); DeepSeek-V3.2 runs them in each of its
61 layers every decode step. One program per (token, head) row computes the same bytes:

* ``amax = max(|q|)`` clamped to >= 1e-10, ``scale = amax / 448`` (fp32, rounded to nearest);
* ``q8 = fp8_e4m3fn(q / scale)``, rounded to nearest-even as ``Tensor.to(torch.float8_e4m3fn)`` does
  (`attention.cuda._bits`: the same integer program on the GPU and in Triton's interpreter);
* ``weights_out = (weights * factor) * scale``, the two fp32 products in the reference's order.

The torch code stays the spec (CPU tensors, the tests against it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.cuda._bits import f32_to_e4m3fn_bits


@triton.jit
def _quantize_query_kernel(q_ptr, w_ptr, q8_ptr, w_out_ptr, factor, n_rows,
                           D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    r64 = rows.to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(q_ptr + r64[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    scale = tl.math.div_rn(amax, 448.0)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q8_ptr + r64[:, None] * D + d[None, :], f32_to_e4m3fn_bits(q).to(tl.uint8), mask=ok[:, None])
    w = tl.load(w_ptr + r64, mask=ok, other=0.0)
    tl.store(w_out_ptr + r64, (w * factor) * scale, mask=ok)


def supports(q: torch.Tensor) -> bool:
    """fp32 queries ``[T, H, D]`` with a power-of-two ``D`` (128 in every DSA model)."""
    D = q.shape[-1]
    return q.dtype == torch.float32 and q.dim() == 3 and D > 0 and D & (D - 1) == 0


def quantize_query(q: torch.Tensor, weights: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` fp32 ``[T, H, D]``, ``weights`` fp32 ``[T, H]`` (the weights projection's output) ->
    (float8_e4m3fn ``[T, H, D]``, fp32 ``[T, H]`` = ``weights * factor * scale``), ``scale`` the
    per-(token, head) quantization scale (`supports`)."""
    T, H, D = q.shape
    q = q.contiguous()
    weights = weights.float().contiguous()
    q8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=q.device)
    w_out = torch.empty(T, H, dtype=torch.float32, device=q.device)
    n = T * H
    if n:
        block = 16
        _quantize_query_kernel[(triton.cdiv(n, block),)](q, weights, q8.view(torch.uint8), w_out, float(factor), n,
                                                         D=D, BLOCK_R=block, num_warps=4)
    return q8, w_out
