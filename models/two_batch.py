"""Two-batch overlap (TBO) of a tensor-parallel forward.

With ``tp > 1`` every decoder layer waits on all-reduces (the attention output,
the MLP or MoE output): on one micro-batch the ranks compute, then talk, then
compute. TBO splits a forward's requests into two micro-batches and runs them
interleaved at their all-reduces: micro-batch A computes up to an all-reduce,
launches it without waiting and hands the turn to B, which computes (while A's
all-reduce is on the wire) up to its own all-reduce, launches it and hands the
turn back; A waits for its result only then. Each micro-batch runs in a thread
of its own, but only the thread holding the turn runs (`Turns`), so every rank
issues its collectives in one fixed order (A0, B0, A1, B1, ...) on the model's
one process group, and its kernels on one CUDA stream: NCCL's rule (one
issuing order on every rank) holds by construction. (The first version ran the
threads freely, each on a CUDA stream and a process group of its own; at
DeepSeek-V3.2 dims on 2 x H200 it hung in its first decode step.)

Each micro-batch is a whole forward of its requests, its layers' top-k
selections its own (a shared layer reuses the selection of its own
micro-batch's earlier layer, never the other's), so the output is the same as
one forward over the whole batch, row for row.

Where it runs: the eager forwards (prefill chunks, decode steps without CUDA
graphs). A forward with fewer than two requests, or one captured in a CUDA
graph (``batch.static_shapes``), runs whole. The split balances new tokens:
the first micro-batch takes the leading requests whose tokens come closest to half.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from models.batch import ForwardBatch
from models.parallel import taking_turns


def split_point(batch: ForwardBatch) -> int | None:
    """The request index the second micro-batch starts at (tokens split about evenly, each half at
    least one request); None for a batch of one request."""
    R = batch.num_requests
    if R < 2:
        return None
    ends = np.cumsum(batch.host_lens()[1]).tolist()  # (a read of R lengths if the builder gave none)
    half = ends[-1] / 2
    return min(range(1, R), key=lambda k: abs(ends[k - 1] - half))


def split_batch(batch: ForwardBatch, at: int) -> tuple[ForwardBatch, ForwardBatch]:
    """(requests ``[0, at)``, requests ``[at, R)``) of ``batch``, each with its own tokens ``[T_i]``,
    page-table rows ``[R_i, max_pages]`` and lengths; ``max_seq_len`` stays an upper bound of both."""
    seq, q = batch.host_lens()
    t = int(sum(q[:at]))

    def part(tokens: slice, reqs: slice) -> ForwardBatch:
        return replace(batch, input_ids=batch.input_ids[tokens], positions=batch.positions[tokens],
                       out_slots=batch.out_slots[tokens], page_tables=batch.page_tables[reqs],
                       seq_lens=batch.seq_lens[reqs], q_lens=batch.q_lens[reqs],
                       seq_lens_host=seq[reqs], q_lens_host=q[reqs])

    return part(slice(0, t), slice(0, at)), part(slice(t, None), slice(at, None))


class Turns:
    """Whose turn it is to run, of two micro-batch threads (0 and 1). A thread runs only while it
    holds the turn; `pass_turn` hands it over at an all-reduce and waits to get it back; `done`
    hands it over for good. A thread whose partner is done keeps the turn."""

    def __init__(self):
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]

    def wait_turn(self, me: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == me)

    def pass_turn(self, me: int) -> None:
        with self._cond:
            if self._done[1 - me]:
                return
            self._turn = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me)

    def done(self, me: int) -> None:
        with self._cond:
            self._done[me] = True
            self._turn = 1 - me
            self._cond.notify_all()


class TwoBatchOverlap:
    """Runs a forward as two micro-batches interleaved at their all-reduces (module docstring)."""

    def __init__(self):
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
        device = first.input_ids.device
        turns = Turns()

        def run(micro: ForwardBatch, me: int) -> torch.Tensor:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # a fresh thread starts on device 0
            turns.wait_turn(me)
            try:
                with torch.inference_mode(inference), taking_turns(turns, me):
                    return forward(micro)
            finally:
                turns.done(me)  # also on an error: the partner is never left waiting for the turn

        # The first micro-batch (turn 0) runs on the pool's thread, the second here.
        other = self._other.submit(run, first, 0)
        try:
            tail = run(second, 1)
        finally:
            head = other.result()  # waited for even when this thread failed: never left running
        self.overlapped += 1
        return torch.cat([head, tail])
