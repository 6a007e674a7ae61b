"""The controller: validates a whole application config before anything is placed.

``validate(app_cfg, model_cfg)`` applies the rules of DESIGN.md ("Controller
rules") and returns *every* violation, each with the path of the field to
change (``decode.tensor_parallel_size``) and a message saying what is wrong
and why. ``check_or_raise`` turns a non-empty list into one
``AppConfigError``. ``check_args`` runs the whole offline check on a raw
``args`` mapping: pydantic field validation, model-config resolution, then
the rules — what ``dsa-pd check`` and the app builder call.

``plan_placement(app_cfg)`` computes the Ray resources of every replica
(placement-group bundles for tensor-parallel replicas); it is pure
computation, no Ray import.

In monolithic mode (``AppConfig.mode``) only the decode role is deployed:
the rules, the placement and the memory plan cover it alone, the
prefill/decode agreement rules do not apply, and a ``prefill`` section is a
violation (it would configure nothing).

The estimates here (weight bytes, page bytes) follow the model code in
``models/`` (which projections are sharded by rank, which are replicated)
and the byte formats of ``attention/``, so they change when those do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic

from attention.cache import CacheSpec
from attention.formats import PAGE_SIZE, pages_for_tokens
from deployments.app_config import APP_IMPORT_PATH, AppConfig, RoleConfig
from models.config import ConfigError, ModelConfig, config_from_dict, load_config
from models.dtypes import dtype_bytes
from transfer.compat import CompatInfo, diff_compat
from workers.mtp import check_topk_reuse
from workers.scheduler import tokens_to_hold

__all__ = [
    "APP_IMPORT_PATH",
    "AppConfigError",
    "CheckResult",
    "FLASH_MLA_HEADS",
    "MemoryEstimate",
    "PlacementPlan",
    "RolePlacement",
    "Violation",
    "cache_formats",
    "check_args",
    "check_or_raise",
    "bytes_per_page",
    "estimate_memory",
    "format_bytes",
    "model_param_count",
    "plan_placement",
    "role_compat_info",
    "resolve_model_config",
    "validate",
    "violations_from_pydantic",
    "weight_bytes_per_rank",
]

Role = Literal["prefill", "decode"]

GiB = 1 << 30

FLASH_MLA_HEADS = (64, 128)
"""Query-head counts FlashMLA's sparse kernels run; fewer heads per GPU are padded up to one of them."""


# --------------------------------------------------------------------------- violations


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``path`` is the field to change (dotted, relative to the app args)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class AppConfigError(ValueError):
    """An application config that cannot be deployed; ``violations`` lists every reason."""

    def __init__(self, violations: list[Violation]):
        self.violations = tuple(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} configuration violation(s):\n{lines}")


def _loc_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def violations_from_pydantic(err: pydantic.ValidationError, prefix: str = "") -> list[Violation]:
    """Every error of a pydantic validation as a ``Violation`` (path from its location)."""
    out = []
    for e in err.errors(include_url=False):
        path = _loc_path(tuple(e["loc"]))
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        msg = e["msg"]
        if e["type"] == "value_error":
            # Our own validators' messages; pydantic prefixes them with "Value error, ".
            msg = str(e.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
        elif e["type"] == "extra_forbidden":
            msg = "unknown field (a typo?)"
        elif e["type"] == "missing":
            msg = "required field missing"
        else:
            msg = f"{msg} (got {e.get('input')!r})"
        out.append(Violation(path or "(root)", msg))
    return out


# --------------------------------------------------------------------------- cache geometry


def cache_formats(role_cfg: RoleConfig, model_cfg: ModelConfig) -> tuple[str, str]:
    """``(kv_format, index_format)`` as the transfer handshake compares them (`CacheSpec.transfer_formats`)."""
    return _cache_spec(role_cfg, model_cfg, num_pages=1).transfer_formats()


def _cache_spec(role_cfg: RoleConfig, model_cfg: ModelConfig, num_pages: int | None = None) -> CacheSpec:
    """The cache geometry a replica of ``role_cfg`` allocates: `RankSpec.cache_spec`, which loading calls too."""
    return role_cfg.rank_spec().cache_spec(model_cfg, num_pages)


def bytes_per_page(role_cfg: RoleConfig, model_cfg: ModelConfig) -> int:
    """Bytes one page id occupies across every layer's MLA and indexer caches of one rank."""
    return _cache_spec(role_cfg, model_cfg, num_pages=1).page_bytes()


def role_compat_info(app_cfg: AppConfig, role: Role, model_cfg: ModelConfig) -> CompatInfo:
    """The ``CompatInfo`` the ranks of ``role`` present in the transfer handshake.

    The controller compares the two roles' infos before placement; the
    handshake compares them again at run time against the actual peer.
    """
    role_cfg = app_cfg.for_role(role)
    kv_format, index_format = cache_formats(role_cfg, model_cfg)
    return CompatInfo(
        # models.config.config_identity, as the replicas' links compute it from the config.json
        # they load (for a config given inline or generated, from that dict).
        model=model_cfg.identity,
        num_layers=_cache_spec(role_cfg, model_cfg).num_layers,
        page_size=role_cfg.page_size,
        kv_format=kv_format,
        index_format=index_format,
        has_mtp=role_cfg.has_mtp,
    )


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class _Params:
    """Element counts by how they are stored: ``quant`` = projections an fp8 checkpoint block-quantizes."""

    replicated_plain: int = 0
    replicated_quant: int = 0
    sharded_plain: int = 0
    sharded_quant: int = 0

    def __add__(self, o: "_Params") -> "_Params":
        return _Params(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))

    def __mul__(self, k: int) -> "_Params":
        return _Params(*(a * k for a in dataclasses.astuple(self)))


