"""The worker thread of a decode replica: runs a `DecodeWorker`.

Per request (DESIGN.md, request path 2-5): `reserve` takes
``ceil(prompt / 64)`` pages and opens an any-peer receive (the router picks
the prefill replica after the pages are reserved; the receive binds to the
handshaked prefill agent that pushes first), then emits `Reserved` on the
request's stream. The replica calls a prefill replica and hands its answer to
`prefill_result`; once the pages have landed too, the request joins the
running batch and every step's `RequestOutput` is emitted on its stream.
Requests that find the pool full wait here, in arrival order, until pages
come back, but no longer than their ``admit_by`` time (``deployments.admission``):
then they are refused ``overloaded: decode queue timeout`` (429 at the ingress).

In monolithic mode the worker has no KV link: `add` hands a request to the
engine, which queues it, prefills it in chunks and decodes it; the request's
outputs are emitted the same way, and one the pool can never hold is refused
with the same error output as a PD request the decode pool cannot take; one
the engine has not started (no prefill chunk yet) by its ``admit_by`` time is
aborted with the same queue-timeout refusal.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from attention.formats import pages_for_tokens
from deployments.admission import overload_message, timeout_detail, waited
from deployments.metrics import hop_trace
from deployments.replica_stats import DecodeStats, PrefixKeys, StepRecord
from deployments.worker_thread import WorkerThread
from workers.decode_worker import DecodeWorker
from workers.engine import RequestOutput
from workers.page_pool import PoolExhausted
from workers.prefill_worker import PrefillResult
from workers.request import FinishReason, Request, RequestState
from workers.scheduler import prefill_length

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console


@dataclass(frozen=True)
class Reserved:
    """Emitted once a request's pages are reserved and its receive is open: ``pages`` the ones prefill pushes
    into, after the ``cached_pages`` leading pages this replica's prefix cache already holds."""

    pages: list[int]
    cached_pages: int = 0


def error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(request_id, [], [], True, FinishReason.ERROR.value, message)


def _overloaded(request_id: str, reason: str, why: str = "pages") -> RequestOutput:
    """The refusal of a request the decode page pool cannot take, or (``why="queue_timeout"``) that waited
    past its ``admit_by`` time (429 ``overloaded`` at the ingress)."""
    return error_output(request_id, overload_message("decode", why, reason))


