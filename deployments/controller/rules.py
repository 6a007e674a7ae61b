"""The controller's rules (DESIGN.md, "Controller rules"): `validate` returns every violation of an
application config, `check_or_raise` raises them as one `AppConfigError`, `check_args` runs the whole
offline check on a raw ``args`` mapping (field validation, the model config, the rules)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

from attention.formats import PAGE_SIZE, pages_for_tokens
from deployments.app_config import AppConfig, RoleConfig
from models import footprint
from models.config import ConfigError, ModelConfig, config_from_dict, load_config
from transfer.compat import diff_compat
from workers.mtp import check_topk_reuse
from workers.scheduler import tokens_to_hold

from deployments.controller.violations import AppConfigError, Violation, violations_from_pydantic
from deployments.controller.memory import _cache_spec, cache_formats, estimate_memory, role_compat_info
from deployments.controller.v4_rules import v4_agreement_rules, v4_feature_rules, v4_role_rules
from models.registry import read_config_json
from models.v4.config import V4Config, v4_config_from_dict


FLASH_MLA_HEADS = (64, 128)
"""Query-head counts FlashMLA's sparse kernels run; fewer heads per GPU are padded up to one of them."""


def _device_rules(role: str, role_cfg: RoleConfig, out: list[Violation]) -> None:
    tp = role_cfg.tensor_parallel_size
    if role_cfg.engine_process and tp > 1:
        out.append(Violation(
            f"{role}.engine_process",
            f"the engine process runs one rank: tensor_parallel_size {tp} starts its rank workers as Ray actors, "
            "which a child process of the replica cannot start; set engine_process to false",
        ))
    if role_cfg.backend == "cuda" and role_cfg.device == "cpu":
        out.append(Violation(f"{role}.device", "backend 'cuda' (flash_mla, deep_gemm) needs device 'cuda', got 'cpu'"))
    if role_cfg.backend == "cuda" and role_cfg.dtype != "bfloat16":
        out.append(Violation(
            f"{role}.dtype",
            f"backend 'cuda' runs bfloat16 activations (FlashMLA and DeepGEMM take bf16 queries), got {role_cfg.dtype!r}",
        ))
    if role_cfg.device == "cuda":
        if role_cfg.num_gpus == 0:
            out.append(Violation(f"{role}.num_gpus", "device 'cuda' needs num_gpus > 0: Ray would hide every GPU"))
        elif tp > 1 and role_cfg.num_gpus != tp:
            out.append(Violation(
                f"{role}.num_gpus",
                f"num_gpus is per replica and each of the {tp} tensor-parallel ranks owns one GPU: "
                f"set num_gpus to {tp}, got {role_cfg.num_gpus:g}",
            ))
        elif tp == 1 and role_cfg.num_gpus > 1:
            out.append(Violation(
                f"{role}.num_gpus",
                f"a replica with one rank uses one GPU at most, got num_gpus {role_cfg.num_gpus:g}; "
                "raise tensor_parallel_size to use more",
            ))
        if tp > role_cfg.gpus_per_node:
            out.append(Violation(
                f"{role}.tensor_parallel_size",
                f"{tp} ranks do not fit one node of {role_cfg.gpus_per_node} GPUs (gpus_per_node): a replica's ranks "
                "are packed on one node (STRICT_PACK)",
            ))
    elif role_cfg.num_gpus > 0:
        out.append(Violation(
            f"{role}.num_gpus",
            f"device 'cpu' does not use GPUs but num_gpus is {role_cfg.num_gpus:g}: the replica would hold them idle",
        ))
    if role_cfg.cuda_graphs and not (role_cfg.backend == "cuda" and role_cfg.device == "cuda"):
        out.append(Violation(
            f"{role}.cuda_graphs",
            "CUDA graphs capture the cuda backend's decode step on a GPU (backend 'cuda', device 'cuda'); got "
            f"backend {role_cfg.backend!r}, device {role_cfg.device!r}",
        ))
    if role_cfg.cuda_graphs and tp > 1 and role_cfg.mtp_draft_tokens:
        out.append(Violation(
            f"{role}.cuda_graphs",
            f"CUDA graphs with tensor_parallel_size {tp} capture steps without MTP drafts only; "
            f"mtp_draft_tokens is {role_cfg.mtp_draft_tokens}: set cuda_graphs to null (graphs off) or "
            "mtp_draft_tokens to 0",
        ))
    if role_cfg.prefill_graph_max_tokens:
        graphs_on = role_cfg.cuda_graphs is not False and role_cfg.backend == "cuda" and role_cfg.device == "cuda"
        if not graphs_on or tp > 1:
            why = (f"tensor_parallel_size is {tp} (prefill graphs are built for one rank)" if graphs_on else
                   f"CUDA graphs are off (cuda_graphs {role_cfg.cuda_graphs}, backend {role_cfg.backend!r}, "
                   f"device {role_cfg.device!r})")
            out.append(Violation(
                f"{role}.prefill_graph_max_tokens",
                f"{role_cfg.prefill_graph_max_tokens} asks for captured prefills, but {why}: set it to 0 or leave it "
                "unset",
            ))
    if role_cfg.page_size != PAGE_SIZE:
        out.append(Violation(
            f"{role}.page_size",
            f"DeepSeek-V3.2 / GLM-5 caches use {PAGE_SIZE}-token pages (the fp8 byte formats, FlashMLA and "
            f"DeepGEMM's paged kernels), got {role_cfg.page_size}",
        ))


