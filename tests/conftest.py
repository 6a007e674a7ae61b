"""Test-suite policy.

`gpu`-marked tests need CUDA: on a machine without a GPU they are skipped
with that reason (CI is CPU-only). On a machine *with* a GPU they run, and a
missing kernel package is a failure, not a skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One OpenMP thread per test process (and the processes it starts), unless set: a test process
# shares the 2 cores with prestarted runs and servers starting (tests/prestart.py,
# tests/schedule.py), and two OpenMP threads then spin at every barrier while the other waits for
# a core. Alone on the machine a second thread saved 3% of the wall time of the engine tests, for
# 40% more CPU time.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARED = REPO.parent / "shared"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _runs(item) -> bool:
    """Not skipped by a mark known at collection (``skip``, or ``skipif`` with a condition already true)."""
    if item.get_closest_marker("skip"):
        return False
    return not any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))


_PRESTART: dict[Path, dict] = {}
"""Per test directory, the ``PRESTART`` runs its collected tests read (tests/prestart.py)."""


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    servers = sys.modules.get("tests.deployments.shared_servers")  # imported by the serving modules
    if servers is not None:
        servers.count_users(dict.fromkeys(getattr(item, "module", None) for item in session.items if _runs(item)))
    for item in session.items:
        module = getattr(item, "module", None)
        if not _runs(item):
            continue
        for name, factory in getattr(module, "PRESTART", {}).items():
            if name in getattr(item, "fixturenames", ()) or getattr(item, "originalname", None) == name:
                _PRESTART.setdefault(item.path.parent, {}).setdefault((module.__name__, name), factory)


def pytest_runtest_setup(item):
    """At a directory's first test, its runs are queued: they run beside that directory's tests."""
    group = _PRESTART.pop(item.path.parent, None)
    if group:
        from tests.prestart import prestart

        prestart(factory() for factory in group.values())


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Serving modules run once their server answers, started beside other modules (tests/schedule.py)."""
    servers = sys.modules.get("tests.deployments.shared_servers")
    if servers is None or session.config.option.collectonly or (
            session.testsfailed and not session.config.option.continue_on_collection_errors):
        return None  # pytest's own loop
    from tests import prestart, schedule

    factory = session.config._tmp_path_factory
    return schedule.run(session, schedule.Servers(
        spec_of=lambda group: servers.spec_of(getattr(group[0], "module", None)) if any(map(_runs, group)) else None,
        alone=lambda group: bool(getattr(getattr(group[0], "module", None), "RUNS_ALONE", False)),
        started=servers.started, ready=servers.ready, start=lambda spec: servers.start(spec, factory),
        may_start=prestart.idle, hold_runs=prestart.hold))


def pytest_sessionfinish(session):
    for name in ("tests.prestart", "tests.deployments.shared_servers"):
        if name in sys.modules:
            sys.modules[name].stop_all()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H100: see docs/gpu-results.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-tensor tests: their ops take microseconds, and OpenMP's
    hand-offs between two threads cost more than the work (10-100x on a busy 2-core machine)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True)
def _free_lingering_nixl_agents():
    """Free NIXL agents a test left in reference cycles (an ``LLM`` and its engine).

    Each agent's progress thread polls until the agent is freed, and objects
    in cycles go only when the cyclic GC runs: on the 2-core CI machine a few
    leftover agents starved the tests after them (rank-worker actors got ~5%
    of a core, before the threads slept between rounds).
    """
    yield
    if "nixl" in sys.modules:
        import gc

        gc.collect()


@pytest.fixture
def cuda_fake_kernels(monkeypatch):
    """``tests/attention/cuda_fakes``' stand-ins as the ``deep_gemm`` / ``flash_mla`` packages for one test
    (the cuda backend's glue on CPU); returns the module (its ``CALLS`` counts the kernel calls)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "attention"))
    try:
        import cuda_fakes
    finally:
        sys.path.pop(0)
    for name, module in cuda_fakes.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda_fakes.CALLS.clear()
    return cuda_fakes
