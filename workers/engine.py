"""The engine of one replica: scheduler + model runner + sampler + MTP.

``Engine.step()`` runs one scheduling round — prefill chunks (one PREFILL
forward), then one decode step for every running request (a DECODE forward
with one token each, or with MTP a draft phase and a ``next_n = k + 1`` verify
forward) — and returns what each request produced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from models.batch import ForwardMode
from workers.model_runner import ModelRunner, WorkItem
from workers.mtp import accept_drafts, check_topk_reuse, draft_slot_layout
from workers.page_pool import PagePool
from workers.request import FinishReason, Request
from workers.sampler import draw, sample, sampling_probs
from workers.scheduler import PrefillChunk, Scheduler, SchedulerConfig, prefill_length

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced in one step (``token_ids`` may be empty)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    preemptions: int = 0
    accepted_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def mtp_acceptance_rate(self) -> float:
        return self.mtp_accepted / self.mtp_drafted if self.mtp_drafted else 0.0


class Engine:
    def __init__(self, runner: ModelRunner, pool: PagePool, cfg: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), mtp_topk_reuse: bool = False,
                 detokenize=None):
        if cfg.mtp_draft_tokens and not len(runner.model.mtp):
            raise ValueError("mtp_draft_tokens > 0 needs a checkpoint with an MTP layer (num_nextn_predict_layers >= 1)")
        check_topk_reuse(mtp_topk_reuse, 1)
        self.runner, self.pool, self.cfg = runner, pool, cfg
        self.model = runner.model
        self.scheduler = Scheduler(pool, cfg)
        self.eos = set(eos_token_ids)
        self.k = cfg.mtp_draft_tokens
        self.topk_reuse = mtp_topk_reuse
        self.detokenize = detokenize
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()

    # ----------------------------------------------------------------- API
    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue ``req``; returns a final output at once if it was rejected."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.params.stop_strings and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer")
        self.scheduler.add(req)
        if req.finished:
            return RequestOutput(req.request_id, [], [], True, req.finish_reason.value, req.error)
        self.requests[req.request_id] = req
        return None

    def admit_prefilled(self, req: Request, first_token: int, first_logprob: float,
                        last_hidden: torch.Tensor) -> list[RequestOutput]:
        """Join a request whose prompt KV is already in ``req.page_table`` (pushed by a
        prefill peer) to the running batch. ``last_hidden`` ``[hidden]``: the
        target hidden state of the last prompt position."""
        self.requests[req.request_id] = req
        req.num_computed = len(req.prompt)
        if self.k:
            # The MTP entry of the last prompt position needs token 1: written
            # here by the first draft step, as in monolithic mode.
            # It crossed processes on the host: back onto this replica's device.
            req.pending_hidden = last_hidden.to(device=self.runner.device, dtype=self.model.dtype)[None]
            req.pending_start = len(req.prompt) - 1
        self.scheduler.add_running(req)
        out = RequestOutput(req.request_id, [], [])
        self._emit(req, first_token, first_logprob, out)
        return [out]

    def abort(self, request_id: str) -> bool:
        """Abort at any phase; frees the request's pages. False if unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.finish(FinishReason.ABORT)
        return True

    def enable_cuda_graphs(self, max_context: int, capture: bool = True) -> None:
        """Run this engine's target decode steps (width 1, or ``k + 1`` with MTP)
        through per-bucket CUDA graphs for up to ``max_batch_size`` requests
        with contexts up to ``max_context`` tokens (``workers.decode_graphs``);
        ``capture=False`` runs the same static-buffer path eagerly."""
        self.runner.enable_decode_graphs((self.k + 1,), self.cfg.max_batch_size, max_context, capture)
        g = self.runner.decode_graphs[self.k + 1]
        log.info("decode steps of width %d: %s for batch sizes %s, contexts up to %d tokens",
                 self.k + 1, "CUDA graphs captured" if capture else "static buffers", g.plan.batch_sizes, max_context)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.stats.steps += 1
        self.stats.preemptions += len(sched.preempted)
        outs: dict[str, RequestOutput] = {}
        decode = [r for r in sched.decode if not r.finished]
        if sched.prefill:
            self._prefill(sched.prefill, outs)
        if decode:
            if self.k:
                self._verify(decode, outs)
            else:
                self._decode(decode, outs)
        return list(outs.values())

    # ----------------------------------------------------------- internals
    def _out(self, outs, req: Request) -> RequestOutput:
        if req.request_id not in outs:
            outs[req.request_id] = RequestOutput(req.request_id, [], [])
        return outs[req.request_id]

    def _append(self, req: Request, tokens: list[int], logits: torch.Tensor, outs) -> None:
        """Append tokens (scored by fp32 ``logits`` ``[len(tokens), vocab]``), stopping
        at max tokens / EOS / stop ids / stop strings."""
        out = self._out(outs, req)
        logprobs = torch.log_softmax(logits.float(), -1)
        for i, t in enumerate(tokens):
            if self._emit(req, t, float(logprobs[i, t]), out):
                return

    def _emit(self, req: Request, token: int, logprob: float, out: RequestOutput) -> bool:
        """Append one token; finish the request (True) on a stop condition."""
        req.output.append(token)
        req.logprobs.append(logprob)
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        p = req.params
        reason = None
        if token in p.stop_token_ids or (token in self.eos and not p.ignore_eos):
            reason = FinishReason.STOP
        elif p.stop_strings and any(s in self.detokenize(req.output) for s in p.stop_strings):
            reason = FinishReason.STOP
        elif len(req.output) >= p.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is None:
            return False
        self._finish(req, reason, out)
        return True

    def _finish(self, req: Request, reason: FinishReason, out: RequestOutput) -> None:
        self.scheduler.remove(req)
        req.finish(reason)
        self.requests.pop(req.request_id, None)
        out.finished, out.finish_reason = True, reason.value

    def _prefill(self, chunks: list[PrefillChunk], outs) -> None:
        items = [WorkItem(tuple(c.request.token_ids[c.start:c.end]), c.start, tuple(c.request.page_table)) for c in chunks]
        batch, hidden = self.runner.forward(ForwardMode.PREFILL, items)
        self.stats.prefill_tokens += batch.num_tokens
        ranges = batch.query_ranges()
        mtp_items, mtp_hidden = [], []
        finishing = []
        for c, (s0, s1) in zip(chunks, ranges):
            req = c.request
            req.num_computed = c.end
            if self.k:
                # MTP cache entries need the token after each position; the
                # final prefill position waits (its next token is sampled now).
                known_end = min(c.end, prefill_length(req) - 1)
                if known_end > c.start:
                    mtp_items.append(WorkItem(tuple(req.token_ids[c.start + 1:known_end + 1]), c.start, tuple(req.page_table)))
                    mtp_hidden.append(hidden[s0:s0 + known_end - c.start])
                if c.is_last:
                    req.pending_hidden, req.pending_start = hidden[s1 - 1:s1].clone(), c.end - 1
            if c.is_last:
                finishing.append((req, s1 - 1))
        if mtp_items:
            mbatch = self.runner.build_batch(ForwardMode.PREFILL, mtp_items)
            self.model.mtp_forward(mbatch, torch.cat(mtp_hidden), self.runner.cache, self.runner.backend,
                                   draft=False)
        for req, row in finishing:
            self.scheduler.prefill_done(req)
            if req.output:  # resumed after preemption: its next input is known
                continue
            logits = self.model.logits(hidden[row:row + 1])
            self._append(req, [sample(logits[0], req.params, req.generator)], logits, outs)

    def _decode(self, reqs: list[Request], outs) -> None:
        items = [WorkItem((r.token_ids[-1],), r.num_tokens - 1, tuple(r.page_table)) for r in reqs]
        logits = self.model.logits(self.runner.decode(items))
        self.stats.decode_tokens += len(reqs)
        for i, r in enumerate(reqs):
            r.num_computed = r.num_tokens
            self._append(r, [sample(logits[i], r.params, r.generator)], logits[i:i + 1], outs)

    # ------------------------------------------------------------------ MTP
    def _draft(self, reqs: list[Request]) -> None:
        """Write the MTP cache for each request's pending positions and chain
        ``k`` draft tokens from the last one."""
        items = [WorkItem(tuple(r.token_ids[r.pending_start + 1:r.pending_start + 1 + r.pending_hidden.shape[0]]),
                          r.pending_start, tuple(r.page_table)) for r in reqs]
        batch = self.runner.build_batch(ForwardMode.PREFILL, items)
        logits, mtp_hidden, selected = self.model.mtp_forward(
            batch, torch.cat([r.pending_hidden for r in reqs]), self.runner.cache, self.runner.backend)
        last = torch.cumsum(batch.q_lens, 0) - 1
        logits, h = logits[last], mtp_hidden[last]
        sel = None
        if self.topk_reuse:
            from models.indexer import SelectedTokens
            sel = SelectedTokens(selected.slots[last], selected.positions[last])
        for r in reqs:
            r.drafts, r.pending_hidden = [], None
        probs = []
        # Chained steps s = 1 .. k-1 write positions first_pos + s - 1, laid out
        # by the one authoritative helper.
        first_pos = torch.tensor([r.num_tokens for r in reqs])
        layout = None
        for step in range(self.k):
            step_probs = []
            for i, r in enumerate(reqs):
                if r.params.greedy:
                    r.drafts.append(int(logits[i].argmax()))
                else:
                    q = sampling_probs(logits[i], r.params)
                    r.drafts.append(draw(q, r.generator))
                    step_probs.append(q)
            probs.append(step_probs)
            if step == self.k - 1:
                break
            items = [WorkItem((r.drafts[-1],), r.num_tokens + step, tuple(r.page_table)) for r in reqs]
            batch = self.runner.build_batch(ForwardMode.DECODE, items)
            if layout is None:
                layout = draft_slot_layout(batch.page_tables, first_pos.to(batch.page_tables.device), self.k - 1)
            batch.out_slots = layout[step]
            logits, h, selected = self.model.mtp_forward(batch, h, self.runner.cache, self.runner.backend, reuse=sel)
            if self.topk_reuse:
                sel = selected
        for i, r in enumerate(reqs):
            if not r.params.greedy:
                r.draft_probs = torch.stack([probs[s][i] for s in range(self.k)])

    def _verify(self, reqs: list[Request], outs) -> None:
        need = [r for r in reqs if r.pending_hidden is not None]
        if need:
            self._draft(need)
        n = self.k + 1
        items = [WorkItem((r.token_ids[-1], *r.drafts), r.num_tokens - 1, tuple(r.page_table)) for r in reqs]
        hidden = self.runner.decode(items)
        logits = self.model.logits(hidden).view(len(reqs), n, -1)
        hidden = hidden.view(len(reqs), n, -1)
        for i, r in enumerate(reqs):
            acc = accept_drafts(r.drafts, logits[i], r.params, r.draft_probs, r.generator)
            self.stats.mtp_drafted += self.k
            self.stats.mtp_accepted += acc.accepted
            self.stats.accepted_histogram[acc.accepted] = self.stats.accepted_histogram.get(acc.accepted, 0) + 1
            self.stats.decode_tokens += len(acc.tokens)
            start = r.num_tokens - 1
            r.drafts, r.draft_probs = [], None
            self._append(r, acc.tokens, logits[i, : len(acc.tokens)], outs)
            if r.finished:
                continue
            r.num_computed = r.num_tokens - 1
            r.pending_hidden, r.pending_start = hidden[i, : acc.accepted + 1].clone(), start
