"""Decode steps through static per-bucket buffers, replayed as CUDA graphs.

A decode step's shapes depend only on the number of requests ``B`` and the
new tokens per request ``width`` (1 for plain decode, ``k + 1`` for MTP
verification). So each bucket ``B_b`` of a :class:`DecodeGraphPlan` gets one
captured CUDA graph of the whole target-model forward, reading its inputs from
device buffers that persist between steps (:class:`DecodeInputs`):

* each running request owns a row; per step the host writes one packed int64
  block (the rows' new tokens, context lengths and live flags) and only the
  page-table rows that changed;
* everything derived per step -- positions and cache slots, the indexer's
  context lengths, DeepGEMM's paged-logits schedule
  (``get_paged_mqa_logits_metadata`` runs inside the graph on the context
  lengths), the top-k selection and the FlashMLA indices -- is computed by
  kernels inside the graph from those buffers, so nothing is rebuilt on the
  host. FlashMLA's sparse-decode scheduling metadata depends only on the
  shapes and top-k width: it is made by the warm-up run before capture and
  stays fixed for the graph's life.

Rows past the live requests are padding: position 0 of page 0 (context 1:
they read one key and attend to it, harmlessly), cache slot ``-1`` (the
cache writes skip it; their live flag is rewritten on every step, so a row that held a
request in the previous replay can never write into that request's pages).

The forward runs with ``ForwardBatch.static_shapes`` (the MoE uses its masked
fixed-shape layout, ``models/moe/dispatch.py``, instead of sorting tokens on the host) and with
``max_seq_len`` = the indexer's logits width, so nothing reads a tensor value back to the host.
A bucket has a graph per logits width the backend asks for (`DecodeGraphPlan.logits_pages`: the
cuda backend's top-k kernels differ below and above 8,192 logits), and a step replays the narrowest
that holds its longest context. ``capture=False`` runs the very same
code eagerly on the same buffers: on CPU (tests) and as the reference the
replayed graphs are checked against, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.formats import PAGE_SIZE, pages_for_tokens
from models.batch import ForwardBatch, ForwardMode, slots_for_positions
from workers.host_copy import to_device


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Buckets for up to ``max_batch_size`` requests: 1, 2, 4, 8, then every 16,
    and ``max_batch_size`` itself (a step pads to the smallest bucket that fits)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def graphs_wanted(setting: bool | None, backend: str, device: str | torch.device, tp_size: int = 1,
                  mtp: bool = False, cache_groups: bool = False) -> bool:
    """Whether decode steps are captured: ``setting`` when given (True on a
    non-CUDA device is an error), else on for the cuda backend on a GPU (the
    reference backend reads values back to the host and cannot be captured).
    With ``tp_size > 1`` every rank captures its own graphs (`workers.rank_group`),
    except with MTP (``mtp``: the drafts are made between the ranks' forwards;
    True is then an error). ``cache_groups``: a DeepSeek-V4 model (`workers.v4_runner`
    is eager: off by default, True an error)."""
    if cache_groups:
        if setting:
            raise ValueError("cuda_graphs are not built for DeepSeek-V4 (its runner is eager)")
        return False
    if tp_size > 1 and mtp:
        if setting:
            raise ValueError("cuda_graphs with tp_size > 1 and MTP drafts are not built yet")
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


def patch_tokens(tokens: torch.Tensor, width: int, at: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (`workers.model_runner.TokenPatch`) into int64 ``tokens`` ``[R * width]`` in place:
    the last ``j`` tokens of each request ``at`` (int64 ``[m]`` on ``tokens``' device)."""
    values = values.to(tokens.device, torch.int64)
    if values.dim() == 1:
        values = values[:, None]
    j = values.shape[1]
    if not 1 <= j <= width or values.shape[0] != at.shape[0]:
        raise ValueError(f"a token patch of shape {tuple(values.shape)} for {at.shape[0]} requests of width {width}")
    tokens.view(-1, width)[:, width - j:].index_copy_(0, at, values)