def _mode_rules(app_cfg: AppConfig, out: list[Violation]) -> None:
    if app_cfg.monolithic and "prefill" in app_cfg.model_fields_set:
        out.append(Violation(
            "prefill",
            "mode 'monolithic' deploys decode replicas only, which prefill their own requests with the decode "
            "section's chunk_size and max_batch_size: a prefill section would configure nothing. Remove it, "
            "or set mode to 'pd'",
        ))
    wait = app_cfg.limits.queue_timeout_s
    if not app_cfg.monolithic and wait is not None and wait >= app_cfg.transfer.deadline_s:
        # A request may start its prefill as late as queue_timeout_s after arriving, while decode's
        # receive expires transfer.deadline_s after it reserved the pages (deployments/admission.py).
        out.append(Violation(
            "limits.queue_timeout_s",
            f"{wait:g}s leaves no time of transfer.deadline_s ({app_cfg.transfer.deadline_s:g}s) for a request "
            "that starts its prefill that late: its KV transfer would expire first. Lower it (default: half "
            "the deadline) or raise transfer.deadline_s",
        ))


def _agreement_rules(app_cfg: AppConfig, model_cfg: ModelConfig | None, out: list[Violation]) -> None:
    """Prefill and decode exchange raw pages, so they must agree on what a page means.

    Violations point at the decode field: the usual fix is to make decode
    match prefill. Model identity agrees by construction (one model source).
    """
    p, d = app_cfg.prefill, app_cfg.decode
    n_before = len(out)
    if p.tensor_parallel_size != d.tensor_parallel_size:
        out.append(Violation(
            "decode.tensor_parallel_size",
            f"prefill tensor_parallel_size {p.tensor_parallel_size} vs decode {d.tensor_parallel_size}: every rank "
            "caches the whole MLA latent and prefill rank i pushes its pages to decode rank i, so both roles "
            "need the same number of ranks",
        ))
    if p.page_size != d.page_size:
        out.append(Violation(
            "decode.page_size", f"prefill pages hold {p.page_size} tokens, decode pages {d.page_size}: they must agree"
        ))
    if p.page_layout != d.page_layout:
        out.append(Violation(
            "decode.page_layout",
            f"prefill page_layout {p.page_layout!r} vs decode {d.page_layout!r}: pages are copied byte for byte, "
            "so both roles need the same layout of layers within a page",
        ))
    if p.kv_cache_dtype != d.kv_cache_dtype:
        fmt = ""
        if model_cfg is not None:
            fmt = f" (MLA/indexer formats {cache_formats(p, model_cfg)} vs {cache_formats(d, model_cfg)})"
        out.append(Violation(
            "decode.kv_cache_dtype",
            f"prefill kv_cache_dtype {p.kv_cache_dtype!r} vs decode {d.kv_cache_dtype!r}{fmt}: "
            "pages are copied byte for byte, so both roles need the same KV and indexer cache formats",
        ))
    elif p.kv_cache_dtype == "auto" and p.dtype != d.dtype:
        out.append(Violation(
            "decode.dtype",
            f"kv_cache_dtype 'auto' stores caches in the model dtype: prefill {p.dtype!r} vs decode {d.dtype!r} "
            "gives different page formats",
        ))
    if p.has_mtp != d.has_mtp:
        layers = ""
        if model_cfg is not None:
            layers = (
                f" (cache layers: prefill {_cache_spec(p, model_cfg).num_layers}, "
                f"decode {_cache_spec(d, model_cfg).num_layers})"
            )
        out.append(Violation(
            "decode.mtp_draft_tokens" if d.has_mtp else "prefill.mtp_draft_tokens",
            f"MTP is on for {'decode' if d.has_mtp else 'prefill'} only (prefill mtp_draft_tokens "
            f"{p.mtp_draft_tokens}, decode {d.mtp_draft_tokens}){layers}: the MTP layer's cache pages are filled "
            "by prefill and read by decode, so both roles must have it or neither",
        ))
    if model_cfg is not None and len(out) == n_before:
        # Whatever else the handshake hashes must agree too; a difference not
        # explained above means a compat field this controller does not know about.
        diffs = diff_compat(role_compat_info(app_cfg, "prefill", model_cfg), role_compat_info(app_cfg, "decode", model_cfg))
        for diff in diffs:
            out.append(Violation(
                "decode", f"transfer compatibility field {diff.field!r} differs: prefill {diff.local!r}, decode {diff.remote!r}"
            ))


