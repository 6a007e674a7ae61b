"""Turns scheduled work into ``ForwardBatch`` es and runs the model on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.cache import PagedKVCache
from attention.formats import PAGE_SIZE, pages_for_tokens
from models.batch import ForwardBatch, ForwardMode, slots_for_positions
from models.model import DsaForCausalLM
from workers.decode_graphs import DecodeGraphPlan, DecodeGraphs, graph_batch_sizes


@dataclass(frozen=True)
class WorkItem:
    """New tokens of one request for one forward.

    token_ids: the new tokens, at positions ``start .. start + len - 1``
    page_table: the request's page ids (covers at least ``start + len`` tokens)
    """

    token_ids: tuple[int, ...]
    start: int
    page_table: tuple[int, ...]

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


def decode_width(items: list[WorkItem]) -> int:
    """New tokens per request of a DECODE step (equal for all; checked on the host)."""
    widths = {len(it.token_ids) for it in items}
    if len(widths) != 1:
        raise ValueError(f"a DECODE batch needs the same number of new tokens per request, got {sorted(widths)}")
    return widths.pop()


class ModelRunner:
    def __init__(self, model: DsaForCausalLM, cache: PagedKVCache, backend, device: str | torch.device):
        self.model, self.cache, self.backend = model, cache, backend
        self.device = torch.device(device)
        # width -> DecodeGraphs: decode steps of that width run through static
        # buffers / CUDA graphs when they fit (see enable_decode_graphs).
        self.decode_graphs: dict[int, DecodeGraphs] = {}

    def enable_decode_graphs(self, widths: tuple[int, ...], max_batch_size: int, max_context: int,
                             capture: bool) -> None:
        """Run DECODE steps of each width in ``widths`` through per-bucket static
        buffers (``workers.decode_graphs``), captured as CUDA graphs when
        ``capture``. Steps with more requests than ``max_batch_size`` or a
        context beyond ``max_context`` tokens run eagerly."""
        for w in widths:
            plan = DecodeGraphPlan(w, graph_batch_sizes(max_batch_size), pages_for_tokens(max_context))
            graphs = DecodeGraphs(self.model, self.cache, self.backend, plan, self.device, capture)
            graphs.capture_all()
            self.decode_graphs[w] = graphs

    def build_batch(self, mode: ForwardMode, items: list[WorkItem]) -> ForwardBatch:
        if mode is ForwardMode.DECODE:
            decode_width(items)
        hb = host_batch(items)
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=hb.token_ids.to(dev),
            positions=hb.positions.to(dev),
            out_slots=hb.out_slots.to(dev),
            page_tables=hb.page_tables.to(dev),
            seq_lens=hb.seq_lens.to(dev),
            q_lens=hb.q_lens.to(dev),
            max_seq_len=max(it.end for it in items),
        )

    @torch.inference_mode()
    def forward(self, mode: ForwardMode, items: list[WorkItem]) -> tuple[ForwardBatch, torch.Tensor]:
        """Run the target model eagerly; returns the batch and normed hidden ``[T, hidden]``."""
        batch = self.build_batch(mode, items)
        return batch, self.model(batch, self.cache, self.backend)

    @torch.inference_mode()
    def decode(self, items: list[WorkItem]) -> torch.Tensor:
        """One DECODE step of the target model: normed hidden ``[R * width, hidden]``.

        Through the static buffers / CUDA graph of the step's width when it
        fits (the result is then a view valid until the next step: clone what
        must outlive it), else eagerly.
        """
        width = decode_width(items)
        graphs = self.decode_graphs.get(width)
        max_pages = max(len(it.page_table) for it in items)
        if graphs is not None and graphs.covers(len(items), max_pages, width):
            hb = host_batch(items)
            return graphs.run(hb.token_ids, hb.positions, hb.out_slots, hb.seq_lens, hb.page_tables)
        return self.forward(ForwardMode.DECODE, items)[1]
