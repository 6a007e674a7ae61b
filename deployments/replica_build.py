"""Build the engine of one prefill or decode replica from the validated app config.

A replica owns its model, paged caches, page pool and NIXL link: with one
rank all in the Serve replica's process; with ``tensor_parallel_size``
ranks the replica process keeps the page pool and the engine and drives one
rank worker actor per rank (its own shard, cache and NIXL agent) in the
bundles of the placement group Serve reserved for the replica. This mirrors
what ``workers.offline.LLM`` builds for each side of ``pd=True``, from a
``PoolConfig`` instead of keyword arguments, so the served engine is the one
the offline correctness tests exercise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from attention.backend import get_backend
from attention.cache import PagedKVCache
from deployments.app_config import AppConfig, PoolConfig
from deployments.controller import PoolPlacement, plan_placement
from models.loader import load_model
from models.model import DsaForCausalLM
from workers.decode_graphs import default_graph_context, graphs_wanted
from workers.decode_worker import DecodeWorker
from workers.group_link import GroupLink
from workers.engine import Engine
from workers.kv_link import KVLink
from workers.push_tuning import PushTuning
from workers.model_runner import ModelRunner, cache_spec_for
from workers.page_pool import PagePool
from workers.prefill_worker import PrefillWorker
from workers.rank_group import GroupModel, RankGroup
from workers.rank_worker import RankSpec
from workers.scheduler import SchedulerConfig

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ReplicaParts:
    """What every replica has: its model, cache, pool and KV link."""

    model: DsaForCausalLM | GroupModel
    cache: PagedKVCache | None
    pool: PagePool
    runner: ModelRunner
    link: KVLink | GroupLink


def detokenizer(model_dir: str | Path) -> Callable[[list[int]], str] | None:
    """``ids -> text`` from the checkpoint's tokenizer (the engine matches stop strings on it); None without one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    return lambda ids: tok.decode(ids)


def rank_actor_options(place: PoolPlacement) -> list[dict[str, Any]]:
    """Ray actor options of each rank worker: the controller's per-rank
    resources, in bundle ``rank_bundle_indices[r]`` of the placement group
    Serve reserved for this replica (none outside a placement group)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    out = []
    for bundle in place.rank_bundle_indices:
        opts: dict[str, Any] = dict(place.rank_actor_options or {})
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        out.append(opts)
    return out


def build_parts(pool_cfg: PoolConfig, model_dir: str | Path, worker_id: str, place: PoolPlacement,
                push: PushTuning = PushTuning()) -> ReplicaParts:
    """Load the model and allocate the caches of one replica of ``pool_cfg``; register them with NIXL.

    One rank runs here, in the replica's process. With ``tensor_parallel_size``
    ranks, each runs in a rank worker actor placed by ``place`` (its own
    shard, cache and NIXL agent; ``workers.rank_group``) and this process
    drives them: ``cache`` is then None and ``model`` / ``runner`` / ``link``
    are the group's driver-side handles.
    """
    # The Hadamard rotation only matters once indexer keys are quantized (as in LLM).
    hadamard = pool_cfg.kv_cache_dtype == "fp8"
    if pool_cfg.tensor_parallel_size > 1:
        spec = RankSpec(str(model_dir), pool_cfg.backend, pool_cfg.device, pool_cfg.dtype, pool_cfg.kv_cache_dtype,
                        pool_cfg.num_pages, hadamard, with_mtp=pool_cfg.has_mtp, push=push,
                        page_layout=pool_cfg.page_layout)
        options = rank_actor_options(place)
        group = RankGroup(spec, pool_cfg.tensor_parallel_size, options)
        where = (f"bundles {list(place.rank_bundle_indices)} of the replica's placement group"
                 if "scheduling_strategy" in options[0] else "no placement group")
        log.info("%s: %d rank workers started (pids %s, %s)", worker_id, group.size, group.pids, where)
        return ReplicaParts(group.model, None, PagePool(pool_cfg.num_pages), group.runner, group.link(worker_id))
    # Load the MTP layer only where it is used: the controller's memory plan
    # and the handshake's has_mtp both follow mtp_draft_tokens.
    model = load_model(model_dir, _DTYPES[pool_cfg.dtype], pool_cfg.device, hadamard=hadamard,
                       with_mtp=pool_cfg.has_mtp)
    cache = PagedKVCache(cache_spec_for(model, pool_cfg.num_pages, pool_cfg.kv_cache_dtype, pool_cfg.page_layout),
                         pool_cfg.device)
    runner = ModelRunner(model, cache, get_backend(pool_cfg.backend), pool_cfg.device)
    link = KVLink.create(worker_id, model_dir, cache, has_mtp=len(model.mtp) > 0, push=push)
    return ReplicaParts(model, cache, PagePool(pool_cfg.num_pages), runner, link)


def build_prefill_worker(app_cfg: AppConfig, model_dir: str | Path, worker_id: str) -> PrefillWorker:
    pool_cfg = app_cfg.prefill
    p = build_parts(pool_cfg, model_dir, worker_id, plan_placement(app_cfg).prefill,
                    app_cfg.transfer.push_tuning().for_prefill())
    return PrefillWorker(p.runner, p.pool, p.link, pool_cfg.chunk_size, mtp=pool_cfg.has_mtp,
                         deadline_s=app_cfg.transfer.deadline_s)


def build_decode_worker(app_cfg: AppConfig, model_dir: str | Path, worker_id: str) -> DecodeWorker:
    pool_cfg = app_cfg.decode
    p = build_parts(pool_cfg, model_dir, worker_id, plan_placement(app_cfg).decode, app_cfg.transfer.push_tuning())
    sched = SchedulerConfig(max_batch_size=pool_cfg.max_batch_size, chunk_size=pool_cfg.chunk_size,
                            mtp_draft_tokens=pool_cfg.mtp_draft_tokens)
    engine = Engine(p.runner, p.pool, sched, p.model.cfg.eos_token_ids, app_cfg.features.mtp_topk_reuse,
                    detokenize=detokenizer(model_dir))
    if graphs_wanted(pool_cfg.cuda_graphs, pool_cfg.backend, pool_cfg.device, pool_cfg.tensor_parallel_size):
        engine.enable_cuda_graphs(pool_cfg.cuda_graph_max_context
                                  or default_graph_context(p.model.cfg, pool_cfg.num_pages))
    return DecodeWorker(engine, p.link, deadline_s=app_cfg.transfer.deadline_s)
