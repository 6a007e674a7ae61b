"""`deployments.engine_process.EngineProcess`: a monolithic decode replica's worker thread run in a child
process, driven as the replica drives it (no Serve here: the served option is
`test_serve_engine_process.py`'s).

A request's streamed tokens equal the offline engine's greedy output, stats and step records arrive,
a command's exception comes back to its caller, and a killed engine process fails every open stream
with the role's error output and makes `check` raise. `stop` ends the child.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from deployments.app_config import AppConfig
from deployments.decode_thread import error_output
from deployments.engine_process import EngineProcess
from deployments.worker_thread import ENGINE_FAILED, WorkerThreadFailed
from tests.deployments.app_fixtures import CONFIGS
from tests.deployments.offline_reference import prompt_ids
from workers.request import Request, unavailable
from workers.sample.params import SamplingParams

RAW = yaml.safe_load((CONFIGS / "tiny_mono.yaml").read_text())["applications"][0]["args"]
ARGS = AppConfig.model_validate(RAW)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ARGS.model.model_copy(update={"cache_dir": str(tmp_path_factory.mktemp("ep-cache"))})
               .checkpoint_dir(make=True))


async def _collect(q: asyncio.Queue, timeout: float = 120) -> list:
    outs = []
    while True:
        out = await asyncio.wait_for(q.get(), timeout)
        outs.append(out)
        if out.finished:
            return outs


def test_engine_process_streams_the_offline_greedy_output(model_dir):
    from workers.offline import LLM

    prompts = [prompt_ids(n, seed=30 + n) for n in (3, 40, 300)]
    d = ARGS.decode
    want = LLM(model_dir, backend=d.backend, device=d.device, dtype=d.dtype, kv_cache_dtype=d.kv_cache_dtype,
               num_pages=d.num_pages, chunk_size=d.chunk_size).generate(prompts, max_new_tokens=12, ignore_eos=True)
    proc = EngineProcess("decode", RAW, model_dir, "decode-ep-test", 0.2, fail_item=error_output)
    proc.launch(timeout_s=120)
    try:
        assert proc.proc.pid != os.getpid() and proc.warmup_page is None and proc.handshake_offer() is None
        assert proc.stats.total_pages == d.num_pages and proc.agent_name == "decode-ep-test"

        async def run():
            queues = [proc.open_stream(f"r{i}") for i in range(len(prompts))]
            with pytest.raises(ValueError, match="already in flight"):
                proc.open_stream("r0")
            for i, p in enumerate(prompts):
                proc.post(proc.add, Request(f"r{i}", list(p), SamplingParams(max_new_tokens=12, ignore_eos=True)),
                          None)
            got = await asyncio.gather(*(_collect(q) for q in queues))
            with pytest.raises(AttributeError):  # a monolithic worker has no link: the command's own error
                await proc.call(proc.learn_peer, b"not an offer")
            return got

        got = asyncio.run(run())
        assert [[t for o in outs for t in o.token_ids] for outs in got] == want
        assert all(outs[-1].finish_reason == "length" for outs in got)
        with pytest.raises(AttributeError):
            proc.not_a_command  # noqa: B018 - only the role's commands are names
        steps = []
        for _ in range(100):  # the child reports every STATS_EVERY_S
            steps += proc.take_steps()
            if proc.stats.free_pages == d.num_pages and steps:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert proc.stats.free_pages == d.num_pages and proc.stats.requests == 0
        assert {s.kind for s in steps} >= {"prefill", "decode"}
        proc.check()
    finally:
        proc.stop()
    assert proc.proc.returncode is not None


def test_the_engine_process_logs_into_the_replicas_log_file(model_dir, tmp_path):
    """A replica's Serve log file (a FileHandler on ``ray.serve``) gets the child's records too: an engine's
    errors are where the replica's are looked for."""
    import logging

    import logging.handlers

    path = tmp_path / "replica.log"
    # As Serve sets it up in a replica: the file handler behind a MemoryHandler.
    handler = logging.handlers.MemoryHandler(100, target=logging.FileHandler(path))
    logging.getLogger("ray.serve").addHandler(handler)
    try:
        proc = EngineProcess("decode", RAW, model_dir, "decode-ep-log", 0.2, fail_item=error_output)
        proc.launch(timeout_s=120)
        pid = proc.proc.pid
        proc.stop()
    finally:
        logging.getLogger("ray.serve").removeHandler(handler)
        handler.target.close()
        handler.close()
    lines = [line for line in path.read_text().splitlines() if f"engine[{pid}]" in line]
    assert any("decode worker decode-ep-log built" in line for line in lines), path.read_text()[-2000:]


