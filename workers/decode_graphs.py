"""Decode steps through static per-bucket buffers, replayed as CUDA graphs.

A decode step's shapes depend only on the number of requests ``B`` and the
new tokens per request ``width`` (1 for plain decode, ``k + 1`` for MTP
verification). So each bucket ``B_b`` of a :class:`DecodeGraphPlan` gets one
captured CUDA graph of the whole target-model forward, reading its inputs from
static buffers that are overwritten in place before every replay:

* ``input_ids``, ``positions``, ``out_slots`` ``[B_b * width]`` and
  ``seq_lens``, ``q_lens`` ``[B_b]`` (int64) and ``page_tables``
  ``[B_b, max_pages]`` (int32);
* everything derived per step -- the indexer's context lengths, DeepGEMM's
  paged-logits schedule (``get_paged_mqa_logits_metadata`` runs inside the
  graph on the context lengths), the top-k selection and the FlashMLA indices
  -- is computed by kernels inside the graph from those buffers, so nothing
  is rebuilt on the host. FlashMLA's sparse-decode scheduling metadata
  depends only on the shapes and top-k width: it is made by the warm-up run
  before capture and stays fixed for the graph's life.

Rows past the live requests are padding: position 0 of page 0 (context 1:
they read one key and attend to it, harmlessly), cache slot ``-1`` (the
cache writes skip it), page table zeros. They are rewritten on every step, so a row that held a
request in the previous replay can never write into that request's pages.

The forward runs with ``ForwardBatch.static_shapes`` (the MoE takes every
expert over every token instead of gathering tokens per expert) and with
``max_seq_len = max_pages * 64`` (the indexer's logits width), so nothing
reads a tensor value back to the host. ``capture=False`` runs the very same
code eagerly on the same buffers: on CPU (tests) and as the reference the
replayed graphs are checked against, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.formats import PAGE_SIZE
from models.batch import ForwardBatch, ForwardMode


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Buckets for up to ``max_batch_size`` requests: 1, 2, 4, 8, then every 16,
    and ``max_batch_size`` itself (a step pads to the smallest bucket that fits)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def graphs_wanted(setting: bool | None, backend: str, device: str | torch.device, tp_size: int = 1) -> bool:
    """Whether decode steps are captured: ``setting`` when given (True on a
    non-CUDA device is an error), else on for the cuda backend on a GPU (the
    reference backend reads values back to the host and cannot be captured).
    Never with ``tp_size > 1`` (not built for rank workers yet; True is an error)."""
    if tp_size > 1:
        if setting:
            raise ValueError("cuda_graphs with tp_size > 1 are not built yet")
        return False
    on_gpu = torch.device(device).type == "cuda"
    if setting is None:
        return on_gpu and backend == "cuda"
    if setting and not (on_gpu and backend == "cuda"):
        raise ValueError(f"cuda_graphs=True needs backend='cuda' on a CUDA device, got backend={backend!r} "
                         f"on {torch.device(device)}")
    return setting


def default_graph_context(cfg, num_pages: int) -> int:
    """The longest context a captured decode step serves by default: what the
    pool could hold for one request, capped by the model's position limit."""
    return max(PAGE_SIZE, min(num_pages * PAGE_SIZE, int(cfg.max_position_embeddings)))


@dataclass(frozen=True)
class DecodeGraphPlan:
    """Which decode steps have a graph.

    width:       new tokens per request (1, or ``k + 1`` when verifying k drafts)
    batch_sizes: ascending bucket sizes
    max_pages:   page-table width per request; a request with more pages (a
                 context beyond ``max_pages * 64`` tokens) runs eagerly
    """

    width: int
    batch_sizes: tuple[int, ...]
    max_pages: int

    def __post_init__(self) -> None:
        if self.width < 1 or self.max_pages < 1:
            raise ValueError(f"width and max_pages must be >= 1, got {self.width} and {self.max_pages}")
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be ascending distinct positive ints, got {self.batch_sizes}")

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_context(self) -> int:
        return self.max_pages * PAGE_SIZE

    def bucket(self, num_requests: int) -> int | None:
        """The smallest bucket holding ``num_requests`` requests, or None."""
        for b in self.batch_sizes:
            if b >= num_requests:
                return b
        return None


