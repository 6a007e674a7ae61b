"""Build the worker of one prefill or decode replica from the validated app config.

The config's role section becomes a `RankSpec` (`RoleConfig.rank_spec`) and
``workers.replica_build`` does the rest, as it does for the offline ``LLM``:
with one rank everything runs in the Serve replica's process; with
``tensor_parallel_size`` ranks the replica process keeps the page pool and
the engine and drives one rank worker actor per rank, in the bundles of the
placement group Serve reserved for the replica. In monolithic mode the
decode replica is built without a NIXL link (``worker_id=None`` to
``build_replica``): its `DecodeWorker` prefills locally.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from attention.formats import PAGE_SIZE
from deployments.admission import queue_timeout_s
from deployments.app_config import AppConfig
from deployments.controller import RolePlacement, plan_placement
from deployments.decode_thread import DecodeThread
from deployments.prefill_thread import PrefillThread
from deployments.worker_thread import WorkerThread
from workers.decode_graphs import default_graph_context, graphs_wanted
from workers.decode_worker import DecodeWorker
from workers.prefill_graphs import prefill_graph_tokens
from workers.prefill_worker import PrefillWorker
from workers.push_tuning import PushTuning
from workers.rank_build import uses_cache_groups
from workers.replica_build import ReplicaParts, build_engine, build_replica
from workers.scheduler import SchedulerConfig
from workers.structured import GrammarCompiler

log = logging.getLogger("ray.serve")  # Serve's logger: replica log files and the driver console


def rank_actor_options(place: RolePlacement) -> list[dict[str, Any]]:
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


def _build(app_cfg: AppConfig, role: str, model_dir: str | Path, worker_id: str, push: PushTuning,
           link: bool = True) -> ReplicaParts:
    """``link``: open the replica's NIXL link under ``worker_id`` (False: none, monolithic mode)."""
    role_cfg = app_cfg.for_role(role)
    place = plan_placement(app_cfg).for_role(role)
    options = rank_actor_options(place) if role_cfg.tensor_parallel_size > 1 else None
    t = time.perf_counter()
    parts = build_replica(role_cfg.rank_spec(model_dir, push, app_cfg.features.two_batch_overlap),
                          role_cfg.tensor_parallel_size,
                          worker_id if link else None, options, prefix_caching=app_cfg.features.prefix_caching,
                          mtp=role_cfg.has_mtp, chunk_size=role_cfg.chunk_size)
    # (The warm-up runs on the cuda backend only, V4 aside: `workers.replica_build.build_replica`.)
    log.info("%s: replica built (weights loaded, prefill kernels warmed up where compiled) in %.1f s", worker_id,
             time.perf_counter() - t)
    if app_cfg.features.two_batch_overlap:
        log.info("%s: two-batch overlap on (each multi-request forward as two micro-batches, models/two_batch.py)",
                 worker_id)
    if parts.group is not None:
        where = (f"bundles {list(place.rank_bundle_indices)} of the replica's placement group"
                 if "scheduling_strategy" in options[0] else "no placement group")
        log.info("%s: %d rank workers started (pids %s, %s)", worker_id, parts.group.size, parts.group.pids, where)
    return parts


