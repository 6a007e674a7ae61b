"""The MTP draft phase of a DeepSeek-V4 decode step (`workers.v4_runner.V4ModelRunner.make_drafter`).

The same contract as `workers.mtp_draft.FixedWidthDrafter` (``draft``, ``remember``,
``enable_graphs``; `workers.engine.Engine` runs either), on the same request state: a request's
*pending* positions ``S .. S + m - 1`` (`Request.pending_start`, `Request.pending_hidden`
``[m, hc_mult * hidden]``, the verify's or prefill's streams) whose MTP entries need the tokens
after them, the request's last ``m`` tokens (`workers.mtp_draft.pending_rows`; ``S + m = num_tokens - 1``).

* The first MTP forward runs each request's ``m`` pending positions (``q_len = m``: the V4 runner
  is eager and forwards per sequence, so nothing is gained by the fixed width ``k + 1`` that CUDA
  graphs need) and writes their entries; the output of each request's last position gives draft 1.
* Chained step ``s`` (``0 .. k - 2``) runs at position ``num_tokens - 1 + s``: its input is draft
  ``s + 1`` and the previous step's output streams, its entry is written at that position
  (`workers.mtp.draft_slot_layout` with ``first_positions = num_tokens - 1`` and the ``swa`` group's
  page size gives the slots), and it gives draft ``s + 2``.

Where DeepSeek-V3.2's chained steps sit one position further (``num_tokens + s``: its first reads
the entry of ``num_tokens - 1``, which nobody wrote), V4's follow the MTP convention -- the entry at
position ``p`` is made of the state at ``p`` and the token at ``p + 1`` -- so every key a chained step
attends to was written, by this draft or an earlier one. Chained entries are rewritten by the next
draft's first forward (its pending positions start at ``num_tokens - 1``) before any forward reads
them as history: the MTP cache below ``pending_start`` always holds true entries.
"""

from __future__ import annotations

import torch

from models.batch import ForwardMode
from models.v4.batch import V4Batch
from workers.mtp_draft import DraftSampler, Drafts, pending_rows
from workers.page_tables import frozen_pages
from workers.request import Request
from workers.sample.metadata import SamplingMetadata


class V4Drafter:
    """``k`` drafts per request from ``runner.model``'s MTP layer 0 (module docstring); always eager."""

    graphs = None

    def __init__(self, runner, k: int, topk_reuse: bool):
        if topk_reuse:
            raise ValueError("mtp_topk_reuse: DeepSeek-V4's MTP layer attends over its sliding window only, it "
                             "selects no top-k to reuse")
        if not len(runner.model.mtp):
            raise ValueError("MTP drafts need the checkpoint's MTP layer (num_nextn_predict_layers >= 1, loaded)")
        self.runner, self.k, self.model = runner, k, runner.model
        self.swa_page = runner.cache.layouts["swa"].group.tokens_per_page

    def enable_graphs(self, verify_graphs, capture: bool) -> None:
        raise ValueError("CUDA graphs are not built for DeepSeek-V4 (its runner is eager, reference backend)")

    def remember(self, reqs, views, hidden) -> None:
        pass  # the pending streams are read from each request (`Request.pending_hidden`)

    def positions_held(self, table) -> int:
        """Positions whose MTP keys ``table`` (a `workers.page_tables.PageTable`) has pages for."""
        return len(table.pages.get("swa", ())) * self.swa_page

    @torch.inference_mode()
    def draft(self, reqs: list[Request], meta: SamplingMetadata) -> Drafts:
        """``k`` drafts for each of ``reqs`` (all with pending positions), rows of ``meta``; writes the
        MTP layer's keys of their pending positions and of the chained steps'."""
        k, n, R = self.k, self.k + 1, len(reqs)
        pending = pending_rows(reqs, k, self.positions_held)
        dev, cache = self.runner.device, self.runner.cache
        tables = tuple(frozen_pages(r.page_table) for r in reqs)
        tokens = [pending.tokens[i * n:i * n + m] for i, m in enumerate(pending.counts)]
        batch = V4Batch.of(ForwardMode.PREFILL, tokens, pending.starts, tables, dev)
        hidden = torch.cat([r.pending_hidden for r in reqs])
        last = torch.tensor(pending.counts, dtype=torch.int64).cumsum(0) - 1  # each request's last pending row
        sampler = DraftSampler(meta)
        logits, h, _ = self.model.mtp_forward(batch, hidden, cache, rows=last.to(dev))
        drafts = sampler(logits)
        first = [s + m for s, m in zip(pending.starts, pending.counts)]  # num_tokens - 1
        for s in range(k - 1):
            batch = V4Batch(ForwardMode.DECODE, (1,) * R, drafts.to(dev, torch.int64), tuple(f + s for f in first),
                            tables)
            logits, h, _ = self.model.mtp_forward(batch, h, cache)
            drafts = sampler(logits)
        for r in reqs:
            r.pending_hidden = None
        return sampler.result()