def _feature_rules(app_cfg: AppConfig, model_cfg: ModelConfig | None, out: list[Violation]) -> None:
    f = app_cfg.features
    if f.two_batch_overlap and model_cfg is not None and model_cfg.topk_plan.has_sharing:
        plan = model_cfg.topk_plan
        shared = [i for i in range(plan.num_layers) if not plan.computes[i]]
        out.append(Violation(
            "features.two_batch_overlap",
            f"two-batch overlap is incompatible with DSA top-k sharing, and this model shares top-k in "
            f"{len(shared)} of {plan.num_layers} layers (e.g. layer {shared[0]} reuses layer "
            f"{plan.source[shared[0]]}'s; from index_topk_freq / index_topk_pattern / indexer_types): "
            "set two_batch_overlap to false",
        ))
    if f.two_batch_overlap:
        roles = {r: app_cfg.for_role(r) for r in (("decode",) if app_cfg.monolithic else ("prefill", "decode"))}
        single = [f"{r} {rc.tensor_parallel_size}" for r, rc in roles.items() if rc.tensor_parallel_size < 2]
        if single:
            out.append(Violation(
                "features.two_batch_overlap",
                "two-batch overlap hides one micro-batch's tensor-parallel all-reduces behind the other's compute, "
                f"and tensor_parallel_size is 1 ({', '.join(single)}): there is nothing to overlap; set "
                "two_batch_overlap to false or tensor_parallel_size to 2 or more",
            ))
    try:
        check_topk_reuse(f.mtp_topk_reuse, f.draft_topk)  # the engine's own rule
    except ValueError as e:
        out.append(Violation(
            "features.mtp_topk_reuse", f"{e}: each draft step must extend one chain; set draft_topk to 1"
        ))