def build_prefill_worker(app_cfg: AppConfig, model_dir: str | Path, worker_id: str) -> PrefillWorker:
    role_cfg = app_cfg.prefill
    p = _build(app_cfg, "prefill", model_dir, worker_id, app_cfg.transfer.push_tuning().for_prefill())
    grammars = GrammarCompiler.for_checkpoint(model_dir, p.model.cfg.vocab_size, p.model.cfg.eos_token_ids)
    graphs = graphs_wanted(role_cfg.cuda_graphs, role_cfg.backend, role_cfg.device, role_cfg.tensor_parallel_size,
                           cache_groups=uses_cache_groups(str(model_dir)))
    tokens = _prefill_graph_tokens(role_cfg, graphs, p, model_dir)
    if tokens:
        t = time.perf_counter()
        p.runner.enable_prefill_graphs(tokens, capture=True, max_context=_graph_context(app_cfg, role_cfg, p))
        plan = p.runner.prefill_graphs.plan
        log.info("%s: prefills from CUDA graphs: one new prompt of %s tokens, rows of %s tokens over cached "
                 "prefixes (contexts up to %d; captured in %.1f s)", worker_id, plan.buckets, plan.row_buckets,
                 plan.max_context, time.perf_counter() - t)
    return PrefillWorker(p.runner, p.pool, p.link, role_cfg.chunk_size, mtp=role_cfg.has_mtp,
                         deadline_s=app_cfg.transfer.deadline_s, grammars=grammars)


def build_decode_worker(app_cfg: AppConfig, model_dir: str | Path, worker_id: str) -> DecodeWorker:
    """The decode replica's worker; in monolithic mode without a link (the transfer settings are unused)."""
    role_cfg = app_cfg.decode
    linked = not app_cfg.monolithic
    push = app_cfg.transfer.push_tuning() if linked else PushTuning()
    p = _build(app_cfg, "decode", model_dir, worker_id, push, link=linked)
    sched = SchedulerConfig(max_batch_size=role_cfg.max_batch_size, chunk_size=role_cfg.chunk_size,
                            mtp_draft_tokens=role_cfg.mtp_draft_tokens, overlap=role_cfg.overlap_scheduling)
    graphs = graphs_wanted(role_cfg.cuda_graphs, role_cfg.backend, role_cfg.device, role_cfg.tensor_parallel_size,
                           mtp=role_cfg.mtp_draft_tokens > 0, cache_groups=uses_cache_groups(str(model_dir)))
    engine = build_engine(p, model_dir, sched, app_cfg.features.mtp_topk_reuse, graphs,
                          _graph_context(app_cfg, role_cfg, p), _prefill_graph_tokens(role_cfg, graphs, p, model_dir))
    return DecodeWorker(engine, p.link, deadline_s=app_cfg.transfer.deadline_s)


def _graph_context(app_cfg: AppConfig, role_cfg, parts: ReplicaParts) -> int:
    """The longest context the role's graphs serve (decode steps, prefill rows): ``cuda_graph_max_context``,
    else what the pool holds for one request capped by the model's positions and by ``model.max_model_len``
    (no served request is longer: the ingress refuses it), which sizes the graphs' indexer logits."""
    if role_cfg.cuda_graph_max_context:
        return role_cfg.cuda_graph_max_context
    context = default_graph_context(parts.model.cfg, parts.pool.num_pages)
    limit = app_cfg.model.max_model_len
    return max(PAGE_SIZE, min(context, limit)) if limit else context


def _prefill_graph_tokens(role_cfg, graphs: bool, parts: ReplicaParts, model_dir) -> int:
    """The role's `workers.prefill_graphs.prefill_graph_tokens` (0: prefills all eager)."""
    return prefill_graph_tokens(role_cfg.prefill_graph_max_tokens, graphs, parts.model.cfg, role_cfg.chunk_size,
                                role_cfg.tensor_parallel_size, uses_cache_groups(str(model_dir)))


def build_worker_thread(app_cfg: AppConfig, role: str, model_dir: str | Path, worker_id: str) -> WorkerThread:
    """The role's worker and the thread that runs it (not started): what a replica runs in its own process,
    or its engine process runs for it (`deployments.engine_process`)."""
    if role == "decode":
        return DecodeThread(build_decode_worker(app_cfg, model_dir, worker_id), worker_id, queue_timeout_s(app_cfg))
    if role == "prefill":
        return PrefillThread(build_prefill_worker(app_cfg, model_dir, worker_id),
                             warm_up=app_cfg.transfer.warmup_at_start, queue_timeout_s=queue_timeout_s(app_cfg))
    raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