@dataclass(frozen=True)
class DecodeGraphPlan:
    """Which decode steps have a graph.

    width:        new tokens per request (1, or ``k + 1`` when verifying k drafts)
    batch_sizes:  ascending bucket sizes
    max_pages:    page-table width per request; a request with more pages (a
                  context beyond ``max_pages * 64`` tokens) runs eagerly
    logits_pages: ascending indexer-logits widths in pages, the last ``max_pages`` (empty: that one alone);
                  every bucket has a graph of each, and a step takes the narrowest holding its longest context
    """

    width: int
    batch_sizes: tuple[int, ...]
    max_pages: int
    logits_pages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.width < 1 or self.max_pages < 1:
            raise ValueError(f"width and max_pages must be >= 1, got {self.width} and {self.max_pages}")
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be ascending distinct positive ints, got {self.batch_sizes}")
        if not self.logits_pages:
            object.__setattr__(self, "logits_pages", (self.max_pages,))
        w = self.logits_pages
        if list(w) != sorted(set(w)) or w[0] < 1 or w[-1] != self.max_pages:
            raise ValueError(f"logits_pages must be ascending distinct positive ints ending at max_pages "
                             f"({self.max_pages}), got {w}")

    @classmethod
    def for_limits(cls, width: int, max_batch_size: int, max_context: int,
                   logits_widths: tuple[int, ...] = ()) -> "DecodeGraphPlan":
        """The plan of an engine serving up to ``max_batch_size`` requests with contexts up to
        ``max_context`` tokens (`graph_batch_sizes` buckets); ``logits_widths``: the backend's
        (`attention.backend.AttentionBackend.decode_logits_widths`), in tokens."""
        max_pages = pages_for_tokens(max_context)
        pages = sorted({pages_for_tokens(w) for w in logits_widths if 0 < w < max_context} | {max_pages})
        return cls(width, graph_batch_sizes(max_batch_size), max_pages, tuple(pages))

    def keys(self) -> list[tuple[int, int]]:
        """Every graph's ``(bucket, logits pages)``."""
        return [(b, p) for b in self.batch_sizes for p in self.logits_pages]

    def logits_width(self, max_seq_len: int) -> int:
        """The narrowest logits width (pages) holding a context of ``max_seq_len`` tokens (it must fit
        ``max_pages``)."""
        for p in self.logits_pages:
            if p * PAGE_SIZE >= max_seq_len:
                return p
        raise ValueError(f"a context of {max_seq_len} tokens is beyond this plan's {self.max_context}")

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

    def covers(self, num_requests: int, max_pages: int, width: int) -> bool:
        """Whether a step of ``num_requests`` requests of ``width`` new tokens,
        none with more than ``max_pages`` pages, has a graph here."""
        return width == self.width and max_pages <= self.max_pages and self.bucket(num_requests) is not None