def _model_rules(role: str, role_cfg: RoleConfig, app_cfg: AppConfig, m: ModelConfig, gpu_memory_bytes: int | None,
                 out: list[Violation]) -> None:
    tp = role_cfg.tensor_parallel_size
    if role_cfg.has_mtp and not m.has_mtp:
        out.append(Violation(
            f"{role}.mtp_draft_tokens",
            f"mtp_draft_tokens {role_cfg.mtp_draft_tokens} needs the model's MTP layer, but the checkpoint has "
            "num_nextn_predict_layers 0: set mtp_draft_tokens to 0",
        ))

    # What models/ splits by rank: heads (MLA), routed experts, dense and shared-expert MLP columns.
    sharded = [("num_attention_heads", m.num_attention_heads), ("n_routed_experts", m.n_routed_experts)]
    if "dense" in m.mlp_layer_types:
        sharded.append(("intermediate_size", m.intermediate_size))
    if m.n_shared_experts:
        sharded.append(("moe_intermediate_size x n_shared_experts", m.moe_intermediate_size * m.n_shared_experts))
    divisible = True
    for name, total in sharded:
        if total % tp:
            divisible = False
            note = ""
            if name == "num_attention_heads":
                note = f" (the {m.index_n_heads} indexer heads are replicated, so they need not divide)"
            out.append(Violation(
                f"{role}.tensor_parallel_size",
                f"tensor_parallel_size {tp} does not divide {name} ({total}): models/ splits it across ranks{note}",
            ))
    shards_ok = divisible
    if divisible and tp > 1 and role_cfg.rank_spec().fp8_weights and m.weight_block_size is not None:
        # fp8 weights stay quantized on the cuda backend: a rank's shard must start and end on a
        # scale-block boundary or its scales would be split. Asked of the model code itself (its
        # fp8 modules built on the meta device, `ReplicatedLinear.to_fp8`), not restated here.
        try:
            footprint.meta_model(m, tp, fp8_weights=True, with_mtp=role_cfg.has_mtp)
        except ValueError as e:
            shards_ok = False
            bh, bw = m.weight_block_size
            out.append(Violation(
                f"{role}.tensor_parallel_size",
                f"with fp8 block-quantized weights ({bh}x{bw} blocks) tensor_parallel_size {tp} splits a scale "
                f"block: {e}",
            ))

    if role_cfg.backend == "cuda":
        # The kernels' own admission check (FlashMLA 512 + 64 latent/rope,
        # DeepGEMM 128-dim indexer keys, fp8 caches), run before placement.
        try:
            from attention.cuda.backend import check_cache_spec

            check_cache_spec(_cache_spec(role_cfg, m, num_pages=1))
        except ValueError as e:
            out.append(Violation(f"{role}.backend", str(e)))
        except ImportError as e:
            out.append(Violation(f"{role}.backend", f"the cuda backend cannot be imported here: {e}"))

    if role_cfg.backend == "cuda" and m.num_attention_heads % tp == 0:
        hpg = m.num_attention_heads // tp
        if hpg > max(FLASH_MLA_HEADS):
            out.append(Violation(
                f"{role}.tensor_parallel_size",
                f"FlashMLA runs 64 or 128 query heads per GPU (fewer are padded); {m.num_attention_heads} heads / "
                f"tensor_parallel_size {tp} = {hpg} per GPU exceed 128: use tensor_parallel_size >= "
                f"{-(-m.num_attention_heads // max(FLASH_MLA_HEADS))}",
            ))

    max_len = app_cfg.model.max_model_len or m.max_position_embeddings
    tokens = max_len
    held_by = "written by MTP drafts"
    if role == "decode" and app_cfg.monolithic:
        # The engine admits a prompt only if its pages for the whole request
        # (prompt + max_new_tokens, with what its last step may write) fit
        # the pool: workers.scheduler.Scheduler.add refuses it otherwise.
        tokens = tokens_to_hold(max_len, role_cfg.mtp_draft_tokens)
        held_by = "the engine holds at admission (workers.scheduler.tokens_to_hold)"
    elif role == "decode" and role_cfg.mtp_draft_tokens:
        # A running request is at most max_len - 1 tokens long, but its verify
        # step and draft chain write cache positions past its length: hold
        # what the engine's scheduler reserves.
        tokens = tokens_to_hold(max_len - 1, role_cfg.mtp_draft_tokens)
    need = pages_for_tokens(tokens, role_cfg.page_size)
    if role_cfg.num_pages < need:
        extra = f" + {tokens - max_len} positions {held_by}" if tokens > max_len else ""
        out.append(Violation(
            f"{role}.num_pages",
            f"{role_cfg.num_pages} pages hold {role_cfg.num_pages * role_cfg.page_size} tokens, less than one request of "
            f"max_model_len {max_len}{extra}: need at least {need} pages (or lower model.max_model_len)",
        ))

    if role_cfg.device == "cuda" and shards_ok:  # the plan builds the shard: only a shard that exists
        est = estimate_memory(role_cfg, m, gpu_memory_bytes)
        if not est.fits:
            without_pages = est.weights_bytes + est.workspace_bytes
            if without_pages > est.budget_bytes:
                out.append(Violation(
                    f"{role}.tensor_parallel_size",
                    f"does not fit a GPU: {est.describe()}; the weights alone exceed the budget: raise "
                    "tensor_parallel_size, use an fp8 checkpoint on the cuda backend, or a larger GPU",
                ))
            else:
                out.append(Violation(
                    f"{role}.num_pages",
                    f"does not fit a GPU: {est.describe()}; at most {est.max_pages} pages fit",
                ))


def validate(app_cfg: AppConfig, model_cfg: ModelConfig | None, gpu_memory_bytes: int | None = None) -> list[Violation]:
    """Every rule violation of ``app_cfg`` (serving ``model_cfg``), in a stable order; empty when valid.

    ``model_cfg`` None (the checkpoint config could not be read) skips the
    rules that need it. ``gpu_memory_bytes`` overrides each role's
    ``gpu_memory_gib`` for the memory-budget rule. Only the deployed roles
    (`AppConfig.roles`) are checked; the agreement rules only in pd mode.
    """
    out: list[Violation] = []
    _mode_rules(app_cfg, out)
    for role in app_cfg.roles:
        _device_rules(role, app_cfg.for_role(role), out)
    if isinstance(model_cfg, V4Config):
        # V4's own rules (deployments.controller.v4_rules); the DSA ones below read a ModelConfig.
        if not app_cfg.monolithic:
            _agreement_rules(app_cfg, None, out)
            v4_agreement_rules(app_cfg, model_cfg, out)
        _feature_rules(app_cfg, None, out)
        v4_feature_rules(app_cfg, out)
        for role in app_cfg.roles:
            v4_role_rules(role, app_cfg.for_role(role), app_cfg, model_cfg, out, gpu_memory_bytes)
        return _dedupe(out)
    if not app_cfg.monolithic:
        _agreement_rules(app_cfg, model_cfg, out)
    _feature_rules(app_cfg, model_cfg, out)
    if model_cfg is not None:
        max_len = app_cfg.model.max_model_len
        if max_len is not None and max_len > model_cfg.max_position_embeddings:
            out.append(Violation(
                "model.max_model_len",
                f"{max_len} exceeds the model's max_position_embeddings ({model_cfg.max_position_embeddings})",
            ))
        for role in app_cfg.roles:
            _model_rules(role, app_cfg.for_role(role), app_cfg, model_cfg, gpu_memory_bytes, out)
    return out


