"""Offline API: ``LLM(model_dir).generate(...)`` without any server.

This is the API every correctness check uses. Decode runs through the paged
caches (never a full recompute) with all live requests batched per step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from models.batch import ForwardMode
from workers.decode_graphs import graphs_wanted
from workers.decode_worker import DecodeWorker
from workers.model_runner import WorkItem
from workers.page_pool import PoolExhausted
from workers.page_tables import frozen_pages
from workers.prefill_graphs import prefill_graph_tokens
from workers.prefill_worker import PrefillTask, PrefillWorker
from workers.rank_build import RankSpec, uses_cache_groups
from workers.rank_group import RankGroup
from workers.replica_build import build_engine, build_replica
from workers.request import FinishReason, Request, RequestState
from workers.sample.params import SamplingParams
from workers.scheduler import SchedulerConfig
from workers.structured import GrammarSpec


class LLM:
    """A model replica in-process.

    dtype: ``"float32"`` | ``"bfloat16"`` (weights and activations).
    kv_cache_dtype: ``"auto"`` keeps the MLA latent and indexer keys unquantized
    in ``dtype`` (exact math, for comparisons); ``"fp8"`` uses the serving byte
    formats (656-byte MLA tokens, 132-byte indexer tokens).
    tp_size: tensor-parallel ranks per replica (each side of ``pd=True``):
    > 1 runs each rank in its own Ray actor (``workers.rank_group``; gloo on
    CPU, NCCL and one GPU per rank on ``cuda``) driven by this process's
    engine; `shutdown` ends them.
    two_batch_overlap: with ``tp_size > 1``, run each eager forward as two micro-batches whose
    all-reduces overlap the other's compute (`models.two_batch`).
    prefill_graph_max_tokens: with CUDA graphs on, a prefill of one new prompt of up to this many
    tokens replays a captured graph (`workers.prefill_graphs`; None: 1024, capped by the model's
    ``index_topk`` and ``chunk_size``; 0: off).
    prefix_caching: keep finished requests' full pages in each pool's prefix cache
    (`workers.prefix_cache`): a prompt's cached prefix is neither computed again
    nor, with ``pd=True``, pushed again; outputs are the same either way.
    """

    def __init__(self, model_dir: str | Path, backend: str = "reference", device: str = "cpu",
                 dtype: str = "float32", kv_cache_dtype: str = "auto", num_pages: int = 512,
                 hadamard: bool | None = None, mtp_draft_tokens: int = 0, mtp_topk_reuse: bool = False,
                 chunk_size: int = 256, max_batch_size: int = 64, pd: bool = False,
                 transfer_deadline_s: float = 600.0, cuda_graphs: bool | None = None,
                 cuda_graph_max_context: int | None = None, prefill_graph_max_tokens: int | None = None,
                 tp_size: int = 1, overlap_scheduling: bool = True,
                 prefix_caching: bool = True, two_batch_overlap: bool = False):
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.model_dir = Path(model_dir)
        # hadamard None: rotate indexer keys only once they are quantized (RankSpec.use_hadamard).
        spec = RankSpec(str(self.model_dir), backend, device, dtype, kv_cache_dtype, num_pages, hadamard,
                        two_batch_overlap=two_batch_overlap)
        # Before any rank worker starts: a refusal costs nothing.
        want_graphs = graphs_wanted(cuda_graphs, backend, device, tp_size, mtp=mtp_draft_tokens > 0,
                                    cache_groups=uses_cache_groups(str(self.model_dir)))
        if pd and tp_size == 1 and torch.device(device).type == "cuda":
            # Measured on the H100 (nixl 1.5.1): a VRAM push between two agents of
            # one process fails with NIXL_ERR_REMOTE_DISCONNECT; across processes
            # it works (the Serve app; tests/workers/remote_prefill.py; with
            # tp_size > 1 every rank is its own process).
            raise ValueError("LLM(pd=True) runs prefill and decode in one process, which NIXL cannot link "
                             "over GPU memory; on a GPU serve the app (prefill and decode replicas are "
                             "separate processes) or use pd=False")
        mtp = mtp_draft_tokens > 0
        decode = build_replica(spec, tp_size, "decode-0" if pd else None, prefix_caching=prefix_caching, mtp=mtp,
                               chunk_size=chunk_size)
        self.groups: list[RankGroup] = [decode.group] if decode.group else []
        self.model, self.runner, self.cache, self.pool = decode.model, decode.runner, decode.cache, decode.pool
        self.cfg = self.model.cfg
        sched = SchedulerConfig(max_batch_size=max_batch_size, chunk_size=chunk_size, mtp_draft_tokens=mtp_draft_tokens,
                                overlap=overlap_scheduling)
        prefill_tokens = prefill_graph_tokens(prefill_graph_max_tokens, want_graphs, self.cfg, chunk_size, tp_size,
                                              uses_cache_groups(str(self.model_dir)))
        self.engine = build_engine(decode, self.model_dir, sched, mtp_topk_reuse, want_graphs, cuda_graph_max_context,
                                   prefill_tokens)
        self._next_id = 0
        self.pd = None
        if pd:
            # A second replica in-process: its own weights, cache and pool, linked to
            # this one by real NIXL agents (DRAM on CPU); with tp_size > 1 prefill
            # rank i pushes to decode rank i, each pair over its own agents.
            prefill = build_replica(replace(spec, push=spec.push.for_prefill()), tp_size, "prefill-0",
                                    prefix_caching=prefix_caching, mtp=mtp)
            if prefill.group:
                self.groups.append(prefill.group)
            decode.link.handshake(prefill.link)
            # CPU prefill of a queue of prompts is slow: the deadline covers queueing + compute.
            self.pd = _LocalPD(PrefillWorker(prefill.runner, prefill.pool, prefill.link, chunk_size,
                                             mtp=mtp_draft_tokens > 0, deadline_s=transfer_deadline_s,
                                             grammars=self.engine.grammars),  # one tokenizer: one compiler
                               DecodeWorker(self.engine, decode.link, deadline_s=transfer_deadline_s))

    def shutdown(self) -> None:
        """End the rank actors (tp_size > 1); a no-op otherwise."""
        for g in self.groups:
            g.shutdown()
        self.groups = []

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 ``[len(token_ids), vocab]``: the logits after every prompt token."""
        pages = self.pool.allocate_for_tokens(len(token_ids))
        try:
            batch, hidden = self.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(token_ids), 0, frozen_pages(pages))])
            with torch.inference_mode():
                return self.model.logits(hidden).cpu()
        finally:
            self.pool.free(pages)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                 stop: tuple[str, ...] = (), min_p: float = 0.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_tokens: int = 0,
                 logit_bias: tuple[tuple[int, float], ...] = (),
                 grammar: GrammarSpec | list[GrammarSpec | None] | None = None) -> list[list[int]]:
        """Generate for every prompt; returns the new token ids of each (ending at
        the first EOS / stop token, which is included, unless ``ignore_eos``).
        Sampling options as in ``workers.sample.params.SamplingParams``. With
        ``seed``, request ``i`` samples from its own stream seeded ``seed + i``:
        reproducible whatever else is in the batch. ``grammar``: structured
        outputs (`workers.structured.GrammarSpec`), one for every prompt or a
        list with one (or None) per prompt."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        reqs = []
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens, temperature, top_p, top_k,
                                    None if seed is None else seed + i, tuple(stop_token_ids), ignore_eos, tuple(stop),
                                    min_p, presence_penalty, frequency_penalty, repetition_penalty,
                                    min_tokens=min_tokens, logit_bias=tuple(logit_bias),
                                    grammar=grammar[i] if isinstance(grammar, list) else grammar)
            reqs.append(Request(f"offline-{self._next_id}", list(p), params))
            self._next_id += 1
        return self._run(reqs)

    def logprob_requests(self, prompts: list[list[int]], max_new_tokens: int = 1, logprobs: int | None = None,
                         prompt_logprobs: int | None = 0, **sampling) -> list[Request]:
        """Generate (greedy unless ``sampling`` says otherwise: ``SamplingParams`` fields) with
        log-probabilities; returns the finished requests: ``output`` / ``logprobs`` the new tokens
        and theirs, ``prompt_logprobs`` (`workers.sample.prompt_logprobs.PromptLogprobs`) the
        prompt's, computed in the engine's chunked prefill (with ``pd=True`` on the prefill worker,
        sent over with token 1) as served requests get them."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        params = SamplingParams(max_new_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **sampling)
        reqs = []
        for p in prompts:
            reqs.append(Request(f"offline-{self._next_id}", list(p), params))
            self._next_id += 1
        self._run(reqs)
        return reqs

    def _run(self, reqs: list[Request]) -> list[list[int]]:
        """Run ``reqs`` to their end; the new token ids of each."""
        if self.pd is not None:
            return self.pd.generate(reqs)
        for r in reqs:
            rejected = self.engine.add_request(r)
            if rejected is not None:
                for other in reqs:
                    self.engine.abort(other.request_id)
                raise ValueError(rejected.error)
        try:
            while any(not r.finished for r in reqs):
                self.engine.step()
            self.engine.flush()  # a step launched ahead of tokens that turned out to be the last
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [list(r.output) for r in reqs]

    def stats(self) -> dict:
        """MTP acceptance counts, page-pool free counts and step counters."""
        s = self.engine.stats
        return {
            "mtp_drafted": s.mtp_drafted,
            "mtp_accepted": s.mtp_accepted,
            "mtp_acceptance_rate": s.mtp_acceptance_rate,
            "mtp_accepted_histogram": dict(s.accepted_histogram),
            "steps": s.steps,
            "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens,
            "preemptions": s.preemptions,
            "mixed_steps": s.mixed_steps,
            "two_batch_forwards": self._two_batch_forwards(),
            **_cache_stats("", self.pool),
            **(_cache_stats("prefill_", self.pd.prefill.pool) if self.pd else {}),
            "pool_free_pages": self.pool.free_count,
            "pool_total_pages": self.pool.num_pages,
            **({"prefill_pool_free_pages": self.pd.prefill.pool.free_count} if self.pd else {}),
        }

    def _two_batch_forwards(self) -> int:
        """Forwards of the decode side run as two micro-batches (rank 0's count: every rank splits alike)."""
        if self.groups:
            return self.groups[0].call_rank(0, "two_batch_forwards")
        two_batch = getattr(self.model, "two_batch", None)
        return two_batch.overlapped if two_batch is not None else 0


