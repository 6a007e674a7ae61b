"""Fixtures shared by the worker tests."""

from __future__ import annotations

import pytest

from tests.workers.v4_reference import make_tiny_v4


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory):
    """The tiny DeepSeek-V4 checkpoint of `dsa-pd make-tiny --arch deepseek_v4` (made once per run)."""
    return make_tiny_v4(tmp_path_factory.mktemp("tiny-v4"))
