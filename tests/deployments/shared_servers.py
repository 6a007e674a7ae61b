"""The `serve run` servers of the serving test modules, started before the modules run.

A server module names its server at module level (``SERVER = ServerSpec(...)``) and binds
``server = server_fixture(SERVER)``. A start costs ~35 s of the 2-core CI machine, mostly
CPU (Ray's processes, the replicas' imports and models) while the tests of other modules
use one core; tests/schedule.py starts a module's server in the background while other
modules' tests run, and runs the module once its server answers (`ready`). Modules with the
same spec share one server (`TINY_PD`), which stops after the last of them (`release`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.deployments.app_fixtures import CONFIGS
from tests.deployments.serve_process import ServeProcess, offline_greedy_texts, shared_cache_dir


@dataclass(frozen=True, eq=False)
class ServerSpec:
    """``serve run`` of ``config`` (a shipped file, as users run it), or of a one-application config
    named ``config_name`` whose args are ``args`` (a dict, or a function of the server's work dir)."""

    tag: str
    config: Path | None = None
    args: dict | Callable[[Path], dict] | None = None
    config_name: str = "app.yaml"
    env: dict[str, str] = field(default_factory=dict)

    def start(self, work: Path) -> ServeProcess:
        config = self.config
        if config is None:
            args = self.args(work) if callable(self.args) else self.args
            config = work / self.config_name
            config.write_text(yaml.safe_dump({"applications": [{
                "name": "dsa-pd", "route_prefix": "/", "import_path": "deployments.app:build_app", "args": args}]}))
        return ServeProcess(config, work, env=self.env).start()


TINY_PD = ServerSpec("serve-tiny-pd", config=CONFIGS / "tiny_pd.yaml",
                     # Replica metrics reported to Ray's agent every second (Ray's default: 10 s), so that
                     # the Prometheus test's waits for a scrape are short; its other users do not mind.
                     env={"RAY_metrics_report_interval_ms": "1000"})
"""configs/tiny_pd.yaml, shared by test_serve_app.py and test_prometheus_dashboards.py (both count what
they check from their own start: deltas, pools back at their start counts)."""


class _Started:
    def __init__(self, proc: ServeProcess):
        self.proc = proc
        self.healthy = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        try:
            self.proc.wait_ready(timeout=600)
        except AssertionError:
            pass  # the module's own wait_ready reports it
        self.healthy.set()  # answering, or never will: either way nothing to wait for here


_STARTED: dict[ServerSpec, _Started] = {}
_USERS: Counter = Counter()
"""Per spec, the collected modules that use it and have not finished."""
_LOCK = threading.Lock()


def spec_of(module) -> ServerSpec | None:
    """A module's ``SERVER``."""
    spec = getattr(module, "SERVER", None)
    return spec if isinstance(spec, ServerSpec) else None


def count_users(modules) -> None:
    """Note the collected modules' ``SERVER`` specs (tests/conftest.py, once the tests are collected)."""
    for m in modules:
        if spec_of(m) is not None:
            _USERS[spec_of(m)] += 1


def start(spec: ServerSpec, tmp_path_factory) -> ServeProcess:
    """The spec's server, started now unless it was already."""
    with _LOCK:
        if spec not in _STARTED:
            _STARTED[spec] = _Started(spec.start(tmp_path_factory.mktemp(spec.tag)))
        return _STARTED[spec].proc


def started(spec: ServerSpec) -> bool:
    return spec in _STARTED


def ready(spec: ServerSpec) -> bool:
    """Started, and answering ``/health`` (or failed for good: its module will say so)."""
    s = _STARTED.get(spec)
    return s is not None and s.healthy.is_set()


def release(spec: ServerSpec) -> None:
    """A module using ``spec`` finished: stop the server after the last one."""
    with _LOCK:
        _USERS[spec] -= 1
        if _USERS[spec] <= 0 and spec in _STARTED:
            _STARTED.pop(spec).proc.stop()


def stop_all() -> None:
    """Stop every server still running (the session's end; servers started for modules that never ran)."""
    with _LOCK:
        for s in _STARTED.values():
            s.proc.stop()
        _STARTED.clear()


def server_fixture(spec: ServerSpec):
    """The module-scoped ``server`` fixture of a module with ``SERVER = spec``: the started server (not
    necessarily answering yet: the module waits with ``wait_ready``, computing its reference meanwhile)."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        proc = start(spec, tmp_path_factory)
        yield proc
        release(spec)

    return server


def served_and_offline_fixtures(spec: ServerSpec, args, prompts: list[list[int]], tokens: int):
    """Module-scoped ``server`` (`server_fixture`) and ``reference`` (offline single-process greedy texts of
    ``prompts`` for the model of ``args``, an ``AppConfig``) fixtures; bind them at module level."""

    @pytest.fixture(scope="module")
    def reference(server) -> list[str]:
        return offline_greedy_texts(args, shared_cache_dir(), prompts, tokens)

    return server_fixture(spec), reference