def _cache_stats(prefix: str, pool) -> dict:
    """A pool's prefix-cache figures (`workers.prefix_cache.CacheCounters`, pages cached), keys ``prefix``-ed."""
    c = pool.prefix_cache.counters if pool.prefix_cache is not None else None
    return {f"{prefix}prefix_cache_queries": c.queries if c else 0, f"{prefix}prefix_cache_hits": c.hits if c else 0,
            f"{prefix}prefix_cache_evictions": c.evictions if c else 0, f"{prefix}cached_pages": pool.cached_count}


class _LocalPD:
    """Drives a prefill and a decode worker in one process the way the Serve
    deployments drive them across processes: decode reserves pages, prefill
    computes and pushes, decode admits and decodes."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker):
        self.prefill, self.decode = prefill, decode

    def generate(self, reqs: list[Request]) -> list[list[int]]:
        queued = list(reqs)
        # What the prefill worker is asked whether a request must wait (kept: its page keys are memoized on it).
        probes = {r.request_id: PrefillTask(r.request_id, r.prompt, r.params, "", []) for r in reqs}
        try:
            while queued or any(not r.finished for r in reqs):
                i = 0
                while i < len(queued):
                    r = queued[i]
                    if self.decode.waits_for_prefix(r) or self.prefill.waits_for_prefix(probes[r.request_id]):
                        i += 1  # its prefix is being prefilled or pushed: it reuses those pages (the served rule)
                        continue
                    try:
                        pages = self.decode.reserve(r, self.prefill.link.agent.name)
                    except PoolExhausted:
                        if not self.decode.has_work:
                            raise
                        break
                    try:
                        self.prefill.submit(PrefillTask(r.request_id, r.prompt, r.params,
                                                        self.decode.link.agent.name, pages, r.cached_pages))
                    except PoolExhausted:
                        self.decode.abort(r.request_id)
                        r.state = RequestState.WAITING
                        r.finish_reason = None
                        break
                    queued.pop(i)
                for res in self.prefill.step():
                    self.decode.on_prefill_result(res)
                self.decode.step()
                failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
                if failed:
                    raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
            self.decode.engine.flush()
        except BaseException:
            for r in reqs:
                self.prefill.abort(r.request_id)
                self.decode.abort(r.request_id)
            raise
        return [list(r.output) for r in reqs]
