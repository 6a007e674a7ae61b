"""DeepSeek-V4's sparse attention with sinks on FlashMLA (``attention.cuda.v4_attention``) against the
reference (``attention.v4_attention.sparse_attention_with_sink``), on fresh random inputs.

* CPU (CI): the wrapper's glue (head and index padding, invalid indices, the sink, ``topk_length``) on
  ``cuda_fakes``' ``flash_mla_sparse_fwd``, which asserts the installed SM90 kernel's argument contract
  (d_qk 512, 64 / 128 heads, top-k % 64, an f32 ``[h]`` sink, an int32 ``[s]`` length) and computes
  the kernel's own definition (softmax, then the output scaled by exp(lse) / (exp(lse) + exp(sink)));
* ``gpu``: the same comparisons on the real kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from attention.v4_attention import sparse_attention_with_sink as reference

SEED = random.randrange(1 << 30)


def _case(gen, S, H, N, K, device, invalid=0.3):
    """bf16-representable q / kv (so the kernel's bf16 inputs are exact), indices with -1 holes."""
    q = torch.randn(S, H, 512, generator=gen).to(torch.bfloat16).float()
    kv = torch.randn(N, 512, generator=gen).to(torch.bfloat16).float()
    idx = torch.randint(0, N, (S, K), generator=gen)
    idx[torch.rand(S, K, generator=gen) < invalid] = -1
    idx[0] = -1  # a row with nothing to read
    sink = torch.randn(H, generator=gen) * 2
    return q.to(device), kv.to(device), idx.to(device), sink.to(device)


def _check(S, H, N, K, device, lengths=False):
    from attention.cuda.v4_attention import sparse_attention_with_sink

    gen = torch.Generator().manual_seed(SEED)
    q, kv, idx, sink = _case(gen, S, H, N, K, device)
    scale = 512 ** -0.5
    topk_length = None
    want_idx = idx
    if lengths:
        topk_length = torch.randint(0, K + 1, (S,), generator=gen).to(device)
        # The reference reads what the kernel is told to: entries past a row's length are out.
        want_idx = torch.where(torch.arange(K, device=device)[None, :] < topk_length[:, None], idx, -1)
    got = sparse_attention_with_sink(q, kv, idx, sink, scale, topk_length)
    want = reference(q, kv, want_idx, sink, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (S, H, 512)
    assert torch.equal(got[0].float(), torch.zeros(H, 512, device=device)), SEED  # no valid index: 0
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=f"ATTN_TEST_SEED={SEED}")


@pytest.mark.parametrize("H", [16, 64, 128])  # 16: a tensor-parallel shard, padded to 64 heads
def test_v4_sparse_attention_matches_reference_on_fakes(cuda_fake_kernels, H):
    _check(S=19, H=H, N=300, K=200, device="cpu")  # K 200: the index width is padded to 256
    assert cuda_fake_kernels.CALLS["flash_mla_sparse_fwd"] == 1


def test_v4_sparse_attention_topk_length_on_fakes(cuda_fake_kernels):
    _check(S=23, H=64, N=257, K=130, device="cpu", lengths=True)


def test_v4_sparse_attention_out_of_range_index_is_invalid(cuda_fake_kernels):
    """An index >= N reads nothing (turned into -1 on the device, no read-back), as -1 does."""
    from attention.cuda.v4_attention import sparse_attention_with_sink

    gen = torch.Generator().manual_seed(SEED)
    q, kv, idx, sink = _case(gen, 5, 64, 40, 64, "cpu")
    bad = idx.clone()
    bad[idx < 0] = 40 + 7
    got = sparse_attention_with_sink(q, kv, bad, sink, 0.05)
    torch.testing.assert_close(got.float(), reference(q, kv, idx, sink, 0.05), rtol=2e-2, atol=2e-2)


def test_v4_sparse_attention_refuses_other_shapes(cuda_fake_kernels):
    from attention.cuda.v4_attention import sparse_attention_with_sink

    q, kv, idx, sink = torch.zeros(3, 64, 576), torch.zeros(9, 576), torch.zeros(3, 8, dtype=torch.long), torch.zeros(64)
    with pytest.raises(ValueError, match=r"q \[S, H, 512\]"):
        sparse_attention_with_sink(q, kv, idx, sink, 1.0)
    with pytest.raises(ValueError, match="at most 128 query heads"):
        sparse_attention_with_sink(torch.zeros(3, 256, 512), torch.zeros(9, 512), idx, torch.zeros(256), 1.0)
    with pytest.raises(ValueError, match="sink must be"):
        sparse_attention_with_sink(torch.zeros(3, 64, 512), torch.zeros(9, 512), idx, torch.zeros(32), 1.0)
    assert "flash_mla_sparse_fwd" not in cuda_fake_kernels.CALLS


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("lengths", [False, True])
def test_v4_sparse_attention_matches_reference_gpu(H, lengths):
    _check(S=256, H=H, N=4096, K=640, device="cuda", lengths=lengths)
