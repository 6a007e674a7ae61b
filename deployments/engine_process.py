"""A replica's worker thread in a child process of its own (``prefill/decode.engine_process``).

Why: the worker thread shares its replica's Python interpreter, and so the GIL,
with Serve's and Ray's threads (request handling, streaming, serialization,
metrics). After every device wait the engine must take the GIL back, and at
high concurrency the others hold it for a large share of the time. On an
H200 (docs/perf.md, session 21), a served decode step took 5.0-9.0 ms, while
the same engine offline took 3.6-4.9 ms. vLLM and SGLang run their engine
loop in a process of its own for this reason; this module does the same for
one replica.

`EngineProcess` (in the replica) starts ``python -m deployments.engine_process``
over a socket pair. The child builds the role's worker and its `DecodeThread` /
`PrefillThread` exactly as the replica would (`deployments.replica_build`), then
runs it. `EngineProcess` stands in for that thread in the replica, with the
surface the servers use:
- commands: ``post`` / ``call`` of the thread's command names (``proc.reserve``
  names the command; it is not a bound method);
- ``open_stream`` / ``close_stream``;
- ``stats`` / ``take_steps`` / ``check`` / ``stop``;
- ``agent_name``, ``warmup_page``, ``handshake_offer``.

The wire, one pickled message at a time:
- replica -> child: the role and config first, then commands;
- child -> replica: each step's outputs as one message, the stats snapshot and new step records every
  ``STATS_EVERY_S``, and command results.

The child exits when the socket closes, and the kernel kills it when the replica's process dies
(``PR_SET_PDEATHSIG``, and a watchdog on the parent's pid), so a killed replica leaves no engine holding
the GPU or its NIXL agent.

Tensor parallelism is refused with this option (`deployments.controller.rules`): rank workers are
Ray actors, and the child is not a Ray worker.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from deployments.metrics import hop_trace
from deployments.replica_stats import ReplicaStats, StepRecord, take_records
from deployments.stream_table import StreamTable
from deployments.worker_thread import ENGINE_FAILED, WorkerThread, WorkerThreadFailed
from workers.request import unavailable

log = logging.getLogger("ray.serve")

COMMANDS = {
    "decode": frozenset({"add", "reserve", "prefill_result", "abort", "learn_peer", "forget_peer"}),
    "prefill": frozenset({"submit", "abort", "learn_peer", "forget_peer"}),
}
"""The worker threads' commands a replica sends (`DecodeThread`, `PrefillThread`)."""
STOP_JOIN_S = 5.0
"""How long the child waits for its worker thread at `stop` (shorter than the replica's wait for the child)."""
EXIT_GRACE_S = 1.0
"""With ``exit_with_engine``: how long a replica whose engine process died lives on, so that its open streams'
error outputs reach their callers, before it exits and Serve replaces it (as it would a replica whose
in-process engine crashed the process)."""
STATS_EVERY_S = 0.05
"""How often the child sends its stats snapshot and new step records (the replica's heartbeats read them
twice a second)."""


@dataclass(frozen=True)
class Command:
    """A worker-thread command by name: what ``proc.reserve`` is, so that ``post(proc.reserve, ...)`` reads as
    it does for a thread in the replica."""

    name: str


