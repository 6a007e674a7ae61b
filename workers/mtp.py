"""MTP speculative decoding: the draft-slot layout (the acceptance rule is
``workers.sample.rejection``).

The draft layout is defined once here and used by every caller (eager and
CUDA-graph paths): multi-step draft write slots are a flat ``[steps * bs * topk]``
buffer viewed as ``[steps, bs * topk]`` — step-major, so one draft step's slots
are contiguous and a captured graph for step ``s`` reads row ``s``.
"""

from __future__ import annotations

import torch

from attention.formats import PAGE_SIZE


def draft_slot_layout(page_tables: torch.Tensor, first_positions: torch.Tensor, steps: int,
                      topk: int = 1, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """Cache slots written by ``steps`` chained draft steps.

    page_tables: int ``[bs, max_pages]``; first_positions: int64 ``[bs]``, the
    position written by step 0. Returns int64 ``[steps, bs * topk]``: row ``s``
    holds, for request ``b`` and draft branch ``t``, the slot of position
    ``first_positions[b] + s`` at index ``b * topk + t``. ``page_size``: positions a
    page holds (DeepSeek-V4's ``swa`` group, where its MTP layer's keys live: 256).
    """
    if topk != 1:
        # Tree drafts (top-k > 1) write topk branches per position; they need
        # per-branch pages we do not allocate. Refused rather than half-done.
        raise ValueError(f"draft top-k must be 1, got {topk}")
    bs = first_positions.shape[0]
    pos = first_positions.long()[None, :] + torch.arange(steps, device=first_positions.device)[:, None]  # [steps, bs]
    pages = torch.gather(page_tables.long(), 1, (pos // page_size).T).T
    flat = (pages * page_size + pos % page_size).reshape(steps * bs * topk)
    return flat.view(steps, bs * topk)


def check_topk_reuse(reuse: bool, draft_topk: int) -> None:
    """Reusing one draft step's indexer top-k in the next is only sound when
    every step extends a single branch."""
    if reuse and draft_topk != 1:
        raise ValueError(f"MTP indexer top-k reuse requires draft top-k == 1 (got {draft_topk})")
