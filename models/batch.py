"""The metadata of one model forward: which tokens, where their KV goes, what they see.

Built by ``workers/`` (the model runner) and consumed by the model; the model
never allocates pages itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from attention.formats import PAGE_SIZE


class ForwardMode(Enum):
    PREFILL = "prefill"
    """Prefill or a prefill chunk: each request contributes a run of new tokens
    at positions ``[seq_len - q_len, seq_len)`` on top of a cached prefix."""
    DECODE = "decode"
    """Every request contributes the same number ``q_len`` of new tokens (1 for
    plain decode, ``next_n`` for MTP verification) at the end of its context."""


@dataclass
class ForwardBatch:
    """One forward over ``R`` requests and ``T`` new tokens (requests in order).

    input_ids:    int64 ``[T]``
    positions:    int64 ``[T]``  absolute position of each new token
    out_slots:    int64 ``[T]``  cache slot (``page * 64 + offset``) each token's KV is written to
    page_tables: int32 ``[R, max_pages]`` page ids of each request (unused entries 0)
    seq_lens:     int64 ``[R]``  context length of each request *after* this forward
    q_lens:       int64 ``[R]``  new tokens per request (sum = T)
    max_seq_len:  host-side upper bound of ``seq_lens`` (sizes the decode
                  indexer's logits without reading ``seq_lens`` back from the
                  device; a CUDA-graph bucket sets its whole context capacity)
    static_shapes: no op may pick shapes from tensor values (CUDA-graph
                  capture): the MoE uses its masked fixed-shape layout
    seq_lens_host, q_lens_host: the same lengths on the host, when the builder
                  has them (an eager batch): a PREFILL forward then never reads
                  a length back from the device (each read waits for every
                  kernel queued before it, and the device idles while the host
                  launches the next ones)
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    page_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: torch.Tensor
    max_seq_len: int | None = None
    static_shapes: bool = False
    seq_lens_host: tuple[int, ...] | None = None
    q_lens_host: tuple[int, ...] | None = None
    _packed: "list[PackedContext] | None" = field(default=None, init=False, repr=False, compare=False)
    _invariant: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def layer_invariant(self, key, make):
        """``make()``, computed once per forward under ``key`` and shared by every layer that asks (what a
        layer derives from the batch alone, e.g. the whole-window selection: no per-layer kernels for it)."""
        if key not in self._invariant:
            self._invariant[key] = make()
        return self._invariant[key]

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def decode_width(self) -> int:
        """``q_len`` shared by every request of a DECODE batch, from shapes only
        (no device read: the decode step is CUDA-graph captured). Whoever builds
        a DECODE batch checks the widths on the host (``ModelRunner.build_batch``)."""
        assert self.mode is ForwardMode.DECODE
        if self.num_requests == 0 or self.num_tokens % self.num_requests:
            raise ValueError(f"a DECODE batch needs the same number of new tokens per request, got "
                             f"{self.num_tokens} tokens for {self.num_requests} requests")
        return self.num_tokens // self.num_requests

    def seq_len_bound(self) -> int:
        """``max_seq_len`` when known on the host, else ``max(seq_lens)`` (a device read)."""
        return self.max_seq_len if self.max_seq_len is not None else int(self.seq_lens.max())

    def context_slots(self, request: int) -> torch.Tensor:
        """int64 ``[seq_lens[request]]``: cache slots of positions ``0 .. seq_len - 1``."""
        n = self.host_lens()[0][request]
        return slots_for_positions(self.page_tables[request], torch.arange(n, device=self.page_tables.device))

    def host_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(seq_lens, q_lens) on the host: the builder's copies, else one read of the device's."""
        if self.seq_lens_host is None or self.q_lens_host is None:
            self.seq_lens_host = tuple(self.seq_lens.tolist())
            self.q_lens_host = tuple(self.q_lens.tolist())
        return self.seq_lens_host, self.q_lens_host

    def query_ranges(self) -> list[tuple[int, int]]:
        """``[(start, end)]`` token ranges of each request in the flat token dim."""
        ends = np.cumsum(self.host_lens()[1]).tolist()
        starts = [0] + ends[:-1]
        return list(zip(starts, ends))

    def packed_contexts(self) -> "list[PackedContext]":
        """The requests' contexts packed request after request (`PackedContext`), in groups of
        consecutive requests holding at most `PACK_MAX_POSITIONS` positions together (a request over
        it alone), built once per forward: they are the same for every layer."""
        if self._packed is None:
            seq, q = self.host_lens()
            groups, r0, held = [], 0, 0
            for r, n in enumerate(seq):
                if r > r0 and held + n > PACK_MAX_POSITIONS:
                    groups.append((r0, r))
                    r0, held = r, 0
                held += n
            groups.append((r0, len(seq)))
            self._packed = [PackedContext.build(self, a, b) for a, b in groups]
        return self._packed


PACK_MAX_POSITIONS = 1 << 17
"""Context positions one `PackedContext` holds at most (unless one request alone has more): a layer
gathers them as fp32 latents (2.3 KiB a position) plus a bf16 copy and the indexer keys, about
0.5 GiB at this bound. Requests with long cached prefixes in one chunk would otherwise add up (16
of 128k positions: 8 GiB), where one request at a time held one context."""


@dataclass(frozen=True)
class PackedContext:
    """The whole context (positions ``0 .. seq_len - 1``) of consecutive requests of a PREFILL forward,
    request after request, so that a layer reads its cache for them in one gather and runs one
    indexer and one sparse-attention call (not one per request, each with its own small kernels and
    host work).

    tokens:         the new tokens of these requests (a slice of the forward's ``[T]``)
    slots:          int64 ``[N]`` cache slot of each packed position (``N`` = their ``sum(seq_lens)``)
    row_start:      int32 ``[t]`` packed index of position 0 of each new token's request
    row_end:        int32 ``[t]`` end of each new token's causal window: ``row_start + position + 1``
    row_start_host, row_end_host: int64 numpy ``[t]``, the same on the host (chunk planning)

    A new token of request r sees packed keys ``[row_start, row_end)``; a request-local position
    p of that token is packed index ``row_start + p``.
    """

    tokens: slice
    slots: torch.Tensor
    row_start: torch.Tensor
    row_end: torch.Tensor
    row_start_host: np.ndarray
    row_end_host: np.ndarray

    @classmethod
    def build(cls, batch: ForwardBatch, r0: int = 0, r1: int | None = None) -> "PackedContext":
        """Requests ``[r0, r1)`` of ``batch`` (default all)."""
        seq_all, q_all = batch.host_lens()
        r1 = len(seq_all) if r1 is None else r1
        seq, q = seq_all[r0:r1], q_all[r0:r1]
        t0 = int(sum(q_all[:r0]))
        tokens = slice(t0, t0 + int(sum(q)))
        dev = batch.seq_lens.device
        n, t = int(sum(seq)), int(sum(q))
        # Sizes come from the host (output_size), values stay on the device: no read-back.
        seq_d = batch.seq_lens[r0:r1].long()
        start_d = torch.cumsum(seq_d, 0) - seq_d
        req = torch.repeat_interleave(torch.arange(len(seq), device=dev), seq_d, output_size=n)
        pos = torch.arange(n, device=dev) - start_d[req]
        row_start = torch.repeat_interleave(start_d, batch.q_lens[r0:r1].long(), output_size=t)
        row_end = row_start + batch.positions[tokens].long() + 1
        seq_h, q_h = np.asarray(seq, dtype=np.int64), np.asarray(q, dtype=np.int64)
        start_h = np.repeat(np.cumsum(seq_h) - seq_h, q_h)
        # A request's new tokens are its last q_len positions.
        pos_h = np.concatenate([np.arange(s - k, s) for s, k in zip(seq_h, q_h)]) if t else np.zeros(0, np.int64)
        return cls(tokens=tokens, slots=slots_for_positions(batch.page_tables[r0:r1], pos, req),
                   row_start=row_start.to(torch.int32), row_end=row_end.to(torch.int32),
                   row_start_host=start_h, row_end_host=start_h + pos_h + 1)

    @property
    def max_window(self) -> int:
        """The widest causal window of these new tokens (0 when there are none), from the host."""
        return int((self.row_end_host - self.row_start_host).max()) if len(self.row_end_host) else 0

    def whole_windows(self, width: int) -> torch.Tensor:
        """int32 ``[t, width]`` packed indices of each new token's whole window in ascending order,
        ``-1`` padded: the top-k selection of a token whose window holds at most ``width`` keys,
        whatever their scores (``width >= max_window``)."""
        if width < self.max_window:
            raise ValueError(f"a window of {self.max_window} keys does not fit in {width}")
        cols = torch.arange(width, device=self.row_start.device, dtype=torch.int32)
        win = (self.row_end - self.row_start)[:, None]
        return torch.where(cols[None, :] < win, cols[None, :] + self.row_start[:, None], -1).to(torch.int32)

    def packed_indices(self, positions: torch.Tensor) -> torch.Tensor:
        """Request-local positions ``[T, k]`` (``-1`` = none) -> int32 packed indices (``-1`` kept)."""
        return torch.where(positions >= 0, positions + self.row_start[:, None], -1).to(torch.int32)

    def local(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed indices ``[T, k]`` (``-1`` = none) -> (int64 cache slots, int64 request-local positions)."""
        valid = packed >= 0
        p = packed.long()
        slots = torch.where(valid, self.slots[p.clamp_min(0)], -1)
        return slots, torch.where(valid, p - self.row_start[:, None], -1)


def slots_for_positions(page_table: torch.Tensor, positions: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """Map token positions to cache slots through one request's page table.

    page_table: int ``[max_pages]``; positions: int64 ``[...]`` -> int64 ``[...]``.
    ``rows``: int64 like ``positions``, with ``page_table [R, max_pages]``: each position through
    its own request's row.
    """
    table = page_table.long()
    pages = table[positions // PAGE_SIZE] if rows is None else table[rows, positions // PAGE_SIZE]
    return pages * PAGE_SIZE + positions % PAGE_SIZE