def _layer_params(m: ModelConfig, dense: bool, owns_indexer: bool) -> _Params:
    h, H = m.hidden_size, m.num_attention_heads
    # MLA: the low-rank down projections are replicated, the per-head up / out
    # projections are split by head (models/mla.py).
    p = _Params(
        replicated_quant=h * m.q_lora_rank + h * (m.kv_lora_rank + m.qk_rope_head_dim),
        replicated_plain=m.q_lora_rank + m.kv_lora_rank + 2 * h,
        sharded_quant=m.q_lora_rank * H * m.qk_head_dim
        + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        + H * m.v_head_dim * h,
    )
    if owns_indexer:  # the indexer is replicated (models/indexer.py)
        p += _Params(
            replicated_quant=m.q_lora_rank * m.index_n_heads * m.index_head_dim + h * m.index_head_dim,
            replicated_plain=h * m.index_n_heads + 2 * m.index_head_dim,
        )
    if dense:
        p += _Params(sharded_quant=3 * h * m.intermediate_size)
    else:
        # Router replicated; routed experts split by rank; shared experts column/row parallel.
        p += _Params(
            replicated_plain=m.n_routed_experts * h + m.n_routed_experts,
            sharded_quant=(m.n_routed_experts + m.n_shared_experts) * 3 * h * m.moe_intermediate_size,
        )
    return p


def _model_params(m: ModelConfig, with_mtp: bool) -> _Params:
    h, vocab = m.hidden_size, m.vocab_size
    plan = m.topk_plan
    p = _Params(replicated_plain=2 * vocab * h + h)  # embed_tokens, lm_head (replicated), final norm
    for layer in range(m.num_hidden_layers):
        p += _layer_params(m, m.mlp_layer_types[layer] == "dense", plan.computes[layer])
    if with_mtp:
        # models/model.py's MTPLayer holds its own embed_tokens and head (copies
        # of the main ones in the checkpoint), eh_proj and three norms.
        mtp = _layer_params(m, dense=False, owns_indexer=True) + _Params(
            replicated_plain=2 * vocab * h + 3 * h, replicated_quant=2 * h * h
        )
        p += mtp * m.num_nextn_predict_layers
    return p


def model_param_count(model_cfg: ModelConfig, with_mtp: bool = True) -> int:
    """Parameters of the whole model as ``models.model.DsaForCausalLM`` holds them (tp = 1)."""
    return sum(dataclasses.astuple(_model_params(model_cfg, with_mtp)))


def weight_bytes_per_rank(
    model_cfg: ModelConfig, tp: int, *, dtype: str, fp8_weights: bool, with_mtp: bool
) -> int:
    """Estimated weight bytes one tensor-parallel rank holds.

    Replicated tensors count whole, sharded ones ``1/tp``. ``fp8_weights``
    (an fp8 checkpoint on the ``cuda`` backend, which keeps fp8 weights for
    DeepGEMM): block-quantized projections take 1 byte per element plus a
    float32 scale per block; otherwise (bf16 checkpoints, or the reference
    backend, which dequantizes) every element takes ``dtype``'s size.
    """
    p = _model_params(model_cfg, with_mtp)
    elem = dtype_bytes(dtype)
    if fp8_weights and model_cfg.weight_block_size is not None:
        bh, bw = model_cfg.weight_block_size
        quant = 1.0 + 4.0 / (bh * bw)
    else:
        quant = float(elem)
    rank_plain = p.replicated_plain + p.sharded_plain / tp
    rank_quant = p.replicated_quant + p.sharded_quant / tp
    return int(rank_plain * elem + rank_quant * quant)


