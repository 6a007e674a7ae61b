"""Subprocesses whose output tests check, started before the tests that read them.

Some checks are a subprocess of tens of seconds (a Triton interpreter or sm_90 compile worker)
that keeps one core busy while the test process waits for it. A module names such subprocesses
in ``PRESTART``, ``{fixture or test name: () -> WorkerRun}``; at the first test of a directory,
tests/conftest.py queues those its collected tests read (`prestart`). The queue keeps one run
going beside the tests, and one more for every test blocked on a run (its core is idle then):
on the 2-core CI machine the runs overlap each other and the tests instead of queueing behind
the one test that reads each. A run is the same subprocess whoever starts it (`worker` returns
the one run of an argv), and a test that needs a run the queue has not started starts it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _Scheduler:
    """Starts queued runs while fewer than ``1 + blocked`` runs are going (none while ``held``)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.queue: list[WorkerRun] = []
        self.running = 0
        self.blocked = 0
        self.held = False
        self.thread: threading.Thread | None = None

    def add(self, runs: Iterable["WorkerRun"]) -> None:
        with self.cond:
            self.queue += [r for r in dict.fromkeys(runs) if r not in self.queue]
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="prestart", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.queue and self.running < 1 + self.blocked and not self.held):
                    self.cond.wait()
                run = self.queue.pop(0)
            run.start()

    def started(self) -> None:
        with self.cond:
            self.running += 1

    def ended(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def block(self, by: int) -> None:
        with self.cond:
            self.blocked += by
            self.cond.notify_all()

    def hold(self, held: bool) -> None:
        with self.cond:
            self.held = held
            self.cond.notify_all()

    def idle(self) -> bool:
        with self.cond:
            return not self.queue and self.running == 0


_SCHEDULER = _Scheduler()


class WorkerRun:
    """One subprocess, started once (by the queue or by the first test that needs it)."""

    def __init__(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str | Path = REPO):
        self.argv, self.env, self.timeout, self.cwd = argv, env, timeout, cwd
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ended = threading.Event()
        self._done: subprocess.CompletedProcess | None = None

    def start(self) -> "WorkerRun":
        with self._lock:
            if self._proc is None:
                self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
                self._proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=self._out,
                                              stderr=self._err)
                _SCHEDULER.started()
                threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self) -> None:
        try:
            self._proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            self._err.write(f"\nkilled after its {self.timeout:.0f}s timeout\n".encode())
        finally:
            self._ended.set()
            _SCHEDULER.ended()

    def wait(self) -> subprocess.CompletedProcess:
        """Start it if nobody did; then its exit status and output (text; killed at its timeout)."""
        self.start()
        if not self._ended.is_set():
            _SCHEDULER.block(+1)
            try:
                self._ended.wait()
            finally:
                _SCHEDULER.block(-1)
        with self._lock:
            if self._done is None:
                out = []
                for f in (self._out, self._err):
                    f.seek(0)
                    out.append(f.read().decode(errors="replace"))
                    f.close()
                self._done = subprocess.CompletedProcess(self.argv, self._proc.returncode, *out)
        return self._done

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


_RUNS: dict[tuple[str, ...], WorkerRun] = {}
_RUNS_LOCK = threading.Lock()


def worker(argv: list, env: Callable[[], dict[str, str]], timeout: float, cwd: str | Path = REPO) -> WorkerRun:
    """The run of ``argv`` (made on the first call, in ``env()`` and ``cwd`` of that call)."""
    with _RUNS_LOCK:
        key = tuple(map(str, argv))
        if key not in _RUNS:
            _RUNS[key] = WorkerRun(list(key), env(), timeout, cwd)
        return _RUNS[key]


def python_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH, one OpenMP thread (a run's tensors are
    small and it shares the machine with the tests and other runs) and ``extra``."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    env.update(extra)
    return env


def temp_dir(prefix: str) -> str:
    """A fresh directory, removed when the test process exits (a run may outlive any fixture)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def prestart(runs: Iterable[WorkerRun]) -> None:
    """Queue ``runs`` (started in order as described above)."""
    _SCHEDULER.add(runs)


def hold(held: bool) -> None:
    """While ``held``, start no queued run (a test that a busy machine would disturb is running)."""
    _SCHEDULER.hold(held)


def idle() -> bool:
    """No run going or queued."""
    return _SCHEDULER.idle()


def stop_all() -> None:
    """Kill the runs still going (a session that ends before reading them)."""
    with _RUNS_LOCK:
        runs = list(_RUNS.values())
    for run in runs:
        run.stop()