class DecodeInputs:
    """The decode batch's inputs, kept on the device between steps and read by
    one plan's graphs (sized for its largest bucket ``B``).

    Each running request owns a row while it decodes (`assign`); rows are kept
    compact (``0 .. R-1``; a leaving request's row is taken over by the last
    one). Per step the host sends one packed int64 block -- each row's new
    tokens, context length and a live flag -- and the page-table rows that
    changed (a request joined, moved or reached a new page); positions and
    cache slots are computed from those on the device, inside the graph. So
    the host's work per step grows with the batch only by a list of ints,
    not by page tables or per-row tensors.

    Device buffers: ``packed`` int64 ``[B * width + 2 * B]`` (tokens, seq_lens,
    live), ``page_tables`` int32 ``[B, max_pages]``; ``q_lens`` int64 ``[B]``
    (constant ``width``).
    """

    def __init__(self, plan: DecodeGraphPlan, device: torch.device):
        B, w = plan.max_batch_size, plan.width
        self.plan, self.device = plan, device
        self.packed = torch.zeros(B * w + 2 * B, dtype=torch.int64, device=device)
        self.packed[B * w: B * w + B] = 1  # padding rows: context 1 (see `batch`)
        self.page_tables = torch.zeros(B, plan.max_pages, dtype=torch.int32, device=device)
        self.q_lens = torch.full((B,), w, dtype=torch.int64, device=device)
        self._offsets = torch.arange(w, dtype=torch.int64, device=device)
        self._row_ids = torch.arange(B, dtype=torch.int64, device=device)[:, None].expand(B, w)
        # Host mirror of the page tables and of who owns which row.
        self._host_tables = torch.zeros(B, plan.max_pages, dtype=torch.int32)
        self._keys: list[str] = []            # row -> request key
        self._row: dict[str, int] = {}        # request key -> row
        self._written: list[int] = []         # row -> page ids written so far
        # row -> the request's page list object: a request that lost its pages
        # (preempted) and got new ones has a new list, so its row is rewritten.
        self._lists: list[list[int]] = []

    @property
    def num_rows(self) -> int:
        return len(self._keys)

    def assign(self, keys: list[str], page_tables: list[list[int]]) -> list[int]:
        """Rows for the requests ``keys`` (in order), with their current page
        tables (the requests' own lists: only pages beyond those already
        written are read). Rows of keys not in ``keys`` are released. Returns
        each key's row."""
        if len(keys) > self.plan.max_batch_size:
            raise ValueError(f"{len(keys)} requests exceed this plan's {self.plan.max_batch_size} rows")
        wanted = set(keys)
        if len(wanted) != len(keys):
            raise ValueError("duplicate request keys in one decode step")
        dirty: set[int] = set()
        for key in [k for k in self._keys if k not in wanted]:
            self._release(key, dirty)
        for key, table in zip(keys, page_tables):
            if len(table) > self.plan.max_pages:
                raise ValueError(f"request {key!r} has {len(table)} pages, beyond this plan's {self.plan.max_pages}")
            row = self._row.get(key)
            if row is None:
                row = len(self._keys)
                self._keys.append(key)
                self._row[key] = row
                self._written.append(0)
                self._lists.append(table)
                self._host_tables[row].zero_()
            done = self._written[row]
            if table is not self._lists[row]:
                self._lists[row], done = table, -1
            if len(table) != done:
                if len(table) < done or done < 0:
                    self._host_tables[row].zero_()
                    done = 0
                self._host_tables[row, done:len(table)] = torch.tensor(table[done:], dtype=torch.int32)
                self._written[row] = len(table)
                dirty.add(row)
        if dirty:
            rows = torch.tensor(sorted(dirty), dtype=torch.int64)
            self.page_tables[to_device(rows, self.device)] = to_device(self._host_tables[rows], self.device)
        return [self._row[k] for k in keys]

    def _release(self, key: str, dirty: set[int]) -> None:
        row = self._row.pop(key)
        last = len(self._keys) - 1
        if row != last:  # the last row moves into the hole: rows stay compact
            moved = self._keys[last]
            self._keys[row], self._row[moved], self._written[row] = moved, row, self._written[last]
            self._lists[row] = self._lists[last]
            self._host_tables[row] = self._host_tables[last]
            dirty.add(row)
        self._keys.pop()
        self._written.pop()
        self._lists.pop()
        self._host_tables[last].zero_()
        dirty.add(last)

    def clear(self) -> None:
        """Release every row (page-table rows back to zeros)."""
        dirty: set[int] = set()
        for key in list(self._keys):
            self._release(key, dirty)
        if dirty:
            rows = torch.tensor(sorted(dirty), dtype=torch.int64)
            self.page_tables[to_device(rows, self.device)] = to_device(self._host_tables[rows], self.device)

    def write_step(self, rows: list[int], tokens: list[int], seq_lens: list[int]) -> None:
        """This step's new tokens (``len(rows) * width`` ints, by request) and
        context lengths (after the step) of the requests in ``rows``; every
        other row is padding. One host-to-device copy."""
        B, w = self.plan.max_batch_size, self.plan.width
        tok = [0] * (B * w)
        lens = [1] * B
        live = [0] * B
        for i, row in enumerate(rows):
            tok[row * w:(row + 1) * w] = tokens[i * w:(i + 1) * w]
            lens[row] = seq_lens[i]
            live[row] = 1
        self.packed.copy_(to_device(torch.tensor(tok + lens + live, dtype=torch.int64), self.device))

    def patch_tokens(self, rows: list[int], values: torch.Tensor) -> None:
        """Set the last ``j`` new tokens of ``rows`` from int64 device ``values`` ``[len(rows)]``
        (``j`` = 1) or ``[len(rows), j]`` (an MTP verify's drafts: `workers.model_runner.TokenPatch`)."""
        B, w = self.plan.max_batch_size, self.plan.width
        index = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        patch_tokens(self.packed[: B * w], w, index, values)

    def batch(self, bucket: int, logits_pages: int | None = None) -> ForwardBatch:
        """The forward over rows ``0 .. bucket-1``, its indexer logits ``logits_pages`` pages wide (default
        ``max_pages``: every context the rows may hold must fit). Positions and cache slots are
        computed here from the buffers, so under capture they are part of the
        graph. Padding rows sit at position 0 of page 0 with context 1: they
        read one key (DeepGEMM's paged logits faulted on a step whose every row
        had context 0, H100 2026-11-22) and write none (slot -1)."""
        B, w = self.plan.max_batch_size, self.plan.width
        p = self.packed
        seq_lens = p[B * w: B * w + bucket]
        live = p[B * w + B: B * w + B + bucket]
        positions = (seq_lens[:, None] - w + self._offsets).clamp_min(0)          # [bucket, w]
        page_tables = self.page_tables[:bucket]
        slots = torch.where(live[:, None] > 0, slots_for_positions(page_tables, positions, self._row_ids[:bucket]), -1)
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=p[: bucket * w], positions=positions.reshape(-1),
            out_slots=slots.reshape(-1), page_tables=page_tables, seq_lens=seq_lens,
            q_lens=self.q_lens[:bucket], max_seq_len=(logits_pages or self.plan.max_pages) * PAGE_SIZE,
            static_shapes=True,
        )


