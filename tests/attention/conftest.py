"""Fixtures of the attention tests: golden-file location and fresh random seeds."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# `pytest` run without installing the package: make `import attention` work.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GOLDEN_DIR = (REPO / ".." / "shared" / "golden").resolve()


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """``shared/golden`` beside the repo checkout (real FlashMLA / DeepGEMM outputs)."""
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"golden vectors not found: {GOLDEN_DIR} does not exist (shared/ beside the checkout)")
    return GOLDEN_DIR


@pytest.fixture
def load_golden(golden_dir):
    from safetensors.torch import load_file

    def load(name: str) -> dict[str, torch.Tensor]:
        path = golden_dir / f"{name}.safetensors"
        assert path.is_file(), f"golden file missing: {path}"
        return load_file(str(path))

    return load


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch.Generator with a fresh seed per test (set ATTN_TEST_SEED to replay one).

    The seed is printed (shown by pytest when the test fails) and recorded in
    the test's user_properties.
    """
    seed = int(os.environ.get("ATTN_TEST_SEED", secrets.randbits(31)))
    print(f"{request.node.nodeid}: ATTN_TEST_SEED={seed}")
    request.node.user_properties.append(("seed", seed))
    g = torch.Generator().manual_seed(seed)
    return g
