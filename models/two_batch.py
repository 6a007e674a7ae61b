"""Two-batch overlap (TBO) of a tensor-parallel forward.

With ``tp > 1`` every decoder layer waits on all-reduces (the attention output,
the MLP or MoE output): on one micro-batch the ranks compute, then talk, then
compute. TBO splits a forward's requests into two micro-batches and runs them
at once, each in a thread of its own with a process group of its own
(`models.parallel.collectives_on`): while one micro-batch's all-reduce is on
the wire, the other computes. Each micro-batch is a whole forward of its
requests, its layers' top-k selections its own (a shared layer reuses the
selection of its own micro-batch's earlier layer, never the other's), so the
output is the same as one forward over the whole batch, row for row (the
per-request independence every batch already has: a request's output does not
depend on what it is batched with).

Where it runs: the eager forwards (prefill chunks, decode steps without CUDA
graphs). A forward with fewer than two requests, or one captured in a CUDA
graph (``batch.static_shapes``), runs whole. The split balances new tokens:
the first micro-batch takes the leading requests whose tokens come closest to half.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

import torch

from models.batch import ForwardBatch
from models.parallel import collectives_on


def split_point(batch: ForwardBatch) -> int | None:
    """The request index the second micro-batch starts at (tokens split about evenly, each half at
    least one request); None for a batch of one request."""
    R = batch.num_requests
    if R < 2:
        return None
    ends = torch.cumsum(batch.q_lens, 0).tolist()  # one host read of R lengths (eager forwards only)
    half = ends[-1] / 2
    return min(range(1, R), key=lambda k: abs(ends[k - 1] - half))


def split_batch(batch: ForwardBatch, at: int) -> tuple[ForwardBatch, ForwardBatch]:
    """(requests ``[0, at)``, requests ``[at, R)``) of ``batch``, each with its own tokens ``[T_i]``,
    page-table rows ``[R_i, max_pages]`` and lengths; ``max_seq_len`` stays an upper bound of both."""
    t = int(batch.q_lens[:at].sum())

    def part(tokens: slice, reqs: slice) -> ForwardBatch:
        return replace(batch, input_ids=batch.input_ids[tokens], positions=batch.positions[tokens],
                       out_slots=batch.out_slots[tokens], page_tables=batch.page_tables[reqs],
                       seq_lens=batch.seq_lens[reqs], q_lens=batch.q_lens[reqs])

    return part(slice(0, t), slice(0, at)), part(slice(t, None), slice(at, None))


class TwoBatchOverlap:
    """Runs a forward as two overlapped micro-batches on ``groups`` (two process groups of the same
    tensor-parallel ranks, made in the same order on every rank)."""

    def __init__(self, groups: tuple):
        if len(groups) != 2:
            raise ValueError(f"two-batch overlap needs two process groups, got {len(groups)}")
        self.groups = groups
        self._other = ThreadPoolExecutor(1, thread_name_prefix="tbo-micro-batch")
        self.overlapped = 0
        """Forwards run as two micro-batches (the rest ran whole)."""

    def __call__(self, forward: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """``forward(batch)`` (hidden ``[T, hidden]``), as two micro-batches where it can be."""
        at = None if batch.static_shapes else split_point(batch)
        if at is None:
            return forward(batch)
        first, second = split_batch(batch, at)
        inference = torch.is_inference_mode_enabled()  # thread-local: the other thread takes it over

        def run(micro: ForwardBatch, group) -> torch.Tensor:
            with torch.inference_mode(inference), collectives_on(group):
                return forward(micro)

        other = self._other.submit(run, first, self.groups[0])
        try:
            tail = run(second, self.groups[1])
        finally:
            head = other.result()  # waited for even when this thread failed: never left running
        self.overlapped += 1
        return torch.cat([head, tail])
