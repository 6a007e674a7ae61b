"""Rotary embedding of a head's rope dims, as one Triton kernel per call on CUDA tensors.

`models.rope.apply_rope` in torch is seven kernels a call (two slices' four products, a difference,
a sum, the concatenation), and a DeepSeek-V3.2 layer calls it four times (MLA's query and key rope
parts, the indexer's query and key, the indexer's with one more concatenation for its unrotated
dims). One program per (token, head) row computes the same roundings as the torch function (the
spec: CPU tensors, and the tests here):

* each product in fp32, rounded to the result dtype (``torch.promote_types`` of x and cos), as a
  torch elementwise product of two such tensors rounds it;
* the difference / sum of the rounded products in fp32, rounded again;
* output: the rotated dims de-interleaved (evens then odds) for interleaved pairs, as
  `models.rope.apply_rope`, then the row's unrotated dims copied; stored in ``out_dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _round(v, CALC: tl.constexpr):
    """``v`` (fp32) rounded to the computation dtype and back (torch rounds every op's result)."""
    if CALC == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif CALC == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _rope_kernel(x_ptr, x_stride_t, x_stride_h, cos_ptr, sin_ptr, cs_stride, out_ptr, H,
                 D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr, CALC: tl.constexpr,
                 HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid // H
    h = pid % H
    base = x_ptr + t * x_stride_t + h * x_stride_h
    i = tl.arange(0, HALF_BLOCK)
    m = i < R // 2
    if INTERLEAVED:
        o1 = 2 * i
        o2 = 2 * i + 1
    else:
        o1 = i
        o2 = i + R // 2
    x1 = tl.load(base + o1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + o2, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    y1 = _round(_round(x1 * c, CALC) - _round(x2 * s, CALC), CALC)
    y2 = _round(_round(x2 * c, CALC) + _round(x1 * s, CALC), CALC)
    out = out_ptr + pid * D
    tl.store(out + i, y1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(out + R // 2 + i, y2.to(out_ptr.dtype.element_ty), mask=m)
    if R < D:
        j = tl.arange(0, REST_BLOCK)
        mj = j < D - R
        v = tl.load(base + R + j, mask=mj, other=0.0)
        tl.store(out + R + j, v.to(out_ptr.dtype.element_ty), mask=mj)


def supports(x: torch.Tensor, cos: torch.Tensor, rotate: int) -> bool:
    """Whether `apply_rope` takes ``x``: ``[T, D]`` or ``[T, H, D]`` floats with a unit last stride,
    ``cos`` / ``sin`` ``[T, rotate / 2]`` with a unit last stride, rotating an even number of dims."""
    return (x.dim() in (2, 3) and x.stride(-1) == 1 and x.dtype in _CODES and cos.dtype in _CODES
            and cos.dim() == 2 and cos.stride(-1) == 1 and cos.shape[0] == x.shape[0]
            and rotate % 2 == 0 and 0 < rotate <= x.shape[-1] and cos.shape[1] == rotate // 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, rotate: int | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``[T, (H,) D]`` with its first ``rotate`` dims (default all) rotated by ``cos`` / ``sin``
    ``[T, rotate / 2]`` (`supports`) and the rest copied; contiguous, x's shape, in ``out_dtype``
    (default: the promoted dtype of x and cos, as the torch function returns)."""
    D = x.shape[-1]
    R = D if rotate is None else rotate
    calc = torch.promote_types(x.dtype, cos.dtype)
    out = torch.empty(x.shape, dtype=out_dtype or calc, device=x.device)
    T, H = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    if T * H:
        if sin.stride() != cos.stride():  # one row stride for both tables
            cos, sin = cos.contiguous(), sin.contiguous()
        _rope_kernel[(T * H,)](
            x, x.stride(0), x.stride(1) if x.dim() == 3 else 0, cos, sin, cos.stride(0), out, H,
            D=D, R=R, INTERLEAVED=interleaved, CALC=_CODES[calc], HALF_BLOCK=triton.next_power_of_2(max(R // 2, 1)),
            REST_BLOCK=triton.next_power_of_2(max(D - R, 1)), num_warps=1)
    return out