def test_a_killed_engine_process_fails_its_streams(model_dir):
    proc = EngineProcess("decode", RAW, model_dir, "decode-ep-kill", 0.2, fail_item=error_output)
    proc.launch(timeout_s=120)
    try:
        async def run():
            q = proc.open_stream("long")
            proc.post(proc.add, Request("long", prompt_ids(50, seed=1),
                                        SamplingParams(max_new_tokens=20000, ignore_eos=True)), None)
            first = await asyncio.wait_for(q.get(), 120)
            assert first.token_ids and not first.finished
            os.kill(proc.proc.pid, signal.SIGKILL)
            while True:
                out = await asyncio.wait_for(q.get(), 60)
                if out.finished:
                    break
            # After the failure: a new request is answered with the error, once however many posts follow;
            # a command raises.
            after = proc.open_stream("after")
            proc.post(proc.add, Request("after", [1, 2, 3], SamplingParams(max_new_tokens=2)), None)
            late = await asyncio.wait_for(after.get(), 10)
            for _ in range(3):
                proc.post(proc.abort, "after")
            with pytest.raises(WorkerThreadFailed):
                await proc.call(proc.abort, "long")
            await asyncio.sleep(0.2)
            assert after.empty() and q.empty(), "a stream was failed twice"
            return out, late

        last, late = asyncio.run(run())
        for out in (last, late):  # a fault of the replica, not of the request: 503 at the ingress
            assert out.finished and out.finish_reason == "error" and out.error.startswith(unavailable(ENGINE_FAILED))
        with pytest.raises(WorkerThreadFailed):
            proc.check()
    finally:
        proc.stop()


class _TwoArgError(Exception):
    def __init__(self, peer, diffs):  # as transfer.errors.CompatibilityError: unpickling calls it with one arg
        super().__init__(f"{peer}: {diffs}")
        self.peer, self.diffs = peer, diffs


def test_an_exception_that_does_not_unpickle_comes_back_as_a_runtime_error():
    from deployments.engine_process import _wire_error

    e = _TwoArgError("p", ["dtype"])
    wired = _wire_error(e)
    assert type(wired) is RuntimeError and str(wired) == "_TwoArgError: p: ['dtype']"
    plain = ValueError("fine")
    assert _wire_error(plain) is plain


def test_the_engine_process_dies_with_its_replica(model_dir, tmp_path):
    """The replica's process killed outright (no stop): its engine process goes too, by whichever comes first
    (the closed socket, the parent-death signal, the watchdog on the parent's pid; while a worker is being
    built only the last two can act)."""
    import time

    replica = _replica_process(tmp_path, model_dir, "decode-orphan")
    try:
        child = int(replica.stdout.readline())
        assert os.path.exists(f"/proc/{child}")
        os.kill(replica.pid, signal.SIGKILL)
        replica.wait(10)
        end = time.monotonic() + 15
        while time.monotonic() < end and os.path.exists(f"/proc/{child}") and \
                "zombie" not in _proc_state(child):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{child}") or "zombie" in _proc_state(child), _proc_state(child)
    finally:
        if replica.poll() is None:
            replica.kill()


def test_a_replica_exits_after_its_engine_process_dies(model_dir, tmp_path):
    """``exit_with_engine`` (what a Serve replica sets): the child killed, the replica's process exits too, after
    the grace that lets its streams' errors out, so Serve replaces it at once instead of after several failed
    health checks (it would answer 503s meanwhile)."""
    import time

    from deployments.engine_process import EXIT_GRACE_S

    replica = _replica_process(tmp_path, model_dir, "decode-exit", "exit_with_engine=True")
    try:
        child = int(replica.stdout.readline())
        t0 = time.monotonic()
        os.kill(child, signal.SIGKILL)
        assert replica.wait(EXIT_GRACE_S + 20) == 1
        assert time.monotonic() - t0 >= EXIT_GRACE_S
    finally:
        if replica.poll() is None:
            replica.kill()


def _replica_process(tmp_path, model_dir: str, worker_id: str, options: str = ""):
    """A Python process standing in for a replica: it launches an `EngineProcess` (``options``: more keyword
    arguments, as source), prints the child's pid, then sleeps. The caller reads the pid from its stdout."""
    import subprocess
    import sys

    script = tmp_path / f"{worker_id}.py"
    script.write_text(
        "import json, sys, time\n"
        "from deployments.decode_thread import error_output\n"
        "from deployments.engine_process import EngineProcess\n"
        f"proc = EngineProcess('decode', json.loads({json.dumps(json.dumps(RAW))!s}), {model_dir!r}, {worker_id!r}, "
        f"0.2, fail_item=error_output, {options})\n"
        "proc.launch(timeout_s=120)\n"
        "print(proc.proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))


def _proc_state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return "gone"


def test_a_prefill_engine_failure_marks_the_pd_attempt_for_one_retry():
    """`DecodeServer._await_prefill`: a prefill answer ended by its replica's failed engine (thread or process)
    marks the attempt retryable, as a dead prefill replica does; the request's own errors do not."""
    from types import SimpleNamespace

    from deployments.decode_server import DecodeServer
    from workers.prefill_worker import PrefillResult, PrefillTask

    posted = []
    server = SimpleNamespace(retryable=set(), thread=SimpleNamespace(prefill_result="prefill_result",
                                                                     post=lambda *a: posted.append(a)))

    async def answer(result):
        return "agent-p", result

    def run(rid: str, error: str) -> None:
        task = PrefillTask(rid, [1, 2, 3], SamplingParams(max_new_tokens=2), "decode-agent", [0])
        asyncio.run(DecodeServer._await_prefill(server, task, answer(PrefillResult(rid, False, error=error))))

    run("a", unavailable(f"{ENGINE_FAILED}: the engine process exited"))
    run("b", "prompt too long")
    run("c", unavailable("KV transfer expired"))
    assert server.retryable == {"a"}
    assert [p[1].request_id for p in posted] == ["a", "b", "c"]