def _dedupe(out: list[Violation]) -> list[Violation]:
    """``out`` without repeats (a rule checked per role may say the same of the whole app twice)."""
    seen, kept = set(), []
    for v in out:
        if (v.path, v.message) not in seen:
            seen.add((v.path, v.message))
            kept.append(v)
    return kept


def check_or_raise(app_cfg: AppConfig, model_cfg: ModelConfig | None, gpu_memory_bytes: int | None = None) -> None:
    """Raise one ``AppConfigError`` listing every violation, or return when the config is valid."""
    violations = validate(app_cfg, model_cfg, gpu_memory_bytes)
    if violations:
        raise AppConfigError(violations)

# --------------------------------------------------------------------------- whole check


def resolve_model_config(app_cfg: AppConfig) -> tuple[ModelConfig | None, list[Violation]]:
    """The ``ModelConfig`` the app will serve, without loading weights or making a tiny model.

    Order: ``model.path/config.json`` when it exists (and ``model.config``,
    if also given, must describe the same model); else the inline
    ``model.config``; a tiny spec gives its known config (or the made
    checkpoint's, when it is already in the cache).
    """
    src = app_cfg.model
    try:
        if src.tiny is not None:
            made = src.checkpoint_dir(make=False)
            if (made / "config.json").exists():
                return _load_config(made), []
            return _config_from_dict(src.tiny.config_dict()), []
        path = src.checkpoint_dir()
        if (path / "config.json").exists():
            cfg = _load_config(path)
            if src.config is not None:
                inline = _config_from_dict(src.config)
                differ = [f.name for f in dataclasses.fields(cfg) if f.compare and getattr(cfg, f.name) != getattr(inline, f.name)]
                if differ:
                    return cfg, [Violation(
                        "model.config",
                        f"the inline config differs from {path / 'config.json'} in {', '.join(differ)}: "
                        "the checkpoint's is served; update or remove the inline copy",
                    )]
            return cfg, []
        if src.config is None:
            return None, [Violation(
                "model.path",
                f"no config.json at {str(path)!r}; to validate without the checkpoint, give model.config "
                "(a copy of its config.json)",
            )]
        return _config_from_dict(src.config), []
    except ConfigError as e:
        where = "model.config" if src.config is not None and src.tiny is None else "model"
        return None, [Violation(where, str(e))]


def _config_from_dict(raw: dict) -> ModelConfig | V4Config:
    """A DSA ``ModelConfig``, or a ``V4Config`` for ``model_type: deepseek_v4`` (`models.registry`)."""
    if raw.get("model_type") == "deepseek_v4":
        return v4_config_from_dict(raw)
    return config_from_dict(raw)


def _load_config(path) -> ModelConfig | V4Config:
    raw = read_config_json(path)
    return v4_config_from_dict(raw) if raw.get("model_type") == "deepseek_v4" else load_config(path)


@dataclass(frozen=True)
class CheckResult:
    """Outcome of ``check_args``: the parsed config and model config (None where they failed) and every violation."""

    app_cfg: AppConfig | None
    model_cfg: ModelConfig | None
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations


def check_args(args: Mapping[str, Any] | AppConfig, gpu_memory_bytes: int | None = None) -> CheckResult:
    """Validate raw app ``args`` end to end: fields, model config, then every controller rule."""
    if isinstance(args, AppConfig):
        app_cfg = args
    else:
        try:
            app_cfg = AppConfig.model_validate(dict(args))
        except pydantic.ValidationError as e:
            return CheckResult(None, None, tuple(violations_from_pydantic(e)))
    model_cfg, violations = resolve_model_config(app_cfg)
    violations += validate(app_cfg, model_cfg, gpu_memory_bytes)
    return CheckResult(app_cfg, model_cfg, tuple(violations))
