"""What a replica reports about itself: one frozen dataclass per role.

A replica's worker thread takes a snapshot after every round; the snapshot
crosses the Ray boundary three ways — Serve's routing stats (a plain dict,
as Serve requires), the peer directory behind ``/stats`` and ``/health``,
and the replica's own Prometheus gauges. Every reader turns the dict back
into the dataclass with `from_dict`, which refuses a missing or unknown
field: a misspelt name fails loudly instead of reading as 0.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

S = TypeVar("S", bound="ReplicaStats")


@dataclass(frozen=True)
class ReplicaStats:
    """Fields every replica reports. ``free_pages`` / ``total_pages``: its page pool (free includes the
    prefix cache's unreferenced pages: reclaimable); ``queued``: requests waiting in the replica for pages.
    The prefix cache (`workers.prefix_cache`; zeros without one): ``cached_pages`` held,
    ``prefix_queries`` / ``prefix_hits`` prompt tokens looked up / found cached and ``prefix_evictions``
    since start, ``prefix_keys`` the routing keys of its cached pages (`PrefixKeys`: a replica that
    restarts reports none)."""

    agent: str
    free_pages: int
    total_pages: int
    queued: int
    cached_pages: int
    prefix_queries: int
    prefix_hits: int
    prefix_evictions: int
    prefix_keys: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """The wire form (Serve's routing stats and the directory take plain dicts)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[S], d: Mapping[str, Any]) -> S:
        """Back from `to_dict`; a TypeError names any missing or unknown field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(d) - names, names - set(d)
        if unknown or missing:
            raise TypeError(f"{cls.__name__}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        d = dict(d)
        if isinstance(d["prefix_keys"], list):
            d["prefix_keys"] = tuple(d["prefix_keys"])  # a list after JSON (the directory, /stats)
        return cls(**d)

    @classmethod
    def from_routing(cls: type[S], d: Mapping[str, Any] | None) -> S | None:
        """`from_dict` of a replica's routing stats; None before its first report (Serve starts with ``{}``)."""
        return cls.from_dict(d) if d else None

    @property
    def waiting(self) -> int:
        """Requests waiting in the replica (for pages, KV or a batch slot): the queue-depth gauge."""
        return self.queued


REPORTED_KEYS = 4096
"""Most routing keys a replica reports (64-bit each): 4096 pages = 256k tokens of cached prefixes, the ones
referenced by running requests first, then the most recently used (`PrefixCache.routing_keys`)."""

KEYS_PERIOD_S = 1.0
"""How often a replica recomputes its reported keys (`deployments.router.ROUTING_STATS_PERIOD_S`: what
Serve's routing stats refresh at), not after every engine round."""


class PrefixKeys:
    """A page pool's prefix-cache figures for the replica's snapshots, its routing keys recomputed at most
    every `KEYS_PERIOD_S` (the worker thread snapshots after every round)."""

    def __init__(self, pool, clock=time.monotonic):
        self.pool, self.clock = pool, clock
        self._keys: tuple[int, ...] = ()
        self._at = -float("inf")

    def fields(self) -> dict[str, Any]:
        """The `ReplicaStats` prefix-cache fields, as keyword arguments."""
        cache = self.pool.prefix_cache
        if cache is None:
            return dict(cached_pages=0, prefix_queries=0, prefix_hits=0, prefix_evictions=0, prefix_keys=())
        now = self.clock()
        if now - self._at >= KEYS_PERIOD_S:
            self._keys, self._at = tuple(cache.routing_keys(REPORTED_KEYS)), now
        c = cache.counters
        return dict(cached_pages=len(cache), prefix_queries=c.queries, prefix_hits=c.hits,
                    prefix_evictions=c.evictions, prefix_keys=self._keys)


@dataclass(frozen=True)
class PrefillStats(ReplicaStats):
    """``active``: tasks being prefilled; ``queued_tokens``: prompt tokens not computed yet (queued
    and active); ``completed``: prefills answered since start; ``known_decodes``: handshaked decode agents;
    ``prefill_graph_replays``: prefill forwards replayed from CUDA graphs (`workers.prefill_graphs`)."""

    active: int
    queued_tokens: int
    completed: int
    known_decodes: int
    prefill_graph_replays: int


@dataclass(frozen=True)
class DecodeStats(ReplicaStats):
    """``reserved_pages``: pages no request uses (the warm-up page; none in monolithic mode);
    ``running``: requests in the batch or prefilling; ``awaiting_kv``: pages reserved, push in
    flight; ``held_pages``: ended requests' pages until prefill settles them; ``requests``:
    running + awaiting KV + queued; ``queued_prompt_pages``: pages the queued prompts will need
    (waiting for pages to be reserved, or in the engine's queue for a prefill); the engine's counters
    (``decode_tokens``, MTP drafts and acceptances, ``preemptions``, ``decode_graph_replays``,
    ``prefill_graph_replays``: prefills replayed from CUDA graphs, `workers.prefill_graphs`; ``mixed_steps``:
    steps whose decode batch rode along with a prefill in one forward);
    ``known_prefills``: handshaked prefill agents (0 in monolithic mode: no link)."""

    reserved_pages: int
    running: int
    awaiting_kv: int
    held_pages: int
    requests: int
    queued_prompt_pages: int
    decode_tokens: int
    mtp_drafted: int
    mtp_accepted: int
    mtp_acceptance_rate: float
    preemptions: int
    decode_graph_replays: int
    known_prefills: int
    prefill_graph_replays: int
    mixed_steps: int = 0

    @property
    def waiting(self) -> int:
        return self.queued + self.awaiting_kv


@dataclass(frozen=True)
class StepRecord:
    """One engine step that computed, as its worker thread saw it (the step-time and token metrics).

    The thread appends one per step to `WorkerThread.steps`; the replica's
    heartbeat hands them to its metrics on the event loop, so recording costs
    the engine's thread one append. ``kind``: ``prefill`` (ran a prefill
    chunk), ``decode`` or ``verify`` (MTP); ``tokens``: prompt tokens computed
    (prefill) or rows decoded / tokens accepted (decode, verify);
    ``accepted``: for a verify step, how many requests accepted 0, 1, ... k
    drafts (index = accepted length); ``ended``: wall-clock time (``time.time()``)
    when the step returned (the step trace, `deployments.metrics.step_trace`)."""

    kind: str
    seconds: float
    tokens: int
    accepted: tuple[int, ...] = ()
    ended: float = 0.0


def stats_class(role: str) -> type[ReplicaStats]:
    """`PrefillStats` or `DecodeStats`."""
    return {"prefill": PrefillStats, "decode": DecodeStats}[role]


def take_records(records: collections.deque[StepRecord]) -> list[StepRecord]:
    """Every record in ``records``, oldest first, removed (``popleft`` is thread-safe: the engine's thread
    may append meanwhile)."""
    out = []
    while True:
        try:
            out.append(records.popleft())
        except IndexError:
            return out