def format_bytes(n: int) -> str:
    """``1.50 GiB`` / ``12.3 MiB``: GiB down to 1 GiB, MiB below (tiny models)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory plan of a role: weights + page pool + workspace against the GPU budget."""

    weights_bytes: int
    page_bytes: int
    bytes_per_page: int
    workspace_bytes: int
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.page_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def max_pages(self) -> int:
        """The most pages that fit next to the weights and workspace (0 if none)."""
        free = self.budget_bytes - self.weights_bytes - self.workspace_bytes
        return max(free // self.bytes_per_page, 0)

    def describe(self) -> str:
        return (
            f"weights {format_bytes(self.weights_bytes)} + pages {format_bytes(self.page_bytes)} "
            f"({self.page_bytes // self.bytes_per_page} x {self.bytes_per_page} B) + workspace "
            f"{format_bytes(self.workspace_bytes)} = {format_bytes(self.total_bytes)} of a "
            f"{format_bytes(self.budget_bytes)} budget"
        )


def _gpu_share(role_cfg: RoleConfig) -> float:
    """The share of one GPU each rank of the role owns (a fraction only for the shared-GPU demo)."""
    if role_cfg.tensor_parallel_size == 1 and 0 < role_cfg.num_gpus < 1:
        return role_cfg.num_gpus
    return 1.0


def estimate_memory(role_cfg: RoleConfig, model_cfg: ModelConfig, gpu_memory_bytes: int | None = None) -> MemoryEstimate:
    """Per-rank memory of a replica of ``role_cfg``; the budget is ``gpu_memory x utilization x GPU share``.

    ``gpu_memory_bytes`` overrides the role's ``gpu_memory_gib`` (e.g. the
    memory of the device actually found).
    """
    per_page = bytes_per_page(role_cfg, model_cfg)
    gpu = gpu_memory_bytes if gpu_memory_bytes is not None else int(role_cfg.gpu_memory_gib * GiB)
    return MemoryEstimate(
        weights_bytes=weight_bytes_per_rank(
            model_cfg,
            role_cfg.tensor_parallel_size,
            dtype=role_cfg.dtype,
            fp8_weights=role_cfg.backend == "cuda",
            with_mtp=role_cfg.has_mtp,
        ),
        page_bytes=role_cfg.num_pages * per_page,
        bytes_per_page=per_page,
        workspace_bytes=int(role_cfg.workspace_gib * GiB),
        budget_bytes=int(gpu * role_cfg.gpu_memory_utilization * _gpu_share(role_cfg)),
    )


# --------------------------------------------------------------------------- rules


def _device_rules(role: str, role_cfg: RoleConfig, out: list[Violation]) -> None:
    tp = role_cfg.tensor_parallel_size
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
    if role_cfg.cuda_graphs and not (role_cfg.backend == "cuda" and role_cfg.device == "cuda" and tp == 1):
        out.append(Violation(
            f"{role}.cuda_graphs",
            "CUDA graphs capture the cuda backend's decode step on a GPU with one rank (backend 'cuda', device "
            f"'cuda', tensor_parallel_size 1); got backend {role_cfg.backend!r}, device {role_cfg.device!r}, "
            f"tensor_parallel_size {tp}",
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
    if divisible and tp > 1 and role_cfg.backend == "cuda" and m.weight_block_size is not None:
        bh, bw = m.weight_block_size
        hpr = m.num_attention_heads // tp
        # fp8 weights stay quantized on the cuda backend: a rank's shard must
        # start and end on a scale-block boundary or its scales would be split.
        shard_dims = [
            ("q_b_proj rows", hpr * m.qk_head_dim, bh),
            ("kv_b_proj rows", hpr * (m.qk_nope_head_dim + m.v_head_dim), bh),
            ("o_proj columns", hpr * m.v_head_dim, bw),
        ]
        if "dense" in m.mlp_layer_types:
            shard_dims.append(("dense MLP columns", m.intermediate_size // tp, bh))
        if m.n_shared_experts:
            shard_dims.append(("shared expert columns", m.moe_intermediate_size * m.n_shared_experts // tp, bh))
        for name, size, block in shard_dims:
            if size % block:
                out.append(Violation(
                    f"{role}.tensor_parallel_size",
                    f"with fp8 block-quantized weights ({bh}x{bw} blocks) each rank's {name} ({size}) must be a "
                    f"multiple of {block}; tensor_parallel_size {tp} splits a scale block",
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

    if role_cfg.device == "cuda":
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
                return load_config(made), []
            return config_from_dict(src.tiny.config_dict()), []
        path = src.checkpoint_dir()
        if (path / "config.json").exists():
            cfg = load_config(path)
            if src.config is not None:
                inline = config_from_dict(src.config)
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
        return config_from_dict(src.config), []
    except ConfigError as e:
        where = "model.config" if src.config is not None and src.tiny is None else "model"
        return None, [Violation(where, str(e))]


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


# --------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class RolePlacement:
    """Ray resources of one role's replicas.

    With one rank, the rank runs inside the Serve replica: ``ray_actor_options``
    carries its CPUs and (possibly fractional) GPUs and there is no placement
    group. With ``tp`` ranks, each replica reserves a placement group of
    ``tp`` bundles ``{"CPU": num_cpus, "GPU": 1}`` packed on one node
    (``STRICT_PACK``: NCCL and the per-rank NIXL agents stay on NVLink); Serve
    puts the replica actor in bundle 0 with no resources of its own (it only
    orchestrates), and rank worker ``r`` goes into bundle ``r`` with
    ``rank_actor_options``.
    """

    role: Role
    num_replicas: int | None
    autoscaling_config: dict[str, float | int] | None
    ray_actor_options: dict[str, float]
    placement_group_bundles: tuple[dict[str, float], ...] | None
    placement_group_strategy: str | None
    rank_actor_options: dict[str, float] | None
    rank_bundle_indices: tuple[int, ...]
    max_ongoing_requests: int

    @property
    def gpus_per_replica(self) -> float:
        if self.placement_group_bundles is not None:
            return sum(b.get("GPU", 0.0) for b in self.placement_group_bundles)
        return self.ray_actor_options.get("num_gpus", 0.0)

    @property
    def replica_range(self) -> tuple[int, int]:
        """``(min, max)`` replicas."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config["min_replicas"]), int(self.autoscaling_config["max_replicas"])
        n = self.num_replicas or 1
        return n, n

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment(...).options(...)``."""
        opts: dict[str, Any] = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = self.num_replicas
        if self.placement_group_bundles is not None:
            opts["placement_group_bundles"] = [dict(b) for b in self.placement_group_bundles]
            opts["placement_group_strategy"] = self.placement_group_strategy
        return opts


@dataclass(frozen=True)
class PlacementPlan:
    """Placement of the deployed roles (``prefill`` None in monolithic mode); ``gpus`` is the
    (min, max) GPU total over the replica range."""

    prefill: RolePlacement | None
    decode: RolePlacement

    @property
    def placements(self) -> tuple[RolePlacement, ...]:
        """The placements of the deployed roles, prefill first."""
        return tuple(p for p in (self.prefill, self.decode) if p is not None)

    def for_role(self, role: str) -> RolePlacement:
        place = {"prefill": self.prefill, "decode": self.decode}[role]
        if place is None:
            raise ValueError(f"no {role} role is deployed in monolithic mode")
        return place

    @property
    def gpus(self) -> tuple[float, float]:
        lo = sum(p.gpus_per_replica * p.replica_range[0] for p in self.placements)
        hi = sum(p.gpus_per_replica * p.replica_range[1] for p in self.placements)
        return lo, hi


def _plan_pool(role: Role, role_cfg: RoleConfig) -> RolePlacement:
    tp = role_cfg.tensor_parallel_size
    gpu_per_rank = 1.0 if role_cfg.device == "cuda" else 0.0
    autoscaling = None
    if role_cfg.autoscaling is not None:
        a = role_cfg.autoscaling
        autoscaling = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests or float(role_cfg.max_batch_size),
        }
    common = dict(
        role=role,
        num_replicas=None if autoscaling else (role_cfg.num_replicas or 1),
        autoscaling_config=autoscaling,
        max_ongoing_requests=role_cfg.ongoing_requests_cap,
    )
    if tp == 1:
        return RolePlacement(
            ray_actor_options={"num_cpus": float(role_cfg.num_cpus), "num_gpus": float(role_cfg.num_gpus)},
            placement_group_bundles=None,
            placement_group_strategy=None,
            rank_actor_options=None,
            rank_bundle_indices=(),
            **common,
        )
    bundle = {"CPU": float(role_cfg.num_cpus)}
    if gpu_per_rank:
        bundle["GPU"] = gpu_per_rank
    return RolePlacement(
        ray_actor_options={"num_cpus": 0.0, "num_gpus": 0.0},
        placement_group_bundles=tuple(dict(bundle) for _ in range(tp)),
        placement_group_strategy="STRICT_PACK",
        rank_actor_options={"num_cpus": float(role_cfg.num_cpus), "num_gpus": gpu_per_rank},
        rank_bundle_indices=tuple(range(tp)),
        **common,
    )


def plan_placement(app_cfg: AppConfig) -> PlacementPlan:
    """Ray resources per replica of the deployed roles (pure computation; run ``validate`` first)."""
    prefill = None if app_cfg.monolithic else _plan_pool("prefill", app_cfg.prefill)
    return PlacementPlan(prefill=prefill, decode=_plan_pool("decode", app_cfg.decode))
