"""Turns scheduled work into ``ForwardBatch`` es and runs the model on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.cache import PagedKVCache
from attention.formats import PAGE_SIZE
from models.batch import ForwardBatch, ForwardMode, slots_for_positions
from models.model import DsaForCausalLM
from workers.decode_graphs import DecodeGraphPlan, DecodeGraphs, patch_tokens
from workers.host_copy import to_device
from workers.page_tables import frozen_pages
from workers.prefill_graphs import PrefillGraphPlan, PrefillGraphs


@dataclass(frozen=True)
class WorkItem:
    """New tokens of one request for one forward.

    token_ids: the new tokens, at positions ``start .. start + len - 1``
    page_table: the request's page ids (covers at least ``start + len`` tokens); a grouped cache's
    (DeepSeek-V4): group name -> page ids (`workers.page_tables.PageTable.frozen`)
    """

    token_ids: tuple[int, ...]
    start: int
    page_table: tuple[int, ...] | dict[str, tuple[int, ...]]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class HostBatch:
    """A forward's metadata on the host, before it moves to the device.

    token_ids, positions, out_slots: int64 ``[T]``; seq_lens, q_lens: int64
    ``[R]``; page_tables: int32 ``[R, max_pages]`` (unused entries 0).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    seq_lens: torch.Tensor
    q_lens: torch.Tensor
    page_tables: torch.Tensor


def host_batch(items: list[WorkItem]) -> HostBatch:
    """Lay out ``items`` (requests in order) as :class:`HostBatch` tensors."""
    if not items:
        raise ValueError("a forward needs at least one request")
    max_pages = max(len(it.page_table) for it in items)
    page_tables = torch.zeros(len(items), max_pages, dtype=torch.int32)
    for r, it in enumerate(items):
        if it.end > len(it.page_table) * PAGE_SIZE:
            raise ValueError(f"{it.end} tokens do not fit in {len(it.page_table)} pages")
        page_tables[r, : len(it.page_table)] = torch.tensor(it.page_table, dtype=torch.int32)
    positions = torch.cat([torch.arange(it.start, it.end) for it in items])
    q_lens = torch.tensor([len(it.token_ids) for it in items])
    req = torch.repeat_interleave(torch.arange(len(items)), q_lens)
    out_slots = torch.cat([
        slots_for_positions(page_tables[r], positions[req == r]) for r in range(len(items))
    ])
    return HostBatch(
        token_ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long),
        positions=positions, out_slots=out_slots,
        seq_lens=torch.tensor([it.end for it in items]), q_lens=q_lens, page_tables=page_tables,
    )


TokenPatch = tuple[list[int], torch.Tensor]
"""Input tokens of a decode step that are on the device: (request indices in the
step, int64 ``[m]`` or ``[m, j]``: the last ``j`` of those requests' ``width`` new
tokens; a width-1 step fed the tokens in flight (overlap scheduling), or an MTP
verify fed its ``k`` drafts)."""


@dataclass(frozen=True)
class DecodeStep:
    """The requests of one DECODE forward, as the persistent decode batch takes them.

    keys:        stable request ids (a request keeps its row between steps)
    tokens:      the ``R * width`` new tokens, request by request
    seq_lens:    each request's context length after the step
    page_tables: each request's page ids (its own list: not copied per step)
    width:       new tokens per request (1, or ``k + 1`` when verifying k drafts)
    """

    keys: list[str]
    tokens: list[int]
    seq_lens: list[int]
    page_tables: list[list[int]]
    width: int

    def __post_init__(self) -> None:
        R = len(self.keys)
        if not R or len(self.tokens) != R * self.width or len(self.seq_lens) != R or len(self.page_tables) != R:
            raise ValueError(f"a decode step of {R} requests x width {self.width} needs {R * self.width} tokens and "
                             f"{R} context lengths and page tables, got {len(self.tokens)}, {len(self.seq_lens)} "
                             f"and {len(self.page_tables)}")

    def items(self) -> list[WorkItem]:
        """The same step as `WorkItem` s (the eager path)."""
        w = self.width
        return [WorkItem(tuple(self.tokens[i * w:(i + 1) * w]), self.seq_lens[i] - w, frozen_pages(self.page_tables[i]))
                for i in range(len(self.keys))]


def decode_width(items: list[WorkItem]) -> int:
    """New tokens per request of a DECODE step (equal for all; checked on the host)."""
    widths = {len(it.token_ids) for it in items}
    if len(widths) != 1:
        raise ValueError(f"a DECODE batch needs the same number of new tokens per request, got {sorted(widths)}")
    return widths.pop()


