"""DeepSeek-V4 on the cuda backend on a GPU (``gpu``: skipped on CPU-only machines): the tiny V4 with the
real attention shape (``attention: serving``) through the engine with ``backend="cuda"`` (sparse attention
on FlashMLA's SM90 prefill kernel, bf16) against the reference backend (fp32) on the same GPU:

* prompts of 9, 40 and 261 tokens: prompt logits close, argmax agreement, greedy output reported;
* a 32k-token prompt prefilled in 8k-token chunks on the cuda backend: every page given back, the last
  256 positions' logits against the reference's (issue 22's "a 32k-token prompt prefilled in chunks").
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
