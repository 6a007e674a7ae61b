"""The model runner of DeepSeek-V4 (reference backend): forwards over paged cache groups.

Same calls as ``workers.model_runner.ModelRunner`` (``forward``, ``decode``,
``build_batch``), so the engine, the prefill worker and the offline ``LLM``
drive it unchanged. A work item's page table is the request's pages per group
(`workers.page_tables.PageTable.frozen`). Per forward, each request's
``SequenceState`` is rebuilt from its pages (``models.v4.paged_state``), the
batch runs through ``models.v4``'s model (per-sequence attention, batched
projections and MoE), and what it added goes back into the pages: nothing of
a request lives in the runner between forwards.

Prefix caching (`workers.v4_prefix`): a table with cut state pages (more than
one page in a CSA state group) gets the state at every cut a forward crosses
written into the page for it (``paged_state.store_cut_states``).

Not here yet: CUDA graphs and overlap scheduling (tokens come from the host
each step), the MTP layer, the cuda backend's sparse kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.group_cache import GroupedPagedCache
from models.batch import ForwardMode
from models.v4.cache_spec import cut_state_groups
from models.v4.model import DeepseekV4ForCausalLM
from models.v4.paged_state import load_state, record_fed, store_cut_states, store_state
from workers.model_runner import DecodeStep, TokenPatch, WorkItem, decode_width
from workers.v4_prefix import cut_tokens


@dataclass(frozen=True)
class V4Batch:
    """What the engine reads of a forward's batch: its token count and each request's token range."""

    mode: ForwardMode
    q_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def query_ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.q_lens:
            out.append((start, start + n))
            start += n
        return out


class V4ModelRunner:
    supports_overlap = False
    """Each step's input tokens come from the host (no device-side token patch yet)."""

    def __init__(self, model: DeepseekV4ForCausalLM, cache: GroupedPagedCache, device: str | torch.device):
        if cache.device != torch.device(device):
            raise ValueError(f"the cache is on {cache.device}, the runner on {device}")
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.backend = None
        self.decode_graphs: dict = {}
        self.cut = cut_tokens(cache.groups)
        self.cut_groups = cut_state_groups(model.cfg)

    def enable_decode_graphs(self, *args, **kwargs) -> None:
        raise ValueError("CUDA graphs are not built for DeepSeek-V4 (its runner is eager, reference backend)")

    def build_batch(self, mode: ForwardMode, items: list[WorkItem]) -> V4Batch:
        if mode is ForwardMode.DECODE:
            decode_width(items)
        if not items:
            raise ValueError("a forward needs at least one request")
        return V4Batch(mode, tuple(len(it.token_ids) for it in items))

    @torch.inference_mode()
    def forward(self, mode: ForwardMode, items: list[WorkItem]) -> tuple[V4Batch, torch.Tensor]:
        """Run ``items`` (request ``r``'s tokens at positions ``start ..``) -> (batch, normed hidden ``[T, hidden]``)."""
        batch = self.build_batch(mode, items)
        for it in items:
            if not isinstance(it.page_table, dict):
                raise TypeError("a DeepSeek-V4 work item's page table is its pages per cache group")
        states = [load_state(self.model, self.cache, it.page_table, it.start) for it in items]
        cuts = [self._cut_pages(it) for it in items]
        for st, c in zip(states, cuts):
            if c:
                record_fed(self.model, st)
        ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, list(batch.q_lens), states)
        for it, st, c in zip(items, states, cuts):
            store_state(self.model, self.cache, it.page_table, st, it.start)
            if c:
                store_cut_states(self.model, self.cache, st, it.start, c)
        return batch, hidden

    def _cut_pages(self, item: WorkItem) -> dict[int, dict[str, int]]:
        """The cuts ``item`` crosses (``start < c <= end``) whose state its table has a page for in every
        cut state group: cut -> group -> page (index ``c // G``; none without a prefix cache)."""
        pages = item.page_table
        n = min((len(pages.get(g, ())) for g in self.cut_groups), default=0)
        end = item.start + len(item.token_ids)
        first = item.start // self.cut + 1
        return {k * self.cut: {g: pages[g][k] for g in self.cut_groups}
                for k in range(first, min(end // self.cut + 1, n))}

    @torch.inference_mode()
    def decode(self, step: DecodeStep, token_patch: TokenPatch | None = None) -> torch.Tensor:
        """One DECODE step: normed hidden ``[R * width, hidden]``."""
        if token_patch is not None:
            raise ValueError("the DeepSeek-V4 runner takes its decode inputs from the host (no token patch)")
        return self.forward(ForwardMode.DECODE, step.items())[1]
