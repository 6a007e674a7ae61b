"""Triton kernel checks in the interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

The interpreter must be switched on before triton is imported, so a test module
runs its checks in a subprocess of itself (``python test_x.py SEED``): the
subprocess calls `report`, the test process `interpreter_results`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def report(checks: dict[str, Callable[[], None]]) -> None:
    """Run every check (in the interpreter) and print their results as one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must run with TRITON_INTERPRET=1"
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


def report_seeded(checks: dict[str, Callable], argv: list[str]) -> None:
    """`report` for checks that take a generator: ``python test_x.py SEED`` gives check ``name`` a CPU
    generator seeded ``SEED + sum(map(ord, name))`` (each check its own stream, replayable by SEED)."""
    import torch

    seed = int(argv[0])
    report({name: (lambda c=check, n=name: c(torch.Generator().manual_seed(seed + sum(map(ord, n)))))
            for name, check in checks.items()})


def interpreter_results(test_file: str, seed: int) -> dict[str, str]:
    """``{check: "ok" | traceback}`` from ``python test_file SEED`` under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(test_file).resolve()), str(seed)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"interpreter worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def compile_in_subprocess(test_file: str, cache_dir: str | Path) -> None:
    """Run ``python test_file --compile`` (its sm_90 compile worker, which prints COMPILED).

    A subprocess: compiling needs TRITON_INTERPRET unset at import, and a private
    cache dir makes it really compile (no stale cubin from an earlier run).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(test_file).resolve()), "--compile"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