class EngineProcess:
    """The replica side: see the module doc. ``fail_item(key, message)``: what an open stream receives when
    the child dies without saying so (the role's error output)."""

    def __init__(self, role: str, app_args: dict[str, Any], model_dir: str, worker_id: str,
                 gil_switch_interval_ms: float, fail_item: Callable[[str, str], Any], exit_with_engine: bool = False):
        """exit_with_engine: end this process ``EXIT_GRACE_S`` after the child dies unasked (a Serve replica:
        it would otherwise stay routable, answering every request with a 503, until its health checks fail)."""
        if role not in COMMANDS:
            raise ValueError(f"role must be one of {sorted(COMMANDS)}, got {role!r}")
        self.role, self.worker_id, self.name = role, worker_id, f"{role}:{worker_id}"
        self._init = {"role": role, "app_args": app_args, "model_dir": str(model_dir), "worker_id": worker_id,
                      "gil_switch_interval_ms": gil_switch_interval_ms, "log_files": _log_files()}
        self._fail_item = fail_item
        self.exit_with_engine = exit_with_engine
        self._failed_keys: set[str] = set()  # streams given their error output already
        self._fail_lock = threading.Lock()
        self.stats: ReplicaStats | None = None
        self.error: BaseException | None = None
        self.agent_name: str = worker_id
        self.warmup_page: int | None = None
        self._offer: bytes | None = None
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=WorkerThread.MAX_STEP_RECORDS)
        self._streams = StreamTable()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._ready_seen = False  # a child that fails to build fails `launch`: the replica's start, not an exit
        self._stopping = False
        self.proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None

    # --------------------------------------------------------------- lifecycle
    def launch(self, timeout_s: float | None = None) -> None:
        """Start the child and wait until its worker is built (blocking: from the replica, through
        ``asyncio.to_thread``). Raises `WorkerThreadFailed` if the build fails or the child dies."""
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "deployments.engine_process", str(theirs.fileno()),
                                      str(os.getpid())], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Connection(mine.detach())
        self._reader = threading.Thread(target=self._read, name=f"{self.name}:from-engine", daemon=True)
        self._reader.start()
        try:
            self._send(("init", self._init))
        except OSError as e:  # the child died at once
            self._fail(RuntimeError(f"the engine process exited at start ({e!r})"))
        if not self._ready.wait(timeout_s):
            self.stop()
            raise WorkerThreadFailed(f"{self.name}: the engine process did not start in {timeout_s} s")
        if self.error is not None:
            self.stop()
            raise WorkerThreadFailed(f"{self.name}: the engine process failed to start: {self.error}") from self.error

    def start(self) -> None:
        """The thread's ``start``: the child runs from `launch` on."""

    @property
    def engine_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child (asked, then killed after ``timeout``), then close the socket once the reader has
        ended. Calls still unanswered fail; streams still open get their error output."""
        self._stopping = True
        if self.proc is None:
            return
        try:
            # Not behind a sender stuck on a full socket: then the child is not reading, and is killed below.
            if self._send_lock.acquire(timeout=1.0):
                try:
                    _send(self._conn, ("stop",))
                finally:
                    self._send_lock.release()
        except OSError:
            pass
        try:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:  # stuck in the driver: the kernel reaps it; nothing to wait for
                    log.error("%s: the engine process (pid %d) did not exit after SIGKILL", self.name, self.proc.pid)
        finally:
            if self._reader is not None:
                self._reader.join(1.0)  # it ends at the child's EOF: closing under it could read a reused fd
            self._conn.close()
            self._fail(RuntimeError("the engine process stopped"))

    def check(self) -> None:
        """Raise `WorkerThreadFailed` if the engine process or its worker thread died."""
        if self.error is not None:
            raise WorkerThreadFailed(f"{self.name} engine process failed: {self.error}") from self.error
        if self._reader is not None and not self._reader.is_alive() and not self._stopping:
            raise WorkerThreadFailed(f"{self.name}: the reader of the engine process stopped")
        if self.proc is not None and self.proc.poll() is not None and not self._stopping:
            raise WorkerThreadFailed(f"{self.name} engine process exited with {self.proc.returncode}")

    def handshake_offer(self) -> bytes | None:
        return self._offer

    def take_steps(self) -> list[StepRecord]:
        return take_records(self._steps)

    # ---------------------------------------------------------------- commands
    def __getattr__(self, name: str) -> Command:
        if name in COMMANDS.get(self.__dict__.get("role", ""), ()):
            return Command(name)
        raise AttributeError(name)

    def post(self, cmd: Command, *args) -> None:
        """Run ``cmd(*args)`` on the child's worker thread; errors are logged there. To a dead child: nothing
        (its open streams have their error outputs already)."""
        if self.error is None:
            try:
                self._send(("post", cmd.name, args))
            except OSError:
                # The child is gone. The reader fails the engine at the socket's end, after the outputs the child
                # sent before it (a request that finished there must not read as failed here).
                pass
        else:
            self._fail(self.error)  # streams opened since the failure learn it too

    def call(self, cmd: Command, *args) -> asyncio.Future:
        """Run ``cmd(*args)`` on the child's worker thread; await the result (or its exception).

        Unlike `WorkerThread.call`, cancelling the future does not skip a command not yet run: it has left
        for the child already. The servers call only the peer commands (``learn_peer`` / ``forget_peer``),
        which a repeat or a late run leaves right; request commands are `post` s, and the abort a cancelled
        request sends follows them on the same socket, so the child runs it after them, as the thread would."""
        cf: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = cf
        if self.error is None:
            try:
                self._send(("call", call_id, cmd.name, args))
            except OSError:
                pass  # the child is gone: the reader's end of the socket fails this call (`_fail`)
        if self.error is not None and self._calls.pop(call_id, None) is not None:  # no answer will come
            cf.set_exception(WorkerThreadFailed(f"{self.name} engine process failed: {self.error}"))
        return asyncio.wrap_future(cf)

    def open_stream(self, key: str) -> asyncio.Queue:
        return self._streams.open(key)

    def close_stream(self, key: str) -> None:
        self._streams.close(key)

    # ------------------------------------------------------------------- wire
    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            _send(self._conn, msg)

    def _read(self) -> None:
        """The reader thread: hands each message on. Whatever stops it (the child's exit, a message it
        cannot read) fails the engine: no stream or call is left waiting for a reader that is gone."""
        try:
            while True:
                self._handle(_recv(self._conn))
        except (EOFError, OSError) as e:
            self._fail(RuntimeError("the engine process stopped" if self._stopping
                                    else f"the engine process exited ({e!r})"))
        except BaseException as e:  # noqa: BLE001 - e.g. a message that does not unpickle
            log.exception("%s: reading from the engine process failed", self.name)
            self._fail(RuntimeError(f"reading from the engine process failed: {e!r}"))
        finally:
            self._ready.set()
        if self.exit_with_engine and not self._stopping and self._ready_seen:
            # Serve replaces a replica whose process died at once; one whose health checks fail only after
            # several periods, answering 503s meanwhile. So the replica follows its engine out.
            log.error("%s: the engine process died; this replica exits in %.1f s", self.name, EXIT_GRACE_S)
            time.sleep(EXIT_GRACE_S)
            os._exit(1)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "emit":
            if hop_trace.active():
                for key, item in msg[1]:
                    if hop_trace.carries_tokens(item):
                        hop_trace.mark(key, f"{self.role}.received")
            self._streams.deliver(msg[1])
        elif kind == "stats":
            self.stats = msg[1]
            self._steps.extend(msg[2])
        elif kind == "result":
            _, call_id, ok, value = msg
            cf = self._calls.pop(call_id, None)
            if cf is not None and cf.set_running_or_notify_cancel():
                cf.set_result(value) if ok else cf.set_exception(value)
        elif kind == "ready":
            self._ready_seen = True
            info = msg[1]
            self.agent_name, self.warmup_page, self._offer = info["agent"], info["warmup_page"], info["offer"]
            self.stats = info["stats"]
            self._ready.set()
        elif kind == "failed":
            self._fail(RuntimeError(msg[1]))

    def _fail(self, error: BaseException) -> None:
        """The child's worker is gone: every open stream and pending call learns it."""
        with self._fail_lock:
            if self.error is None:
                self.error = error
                if not self._stopping:
                    log.error("%s: %s", self.name, error)
            # A fault of this replica, not of the request: 503 at the ingress (`workers.request.unavailable`).
            # Each open stream gets one error output (a post after the failure fails only streams opened since).
            message = unavailable(f"{ENGINE_FAILED}: {self.error}")
            keys = [k for k in self._streams.keys() if k not in self._failed_keys]
            self._failed_keys.update(keys)
        self._ready.set()  # a start that failed ends `launch`'s wait
        self._streams.deliver([(k, self._fail_item(k, message)) for k in keys])
        for call_id in list(self._calls):
            cf = self._calls.pop(call_id, None)
            if cf is not None and cf.set_running_or_notify_cancel():
                cf.set_exception(WorkerThreadFailed(f"{self.name} engine process failed: {error}"))


