"""Triton kernel checks in the interpreter (``TRITON_INTERPRET=1``) on CPU tensors, and compiled
for sm_90 without a GPU.

The interpreter must be switched on before triton is imported (and be off for a compile), so a
test module runs its checks in a subprocess of itself (``python test_x.py SEED``, ``python
test_x.py --compile``): the subprocess calls `report` (or prints COMPILED), the test process reads
it (`results`, `compiled`). The subprocesses are `tests.prestart` runs: a module lists them in its
``PRESTART`` and they start in the background once the tests are collected.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from tests.prestart import WorkerRun, python_env, temp_dir, worker


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


def _env(interpret: bool, **extra: str) -> dict[str, str]:
    env = python_env(**extra)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def interpreter_run(test_file: str, *args, timeout: float = 300) -> WorkerRun:
    """``python test_file ARGS`` under the interpreter (the module's worker prints `report`'s line)."""
    return worker([sys.executable, str(Path(test_file).resolve()), *args], lambda: _env(True), timeout)


def compile_run(test_file: str, timeout: float = 300) -> WorkerRun:
    """``python test_file --compile`` (its sm_90 compile worker, which prints COMPILED), with a private
    Triton cache dir so that it really compiles (no stale cubin from an earlier run)."""
    return worker([sys.executable, str(Path(test_file).resolve()), "--compile"],
                  lambda: _env(False, TRITON_CACHE_DIR=temp_dir("triton-cache-")), timeout)


def code_compile_run(code: str, timeout: float = 300) -> WorkerRun:
    """``python -c CODE`` outside the interpreter, with a private Triton cache dir."""
    return worker([sys.executable, "-c", code], lambda: _env(False, TRITON_CACHE_DIR=temp_dir("triton-cache-")),
                  timeout)


def results(run: WorkerRun) -> dict[str, str]:
    """``{check: "ok" | traceback}`` from a worker that ran `report`."""
    proc = run.wait()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"interpreter worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def compiled(run: WorkerRun) -> None:
    """A compile worker's run printed COMPILED."""
    proc = run.wait()
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def kernel_suite(test_file: str, seed: int, checks: dict[str, Callable], seed_env: str, compile_test: str):
    """What every Triton kernel test module declares, built once: ``(PRESTART, interpreter_results fixture,
    the interpreter test)``. The module assigns them to ``PRESTART``, ``interpreter_results`` and its
    ``test_<kernel>_interpreter`` name, and names its compile test ``compile_test``. ``seed_env``: the
    environment variable that replays ``seed`` (shown on a failure)."""
    import pytest

    prestart = {"interpreter_results": lambda: interpreter_run(test_file, seed),
                compile_test: lambda: compile_run(test_file)}

    @pytest.fixture(scope="module")
    def interpreter_results() -> dict[str, str]:
        return results(interpreter_run(test_file, seed))

    @pytest.mark.parametrize("name", list(checks))
    def test_interpreter(name, interpreter_results):
        assert interpreter_results[name] == "ok", f"{seed_env}={seed}\n{interpreter_results[name]}"

    return prestart, interpreter_results, test_interpreter


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int) -> None:
    """Compile the Triton kernel ``fn`` to an sm_90 cubin on the CPU (no GPU needed): ``signature`` its
    runtime arguments' types, ``constexprs`` its compile-time values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **{c: "constexpr" for c in constexprs}}, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def worker_main(argv: list[str], checks: dict[str, Callable], compile_worker: Callable[[], None]) -> None:
    """A kernel test module run as a script: ``--compile`` (the sm_90 compile worker, which prints COMPILED)
    or ``SEED`` (the checks in the interpreter, `report_seeded`)."""
    if argv == ["--compile"]:
        compile_worker()
        print("COMPILED")
    else:
        report_seeded(checks, argv)
