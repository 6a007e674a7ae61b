"""The tiny DeepSeek-V4 checkpoint and the standalone model's greedy output the V4 engine tests compare with,
and teacher-forced decode logits through an ``LLM``'s runner (`teacher_forced`)."""

from __future__ import annotations

from pathlib import Path

import torch

from deployments.cli import main as dsa_pd
from models.batch import ForwardMode
from tests.workers.prompts import random_prompt
from workers.model_runner import WorkItem
from workers.page_tables import frozen_pages


def make_tiny_v4(path: Path) -> Path:
    """``dsa-pd make-tiny --arch deepseek_v4 PATH`` (as a user makes it)."""
    assert dsa_pd(["make-tiny", "--arch", "deepseek_v4", str(path)]) == 0
    return path


def standalone_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy continuations by the standalone ``models.v4`` model: one sequence state per prompt,
    the whole prompt in one forward, then one token per forward."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            st = model.new_state()
            h = model(torch.tensor(p), [len(p)], [st])[-1:]
            out = []
            for _ in range(new):
                out.append(int(model.logits(h).argmax(-1)))
                h = model(torch.tensor(out[-1:]), [1], [st])
            outs.append(out)
    return outs


def teacher_forced(llm, prompts, steps, between=None) -> list[torch.Tensor]:
    """Through ``llm`` (a ``workers.offline.LLM``): prefill ``prompts`` in one forward, then DECODE steps of ``steps[i]`` fixed tokens per request ->
    fp32 logits ``[R * width, vocab]`` of each step. ``between(i)``: called before step ``i``."""
    total = [len(p) + sum(steps) for p in prompts]
    tables = [llm.pool.allocate_for_tokens(n) for n in total]
    try:
        pages = [frozen_pages(t) for t in tables]
        llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p), 0, pg) for p, pg in zip(prompts, pages)])
        starts = [len(p) for p in prompts]
        out = []
        for i, w in enumerate(steps):
            if between is not None:
                between(i)
            items = [WorkItem(tuple(random_prompt(w, 300, 1000 * i + r)), s, pg)
                     for r, (s, pg) in enumerate(zip(starts, pages))]
            _, hidden = llm.runner.forward(ForwardMode.DECODE, items)
            with torch.inference_mode():
                out.append(llm.model.logits(hidden).cpu())
            starts = [s + w for s in starts]
        return out
    finally:
        for t in tables:
            llm.pool.free(t)
