"""An invalid config is refused, with every violation, before anything is placed.

`serve run` (Ray 2.60) builds the application in a task of its controller
and keeps running whatever happens to the build, so the check there is that
the build fails with every violation in the log, no replica of the
application starts and no model is made. `dsa-pd serve` (check, then
`serve run`) is the command that exits non-zero, before Ray starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.deployments.app_fixtures import merged, yaml_args
from tests.deployments.serve_process import REPO, ServeProcess

pytestmark = pytest.mark.slow

RUNS_ALONE = "its `serve run` starts a Ray cluster (tests/schedule.py)"

BAD_ARGS = merged(yaml_args("tiny_pd.yaml"),
                  prefill={"kv_cache_dtype": "auto", "tensor_parallel_size": 2},
                  decode={"num_pages": 3})
MESSAGES = (
    "decode.kv_cache_dtype: prefill kv_cache_dtype 'auto' vs decode 'fp8'",
    "decode.num_pages: 3 pages hold 192 tokens, less than one request of max_model_len 2048",
    "decode.tensor_parallel_size: prefill tensor_parallel_size 2 vs decode 1",
)


def _write(tmp_path) -> str:
    doc = {"applications": [{"name": "dsa-pd", "route_prefix": "/", "import_path": "deployments.app:build_app",
                             "args": BAD_ARGS}]}
    path = tmp_path / "bad_pd.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def test_serve_run_fails_the_build_with_every_violation_and_places_nothing(tmp_path):
    cache = tmp_path / "cache"
    proc = ServeProcess(_write(tmp_path), tmp_path, cache_dir=cache).start()
    try:
        log = proc.wait_for_log("Deploying app 'dsa-pd' failed", timeout=240)
        assert "3 configuration violation(s)" in log, proc.tail(80)
        for needle in MESSAGES:
            assert needle in log, needle
        assert "ServeReplica:dsa-pd" not in log  # not one replica of the application was started
        # Built once: a violation is not retried (deployments.app.InvalidAppConfig).
        assert log.count("Importing application 'dsa-pd'") == 1, proc.tail(80)
        assert not cache.exists()  # validation comes before making the tiny model
    finally:
        proc.stop()


def test_dsa_pd_serve_exits_1_with_every_violation_before_ray_starts(tmp_path):
    exe = shutil.which("dsa-pd")
    cmd = [exe] if exe else [sys.executable, "-m", "deployments.cli"]
    env = dict(os.environ, DSA_PD_CACHE=str(tmp_path / "cache"), RAY_ADDRESS="local",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    r = subprocess.run(cmd + ["serve", _write(tmp_path)], capture_output=True, text=True, env=env, timeout=120,
                       cwd=REPO)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "3 violation(s)" in r.stdout and all(m in r.stdout for m in MESSAGES)
    assert "Ray" not in r.stdout + r.stderr  # refused before `serve run` was started
