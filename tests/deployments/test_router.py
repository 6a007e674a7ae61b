"""Replica ranking of the request routers (the pure part; the routers run for real in test_serve_app)."""

from __future__ import annotations

from deployments.router import Candidate, prefix_hash, rank


def test_prefix_hash_covers_full_pages_only():
    a = list(range(200))
    assert prefix_hash(a[:63], 4) is None
    assert prefix_hash(a[:64], 4) == prefix_hash(a[:100], 4) == prefix_hash(a[:64] + [9] * 70, 1)
    assert prefix_hash(a, 1) != prefix_hash(a, 2)  # two pages hashed, not one
    assert prefix_hash(a, 4) == prefix_hash(a + [1] * 100, 3)  # only 3 full pages in 200 tokens


def test_least_loaded_then_free_pages():
    cands = [Candidate("a", 3), Candidate("b", 1, 0.9), Candidate("c", 1, 0.1), Candidate("d", 0, 0.99)]
    assert rank(cands, "least_loaded") == ["d", "c", "b", "a"]


def test_affinity_breaks_ties_and_is_stable_when_replicas_leave():
    hint = prefix_hash(list(range(64)), 1)
    cands = [Candidate(k, 2) for k in "abcdef"]
    first = rank(cands, "least_loaded", hint)[0]
    # Same prefix, same replica; a replica other than the chosen one leaving does not move it.
    assert rank(reversed(cands), "least_loaded", hint)[0] == first
    assert rank([c for c in cands if c.key != ("a" if first != "a" else "b")], "least_loaded", hint)[0] == first
    # Prefixes spread over replicas.
    firsts = {rank(cands, "least_loaded", prefix_hash([i] * 64, 1))[0] for i in range(40)}
    assert len(firsts) >= 4


def test_prefix_affinity_tolerates_slack_but_not_more():
    hint = prefix_hash(list(range(64)), 1)
    even = [Candidate(k, 0) for k in "abcd"]
    pick = rank(even, "prefix_affinity", hint)[0]
    others = [Candidate(k, 0) for k in "abcd" if k != pick]
    assert rank(others + [Candidate(pick, 2)], "prefix_affinity", hint, affinity_slack=2)[0] == pick
    assert rank(others + [Candidate(pick, 3)], "prefix_affinity", hint, affinity_slack=2)[0] != pick
    assert rank(others + [Candidate(pick, 3)], "least_loaded", hint, affinity_slack=2)[-1] == pick


def test_round_robin_rotates():
    cands = [Candidate(k, 5 - i) for i, k in enumerate("abc")]
    assert [rank(cands, "round_robin", turn=t)[0] for t in range(4)] == ["a", "b", "c", "a"]
    assert rank([], "least_loaded") == []
