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
* greedy output equals the reference backend's (short runs) and the previous path's;
* with MTP, the chained draft steps run on the kernel too (their draft logits equal the workspace path's
  from the same pages) and greedy output with MTP equals greedy output without.
"""

from __future__ import annotations

import pytest
import torch

from deployments.app_config import SERVING_ATTENTION_DIMS_V4
from models.batch import ForwardMode
from models.tiny_v4 import make_tiny_v4
from models.v4.batch import V4Batch
from tests.workers.prompts import random_prompt
from tests.workers.v4_reference import teacher_forced
from workers.model_runner import WorkItem
from workers.offline import LLM
from workers.page_tables import frozen_pages

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


def test_v4_mtp_chained_drafts_on_the_paged_decode_kernel(serving_v4, cuda_fake_kernels):
    """With MTP (2 drafts: one chained step each) the chained draft steps attend through the paged kernel too
    (MTP layer ``num_hidden_layers``: its window only); greedy output with MTP equals greedy output without."""
    prompts = [random_prompt(n, 300, n) for n in (9, 40, 250)]
    plain = LLM(serving_v4, backend="cuda", device="cpu", num_pages=8, chunk_size=64, kv_cache_dtype="fp8")
    want = plain.generate(prompts, max_new_tokens=10, ignore_eos=True)
    mtp = LLM(serving_v4, backend="cuda", device="cpu", num_pages=8, chunk_size=64, kv_cache_dtype="fp8",
              mtp_draft_tokens=2)
    attend, new_meta = mtp.model.decode_kernel
    layers = []

    def spy(q, cache, layer, *args, **kw):
        layers.append(layer)
        return attend(q, cache, layer, *args, **kw)

    mtp.model.set_decode_kernel(spy, new_meta)
    assert mtp.generate(prompts, max_new_tokens=10, ignore_eos=True) == want
    n = mtp.model.cfg.num_hidden_layers
    assert n in layers and set(layers) == set(range(n + 1))  # the MTP layer's chained steps, the main layers
    assert mtp.stats()["mtp_drafted"] > 0
    # Greedy output does not depend on the drafts: check the chained step's draft logits themselves, paged
    # kernel against the workspace path from the same pages.
    mtp.model.set_decode_kernel(attend, new_meta)
    assert torch.allclose(*_chained_draft_logits(mtp, prompts), rtol=1e-2, atol=3e-2)


def _chained_draft_logits(llm, prompts):
    """Prefill ``prompts`` and their MTP entries (as the drafter's first forward), then one chained MTP step
    (a DECODE batch at position ``len - 1``) on the paged kernel and, from the same pages, on the workspace
    path -> (draft logits, draft logits)."""
    model, dev = llm.model, llm.runner.device
    tables = [llm.pool.allocate_for_tokens(len(p) + 4) for p in prompts]
    try:
        pages = tuple(frozen_pages(t) for t in tables)
        _, h = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(p), 0, pg) for p, pg in zip(prompts, pages)])
        with torch.inference_mode():
            first = V4Batch.of(ForwardMode.PREFILL, [p[1:] for p in prompts], [0] * len(prompts), pages, dev)
            last = torch.tensor([len(p) - 1 for p in prompts]).cumsum(0) - 1
            keep = torch.ones(h.shape[0], dtype=torch.bool)
            keep[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1] = False  # no token after the last
            _, x, _ = model.mtp_forward(first, h[keep], llm.runner.cache, rows=last)
            chained = V4Batch.of(ForwardMode.DECODE, [[7]] * len(prompts), [len(p) - 1 for p in prompts], pages, dev)
            before = llm.runner.cache.buffer.clone()
            paged, _, _ = model.mtp_forward(chained, x, llm.runner.cache)
            llm.runner.cache.buffer.copy_(before)
            kernel, model.decode_kernel = model.decode_kernel, None
            try:
                workspace, _, _ = model.mtp_forward(chained, x, llm.runner.cache)
            finally:
                model.decode_kernel = kernel
        return paged, workspace
    finally:
        for t in tables:
            llm.pool.free(t)
