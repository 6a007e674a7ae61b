"""Sparse MLA (reference): golden FlashMLA outputs, fp8 vs auto caches, decode vs prefill."""

from __future__ import annotations

import math

import pytest
import torch

import attention.sparse_mla as sparse_mla_mod
from attention.cache import CacheSpec, PagedKVCache
from attention.formats import FP8_DTYPE, PAGE_SIZE
from attention.sparse_mla import sparse_mla_decode, sparse_mla_prefill

SM_SCALE = 0.041666666666666664  # golden_meta.json


def fro_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def golden_decode_cache(g, mode="fp8", emulate_kernel_rounding=False) -> PagedKVCache:
    """A PagedKVCache holding the golden's 12 pages (bytes as FlashMLA read them)."""
    raw = g["kv_cache_uint8"]
    if mode == "fp8":
        c = PagedKVCache(CacheSpec(1, raw.shape[0], 512, 64, 128, "fp8", torch.bfloat16))
        c.mla_view_for_kernel(0).copy_(raw)
        return c
    # auto bf16 cache holding what the legacy SM90 kernel computes with: the fp8
    # value times the *bf16-rounded* tile scale, rounded to bf16.
    buf = raw.reshape(-1, 656)
    vals = buf[:, :512].view(FP8_DTYPE).float().view(-1, 4, 128)
    scale = buf[:, 512:528].contiguous().view(torch.float32)
    if emulate_kernel_rounding:
        scale = scale.bfloat16().float()
    latent = (vals * scale[..., None]).view(-1, 512)
    rope = buf[:, 528:].contiguous().view(torch.bfloat16).float()
    c = PagedKVCache(CacheSpec(1, raw.shape[0], 512, 64, 128, "auto", torch.bfloat16))
    c.write_mla(0, torch.arange(buf.shape[0]), latent, rope)
    return c


# ----------------------------------------------------------------- golden


def test_golden_sparse_decode(load_golden):
    g = load_golden("flashmla_sparse_decode_v32")
    assert (g["indices"] == -1).any()  # the case exercises invalid indices
    out, lse = sparse_mla_decode(g["q"], golden_decode_cache(g), 0, g["indices"], SM_SCALE)
    assert out.shape == (3, 2, 64, 512) and out.dtype == torch.float32
    assert lse.shape == (3, 64, 2) and lse.dtype == torch.float32  # [b, h, s_q]
    err_out, err_lse = fro_rel(out, g["out"]), (lse - g["lse"]).abs().max().item()
    print(f"decode: out rel (Frobenius) {err_out:.3e}, lse max abs {err_lse:.3e}")
    assert err_out <= 3.5e-3  # measured 3.2e-3: bf16 kernel arithmetic + bf16 output
    assert err_lse <= 3e-3  # measured 2.8e-3, natural log


def test_golden_sparse_decode_kernel_rounding_explained(load_golden):
    """Emulating the kernel's bf16 scale / bf16 key rounding closes the lse gap to fp32 noise.

    Pins down *why* the fp32 reference differs from FlashMLA's legacy fp8 decode
    by ~3e-3 in lse (documented in attention/sparse_mla.py).
    """
    g = load_golden("flashmla_sparse_decode_v32")
    c = golden_decode_cache(g, mode="auto", emulate_kernel_rounding=True)
    out, lse = sparse_mla_decode(g["q"], c, 0, g["indices"], SM_SCALE)
    err_lse = (lse - g["lse"]).abs().max().item()
    print(f"decode, kernel rounding emulated: out rel {fro_rel(out, g['out']):.3e}, lse {err_lse:.3e}")
    assert err_lse <= 2e-5
    assert fro_rel(out, g["out"]) <= 2.5e-3
    # Without the scale rounding the auto cache equals the fp8 cache's exact dequantization.
    exact = golden_decode_cache(g, mode="auto", emulate_kernel_rounding=False)
    _, lse_exact = sparse_mla_decode(g["q"], exact, 0, g["indices"], SM_SCALE)
    assert (lse_exact - g["lse"]).abs().max().item() > 10 * err_lse


