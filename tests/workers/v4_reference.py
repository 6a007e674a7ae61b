"""The tiny DeepSeek-V4 checkpoint and the standalone model's greedy output the V4 engine tests compare with."""

from __future__ import annotations

from pathlib import Path

import torch

from deployments.cli import main as dsa_pd


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
