"""DeepSeek-V4 decode attention reading the paged caches in place (the cuda backend's decode path).

The reference attention (``models.v4.attention.V4Attention._sequence``) gathers, per sequence, the
compressed entries and the sliding window from its ``SequenceState`` into one workspace and attends
over a combined index row. A DECODE forward on the cuda backend with fp8 caches instead hands the
layer's pages to a paged decode kernel (``attention.cuda.v4_decode.v4_sparse_decode``: FlashMLA's
fp8 sparse decode, ``kv_format="V4"``), with the same keys per query:

* every layer: the window, positions ``p, p - 1, .., p - window + 1`` (those ``>= 0``) of the ``swa``
  group;
* CSA (c4) layers: the indexer's top-k entry ids of the ``csa_kv`` group (``-1`` = none);
* HCA (c128) layers: every complete entry ``e < (p + 1) // m`` of the ``hca_kv`` group;

and the per-head sink. A sliding-window-only layer has the window as its only (main) source; the
others have the compressed group as the main source and the window as the extra one.

The state is updated exactly as the reference updates it (``st.swa`` grows by this forward's keys, the
compressors and the indexer run on the new tokens), so the paged store after the forward
(``models.v4.paged_state.store_state``) is unchanged. The keys and entries this forward makes are
written into their pages *before* the kernel runs (it reads them there: a query attends to its own key
and to an entry its token completes): the keys of every request in one batched write per layer
(``GroupedPagedCache.write_rows``, its bounds checked on the host when the `PagedDecode` is built), the
entries per request that completed one; the store writes the same values again.

`PagedDecode` is built once per forward by the runner (``workers.v4_runner``; for the MTP layer's chained
draft steps by ``models.v4.mtp.paged_mtp_forward``) and passed down to every attention layer; it also holds the kernel's scheduling metadata, one object per layer kind and index
widths, reused by the layers of that kind (their per-query lengths are equal: they depend only on the
positions, the window, the ratio and ``index_topk``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from attention.group_cache import GroupedPagedCache, V4Source, padded_tables
from models.v4.config import CSA, HCA, SLIDING

_GROUP = {CSA: "csa_kv", HCA: "hca_kv"}


@dataclass
class PagedDecode:
    """One decode forward's view of the pages (module docstring).

    cache:    the grouped cache (V4 fp8 format);
    pages:    request ``r``'s pages per group (the batch's page tables);
    tables:   group -> int64 ``[R, max_pages]`` (`attention.group_cache.padded_tables`);
    rows:     int64 ``[T]``, the request of each token of the forward;
    ends:     host ints, request ``r``'s length after the forward;
    attend:   ``attention.cuda.v4_decode.v4_sparse_decode``'s signature;
    new_meta: makes an empty scheduling metadata object (``attention.cuda.v4_decode.new_meta``);
    metas:    scheduling metadata by (layer kind, index widths), made on first use.
    """

    cache: GroupedPagedCache
    pages: tuple[Mapping[str, Sequence[int]], ...]
    tables: dict[str, torch.Tensor]
    rows: torch.Tensor
    ends: tuple[int, ...]
    attend: Callable
    new_meta: Callable
    metas: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cache: GroupedPagedCache, pages, starts: Sequence[int], q_lens: Sequence[int],
           attend: Callable, new_meta: Callable) -> "PagedDecode":
        """A forward of ``q_lens[r]`` tokens from position ``starts[r]`` of requests whose pages are
        ``pages[r]`` (group -> page ids)."""
        dev = cache.device
        T = cache.layouts["swa"].group.tokens_per_page
        for p, s, n in zip(pages, starts, q_lens):  # on the host: the batched key write reads nothing back
            if s + n > len(p["swa"]) * T:
                raise ValueError(f"a request's {len(p['swa'])} swa pages do not hold positions up to {s + n}")
        groups = [g for g in ("swa", *_GROUP.values()) if g in cache.layouts]
        tables = {g: padded_tables([p[g] for p in pages], dev) for g in groups}
        rows = torch.repeat_interleave(torch.arange(len(q_lens), device=dev),
                                       torch.tensor(list(q_lens), device=dev))
        return cls(cache, tuple(pages), tables, rows, tuple(s + n for s, n in zip(starts, q_lens)), attend,
                   new_meta)

    def meta(self, key: tuple):
        """The scheduling metadata shared by this forward's calls keyed ``key`` (equal lengths)."""
        if key not in self.metas:
            self.metas[key] = self.new_meta()
        return self.metas[key]