def test_golden_sparse_prefill(load_golden):
    g = load_golden("flashmla_sparse_prefill")
    s_kv = g["kv"].shape[0]
    idx = g["indices"]
    assert (idx >= s_kv).any() and (idx == -1).any()  # both kinds of invalid index occur
    assert bool((idx[7] < 0).all())  # row 7: no valid index
    out, max_logits, lse = sparse_mla_prefill(g["q"], g["kv"], idx, SM_SCALE)
    assert out.shape == (40, 64, 512) and max_logits.shape == lse.shape == (40, 64)
    # empty row: exactly what the kernel returned
    assert torch.equal(out[7], torch.zeros(64, 512))
    assert bool(torch.isposinf(lse[7]).all() and torch.isposinf(g["lse"][7]).all())
    assert bool(torch.isneginf(max_logits[7]).all() and torch.isneginf(g["max_logits"][7]).all())
    assert torch.equal(g["out"][7].float(), torch.zeros(64, 512))
    rows = torch.arange(40) != 7
    err_out = fro_rel(out, g["out"])
    err_lse = (lse[rows] - g["lse"][rows]).abs().max().item()
    err_max = (max_logits[rows] - g["max_logits"][rows]).abs().max().item()
    print(f"prefill: out rel {err_out:.3e}, lse {err_lse:.3e}, max_logits {err_max:.3e}")
    assert err_out <= 3e-3  # measured 2.1e-3
    # The legacy kernel's lse and max_logits are natural-log, scaled by sm_scale:
    # they match to fp32 noise, while a base-2 reading would be off by ~1 or more.
    assert err_lse <= 2e-5 and err_max <= 2e-5
    assert (lse[rows] / math.log(2) - g["lse"][rows]).abs().max() > 0.5


# ----------------------------------------------------------------- helpers


def dense_reference(q, keys, valid, sm_scale, d_v):
    """Float64 per-row attention: q [n, h, D], keys [n, topk, D], valid [n, topk]."""
    n, h, _ = q.shape
    out = torch.zeros(n, h, d_v, dtype=torch.float64)
    lse = torch.full((n, h), math.inf, dtype=torch.float64)
    for i in range(n):
        k = keys[i][valid[i]].double()
        if k.shape[0] == 0:
            continue
        logits = q[i].double() @ k.T * sm_scale
        lse[i] = torch.logsumexp(logits, -1)
        out[i] = torch.softmax(logits, -1) @ k[:, :d_v]
    return out, lse


def random_cache_pair(gen, r=96, d=16, num_pages=6, n_tokens=300):
    """The same random tokens written to an fp8 cache and an fp32 auto cache; returns both + slots."""
    slots = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:n_tokens]
    latent = torch.randn(n_tokens, r, generator=gen)
    rope = torch.randn(n_tokens, d, generator=gen)
    caches = {}
    for mode in ("fp8", "auto"):
        c = PagedKVCache(CacheSpec(2, num_pages, r, d, 16, mode, torch.float32))
        c.write_mla(1, slots, latent, rope)
        caches[mode] = c
    return caches, slots


# ----------------------------------------------------------------- decode


def test_decode_matches_dense_reference_and_fp8_is_close(gen):
    r, d = 96, 16
    caches, slots = random_cache_pair(gen, r, d)
    b, s_q, h, topk = 3, 2, 8, 40
    q = torch.randn(b, s_q, h, r + d, generator=gen)
    pick = torch.randint(0, slots.numel(), (b, s_q, topk), generator=gen)
    indices = slots[pick].to(torch.int32)
    indices[0, 1, 5:] = -1  # mostly invalid row
    indices[2, 0, ::3] = -1
    sm = (r + d) ** -0.5

    out_a, lse_a = sparse_mla_decode(q, caches["auto"], 1, indices, sm)
    flat_idx = indices.view(-1, topk).long()
    keys = caches["auto"].read_mla(1, flat_idx.reshape(-1)).view(-1, topk, r + d)
    want_out, want_lse = dense_reference(q.view(-1, h, r + d), keys, flat_idx >= 0, sm, r)
    torch.testing.assert_close(out_a, want_out.float().view(b, s_q, h, r), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_a, want_lse.float().view(b, s_q, h).transpose(1, 2), rtol=1e-5, atol=1e-5)

    out_8, lse_8 = sparse_mla_decode(q, caches["fp8"], 1, indices, sm)
    # Exactly the attention over the dequantized fp8 keys ...
    dequant = PagedKVCache(caches["auto"].spec)
    dequant.write_mla(1, slots, *caches["fp8"].read_mla(1, slots).split([r, d], dim=1))
    out_q, lse_q = sparse_mla_decode(q, dequant, 1, indices, sm)
    torch.testing.assert_close(out_8, out_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_8, lse_q, rtol=1e-6, atol=1e-6)
    # ... which is within fp8 error of the unquantized result: keys carry <= 2^-4
    # relative error per element (~2% rms). Worst over 300 seeds: 3.8e-2 / 6.1e-2.
    assert 0 < fro_rel(out_8, out_a) <= 8e-2
    assert (lse_8 - lse_a).abs().max() <= 0.15


