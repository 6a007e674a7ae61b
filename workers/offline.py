"""Offline API: ``LLM(model_dir).generate(...)`` without any server.

This is the API every correctness check uses. Decode runs through the paged
caches (never a full recompute) with all live requests batched per step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from attention.backend import get_backend
from attention.cache import PagedKVCache
from models.batch import ForwardMode
from models.loader import load_model
from workers.decode_graphs import default_graph_context, graphs_wanted
from workers.engine import Engine
from workers.model_runner import ModelRunner, WorkItem, cache_spec_for
from workers.page_pool import PagePool
from workers.decode_worker import DecodeWorker
from workers.kv_link import KVLink
from workers.page_pool import PoolExhausted
from workers.prefill_worker import PrefillTask, PrefillWorker
from workers.push_tuning import PushTuning
from workers.rank_group import RankGroup
from workers.rank_worker import RankSpec
from workers.request import FinishReason, Request, RequestState
from workers.sampler import SamplingParams
from workers.scheduler import SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    """

    def __init__(self, model_dir: str | Path, backend: str = "reference", device: str = "cpu",
                 dtype: str = "float32", kv_cache_dtype: str = "auto", num_pages: int = 512,
                 hadamard: bool | None = None, mtp_draft_tokens: int = 0, mtp_topk_reuse: bool = False,
                 chunk_size: int = 256, max_batch_size: int = 64, pd: bool = False,
                 transfer_deadline_s: float = 600.0, cuda_graphs: bool | None = None,
                 cuda_graph_max_context: int | None = None, tp_size: int = 1):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        self.model_dir = Path(model_dir)
        # The Hadamard rotation only matters once keys are quantized; in exact
        # mode it is skipped, as in transformers' reference.
        hadamard = kv_cache_dtype == "fp8" if hadamard is None else hadamard
        self.groups: list[RankGroup] = []
        want_graphs = graphs_wanted(cuda_graphs, backend, device, tp_size)  # before any rank worker starts
        if tp_size > 1:
            rank_spec = RankSpec(str(self.model_dir), backend, device, dtype, kv_cache_dtype, num_pages, hadamard)
            self.groups.append(RankGroup(rank_spec, tp_size))
            self.model, self.runner, self.cache = self.groups[0].model, self.groups[0].runner, None
        else:
            self.model = load_model(self.model_dir, _DTYPES[dtype], device, hadamard=hadamard)
            self.cache = PagedKVCache(cache_spec_for(self.model, num_pages, kv_cache_dtype), device)
            self.runner = ModelRunner(self.model, self.cache, get_backend(backend), device)
        self.cfg = self.model.cfg
        self.pool = PagePool(num_pages)
        sched = SchedulerConfig(max_batch_size=max_batch_size, chunk_size=chunk_size, mtp_draft_tokens=mtp_draft_tokens)
        self.engine = Engine(self.runner, self.pool, sched, self.cfg.eos_token_ids, mtp_topk_reuse,
                             detokenize=self._detokenizer())
        if want_graphs:
            self.engine.enable_cuda_graphs(cuda_graph_max_context or default_graph_context(self.cfg, num_pages))
        self._next_id = 0
        self.pd = None
        if pd and tp_size == 1 and torch.device(device).type == "cuda":
            # Measured on the H100 (nixl 1.5.1): a VRAM push between two agents of
            # one process fails with NIXL_ERR_REMOTE_DISCONNECT; across processes
            # it works (the Serve app; tests/workers/remote_prefill.py; with
            # tp_size > 1 every rank is its own process).
            raise ValueError("LLM(pd=True) runs prefill and decode in one process, which NIXL cannot link "
                             "over GPU memory; on a GPU serve the app (prefill and decode replicas are "
                             "separate processes) or use pd=False")
        if pd:
            # A second replica in-process: its own weights, cache and pool,
            # linked to this one by real NIXL agents (DRAM on CPU).
            ppool = PagePool(num_pages)
            if tp_size > 1:
                # Prefill rank i pushes to decode rank i, each pair over its own NIXL agents.
                self.groups.append(RankGroup(replace(rank_spec, push=rank_spec.push.for_prefill()), tp_size))
                prunner = self.groups[1].runner
                plink, dlink = self.groups[1].link("prefill-0"), self.groups[0].link("decode-0")
            else:
                pmodel = load_model(self.model_dir, _DTYPES[dtype], device, hadamard=hadamard)
                pcache = PagedKVCache(cache_spec_for(pmodel, num_pages, kv_cache_dtype), device)
                prunner = ModelRunner(pmodel, pcache, get_backend(backend), device)
                has_mtp = len(self.model.mtp) > 0
                plink = KVLink.create("prefill-0", self.model_dir, pcache, has_mtp, push=PushTuning().for_prefill())
                dlink = KVLink.create("decode-0", self.model_dir, self.cache, has_mtp)
            dlink.handshake(plink)
            # CPU prefill of a queue of prompts is slow: the deadline covers queueing + compute.
            self.pd = _LocalPD(PrefillWorker(prunner, ppool, plink, chunk_size, mtp=mtp_draft_tokens > 0,
                                             deadline_s=transfer_deadline_s),
                               DecodeWorker(self.engine, dlink, deadline_s=transfer_deadline_s))

    def shutdown(self) -> None:
        """End the rank actors (tp_size > 1); a no-op otherwise."""
        for g in self.groups:
            g.shutdown()
        self.groups = []

    def _detokenizer(self):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError):
            return None  # token-id-only checkpoint: stop strings are refused
        return lambda ids: tok.decode(ids)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 ``[len(token_ids), vocab]``: the logits after every prompt token."""
        pages = self.pool.allocate_for_tokens(len(token_ids))
        try:
            batch, hidden = self.runner.forward(ForwardMode.EXTEND, [WorkItem(tuple(token_ids), 0, tuple(pages))])
            with torch.inference_mode():
                return self.model.logits(hidden).cpu()
        finally:
            self.pool.free(pages)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                 stop: tuple[str, ...] = ()) -> list[list[int]]:
        """Generate for every prompt; returns the new token ids of each (ending at
        the first EOS / stop token, which is included, unless ``ignore_eos``).
        With ``seed``, request ``i`` samples from its own generator seeded
        ``seed + i``: reproducible whatever else is in the batch."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        reqs = []
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens, temperature, top_p, top_k,
                                    None if seed is None else seed + i, tuple(stop_token_ids), ignore_eos, tuple(stop))
            reqs.append(Request(f"offline-{self._next_id}", list(p), params))
            self._next_id += 1
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
            "pool_free_pages": self.pool.free_count,
            "pool_total_pages": self.pool.num_pages,
            **({"prefill_pool_free_pages": self.pd.prefill.pool.free_count} if self.pd else {}),
        }


class _LocalPD:
    """Drives a prefill and a decode worker in one process the way the Serve
    deployments drive them across processes: decode reserves pages, prefill
    computes and pushes, decode admits and decodes."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker):
        self.prefill, self.decode = prefill, decode

    def generate(self, reqs: list[Request]) -> list[list[int]]:
        queued = list(reqs)
        try:
            while queued or any(not r.finished for r in reqs):
                while queued:
                    r = queued[0]
                    try:
                        pages = self.decode.reserve(r, self.prefill.link.agent.name)
                    except PoolExhausted:
                        if not self.decode.has_work:
                            raise
                        break
                    try:
                        self.prefill.submit(PrefillTask(r.request_id, r.prompt, r.params,
                                                        self.decode.link.agent.name, pages))
                    except PoolExhausted:
                        self.decode.abort(r.request_id)
                        r.state = RequestState.WAITING
                        r.finish_reason = None
                        break
                    queued.pop(0)
                for res in self.prefill.step():
                    self.decode.on_prefill_result(res)
                self.decode.step()
                failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
                if failed:
                    raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        except BaseException:
            for r in reqs:
                self.prefill.abort(r.request_id)
                self.decode.abort(r.request_id)
            raise
        return [list(r.output) for r in reqs]