class ModelRunner:
    supports_overlap = True
    """Decode steps may be launched before the previous one is read back (`workers.engine.Engine.step`)."""

    def __init__(self, model: DsaForCausalLM, cache: PagedKVCache, backend, device: str | torch.device):
        self.model, self.cache, self.backend = model, cache, backend
        self.device = torch.device(device)
        # width -> DecodeGraphs: decode steps of that width run through static
        # buffers / CUDA graphs when they fit (see enable_decode_graphs).
        self.decode_graphs: dict[int, DecodeGraphs] = {}
        # Small prefills through static buffers / CUDA graphs (enable_prefill_graphs).
        self.prefill_graphs: PrefillGraphs | None = None
        # One memory pool for every graph of this runner's target model: they replay one at a time, in
        # stream order, so each may reuse what the others' intermediates used (`capture_forwards`).
        self._graph_pool = None

    def graph_pool(self):
        """The runner's CUDA-graph memory pool (made on first use)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def enable_decode_graphs(self, widths: tuple[int, ...], max_batch_size: int, max_context: int,
                             capture: bool) -> None:
        """Run DECODE steps of each width in ``widths`` through per-bucket static
        buffers (``workers.decode_graphs``), captured as CUDA graphs when
        ``capture``. Steps with more requests than ``max_batch_size`` or a
        context beyond ``max_context`` tokens run eagerly."""
        for w in widths:
            plan = DecodeGraphPlan.for_limits(w, max_batch_size, max_context,
                                              self.backend.decode_logits_widths(max_context))
            graphs = DecodeGraphs(self.model, self.cache, self.backend, plan, self.device, capture)
            graphs.capture_all(self.graph_pool() if capture else None)
            self.decode_graphs[w] = graphs

    def enable_prefill_graphs(self, max_tokens: int, capture: bool, max_context: int = 0) -> None:
        """Run PREFILL forwards of one prompt through per-bucket static buffers (``workers.prefill_graphs``),
        captured as CUDA graphs when ``capture``: a new prompt of at most ``max_tokens`` tokens, and with
        ``max_context`` > 0 the new tokens of several requests over cached prefixes (at most
        `workers.prefill_graphs.row_cap` in all, contexts up to ``max_context``); every other prefill runs
        eagerly.
        ``max_tokens`` 0: none."""
        self.prefill_graphs = None
        if max_tokens < 1:
            return
        graphs = PrefillGraphs(self.model, self.cache, self.backend,
                               PrefillGraphPlan.for_limits(max_tokens, max_context), self.device, capture)
        graphs.capture_all(self.graph_pool() if capture else None)
        self.prefill_graphs = graphs

    def build_batch(self, mode: ForwardMode, items: list[WorkItem]) -> ForwardBatch:
        if mode is ForwardMode.DECODE:
            decode_width(items)
        hb = host_batch(items)
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=to_device(hb.token_ids, dev),
            positions=to_device(hb.positions, dev),
            out_slots=to_device(hb.out_slots, dev),
            page_tables=to_device(hb.page_tables, dev),
            seq_lens=to_device(hb.seq_lens, dev),
            q_lens=to_device(hb.q_lens, dev),
            max_seq_len=max(it.end for it in items),
            seq_lens_host=tuple(it.end for it in items),
            q_lens_host=tuple(len(it.token_ids) for it in items),
        )

    @torch.inference_mode()
    def forward(self, mode: ForwardMode, items: list[WorkItem]) -> tuple[ForwardBatch, torch.Tensor]:
        """Run the target model; returns the batch and normed hidden ``[T, hidden]``. A prefill the
        prefill graphs cover replays one (its hidden states are then a view valid until this runner's
        next forward: clone what must outlive the step); everything else runs eagerly."""
        graphs = self.prefill_graphs
        if mode is ForwardMode.PREFILL and graphs is not None and graphs.covers(items):
            return graphs.run(items)
        batch = self.build_batch(mode, items)
        return batch, self.model(batch, self.cache, self.backend)

    @torch.inference_mode()
    def decode(self, step: DecodeStep, token_patch: TokenPatch | None = None) -> torch.Tensor:
        """One DECODE step of the target model: normed hidden ``[R * width, hidden]``.

        Through the persistent inputs and CUDA graph of the step's width when
        it fits (the result may be a view valid until the next step: clone
        what must outlive it), else eagerly. ``token_patch``: input tokens
        that are still on the device (a step launched before the previous
        one was read back); they replace the host's placeholders.
        """
        graphs = self.decode_graphs.get(step.width)
        if graphs is not None and graphs.covers(len(step.keys), max(len(t) for t in step.page_tables), step.width):
            return graphs.run(step.keys, step.tokens, step.seq_lens, step.page_tables, token_patch)
        batch = self.build_batch(ForwardMode.DECODE, step.items())
        if token_patch is not None:
            at, values = token_patch
            at = to_device(torch.tensor(at, dtype=torch.int64), self.device)
            patch_tokens(batch.input_ids, step.width, at, values)
        return self.model(batch, self.cache, self.backend)