def window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """int64 ``[T, window]``: query ``t`` at position ``p`` reads ``p, p - 1, .., p - window + 1`` (``-1``
    where negative), the reference's window ``(p - window, p]``."""
    pos = positions[:, None] - torch.arange(window, device=positions.device)[None, :]
    return torch.where(pos >= 0, pos, -1)


def causal_entries(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """int64 ``[T, width]``: every entry ``e < (p + 1) // ratio`` (complete at the query), ``-1`` after."""
    e = torch.arange(width, device=positions.device)[None, :]
    return torch.where(e < ((positions + 1) // ratio)[:, None], e, -1)


def paged_decode_attention(attn, x, q_res, q, kv, positions, cos, sin, ranges, states, compress_rotary,
                           paged: PagedDecode) -> torch.Tensor:
    """``V4Attention.forward``'s attention part for a DECODE forward over pages: x ``[T, hidden]``,
    q_res ``[T, q_lora]``, q / kv ``[T, H, D]`` / ``[T, D]`` (rotated; kv rounded through the cache format),
    positions int64 ``[T]``, cos / sin of the layer's rope, ``ranges`` / ``states`` per request (updated
    as the reference updates them) -> out ``[T, H, D]`` (the kernel's bf16)."""
    cache, layer = paged.cache, attn.layer
    cache.write_rows("swa", layer, paged.tables["swa"], paged.rows, positions, kv)  # every request's new keys
    comp_rows = []
    for r, ((s0, s1), st) in enumerate(zip(ranges, states)):
        if s1 == s0:
            continue
        pages = paged.pages[r]
        # The state as the reference leaves it: the window before, then this forward's keys.
        st.swa = torch.cat([attn.window_before(st), kv[s0:s1]])
        if attn.compressor is None:
            continue
        before = st.comp.num_entries
        attn.compressor(x[s0:s1], st.comp, compress_rotary)
        if st.comp.num_entries > before:  # entries this forward's tokens completed
            at = torch.arange(before, st.comp.num_entries, device=x.device)
            cache.write(_GROUP[attn.kind], layer, pages[_GROUP[attn.kind]], at, st.comp.entries[before:])
        if attn.indexer is not None:
            comp_rows.append(attn.indexer(x[s0:s1], q_res[s0:s1], positions[s0:s1], cos[s0:s1], sin[s0:s1],
                                          st.index, compress_rotary))
    swa = _source("swa", paged, window_positions(positions, attn.window))
    if attn.kind == SLIDING:
        main, extra = swa, None
    elif attn.kind == CSA:
        width = max(c.shape[1] for c in comp_rows)
        ids = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1]), value=-1) for c in comp_rows])
        main, extra = _source("csa_kv", paged, ids), swa
    else:  # HCA: every complete entry of the longest request
        width = max(end // attn.ratio for end in paged.ends)
        main, extra = _source("hca_kv", paged, causal_entries(positions, attn.ratio, width)), swa
    meta = paged.meta((attn.kind, main.positions.shape[1], None if extra is None else extra.positions.shape[1]))
    return paged.attend(q, cache, layer, main, extra, paged.rows, attn.attn_sink, attn.scale, meta=meta)


def _source(group: str, paged: PagedDecode, positions: torch.Tensor) -> V4Source:
    return V4Source(group, paged.tables[group], positions)