def capture_forwards(model, cache, backend, device: torch.device, buckets, make_batch, pool=None
                     ) -> dict[int, tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]]:
    """One captured target-model forward per bucket (any sortable key: a decode graph's is ``(bucket, logits
    pages)``), largest first, sharing one memory pool (``pool``, a
    `torch.cuda.graph_pool_handle`; default a new one): ``{bucket: (graph, its batch, its output)}``.
    ``make_batch(bucket)`` builds the forward's batch from static buffers that currently hold
    all-padding inputs (nothing is written to the cache).

    Graphs of one pool must replay one at a time, in stream order (one engine's forwards do): each
    reuses the memory the others' intermediates had, never their outputs, which stay referenced.

    Each bucket first runs twice eagerly on a side stream: that compiles the Triton and DeepGEMM
    kernels of its shapes and makes FlashMLA's scheduling metadata outside the capture. The batch
    is rebuilt inside the capture, so what it derives from the buffers (positions, slots) is part
    of the graph."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    stream = torch.cuda.Stream(device)
    out = {}
    for bucket in sorted(buckets, reverse=True):
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(make_batch(bucket), cache, backend)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            batch = make_batch(bucket)
            hidden = model(batch, cache, backend)
        out[bucket] = (graph, batch, hidden)
    torch.cuda.synchronize(device)
    return out


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
        self.inputs = DecodeInputs(plan, self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bucket, logits pages) -> graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0
        self.width_steps: dict[int, int] = {}  # logits pages -> steps run at that width (tests, diagnostics)

    def covers(self, num_requests: int, max_pages: int, width: int) -> bool:
        """Whether a step runs here (`DecodeGraphPlan.covers`)."""
        return self.plan.covers(num_requests, max_pages, width)

    @torch.inference_mode()
    def capture_all(self, pool=None) -> None:
        """Capture one graph per bucket and logits width (`capture_forwards`, in ``pool`` when given) on
        all-padding inputs."""
        if not self.capture:
            return
        self.inputs.clear()
        self.inputs.write_step([], [], [])
        captured = capture_forwards(self.model, self.cache, self.backend, self.device, self.plan.keys(),
                                    lambda key: self.inputs.batch(*key), pool)
        for key, (graph, _, hidden) in captured.items():
            self.graphs[key], self.outputs[key] = graph, hidden

    @torch.inference_mode()
    def run(self, keys: list[str], tokens: list[int], seq_lens: list[int],
            page_tables: list[list[int]], token_patch: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step of ``R`` requests, in the order of ``keys`` (their
        stable ids): ``tokens`` the ``R * width`` new tokens by request,
        ``seq_lens`` each context length after the step, ``page_tables`` each
        request's page ids (its live list: only new pages are copied).
        ``token_patch``: (request indices, int64 device tokens) replacing those
        requests' last tokens (`workers.model_runner.TokenPatch`: the tokens in
        flight of a width-1 step, an MTP verify's drafts).

        Returns normed hidden ``[R * width, hidden]`` in ``keys`` order: a
        view of the graph's output buffer when the rows are in that order
        (valid until the runner's next forward: its graphs share one memory pool; clone to keep), else a
        gather.
        """
        R = len(keys)
        bucket = self.plan.bucket(R)
        max_pages = max((len(t) for t in page_tables), default=0)
        if bucket is None or max_pages > self.plan.max_pages:
            raise ValueError(f"a decode step of {R} requests x {max_pages} pages is outside this plan "
                             f"({self.plan.max_batch_size} requests x {self.plan.max_pages} pages)")
        rows = self.inputs.assign(keys, page_tables)
        self.inputs.write_step(rows, tokens, seq_lens)
        if token_patch is not None:
            self.inputs.patch_tokens([rows[i] for i in token_patch[0]], token_patch[1])
        key = (bucket, self.plan.logits_width(max(seq_lens, default=1)))
        self.width_steps[key[1]] = self.width_steps.get(key[1], 0) + 1
        if self.capture:
            if key not in self.graphs:
                raise RuntimeError("capture_all() must run before the first replay")
            self.graphs[key].replay()
            self.replays += 1
            hidden = self.outputs[key]
        else:
            hidden = self.model(self.inputs.batch(*key), self.cache, self.backend)
        w = self.plan.width
        if rows == list(range(R)):
            return hidden[: R * w]
        index = torch.tensor([row * w + j for row in rows for j in range(w)], dtype=torch.int64)
        return hidden.index_select(0, to_device(index, hidden.device))
