"""Request routers of the decode and prefill deployments (Ray Serve ``RequestRouter`` s).

Serve calls a deployment's router in the process that holds the handle (the
ingress for decode, each decode replica for prefill) with the live replicas;
the router ranks them and Serve sends the request to the first rank whose
queue has room (``max_ongoing_requests``), probing queue lengths itself.
Each replica reports its load through ``record_routing_stats`` (refreshed
every ``ROUTING_STATS_PERIOD_S``) and, once, its NIXL agent name through
``record_replica_metadata``.

Ranking (`rank`), policy ``cache_aware`` (the default): each replica scores

    score = overlap_weight x cached_pages - load

``cached_pages``: how many of the prompt's leading 64-token pages the
replica's prefix cache holds (the caller passes the prompt's page keys,
`workers.prefix_cache.chain_keys` with the target role's `replica_salt`, as
the ``prefix_keys`` keyword argument; each replica reports the keys it holds
in its routing stats, `deployments.replica_stats.PrefixKeys`; a restarted
replica reports none). ``load``: requests in flight at the replica, the
fresher of Serve's own queue-length cache and the replica's report (prefill:
its active and queued tasks). The highest score goes first; ties by page
pressure (used page share), then by replica id rotated by the router's turn
(a burst routed before any load report changes spreads over equally loaded
replicas instead of all going to the lowest id). ``overlap_weight``
(``router.overlap_weight``, in requests per cached page) is the cost function
of Dynamo's KV router with our load unit: at the default 0.25 an 8k-token
cached prefix (128 pages) is worth 32 requests of queue, and no overlap at all
leaves plain least-loaded. ``least_loaded`` ignores the cache; ``round_robin``
ignores load. The prefill router also keeps only replicas whose agent the
calling decode replica has handshaked with (``known_prefills`` in the call),
since decode's any-peer receive accepts pushes from those agents only. Serve
skips a replica whose ``max_ongoing_requests`` is reached, so an overloaded
replica never gets a request for its cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.metrics.router import RouterMetrics
from deployments.replica_stats import DecodeStats, PrefillStats, ReplicaStats
from workers.prefix_cache import LOOKAHEAD, chain_keys, routing_key

ROUTING_STATS_PERIOD_S = 1.0


def prefix_keys(token_ids: Sequence[int], salt: bytes, max_pages: int, lookahead: int = LOOKAHEAD) -> list[int]:
    """The routing keys (`workers.prefix_cache.routing_key`) of the prompt's leading full pages, at most
    ``max_pages``, hashed as a replica with ``salt`` and ``lookahead`` keys its cache."""
    return [routing_key(k) for k in chain_keys(token_ids, salt, max_pages, lookahead=lookahead)]


class PromptKeys:
    """What a caller of a role's deployment passes as ``prefix_keys``: `prefix_keys` of a prompt with that
    role's `workers.prefix_cache.replica_salt`; nothing (``None``) when its policy is not ``cache_aware`` or
    prefix caching is off."""

    def __init__(self, app_cfg, role: str, model_dir: str):
        from workers.prefix_cache import key_lookahead, replica_salt  # reads the checkpoint's config.json
        from workers.rank_build import uses_cache_groups

        self.salt = None
        self.max_pages = app_cfg.router.prefix_pages
        self.lookahead = LOOKAHEAD
        if app_cfg.router.policy == "cache_aware" and app_cfg.features.prefix_caching:
            role_cfg = app_cfg.for_role(role)
            self.salt = replica_salt(role_cfg.rank_spec(model_dir), role_cfg.has_mtp)
            # As the role's replicas key their pages (`workers.replica_build`); DeepSeek-V4's cut keys always
            # cover the token after them (`workers.v4_prefix`).
            self.lookahead = LOOKAHEAD if uses_cache_groups(str(model_dir)) else key_lookahead(role_cfg.has_mtp)

    def __call__(self, token_ids: Sequence[int]) -> list[int] | None:
        return None if self.salt is None else prefix_keys(token_ids, self.salt, self.max_pages, self.lookahead)


def cached_prefix(keys: Sequence[int], held: Collection[int]) -> int:
    """Leading ``keys`` found in ``held``: the prompt's pages a replica can reuse (a lookup stops at the first
    page it misses)."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Candidate:
    """What the ranking sees of one replica."""

    key: str
    load: float
    """Requests in flight at the replica."""
    pressure: float = 0.0
    """Share of its pool's pages in use (0..1)."""
    cached: int = 0
    """Leading pages of the request's prompt the replica's prefix cache holds."""


def score(c: Candidate, overlap_weight: float) -> float:
    """``overlap_weight x cached pages - load`` (the module doc)."""
    return overlap_weight * c.cached - c.load


