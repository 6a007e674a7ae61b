"""The memory plan of a role: cache page geometry (bytes per page, the formats, the compat info a
KV link is checked against) and the weight, cache and workspace bytes per rank (`estimate_memory`).

The estimates follow the model code in ``models/`` (which projections are sharded by rank, which
are replicated) and the byte formats of ``attention/``, so they change when those do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from attention.cache import CacheSpec
from deployments.app_config import AppConfig, RoleConfig
from models.config import ModelConfig
from models.dtypes import dtype_bytes
from transfer.compat import CompatInfo


Role = Literal["prefill", "decode"]

GiB = 1 << 30


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