class DecodeThread(WorkerThread):
    EXPIRE_EVERY_S = 0.05
    """How often waiting requests are checked against their ``admit_by`` time (not every step)."""

    def __init__(self, worker: DecodeWorker, worker_id: str | None = None, queue_timeout_s: float = 0.0):
        """``worker_id``: the replica's name; default its link's (required for a worker without a link).
        ``queue_timeout_s``: ``limits.queue_timeout_s`` as resolved, named in queue-timeout refusals."""
        if worker_id is None:
            if worker.link is None:
                raise ValueError("a decode worker without a KV link needs a worker_id")
            worker_id = worker.link.agent.worker_id
        super().__init__(f"decode:{worker_id}")
        self.worker = worker
        self.prefix_keys = PrefixKeys(worker.pool)
        self.worker_id = worker_id
        # One page no request ever uses: prefill replicas write their warm-up
        # WRITE of a new pair into it (none without a link: no prefill peers).
        self.warmup_page = worker.pool.reserve_warmup() if worker.link is not None else None
        self.pending: deque[Request] = deque()
        self.queue_timeout_s = queue_timeout_s
        # Request id -> wall-clock time by which it must start, while it waits (pages, or the engine's queue).
        self.admit_by: dict[str, float] = {}
        self._next_expiry = 0.0

    @property
    def agent_name(self) -> str:
        """The NIXL agent's name; without a link, the worker id (what stats and logs call the replica)."""
        return self.worker.link.agent.name if self.worker.link is not None else self.worker_id

    # ------------------------------------------------- commands (worker thread)
    def add(self, req: Request, admit_by: float | None = None) -> None:
        """Monolithic mode: queue ``req`` for the engine's own chunked prefill, then decode.
        A request the pool can never hold (or a duplicate id, or one past ``admit_by``) gets its
        error output now."""
        hop_trace.mark(req.request_id, "engine.added")
        if self._late(req.request_id, admit_by):
            return
        try:
            refused = self.worker.add_request(req)
        except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: this request fails alone
            self.emit(req.request_id, error_output(req.request_id, str(e)))
            return
        if refused is not None:
            self.emit(req.request_id, _overloaded(req.request_id, refused.error or "refused"))
        elif admit_by is not None:
            self.admit_by[req.request_id] = admit_by

    def reserve(self, req: Request, admit_by: float | None = None) -> None:
        """Reserve pages for ``req`` now or when some come back, before ``admit_by`` (wall clock);
        emits `Reserved` (or an error output)."""
        if self._late(req.request_id, admit_by):
            return
        if admit_by is not None:
            self.admit_by[req.request_id] = admit_by
        self.pending.append(req)
        self._admit()

    def _late(self, request_id: str, admit_by: float | None) -> bool:
        """Refuse a request that arrives past its ``admit_by`` time (it waited in Serve's queues)."""
        detail = waited(admit_by, self.queue_timeout_s)
        if detail is not None:
            self.emit(request_id, _overloaded(request_id, detail, "queue_timeout"))
        return detail is not None

    def prefill_result(self, result: PrefillResult, agent: str | None = None) -> None:
        """Prefill's answer; ``agent``: the prefill agent that answered (checked against the one that pushed)."""
        bound = self.worker.receiver.peer_of(result.request_id)
        if result.ok and agent is not None and bound is not None and bound != agent:
            result = PrefillResult(result.request_id, False, error=f"pages pushed by {bound}, answer from {agent}")
        for out in self.worker.on_prefill_result(result):
            self.emit(out.request_id, out)

    def abort(self, request_id: str) -> None:
        """Client gone or prefill call failed: drop the request at whatever phase, freeing its pages."""
        self.pending = deque(r for r in self.pending if r.request_id != request_id)
        self.admit_by.pop(request_id, None)
        self.worker.abort(request_id)

    def learn_peer(self, offer: bytes) -> str:
        return self.worker.link.peers.accept(offer).agent_name

    def forget_peer(self, agent_name: str) -> None:
        """The prefill replica left the directory: requests it was pushing fail at the next poll."""
        self.worker.link.peers.forget(agent_name)

    # ------------------------------------------------------------ worker loop
    def _admit(self) -> None:
        i = 0
        while i < len(self.pending):
            req = self.pending[i]
            if self.worker.waits_for_prefix(req):
                i += 1  # its prefix's KV is arriving for another request: it reuses those pages; later ones go first
                continue
            try:
                pages = self.worker.reserve(req, None)
            except PoolExhausted as e:
                if self.worker.has_work:
                    return  # running requests will free pages
                del self.pending[i]
                self.admit_by.pop(req.request_id, None)
                self.emit(req.request_id, _overloaded(req.request_id, str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: this request fails alone
                del self.pending[i]
                self.admit_by.pop(req.request_id, None)
                self.emit(req.request_id, error_output(req.request_id, str(e)))
                continue
            del self.pending[i]
            self.admit_by.pop(req.request_id, None)  # started: the transfer deadline bounds it from here
            self.emit(req.request_id, Reserved(pages, req.cached_pages))

    def _expire(self) -> None:
        """Refuse every waiting request past its ``admit_by`` time: PD requests still without pages, and
        monolithic requests the engine has not started (an entry is dropped once its request started)."""
        now = time.time()
        if not self.admit_by or now < self._next_expiry:
            return
        self._next_expiry = now + self.EXPIRE_EVERY_S
        pending = {r.request_id for r in self.pending}
        late = set()
        for rid, deadline in list(self.admit_by.items()):
            req = self.worker.engine.requests.get(rid)
            if rid not in pending and not (req is not None and req.state is RequestState.WAITING and not req.output):
                del self.admit_by[rid]  # started (or gone): nothing to time out
            elif now > deadline:
                late.add(rid)
        if not late:
            return
        self.pending = deque(r for r in self.pending if r.request_id not in late)
        for rid in late:
            del self.admit_by[rid]
            self.worker.engine.abort(rid)  # a queued monolithic request holds no pages; a no-op in PD
            self.emit(rid, _overloaded(rid, timeout_detail(self.queue_timeout_s), "queue_timeout"))

    def has_work(self) -> bool:
        return bool(self.pending) or self.worker.has_work

    def tick(self) -> bool:
        eng = self.worker.engine
        computing = eng.has_work
        s = eng.stats
        # What the step did, from the engine's counters (no hook in the engine).
        prefilled, decoded = s.prefill_tokens, s.decode_tokens
        accepted = dict(s.accepted_histogram) if eng.k else None
        t0 = time.perf_counter()
        outs = self.worker.step()
        if computing:
            self._record_step(time.perf_counter() - t0, prefilled, decoded, accepted)
        self.emit_many([(out.request_id, out) for out in outs])
        self._expire()
        if self.pending:
            self._admit()
        return computing

    def _record_step(self, seconds: float, prefilled: int, decoded: int, accepted: dict[int, int] | None) -> None:
        """Append the step's `StepRecord` (none for a step that only read back or polled)."""
        eng = self.worker.engine
        s = eng.stats
        lengths = ()
        if accepted is not None:
            lengths = tuple(s.accepted_histogram.get(n, 0) - accepted.get(n, 0) for n in range(eng.k + 1))
        if s.prefill_tokens > prefilled:  # a chunk ran (monolithic mode, or a re-prefill after preemption)
            self.steps.append(StepRecord("prefill", seconds, s.prefill_tokens - prefilled, lengths, time.time()))
        elif s.decode_tokens > decoded:
            self.steps.append(StepRecord("verify" if eng.k else "decode", seconds, s.decode_tokens - decoded, lengths,
                                         time.time()))

    def snapshot(self) -> DecodeStats:
        w, eng = self.worker, self.worker.engine
        s = eng.stats
        running = len(eng.scheduler.running) + len(eng.scheduler.prefilling)
        queued = len(self.pending) + len(eng.scheduler.waiting)
        return DecodeStats(
            agent=self.agent_name,
            free_pages=w.pool.free_count,
            total_pages=w.pool.num_pages,
            **self.prefix_keys.fields(),
            queued=queued,
            reserved_pages=0 if self.warmup_page is None else 1,  # the warm-up page
            running=running,
            awaiting_kv=len(w.awaiting),
            held_pages=w.receiver.held_pages if w.receiver is not None else 0,
            requests=running + len(w.awaiting) + queued,
            # Queued here for pages (pd), or in the engine for a (re-)prefill.
            queued_prompt_pages=sum(pages_for_tokens(len(r.prompt)) for r in self.pending)
            + sum(pages_for_tokens(prefill_length(r)) for r in eng.scheduler.waiting),
            decode_tokens=s.decode_tokens,
            mtp_drafted=s.mtp_drafted,
            mtp_accepted=s.mtp_accepted,
            mtp_acceptance_rate=s.mtp_acceptance_rate,
            preemptions=s.preemptions,
            decode_graph_replays=sum(g.replays for g in getattr(eng.runner, "decode_graphs", {}).values()),
            known_prefills=len(w.link.peers.peers()) if w.link is not None else 0,
            prefill_graph_replays=getattr(getattr(eng.runner, "prefill_graphs", None), "replays", 0),
            mixed_steps=s.mixed_steps,
        )

    def fail_all(self, message: str) -> None:
        for req in list(self.pending):
            self.emit(req.request_id, error_output(req.request_id, message))
        for rid in list(self.worker.awaiting) + list(self.worker.engine.requests):
            self.emit(rid, error_output(rid, message))