def _send(conn: Connection, msg: tuple) -> None:
    """Plain pickle, not ``Connection.send``'s: multiprocessing's pickler would share a tensor's storage
    through its resource sharer, which authenticates with the key of a process multiprocessing started
    (this child was not), so a result carrying a tensor (prefill's last hidden state) failed to arrive."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


# ------------------------------------------------------------------------ child


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the replica's process is gone, even while the worker is being built (minutes at real
    scale, when nothing reads the socket): the kernel's parent-death signal (Linux), and a watchdog on
    the parent's pid, since that signal follows the thread that started the child, not the process."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="engine-watchdog", daemon=True).start()


def _log_files() -> list[str]:
    """The files Serve's logger writes in this process (a replica's ``replica_*.log``): the child writes its
    own records there too, so that an engine's errors are where a replica's are looked for."""
    paths = []
    for h in logging.getLogger("ray.serve").handlers:
        h = getattr(h, "target", None) or h  # Serve buffers its file handler in a MemoryHandler
        if isinstance(h, logging.FileHandler):
            paths.append(h.baseFilename)
    return paths


def _log_to(paths: list[str]) -> None:
    """Append this process's log records (INFO and up) to ``paths`` as well as stderr."""
    fmt = logging.Formatter("%(levelname)s %(asctime)s engine[%(process)d] %(filename)s:%(lineno)d - %(message)s")
    for path in paths:
        try:
            h = logging.FileHandler(path)  # append mode: the replica's records and these interleave by line
        except OSError as e:
            log.warning("engine process: cannot log to %s (%r)", path, e)
            continue
        h.setFormatter(fmt)
        logging.getLogger().addHandler(h)