def test_decode_equals_prefill_on_same_keys(gen):
    """Decode over paged slots == prefill over the same keys laid out contiguously."""
    r, d = 32, 8
    caches, slots = random_cache_pair(gen, r, d, num_pages=4, n_tokens=200)
    kv = caches["auto"].read_mla(1, slots)  # contiguous kv, position i <-> slots[i]
    b, s_q, h, topk = 2, 3, 4, 24
    q = torch.randn(b, s_q, h, r + d, generator=gen)
    positions = torch.randint(0, 200, (b, s_q, topk), generator=gen)
    positions[1, 2, 10:] = -1
    idx_slots = torch.where(positions >= 0, slots[positions.clamp(min=0)], -1)
    out_d, lse_d = sparse_mla_decode(q, caches["auto"], 1, idx_slots, 0.3)
    out_p, max_p, lse_p = sparse_mla_prefill(
        q.view(-1, h, r + d), kv[:, None, :], positions.view(-1, 1, topk).to(torch.int32), 0.3, r
    )
    torch.testing.assert_close(out_d.view(-1, h, r), out_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_d.transpose(1, 2).reshape(-1, h), lse_p, rtol=1e-5, atol=1e-5)
    assert bool((max_p <= lse_p).all())


@pytest.mark.parametrize("mode", ["fp8", "auto"])
def test_decode_rows_without_valid_index(mode, gen):
    caches, slots = random_cache_pair(gen, num_pages=2, n_tokens=100)
    q = torch.randn(2, 1, 4, 112, generator=gen)
    idx = torch.full((2, 1, 16), -1, dtype=torch.int32)
    idx[1, 0, :3] = slots[:3].to(torch.int32)
    out, lse = sparse_mla_decode(q, caches[mode], 1, idx, 0.1)
    assert torch.equal(out[0], torch.zeros(1, 4, 96)) and bool(torch.isposinf(lse[0]).all())
    assert bool(torch.isfinite(lse[1]).all()) and out[1].abs().sum() > 0


def test_decode_d_v_and_checks(gen):
    caches, slots = random_cache_pair(gen, num_pages=2, n_tokens=64)
    q = torch.randn(1, 1, 2, 112, generator=gen)
    idx = slots[:8].view(1, 1, 8)
    out, _ = sparse_mla_decode(q, caches["auto"], 1, idx, 0.1)
    out_small, _ = sparse_mla_decode(q, caches["auto"], 1, idx, 0.1, d_v=40)
    assert out.shape[-1] == 96 and torch.equal(out_small, out[..., :40])
    with pytest.raises(ValueError):
        sparse_mla_decode(q[..., :100], caches["auto"], 1, idx, 0.1)
    with pytest.raises(IndexError):
        sparse_mla_decode(q, caches["auto"], 1, torch.full((1, 1, 8), 10_000), 0.1)


# ----------------------------------------------------------------- prefill


def test_prefill_invalid_indices_and_dense_reference(gen):
    s, h, s_kv, topk, r, d = 12, 4, 50, 20, 64, 16
    q = torch.randn(s, h, r + d, generator=gen).bfloat16()
    kv = torch.randn(s_kv, 1, r + d, generator=gen).bfloat16()
    idx = torch.randint(0, s_kv, (s, 1, topk), generator=gen, dtype=torch.int32)
    idx[0, 0, :] = -1  # no valid index
    idx[1, 0, :] = s_kv + 3  # all >= s_kv: no valid index either
    idx[2, 0, ::2] = -1
    idx[3, 0, 1::2] = s_kv
    out, mx, lse = sparse_mla_prefill(q, kv, idx, 0.2, d_v=r)
    for row in (0, 1):
        assert torch.equal(out[row], torch.zeros(h, r))
        assert bool(torch.isposinf(lse[row]).all() and torch.isneginf(mx[row]).all())
    valid = (idx[:, 0] >= 0) & (idx[:, 0] < s_kv)
    keys = kv[:, 0].float()[idx[:, 0].long().clamp(0, s_kv - 1)]
    want_out, want_lse = dense_reference(q.float(), keys, valid, 0.2, r)
    torch.testing.assert_close(out, want_out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-5)
    want_max = torch.stack([
        (q[i].float() @ keys[i][valid[i]].T * 0.2).amax(-1) if valid[i].any() else torch.full((h,), -math.inf)
        for i in range(s)
    ])
    torch.testing.assert_close(mx, want_max, rtol=1e-6, atol=1e-6)


def test_prefill_chunking_is_invisible(gen, monkeypatch):
    q = torch.randn(30, 4, 40, generator=gen)
    kv = torch.randn(70, 1, 40, generator=gen)
    idx = torch.randint(-1, 75, (30, 1, 16), generator=gen)
    whole = sparse_mla_prefill(q, kv, idx, 0.15, d_v=32)
    monkeypatch.setattr(sparse_mla_mod, "_CHUNK_ELEMENTS", 16 * 44 * 7)  # 7 rows per chunk
    chunked = sparse_mla_prefill(q, kv, idx, 0.15, d_v=32)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_prefill_d_v_required_unless_576():
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_prefill(torch.zeros(1, 2, 40), torch.zeros(3, 1, 40), torch.zeros(1, 1, 2, dtype=torch.int32), 0.1)
    out, _, _ = sparse_mla_prefill(
        torch.zeros(1, 2, 576), torch.zeros(3, 1, 576), torch.zeros(1, 1, 2, dtype=torch.int32), 0.1
    )
    assert out.shape == (1, 2, 512)
