"""The MoE layer: router, this rank's routed experts (stacked), shared experts."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn as nn

from models.config import ModelConfig
from models.mlp import MLP
from models.moe import dispatch
from models.moe.experts import RoutedExperts
from models.moe.router import Router
from models.ops import grouped_gemm_ref
from models.ops import triton_importable
from models.parallel import SINGLE, TPContext


def grouped_gemm_ops(kernels: str, x: torch.Tensor, experts: RoutedExperts) -> ModuleType:
    """``grouped_gemm_cuda`` (Triton; bf16 or fp8 block-quantized weights) for the ``cuda`` kernels
    on a CUDA device with triton importable; ``grouped_gemm_ref`` otherwise."""
    if kernels == "cuda" and x.is_cuda and triton_importable():
        from models.ops import grouped_gemm_cuda

        return grouped_gemm_cuda
    return grouped_gemm_ref


class MoE(nn.Module):
    """Routed experts are split across ranks by contiguous ranges (expert
    parallel); each rank computes its experts' pairs only, and one all-reduce
    sums the ranks' contributions before the tensor-parallel shared experts
    are added (their down projection all-reduces itself)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.n_experts = cfg.n_routed_experts
        per_rank = tp.shard(cfg.n_routed_experts, "n_routed_experts")
        self.first_expert = tp.rank * per_rank
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.hidden_size, cfg.moe_intermediate_size, self.first_expert, per_rank, dtype)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, SINGLE if tp.size == 1 else tp, dtype)
            if cfg.n_shared_experts else None
        )

    def layout(self, ids: torch.Tensor, static_shapes: bool, ops: ModuleType = grouped_gemm_ref) -> dispatch.ExpertLayout:
        """The masked fixed-shape layout under ``static_shapes`` (CUDA-graph
        capture; built by one kernel for the Triton GEMMs), else the contiguous one."""
        if not static_shapes:
            make = dispatch.contiguous_layout
        elif ops is grouped_gemm_ref:
            make = dispatch.masked_layout
        else:
            make = ops.masked_layout
        return make(ids, self.first_expert, self.experts.num_local, self.n_experts)

    def forward(self, x: torch.Tensor, static_shapes: bool = False, kernels: str = "reference") -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``.

        ``static_shapes``: no shape may depend on the routing and nothing may be
        read back to the host (the step is captured in a CUDA graph): the
        masked layout. Otherwise the contiguous layout.
        ``kernels``: the attention backend's name; ``"cuda"`` on a CUDA device
        runs the Triton grouped GEMMs, anything else the torch reference.
        """
        weights, ids = self.gate(x)
        ex = self.experts
        ops = grouped_gemm_ops(kernels, x, ex)
        scales = {}
        if ex.quant_block is not None:
            scales = dict(w13_scale=ex.w13_scale_inv, w2_scale=ex.w2_scale_inv, block=ex.quant_block)
        out = ops.routed_experts(x, ex.w13, ex.w2, self.layout(ids, static_shapes, ops), weights, **scales)
        if self.tp.size > 1:
            out = self.tp.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
