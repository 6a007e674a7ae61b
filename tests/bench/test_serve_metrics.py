"""`bench serve`'s numbers on synthetic inputs: percentiles, TPOT, ITL pooling,
throughputs, goodput, Poisson arrivals and the datasets (no server)."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest

from bench.serve.arrivals import arrival_offsets
from bench.serve.datasets import fixed_requests, jsonl_requests, random_requests
from bench.serve.metrics import (
    RequestResult,
    meets_slos,
    parse_goodput,
    percentile,
    std,
    summarize,
)


def ok(ttft, e2el, out, prompt=10, itl=()):
    return RequestResult(success=True, ttft=ttft, e2el=e2el, output_tokens=out, prompt_tokens=prompt, itl=list(itl))


def test_percentile_and_std_equal_numpys():
    rng = random.Random(3)
    for n in (1, 2, 5, 100):
        xs = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)
        assert std(xs) == pytest.approx(float(np.std(xs)), abs=1e-12)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # interpolated between the middle two
    assert math.isnan(percentile([], 50)) and math.isnan(std([]))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token_and_counts_usage_tokens():
    # 4 content chunks carrying 10 tokens (multi-token chunks): TPOT comes from the
    # token count, not the chunk count: (1.0 - 0.1) / (10 - 1) = 0.1 s.
    r = ok(ttft=0.1, e2el=1.0, out=10, itl=[0.3, 0.3, 0.3])
    assert r.tpot == pytest.approx(0.1)
    assert ok(0.2, 0.2, out=1).tpot is None            # one token: no TPOT
    assert RequestResult(success=False, ttft=0.1, e2el=1.0, output_tokens=10).tpot is None


def test_summary_counts_throughputs_and_pools_itl():
    results = [
        ok(0.100, 1.000, out=10, prompt=20, itl=[0.2, 0.3]),
        ok(0.300, 0.700, out=5, prompt=30, itl=[0.1, 0.1, 0.2]),
        ok(0.050, 0.050, out=1, prompt=7),
        RequestResult(success=False, error="HTTP 400: too long", prompt_tokens=5000, e2el=0.01),
    ]
    s = summarize(results, duration_s=2.0, metrics=["ttft", "tpot", "itl", "e2el"], percentiles=[50, 90, 99])
    assert (s["completed"], s["failed"]) == (3, 1)
    # Failed requests count neither tokens nor time.
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (57, 16)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_throughput"] == pytest.approx(28.5) and s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(36.5)
    assert s["mean_ttft_ms"] == pytest.approx(150.0) and s["median_ttft_ms"] == pytest.approx(100.0)
    # TPOT over the requests with >= 2 tokens only: 100 ms and 100 ms.
    assert s["mean_tpot_ms"] == pytest.approx(100.0) and s["std_tpot_ms"] == pytest.approx(0.0)
    # ITL: every gap of every request, flattened: [200, 300, 100, 100, 200] ms.
    assert s["mean_itl_ms"] == pytest.approx(180.0) and s["median_itl_ms"] == pytest.approx(200.0)
    assert s["p90_itl_ms"] == pytest.approx(float(np.percentile([200, 300, 100, 100, 200], 90)))
    assert s["percentiles_e2el_ms"] == [[50, pytest.approx(700.0)], [90, pytest.approx(940.0)],
                                        [99, pytest.approx(994.0)]]
    assert s["request_goodput"] is None  # no SLOs given


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        ok(0.100, 1.000, out=10),   # ttft 100 ms, tpot 100 ms, e2el 1000 ms
        ok(0.400, 0.800, out=5),    # ttft 400 ms: misses ttft:300
        ok(0.100, 2.100, out=11),   # tpot 200 ms: misses tpot:150
        ok(0.050, 0.050, out=1),    # no TPOT: meets the TPOT SLO
        RequestResult(success=False, error="x"),
    ]
    slos = parse_goodput(["ttft:300", "tpot:150"])
    assert slos == {"ttft": 300.0, "tpot": 150.0}
    assert [meets_slos(r, slos) for r in results] == [True, False, False, True, False]
    s = summarize(results, duration_s=4.0, goodput_slos_ms=slos)
    assert s["request_goodput"] == pytest.approx(0.5)
    assert summarize(results, 4.0, goodput_slos_ms={"e2el": 900})["request_goodput"] == pytest.approx(0.5)
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_poisson_arrivals_are_reproducible_with_a_seed():
    a = arrival_offsets(2000, request_rate=4.0, seed=7)
    assert a == arrival_offsets(2000, request_rate=4.0, seed=7)
    assert a != arrival_offsets(2000, request_rate=4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    gaps = np.diff(a)
    # Exponential gaps of mean 1/rate (0.25 s): mean and std both ~0.25 (coefficient of variation 1).
    assert gaps.mean() == pytest.approx(0.25, rel=0.1) and gaps.std() == pytest.approx(0.25, rel=0.1)
    regular = np.diff(arrival_offsets(2000, request_rate=4.0, burstiness=16.0, seed=7))
    assert regular.mean() == pytest.approx(0.25, rel=0.1) and regular.std() < 0.1  # cv = 1/sqrt(16)
    assert arrival_offsets(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_random_and_fixed_datasets():
    reqs = random_requests(200, input_len=28, output_len=8, range_ratio=0.42, vocab_size=100, token_offset=5, seed=1)
    assert reqs == random_requests(200, 28, 8, 0.42, 100, 5, seed=1)
    assert reqs != random_requests(200, 28, 8, 0.42, 100, 5, seed=2)
    assert {len(r.prompt) for r in reqs} <= set(range(16, 40)) and min(len(r.prompt) for r in reqs) == 16
    assert all(r.prompt_len == len(r.prompt) and 4 <= r.output_len <= 11 for r in reqs)
    assert all(5 <= t < 105 for r in reqs for t in r.prompt)
    assert {len(r.prompt) for r in random_requests(20, 33, 8, seed=0)} == {33}
    fixed = fixed_requests(4, input_len=17, output_len=9, seed=3)
    assert len({tuple(r.prompt) for r in fixed}) == 1 and fixed[0].prompt_len == 17 and fixed[0].output_len == 9


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": "hello", "output_len": 3}, {"prompt": [1, 2, 3]}, {"prompt": "x"})) + "\n\n")
    reqs = jsonl_requests(path, None, default_output_len=7)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("hello", None, 3), ([1, 2, 3], 3, 7), ("x", None, 7)]
    assert [r.prompt for r in jsonl_requests(path, 5, 7)] == ["hello", [1, 2, 3], "x", "hello", [1, 2, 3]]
    for bad in ('{"text": "x"}', '{"prompt": []}', '{"prompt": "x", "output_len": 0}', "not json"):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError):
            jsonl_requests(path, None, 7)
