"""Does FlashMLA's SM90 sparse prefill at V3.2's ``d_qk`` 576 honour a per-token ``topk_length``?

The answer decides whether V3.2's prefill can give each token its own window width
(``attention/API.md``, "topk_length") instead of cutting the index columns per group: row ``s`` with
``topk_length[s] = L`` must equal the same row with every index past ``L`` set to -1.
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_v32_legacy_sparse_prefill_topk_length_gpu():
    fm = pytest.importorskip("flash_mla")
    gen = torch.Generator().manual_seed(0)
    S, H, N, K = 200, 128, 3000, 512
    q = torch.randn(S, H, 576, generator=gen).to(torch.bfloat16).cuda()
    kv = torch.randn(N, 1, 576, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.randint(0, N, (S, 1, K), generator=gen, dtype=torch.int32).cuda()
    length = torch.randint(1, K + 1, (S,), generator=gen, dtype=torch.int32).cuda()
    cut = torch.where(torch.arange(K, device="cuda")[None, None, :] < length[:, None, None], idx, -1)
    want, _, want_lse = fm.flash_mla_sparse_fwd(q, kv, cut, 576 ** -0.5, 512, use_legacy=True)
    got, _, got_lse = fm.flash_mla_sparse_fwd(q, kv, idx, 576 ** -0.5, 512, topk_length=length, use_legacy=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-3, atol=1e-3)
