"""The MTP draft phase of a decode step: ``k`` draft tokens per running request, left on the device.

What a draft starts from. A verify step over positions ``S .. S + k`` accepts ``a`` drafts. The MTP
layer's cache entry of position ``p`` needs the target hidden state at ``p`` and the token at
``p + 1``, so positions ``S .. S + a`` (``m = a + 1`` of them) are left *pending*
(`Request.pending_hidden` ``[m, hidden]``, `Request.pending_start` = ``S``; after a prompt's
prefill ``m = 1``). Always ``pending_start + m = num_tokens - 1``: the pending positions' next
tokens are the request's last ``m`` tokens. The next step's draft writes those entries; the last
one's output is draft 1; draft ``s + 1`` chains from draft ``s`` (width-1 MTP steps at positions
``num_tokens + s``, slots from `workers.mtp.draft_slot_layout`).

`FixedWidthDrafter` (the engine's): the first MTP forward is one DECODE forward of width
``n = k + 1`` over positions ``S .. S + k`` of every request whatever its ``m``, fed the verify's
hidden states (the rows past ``m`` hold the verify's rejected positions, or zeros). Its shapes depend
on the batch size only: no per-request host work, and CUDA graphs capture it
(`workers.draft_graphs`). Positions past ``m`` write no cache entry (slot -1) and their outputs are
dropped: the MTP cache then holds exactly what the extend path writes. (Written, they would be
rewritten by the next draft before any of its kept queries reads them -- as the target's entries of
rejected drafts are rewritten by the next verify -- except that the chained steps sit one position
past the MTP convention: the first at ``num_tokens``, so it reads position ``num_tokens - 1``, whose
entry is not written yet; it would then see the rejected one instead of a stale one, and the drafts
would differ from the extend path's.) Each request's logits row ``m - 1`` is gathered on the device
(`DsaForCausalLM.mtp_forward(rows=)`). The drafts stay on the device: the verify takes them as
device input (`workers.model_runner.TokenPatch`).

`ExtendDrafter`: the former path, kept as the specification the fixed-width draft is tested against:
the first forward in PREFILL (extend) mode over each request's ``m`` pending positions, with
per-request host batch building, and every forward eager.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attention.formats import PAGE_SIZE
from models.batch import ForwardBatch, ForwardMode
from workers.host_copy import to_device
from workers.model_runner import ModelRunner, WorkItem
from workers.mtp import draft_slot_layout
from workers.request import Request
from workers.sample.metadata import SamplingMetadata
from workers.sample.sampler import sample


@dataclass
class Drafts:
    """``k`` drafts per request, on the device.

    tokens: int64 ``[R, k]``; probs: fp32 ``[S, k, vocab]``, the distributions the sampled rows'
    drafts were drawn from (rows ``meta.sampled_rows`` in batch order), None when every row is greedy.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None


class DraftSampler:
    """Samples the drafts of one step, step by step, from the requests' own streams (draft ``s``
    uses draw ``s``; the verify, draw ``k``). Drafts are proposals: no penalties, biases or grammar
    masks (the acceptance rule holds for any ``q``; the verify's masks judge the drafts)."""

    def __init__(self, meta: SamplingMetadata):
        self.meta = replace(meta, penalties=None, bias=None, grammar=None)
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``[R]`` the next draft of each row of fp32 ``logits`` ``[R, vocab]``."""
        out = sample(logits, self.meta, draw_index=len(self.tokens), want_logprobs=False,
                     want_probs=not self.meta.all_greedy)
        self.tokens.append(out.tokens)
        if out.probs is not None:
            self.probs.append(out.probs)
        return out.tokens

    def result(self) -> Drafts:
        return Drafts(torch.stack(self.tokens, dim=1), torch.stack(self.probs, dim=1) if self.probs else None)


@dataclass
class PendingRows:
    """The first draft forward's per-request inputs, on the host (requests in batch order).

    tokens: ``R * n`` ints, each request's last ``m`` tokens then ``n - m`` zeros (placeholders:
    their positions write nothing); starts: ``pending_start`` of each; counts: its ``m``.
    """

    tokens: list[int]
    starts: list[int]
    counts: list[int]


def pending_rows(reqs: list[Request], k: int, positions_held=None) -> PendingRows:
    """Each request's pending positions as `PendingRows`; checks the invariants they rest on.
    ``positions_held(page_table)``: the positions a request's pages cover (default: 64 a page; a
    grouped cache's drafter gives its own, `workers.v4_mtp_draft`)."""
    if positions_held is None:
        positions_held = lambda table: len(table) * PAGE_SIZE  # noqa: E731
    n = k + 1
    tokens, starts, counts = [], [], []
    for r in reqs:
        if r.pending_hidden is None:
            raise RuntimeError(f"request {r.request_id!r} reached an MTP verify without pending hidden states "
                               "(every prefill and verify leaves some)")
        m = int(r.pending_hidden.shape[0])
        num = r.num_tokens
        if not 1 <= m <= n or r.pending_start + m != num - 1:
            raise RuntimeError(f"request {r.request_id!r}: {m} pending positions from {r.pending_start} for "
                               f"{num} tokens (want 1..{n} ending at {num - 2})")
        # The chained steps write up to position num_tokens + k - 2: the scheduler's pages cover it
        # (`tokens_to_hold`); a graph's slot lookup would silently read page 0 beyond the table.
        if num + k - 1 > positions_held(r.page_table):
            raise RuntimeError(f"request {r.request_id!r}: pages for {positions_held(r.page_table)} positions, "
                               f"draft positions up to {num + k - 2}")
        last = r.output[-m:] if len(r.output) >= m else r.token_ids[-m:]
        tokens += last
        tokens += [0] * (n - m)
        starts.append(r.pending_start)
        counts.append(m)
    return PendingRows(tokens, starts, counts)


