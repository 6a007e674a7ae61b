"""Turns scheduled work into ``ForwardBatch`` es and runs the model on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.cache import CacheSpec, PagedKVCache
from attention.formats import PAGE_SIZE
from models.batch import ForwardBatch, ForwardMode, slots_for_positions
from models.model import DsaForCausalLM


@dataclass(frozen=True)
class WorkItem:
    """New tokens of one request for one forward.

    token_ids: the new tokens, at positions ``start .. start + len - 1``
    pages:     the request's page table (covers at least ``start + len`` tokens)
    """

    token_ids: tuple[int, ...]
    start: int
    pages: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def cache_spec_for(model: DsaForCausalLM, num_pages: int, kv_cache_dtype: str) -> CacheSpec:
    """The cache geometry a model needs: one MLA cache per attention layer
    (MTP included) and an indexer cache on the layers that compute top-k."""
    cfg = model.cfg
    computes = list(cfg.topk_plan.computes[: cfg.num_hidden_layers]) + [True] * len(model.mtp)
    return CacheSpec(
        num_layers=model.num_cache_layers,
        num_pages=num_pages,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        index_head_dim=cfg.index_head_dim,
        kv_cache_dtype=kv_cache_dtype,
        dtype=model.dtype,
        indexer_layers=tuple(computes),
    )


class ModelRunner:
    def __init__(self, model: DsaForCausalLM, cache: PagedKVCache, backend, device: str | torch.device):
        self.model, self.cache, self.backend = model, cache, backend
        self.device = torch.device(device)

    def build_batch(self, mode: ForwardMode, items: list[WorkItem]) -> ForwardBatch:
        max_pages = max(len(it.pages) for it in items)
        tables = torch.zeros(len(items), max_pages, dtype=torch.int32)
        for r, it in enumerate(items):
            if it.end > len(it.pages) * PAGE_SIZE:
                raise ValueError(f"{it.end} tokens do not fit in {len(it.pages)} pages")
            tables[r, : len(it.pages)] = torch.tensor(it.pages, dtype=torch.int32)
        positions = torch.cat([torch.arange(it.start, it.end) for it in items])
        q_lens = torch.tensor([len(it.token_ids) for it in items])
        req = torch.repeat_interleave(torch.arange(len(items)), q_lens)
        out_slots = torch.cat([
            slots_for_positions(tables[r], positions[req == r]) for r in range(len(items))
        ])
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long, device=dev),
            positions=positions.to(dev),
            out_slots=out_slots.to(dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor([it.end for it in items], device=dev),
            q_lens=q_lens.to(dev),
        )

    @torch.inference_mode()
    def forward(self, mode: ForwardMode, items: list[WorkItem]) -> tuple[ForwardBatch, torch.Tensor]:
        """Run the target model; returns the batch and normed hidden ``[T, hidden]``."""
        batch = self.build_batch(mode, items)
        return batch, self.model(batch, self.cache, self.backend)

    @torch.inference_mode()
    def last_token_logits(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, vocab]`` logits of each request's last new token."""
        last = torch.cumsum(batch.q_lens, 0) - 1
        return self.model.logits(hidden[last])
