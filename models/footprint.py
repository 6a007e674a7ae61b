"""Parameters and bytes of a model shard from its config alone.

The model is built on the meta device (no memory) the way `models.loader.load_model`
builds it: the same tensor-parallel shard (rank 0's; ranks hold equal shares), the
same modules held in fp8 (`models.fp8.planned_fp8_modules`, the DeepSeek naming
rule real fp8 checkpoints follow). So the controller's memory plan is what loading
allocates, and changes with the model code by itself.
"""

from __future__ import annotations

import torch

from models import fp8
from models.config import ModelConfig
from models.model import DsaForCausalLM
from models.parallel import TPContext

# A process group for the meta model of a rank of tp > 1: no collective ever runs on it.
_META_GROUP = object()


def meta_model(cfg: ModelConfig, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16, fp8_weights: bool = False,
               with_mtp: bool = True, hadamard: bool = False) -> DsaForCausalLM:
    """Rank 0's shard on the meta device, fp8 modules converted when ``fp8_weights`` and the config is fp8."""
    tp = TPContext(0, tp_size, _META_GROUP if tp_size > 1 else None)
    with torch.device("meta"):
        model = DsaForCausalLM(cfg, dtype=dtype, tp=tp, hadamard=hadamard, with_mtp=with_mtp)
    if fp8_weights and cfg.weight_block_size is not None:
        fp8.to_fp8(model, fp8.planned_fp8_modules(model, cfg.weight_block_size), cfg.weight_block_size)
    return model


def param_count(cfg: ModelConfig, with_mtp: bool = True) -> int:
    """Parameters of the whole model (tp = 1) as ``DsaForCausalLM`` holds them."""
    return sum(p.numel() for p in meta_model(cfg, with_mtp=with_mtp).parameters())


def weight_bytes(cfg: ModelConfig, tp_size: int, dtype: torch.dtype, fp8_weights: bool, with_mtp: bool,
                 hadamard: bool = False) -> int:
    """Bytes one rank's parameters and buffers take once loaded (`models.fp8.weight_bytes` of the shard)."""
    return fp8.weight_bytes(meta_model(cfg, tp_size, dtype, fp8_weights, with_mtp, hadamard))


def v4_weight_bytes(cfg, dtype: torch.dtype, with_mtp: bool) -> int:
    """Bytes a DeepSeek-V4 replica's parameters and buffers take once loaded (one rank, the reference
    backend: fp8 checkpoints dequantized to ``dtype``), from ``DeepseekV4ForCausalLM`` on the meta device.
    ``cfg``: a ``models.v4.config.V4Config``."""
    from models.v4.model import DeepseekV4ForCausalLM

    with torch.device("meta"):
        return fp8.weight_bytes(DeepseekV4ForCausalLM(cfg, dtype, with_mtp=with_mtp))