def first_draft_batch(page_tables: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor,
                      n: int, max_seq_len: int, static_shapes: bool = False) -> ForwardBatch:
    """The first draft forward: DECODE of width ``n`` over positions ``starts + 0 .. n - 1``.

    page_tables int32 ``[R, max_pages]``; starts, counts int64 ``[R]`` (a count of 0: a padding row);
    tokens int64 ``[R * n]``. Position ``starts + j`` writes its cache slot (from
    `draft_slot_layout`) iff ``j < counts``, else slot -1. Only tensor ops: CUDA graphs capture it.
    """
    R = starts.shape[0]
    j = torch.arange(n, device=starts.device)
    slots = draft_slot_layout(page_tables, starts, n).T                        # [R, n]
    slots = torch.where(j[None, :] < counts[:, None], slots, -1)
    positions = starts[:, None] + j
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=tokens, positions=positions.reshape(-1),
                        out_slots=slots.reshape(-1), page_tables=page_tables, seq_lens=starts + n,
                        q_lens=torch.full((R,), n, dtype=torch.int64, device=starts.device),
                        max_seq_len=max_seq_len, static_shapes=static_shapes)


def chain_draft_batch(page_tables: torch.Tensor, first_pos: torch.Tensor, live: torch.Tensor, step: int,
                      steps: int, tokens: torch.Tensor, max_seq_len: int, static_shapes: bool = False
                      ) -> ForwardBatch:
    """Chained draft step ``step`` of ``steps``: DECODE of width 1 at positions ``first_pos + step``.

    first_pos int64 ``[R]`` (each request's ``num_tokens``); live bool ``[R]`` (False: a padding
    row, writes nothing); tokens int64 ``[R]`` (the previous step's drafts). Slots:
    `draft_slot_layout` row ``step``.
    """
    slots = torch.where(live, draft_slot_layout(page_tables, first_pos, steps)[step], -1)
    positions = first_pos + step
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=tokens, positions=positions, out_slots=slots,
                        page_tables=page_tables, seq_lens=positions + 1, q_lens=torch.ones_like(positions),
                        max_seq_len=max_seq_len, static_shapes=static_shapes)


