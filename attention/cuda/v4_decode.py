"""DeepSeek-V4 sparse decode on FlashMLA's SM90 ("legacy") fp8 decode kernel, reading the V4 pages directly.

:func:`v4_sparse_decode` attends each query over two paged sources of one layer of a
:class:`~attention.group_cache.GroupedPagedCache` stored in the V4 fp8 token format
(``attention.v4_format``: 584-byte tokens, FlashMLA's ``kv_format="V4"``):

* ``main``: the compressed cache (``csa_kv`` / ``hca_kv``) with each query's entry ids (CSA: the
  indexer's top-k; HCA: every complete entry), or, for a sliding-window-only layer, the ``swa``
  pages with the window's positions;
* ``extra`` (optional): the ``swa`` pages with the window's positions, next to a compressed main.

Positions become kernel slots (``page * 256 + offset``) through the cache's one position rule
(`GroupedPagedCache.kernel_slots`); the pages are read in place through `GroupedPagedCache.kernel_view`
(no bf16 workspace, unlike prefill's ``attention.cuda.v4_attention``). The call is

    flash_mla_with_kvcache(q [n, 1, h_pad, 512] bf16, main view, None, None, 512, meta,
        softmax_scale=, is_fp8_kvcache=True, indices=[n, 1, K] int32, attn_sink=f32 [h_pad],
        extra_k_cache=, extra_indices_in_kvcache=[n, 1, K2], topk_length=int32 [n],
        extra_topk_length=int32 [n], use_legacy=True, kv_format="V4")

with, as for V3.2 (``attention.cuda.mla``): one query per kernel batch row (``s_q = 1``, so every query has
its own lengths: ``topk_length`` is per batch row); heads padded with zero heads (sink 0) to 64 / 128 and
dropped after; index widths padded with ``-1`` to a multiple of 128; an index outside the pool made ``-1``
on the device (the kernel does no bounds check). A source's valid entries are moved to the front of its
row (a stable sort on the device) so that ``topk_length`` = its valid count skips only padding; lengths are
at least 1 (a ``-1`` entry reads nothing) so that no row asks the kernel for an empty source.

Scheduling metadata: the kernel fills a ``get_mla_metadata()`` object on first use and trusts it while
shapes *and length values* stay the same (not checked: stale metadata is silently wrong). Pass the same
``meta`` only to calls with equal lengths (``models.v4.paged_decode``: one per layer kind per forward);
None makes a fresh one.

What this does not check (the ``gpu`` test does): the real kernel's numerics and its reading of the
strided grouped-cache view. The CPU tests run it on ``tests/attention/cuda_fakes``' stand-in.
"""

from __future__ import annotations

import torch

from ..group_cache import V4Source
from . import _ext
from .mla import _pad_heads, padded_heads, padded_topk
from .v4_attention import D_V4


def _kernel_indices(cache, layer: int, src: V4Source, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 ``[n, 1, K_pad]`` kernel slots, valid first, ``-1`` after; int32 ``[n]`` lengths >= 1)."""
    slots = cache.kernel_slots(src.group, src.tables, rows, src.positions)
    view = cache.kernel_view(src.group, layer)
    # The kernel reads any index but -1: a slot outside the pool (a caller's bug) reads nothing instead.
    slots = torch.where(slots < view.shape[0] * view.shape[1], slots, -1)
    n, k = slots.shape
    # The kernel reads only the first topk_length entries: put the valid ones there (stable: order kept).
    order = torch.sort((slots < 0).to(torch.int8), dim=1, stable=True).indices
    slots = slots.gather(1, order)
    out = torch.full((n, 1, padded_topk(k)), -1, dtype=torch.int32, device=slots.device)
    out[:, 0, :k] = slots
    lengths = (slots >= 0).sum(dim=1).clamp(min=1).to(torch.int32)
    return out, lengths


def new_meta():
    """An empty FlashMLA scheduling metadata object (the kernel fills it on first use)."""
    return _ext.flash_mla().get_mla_metadata()[0]


def v4_sparse_decode(q: torch.Tensor, cache, layer: int, main: V4Source, extra: V4Source | None,
                     rows: torch.Tensor, sink: torch.Tensor, sm_scale: float, meta=None) -> torch.Tensor:
    """q ``[n, H, 512]`` (any float; bf16 into the kernel; ``H <= 128``), ``cache`` a ``GroupedPagedCache``
    whose ``main`` / ``extra`` groups are in the V4 fp8 format, ``layer`` the attention layer, ``rows``
    int64 ``[n]`` the sequence (row of the sources' tables) of each query, ``sink`` fp32 ``[H]``
    -> out bf16 ``[n, H, 512]``: per query, softmax over both sources' entries plus the sink (a zero-value
    logit), key = value (all 512 dims); a query with no valid entry gets 0. ``meta``: scheduling metadata
    (module docstring)."""
    if q.dim() != 3 or q.shape[-1] != D_V4:
        raise ValueError(f"V4 sparse decode on FlashMLA needs q [n, H, {D_V4}], got {tuple(q.shape)}")
    n, H, _ = q.shape
    if sink.shape != (H,):
        raise ValueError(f"sink must be [{H}], got {tuple(sink.shape)}")
    for src in (main, extra):
        if src is not None and (src.positions.dim() != 2 or src.positions.shape[0] != n):
            raise ValueError(f"{src.group}: positions must be [{n}, k], got {tuple(src.positions.shape)}")
    if rows.shape != (n,):
        raise ValueError(f"rows must be [{n}], got {tuple(rows.shape)}")
    if n == 0:
        return torch.zeros(0, H, D_V4, dtype=torch.bfloat16, device=q.device)
    h_pad = padded_heads(H)
    qb = _pad_heads(q, h_pad)[:, None]  # [n, 1, h_pad, 512]: one query per kernel batch row
    sinks = torch.zeros(h_pad, dtype=torch.float32, device=q.device)
    sinks[:H] = sink.float()
    idx, length = _kernel_indices(cache, layer, main, rows)
    kw = {}
    if extra is not None:
        e_idx, e_length = _kernel_indices(cache, layer, extra, rows)
        kw = dict(extra_k_cache=cache.kernel_view(extra.group, layer), extra_indices_in_kvcache=e_idx,
                  extra_topk_length=e_length)
    out, _ = _ext.flash_mla().flash_mla_with_kvcache(
        qb, cache.kernel_view(main.group, layer), None, None, D_V4, new_meta() if meta is None else meta,
        softmax_scale=float(sm_scale), is_fp8_kvcache=True, indices=idx, attn_sink=sinks, topk_length=length,
        use_legacy=True, kv_format="V4", **kw,
    )
    return out[:, 0, :H]
