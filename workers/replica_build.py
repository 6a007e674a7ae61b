"""One replica from a `RankSpec`: its ranks, its page pool, its KV link and
(for a replica that decodes) its `Engine`.

With one rank everything runs in the calling process (`build_rank`); with
``tp_size`` ranks each runs in a rank worker actor (``workers.rank_group``)
and the caller drives them through the group's model, runner and link. The
offline ``LLM`` (each side of ``pd=True``) and the Serve replicas
(``deployments/replica_build.py``) build through here, so the served engine
is the one the offline correctness tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from attention.cache import PagedKVCache
from attention.group_cache import GroupedPagedCache
from models.model import DsaForCausalLM
from models.v4.cache_spec import cut_state_groups
from models.tokenizer import load_detokenizer
from workers.decode_graphs import default_graph_context
from workers.kernel_warmup import warm_up_prefill
from workers.engine import Engine
from workers.group_link import GroupLink
from workers.kv_link import KVLink
from workers.model_runner import ModelRunner
from workers.page_pool import PagePool
from workers.page_tables import GroupPagePools
from workers.prefix_cache import PrefixCache, key_lookahead, replica_salt
from workers.v4_prefix import V4PrefixCache
from workers.rank_build import RankSpec, build_rank, uses_cache_groups
from workers.rank_group import GroupModel, RankGroup
from workers.scheduler import SchedulerConfig
from workers.structured import GrammarCompiler


@dataclass
class ReplicaParts:
    """What every replica has.

    model / runner: the in-process rank's, or the rank group's driver-side handles;
    cache: the in-process rank's pages (None with a rank group: each rank holds its own);
    pool: the one page pool whose ids index every rank's cache;
    link: the NIXL link (None when the replica was built without one);
    group: the rank group (tp_size > 1), to shut down with the replica.
    """

    model: DsaForCausalLM | GroupModel
    cache: PagedKVCache | None
    pool: PagePool
    runner: ModelRunner
    link: KVLink | GroupLink | None
    group: RankGroup | None = None


def build_replica(spec: RankSpec, tp_size: int = 1, worker_id: str | None = None,
                  actor_options: Sequence[dict[str, Any]] | None = None, prefix_caching: bool = False,
                  mtp: bool = False, chunk_size: int | None = None) -> ReplicaParts:
    """Load ``spec`` on ``tp_size`` ranks and make the replica's page pool.

    worker_id: open a NIXL link under that name (prefill and decode replicas; None: no link).
    actor_options: the rank workers' Ray actor options, one dict per rank (tp_size > 1).
    prefix_caching: give the pool a prefix cache (`workers.prefix_cache`; DeepSeek-V4's cache groups:
    `workers.v4_prefix`) keyed with `replica_salt`;
    mtp: the replica writes the MTP layer's pages (MTP drafts on; part of the salt).
    chunk_size: the replica's prefill chunk; on the ``cuda`` backend its prefill kernels are compiled
    now, up to that many tokens (`workers.kernel_warmup`).
    """
    parts = _build_parts(spec, tp_size, worker_id, actor_options, prefix_caching, mtp)
    # DeepSeek-V4's cuda path compiles nothing on first use (FlashMLA is built ahead of time; the rest is torch).
    if chunk_size and spec.backend == "cuda" and not uses_cache_groups(spec.model_dir):
        warm_up_prefill(parts.runner, parts.pool, chunk_size, parts.model.cfg.max_position_embeddings)
    return parts


def _build_parts(spec: RankSpec, tp_size: int, worker_id: str | None, actor_options, prefix_caching: bool,
                 mtp: bool) -> ReplicaParts:
    if tp_size > 1:
        cache = PrefixCache(replica_salt(spec, mtp), lookahead=key_lookahead(mtp and spec.with_mtp)) if prefix_caching else None
        group = RankGroup(spec, tp_size, actor_options)
        link = group.link(worker_id) if worker_id is not None else None
        return ReplicaParts(group.model, None, PagePool(spec.num_pages, cache), group.runner, link, group)
    rank = build_rank(spec)
    if isinstance(rank.cache, GroupedPagedCache):
        # One pool per cache group; their prefix cache reuses cuts of 256 tokens with each cut's state.
        prefix = (V4PrefixCache(replica_salt(spec, mtp), rank.cache.groups, cut_state_groups(rank.model.cfg))
                  if prefix_caching else None)
        pool = GroupPagePools(rank.cache, prefix)
    else:
        pool = PagePool(spec.num_pages, PrefixCache(replica_salt(spec, mtp), lookahead=key_lookahead(mtp and spec.with_mtp))
                        if prefix_caching else None)
    link = rank.open_link(worker_id) if worker_id is not None else None
    return ReplicaParts(rank.model, rank.cache, pool, rank.runner, link)


def build_engine(parts: ReplicaParts, model_dir: str | Path, sched: SchedulerConfig, mtp_topk_reuse: bool,
                 cuda_graphs: bool, cuda_graph_max_context: int | None = None, prefill_graph_tokens: int = 0) -> Engine:
    """The continuous-batching engine over ``parts`` (stop strings through the checkpoint's tokenizer).

    cuda_graphs: capture decode steps (as resolved by ``workers.decode_graphs.graphs_wanted``), for
    contexts up to ``cuda_graph_max_context`` tokens (default: what the page pool holds for one
    request, capped by the model's positions); and prefills of one new prompt of up to
    ``prefill_graph_tokens`` tokens (`workers.prefill_graphs.prefill_graph_tokens`; 0: none).
    """
    cfg = parts.model.cfg
    engine = Engine(parts.runner, parts.pool, sched, cfg.eos_token_ids, mtp_topk_reuse,
                    detokenize=load_detokenizer(model_dir),
                    grammars=GrammarCompiler.for_checkpoint(model_dir, cfg.vocab_size, cfg.eos_token_ids))
    if cuda_graphs:
        engine.enable_cuda_graphs(cuda_graph_max_context or default_graph_context(parts.model.cfg, parts.pool.num_pages),
                                  prefill_tokens=prefill_graph_tokens)
    return engine
