"""The profiling tools a GPU lease relies on run on the CPU and report what they claim.

`bench.engine_host` (the engine's own Python per step) and `bench.step_profile.profile_prefill`
are run once per lease each: a broken one costs device time, so they are exercised here on a tiny
model (no timing is asserted: speed claims come from the GPU runs in docs/perf.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from models.tiny import make_tiny

    return make_tiny("deepseek_v32", tmp_path_factory.mktemp("tiny"), seed=3)


def test_engine_host_reports_the_engines_own_python(tiny):
    out = subprocess.run([sys.executable, "-m", "bench.engine_host", "--model", str(tiny), "--batch", "6",
                          "--steps", "4", "--top", "40"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    head = re.search(r"batch 6: the engine's own Python ([0-9.]+) ms/step", out.stdout)
    assert head and float(head.group(1)) > 0, out.stdout
    funcs = re.findall(r"calls/step  (\S+)", out.stdout)
    assert funcs and all(f.split(":")[0].endswith(".py") and not f.startswith("..") for f in funcs), funcs
    # The step itself is in workers/ (among the first 40: which functions lead the first 5 depends on the
    # host's load, and a CI run once had none of engine.py's there).
    assert any(f.startswith("engine.py:") for f in funcs), funcs


def test_profile_prefill_runs_one_prefill_and_frees_its_pages(tiny):
    from bench.step_profile import print_prefill_profile, profile_prefill
    from workers.offline import LLM

    llm = LLM(tiny, num_pages=64)
    free = llm.pool.free_count
    p = profile_prefill(llm, 2, 70)
    assert p["case"] == "prefill 2x70" and p["wall_ms"] > 0 and p["tokens_per_s_profiled"] > 0
    assert p["gpu_busy_ms"] == 0 and p["top_kernels"] == []  # no CUDA kernels on the CPU
    assert llm.pool.free_count == free
    # The host side is reported on any device: the repository's functions by cumulative time (the
    # model's forward among them); no kernels, gaps or sync points without a GPU.
    assert any("models/model.py" in r for r in p["repo_cumulative"]), p["repo_cumulative"]
    assert p["gpu_idle"]["kernels"] == 0 and p["sync_points"] == []
    print_prefill_profile(p)
    hit = profile_prefill(llm, 1, 20, cached=64)  # after a cached 64-token prefix (bench offline's 1x20+64)
    assert hit["case"] == "prefill 1x20 over 64 cached" and hit["wall_ms"] > 0
    assert llm.pool.free_count == free