class _StaticInputs:
    """The buffers one plan's graphs read, sized for its largest bucket."""

    def __init__(self, plan: DecodeGraphPlan, device: torch.device):
        B, w = plan.max_batch_size, plan.width
        self.plan = plan
        # One int64 block for the per-token and per-request fields: one
        # host-to-device copy per step instead of five.
        self.packed = torch.zeros(3 * B * w + 2 * B, dtype=torch.int64, device=device)
        self.page_tables = torch.zeros(B, plan.max_pages, dtype=torch.int32, device=device)

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        B, w = self.plan.max_batch_size, self.plan.width
        p = self.packed
        n = bucket * w
        return {
            "input_ids": p[0:n],
            "positions": p[B * w: B * w + n],
            "out_slots": p[2 * B * w: 2 * B * w + n],
            "seq_lens": p[3 * B * w: 3 * B * w + bucket],
            "q_lens": p[3 * B * w + B: 3 * B * w + B + bucket],
            "page_tables": self.page_tables[:bucket],
        }

    def batch(self, bucket: int) -> ForwardBatch:
        v = self.views(bucket)
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=v["input_ids"], positions=v["positions"],
            out_slots=v["out_slots"], page_tables=v["page_tables"], seq_lens=v["seq_lens"],
            q_lens=v["q_lens"], max_seq_len=self.plan.max_context, static_shapes=True,
        )

    def fill(self, bucket: int, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             seq_lens: torch.Tensor, page_tables: torch.Tensor) -> None:
        """Write ``R <= bucket`` live rows (host tensors: ``tokens``, ``positions``,
        ``slots`` int64 ``[R * width]``; ``seq_lens`` int64 ``[R]``; ``page_tables``
        int32 ``[R, <= max_pages]``) and padding for the rest of the bucket."""
        B, w = self.plan.max_batch_size, self.plan.width
        R, n = seq_lens.shape[0], bucket * w
        host = torch.zeros(3 * B * w + 2 * B, dtype=torch.int64)
        host[0: R * w] = tokens
        host[B * w: B * w + R * w] = positions
        # Padding rows sit at position 0 of page 0: context 1, so they read one
        # key (DeepGEMM's paged logits faulted on a step whose every row had
        # context 0, H100 2026-11-22) and write none (slot -1).
        host[2 * B * w: 2 * B * w + R * w] = slots
        host[2 * B * w + R * w: 2 * B * w + n] = -1
        host[3 * B * w: 3 * B * w + R] = seq_lens
        host[3 * B * w + R: 3 * B * w + bucket] = 1
        host[3 * B * w + B: 3 * B * w + B + bucket] = w
        bt = torch.zeros(bucket, self.plan.max_pages, dtype=torch.int32)
        bt[:R, : page_tables.shape[1]] = page_tables
        self.packed.copy_(host)
        self.page_tables[:bucket].copy_(bt)


class DecodeGraphs:
    """Runs the target model's DECODE forwards of one width through static
    buffers, as captured CUDA graphs (``capture=True``) or eagerly."""

    def __init__(self, model, cache, backend, plan: DecodeGraphPlan, device: str | torch.device,
                 capture: bool):
        self.model, self.cache, self.backend, self.plan = model, cache, backend, plan
        self.device = torch.device(device)
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.capture = capture
        self.inputs = _StaticInputs(plan, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def covers(self, num_requests: int, max_pages: int, width: int) -> bool:
        """Whether a step of ``num_requests`` requests of ``width`` new tokens,
        none with more than ``max_pages`` pages, runs here."""
        return (width == self.plan.width and max_pages <= self.plan.max_pages
                and self.plan.bucket(num_requests) is not None)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool.

        Every bucket first runs eagerly on all-padding inputs (which writes
        nothing into the cache): that compiles the Triton and DeepGEMM kernels
        and makes FlashMLA's scheduling metadata outside the graph.
        """
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        empty = torch.zeros(0, dtype=torch.int64)
        stream = torch.cuda.Stream(self.device)
        for bucket in sorted(self.plan.batch_sizes, reverse=True):
            self.inputs.fill(bucket, empty, empty, empty, empty, torch.zeros(0, 1, dtype=torch.int32))
            batch = self.inputs.batch(bucket)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(batch, self.cache, self.backend)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model(batch, self.cache, self.backend)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, page_tables: torch.Tensor) -> torch.Tensor:
        """One decode step of ``R`` requests (host tensors as in ``_StaticInputs.fill``).

        Returns normed hidden ``[R * width, hidden]``: a view of the graph's
        output buffer, valid until the next step of this plan (clone to keep).
        """
        R = seq_lens.shape[0]
        bucket = self.plan.bucket(R)
        if bucket is None or page_tables.shape[1] > self.plan.max_pages:
            raise ValueError(f"a decode step of {R} requests x {page_tables.shape[1]} pages is outside this plan "
                             f"({self.plan.max_batch_size} requests x {self.plan.max_pages} pages)")
        self.inputs.fill(bucket, tokens, positions, slots, seq_lens, page_tables)
        if self.capture:
            if bucket not in self.graphs:
                raise RuntimeError("capture_all() must run before the first replay")
            self.graphs[bucket].replay()
            self.replays += 1
            hidden = self.outputs[bucket]
        else:
            hidden = self.model(self.inputs.batch(bucket), self.cache, self.backend)
        return hidden[: R * self.plan.width]
