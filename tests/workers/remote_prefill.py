"""A prefill worker in a child process, driven from the test process over a pipe.

On a GPU, NIXL (UCX cuda_ipc) cannot push between two agents of one process
(``LLM(pd=True, device="cuda")`` fails with NIXL_ERR_REMOTE_DISCONNECT on
the H100), so the GPU equivalence tests run prefill in its own process, as
the Serve deployments do: the handshake crosses as bytes, tasks and results
as pickles (results carry CPU tensors only).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time

_IDS = itertools.count()  # request ids are never reused (the receiver refuses a reused one)


def _child(conn, model_dir: str, llm_kwargs: dict, chunk_size: int, mtp: bool) -> None:
    from workers.kv_link import KVLink
    from workers.offline import LLM
    from workers.prefill_worker import PrefillWorker
    from workers.push_tuning import PushTuning

    # The caller's settings unchanged: a prefill replica replays the same prefill graphs as a
    # monolithic one (prefill_graph_max_tokens), so PD and monolithic take the same prefill path.
    # (Session 28 found PD != monolithic at a prompt's first token with this process's graphs off:
    # the monolithic side replayed its 64-token chunks' graphs, the prefill side ran them eagerly.)
    llm = LLM(model_dir, **llm_kwargs)
    link = KVLink.create("prefill-0", model_dir, llm.cache, has_mtp=len(llm.model.mtp) > 0,
                         push=PushTuning().for_prefill())
    worker = PrefillWorker(llm.runner, llm.pool, link, chunk_size, mtp=mtp, deadline_s=600.0)
    conn.send(("ready", link.agent.name))
    while True:
        while conn.poll():
            op, arg = conn.recv()
            if op == "respond":
                conn.send(("reply", link.peers.respond(arg)))
            elif op == "submit":
                worker.submit(arg)
            elif op == "abort":
                worker.abort(arg)
            elif op == "free_count":
                conn.send(("free_count", worker.pool.free_count))
            elif op == "stop":
                link.close()
                return
        results = worker.step()
        if results:
            conn.send(("results", results))
        elif not worker.active:
            time.sleep(0.001)


class RemotePrefill:
    """``submit`` / ``results`` / ``abort`` of a :class:`~workers.prefill_worker.PrefillWorker`
    living in a spawned process with its own copy of the model and cache."""

    def __init__(self, model_dir, llm_kwargs: dict, chunk_size: int, mtp: bool):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, str(model_dir), llm_kwargs, chunk_size, mtp),
                                daemon=True)
        self.proc.start()
        self.agent_name = self._expect("ready")
        self._pending = []

    def _expect(self, tag: str, timeout: float = 300.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"prefill process sent no {tag!r} in {timeout} s")
        got, value = self.conn.recv()
        while got == "results":  # results may arrive before a reply
            self._pending.extend(value)
            got, value = self.conn.recv()
        if got != tag:
            raise RuntimeError(f"expected {tag!r} from the prefill process, got {got!r}")
        return value

    def handshake(self, decode_link) -> None:
        self.conn.send(("respond", decode_link.peers.offer().to_bytes()))
        decode_link.peers.accept(self._expect("reply"))

    def submit(self, task) -> None:
        self.conn.send(("submit", task))

    def abort(self, request_id: str) -> None:
        self.conn.send(("abort", request_id))

    def results(self) -> list:
        out, self._pending = self._pending, []
        while self.conn.poll():
            tag, value = self.conn.recv()
            assert tag == "results", tag
            out.extend(value)
        return out

    def free_count(self) -> int:
        self.conn.send(("free_count", None))
        return self._expect("free_count")

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.proc.join(60)


def generate_pd(decode_llm, prefill: RemotePrefill, decode_worker, prompts, **sampling) -> list[list[int]]:
    """Greedy/sampled generation of ``prompts`` with prefill in the other process."""
    from workers.request import FinishReason, Request
    from workers.prefill_worker import PrefillTask
    from workers.sample.params import SamplingParams

    reqs = []
    for i, p in enumerate(prompts):
        seed = sampling.get("seed")
        params = SamplingParams(sampling.get("max_new_tokens", 16), sampling.get("temperature", 0.0),
                                sampling.get("top_p", 1.0), sampling.get("top_k", 0),
                                None if seed is None else seed + i, (), sampling.get("ignore_eos", False))
        reqs.append(Request(f"pd-{next(_IDS)}", list(p), params))
    for r in reqs:
        pages = decode_worker.reserve(r, prefill.agent_name)
        prefill.submit(PrefillTask(r.request_id, r.prompt, r.params, decode_worker.link.agent.name, pages))
    deadline = time.monotonic() + 600
    while any(not r.finished for r in reqs):
        for res in prefill.results():
            decode_worker.on_prefill_result(res)
        decode_worker.step()
        failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        if time.monotonic() > deadline:
            raise TimeoutError("PD generation did not finish in 600 s")
    return [list(r.output) for r in reqs]
