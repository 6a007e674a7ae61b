"""``y = x @ W^T`` with a block-quantized fp8 weight: the dispatcher and the torch reference.

The weight stays as the checkpoint stores it: ``w`` float8_e4m3fn ``[N, K]`` and
``scale`` float32 ``[ceil(N / b0), ceil(K / b1)]``, the real weight being
``w * scale`` per ``b0 x b1`` block (`models.weights.dequantize_fp8_block`).

* ``reference`` (every CPU tensor, and CUDA without Triton): dequantize the
  weight to x's dtype, then ``F.linear``. Bit for bit what a model whose loader
  dequantized the checkpoint computes: the spec the fast paths are tested against.
* ``cuda`` (`models.ops.fp8_linear_cuda`): a Triton GEMM that dequantizes the
  weight tile by tile in registers (weight-only fp8: decode reads half the bytes
  of bf16), and for prefill-sized inputs DeepGEMM's fp8 GEMM with per-token
  1 x 128 activation quantization (fp8 tensor cores).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from models.ops import triton_importable
from models.weights import dequantize_fp8_block


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x ``[..., K]`` -> ``[..., N]`` in x's dtype, through the dequantized weight."""
    return F.linear(x, dequantize_fp8_block(w, scale, block, x.dtype))


def quantize_activations(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x ``[..., K]`` rounded as fp8 GEMMs with dynamic 1 x ``group`` activation scales see it: each
    row's groups scaled by ``max(|x|, 1e-4) / 448``, cast to e4m3 and back (float32)."""
    K = x.shape[-1]
    pad = -K % group
    xf = F.pad(x.float(), (0, pad)).unflatten(-1, (-1, group))
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    return ((xf / s).to(torch.float8_e4m3fn).float() * s).flatten(-2)[..., :K]


def reference_w8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The product a W8A8 GEMM (DeepGEMM's) computes: quantized activations times the dequantized
    weight, accumulated in float32; x's dtype out."""
    return F.linear(quantize_activations(x), dequantize_fp8_block(w, scale, block, torch.float32)).to(x.dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x ``[..., K]`` (bf16 / fp16 / fp32) -> ``[..., N]`` in x's dtype; see the module docstring."""
    if x.is_cuda and triton_importable():
        from models.ops import fp8_linear_cuda

        return fp8_linear_cuda.linear(x, w, scale, block)
    return reference(x, w, scale, block)
