"""DeepSeek-V4 decode on the cuda backend with fp8 caches, on CPU: DECODE steps attend through FlashMLA's fp8
sparse decode kernel reading the V4 pages in place (``attention.cuda.v4_decode`` via
``models.v4.paged_decode``), here ``tests/attention/cuda_fakes``' ``flash_mla_with_kvcache(kv_format="V4")``
stand-in, which asserts the kernel's contract and reads each token's bytes at the kernel's own offsets.
Prefill keeps the bf16 workspace and the prefill kernel (``attention.cuda.v4_attention``).

On the tiny V4 with the real attention dims (``attention: serving``; window 8, CSA c4 with top-3, HCA c8,
so a few steps cross windows, compressed blocks and a 256-token page):

* teacher-forced decode logits (single tokens and 3-token MTP-verify-shaped steps, a batch of three
  requests) are as close to the reference backend's as the cuda backend's previous decode path
  (workspace + prefill kernel: both bf16) is, and equal that path's on the same pages within bf16
  output rounding;
* the decode kernel runs once per layer per DECODE step and never in prefill;
* greedy output equals the reference backend's (short runs) and the previous path's.
"""

from __future__ import annotations

import pytest
import torch

from deployments.app_config import SERVING_ATTENTION_DIMS_V4
from models.tiny_v4 import make_tiny_v4
from tests.workers.prompts import random_prompt
from tests.workers.v4_reference import teacher_forced
from workers.offline import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = (9, 40, 250)  # 250 + the steps' 8 tokens: past the first 256-token page
STEPS = (1, 1, 3, 1, 1, 1)  # tokens per request per DECODE step (3: an MTP verify's shape)


@pytest.fixture(scope="module")
def serving_v4(tmp_path_factory):
    return make_tiny_v4(tmp_path_factory.mktemp("v4-serving-decode"), seed=1, **SERVING_ATTENTION_DIMS_V4)


def test_v4_decode_on_the_paged_kernel_matches_the_reference(serving_v4, cuda_fake_kernels):
    calls = cuda_fake_kernels.CALLS
    ref = LLM(serving_v4, num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    cuda = LLM(serving_v4, backend="cuda", device="cpu", num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    assert cuda.model.decode_kernel is not None and ref.model.decode_kernel is None
    prompts = [random_prompt(n, 300, n) for n in PROMPTS]
    layers = cuda.model.cfg.num_hidden_layers

    def no_prefill_call(i):
        if i == 0:  # the prefill ran on the workspace and the prefill kernel only
            assert "flash_mla_with_kvcache" not in calls and calls["flash_mla_sparse_fwd"] > 0

    got = teacher_forced(cuda, prompts, STEPS, no_prefill_call)
    assert calls["flash_mla_with_kvcache[V4]"] == len(STEPS) * layers == calls["flash_mla_with_kvcache"]
    want = teacher_forced(ref, prompts, STEPS)
    cuda.model.decode_kernel, kernel = None, cuda.model.decode_kernel
    workspace = teacher_forced(cuda, prompts, STEPS)  # the previous decode path, bf16 as well
    cuda.model.decode_kernel = kernel
    agree = []
    for i, (g, w, o) in enumerate(zip(got, want, workspace)):
        # bf16 queries, outputs and prefill workspace keys, 4 layers deep (and top-3 selections of the
        # 250-token request flipped by them, as in test_v4_cuda_fakes): no closer than the previous path.
        dist, before = float((g - w).abs().mean()), float((o - w).abs().mean())
        assert dist < 4e-2 and dist <= 1.1 * before + 1e-3, f"decode step {i}: {dist} vs the workspace's {before}"
        agree.append(g.argmax(-1) == w.argmax(-1))
    assert float(torch.cat(agree).float().mean()) >= 0.85
    assert cuda.pool.free_counts() == ref.pool.free_counts()


def test_v4_paged_decode_equals_the_workspace_path_on_the_same_pages(serving_v4, cuda_fake_kernels):
    """The same cuda rank, the same pages before each step: the paged decode kernel against the previous
    decode path (keys gathered into a bf16 workspace, the prefill kernel). Both attend bf16 queries over
    the same fp8 keys, so they differ by bf16 output rounding only: far tighter than against the reference."""
    cuda = LLM(serving_v4, backend="cuda", device="cpu", num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    prompts = [random_prompt(n, 300, n + 1) for n in PROMPTS]
    kernel = cuda.model.decode_kernel
    snapshots = {}

    def snapshot(i):
        snapshots[i] = cuda.runner.cache.buffer.clone()

    paged = teacher_forced(cuda, prompts, STEPS, snapshot)
    assert cuda_fake_kernels.CALLS["flash_mla_with_kvcache[V4]"] == len(STEPS) * cuda.model.cfg.num_hidden_layers
    cuda.model.decode_kernel = None
    try:
        for i in range(len(STEPS)):  # each step from the pages the paged path started it from
            def restore(j, i=i):
                if j == i:
                    cuda.runner.cache.buffer.copy_(snapshots[i])
            steps = STEPS[:i + 1]
            workspace = teacher_forced(cuda, prompts, steps, restore)[-1]
            torch.testing.assert_close(paged[i], workspace, rtol=1e-2, atol=3e-2, msg=f"decode step {i}")
            assert float((paged[i] - workspace).abs().mean()) < 3e-3, f"decode step {i}"
    finally:
        cuda.model.decode_kernel = kernel


def test_v4_greedy_on_the_paged_decode_kernel_equals_the_reference(serving_v4, cuda_fake_kernels):
    ref = LLM(serving_v4, num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    cuda = LLM(serving_v4, backend="cuda", device="cpu", num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    prompts = [random_prompt(n, 300, n) for n in (9, 40)]
    assert cuda.generate(prompts, max_new_tokens=12, ignore_eos=True) == \
        ref.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert cuda_fake_kernels.CALLS["flash_mla_with_kvcache[V4]"] >= 11 * cuda.model.cfg.num_hidden_layers
    # Longer runs drift from the fp32 reference by bf16 near-ties (the workspace path the same way);
    # against that path the paged kernel's greedy output stays the same.
    prompts = [random_prompt(n, 300, n + 2) for n in (9, 40, 250)]
    got = cuda.generate(prompts, max_new_tokens=12, ignore_eos=True)
    cuda.model.decode_kernel, kernel = None, cuda.model.decode_kernel
    try:
        assert got == cuda.generate(prompts, max_new_tokens=12, ignore_eos=True)
    finally:
        cuda.model.decode_kernel = kernel
