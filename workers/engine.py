"""The engine of one replica: scheduler + model runner + sampler + MTP.

``Engine.step()`` runs one scheduling round — prefill chunks (one PREFILL
forward), then one decode step for every running request (a DECODE forward
with one token each, or with MTP a draft phase (`workers.mtp_draft`) and a
``next_n = k + 1`` verify forward) — and returns what each request produced.

Sampling runs on the device for the whole batch: one `sample` (or, with
MTP, one `accept`) call per forward, and the step's results come to the host
in one read-back at its end (`_Sampled`). An MTP step's drafts stay on the
device: the verify forward takes them as device input (only a constrained
request's drafts come to the host, for its grammar masks).
"""

from __future__ import annotations

import logging
import time
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attention.formats import pages_for_tokens
from models.batch import ForwardMode
from workers.host_copy import tensor_on
from workers.model_runner import DecodeStep, ModelRunner, WorkItem
from workers.mtp import check_topk_reuse
from workers.mtp_draft import FixedWidthDrafter
from workers.page_pool import PagePool
from workers.page_tables import frozen_pages
from workers.request import FinishReason, Request
from workers.request_output import RequestOutput
from workers.sample.metadata import SamplingMetadata, TokenHistory
from workers.sample.output import AcceptOutput, SampleOutput, read_back
from workers.sample.prompt_logprobs import PromptRows
from workers.sample.rejection import accept
from workers.sample.sampler import sample_hidden
from workers.scheduler import PrefillChunk, Scheduler, SchedulerConfig, prefill_length, tokens_to_hold
from workers.structured import GrammarCompiler, MaskJob

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    preemptions: int = 0
    mixed_steps: int = 0
    """Steps whose decode batch rode along with a prefill in one forward (`Engine._prefill`)."""
    accepted_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def mtp_acceptance_rate(self) -> float:
        return self.mtp_accepted / self.mtp_drafted if self.mtp_drafted else 0.0


@dataclass
class _Sampled:
    """One sampling site's results, still on the device until the step's one read-back.

    packed: fp32 ``[R, C]`` (`SampleOutput.packed` / `AcceptOutput.packed`);
    emit: takes the host rows of ``packed`` and the step's outputs."""

    packed: torch.Tensor
    emit: Callable[[list[list[float]], dict], None]
    tokens: torch.Tensor | None = None
    """int64 ``[R]`` each row's sampled token, on the device (one-token sites only)."""


@dataclass
class _InFlight:
    """A decode step launched and not read back yet (overlap scheduling).

    tag: the step's number (the page pool holds frees until it completed);
    host: the packed results' host copy, filled asynchronously until ``done``;
    index: request id -> row of ``sampled.tokens``."""

    tag: int
    sampled: _Sampled
    host: torch.Tensor
    done: torch.cuda.Event | None
    index: dict[str, int]
    read: bool = False
    """Read back and emitted already (by the next launch, whose grammar masks needed its tokens)."""


