"""The controller's rules for a DeepSeek-V4 model (``models.v4.config.V4Config``).

What the DSA settings mean for V4, and what its engine runs today
(``workers.v4_runner``, ``workers.page_tables``):

* top-k sharing: none. Each CSA layer's indexer selects over its own
  compressed cache, HCA layers read every entry, sliding layers only the
  window; there is no ``index_topk_freq`` / pattern to share, so two-batch
  overlap has no sharing conflict. It is refused for another reason: the V4
  runner is one rank, eager (two-batch overlap needs tensor parallel >= 2).
* MTP: the checkpoint's MTP layer (``models.v4.mtp``: one sliding-window V4
  block over ``e_proj(enorm(e)) + h_proj(hnorm(h))``) drafts as DeepSeek-V3.2's
  does; ``mtp_draft_tokens`` > 0 needs ``num_nextn_predict_layers`` >= 1, and a
  decode role that drafts holds the positions its verify and draft chain write
  (``workers.scheduler.tokens_to_hold``) in every cache group. Prefill and decode
  must agree on it (``rules``: the MTP layer's keys are one more layer of the
  ``swa`` pages both roles store). ``features.mtp_topk_reuse`` (reusing a draft
  step's top-k in the next) has nothing to apply to: the MTP block selects no
  top-k.
* caches: per cache group (``models.v4.cache_spec``), each holding
  ``num_pages`` pages; ``kv_cache_dtype`` ``auto`` (unquantized, model dtype) or
  ``fp8`` (sliding-window keys and compressed entries in the 584-byte V4 token
  format, CSA indexer keys in fp8 with a float32 scale; compressor state fp32 either way).
  Prefill and decode must agree on it (``rules``, and the transfer handshake's
  per-group formats).
* backend: ``reference``, or ``cuda`` when the attention has FlashMLA's shape
  (head_dim 512, at most 128 heads): its sparse attention then runs on
  FlashMLA's SM90 prefill kernel (``attention.cuda.v4_attention``) and, with
  ``fp8`` caches, decode on its fp8 sparse decode kernel reading the V4 pages
  (``attention.cuda.v4_decode``), everything else as torch ops on the device,
  eager (``cuda_graphs`` is refused).
* prefix caching (``features.prefix_caching``, ``workers.v4_prefix``): exact
  reuse up to cuts every 256 tokens (a multiple of every compress ratio and of
  the ``swa`` page, so no compressor has a pending row there); each cut's CSA
  compressor state is kept in a page of its own, so the CSA state groups hold
  ``1 + n // 256`` pages of an ``n``-token sequence (at most one more than its
  ``swa`` pages); the pages-per-request rule below counts them. Both roles
  share the flag, so their tables have one shape (PD pairs them page by page).
  With MTP drafts too: the cut pages come out of each group's ``num_pages``, and
  only cuts below the accepted length are cached, so MTP + cache is exact.
* memory: on a GPU (``device: cuda``, the reference backend) the role's plan
  (``deployments.controller.memory.estimate_memory``: weights built on the meta
  device, ``num_pages`` pages in every cache group, the workspace allowance)
  must fit the role's share of the GPU, as for the DSA models. The prefix
  cache's cut pages are pages of the CSA state groups' pools: the plan (what a
  rank allocates) does not change, how many tokens the pages hold does.
"""

from __future__ import annotations

from deployments.app_config import AppConfig, RoleConfig
from deployments.controller.violations import Violation
from models.v4.cache_spec import cut_state_groups, v4_cache_groups
from models.v4.config import V4Config
from workers.page_tables import group_pages_for_tokens
from workers.v4_prefix import cut_tokens, pages_with_cuts
from workers.scheduler import tokens_to_hold


def v4_feature_rules(app_cfg: AppConfig, out: list[Violation]) -> None:
    f = app_cfg.features
    if f.mtp_topk_reuse:
        out.append(Violation(
            "features.mtp_topk_reuse",
            "DeepSeek-V4's MTP layer attends over its sliding window only (no indexer): its draft steps select "
            "no top-k to reuse, and each CSA layer's indexer selects over its own compressed cache: set "
            "mtp_topk_reuse to false",
        ))


def v4_agreement_rules(app_cfg: AppConfig, m: V4Config, out: list[Violation]) -> None:
    """PD: both roles' cache groups must be stored alike (pages are copied byte for byte). The generic rule
    (``rules._agreement_rules``) compares ``kv_cache_dtype`` and, under ``auto``, the model dtype; under
    ``fp8`` every group's format is compared itself (``models.v4.cache_spec``: today none follows the model
    dtype, so roles of different dtypes store alike; a group that did would be caught here)."""
    from models.dtypes import torch_dtype
    from models.v4.cache_spec import v4_group_layouts

    p, d = app_cfg.prefill, app_cfg.decode
    if p.kv_cache_dtype != d.kv_cache_dtype or p.kv_cache_dtype == "auto":
        return  # reported by the generic rule
    fp = {lay.name: lay.describe() for lay in v4_group_layouts(m, torch_dtype(p.dtype), p.kv_cache_dtype)}
    fd = {lay.name: lay.describe() for lay in v4_group_layouts(m, torch_dtype(d.dtype), d.kv_cache_dtype)}
    differ = [f"{g} {fp[g]} vs {fd[g]}" for g in fp if fp[g] != fd[g]]
    if differ:
        out.append(Violation(
            "decode.dtype",
            f"with kv_cache_dtype 'fp8' DeepSeek-V4's prefill ({p.dtype!r}) and decode ({d.dtype!r}) store "
            f"{', '.join(differ)} differently; pages are copied byte for byte, so use one dtype on both roles",
        ))


