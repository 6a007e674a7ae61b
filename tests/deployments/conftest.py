"""Servers that several test modules share: one `serve run` start per test run instead of one per
module (a start costs ~35 s of the 2-core CI machine, most of it Ray's and the replicas' start-up).

A shared server is started by the first module that asks for it and stopped by the last one (the
modules are not waited on: an idle server between them would take its heartbeats' CPU from the
others). Only modules that leave it as they found it share one: the fault tests that kill replicas
(test_serve_multi_replica.py) and the modules with configs of their own keep their own servers.
"""

from __future__ import annotations

import pytest

from tests.deployments.app_fixtures import CONFIGS
from tests.deployments.serve_process import ServeProcess


def _used_after_this_module(request, fixture: str) -> bool:
    """Whether a test collected after ``request``'s module asks for ``fixture``."""
    items = request.session.items
    last = max((i for i, item in enumerate(items) if getattr(item, "module", None) is request.module), default=-1)
    return any(fixture in getattr(item, "fixturenames", ()) for item in items[last + 1:])


@pytest.fixture(scope="session")
def _tiny_pd_process(tmp_path_factory):
    # Replica metrics reported to Ray's agent every second (Ray's default: 10 s), so that the
    # Prometheus test's waits for a scrape are short; the other users do not mind.
    proc = ServeProcess(CONFIGS / "tiny_pd.yaml", tmp_path_factory.mktemp("serve-tiny-pd"),
                        env={"RAY_metrics_report_interval_ms": "1000"}).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tiny_pd_server(_tiny_pd_process, request):
    """`serve run configs/tiny_pd.yaml`, started (not yet healthy: call ``wait_ready``) and shared by
    test_serve_app.py and test_prometheus_dashboards.py, which count what they check from their own
    start (deltas, pools back at their start counts), whichever runs first."""
    yield _tiny_pd_process
    if not _used_after_this_module(request, "tiny_pd_server"):
        _tiny_pd_process.stop()
