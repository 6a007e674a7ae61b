"""DeepSeek-V4 on the cuda backend on a GPU (``gpu``: skipped on CPU-only machines): the tiny V4 with the
real attention shape (``attention: serving``) through the engine with ``backend="cuda"`` (sparse attention
on FlashMLA's SM90 prefill kernel, bf16) against the reference backend (fp32) on the same GPU:

* prompts of 9, 40 and 261 tokens: prompt logits close, argmax agreement, greedy output reported;
* a 32k-token prompt prefilled in 8k-token chunks on the cuda backend: every page given back, the last
  256 positions' logits against the reference's (issue 22's "a 32k-token prompt prefilled in chunks");
* with fp8 caches, DECODE steps on FlashMLA's fp8 sparse decode reading the V4 pages in place
  (``attention.cuda.v4_decode``) against the reference and against the workspace path on the same pages.
"""

from __future__ import annotations

import pytest
import torch

from deployments.app_config import SERVING_ATTENTION_DIMS_V4
from models.tiny_v4 import make_tiny_v4
from tests.workers.prompts import random_prompt
from workers.offline import LLM

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def serving_v4(tmp_path_factory):
    return make_tiny_v4(tmp_path_factory.mktemp("v4-serving-gpu"), seed=1, max_position_embeddings=40000,
                        **SERVING_ATTENTION_DIMS_V4)


def _agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.argmax(-1) == want.argmax(-1)).float().mean())


def test_v4_cuda_backend_matches_the_reference_gpu(serving_v4):
    ref = LLM(serving_v4, device="cuda", num_pages=8, chunk_size=64)
    cuda = LLM(serving_v4, backend="cuda", device="cuda", dtype="bfloat16", num_pages=8, chunk_size=64)
    for n in (9, 40, 261):
        p = random_prompt(n, 300, n)
        got, want = cuda.prompt_logits(p).float(), ref.prompt_logits(p).float()
        diff = (got - want).abs()
        print(f"V4 cuda vs reference, {n} tokens: max |dlogit| {float(diff.max()):.3f}, mean {float(diff.mean()):.4f}, "
              f"argmax agreement {_agreement(got, want):.3f}")
        assert float(diff.mean()) < 0.1 and _agreement(got, want) >= 0.9, n
    st = cuda.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"]


def test_v4_cuda_backend_32k_prompt_in_chunks_gpu(serving_v4):
    n = 32768
    p = random_prompt(n, 300, 7)
    pages = n // 256 + 8
    cuda = LLM(serving_v4, backend="cuda", device="cuda", dtype="bfloat16", num_pages=pages, chunk_size=8192)
    got = cuda.prompt_logits(p)[-256:].float()
    assert torch.isfinite(got).all()
    st = cuda.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"]
    ref = LLM(serving_v4, device="cuda", num_pages=pages, chunk_size=8192)
    want = ref.prompt_logits(p)[-256:].float()
    print(f"V4 32k, last 256 rows: mean |dlogit| {float((got - want).abs().mean()):.4f}, "
          f"argmax agreement {_agreement(got, want):.3f}")
    assert _agreement(got, want) >= 0.8


def test_v4_decode_on_the_paged_fp8_kernel_gpu(serving_v4):
    """DECODE steps with fp8 caches on FlashMLA's fp8 sparse decode (``kv_format="V4"``, the V4 pages read in
    place: ``attention.cuda.v4_decode``) against the reference backend on the same GPU, and against the cuda
    backend's workspace path (bf16 keys gathered, the prefill kernel) on the same pages: teacher-forced
    single-token and 3-token (MTP-verify-shaped) steps of three requests, one crossing a 256-token page."""
    from tests.workers.v4_reference import teacher_forced

    prompts = [random_prompt(n, 300, n) for n in (9, 40, 250)]
    steps = (1, 1, 3, 1, 1, 1)
    ref = LLM(serving_v4, device="cuda", num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    cuda = LLM(serving_v4, backend="cuda", device="cuda", dtype="bfloat16", num_pages=8, chunk_size=64,
               kv_cache_dtype="fp8")
    assert cuda.model.decode_kernel is not None
    snapshots = {}
    got = teacher_forced(cuda, prompts, steps, lambda i: snapshots.setdefault(i, cuda.runner.cache.buffer.clone()))
    want = teacher_forced(ref, prompts, steps)
    kernel, cuda.model.decode_kernel = cuda.model.decode_kernel, None
    try:
        same_pages = []
        for i in range(len(steps)):  # the workspace path from the pages each paged step started from
            def restore(j, i=i):
                if j == i:
                    cuda.runner.cache.buffer.copy_(snapshots[i])
            same_pages.append(teacher_forced(cuda, prompts, steps[:i + 1], restore)[-1])
    finally:
        cuda.model.decode_kernel = kernel
    for i, (g, w, o) in enumerate(zip(got, want, same_pages)):
        g, w, o = g.float(), w.float(), o.float()
        print(f"V4 paged decode step {i}: vs reference mean |dlogit| {float((g - w).abs().mean()):.4f}, argmax "
              f"{_agreement(g, w):.3f}; vs the workspace path on the same pages max {float((g - o).abs().max()):.4f}"
              f" mean {float((g - o).abs().mean()):.5f}")
        assert torch.isfinite(g).all()
        assert float((g - w).abs().mean()) < 0.1 and _agreement(g, w) >= 0.8, i
        assert float((g - o).abs().mean()) < 1e-2 and _agreement(g, o) >= 0.9, i
    st = cuda.stats()
    assert st["pool_free_pages"] == st["pool_total_pages"]
