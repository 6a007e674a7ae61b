"""DecodeWorker: reserves pages for a request, waits for its KV to arrive from
a prefill peer, then decodes it in the engine's running batch.

Without a KV link (``link=None``: monolithic serving, no NIXL agent) it
takes requests with `add_request` instead, which the engine prefills itself
in chunks (as the offline ``LLM(pd=False)`` does) before decoding them in the
same batch. Both kinds can share one engine: stepping is the engine's either
way."""

from __future__ import annotations

from dataclasses import dataclass

from transfer import ReceiveStatus
from workers.engine import Engine, RequestOutput
from workers.kv_link import KVLink
from workers.prefill_worker import PrefillResult
from workers.prefix_cache import held_keys, waits_for_computing
from workers.request import FinishReason, Request, RequestState, unavailable


@dataclass
class _Awaiting:
    request: Request
    cached: int = 0
    """Leading pages of ``request.page_table`` shared from the prefix cache (the rest receive the push)."""
    transfer_done: bool = False
    result: PrefillResult | None = None



class DecodeWorker:
    def __init__(self, engine: Engine, link: KVLink | None, deadline_s: float = 60.0):
        """``link`` None: no prefill peers; requests come through `add_request` only."""
        self.engine, self.link, self.deadline_s = engine, link, deadline_s
        # Pages of a request that ended without its KV go back through the
        # receiver: only once no prefill WRITE can still land in them.
        self.receiver = None if link is None else link.receiver(release_pages=lambda ids: self.pool.free_transfer_ids(ids))
        self.awaiting: dict[str, _Awaiting] = {}

    @property
    def pool(self):
        return self.engine.pool

    def _check_new(self, req: Request) -> None:
        if req.request_id in self.awaiting or req.request_id in self.engine.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")

    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue ``req`` for local prefill by the engine (pages are taken as its chunks are
        scheduled); returns the engine's final error output at once if the pool can never
        hold it. Raises ``ValueError`` (duplicate id, stop strings without a tokenizer)."""
        self._check_new(req)
        return self.engine.add_request(req)

    def waits_for_prefix(self, req: Request) -> bool:
        """Whether ``req`` should wait before `reserve`: the KV of more of its leading pages than the prefix cache
        holds is on its way here for other requests (`workers.prefix_cache.waits_for_computing`: their pages are
        cached when they arrive, `Engine.admit_prefilled`), so it is neither prefilled nor pushed twice. A
        request asking for prompt logprobs reuses nothing and never waits."""
        cache = self.pool.prefix_cache
        if self.receiver is None or cache is None or not self.pool.publishes or req.params.prompt_logprobs is not None:
            return False
        computing = {key for a in self.awaiting.values() for key in held_keys(cache, a.request, a.request.prompt)}
        return bool(computing) and waits_for_computing(cache, req.prompt, held_keys(cache, req, req.prompt), computing)

    def reserve(self, req: Request, prefill_agent: str) -> list[int]:
        """Hold ``ceil(prompt_len / 64)`` pages (the shared helper) for ``req``: the prompt's longest cached
        prefix from this pool's prefix cache (shared read-only, ``req.cached_pages`` of them), then fresh
        pages, which it expects from ``prefill_agent``. Returns the fresh pages: what prefill pushes into
        (its task's ``decode_pages``; ``decode_cached_pages`` = ``req.cached_pages``). Raises
        ``PoolExhausted`` / ``ValueError``."""
        if self.receiver is None:
            raise RuntimeError("this decode worker has no KV link: prefill locally with add_request")
        self._check_new(req)
        self.engine.attach_grammar(req)  # before any page is taken: it raises for a grammar it cannot compile
        n = len(req.prompt)
        pages, cached = self.pool.acquire_tokens(req.prompt, n)
        # Only the fresh pages receive: a cached page is never written, by NIXL or anyone. (A grouped
        # cache's ids are its pages' transfer units, `workers.page_tables`.)
        ids, tokens = self.pool.transfer_plan(pages, n, cached)
        try:
            self.receiver.expect(req.request_id, prefill_agent, tokens, ids, self.deadline_s)
        except Exception:
            self.pool.free(pages)
            raise
        req.page_table, req.state, req.cached_pages = pages, RequestState.AWAITING_KV, cached
        self.awaiting[req.request_id] = _Awaiting(req, cached)
        return ids

    def on_prefill_result(self, result: PrefillResult) -> list[RequestOutput]:
        """Prefill's answer (first token, last hidden); admits once the pages are in."""
        a = self.awaiting.get(result.request_id)
        if a is None:
            return []  # aborted meanwhile: a late answer is ignored
        if not result.ok:
            ended = self.receiver.cancel(result.request_id, result.error or "prefill failed")
            return [self._fail(a, result.error or "prefill failed", free_pages=ended is None)]
        a.result = result
        return self._maybe_admit(a)

    def abort(self, request_id: str) -> bool:
        a = self.awaiting.pop(request_id, None)
        if a is not None:
            # Still receiving: the receiver keeps the pushed pages until prefill
            # settles. Already received (None): they are ours to free.
            self._free(a, received=self.receiver.cancel(request_id, "aborted") is None)
            a.request.finish(FinishReason.ABORT)
            return True
        return self.engine.abort(request_id)

    def step(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        for res in self.receiver.poll() if self.receiver is not None else ():
            a = self.awaiting.get(res.request_id)
            if a is None:
                continue
            if res.status is ReceiveStatus.DONE:
                a.transfer_done = True
                outs += self._maybe_admit(a)
            else:
                outs.append(self._fail(a, unavailable(f"KV transfer {res.status.value}: {res.reason}"), free_pages=False))
        if self.engine.has_work:
            outs += self.engine.step()
        return outs

    @property
    def has_work(self) -> bool:
        """Requests, or pages the receiver holds until prefill settles (they return to the pool on `step`)."""
        return bool(self.awaiting) or self.engine.has_work or (self.receiver is not None and self.receiver.has_work)

    def _fail(self, a: _Awaiting, reason: str, free_pages: bool) -> RequestOutput:
        """``free_pages``: False when the receiver ended the wait (it gives the pages back itself)."""
        self.awaiting.pop(a.request.request_id, None)
        self._free(a, received=free_pages)
        a.request.finish(FinishReason.ERROR, reason)
        return RequestOutput(a.request.request_id, [], [], True, FinishReason.ERROR.value, reason)

    def _free(self, a: _Awaiting, received: bool) -> None:
        """Drop an awaiting request's pages: its cached ones now; the pushed ones too if ``received``, else
        the receiver gives them back once no prefill WRITE can land in them."""
        pages = a.request.page_table
        if received:
            self.pool.free(pages)
        elif a.cached:
            self.pool.free_cached(pages, a.cached)
        a.request.page_table = []

    def _maybe_admit(self, a: _Awaiting) -> list[RequestOutput]:
        if not (a.transfer_done and a.result is not None):
            return []
        self.awaiting.pop(a.request.request_id)
        req, res = a.request, a.result
        if res.seed is not None:  # continue prefill's stream after its draw of token 1
            req.seed, req.rng_offset = res.seed, res.rng_offset
        if res.prompt_logprobs is not None:  # computed in prefill's pass; they leave with token 1
            req.prompt_logprobs = res.prompt_logprobs
        return self.engine.admit_prefilled(req, res.first_token, res.first_logprob, res.last_hidden,
                                           res.first_top_logprobs)
