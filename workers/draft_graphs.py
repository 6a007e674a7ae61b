"""MTP draft forwards through static per-bucket buffers, replayed as CUDA graphs.

The draft phase of an MTP step (`workers.mtp_draft`) runs ``k`` MTP forwards: the first of width
``n = k + 1`` over each request's pending positions, then ``k - 1`` chained width-1 steps. For a
batch bucket ``B_b`` each is one captured graph (``k`` per bucket), in the verify's memory layout:
the draft shares the rows and page tables of the verify's `workers.decode_graphs.DecodeInputs`
(same requests, same step), and adds its own device buffers:

* ``packed`` int64 ``[B * n + 2 * B]``: each row's ``n`` MTP input tokens, ``pending_start`` and
  pending count ``m`` (0: a padding row, which writes nothing), one host-to-device copy a step;
* ``hidden`` ``[B * n, hidden]``: the verify's hidden states, copied in on the device;
* ``chain_tokens`` int64 ``[k - 1, B]``: each chained step's input, the previous drafts, copied in
  on the device;
* ``logits`` fp32 ``[B, vocab]``: every forward's draft logits (one buffer: a step's are sampled
  before the next forward is launched).

Positions, slots (`workers.mtp.draft_slot_layout`), the gather of each request's row ``m - 1`` and
the chained steps' positions (from ``num_tokens = pending_start + m + 1``) are computed inside the
graphs. A chained step's graph reads the previous forward's hidden output (and, with top-k reuse,
its selection) where that graph left it. Sampling runs eagerly between replays (a row's
parameters shape its kernels). ``capture=False`` runs the very same code eagerly on the same
buffers (CPU tests, and the reference the replays are checked against).
"""

from __future__ import annotations

import torch

from workers.decode_graphs import DecodeGraphs
from workers.host_copy import to_device
from workers.mtp_draft import (
    DraftSampler,
    Drafts,
    PendingRows,
    chain_draft_batch,
    first_draft_batch,
    first_draft_rows,
)


class DraftGraphs:
    """The draft forwards of the verify plan of ``verify`` (width ``k + 1``)."""

    def __init__(self, model, cache, backend, verify: DecodeGraphs, k: int, topk_reuse: bool, capture: bool):
        if verify.plan.width != k + 1:
            raise ValueError(f"drafts of {k} tokens need the verify plan of width {k + 1}, got {verify.plan.width}")
        self.model, self.cache, self.backend = model, cache, backend
        self.verify, self.inputs, self.plan = verify, verify.inputs, verify.plan
        self.k, self.topk_reuse, self.capture = k, topk_reuse, capture
        self.device = verify.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        B, n = self.plan.max_batch_size, k + 1
        self.packed = torch.zeros(B * n + 2 * B, dtype=torch.int64, device=self.device)
        self.hidden = torch.zeros(B * n, model.cfg.hidden_size, dtype=model.dtype, device=self.device)
        self.chain_tokens = torch.zeros(max(k - 1, 0), B, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(B, model.cfg.vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # bucket -> each forward's (hidden [bucket, hidden], selection) outputs, read by the next forward
        self.outputs: dict[int, list[tuple]] = {}
        self.replays = 0

    def covers(self, num_requests: int, max_pages: int) -> bool:
        return self.verify.covers(num_requests, max_pages, self.k + 1)

    # ------------------------------------------------------------ forwards
    def _fields(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, n = self.plan.max_batch_size, self.k + 1
        p = self.packed
        return p[:bucket * n], p[B * n:B * n + bucket], p[B * n + B:B * n + B + bucket]

    def _first(self, bucket: int) -> tuple:
        """The first forward over rows ``0 .. bucket-1``; its logits into ``self.logits``."""
        n = self.k + 1
        tokens, starts, counts = self._fields(bucket)
        batch = first_draft_batch(self.inputs.page_tables[:bucket], starts, counts, tokens, n,
                                  self.plan.max_context, static_shapes=True)
        logits, h, sel = self.model.mtp_forward(batch, self.hidden[:bucket * n], self.cache, self.backend,
                                                rows=first_draft_rows(counts, n))
        self.logits[:bucket].copy_(logits)
        return h, sel

    def _chain(self, bucket: int, step: int, h: torch.Tensor, sel) -> tuple:
        """Chained step ``step`` over rows ``0 .. bucket-1`` from the previous forward's ``h`` / ``sel``."""
        _, starts, counts = self._fields(bucket)
        batch = chain_draft_batch(self.inputs.page_tables[:bucket], starts + counts + 1, counts > 0, step,
                                  self.k - 1, self.chain_tokens[step, :bucket], self.plan.max_context,
                                  static_shapes=True)
        logits, h, sel = self.model.mtp_forward(batch, h, self.cache, self.backend,
                                                reuse=sel if self.topk_reuse else None)
        self.logits[:bucket].copy_(logits)
        return h, sel

    def _forward(self, bucket: int, step: int, prev: tuple | None) -> tuple:
        return self._first(bucket) if step == 0 else self._chain(bucket, step - 1, *prev)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture the ``k`` forwards of every bucket, largest first, sharing one memory pool; each
        first runs eagerly on all-padding inputs (no cache writes), as `DecodeGraphs.capture_all`."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.inputs.clear()
        self.packed.zero_()
        for bucket in sorted(self.plan.batch_sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    prev = None
                    for step in range(self.k):
                        prev = self._forward(bucket, step, prev)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graphs, outs, prev = [], [], None
            for step in range(self.k):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    prev = self._forward(bucket, step, prev)
                graphs.append(graph)
                outs.append(prev)
            self.graphs[bucket], self.outputs[bucket] = graphs, outs
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------- a step
    @torch.inference_mode()
    def run(self, drafter, reqs: list, pending: PendingRows, sampler: DraftSampler) -> Drafts:
        """The drafts of ``reqs`` (their `PendingRows`; ``drafter``: the `FixedWidthDrafter`, for the
        hidden inputs), sampled by ``sampler`` between the forwards."""
        R, n, B = len(reqs), self.k + 1, self.plan.max_batch_size
        bucket = self.plan.bucket(R)
        rows = self.inputs.assign([r.request_id for r in reqs], [r.page_table for r in reqs])
        tok, starts, counts = [0] * (B * n), [0] * B, [0] * B
        for i, row in enumerate(rows):
            tok[row * n:(row + 1) * n] = pending.tokens[i * n:(i + 1) * n]
            starts[row], counts[row] = pending.starts[i], pending.counts[i]
        self.packed.copy_(to_device(torch.tensor(tok + starts + counts, dtype=torch.int64), self.device))
        src, index = drafter.hidden_rows(reqs, pending.counts, rows)
        if index is None:
            self.hidden[:R * n].copy_(src)
        else:
            self.hidden.index_copy_(0, to_device(index, self.device), src.to(self.device, self.hidden.dtype))
        in_order = rows == list(range(R))
        at = None if in_order else to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        prev = drafts = None
        for step in range(self.k):
            if step:
                chain = self.chain_tokens[step - 1]
                if at is None:
                    chain[:R].copy_(drafts)
                else:
                    chain.index_copy_(0, at, drafts)
            if self.capture:
                if bucket not in self.graphs:
                    raise RuntimeError("capture_all() must run before the first replay")
                self.graphs[bucket][step].replay()
                self.replays += 1
            else:
                prev = self._forward(bucket, step, prev)
            drafts = sampler(self.logits[:R] if at is None else self.logits.index_select(0, at))
        return sampler.result()
