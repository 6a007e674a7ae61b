"""Tiny checkpoints shared by the tests in this directory (built once per session)."""

from __future__ import annotations

import pytest

from models.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{arch: directory} of the default tiny checkpoint of each arch (bf16, one MTP layer)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, seed=0) for arch in ("deepseek_v32", "glm_moe_dsa")}


@pytest.fixture(scope="session")
def tiny_fp8_dir(tmp_path_factory):
    """fp8 (block 128x128) form of the default tiny glm_moe_dsa checkpoint."""
    return make_tiny("glm_moe_dsa", tmp_path_factory.mktemp("tiny_fp8") / "glm", seed=0, fp8=True)
