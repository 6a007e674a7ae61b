"""bench serve's prefix-repeating workloads (bench/serve/prefix_workloads.py) and the turn order of
multi-turn conversations in the load generator (no server)."""

from __future__ import annotations

import asyncio
import argparse

import pytest

from bench.serve.cli import add_arguments
from bench.serve.datasets import build_requests
from bench.serve.loadgen import run_load
from bench.serve.metrics import RequestResult
from bench.serve.prefix_workloads import multi_turn_requests, prefix_repetition_requests


def test_prefix_repetition_shares_each_prefix_and_nothing_else():
    reqs = prefix_repetition_requests(12, prefix_len=50, suffix_len=20, num_prefixes=3, output_len=5,
                                      vocab_size=100, token_offset=7, seed=1)
    assert len(reqs) == 12 and all(r.prompt_len == 70 == len(r.prompt) and r.output_len == 5 for r in reqs)
    assert all(7 <= t < 107 for r in reqs for t in r.prompt)
    heads = [tuple(r.prompt[:50]) for r in reqs]
    assert len(set(heads)) == 3 and all(heads.count(h) == 4 for h in heads)
    assert len({tuple(r.prompt[50:]) for r in reqs}) == 12  # every suffix its own
    assert reqs == prefix_repetition_requests(12, 50, 20, 3, 5, 100, 7, seed=1)
    assert heads != [tuple(r.prompt[:50]) for r in prefix_repetition_requests(12, 50, 20, 3, 5, 100, 7, seed=2)]
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        prefix_repetition_requests(4, 50, 20, 0, 5)


def test_multi_turn_histories_grow_and_each_turn_follows_the_last():
    reqs = multi_turn_requests(7, first_len=10, user_len=3, turns=3, output_len=2, seed=0)
    assert [r.prompt_len for r in reqs] == [10, 10, 10, 15, 15, 15, 20]
    assert [r.follows for r in reqs] == [None, None, None, 0, 1, 2, 3]
    for r in reqs:
        if r.follows is not None:
            before = reqs[r.follows].prompt
            assert r.prompt[:len(before)] == before  # the whole history is re-sent
    with pytest.raises(ValueError, match="--multi-turn-turns"):
        multi_turn_requests(4, 10, 3, 0, 2)


def test_the_cli_builds_both_workloads():
    p = add_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--dataset-name", "prefix_repetition", "--num-prompts", "6", "--prefix-repetition-prefix-len",
                      "8", "--prefix-repetition-suffix-len", "0", "--prefix-repetition-num-prefixes", "2"])
    assert [r.prompt_len for r in build_requests(a)] == [8] * 6
    a = p.parse_args(["--dataset-name", "multi_turn", "--num-prompts", "4", "--multi-turn-turns", "2",
                      "--random-input-len", "5", "--multi-turn-user-len", "1", "--random-output-len", "2"])
    assert [r.prompt_len for r in build_requests(a)] == [5, 5, 8, 8]


def test_a_turn_is_sent_only_after_the_turn_before_it_ended():
    reqs = multi_turn_requests(6, first_len=4, user_len=1, turns=3, output_len=1, seed=0)
    events = []

    async def send(req):
        i = reqs.index(req)
        events.append(("start", i))
        await asyncio.sleep(0.01 * (3 - i % 3))  # the first conversation's turns are the slowest
        events.append(("end", i))
        return RequestResult(success=True)

    results, _ = asyncio.run(run_load(reqs, send, max_concurrency=2))
    assert len(results) == 6
    for i, r in enumerate(reqs):
        if r.follows is not None:
            assert events.index(("end", r.follows)) < events.index(("start", i))