def _wire_error(e: BaseException) -> BaseException:
    """An exception the replica can unpickle: itself if it round-trips, else a RuntimeError naming it
    (e.g. `transfer.errors.CompatibilityError`, whose constructor takes more than its message)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def _build_thread(init: dict[str, Any]) -> WorkerThread:
    from deployments.app_config import AppConfig
    from deployments.replica_build import build_worker_thread

    return build_worker_thread(AppConfig.model_validate(init["app_args"]), init["role"], init["model_dir"],
                               init["worker_id"])


def child_main(fd: int, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d] %(message)s")
    conn = Connection(fd)
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            _send(conn, msg)

    init = _recv(conn)[1]
    _log_to(init.get("log_files", []))
    sys.setswitchinterval(init["gil_switch_interval_ms"] / 1e3)
    try:
        thread = _build_thread(init)
    except BaseException as e:  # noqa: BLE001 - the replica reports it and Serve retries the replica
        log.exception("engine process: building the %s worker failed", init["role"])
        send(("failed", f"building the {init['role']} worker failed: {e!r}"))
        os._exit(1)  # whatever the partial build started must not keep this process alive
    log.info("engine process %d (replica %d): %s worker %s built", os.getpid(), parent_pid, init["role"],
             thread.agent_name)
    # The thread's outputs go over the socket, one message per round (its `emit_many`), in order per key.
    thread.redirect_outputs(lambda items: send(("emit", list(items))))
    offer = thread.handshake_offer()
    thread.start()
    send(("ready", {"agent": thread.agent_name, "warmup_page": getattr(thread, "warmup_page", None),
                    "offer": offer, "stats": thread.stats}))
    stop = threading.Event()

    def report() -> None:
        """Stats and step records every STATS_EVERY_S, and a last one at the end. A worker thread that
        died, or a report that cannot go out, ends the process: the replica then sees the socket close,
        the one failure signal that cannot be lost."""
        last = None
        try:
            while not stop.wait(STATS_EVERY_S):
                steps = thread.take_steps()
                if thread.stats is not last or steps:
                    last = thread.stats
                    send(("stats", last, steps))
                if thread.error is not None:
                    # Its fail_all's outputs go out first: each open stream ends with the thread path's 503.
                    thread.join(STOP_JOIN_S)
                    send(("stats", thread.stats, thread.take_steps()))
                    send(("failed", f"worker thread failed: {thread.error!r}"))
                    os._exit(1)
            send(("stats", thread.stats, thread.take_steps()))
        except BaseException:  # noqa: BLE001
            if not stop.is_set():
                log.exception("engine process: reporting failed")
                os._exit(1)

    reporter = threading.Thread(target=report, name="engine-stats", daemon=True)
    reporter.start()

    def answer(call_id: int, f: concurrent.futures.Future) -> None:
        """A call's result, or its exception, always goes back (else the replica's future never resolves)."""
        e = f.exception()
        try:
            send(("result", call_id, e is None, f.result() if e is None else _wire_error(e)))
        except OSError:
            pass  # the replica is gone
        except Exception as err:  # noqa: BLE001 - a result that does not pickle
            send(("result", call_id, False, RuntimeError(f"the result did not pickle: {err!r}")))

    try:
        while True:
            msg = _recv(conn)
            if msg[0] == "stop":
                break
            try:
                if msg[0] == "post":
                    thread.post(getattr(thread, msg[1]), *msg[2])
                elif msg[0] == "call":
                    thread.call_future(getattr(thread, msg[2]), *msg[3]).add_done_callback(
                        lambda f, i=msg[1]: answer(i, f))
            except Exception as e:  # noqa: BLE001 - a bad command fails alone; the engine goes on
                log.exception("engine process: command %r failed", msg[:2])
                if msg[0] == "call":
                    send(("result", msg[1], False, _wire_error(e)))
    except (EOFError, OSError):
        pass  # the replica is gone
    finally:
        thread.stop(timeout=STOP_JOIN_S)
        stop.set()
        reporter.join(1.0)  # its last report goes out before the socket closes


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
