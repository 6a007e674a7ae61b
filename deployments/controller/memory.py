"""The memory plan of a role: cache page geometry (bytes per page, the formats, the compat info a
KV link is checked against) and the weight, cache and workspace bytes per rank (`estimate_memory`).

The weights are counted on the model itself, built on the meta device as loading builds it
(`models.footprint`), the pages from the byte formats of ``attention/``: both change when the code
does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from attention.cache import CacheSpec
from deployments.app_config import AppConfig, RoleConfig
from models.config import ModelConfig
from models import footprint
from models.dtypes import torch_dtype
from models.v4.config import V4Config
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


def model_param_count(model_cfg: ModelConfig, with_mtp: bool = True) -> int:
    """Parameters of the whole model as ``models.model.DsaForCausalLM`` holds them (tp = 1)."""
    return footprint.param_count(model_cfg, with_mtp)


def weight_bytes_per_rank(
    model_cfg: ModelConfig, tp: int, *, dtype: str, fp8_weights: bool, with_mtp: bool, hadamard: bool = False
) -> int:
    """Bytes one tensor-parallel rank's weights take once loaded: its shard built on the meta device
    as loading builds it (`models.footprint`). ``fp8_weights`` (an fp8 checkpoint on the ``cuda``
    backend): the block-quantized projections take 1 byte per element plus a float32 scale per
    block, except MLA's ``kv_b_proj`` (dequantized: the absorbed products read it); otherwise (bf16
    checkpoints, or the reference backend, which dequantizes) every weight takes ``dtype``'s size.
    """
    return footprint.weight_bytes(model_cfg, tp, torch_dtype(dtype), fp8_weights, with_mtp, hadamard)


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


def estimate_memory(role_cfg: RoleConfig, model_cfg: ModelConfig | V4Config,
                    gpu_memory_bytes: int | None = None) -> MemoryEstimate:
    """Per-rank memory of a replica of ``role_cfg``; the budget is ``gpu_memory x utilization x GPU share``.

    ``gpu_memory_bytes`` overrides the role's ``gpu_memory_gib`` (e.g. the
    memory of the device actually found).
    """
    gpu = gpu_memory_bytes if gpu_memory_bytes is not None else int(role_cfg.gpu_memory_gib * GiB)
    budget = int(gpu * role_cfg.gpu_memory_utilization * _gpu_share(role_cfg))
    if isinstance(model_cfg, V4Config):
        return _estimate_v4(role_cfg, model_cfg, budget)
    per_page = bytes_per_page(role_cfg, model_cfg)
    spec = role_cfg.rank_spec()
    return MemoryEstimate(
        weights_bytes=weight_bytes_per_rank(
            model_cfg,
            role_cfg.tensor_parallel_size,
            dtype=role_cfg.dtype,
            fp8_weights=spec.fp8_weights,
            with_mtp=role_cfg.has_mtp,
            hadamard=spec.use_hadamard,
        ),
        page_bytes=role_cfg.num_pages * per_page,
        bytes_per_page=per_page,
        workspace_bytes=int(role_cfg.workspace_gib * GiB),
        budget_bytes=budget,
    )


def v4_bytes_per_page(role_cfg: RoleConfig, model_cfg: V4Config) -> int:
    """Bytes one page id occupies in a DeepSeek-V4 replica: every cache group holds ``num_pages`` pages
    (`workers.page_tables`), each ``units_per_page`` units of one buffer (``attention.group_cache``)."""
    from attention.group_cache import UNIT_BYTES
    from models.v4.cache_spec import v4_group_layouts

    layouts = v4_group_layouts(model_cfg, torch_dtype(role_cfg.dtype), role_cfg.kv_cache_dtype,
                               with_mtp=role_cfg.has_mtp)
    return sum(lay.units_per_page for lay in layouts) * UNIT_BYTES


def _estimate_v4(role_cfg: RoleConfig, model_cfg: V4Config, budget: int) -> MemoryEstimate:
    """A DeepSeek-V4 replica (one rank, the reference backend): its weights as built on the meta device,
    its cache groups' one buffer, the role's workspace allowance."""
    per_page = v4_bytes_per_page(role_cfg, model_cfg)
    return MemoryEstimate(
        weights_bytes=footprint.v4_weight_bytes(model_cfg, torch_dtype(role_cfg.dtype), role_cfg.has_mtp),
        page_bytes=role_cfg.num_pages * per_page,
        bytes_per_page=per_page,
        workspace_bytes=int(role_cfg.workspace_gib * GiB),
        budget_bytes=budget,
    )
