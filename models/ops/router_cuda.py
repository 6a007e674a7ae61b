"""noaux_tc routing after the router's GEMM as one Triton kernel per call on CUDA tensors.

`models.moe.router.Router` in torch runs ~19 kernels after its fp32 GEMM (sigmoid, the bias, two
top-k's over the groups, a scatter, the mask, the expert top-k, a gather and the normalization); a
MoE layer pays them in every decode step, a 58-MoE-layer DeepSeek-V3.2 over a thousand a step
(docs/perf.md, session 26: 408 kernels a batch-1 step of the 4-layer checkpoint). One program per token
computes the same selection from the router logits:

* ``scores = sigmoid(logits)``, ``biased = scores + bias`` (fp32);
* a group's score is the sum of its two best biased scores; the ``topk_group`` best groups compete;
* the ``top_k`` best biased scores among their experts win, highest first;
* the weights are the winners' unbiased scores, divided by their sum (+ 1e-20) when ``norm``, times
  ``scaling``.

Exact ties are broken towards the lower index (torch's top-k leaves their order unspecified). The torch
module stays the spec (CPU tensors, and the tests against it); only the sigmoid's and the weight sum's
roundings may differ from torch's by a unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, logits_stride, bias_ptr, w_ptr, ids_ptr, scaling,
                  E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                  BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    EG: tl.constexpr = E // G
    offs = tl.arange(0, E)
    logits = tl.load(logits_ptr + row * logits_stride + offs)
    scores = tl.sigmoid(logits)
    biased = scores + tl.load(bias_ptr + offs)

    # Group scores: the sum of each group's two best biased scores (one of a tied best is masked).
    grouped = tl.reshape(biased, (G, EG))
    best = tl.max(grouped, axis=1)
    if EG > 1:
        first = tl.argmax(grouped, axis=1, tie_break_left=True)
        cols = tl.arange(0, EG)
        second = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), grouped), axis=1)
        group_scores = best + second
    else:
        group_scores = best
    groups = tl.arange(0, G)
    keep = tl.zeros((G,), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(group_scores, axis=0, tie_break_left=True)
        keep = tl.where(groups == g, 1, keep)
        group_scores = tl.where(groups == g, float("-inf"), group_scores)
    kept = tl.reshape(tl.broadcast_to(keep[:, None], (G, EG)), (E,))
    candidates = tl.where(kept != 0, biased, float("-inf"))

    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(K):
        e = tl.argmax(candidates, axis=0, tie_break_left=True)
        w = tl.sum(tl.where(offs == e, scores, 0.0), axis=0)
        weights = tl.where(slots == k, w, weights)
        ids = tl.where(slots == k, e.to(tl.int64), ids)
        candidates = tl.where(offs == e, float("-inf"), candidates)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    tl.store(w_ptr + row * K + slots, weights, mask=slots < K)
    tl.store(ids_ptr + row * K + slots, ids, mask=slots < K)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(n_experts: int, n_group: int, topk_group: int, top_k: int) -> bool:
    """Whether `route` takes this routing: power-of-two expert and group counts (Triton's block shapes;
    DeepSeek-V3.2 and GLM-5: 256 experts in 8 groups), enough experts in the kept groups for the top-k."""
    return (_pow2(n_experts) and _pow2(n_group) and n_experts % n_group == 0 and 1 <= topk_group <= n_group
            and 1 <= top_k <= topk_group * (n_experts // n_group))


def route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int, norm: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` fp32 ``[T, E]`` (the router GEMM's output), ``bias`` fp32 ``[E]`` -> (weights fp32
    ``[T, top_k]``, expert ids int64 ``[T, top_k]``), highest biased score first (`supports`)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("route takes fp32 logits with contiguous rows and an fp32 bias")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, logits.stride(0), bias.contiguous(), weights, ids, float(scaling),
                            E=E, G=n_group, TOPK_GROUP=topk_group, K=top_k,
                            BLOCK_K=triton.next_power_of_2(top_k), NORM=bool(norm), num_warps=4 if E >= 256 else 1)
    return weights, ids
