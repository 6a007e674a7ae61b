"""The metadata of one model forward: which tokens, where their KV goes, what they see.

Built by ``workers/`` (the model runner) and consumed by the model; the model
never allocates pages itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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
        return slots_for_positions(self.page_tables[request], torch.arange(int(self.seq_lens[request]), device=self.page_tables.device))

    def query_ranges(self) -> list[tuple[int, int]]:
        """``[(start, end)]`` token ranges of each request in the flat token dim."""
        ends = torch.cumsum(self.q_lens, 0).tolist()
        starts = [0] + ends[:-1]
        return list(zip(starts, ends))


def slots_for_positions(page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Map token positions to cache slots through one request's page table.

    page_table: int ``[max_pages]``; positions: int64 ``[...]`` -> int64 ``[...]``.
    """
    pages = page_table.long()[positions // PAGE_SIZE]
    return pages * PAGE_SIZE + positions % PAGE_SIZE
