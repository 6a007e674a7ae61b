"""Test-suite policy.

`gpu`-marked tests need CUDA: on a machine without a GPU they are skipped
with that reason (CI is CPU-only). On a machine *with* a GPU they run, and a
missing kernel package is a failure, not a skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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


_PRESTART: dict[Path, dict] = {}
"""Per test directory, the ``PRESTART`` runs its collected tests read (tests/prestart.py)."""


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for item in session.items:
        module = getattr(item, "module", None)
        if item.get_closest_marker("skip"):
            continue
        for name, factory in getattr(module, "PRESTART", {}).items():
            if name in getattr(item, "fixturenames", ()) or getattr(item, "originalname", None) == name:
                _PRESTART.setdefault(item.path.parent, {}).setdefault((module.__name__, name), factory)


def pytest_runtest_setup(item):
    """At a directory's first test, its runs start in the background: beside that directory's tests,
    not beside another directory's servers, whose tests time what they serve."""
    group = _PRESTART.pop(item.path.parent, None)
    if group:
        from tests.prestart import prestart

        prestart(factory() for factory in group.values())


def pytest_sessionfinish(session):
    if "tests.prestart" in sys.modules:
        sys.modules["tests.prestart"].stop_all()


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
