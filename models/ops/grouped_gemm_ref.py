"""Routed-expert GEMMs, reference: a plain torch loop over this rank's experts.

The spec the Triton kernels (``grouped_gemm_cuda``) are tested against, and
the path every CPU run takes. Semantics of one expert ``e`` over its rows:
``down(silu(gate(x)) * up(x))`` with ``gate`` / ``up`` rows ``[0, I)`` /
``[I, 2I)`` of ``w13[e]`` and ``down = w2[e]``, each GEMM in the weights'
dtype (as ``F.linear``).

* contiguous layout: one GEMM per expert over its pairs; experts with no
  pairs are skipped (reads the counts back to the host: eager only);
* masked layout: every expert over all ``max_m`` rows of its table, padding
  included (fixed shapes, nothing read back: CUDA-graph capturable, and as
  costly as running every expert over every token).

``expert_outputs`` gives each pair's expert output (row ``p`` of ``[T * top_k,
hidden]``, zero for another rank's pair); ``combine`` sums each token's rows
weighted by its routing weights in fp32 (slot order, deterministic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from models.weights import dequantize_fp8_block

if TYPE_CHECKING:
    from models.moe.dispatch import ExpertLayout


def _weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, block, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e]
    return dequantize_fp8_block(w[e], scale[e], block, dtype)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.to(w13.dtype), w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout,
                   w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """x ``[T, H]``, w13 ``[E_local, 2I, H]``, w2 ``[E_local, H, I]`` -> ``[T * top_k, H]`` in x's dtype.

    fp8 weights come with their ``*_scale_inv`` stacks and ``block``: each
    expert is dequantized to x's dtype before its GEMMs."""
    K, P = layout.top_k, layout.num_pairs
    dtype = x.dtype
    y = torch.zeros(P + 1, x.shape[1], dtype=dtype, device=x.device)  # row P: scratch for padding rows
    if layout.masked:
        for e in range(layout.num_local):
            pair = layout.pairs[e].long()
            valid = pair >= 0
            out = _expert(x[torch.where(valid, pair, 0) // K], _weight(w13, w13_scale, e, block, dtype),
                          _weight(w2, w2_scale, e, block, dtype))
            y.index_copy_(0, torch.where(valid, pair, P), out.to(dtype))
    else:
        starts, counts = layout.row_start.tolist(), layout.counts.tolist()
        for e, (s, c) in enumerate(zip(starts, counts)):
            if c == 0:
                continue
            pair = layout.pairs[s:s + c].long()
            out = _expert(x[pair // K], _weight(w13, w13_scale, e, block, dtype), _weight(w2, w2_scale, e, block, dtype))
            y[pair] = out.to(dtype)
    return y[:P]


def combine(y: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """y ``[T * top_k, H]``, weights fp32 ``[T, top_k]`` -> ``[T, H]`` (y's dtype):
    ``sum_k weights[t, k] * y[t * top_k + k]`` over this rank's pairs, in fp32."""
    T, K = weights.shape
    yv = y.view(T, K, -1)
    w = weights.float() if layout.all_local else torch.where(layout.local_pairs(), weights.float(), 0.0)
    out = torch.zeros(T, y.shape[-1], dtype=torch.float32, device=y.device)
    for k in range(K):
        out += yv[:, k].float() * w[:, k, None]
    return out.to(y.dtype)


def routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout,
                   weights: torch.Tensor, **scales) -> torch.Tensor:
    """This rank's routed-expert contribution ``[T, H]`` (summed over ranks by the caller)."""
    return combine(expert_outputs(x, w13, w2, layout, **scales), weights, layout)
