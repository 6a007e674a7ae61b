"""`bench.peers.served_steps`: the served engine's step times over a run, from Ray's metrics endpoints.

Exercised against a real prometheus_client exposition served over HTTP and listed in a service
discovery file laid out as Ray writes it (``ray/session_*/prom_metrics_service_discovery.json``).
"""

from __future__ import annotations

import json

import pytest

prometheus_client = pytest.importorskip("prometheus_client")


def test_snapshot_diff_gives_each_kinds_mean_step(tmp_path):
    from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

    from bench.peers.served_steps import diff, scrape, series

    reg = CollectorRegistry()
    steps = Histogram("ray_dsa_pd_engine_step_seconds", "steps", ("role", "kind", "model", "ReplicaId"),
                      registry=reg)
    tokens = Counter("ray_dsa_pd_generated_tokens", "tokens", ("role", "model", "ReplicaId"), registry=reg)
    other = Counter("ray_serve_num_requests", "not ours", registry=reg)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        port = server.server_port
        session = tmp_path / "ray" / "session_2026"
        session.mkdir(parents=True)
        (session / "prom_metrics_service_discovery.json").write_text(
            json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{port}"]}]))
        (tmp_path / "ray" / "session_latest").symlink_to(session)  # listed twice, scraped once

        steps.labels("decode", "prefill", "m", "a").observe(0.2)
        before = series(scrape(tmp_path))
        for replica, secs in (("a", 0.004), ("b", 0.006), ("a", 0.005), ("b", 0.005)):
            steps.labels("decode", "decode", "m", replica).observe(secs)
        steps.labels("decode", "prefill", "m", "a").observe(0.1)
        tokens.labels("decode", "m", "a").inc(7)
        other.inc(3)
        after = series(scrape(tmp_path))
    finally:
        server.shutdown()
    res = diff(before, after)
    dec = res["histograms"]["ray_dsa_pd_engine_step_seconds{kind=decode,model=m,role=decode}"]
    assert dec["count"] == 4 and dec["mean_s"] == pytest.approx(0.005)  # both replicas' series add up
    pre = res["histograms"]["ray_dsa_pd_engine_step_seconds{kind=prefill,model=m,role=decode}"]
    assert pre["count"] == 1 and pre["mean_s"] == pytest.approx(0.1)  # only the run's own step
    assert res["counters"] == {"ray_dsa_pd_generated_tokens_total{model=m,role=decode}": 7}
