"""DeepSeek-V4's sparse attention with sinks on FlashMLA's SM90 ("legacy") prefill kernel.

:func:`sparse_attention_with_sink` takes the reference's arguments
(``attention.v4_attention.sparse_attention_with_sink``: a workspace ``kv [N, 512]`` of the gathered
compressed and sliding-window keys, one combined index row per query, one sink logit per head) and
runs ``flash_mla_sparse_fwd(..., d_v=512, attn_sink=..., use_legacy=True)``: the SM90 build of
sgl-flash-mla 1.0.0 takes ``d_qk`` 512 (V4) besides 576 (V3.2), and a per-head ``attn_sink``
(attention/API.md, "What the installed FlashMLA offers V4 on SM90"). As for V3.2 (`attention.cuda.mla`):

* query heads are padded with zero heads to 64 or 128, the padded heads' sinks with 0 (their outputs
  are dropped);
* the index width is padded with ``-1`` to a multiple of 128;
* an index outside ``[0, N)`` is invalid (turned into ``-1`` on the device: no read-back), where the
  reference raises; either way a caller's bug.

``topk_length`` (int32 ``[S]``, optional): query ``s`` reads only ``indices[s, :topk_length[s]]``, the
kernel's own way to skip a row's padding (the reference masks the same entries).

The V4 model calls it on the cuda backend (`workers.rank_build`: ``DeepseekV4ForCausalLM.set_attention_kernel``);
everything else of V4 runs as torch ops on the device. Its GPU test is
``tests/attention/test_cuda_v4_attention.py``'s ``gpu`` case.
"""

from __future__ import annotations

import torch

from . import _ext
from .mla import _pad_heads, _pad_indices, padded_heads, padded_topk

D_V4 = 512
"""V4's key = value width through the kernel (``head_dim``: 448 nope + 64 rope)."""


def check_v4_dims(head_dim: int, num_heads: int) -> None:
    """Raise unless a V4 model's attention runs on the kernel: ``head_dim`` 512, at most 128 heads."""
    if head_dim != D_V4 or num_heads > 128:
        raise ValueError(f"DeepSeek-V4 on the cuda backend needs head_dim {D_V4} and at most 128 attention heads "
                         f"(FlashMLA's sparse kernel), got head_dim {head_dim} and {num_heads} heads")


def sparse_attention_with_sink(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                               sm_scale: float, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[S, H, 512]``, kv ``[N, 512]`` (any float; bf16 into the kernel), indices int ``[S, K]`` (``-1``
    invalid), sink fp32 ``[H]`` -> out bf16 ``[S, H, 512]``; a row without a valid index gives 0."""
    if q.dim() != 3 or q.shape[-1] != D_V4:
        raise ValueError(f"V4 sparse attention on FlashMLA needs q [S, H, {D_V4}], got {tuple(q.shape)}")
    S, H, D = q.shape
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"kv must be [N, {D}], got {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != S:
        raise ValueError(f"indices must be [{S}, K], got {tuple(indices.shape)}")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [{H}], got {tuple(sink.shape)}")
    if topk_length is not None and topk_length.shape != (S,):
        raise ValueError(f"topk_length must be [{S}], got {tuple(topk_length.shape)}")
    N, K = kv.shape[0], indices.shape[1]
    if S == 0 or N == 0 or K == 0:
        return torch.zeros(S, H, D, dtype=torch.bfloat16, device=q.device)
    h_pad = padded_heads(H)
    qb = _pad_heads(q, h_pad)
    sinks = torch.zeros(h_pad, dtype=torch.float32, device=q.device)
    sinks[:H] = sink.float()
    idx = _pad_indices(indices[:, None, :], padded_topk(K), (indices < 0)[:, None, :] | (indices >= N)[:, None, :])
    length = None if topk_length is None else topk_length.to(torch.int32).contiguous()
    out, _, _ = _ext.flash_mla().flash_mla_sparse_fwd(qb, kv.to(torch.bfloat16).contiguous()[:, None, :], idx,
                                                       float(sm_scale), D_V4, attn_sink=sinks, topk_length=length,
                                                       use_legacy=True)
    return out[:, :H] if h_pad != H else out
