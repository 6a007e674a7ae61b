"""The worker thread of a prefill replica: runs a `PrefillWorker`.

Tasks (from decode replicas) queue here until the pool has pages for them,
then are prefilled chunk by chunk; each chunk's pages are pushed to the
decode replica that reserved them, and the final `PrefillResult` (first
token, last hidden state) goes back on the task's stream. The handshake with
a decode replica is made here too (the NIXL agent belongs to this thread):
from the peer directory at start (with a warm-up WRITE), or from the offer a
task carries when its decode replica is not known yet (a new or restarted
decode epoch). A task still waiting for pages at its ``admit_by`` time
(``deployments.admission``) is refused ``overloaded: prefill queue timeout``:
its decode replica fails the request with that message (429 at the ingress)
while its transfer deadline still leaves time to answer.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from deployments.admission import overload_message, timeout_detail, waited
from deployments.replica_stats import PrefillStats, PrefixKeys, StepRecord
from deployments.worker_thread import WorkerThread
from workers.page_pool import PoolExhausted
from workers.prefill_worker import PrefillResult, PrefillTask, PrefillWorker

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console


class PrefillThread(WorkerThread):
    EMITTED_POINT = "prefill.emitted"

    def __init__(self, worker: PrefillWorker, warm_up: bool = True, queue_timeout_s: float = 0.0):
        """``queue_timeout_s``: ``limits.queue_timeout_s`` as resolved, named in queue-timeout refusals."""
        super().__init__(f"prefill:{worker.link.agent.worker_id}")
        self.worker = worker
        self.prefix_keys = PrefixKeys(worker.pool)
        self.warm_up = warm_up
        self.pending: deque[PrefillTask] = deque()
        self.queue_timeout_s = queue_timeout_s
        self.admit_by: dict[str, float] = {}  # request id -> wall-clock time to start by, while pending
        self.warmed: set[str] = set()
        self.completed = 0

    @property
    def agent_name(self) -> str:
        return self.worker.link.agent.name

    # ------------------------------------------------- commands (worker thread)
    def submit(self, task: PrefillTask, decode_offer: bytes | None, admit_by: float | None = None) -> None:
        """Queue ``task`` until ``admit_by`` (wall clock) at most; its result is emitted on its stream.
        Handshakes with its decode replica if needed."""
        if waited(admit_by, self.queue_timeout_s) is not None:  # it waited in Serve's queues past its time
            self.emit(task.request_id, self._timed_out(task.request_id))
            return
        peers = self.worker.link.peers
        try:
            if not peers.knows(task.decode_agent):
                if decode_offer is None:
                    raise ValueError(f"decode agent {task.decode_agent} is unknown and sent no handshake offer")
                peers.accept(decode_offer)
        except Exception as e:  # noqa: BLE001 - incompatible or stale peer: this task fails, not the replica
            self.emit(task.request_id, PrefillResult(task.request_id, False, error=f"handshake: {e}"))
            return
        if admit_by is not None:
            self.admit_by[task.request_id] = admit_by
        self.pending.append(task)
        self._admit()

    def _timed_out(self, request_id: str) -> PrefillResult:
        return PrefillResult(request_id, False, error=overload_message(
            "prefill", "queue_timeout", timeout_detail(self.queue_timeout_s)))

    def _expire(self) -> None:
        """Refuse the pending tasks past their ``admit_by`` time."""
        if not self.admit_by:
            return
        now = time.time()
        late = {rid for rid, t in self.admit_by.items() if now > t}
        if late:
            self.pending = deque(t for t in self.pending if t.request_id not in late)
            for rid in late:
                del self.admit_by[rid]
                self.emit(rid, self._timed_out(rid))

    def abort(self, request_id: str) -> None:
        """Drop a task (its decode caller gave up): queued or in flight; decode is told by the pusher."""
        self.pending = deque(t for t in self.pending if t.request_id != request_id)
        self.admit_by.pop(request_id, None)
        self.worker.abort(request_id, "decode cancelled the prefill call")

    def learn_peer(self, offer: bytes, warmup_page: int | None) -> str:
        """Handshake with a decode replica from its directory entry; warm the pair up once."""
        peer = self.worker.link.peers.accept(offer)
        if self.warm_up and warmup_page is not None and peer.agent_name not in self.warmed:
            # The first WRITE of a new pair pays connection setup and remote
            # registration: pay it now, into the page decode set aside for it.
            try:
                secs = self.worker.pusher.warm_up(peer.agent_name, local_page=0, remote_page=warmup_page)
                log.info("warmed up %s -> %s in %.3fs", self.agent_name, peer.agent_name, secs)
            except Exception as e:  # noqa: BLE001 - a failed warm-up is a slower first request, not an error
                log.warning("warm-up to %s failed: %s", peer.agent_name, e)
            self.warmed.add(peer.agent_name)
        return peer.agent_name

    def forget_peer(self, agent_name: str) -> None:
        """The decode replica left the directory: its pushes fail now, not at their deadline."""
        self.worker.link.peers.forget(agent_name)
        self.warmed.discard(agent_name)

    # ------------------------------------------------------------ worker loop
    def _admit(self) -> None:
        i = 0
        while i < len(self.pending):
            task = self.pending[i]
            if self.worker.waits_for_prefix(task):
                i += 1  # its prefix is being computed: it reuses those pages; the tasks behind it go first
                continue
            try:
                self.worker.submit(task)
            except PoolExhausted as e:
                if self.worker.active:
                    return  # pages come back as active prefills finish
                del self.pending[i]
                self.admit_by.pop(task.request_id, None)
                self.emit(task.request_id, PrefillResult(task.request_id, False, error=f"prefill page pool: {e}"))
                continue
            except Exception as e:  # noqa: BLE001 - e.g. the decode peer vanished meanwhile
                del self.pending[i]
                self.admit_by.pop(task.request_id, None)
                self.emit(task.request_id, PrefillResult(task.request_id, False, error=str(e)))
                continue
            del self.pending[i]
            self.admit_by.pop(task.request_id, None)  # started

    def has_work(self) -> bool:
        # The pusher too: decode holds a cancelled request's pages until the
        # pusher answers (at once, or once that request's WRITEs ended).
        return bool(self.worker.active or self.pending) or self.worker.pusher.has_work()

    def tick(self) -> bool:
        computing = any(a.done < len(a.task.token_ids) for a in self.worker.active.values())
        # The tasks' progress before the step: what it computed is the difference
        # (a task whose push ended this step has left `active`, not its record).
        before = [(a, a.done) for a in self.worker.active.values()]
        t0 = time.perf_counter()
        results = self.worker.step()
        if computing:
            self.steps.append(StepRecord("prefill", time.perf_counter() - t0, sum(a.done - d for a, d in before),
                                         ended=time.time()))
        for res in results:
            self.completed += 1
            self.emit(res.request_id, res)
        self._expire()
        self._admit()
        return computing

    def snapshot(self) -> PrefillStats:
        w = self.worker
        queued_tokens = sum(len(t.token_ids) for t in self.pending)
        queued_tokens += sum(len(a.task.token_ids) - a.done for a in w.active.values())
        return PrefillStats(
            agent=self.agent_name,
            free_pages=w.pool.free_count,
            total_pages=w.pool.num_pages,
            **self.prefix_keys.fields(),
            queued=len(self.pending),
            active=len(w.active),
            queued_tokens=queued_tokens,
            completed=self.completed,
            known_decodes=len(w.link.peers.peers()),
            prefill_graph_replays=getattr(getattr(w.runner, "prefill_graphs", None), "replays", 0),
        )

    def fail_all(self, message: str) -> None:
        for task in list(self.pending):
            self.emit(task.request_id, PrefillResult(task.request_id, False, error=message))
        for rid in list(self.worker.active):
            self.emit(rid, PrefillResult(rid, False, error=message))
