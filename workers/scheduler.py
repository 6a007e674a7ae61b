"""Continuous batching with chunked prefill.

Every step the scheduler (1) makes sure each running request has pages for
what the step will write, preempting the newest running request when the pool
runs dry, (2) puts every running request in the decode batch, and (3) fills a
prefill token budget (``chunk_size``) with the next chunks of prompts,
admitting waiting requests while pages allow. A long prompt is thus split into
chunks that interleave with decode steps of other requests. With a prefix
cache in the pool, a prompt's first chunk starts after its cached prefix; a
prompt's pages are cached as soon as they are written (`Scheduler.publish`),
and a waiting prompt whose leading pages another prompt is computing right now
waits for them instead of computing them a second time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from attention.formats import PAGE_SIZE
from workers.page_pool import PagePool, PoolExhausted
from workers.prefix_cache import held_keys, waits_for_computing
from workers.request import FinishReason, Request, RequestState


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 64
    chunk_size: int = 256          # prefill tokens per step (all requests together)
    mtp_draft_tokens: int = 0
    overlap: bool = True           # launch pure-decode steps ahead of the read-back (`Engine.step`)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.chunk_size < 1:
            raise ValueError("max_batch_size and chunk_size must be >= 1")
        if not 0 <= self.mtp_draft_tokens <= 3:
            raise ValueError(f"mtp_draft_tokens must be in 0..3, got {self.mtp_draft_tokens}")


def tokens_to_hold(num_tokens: int, draft_tokens: int) -> int:
    """Cache positions a running request may write in its next step.

    A verify step writes positions up to ``num_tokens - 1 + k``; the draft
    chain after it writes MTP positions up to ``num_tokens + 2k - 1``.
    """
    return num_tokens + 2 * draft_tokens + 1


def prefill_length(req: Request) -> int:
    """Tokens a (re)admitted request must prefill: the whole prompt for a new
    request; all but the last token for one resumed after preemption (its last
    token is the next decode input)."""
    return req.num_tokens - 1 if req.output else len(req.prompt)


def cacheable_tokens(req: Request, mtp: bool) -> int:
    """Leading positions of ``req`` whose bytes are final in every cache, so its full pages below may be
    kept in the prefix cache when it releases them: target KV of the positions computed, except the newest
    token's (an overlapped step in flight may still be writing it); with MTP (``mtp``) also only below
    ``pending_start``, the first position whose MTP-layer entry is not written with its true next token yet
    (it is rewritten once that token is known; 0 while a prompt is prefilling)."""
    valid = min(req.num_computed, req.num_tokens - 1)
    if mtp:
        valid = min(valid, req.pending_start)
    return max(valid, 0)


@dataclass
class PrefillChunk:
    request: Request
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == prefill_length(self.request)


@dataclass
class Schedule:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: PagePool, cfg: SchedulerConfig):
        self.pool, self.cfg = pool, cfg
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self._arrivals = 0
        # Whether prompts' pages are cached while being computed (`publish`): only then can a
        # request wait for another's prefix instead of computing it.
        self._shares_prefixes = getattr(pool, "publishes", False) and getattr(pool, "prefix_cache", None) is not None

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Queue a request; one that can never fit the pool is finished with an error."""
        error = self.pool.capacity_error(tokens_to_hold(len(req.prompt) + req.params.max_new_tokens,
                                                        self.cfg.mtp_draft_tokens))
        if error is not None:
            req.finish(FinishReason.ERROR, f"request needs {error} "
                                           f"(prompt {len(req.prompt)} + max_new_tokens {req.params.max_new_tokens})")
            return
        req.arrival = self._arrivals
        self._arrivals += 1
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose KV arrived from a prefill peer joins the decode batch."""
        req.state = RequestState.RUNNING
        req.arrival = self._arrivals
        self._arrivals += 1
        self.running.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of every queue and free its pages (finish or abort)."""
        for q in (self.prefilling, self.running):
            if req in q:
                q.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.release_pages(req)

    def release_pages(self, req: Request) -> None:
        """Drop ``req``'s pages; with a prefix cache its written full pages stay cached (`cacheable_tokens`)."""
        if req.page_table:
            if self.pool.prefix_cache is None:
                self.pool.free(req.page_table)
            else:
                self.pool.free(req.page_table, req.token_ids, cacheable_tokens(req, self.cfg.mtp_draft_tokens > 0))
            req.page_table = []  # (a grouped table is emptied by the free; a fresh one comes at re-admission)

    def publish(self, req: Request) -> None:
        """Cache ``req``'s full pages whose bytes are final (`cacheable_tokens`) while it still holds them:
        called after each prefill chunk and when a prefilled request joins decode."""
        if req.page_table:
            self.pool.publish(req.token_ids, req.page_table, cacheable_tokens(req, self.cfg.mtp_draft_tokens > 0))

    def _prompt_keys(self, req: Request, n: int) -> list[bytes]:
        """The prefix-cache keys of the ``n`` tokens ``req`` prefills (kept on the request)."""
        return held_keys(self.pool.prefix_cache, req, req.token_ids[:n])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # --------------------------------------------------------------- schedule
    def _grow(self, req: Request, tokens: int) -> bool:
        return self.pool.grow(req.page_table, tokens)

    def _preempt(self, victim: Request, out: Schedule) -> None:
        # Recompute preemption: drop the KV, keep the tokens; re-admission
        # prefills prompt + output (all but the last token).
        self.running.remove(victim)
        self.release_pages(victim)
        victim.num_computed = victim.pending_start = 0
        victim.pending_hidden, victim.drafts, victim.draft_probs = None, [], None
        victim.state = RequestState.WAITING
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> Schedule:
        out = Schedule()
        k = self.cfg.mtp_draft_tokens
        # 1. Pages for running requests, oldest first; preempt the newest on shortage.
        order = sorted(self.running, key=lambda r: r.arrival)
        for req in order:
            if req.state is not RequestState.RUNNING:
                continue  # preempted for an older request just now
            while not self._grow(req, tokens_to_hold(req.num_tokens, k)):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim, out)
                if victim is req:
                    break
        out.decode = [r for r in order if r.state is RequestState.RUNNING][: self.cfg.max_batch_size]

        # 2. Prefill chunks within the token budget.
        budget = self.cfg.chunk_size
        for req in list(self.prefilling):
            if budget == 0:
                break
            end = min(prefill_length(req), req.num_computed + budget)
            out.prefill.append(PrefillChunk(req, req.num_computed, end))
            budget -= end - req.num_computed
        computing = None
        if self._shares_prefixes and self.waiting:
            computing = {key for r in self.prefilling for key in self._prompt_keys(r, prefill_length(r))}
        i = 0
        while budget > 0 and i < len(self.waiting) and len(self.running) + len(self.prefilling) < self.cfg.max_batch_size:
            req = self.waiting[i]
            n = prefill_length(req)
            # The prompt's cached prefix is not computed again (prompt logprobs need every position's
            # logits: such a request reuses nothing).
            reuse = req.prompt_logprobs is None
            if computing is not None and reuse and waits_for_computing(self.pool.prefix_cache, req.token_ids[:n],
                                                                       self._prompt_keys(req, n), computing):
                i += 1  # its prefix is being computed: it waits for those pages; later requests may go first
                continue
            hold = tokens_to_hold(n + 1, k)
            try:
                req.page_table, cached = self.pool.acquire_tokens(req.token_ids[:n], hold, reuse=reuse)
            except PoolExhausted:
                break  # stays queued until pages free up
            del self.waiting[i]
            if computing is not None:
                computing.update(self._prompt_keys(req, n))
            req.num_computed = cached * PAGE_SIZE
            req.state = RequestState.PREFILLING
            self.prefilling.append(req)
            end = min(n, req.num_computed + budget)
            out.prefill.append(PrefillChunk(req, req.num_computed, end))
            budget -= end - req.num_computed
        return out

    def prefill_done(self, req: Request) -> None:
        self.prefilling.remove(req)
        req.state = RequestState.RUNNING
        self.running.append(req)