class Engine:
    def __init__(self, runner: ModelRunner, pool: PagePool, cfg: SchedulerConfig,
                 eos_token_ids: tuple[int, ...] = (), mtp_topk_reuse: bool = False,
                 detokenize=None, grammars: GrammarCompiler | None = None):
        """grammars: the replica's grammar compiler (structured outputs; None: constrained requests
        are refused)."""
        if cfg.mtp_draft_tokens and not len(runner.model.mtp):
            raise ValueError("mtp_draft_tokens > 0 needs a checkpoint with an MTP layer (num_nextn_predict_layers >= 1)")
        check_topk_reuse(mtp_topk_reuse, 1)
        self.runner, self.pool, self.cfg = runner, pool, cfg
        self.model = runner.model
        self.scheduler = Scheduler(pool, cfg)
        self.eos = set(eos_token_ids)
        self.k = cfg.mtp_draft_tokens
        self.topk_reuse = mtp_topk_reuse
        # The draft phase of an MTP step (`workers.mtp_draft.ExtendDrafter` is the spec it is tested against);
        # a runner with a draft phase of its own makes it (DeepSeek-V4: `workers.v4_mtp_draft`).
        make = getattr(runner, "make_drafter", None)
        if not self.k:
            self.drafter = None
        else:
            self.drafter = make(self.k, mtp_topk_reuse) if make else FixedWidthDrafter(runner, self.k, mtp_topk_reuse)
        self.detokenize = detokenize
        self.grammars = grammars
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        # The replica's RNG: only the seeds of requests that bring none come from it.
        self._seeds = random.Random()
        self._inflight: _InFlight | None = None

    # ----------------------------------------------------------------- API
    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue ``req``; returns a final output at once if it was rejected."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.params.stop_strings and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer")
        self.attach_grammar(req)
        self._give_seed(req)
        self.scheduler.add(req)
        if req.finished:
            return RequestOutput(req.request_id, [], [], True, req.finish_reason.value, req.error)
        self.requests[req.request_id] = req
        return None

    def admit_prefilled(self, req: Request, first_token: int, first_logprob: float,
                        last_hidden: torch.Tensor, first_top_logprobs: dict[int, float] | None = None
                        ) -> list[RequestOutput]:
        """Join a request whose prompt KV is already in ``req.page_table`` (pushed by a
        prefill peer) to the running batch. ``last_hidden`` ``[hidden]``: the
        target hidden state of the last prompt position. ``req.seed`` /
        ``req.rng_offset`` are prefill's (its stream after token 1)."""
        self.attach_grammar(req)  # its matcher replays token 1 (prefill sampled it under the same grammar)
        self.requests[req.request_id] = req
        self._give_seed(req)
        req.num_computed = len(req.prompt)
        if self.k:
            # The MTP entry of the last prompt position needs token 1: written
            # here by the first draft step, as in monolithic mode.
            # It crossed processes on the host: back onto this replica's device.
            req.pending_hidden = last_hidden.to(device=self.runner.device, dtype=self.model.dtype)[None]
            req.pending_start = len(req.prompt) - 1
        self.scheduler.add_running(req)
        out = RequestOutput(req.request_id, [], [])
        self._emit(req, first_token, first_logprob, out, first_top_logprobs)
        self.scheduler.publish(req)  # its prompt's pages arrived whole: a later request reuses them
        return [out]

    def abort(self, request_id: str) -> bool:
        """Abort at any phase; frees the request's pages. False if unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.finish(FinishReason.ABORT)
        return True

    def enable_cuda_graphs(self, max_context: int, capture: bool = True, prefill_tokens: int = 0) -> None:
        """Run this engine's target decode steps (width 1, or ``k + 1`` with MTP)
        through per-bucket CUDA graphs for up to ``max_batch_size`` requests
        with contexts up to ``max_context`` tokens (``workers.decode_graphs``),
        and with MTP the draft forwards too (``workers.draft_graphs``);
        ``capture=False`` runs the same static-buffer path eagerly.
        ``prefill_tokens``: also small prefills: one new prompt up to that many tokens, or the new tokens
        of a few requests over cached prefixes in contexts up to ``max_context`` (``workers.prefill_graphs``;
        `prefill_graph_tokens` resolves it; 0: none)."""
        # Each phase's seconds in the log: a replica slow to come up says which phase held it.
        if prefill_tokens:
            t = time.perf_counter()
            self.runner.enable_prefill_graphs(prefill_tokens, capture, max_context)
            plan = self.runner.prefill_graphs.plan
            log.info("prefills: %s for one new prompt of %s tokens, and rows of %s tokens over cached prefixes "
                     "(%.1f s)", "CUDA graphs captured" if capture else "static buffers", plan.buckets,
                     plan.row_buckets, time.perf_counter() - t)
        t = time.perf_counter()
        self.runner.enable_decode_graphs((self.k + 1,), self.cfg.max_batch_size, max_context, capture)
        g = self.runner.decode_graphs[self.k + 1]
        if self.k:
            self.drafter.enable_graphs(g, capture)
        log.info("decode steps of width %d: %s for batch sizes %s, indexer logits widths %s pages, contexts up to "
                 "%d tokens (%.1f s)", self.k + 1, "CUDA graphs captured" if capture else "static buffers", g.plan.batch_sizes,
                 g.plan.logits_pages, max_context, time.perf_counter() - t)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduling round; returns what requests produced.

        Overlap scheduling: a pure-decode round (no prompt to prefill, no MTP,
        no penalties, pages for every running request's next token free)
        launches its forward and sampling, then reads back and emits the
        *previous* round's tokens while the device runs this one; the next
        round feeds this round's tokens to the model straight from the
        device. So a round's outputs come one call later, and the host's
        per-round work (stop checks, outputs, scheduling) hides behind the
        device's. A constrained request's mask needs its previous token on
        the host: such a round launches its forward, then reads the previous
        round back and fills the masks while the forward runs, and only its
        sampling waits for them (`_launch`). Any other round first reads back
        what is in flight.
        """
        outs: dict[str, RequestOutput] = {}
        # Decided once, before scheduling: when it holds, `schedule` finds the pages it counted free,
        # so it admits nothing, prefills nothing and preempts nobody (the checks below are guards).
        overlap = self._can_overlap()
        if self._inflight is not None and not overlap:
            self._drain(self._inflight, outs)
        sched = self.scheduler.schedule()
        self.stats.steps += 1
        self.stats.preemptions += len(sched.preempted)
        decode = [r for r in sched.decode if not r.finished]
        # A request whose last token is already in flight needs no further step.
        flying = self._inflight.index if self._inflight is not None else {}
        ahead = [r for r in decode if len(r.output) + (r.request_id in flying) < r.params.max_new_tokens]
        if overlap and ahead and not sched.prefill and not sched.preempted:
            prev, self._inflight = self._inflight, self._launch(ahead, outs)
            if prev is not None and not prev.read:
                self._drain(prev, outs)
            return list(outs.values())
        if self._inflight is not None:  # late, but safe: pages cover the pending tokens
            self._drain(self._inflight, outs)
            decode = [r for r in decode if not r.finished]
        sampled: list[_Sampled] = []
        rode = False
        if sched.prefill:
            sites, rode = self._prefill(sched.prefill, decode)
            sampled += sites
        if decode and not rode:
            sampled.append(self._verify(decode) if self.k else self._decode(decode))
        sampled = [s for s in sampled if s is not None]
        # The step's one read-back: every site's tokens and logprobs in one copy.
        for s, host in zip(sampled, read_back(*(s.packed for s in sampled))):
            s.emit(host.tolist(), outs)
        return list(outs.values())

    def flush(self) -> list[RequestOutput]:
        """Read back the step in flight, if any (a caller that stops stepping once its
        own requests finished: the engine may have launched a step for them that turns
        out to follow their last token)."""
        outs: dict[str, RequestOutput] = {}
        if self._inflight is not None:
            self._drain(self._inflight, outs)
        return list(outs.values())

    # ------------------------------------------------------ overlap scheduling
    def _can_overlap(self) -> bool:
        """Whether the next round can launch before the one in flight is read back:
        decode only (nothing waiting or prefilling), no MTP (the drafts would need
        the tokens on the host), no penalties (they need every token on the host),
        no request still short of its ``min_tokens``, and pages for each running request's next token free
        without preempting. Constrained requests overlap too (`_launch` reads the previous round back
        before their masks)."""
        s = self.scheduler
        if not self.cfg.overlap or not self.runner.supports_overlap or self.k or s.waiting or s.prefilling \
                or not s.running:
            return False
        need = 0
        for r in s.running:
            p = r.params
            # A min_tokens block depends on the count of tokens generated, which lags by the one in flight.
            if p.uses_penalties or len(r.output) < p.min_tokens:
                return False
            # What `schedule` grows each request to: the launch writes position num_tokens - 1
            # + pending (its token in flight), within tokens_to_hold(num_tokens).
            short = pages_for_tokens(tokens_to_hold(len(r.prompt) + len(r.output), 0)) - len(r.page_table)
            if short > 0:
                need += short
        return need <= self.pool.free_count

    def _launch(self, reqs: list[Request], outs: dict) -> _InFlight:
        """Launch one decode step of ``reqs`` and its sampling without waiting for either.
        A request with a token in flight takes it as input from the device.

        A constrained request with a token in flight needs that token on the host for its next
        grammar mask: then the step in flight is read back (its tokens emitted into ``outs``) after
        this step's forward is launched, and the masks are filled while the forward runs; only
        this step's sampling waits for them. Rows that end at that read-back are computed and
        dropped, as an unconstrained row that stops is."""
        prev = self._inflight
        flying = prev.index if prev is not None else {}
        pending = [int(r.request_id in flying) for r in reqs]
        step = DecodeStep([r.request_id for r in reqs], [0 if p else r.last_token for r, p in zip(reqs, pending)],
                          [r.num_tokens + p for r, p in zip(reqs, pending)], [r.page_table for r in reqs], 1)
        patch = None
        if any(pending):
            at = [i for i, p in enumerate(pending) if p]
            tokens = prev.sampled.tokens
            src = tensor_on([prev.index[reqs[i].request_id] for i in at], torch.int64, tokens.device)
            patch = (at, tokens.index_select(0, src))
        hidden = self.runner.decode(step, token_patch=patch)
        self.stats.decode_tokens += len(reqs)
        for r, n in zip(reqs, step.seq_lens):
            r.num_computed = n
        tag = self.stats.steps
        # Frees from now on wait for this step: it may still write the KV of a
        # request that ends meanwhile into that request's pages (also one that
        # ends at the read-back just below).
        self.pool.hold_frees(tag)
        masks = None
        if any(r.grammar is not None for r in reqs):
            if any(p and r.grammar is not None for r, p in zip(reqs, pending)):
                prev.read = True
                self._inflight = None
                self._read_back(prev, outs, keep_hold=True)  # while the forward runs
            masks = self._grammar_masks(reqs)
        sampled = self._sample(reqs, hidden, skip_finished=True, grammar=masks)
        if sampled.packed.device.type == "cuda":
            host = torch.empty(sampled.packed.shape, dtype=sampled.packed.dtype, pin_memory=True)
            host.copy_(sampled.packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = sampled.packed, None
        return _InFlight(tag, sampled, host, done, {r.request_id: i for i, r in enumerate(reqs)})

    def _drain(self, f: _InFlight, outs: dict) -> None:
        """Read back the launched step ``f`` (waiting for it) and emit its tokens."""
        if self._inflight is f:
            self._inflight = None
        self._read_back(f, outs, keep_hold=self._inflight is not None)

    def _read_back(self, f: _InFlight, outs: dict, keep_hold: bool) -> None:
        """Wait for ``f``, give back the pages held for it, emit its tokens. keep_hold: a later step
        is launched (frees keep waiting for it); else pages are freed at once from now on."""
        if f.done is not None:
            f.done.synchronize()
        # Steps complete in order: every step up to this one has run.
        self.pool.release_held(f.tag)
        if not keep_hold:
            self.pool.hold_frees(None)
        f.sampled.emit(f.host.tolist(), outs)

    # ----------------------------------------------------------- internals
    def _out(self, outs, req: Request) -> RequestOutput:
        if req.request_id not in outs:
            outs[req.request_id] = RequestOutput(req.request_id, [], [])
        return outs[req.request_id]

    def _give_seed(self, req: Request) -> None:
        if req.seed is None:
            req.seed = self._seeds.getrandbits(64)

    def _sampling_inputs(self, reqs: list[Request]) -> tuple[SamplingMetadata, TokenHistory | None]:
        """The rows' sampling metadata on the logits' device, and their token history when
        a row uses penalties (rows without get none: padding only)."""
        dev = self.runner.device
        meta = SamplingMetadata.build([r.params for r in reqs], [r.seed for r in reqs],
                                      [r.rng_offset for r in reqs], dev, [len(r.output) for r in reqs], self.eos)
        if meta.penalties is None:
            return meta, None
        history = TokenHistory.build([r.prompt_ids() if r.params.repetition_penalty != 1.0 else None for r in reqs],
                                     [r.output if r.params.uses_penalties else None for r in reqs], dev)
        return meta, history

    def _sample(self, reqs: list[Request], hidden: torch.Tensor, skip_finished: bool = False,
                grammar: MaskJob | None = None) -> _Sampled:
        """One token for each of ``reqs`` from the head over their hidden states ``[len(reqs), hidden]``
        (one draw each; `sample_hidden`: on rank 0 for a model sharded over rank workers).
        ``skip_finished``: emit nothing for a request that ended (or was aborted) before
        the read-back (a step launched ahead of it: overlap scheduling). ``grammar``: the
        constrained rows' masks (`_grammar_masks`, started before the forward)."""
        meta, history = self._sampling_inputs(reqs)
        if grammar is not None:
            meta.grammar = grammar.wait(hidden.device)
        out = sample_hidden(self.model, hidden, meta, history)
        for r in reqs:
            r.rng_offset += 1

        def emit(rows: list[list[float]], outs) -> None:
            for r, s in zip(reqs, SampleOutput.unpack(rows, meta.top_logprobs)):
                if skip_finished and (r.finished or r.request_id not in self.requests):
                    continue
                self._emit(r, s.token, s.logprob, self._out(outs, r), s.top_logprobs)
        return _Sampled(out.packed(), emit, out.tokens)

    # ------------------------------------------------------ structured outputs
    def attach_grammar(self, req: Request) -> None:
        """Give a constrained request its matcher (a copy of the compiled grammar, cached per spec); a
        no-op for others and the second time. Raises ``ValueError`` without a compiler,
        `workers.structured.GrammarError` for a bad grammar (a decode worker calls it before it
        reserves pages, so a refusal leaves nothing behind)."""
        if req.params.grammar is None or req.grammar is not None:
            return
        if self.grammars is None:
            raise ValueError("structured outputs (a grammar) need the checkpoint's tokenizer")
        req.grammar = self.grammars.matcher(req.params.grammar)

    def _grammar_masks(self, reqs: list[Request], drafts: bool = False) -> MaskJob | None:
        """Start the token bitmasks of the constrained ones of ``reqs`` (their rows in this list) on the
        compiler's thread, or None when none is constrained (unconstrained batches pay nothing). The
        caller launches its forward, then waits. drafts: an MTP verify's ``k + 1`` positions per row."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        for i in rows:  # a no-op unless the matcher was made after tokens were generated
            reqs[i].grammar.sync(reqs[i].output)
        return self.grammars.masks(rows, [reqs[i].grammar for i in rows], self.k + 1 if drafts else 1,
                                   [reqs[i].drafts for i in rows] if drafts else None,
                                   pin=torch.device(self.runner.device).type == "cuda")

    def _emit(self, req: Request, token: int, logprob: float, out: RequestOutput,
              top_logprobs: dict[int, float] | None = None) -> bool:
        """Append one token; finish the request (True) on a stop condition."""
        req.output.append(token)
        req.logprobs.append(logprob)
        if len(req.output) == 1 and req.prompt_logprobs is not None:  # they leave with the first token
            out.prompt_logprobs, out.prompt_top_logprobs = req.prompt_logprobs.wire()
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        if req.params.top_logprobs:
            out.top_logprobs = (out.top_logprobs or []) + [top_logprobs or {}]
        p = req.params
        if req.grammar is not None:
            req.grammar.sync(req.output)
        reason = None
        if token in p.stop_token_ids or (token in self.eos and not p.ignore_eos):
            reason = FinishReason.STOP
        elif req.grammar is not None and req.grammar.error is not None:
            self._finish(req, FinishReason.ERROR, out)  # a token the mask should have refused: a bug, not output
            req.error = out.error = f"grammar: {req.grammar.error}"
            return True
        elif req.grammar is not None and req.grammar.done:
            reason = FinishReason.STOP  # the grammar is complete: nothing but EOS could follow (ignore_eos or not)
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

    def _prefill(self, chunks: list[PrefillChunk], decode: list[Request]) -> tuple[list[_Sampled], bool]:
        """One PREFILL forward over ``chunks``; its sampling sites: the prompt logprobs of the
        requests that asked (first: they are stored before token 1 is emitted), then token 1
        of the prompts that finished. The ``decode`` requests' next tokens ride along, each a
        one-token chunk over its context, when the runner's rows graphs take the chunks and them (no MTP):
        then the step makes one forward, not two, and their tokens are the last site.
        Returns (the sites, whether ``decode`` rode along)."""
        items = [WorkItem(tuple(c.request.token_ids[c.start:c.end]), c.start, frozen_pages(c.request.page_table))
                 for c in chunks]
        ride = [WorkItem((r.last_token,), r.num_tokens - 1, frozen_pages(r.page_table)) for r in decode]
        graphs = getattr(self.runner, "prefill_graphs", None)  # (DeepSeek-V4's runner has none)
        # Only a prefill that takes the rows graphs by itself (prefix hits, later chunks, several prompts): a
        # lone new prompt keeps its own graph (the whole-window prefill path, cheaper per token).
        mixed = (bool(ride) and not self.k and graphs is not None and graphs.plan.kind(items) == "rows"
                 and graphs.plan.kind(items + ride) == "rows")
        if not mixed:
            decode = []
        # Token 1's grammar masks, filled while the forward runs (rows: the fresh prompts, in `fresh`'s order).
        masks = self._grammar_masks([c.request for c in chunks if c.is_last and not c.request.output])
        decode_masks = self._grammar_masks(decode)
        batch, hidden = self.runner.forward(ForwardMode.PREFILL, items + ride if mixed else items)
        self.stats.prefill_tokens += batch.num_tokens - len(decode)
        ranges = batch.query_ranges()
        mtp_items, mtp_hidden = [], []
        finishing = []
        prompt_rows = PromptRows()
        for c, (s0, s1) in zip(chunks, ranges):
            req = c.request
            req.num_computed = c.end
            if req.prompt_logprobs is not None:
                prompt_rows.add(req.prompt_logprobs, req.prompt, c.start, c.end, s0)
            if self.k:
                # MTP cache entries need the token after each position; the
                # final prefill position waits (its next token is sampled now).
                known_end = min(c.end, prefill_length(req) - 1)
                if known_end > c.start:
                    mtp_items.append(WorkItem(tuple(req.token_ids[c.start + 1:known_end + 1]), c.start,
                                              frozen_pages(req.page_table)))
                    mtp_hidden.append(hidden[s0:s0 + known_end - c.start])
                if c.is_last:
                    req.pending_hidden, req.pending_start = hidden[s1 - 1:s1].clone(), c.end - 1
            if c.is_last:
                finishing.append((req, s1 - 1))
        if mtp_items:
            mbatch = self.runner.build_batch(ForwardMode.PREFILL, mtp_items)
            self.model.mtp_forward(mbatch, torch.cat(mtp_hidden), self.runner.cache, self.runner.backend,
                                   draft=False)
        for c in chunks:  # a later prompt with this prefix shares these pages from now on
            self.scheduler.publish(c.request)
        for req, _ in finishing:
            self.scheduler.prefill_done(req)
        # Resumed after preemption: their next input is known, nothing to sample.
        sites = []
        if prompt_rows:  # the head over these rows only, in blocks: no second forward
            sites.append(_Sampled(prompt_rows.compute(self.model.logits, hidden, self.model.cfg.vocab_size),
                                  prompt_rows.emit))
        fresh = [(req, row) for req, row in finishing if not req.output]
        if fresh:
            rows = tensor_on([row for _, row in fresh], torch.int64, hidden.device)
            sites.append(self._sample([req for req, _ in fresh], hidden.index_select(0, rows), grammar=masks))
        if decode:  # their rows follow the chunks' (one each)
            self.stats.mixed_steps += 1
            self.stats.decode_tokens += len(decode)
            for r in decode:
                r.num_computed = r.num_tokens
            n = ranges[len(chunks) - 1][1]
            sites.append(self._sample(decode, hidden[n:n + len(decode)], grammar=decode_masks))
        return sites, mixed

    def _decode(self, reqs: list[Request]) -> _Sampled:
        step = DecodeStep([r.request_id for r in reqs], [r.last_token for r in reqs], [r.num_tokens for r in reqs],
                          [r.page_table for r in reqs], 1)
        masks = self._grammar_masks(reqs)  # filled on the compiler's thread while the forward runs
        hidden = self.runner.decode(step)
        self.stats.decode_tokens += len(reqs)
        for r in reqs:
            r.num_computed = r.num_tokens
        return self._sample(reqs, hidden, grammar=masks)

    # ------------------------------------------------------------------ MTP
    def _verify(self, reqs: list[Request]) -> _Sampled:
        """The draft phase (``k`` drafts per request, left on the device) and one verify forward of
        width ``k + 1`` over ``[last token, drafts]``; the acceptance joins the step's one read-back."""
        meta, history = self._sampling_inputs(reqs)
        drafts = self.drafter.draft(reqs, meta)
        n, R = self.k + 1, len(reqs)
        tokens = []
        for r in reqs:  # the drafts' places are filled on the device (`TokenPatch`)
            tokens.append(r.last_token)
            tokens += [0] * self.k
        step = DecodeStep([r.request_id for r in reqs], tokens, [r.num_tokens - 1 + n for r in reqs],
                          [r.page_table for r in reqs], n)
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:  # their masks walk the drafts on the host: those rows' drafts come back
            index = tensor_on(constrained, torch.int64, drafts.tokens.device)
            for i, ds in zip(constrained, drafts.tokens.index_select(0, index).tolist()):
                reqs[i].drafts = ds
        masks = self._grammar_masks(reqs, drafts=True)  # the k + 1 positions' masks, while the forward runs
        hidden = self.runner.decode(step, token_patch=(list(range(R)), drafts.tokens))
        logits = self.model.logits(hidden).view(R, n, -1)
        if masks is not None:
            meta.grammar = masks.wait(logits.device)
        # A copy: the graph's output buffer is rewritten by the next step, and the pending
        # positions' hidden states feed the next draft.
        hidden = hidden.view(R, n, -1).clone()
        packed = accept(logits, drafts.tokens.to(logits.device), meta, drafts.probs, history,
                        draw_index=self.k).packed()
        starts = [r.num_tokens - 1 for r in reqs]
        for r in reqs:
            r.rng_offset += n  # k draft draws and the verify's
            r.drafts, r.draft_probs = [], None

        def emit(rows: list[list[float]], outs) -> None:
            views: list[torch.Tensor | None] = []
            for i, (r, samples) in enumerate(zip(reqs, AcceptOutput.unpack(rows, n, meta.top_logprobs))):
                accepted = len(samples) - 1
                self.stats.mtp_drafted += self.k
                self.stats.mtp_accepted += accepted
                self.stats.accepted_histogram[accepted] = self.stats.accepted_histogram.get(accepted, 0) + 1
                self.stats.decode_tokens += len(samples)
                out = self._out(outs, r)
                for s in samples:
                    if self._emit(r, s.token, s.logprob, out, s.top_logprobs):
                        break
                if r.finished:
                    views.append(None)
                    continue
                r.num_computed = r.num_tokens - 1
                r.pending_hidden, r.pending_start = hidden[i, : accepted + 1], starts[i]
                views.append(r.pending_hidden)
            self.drafter.remember(reqs, views, hidden)
        return _Sampled(packed, emit)
