"""Build the engine of one prefill or decode replica from the validated app config.

A replica (tensor-parallel size 1: the rank runs in the Serve replica
process) owns its model, paged caches, page pool and NIXL link. This mirrors
what ``workers.offline.LLM`` builds for each side of ``pd=True``, from a
``PoolConfig`` instead of keyword arguments, so the served engine is the one
the offline correctness tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from attention.backend import get_backend
from attention.cache import PagedKVCache
from deployments.app_config import AppConfig, PoolConfig
from models.loader import load_model
from models.model import DsaForCausalLM
from workers.decode_worker import DecodeWorker
from workers.engine import Engine
from workers.kv_link import KVLink
from workers.model_runner import ModelRunner, cache_spec_for
from workers.page_pool import PagePool
from workers.prefill_worker import PrefillWorker
from workers.scheduler import SchedulerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ReplicaParts:
    """What every replica has: its model, cache, pool and KV link."""

    model: DsaForCausalLM
    cache: PagedKVCache
    pool: PagePool
    runner: ModelRunner
    link: KVLink


def detokenizer(model_dir: str | Path) -> Callable[[list[int]], str] | None:
    """``ids -> text`` from the checkpoint's tokenizer (the engine matches stop strings on it); None without one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    return lambda ids: tok.decode(ids)


def build_parts(pool_cfg: PoolConfig, model_dir: str | Path, worker_id: str) -> ReplicaParts:
    """Load the model and allocate the caches of one replica of ``pool_cfg``; register them with NIXL."""
    if pool_cfg.tensor_parallel_size != 1:
        # Rank workers in a placement group are not built yet; the controller
        # accepts such configs for planning, this replica cannot run them.
        raise NotImplementedError("serving with tensor_parallel_size > 1 needs rank workers (not built yet)")
    # The Hadamard rotation only matters once indexer keys are quantized (as in LLM).
    hadamard = pool_cfg.kv_cache_dtype == "fp8"
    # Load the MTP layer only where it is used: the controller's memory plan
    # and the handshake's has_mtp both follow mtp_draft_tokens.
    model = load_model(model_dir, _DTYPES[pool_cfg.dtype], pool_cfg.device, hadamard=hadamard,
                       with_mtp=pool_cfg.has_mtp)
    cache = PagedKVCache(cache_spec_for(model, pool_cfg.num_pages, pool_cfg.kv_cache_dtype), pool_cfg.device)
    runner = ModelRunner(model, cache, get_backend(pool_cfg.backend), pool_cfg.device)
    link = KVLink.create(worker_id, model_dir, cache, has_mtp=len(model.mtp) > 0)
    return ReplicaParts(model, cache, PagePool(pool_cfg.num_pages), runner, link)


def build_prefill_worker(app_cfg: AppConfig, model_dir: str | Path, worker_id: str) -> PrefillWorker:
    pool_cfg = app_cfg.prefill
    p = build_parts(pool_cfg, model_dir, worker_id)
    return PrefillWorker(p.runner, p.pool, p.link, pool_cfg.chunk_size, mtp=pool_cfg.has_mtp,
                         deadline_s=app_cfg.transfer.deadline_s)


def build_decode_worker(app_cfg: AppConfig, model_dir: str | Path, worker_id: str) -> DecodeWorker:
    pool_cfg = app_cfg.decode
    p = build_parts(pool_cfg, model_dir, worker_id)
    sched = SchedulerConfig(max_batch_size=pool_cfg.max_batch_size, chunk_size=pool_cfg.chunk_size,
                            mtp_draft_tokens=pool_cfg.mtp_draft_tokens)
    engine = Engine(p.runner, p.pool, sched, p.model.cfg.eos_token_ids, app_cfg.features.mtp_topk_reuse,
                    detokenize=detokenizer(model_dir))
    return DecodeWorker(engine, p.link, deadline_s=app_cfg.transfer.deadline_s)
