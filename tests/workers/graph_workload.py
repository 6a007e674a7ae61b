"""The request mix the CUDA-graph GPU tests replay (tests/workers/test_decode_graphs_gpu.py,
test_draft_graphs_gpu.py): prompts of eight lengths (one page to past four), sent alone first and
then together, so that the batch grows and shrinks through the buckets and rows move."""

from __future__ import annotations

PROMPTS = [[40 + (i * 7 + j * 13) % 80 for j in range(n)] for i, n in enumerate((5, 70, 150, 260, 64, 1, 33, 129))]


def generate_mixed(llm, max_new_tokens: int = 24) -> list[list[int]]:
    """Two batches of one, then every prompt at once; returns the last batch's greedy outputs."""
    for p in PROMPTS[:2]:
        llm.generate([p], max_new_tokens=4, ignore_eos=True)
    return llm.generate(PROMPTS, max_new_tokens=max_new_tokens, ignore_eos=True)
