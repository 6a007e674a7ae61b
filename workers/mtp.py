"""MTP speculative decoding: draft-slot layout and the acceptance rule.

The draft layout is defined once here and used by every caller (eager and
CUDA-graph paths): multi-step draft write slots are a flat ``[steps * bs * topk]``
buffer viewed as ``[steps, bs * topk]`` — step-major, so one draft step's slots
are contiguous and a captured graph for step ``s`` reads row ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.formats import PAGE_SIZE
from workers.sampler import SamplingParams, draw, sampling_probs


def draft_slot_layout(page_tables: torch.Tensor, first_positions: torch.Tensor, steps: int,
                      topk: int = 1) -> torch.Tensor:
    """Cache slots written by ``steps`` chained draft steps.

    page_tables: int ``[bs, max_pages]``; first_positions: int64 ``[bs]``, the
    position written by step 0. Returns int64 ``[steps, bs * topk]``: row ``s``
    holds, for request ``b`` and draft branch ``t``, the slot of position
    ``first_positions[b] + s`` at index ``b * topk + t``.
    """
    if topk != 1:
        # Tree drafts (top-k > 1) write topk branches per position; they need
        # per-branch pages we do not allocate. Refused rather than half-done.
        raise ValueError(f"draft top-k must be 1, got {topk}")
    bs = first_positions.shape[0]
    pos = first_positions.long()[None, :] + torch.arange(steps, device=first_positions.device)[:, None]  # [steps, bs]
    pages = torch.gather(page_tables.long(), 1, (pos // PAGE_SIZE).T).T
    flat = (pages * PAGE_SIZE + pos % PAGE_SIZE).reshape(steps * bs * topk)
    return flat.view(steps, bs * topk)


def check_topk_reuse(reuse: bool, draft_topk: int) -> None:
    """Reusing one draft step's indexer top-k in the next is only sound when
    every step extends a single branch."""
    if reuse and draft_topk != 1:
        raise ValueError(f"MTP indexer top-k reuse requires draft top-k == 1 (got {draft_topk})")


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying ``k`` drafts: the tokens to append (accepted drafts
    then one correction/bonus token) and how many drafts were accepted."""

    tokens: list[int]
    accepted: int


def accept_drafts(drafts: list[int], target_logits: torch.Tensor, params: SamplingParams,
                  draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> Acceptance:
    """Standard speculative acceptance.

    target_logits: fp32 ``[k + 1, vocab]`` (row j scores the token after draft j-1).
    Greedy: accept while the draft equals the target argmax, then append the
    target argmax. Sampling: accept draft ``d`` with probability
    ``min(1, p(d) / q(d))``; on rejection sample from ``norm(max(p - q, 0))``;
    if all pass, sample the bonus from ``p`` — this leaves the output
    distributed exactly as the target's.
    """
    k = len(drafts)
    out: list[int] = []
    if params.greedy:
        targets = target_logits.argmax(-1).tolist()
        for j in range(k):
            if drafts[j] != targets[j]:
                return Acceptance(out + [targets[j]], j)
            out.append(drafts[j])
        return Acceptance(out + [targets[k]], k)
    assert draft_probs is not None
    for j in range(k):
        p = sampling_probs(target_logits[j], params)
        q = draft_probs[j]
        d = drafts[j]
        u = torch.rand((), generator=generator).item()
        if q[d] > 0 and u < min(1.0, (p[d] / q[d]).item()):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        return Acceptance(out + [draw(residual, generator)], j)
    p = sampling_probs(target_logits[k], params)
    return Acceptance(out + [draw(p, generator)], k)
