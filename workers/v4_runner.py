"""The model runner of DeepSeek-V4 (reference and cuda backends): forwards over paged cache groups.

Same calls as ``workers.model_runner.ModelRunner`` (``forward``, ``decode``,
``build_batch``), so the engine, the prefill worker and the offline ``LLM``
drive it unchanged. A work item's page table is the request's pages per group
(`workers.page_tables.PageTable.frozen`). Per forward, each request's
``SequenceState`` is rebuilt from its pages (``models.v4.paged_state``), the
batch runs through ``models.v4``'s model (per-sequence attention, batched
projections and MoE), and what it added goes back into the pages: nothing of
a request lives in the runner between forwards.

The "hidden state" a forward returns is the model's residual streams before
``hc_head`` (``[T, hc_mult * hidden]``, ``models.v4.model``): ``model.logits``
collapses the rows it samples, and the MTP layer reads them as they are.

MTP: ``model.mtp_forward`` takes this runner's `build_batch` output (a
``models.v4.batch.V4Batch``) and writes the MTP layer's keys into the same
``swa`` pages; the draft phase is `workers.v4_mtp_draft.V4Drafter` (`make_drafter`);
a verify step takes its drafts from the device (``token_patch``). A verify of ``k``
drafts writes up to ``k`` positions past where the next step resumes: the state
pages keep the accepted ones (``models.v4.cache_spec.STATE_LOOKAHEAD``).

Prefix caching (`workers.v4_prefix`): a table with cut state pages (more than
one page in a CSA state group) gets the state at every cut a forward crosses
written into the page for it (``paged_state.store_cut_states``). A verify that
crosses a cut with drafts rejected before it writes their rows there; the
forward that next crosses the cut rewrites them, and only cuts below the
accepted length are cached (``workers.scheduler.cacheable_tokens``).

Not here yet: CUDA graphs and overlap scheduling (a step's last tokens come from
the host). On the cuda backend the model's sparse attention runs on FlashMLA
(`workers.rank_build`): prefill over the state's bf16 workspace (``attention.cuda.v4_attention``),
DECODE steps with fp8 caches on the fp8 sparse decode kernel reading the pages in place
(``attention.cuda.v4_decode``; this runner hands the model a ``models.v4.paged_decode.PagedDecode``).
"""

from __future__ import annotations

import torch

from attention.group_cache import GroupedPagedCache
from models.batch import ForwardMode
from models.v4.batch import V4Batch
from models.v4.cache_spec import STATE_LOOKAHEAD, cut_state_groups
from models.v4.model import DeepseekV4ForCausalLM
from models.v4.paged_decode import PagedDecode
from models.v4.paged_state import load_state, pending_rows, store_cut_states, store_state
from workers.decode_graphs import patch_tokens
from workers.host_copy import to_device
from workers.model_runner import DecodeStep, TokenPatch, WorkItem, decode_width
from workers.v4_prefix import cut_tokens

__all__ = ["V4Batch", "V4ModelRunner"]


class V4ModelRunner:
    supports_overlap = False
    """A step's input tokens come from the host, but for an MTP verify's drafts (no in-flight token patch)."""

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

    def make_drafter(self, k: int, topk_reuse: bool):
        """The draft phase of an MTP step of ``k`` drafts (`workers.engine.Engine` asks its runner)."""
        from workers.v4_mtp_draft import V4Drafter

        return V4Drafter(self, k, topk_reuse)

    def build_batch(self, mode: ForwardMode, items: list[WorkItem]) -> V4Batch:
        if not items:
            raise ValueError("a forward needs at least one request")
        if mode is ForwardMode.DECODE and decode_width(items) > STATE_LOOKAHEAD + 1:
            # A verify may leave this many positions rejected; the state rings keep no more.
            raise ValueError(f"a DeepSeek-V4 decode step has at most {STATE_LOOKAHEAD + 1} tokens per request "
                             f"(MTP drafts <= {STATE_LOOKAHEAD}), got {decode_width(items)}")
        return V4Batch.of(mode, [it.token_ids for it in items], [it.start for it in items],
                          [it.page_table for it in items], self.device)

    @torch.inference_mode()
    def forward(self, mode: ForwardMode, items: list[WorkItem], token_patch: TokenPatch | None = None
                ) -> tuple[V4Batch, torch.Tensor]:
        """Run ``items`` (request ``r``'s tokens at positions ``start ..``) -> (batch, streams
        ``[T, hc_mult * hidden]``). ``token_patch``: a DECODE step's last tokens still on the device."""
        batch = self.build_batch(mode, items)
        if token_patch is not None:
            at, values = token_patch
            patch_tokens(batch.input_ids, len(items[0].token_ids), to_device(torch.tensor(at, dtype=torch.int64),
                                                                             self.device), values)
        states = [load_state(self.model, self.cache, pages, start)
                  for pages, start in zip(batch.page_tables, batch.starts)]
        cuts = [self._cut_pages(pages, start, n) for pages, start, n in zip(batch.page_tables, batch.starts,
                                                                            batch.q_lens)]
        before = [pending_rows(self.model, st) if c else None for st, c in zip(states, cuts)]
        hidden = self.model(batch.input_ids, list(batch.q_lens), states, self._paged(batch))
        for pages, start, st, c, b in zip(batch.page_tables, batch.starts, states, cuts, before):
            store_state(self.model, self.cache, pages, st, start)
            if c:
                store_cut_states(self.model, self.cache, st, start, c, b)
        return batch, hidden

    def _paged(self, batch: V4Batch) -> PagedDecode | None:
        """A DECODE forward's pages for the model's paged decode kernel (cuda backend, fp8 caches:
        ``models.v4.paged_decode``); None: attention over the state's workspace (prefill, reference)."""
        if batch.mode is not ForwardMode.DECODE or self.model.decode_kernel is None:
            return None
        return PagedDecode.of(self.cache, batch.page_tables, batch.starts, batch.q_lens, *self.model.decode_kernel)

    def _cut_pages(self, pages, start: int, q_len: int) -> dict[int, dict[str, int]]:
        """The cuts a forward of ``q_len`` tokens from ``start`` crosses (``start < c <= end``) whose state
        its table ``pages`` has a page for in every cut state group: cut -> group -> page (index ``c // G``;
        none without a prefix cache)."""
        n = min((len(pages.get(g, ())) for g in self.cut_groups), default=0)
        end = start + q_len
        first = start // self.cut + 1
        return {k * self.cut: {g: pages[g][k] for g in self.cut_groups}
                for k in range(first, min(end // self.cut + 1, n))}

    @torch.inference_mode()
    def decode(self, step: DecodeStep, token_patch: TokenPatch | None = None) -> torch.Tensor:
        """One DECODE step: streams ``[R * width, hc_mult * hidden]``. ``token_patch``: an MTP verify's
        drafts (the last ``width - 1`` tokens of each request), on the device."""
        return self.forward(ForwardMode.DECODE, step.items(), token_patch)[1]