def first_draft_rows(counts: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[R]``: the row of ``[R * n]`` each request's draft comes from (its ``m - 1``;
    padding rows: their first)."""
    return torch.arange(counts.shape[0], device=counts.device) * n + (counts - 1).clamp_min(0)


class FixedWidthDrafter:
    """The draft phase of `workers.engine.Engine` with ``k`` drafts (module docstring): eager, or
    through `workers.draft_graphs.DraftGraphs` once `enable_graphs` ran."""

    def __init__(self, runner: ModelRunner, k: int, topk_reuse: bool):
        self.runner, self.k, self.topk_reuse = runner, k, topk_reuse
        self.model = runner.model
        self.graphs = None
        # (requests, their pending_hidden views, the verify's hidden [R, n, hidden] they view): when the
        # next draft has the same requests with the same views, that tensor is its input as it is.
        self._last: tuple[list[Request], list[torch.Tensor | None], torch.Tensor] | None = None

    def enable_graphs(self, verify_graphs, capture: bool) -> None:
        """Run the drafts through static buffers (CUDA graphs when ``capture``) sharing the rows and page
        tables of ``verify_graphs`` (the `workers.decode_graphs.DecodeGraphs` of width ``k + 1``)."""
        from workers.draft_graphs import DraftGraphs

        self.graphs = DraftGraphs(self.model, self.runner.cache, self.runner.backend, verify_graphs, self.k,
                                  self.topk_reuse, capture)
        self.graphs.capture_all()

    def remember(self, reqs: list[Request], views: list[torch.Tensor | None], hidden: torch.Tensor) -> None:
        """The verify just gave ``reqs[i]`` ``pending_hidden = views[i]`` (None: it finished), a view of
        ``hidden`` ``[R, n, hidden]`` row ``i``."""
        self._last = (reqs, views, hidden)

    def hidden_rows(self, reqs: list[Request], counts: list[int], rows: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first forward's hidden input: (``src`` ``[X, hidden]``, int64 ``[X]`` the row of
        ``[R * n]`` each goes to, request ``i`` at rows ``rows[i] * n ..``), or (``src``, None) when
        ``src`` is already ``[R * n, hidden]`` in that layout."""
        n, last = self.k + 1, self._last
        self._last = None
        rows = list(range(len(reqs))) if rows is None else rows
        in_order = rows == list(range(len(reqs)))
        if last is not None and last[0] == reqs and all(r.pending_hidden is v for r, v in zip(reqs, last[1])):
            src = last[2].reshape(len(reqs) * n, -1)
            if in_order:
                return src, None
            index = [row * n + j for row in rows for j in range(n)]
        else:
            src = torch.cat([r.pending_hidden for r in reqs])
            index = [row * n + j for row, m in zip(rows, counts) for j in range(m)]
            if in_order and len(index) == len(reqs) * n:
                return src, None
        return src, torch.tensor(index, dtype=torch.int64)

    def draft(self, reqs: list[Request], meta: SamplingMetadata) -> Drafts:
        """``k`` drafts for each of ``reqs`` (all with pending positions), rows of ``meta``; writes the
        MTP cache of their pending positions."""
        pending = pending_rows(reqs, self.k)
        sampler = DraftSampler(meta)
        g = self.graphs
        if g is not None and g.covers(len(reqs), max(len(r.page_table) for r in reqs)):
            out = g.run(self, reqs, pending, sampler)
        else:
            out = self._eager(reqs, pending, sampler)
        for r in reqs:
            r.pending_hidden = None
        return out

    def _eager(self, reqs: list[Request], pending: PendingRows, sampler: DraftSampler) -> Drafts:
        k, n, R = self.k, self.k + 1, len(reqs)
        dev = self.runner.device
        max_pages = max(len(r.page_table) for r in reqs)
        tables = to_device(torch.tensor([r.page_table + [0] * (max_pages - len(r.page_table)) for r in reqs],
                                        dtype=torch.int32), dev)
        packed = to_device(torch.tensor(pending.tokens + pending.starts + pending.counts, dtype=torch.int64), dev)
        tokens, starts, counts = packed[:R * n], packed[R * n:R * n + R], packed[R * n + R:]
        src, index = self.hidden_rows(reqs, pending.counts)
        hidden = src if index is None else src.new_zeros(R * n, src.shape[1]).index_copy_(
            0, to_device(index, src.device), src)
        batch = first_draft_batch(tables, starts, counts, tokens, n, max(pending.starts) + n)
        cache, backend = self.runner.cache, self.runner.backend
        logits, h, sel = self.model.mtp_forward(batch, hidden, cache, backend, rows=first_draft_rows(counts, n))
        drafts = sampler(logits)
        first_pos = starts + counts + 1  # num_tokens
        live = torch.ones(R, dtype=torch.bool, device=dev)
        longest = max(r.num_tokens for r in reqs)
        for s in range(k - 1):
            batch = chain_draft_batch(tables, first_pos, live, s, k - 1, drafts.to(dev), longest + s + 1)
            logits, h, sel = self.model.mtp_forward(batch, h, cache, backend, reuse=sel if self.topk_reuse else None)
            drafts = sampler(logits)
        return sampler.result()


class ExtendDrafter:
    """The former draft phase (module docstring), the specification `FixedWidthDrafter` is tested
    against: same interface."""

    def __init__(self, runner: ModelRunner, k: int, topk_reuse: bool):
        self.runner, self.k, self.topk_reuse = runner, k, topk_reuse
        self.model = runner.model
        self.graphs = None

    def enable_graphs(self, verify_graphs, capture: bool) -> None:
        pass  # always eager

    def remember(self, reqs, views, hidden) -> None:
        pass

    def draft(self, reqs: list[Request], meta: SamplingMetadata) -> Drafts:
        pending_rows(reqs, self.k)  # the same checks
        items = [WorkItem(tuple(r.token_ids[r.pending_start + 1:r.pending_start + 1 + r.pending_hidden.shape[0]]),
                          r.pending_start, tuple(r.page_table)) for r in reqs]
        batch = self.runner.build_batch(ForwardMode.PREFILL, items)
        logits, h, selected = self.model.mtp_forward(
            batch, torch.cat([r.pending_hidden for r in reqs]), self.runner.cache, self.runner.backend)
        last = torch.cumsum(batch.q_lens, 0) - 1
        logits, h = logits[last], h[last]
        sel = None
        if self.topk_reuse:
            from models.indexer import SelectedTokens
            sel = SelectedTokens(selected.slots[last], selected.positions[last])
        for r in reqs:
            r.pending_hidden = None
        sampler = DraftSampler(meta)
        first_pos = torch.tensor([r.num_tokens for r in reqs])
        layout = None
        for step in range(self.k):
            drafts = sampler(logits)
            if step == self.k - 1:
                break
            items = [WorkItem((0,), r.num_tokens + step, tuple(r.page_table)) for r in reqs]
            batch = self.runner.build_batch(ForwardMode.DECODE, items)
            batch.input_ids = drafts.to(batch.input_ids.device)
            if layout is None:
                layout = draft_slot_layout(batch.page_tables, first_pos.to(batch.page_tables.device), self.k - 1)
            batch.out_slots = layout[step]
            logits, h, selected = self.model.mtp_forward(batch, h, self.runner.cache, self.runner.backend, reuse=sel)
            if self.topk_reuse:
                sel = selected
        return sampler.result()
