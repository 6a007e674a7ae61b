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


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H100: see docs/gpu-results.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
