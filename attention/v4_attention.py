"""DeepSeek-V4 sparse attention, reference backend (fp32 torch), and its index row.

V4 attends, per query, to some compressed-cache entries (CSA: the indexer's
top-k; HCA: every causal entry) **plus** the last ``window`` uncompressed
sliding-window tokens, in one sparse call over one workspace ``kv [N, D]``
into which the request's needed compressed and SWA keys are gathered
(dequantized). One row of indices per query says which workspace rows it
reads::

    [ compressed part (ncomp) | SWA part (nswa) | -1 ... ]   width = ceil((ncomp + nswa) / align) * align

(``flash_mla_sparse_fwd`` asserts top-k % 64 / 128; ``align`` 128 serves both).
Key = value (shared-KV MQA, all ``D`` dims are values), and each head has a
learnable *sink*: an extra logit with a zero value::

    logit[h, i] = sm_scale * q[h] . kv[idx[i]]         (idx[i] = -1 excluded)
    out[h]      = sum_i exp(logit[h, i]) kv[idx[i]] / (exp(sink[h]) + sum_i exp(logit[h, i]))

A row with no valid index gets ``out = 0``. This is FlashMLA's
``attn_sink`` semantics (``flash_mla_sparse_fwd(..., d_v = D, attn_sink=sink)``).
"""

from __future__ import annotations

import torch

INDEX_ALIGN = 128
"""Width multiple of a combined index row (FlashMLA's sparse kernels take top-k % 64 or % 128)."""

_CHUNK_ELEMENTS = 64 * 1024 * 1024


def combined_index_row(comp: torch.Tensor, swa: torch.Tensor, comp_offset: int, swa_offset: int,
                       align: int = INDEX_ALIGN) -> torch.Tensor:
    """The combined index rows of ``S`` queries: ``[comp | swa | -1 pad]``.

    Args:
        comp: int ``[S, ncomp]`` compressed-entry indices of each query, ``-1`` = none.
        swa: int ``[S, nswa]`` sliding-window token indices of each query, ``-1`` = none.
        comp_offset / swa_offset: workspace row of compressed entry 0 / SWA token 0.
        align: the row width is rounded up to a multiple of it (>= 1).

    Returns:
        int32 ``[S, ceil((ncomp + nswa) / align) * align]``: valid entries shifted by
        their part's offset, every other position ``-1``.
    """
    if comp.dim() != 2 or swa.dim() != 2 or comp.shape[0] != swa.shape[0]:
        raise ValueError(f"comp [S, ncomp] and swa [S, nswa] must agree on S, got {tuple(comp.shape)} and {tuple(swa.shape)}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    S, nc, ns = comp.shape[0], comp.shape[1], swa.shape[1]
    width = -(-(nc + ns) // align) * align
    row = torch.full((S, width), -1, dtype=torch.int32, device=comp.device)
    row[:, :nc] = torch.where(comp >= 0, comp.long() + comp_offset, -1).to(torch.int32)
    row[:, nc:nc + ns] = torch.where(swa >= 0, swa.long() + swa_offset, -1).to(torch.int32)
    return row


def sparse_attention_with_sink(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                               sm_scale: float) -> torch.Tensor:
    """q ``[S, H, D]``, kv ``[N, D]`` (any float dtype), indices int ``[S, K]`` (rows of ``kv``,
    ``-1`` = invalid), sink fp32 ``[H]`` -> out fp32 ``[S, H, D]`` (module docstring).

    Raises IndexError for an index outside ``[-1, N)``."""
    S, H, D = q.shape
    if kv.dim() != 2 or kv.shape[1] != D:
        raise ValueError(f"kv must be [N, {D}], got {tuple(kv.shape)}")
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= kv.shape[0]):
        raise IndexError(f"indices must lie in [-1, {kv.shape[0]}), got [{int(indices.min())}, {int(indices.max())}]")
    out = torch.zeros(S, H, D, dtype=torch.float32, device=q.device)
    K = indices.shape[1]
    rows = max(1, _CHUNK_ELEMENTS // max(1, K * D))
    kvf, s = kv.float(), sink.float()
    for a in range(0, S, rows):
        idx = indices[a:a + rows].long()
        valid = idx >= 0
        k = kvf[idx.clamp(min=0)]  # [n, K, D]
        logits = torch.einsum("nhd,nkd->nhk", q[a:a + rows].float(), k) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        # The sink joins the softmax as one more logit whose value is zero.
        full = torch.cat([logits, s.view(1, H, 1).expand(logits.shape[0], H, 1)], dim=-1)
        p = torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out[a:a + rows] = torch.einsum("nhk,nkd->nhd", p, k)
    return out
