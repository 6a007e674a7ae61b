"""VRAM -> VRAM push between two processes on the GPU (run on the H100)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["random", "runs"])
def test_vram_push_lands_exactly_in_reserved_pages(layout, tmp_path):
    """Random bytes in scattered prefill pages of 61 layers x both kinds land
    page-for-page in the reserved decode pages (per-region checksums of the
    reserved pages, and the bench fails on any mismatch)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "transfer.py"), "--device", "cuda", "--layers", "61",
           "--tokens", "1000,4100", "--reps", "2", "--layout", layout, "--chunk-tokens", "512"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verified" in proc.stdout
