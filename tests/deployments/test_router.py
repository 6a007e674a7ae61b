"""Replica ranking of the request routers: the pure ranking, and the decode router choosing between two
replicas whose real prefix caches hold different prefixes (the routers also run in test_serve_app)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from deployments.replica_stats import DecodeStats, PrefixKeys
from deployments.router import Candidate, DecodeRouter, cached_prefix, prefix_keys, rank
from workers.page_pool import PagePool
from workers.prefix_cache import PrefixCache

SALT = b"decode-salt"


def test_least_loaded_then_free_pages():
    cands = [Candidate("a", 3), Candidate("b", 1, 0.9), Candidate("c", 1, 0.1), Candidate("d", 0, 0.99)]
    assert rank(cands, "least_loaded") == ["d", "c", "b", "a"]
    assert rank(cands, "cache_aware", 0.25) == ["d", "c", "b", "a"]  # no overlap: the same


def test_cache_aware_weighs_cached_pages_against_load():
    # 8 cached pages at weight 0.25 are worth 2 requests in flight.
    cands = [Candidate("a", 0), Candidate("b", 1, cached=8)]
    assert rank(cands, "cache_aware", 0.25)[0] == "b"
    assert rank([Candidate("a", 0), Candidate("b", 2, cached=8)], "cache_aware", 0.25)[0] == "a"  # tie: pressure, id
    assert rank([Candidate("a", 0), Candidate("b", 3, cached=8)], "cache_aware", 0.25)[0] == "a"
    assert rank(cands, "least_loaded", 0.25)[0] == "a"  # the cache is not looked at


def test_ties_rotate_with_the_turn():
    """A burst of requests routed before any load report changes (the 2 x 2 serving test once sent all 8
    of its prompts to one prefill replica): equally ranked replicas take turns; a better one still wins."""
    tied = [Candidate(k, 1, 0.5) for k in "cab"]
    for policy in ("least_loaded", "cache_aware"):
        assert [rank(tied, policy, 0.25, turn=t)[0] for t in range(4)] == ["a", "b", "c", "a"]
    better = tied + [Candidate("d", 0, 0.9)]
    assert {rank(better, "least_loaded", turn=t)[0] for t in range(4)} == {"d"}
    assert rank(better, "least_loaded", turn=1) == ["d", "b", "c", "a"]


def test_a_lookup_stops_at_the_first_missing_page():
    assert cached_prefix([1, 2, 3, 4], {1, 2, 4}) == 2
    assert cached_prefix([1, 2], set()) == 0 and cached_prefix([], {1}) == 0


def test_round_robin_rotates():
    cands = [Candidate(k, 5 - i) for i, k in enumerate("abc")]
    assert [rank(cands, "round_robin", turn=t)[0] for t in range(4)] == ["a", "b", "c", "a"]
    assert rank([], "least_loaded") == []


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 300) for _ in range(n)]


def _replica(rid: str, pool: PagePool, requests: int):
    """What Serve hands a router for one decode replica: its id and the routing stats it reported."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    stats = DecodeStats(agent=rid, free_pages=pool.free_count, total_pages=pool.num_pages, queued=0,
                        **PrefixKeys(pool).fields(), reserved_pages=0, running=requests, awaiting_kv=0,
                        held_pages=0, requests=requests, queued_prompt_pages=0, decode_tokens=0, mtp_drafted=0,
                        mtp_accepted=0, mtp_acceptance_rate=0.0, preemptions=0, decode_graph_replays=0,
                        known_prefills=1, prefill_graph_replays=0)
    return SimpleNamespace(replica_id=ReplicaID(rid, DeploymentID("DecodeServer", "app")),
                           routing_stats=stats.to_dict(), replica_metadata={"agent": rid})


def test_two_decode_replicas_holding_different_prefixes():
    """Each replica's pool ran one long prompt; a request goes to the replica holding its prefix unless
    that one is overloaded; a restarted replica (a fresh pool) reports nothing."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    system_a, system_b = _tokens(1000, 1), _tokens(1000, 2)  # 15 full pages each
    pools = {}
    for rid, system in (("r-a", system_a), ("r-b", system_b)):
        pool = pools[rid] = PagePool(64, PrefixCache(SALT))
        pages, _ = pool.acquire(system, 16)
        pool.free(pages, system, len(system) - 1)
    router = DecodeRouter(DeploymentID("DecodeServer", "app"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="cache_aware", overlap_weight=0.25, model="m")

    def first(prompt, loads, pool_of=pools):
        pending = SimpleNamespace(kwargs={"prefix_keys": prefix_keys(prompt, SALT, 256)},
                                  routing_context=SimpleNamespace(should_backoff=False))
        replicas = [_replica(rid, pool_of[rid], loads[rid]) for rid in ("r-a", "r-b")]
        ranked = asyncio.run(router.choose_replicas(replicas, pending))
        return ranked[0][0].replica_id.unique_id

    question = _tokens(40, 3)
    assert first(system_a + question, {"r-a": 0, "r-b": 0}) == "r-a"
    assert first(system_b + question, {"r-a": 0, "r-b": 0}) == "r-b"
    # 15 cached pages at 0.25 are worth 3.75 requests: a busier holder still wins, an overloaded one not.
    assert first(system_b + question, {"r-a": 0, "r-b": 3}) == "r-b"
    assert first(system_b + question, {"r-a": 0, "r-b": 4}) == "r-a"
    # No prefix in common: the least loaded.
    assert first(_tokens(500, 4), {"r-a": 1, "r-b": 0}) == "r-b"
    # r-b restarts: its new pool reports no key, so the load decides.
    restarted = {**pools, "r-b": PagePool(64, PrefixCache(SALT))}
    assert PrefixKeys(restarted["r-b"]).fields()["prefix_keys"] == ()
    assert first(system_b + question, {"r-a": 0, "r-b": 1}, restarted) == "r-a"


@pytest.mark.parametrize("k", [0, 1])
def test_prompt_keys_hash_as_the_roles_replicas_key_their_pages(tmp_path, k):
    """The ingress's keys for the decode router and a decode replica's cache agree, MTP on (a page's key
    covers the token after it) and off (it does not): a request is routed by the pages that replica holds."""
    from deployments.app_config import AppConfig
    from deployments.router import PromptKeys
    from models.tiny import make_tiny
    from workers.replica_build import build_replica

    model = make_tiny("deepseek_v32", tmp_path / "m", seed=0)
    cfg = AppConfig.model_validate({"model": {"path": str(model)}, "mode": "monolithic",
                                    "decode": {"mtp_draft_tokens": k, "num_pages": 16}})
    keys = PromptKeys(cfg, "decode", str(model))
    parts = build_replica(cfg.decode.rank_spec(model), prefix_caching=True, mtp=cfg.decode.has_mtp)
    cache = parts.pool.prefix_cache
    assert keys.lookahead == cache.lookahead == (1 if k else 0)
    prompt = _tokens(192, 7)  # three full pages: with MTP the third lacks the token after it
    pages, _ = parts.pool.acquire(prompt, 3)
    parts.pool.free(pages, prompt, len(prompt))
    held = set(cache.routing_keys(16))
    assert len(held) == (2 if k else 3)
    assert cached_prefix(keys(prompt + [5]), held) == len(held)