def v4_role_rules(role: str, role_cfg: RoleConfig, app_cfg: AppConfig, m: V4Config, out: list[Violation],
                  gpu_memory_bytes: int | None = None) -> None:
    if role_cfg.has_mtp and not m.has_mtp:
        out.append(Violation(
            f"{role}.mtp_draft_tokens",
            f"mtp_draft_tokens {role_cfg.mtp_draft_tokens} needs the model's MTP layer, but the checkpoint has "
            "num_nextn_predict_layers 0: set mtp_draft_tokens to 0",
        ))
    if role_cfg.backend == "cuda":
        from attention.cuda.v4_attention import check_v4_dims  # the rank build's rule, host-only (no kernels)

        try:
            check_v4_dims(m.head_dim, m.num_attention_heads)
        except ValueError as e:
            out.append(Violation(f"{role}.backend", f"{e}: use backend 'reference'"))
    if role_cfg.cuda_graphs:
        out.append(Violation(
            f"{role}.cuda_graphs",
            "CUDA graphs are not built for DeepSeek-V4 (its runner is eager): leave cuda_graphs unset or false",
        ))
    if role_cfg.prefill_graph_max_tokens:
        out.append(Violation(
            f"{role}.prefill_graph_max_tokens",
            "prefill graphs are not built for DeepSeek-V4 (its runner is eager): set it to 0 or leave it unset",
        ))
    if role_cfg.tensor_parallel_size != 1:
        out.append(Violation(
            f"{role}.tensor_parallel_size",
            f"DeepSeek-V4 runs one rank per replica so far (its runner is not sharded), got "
            f"{role_cfg.tensor_parallel_size}",
        ))
    if app_cfg.features.two_batch_overlap:
        out.append(Violation(
            "features.two_batch_overlap",
            "DeepSeek-V4 has no top-k sharing to conflict with, but its runner is one eager rank: two-batch "
            "overlap (tensor-parallel all-reduces behind compute) does not apply; set it to false",
        ))
    if role_cfg.device == "cuda":
        from deployments.controller.memory import estimate_memory

        est = estimate_memory(role_cfg, m, gpu_memory_bytes)
        if not est.fits:
            if est.weights_bytes + est.workspace_bytes > est.budget_bytes:
                out.append(Violation(f"{role}.device", f"DeepSeek-V4 does not fit a GPU: {est.describe()}; the "
                                     "weights alone exceed the budget (one rank per replica so far)"))
            else:
                out.append(Violation(f"{role}.num_pages", f"does not fit a GPU: {est.describe()}; at most "
                                     f"{est.max_pages} pages (in each cache group) fit"))
    max_len = app_cfg.model.max_model_len or m.max_position_embeddings
    tokens = max_len
    if role == "decode" and app_cfg.monolithic:  # what the scheduler holds at admission
        tokens = tokens_to_hold(max_len, role_cfg.mtp_draft_tokens)
    elif role == "decode" and role_cfg.mtp_draft_tokens:  # a verify and its draft chain write past the length
        tokens = tokens_to_hold(max_len - 1, role_cfg.mtp_draft_tokens)
    groups = v4_cache_groups(m, role_cfg.kv_cache_dtype, with_mtp=role_cfg.has_mtp)
    if app_cfg.features.prefix_caching:  # the CSA state groups hold a page per cut too
        cut, cut_groups = cut_tokens(groups), cut_state_groups(m)
        need = {g.name: pages_with_cuts(g, tokens, cut, cut_groups) for g in groups}
    else:
        need = {g.name: group_pages_for_tokens(g, tokens) for g in groups}
    short = [f"{g} {n}" for g, n in need.items() if n > role_cfg.num_pages]
    if short:
        out.append(Violation(
            f"{role}.num_pages",
            f"each DeepSeek-V4 cache group gets num_pages ({role_cfg.num_pages}) pages; one request of "
            f"max_model_len {max_len} needs more in {', '.join(short)} (workers.page_tables): raise num_pages "
            "or lower model.max_model_len",
        ))


def v4_summary(role_cfg: RoleConfig, m: V4Config, gpu_memory_bytes: int | None = None) -> str:
    """What one replica of ``role_cfg`` holds: weights and every cache group's pages (the memory plan,
    ``deployments.controller.memory.estimate_memory``), against the GPU budget on ``device: cuda``."""
    from deployments.controller.memory import estimate_memory, format_bytes
    from models.dtypes import torch_dtype
    from models.v4.cache_spec import v4_group_layouts

    layouts = v4_group_layouts(m, torch_dtype(role_cfg.dtype), role_cfg.kv_cache_dtype, with_mtp=role_cfg.has_mtp)
    groups = ", ".join(f"{lay.name} {lay.group.tokens_per_page}/page {lay.describe()}" for lay in layouts)
    est = estimate_memory(role_cfg, m, gpu_memory_bytes)
    where = (f"per GPU: {est.describe()}" if role_cfg.device == "cuda" else
             f"per replica (host memory): weights {format_bytes(est.weights_bytes)} + pages "
             f"{format_bytes(est.page_bytes)}")
    return f"{where} ({role_cfg.num_pages} pages in each of {len(layouts)} cache groups: {groups})"