def rank(cands: Iterable[Candidate], policy: str, overlap_weight: float = 0.0, turn: int = 0) -> list[str]:
    """Replica keys, most preferred first (see the module doc)."""
    cands = list(cands)
    if not cands:
        return []
    if policy == "round_robin":
        keys = sorted(c.key for c in cands)
        i = turn % len(keys)
        return keys[i:] + keys[:i]
    w = overlap_weight if policy == "cache_aware" else 0.0
    keys = sorted(c.key for c in cands)
    turned = {k: (i - turn) % len(keys) for i, k in enumerate(keys)}
    order = sorted(cands, key=lambda c: (-score(c, w), round(c.pressure, 2), turned[c.key]))
    return [c.key for c in order]


class _LoadRouter(RequestRouter):
    """Shared by both routers: candidates from routing stats, one rank per replica."""

    target = ""
    """The deployment this router routes to (the ``target`` label of its metrics)."""

    def initialize_state(self, policy: str = "cache_aware", overlap_weight: float = 0.25, model: str = "",
                         **kwargs: Any) -> None:
        """``model``: the served model name (a label of the routing metrics)."""
        self.policy = policy
        self.overlap_weight = overlap_weight
        self._turns = itertools.count()
        self.metrics = RouterMetrics(model, self.target, policy)
        self._held: dict[str, tuple[tuple[int, ...], frozenset[int]]] = {}  # replica -> (its report, as a set)

    def _load(self, r: RunningReplica) -> float:
        raise NotImplementedError

    stats_class: type[ReplicaStats] = ReplicaStats

    def _stats(self, r: RunningReplica) -> ReplicaStats | None:
        """The replica's last report (None before its first)."""
        return self.stats_class.from_routing(r.routing_stats)

    def _pressure(self, r: RunningReplica) -> float:
        s = self._stats(r)
        return 1.0 - s.free_pages / s.total_pages if s is not None and s.total_pages else 0.0

    def _eligible(self, replicas: list[RunningReplica], pending: PendingRequest | None) -> list[RunningReplica]:
        return replicas

    def _held_keys(self, key: str, s: ReplicaStats | None) -> frozenset[int]:
        """The replica's reported cache keys as a set, rebuilt only when its report changed."""
        keys = s.prefix_keys if s is not None else ()
        memo = self._held.get(key)
        if memo is None or memo[0] is not keys:
            memo = self._held[key] = (keys, frozenset(keys))
        return memo[1]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        replicas = self._eligible(candidate_replicas, pending_request)
        keys: Sequence[int] = ()
        if pending_request is not None:
            keys = pending_request.kwargs.get("prefix_keys") or ()
            # Without this Serve retries at once, spinning, while every replica is full.
            pending_request.routing_context.should_backoff = True
        by_key = {r.replica_id.unique_id: r for r in replicas}
        cands = []
        for k, r in by_key.items():
            cached = cached_prefix(keys, self._held_keys(k, self._stats(r))) if keys else 0
            cands.append(Candidate(k, self._load(r), self._pressure(r), cached))
        for gone in set(self._held) - set(by_key):
            del self._held[gone]
        turn = next(self._turns)
        order = rank(cands, self.policy, self.overlap_weight, turn)
        # Classified inside the metrics' guard: a failure there must not fail the routing.
        self.metrics.decided(lambda: self._outcome(cands, order, turn))
        return [[by_key[k]] for k in order]

    def _outcome(self, cands: list[Candidate], order: list[str], turn: int) -> str:
        """The decision's ``outcome`` label: ``prefix_cache`` when cached pages changed the first choice."""
        if not order:
            return "no_replica"
        if self.policy == "round_robin":
            return "round_robin"
        if self.policy == "cache_aware" and rank(cands, "least_loaded", turn=turn)[0] != order[0]:
            return "prefix_cache"
        return "least_loaded"

    def _queue_len(self, r: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(r.replica_id) or 0


class DecodeRouter(_LoadRouter):
    """Ingress -> decode: cached prefix against load (requests in flight), then page pressure."""

    target = "decode"
    stats_class = DecodeStats

    def _load(self, r: RunningReplica) -> float:
        s = self._stats(r)
        return max(self._queue_len(r), s.requests if s is not None else 0)


class PrefillRouter(_LoadRouter):
    """Decode -> prefill: cached prefix against load among the prefill agents the caller has handshaked with."""

    target = "prefill"
    stats_class = PrefillStats

    def _load(self, r: RunningReplica) -> float:
        s = self._stats(r)
        if s is None:
            return self._queue_len(r)
        # Serve's own queue length when fresher; the replica's report adds queued prompt tokens.
        return max(self._queue_len(r), s.active + s.queued) + s.queued_tokens / 1e6

    def _eligible(self, replicas: list[RunningReplica], pending: PendingRequest | None) -> list[RunningReplica]:
        known = None if pending is None else pending.kwargs.get("known_prefills")
        if known is None:
            return replicas
        known = set(known)
        return [r for r in replicas if r.replica_metadata.get("agent") in known]
