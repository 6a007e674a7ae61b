"""Projections that read the same input, joined into one GEMM each (the cuda backend, after loading).

An MLA layer of DeepSeek-V3.2 / GLM-5 runs five small GEMMs on two inputs every step: ``q_a_proj``,
``kv_a_proj_with_mqa`` and the indexer's ``wk`` on the layer's hidden state, ``q_b_proj`` and the indexer's
``wq_b`` on the query latent. At decode sizes each is a separate launch that reads a few MB (docs/perf.md,
session 26: ~14 small projections and 23 split-K reductions a batch-1 step of the 4-layer checkpoint). vLLM
joins the first two (``fused_qkv_a_proj``). Here each input's projections become one `StackedLinear`:

* ``x_proj`` = ``[q_a_proj | indexer.wk | kv_a_proj_with_mqa]`` (without the key projection where the
  layer has no indexer, GLM-5's shared layers, or where it is stored otherwise, e.g. bf16 beside fp8:
  ``[q_a_proj | kv_a_proj_with_mqa]``), all replicated;
* ``q_proj`` = ``[q_b_proj | indexer.wq_b]``, with one rank only (``q_b_proj`` is column-sharded under
  tensor parallelism, ``wq_b`` replicated).

The weights (and an fp8 checkpoint's block scales) are concatenated along the output features, so each
output column is the same dot product as before; the originals are dropped (no memory is added). fp8 parts
must start on a scale-block boundary (every part but the last a multiple of the block's rows: DeepSeek-V3.2's
1536 / 128 / 576 and 24,576 / 8,192 are). Anything else (a bias, mixed dtypes or blocks, a misaligned part)
leaves the layer as it is. The reference backend keeps the separate projections: they are the spec the
stacked ones are tested against.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.parallel import ReplicatedLinear


class StackedLinear(ReplicatedLinear):
    """Several projections of one input as one GEMM: ``forward(x)`` returns each part's output, views of one
    ``[..., sum(parts)]`` result (``parts``: their output features, in order)."""

    def __init__(self, in_features: int, parts: tuple[int, ...], dtype=None):
        super().__init__(in_features, sum(parts), dtype=dtype)
        self.parts = parts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.parts, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={self.parts}"


def stack(linears: list[ReplicatedLinear]) -> StackedLinear | None:
    """One `StackedLinear` holding ``linears``' weights (and fp8 scales) in order, or None where they cannot
    be stacked (module doc)."""
    first = linears[0]
    if any(m.bias is not None for m in linears) or len({m.in_features for m in linears}) != 1:
        return None
    if len({m.weight.dtype for m in linears}) != 1 or len({m.quant_block for m in linears}) != 1:
        return None
    block = first.quant_block
    if block is not None and any(m.out_features % block[0] for m in linears[:-1]):
        return None
    out = StackedLinear(first.in_features, tuple(m.out_features for m in linears), dtype=first.dtype)
    out.weight = nn.Parameter(torch.cat([m.weight.data for m in linears]), requires_grad=False)
    if block is not None:
        out.weight_scale_inv = nn.Parameter(torch.cat([m.weight_scale_inv.data for m in linears]),
                                            requires_grad=False)
        out.quant_block = block
    return out


def fuse_projections(model: nn.Module, tp_size: int = 1) -> int:
    """Stack every MLA layer's same-input projections (module doc), in place; returns the layers changed.
    The replaced projections are set to None: nothing reads them afterwards."""
    from models.mla import MLAttention

    changed = 0
    for attn in model.modules():
        if not isinstance(attn, MLAttention) or attn.x_proj is not None:
            continue
        ix = attn.indexer
        # With the indexer's key projection where it stacks (the same dtype and blocks), else without it.
        x_proj = stack([attn.q_a_proj, ix.wk, attn.kv_a_proj_with_mqa]) if ix is not None else None
        with_wk = x_proj is not None
        if x_proj is None:
            x_proj = stack([attn.q_a_proj, attn.kv_a_proj_with_mqa])
        q_proj = stack([attn.q_b_proj, ix.wq_b]) if ix is not None and tp_size == 1 else None
        if x_proj is not None:
            attn.x_proj, attn.q_a_proj, attn.kv_a_proj_with_mqa = x_proj, None, None
            if with_wk:
                ix.wk = None
        if q_proj is not None:
            attn.q_proj, attn.q_b_proj, ix.wq_b = q_proj, None, None
        changed += x_proj is not None or q_proj is not None
    return changed
