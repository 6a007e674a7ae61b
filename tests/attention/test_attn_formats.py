"""Byte formats: fp8 MLA latent cache and fp8 indexer-key cache."""

from __future__ import annotations

import pytest
import torch

from attention.formats import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_TILE,
    PAGE_SIZE,
    IndexerFp8Format,
    MlaFp8Format,
    dequantize_indexer_fp8,
    dequantize_mla_fp8,
    pack_indexer_page,
    pages_for_tokens,
    quantize_indexer_fp8,
    quantize_mla_fp8,
    unpack_indexer_page,
)

# (kv_lora_rank, rope_dim): DeepSeek-V3.2 and tiny-model shapes, incl. narrower last tiles.
MLA_SHAPES = [(512, 64), (32, 8), (96, 16), (160, 16), (200, 8), (130, 0)]


def wide_range(n: int, width: int, gen: torch.Generator, group: int = FP8_TILE) -> torch.Tensor:
    """Random values whose magnitude varies strongly from one ``group`` of columns to the next."""
    x = torch.randn(n, width, generator=gen)
    groups = -(-width // group)
    mag = torch.exp(torch.randn(n, groups, generator=gen) * 3)
    return x * mag.repeat_interleave(group, dim=1)[:, :width]


def assert_within_fp8_error(x: torch.Tensor, xq: torch.Tensor, scale_per_elem: torch.Tensor) -> None:
    """|x - xq| <= half an e4m3 step: 2^-4 |x| for normals, 2^-10 * scale for subnormals."""
    bound = x.abs() * 2.0**-4 + scale_per_elem * 2.0**-10 + 1e-6 * x.abs()
    err = (x - xq).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item()}"


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


# ----------------------------------------------------------------- geometry


def test_pages_for_tokens_unchanged():
    assert PAGE_SIZE == 64
    assert [pages_for_tokens(n) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]


def test_mla_geometry_deepseek():
    fmt = MlaFp8Format(512, 64)
    assert fmt.n_tiles == 4
    assert fmt.bytes_per_token == 656
    assert (fmt.scale_offset, fmt.rope_offset) == (512, 528)
    assert fmt.bytes_per_page == 64 * 656
    assert fmt.tile_bounds == ((0, 128), (128, 256), (256, 384), (384, 512))


@pytest.mark.parametrize("r,d", MLA_SHAPES)
def test_mla_geometry_general(r, d):
    fmt = MlaFp8Format(r, d)
    bounds = fmt.tile_bounds
    assert fmt.n_tiles == len(bounds) == -(-r // 128)
    assert bounds[0][0] == 0 and bounds[-1][1] == r
    assert all(e - s == 128 for s, e in bounds[:-1]) and 0 < bounds[-1][1] - bounds[-1][0] <= 128
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert fmt.bytes_per_token == r + 4 * fmt.n_tiles + 2 * d


@pytest.mark.parametrize(
    "r,d", [(0, 64), (-128, 64), (512, -1), (512.0, 64), (True, 64), ("512", 64), (512, None)]
)
def test_mla_format_rejects_nonsense(r, d):
    with pytest.raises(ValueError, match="kv_lora_rank|rope_dim"):
        MlaFp8Format(r, d)


@pytest.mark.parametrize("D", [0, -128, 128.0, False])
def test_indexer_format_rejects_nonsense(D):
    with pytest.raises(ValueError, match="head_dim"):
        IndexerFp8Format(D)


def test_indexer_geometry():
    fmt = IndexerFp8Format(128)
    assert fmt.bytes_per_token == 132
    assert fmt.bytes_per_page == 8448
    assert fmt.scale_offset == 64 * 128


# ----------------------------------------------------------------- MLA fp8


@pytest.mark.parametrize("r,d", MLA_SHAPES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_mla_quantize_layout_and_error(r, d, in_dtype, gen):
    n = 37
    fmt = MlaFp8Format(r, d)
    latent = wide_range(n, r, gen).to(in_dtype)
    rope = torch.randn(n, d, generator=gen).to(in_dtype)
    buf = quantize_mla_fp8(latent, rope, fmt)
    assert buf.dtype == torch.uint8 and buf.shape == (n, fmt.bytes_per_token)

    # Independent per-tile re-derivation of every byte region.
    x = latent.float()
    scales = buf[:, r : r + 4 * fmt.n_tiles].contiguous().view(torch.float32)
    for t, (s, e) in enumerate(fmt.tile_bounds):
        amax = x[:, s:e].abs().amax(dim=1)
        assert torch.equal(f32_bits(scales[:, t]), f32_bits(amax / 448.0)), f"tile {t} scale"
        expect = (x[:, s:e] / (amax / 448.0)[:, None]).to(FP8_DTYPE).view(torch.uint8)
        assert torch.equal(buf[:, s:e], expect), f"tile {t} values"
        assert torch.equal(buf[:, s:e].view(FP8_DTYPE).float().abs().amax(dim=1), torch.full((n,), FP8_MAX))
    assert torch.equal(buf[:, fmt.rope_offset :], rope.to(torch.bfloat16).contiguous().view(torch.uint8))

    lat_q, rope_q = dequantize_mla_fp8(buf, fmt)
    assert lat_q.dtype == rope_q.dtype == torch.float32
    assert torch.equal(rope_q, rope.to(torch.bfloat16).float())  # rope is exact
    per_elem = torch.cat([scales[:, t : t + 1].expand(n, e - s) for t, (s, e) in enumerate(fmt.tile_bounds)], 1)
    assert_within_fp8_error(x, lat_q, per_elem)


@pytest.mark.parametrize("r,d", MLA_SHAPES)
def test_mla_requantize_is_bit_exact(r, d, gen):
    fmt = MlaFp8Format(r, d)
    latent = wide_range(200, r, gen)
    rope = torch.randn(200, d, generator=gen) * 10
    buf = quantize_mla_fp8(latent, rope, fmt)
    lat_q, rope_q = dequantize_mla_fp8(buf, fmt)
    again = quantize_mla_fp8(lat_q, rope_q, fmt)
    assert torch.equal(again, buf)
    lat_2, rope_2 = dequantize_mla_fp8(again, fmt)
    assert torch.equal(lat_2, lat_q) and torch.equal(rope_2, rope_q)


@pytest.mark.parametrize("r,d", [(512, 64), (160, 16)])
def test_mla_zero_tiles_do_not_make_nan(r, d, gen):
    fmt = MlaFp8Format(r, d)
    latent = wide_range(6, r, gen)
    latent[0] = 0.0  # whole token zero
    latent[1, :128] = 0.0  # first tile zero
    latent[2, fmt.tile_bounds[-1][0] :] = 0.0  # last (maybe narrower) tile zero
    latent[3, 5] = -0.0
    rope = torch.randn(6, d, generator=gen)
    buf = quantize_mla_fp8(latent, rope, fmt)
    lat_q, _ = dequantize_mla_fp8(buf, fmt)
    assert not torch.isnan(buf[:, :r].view(FP8_DTYPE).float()).any()
    assert not torch.isnan(lat_q).any()
    scales = buf[:, r : fmt.rope_offset].contiguous().view(torch.float32)
    assert torch.equal(scales[0], torch.zeros(fmt.n_tiles))
    assert scales[1, 0] == 0 and scales[2, -1] == 0
    assert torch.equal(lat_q[0], torch.zeros(r))
    assert torch.equal(lat_q[1, :128], torch.zeros(128))
    assert torch.equal(lat_q[2, fmt.tile_bounds[-1][0] :], torch.zeros(r - fmt.tile_bounds[-1][0]))
    assert torch.equal(quantize_mla_fp8(lat_q, dequantize_mla_fp8(buf, fmt)[1], fmt), buf)


def test_mla_shape_checks():
    fmt = MlaFp8Format(96, 16)
    with pytest.raises(ValueError):
        quantize_mla_fp8(torch.zeros(3, 95), torch.zeros(3, 16), fmt)
    with pytest.raises(ValueError):
        quantize_mla_fp8(torch.zeros(3, 96), torch.zeros(2, 16), fmt)
    with pytest.raises(ValueError):
        dequantize_mla_fp8(torch.zeros(3, fmt.bytes_per_token + 1, dtype=torch.uint8), fmt)
    with pytest.raises(ValueError):
        dequantize_mla_fp8(torch.zeros(3, fmt.bytes_per_token, dtype=torch.int8), fmt)


def test_mla_golden_cache_round_trips(load_golden):
    """The cache FlashMLA read on the H100 decodes and re-encodes to the same bytes.

    fp8 values and rope bytes are identical. The golden writer's fp32 scales are
    not always ``amax / 448`` rounded once (it rounds differently, e.g. via
    ``* (1/448)``): ~14% of its tiles re-encode one ulp apart. Every tile still
    has max |value| == 448, i.e. scale = amax / 448.
    """
    fmt = MlaFp8Format(512, 64)
    buf = load_golden("flashmla_sparse_decode_v32")["kv_cache_uint8"].reshape(-1, 656)
    lat, rope = dequantize_mla_fp8(buf, fmt)
    assert torch.isfinite(lat).all() and torch.isfinite(rope).all()
    vals = buf[:, :512].view(FP8_DTYPE).float().view(-1, 4, 128)
    assert torch.equal(vals.abs().amax(-1), torch.full((buf.shape[0], 4), FP8_MAX))
    again = quantize_mla_fp8(lat, rope, fmt)
    assert torch.equal(again[:, :512], buf[:, :512])
    assert torch.equal(again[:, 528:], buf[:, 528:])
    ulps = f32_bits(again[:, 512:528].contiguous().view(torch.float32)) - f32_bits(
        buf[:, 512:528].contiguous().view(torch.float32)
    )
    assert ulps.abs().max() <= 1


# ----------------------------------------------------------------- indexer fp8


@pytest.mark.parametrize("D", [128, 64, 24])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_indexer_quantize(D, in_dtype, gen):
    n = 150
    k = (torch.randn(n, D, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 3)).to(in_dtype)
    k[7] = 0.0
    k_fp8, scale = quantize_indexer_fp8(k)
    assert k_fp8.dtype == FP8_DTYPE and k_fp8.shape == (n, D)
    assert scale.dtype == torch.float32 and scale.shape == (n,)
    amax = k.float().abs().amax(dim=1)
    assert torch.equal(f32_bits(scale), f32_bits(amax / 448.0))
    nz = amax > 0
    assert torch.equal(k_fp8.float().abs().amax(dim=1)[nz], torch.full((int(nz.sum()),), FP8_MAX))
    deq = dequantize_indexer_fp8(k_fp8, scale)
    assert not torch.isnan(deq).any() and torch.equal(deq[7], torch.zeros(D))
    assert_within_fp8_error(k.float(), deq, scale[:, None].expand(n, D))
    # bytes accepted as well as fp8
    assert torch.equal(dequantize_indexer_fp8(k_fp8.view(torch.uint8), scale), deq)
    k2, s2 = quantize_indexer_fp8(deq)
    assert torch.equal(k2.view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(f32_bits(s2), f32_bits(scale))


@pytest.mark.parametrize("D", [128, 24])
def test_indexer_page_pack_layout(D, gen):
    fmt = IndexerFp8Format(D)
    P = 3
    k = torch.randn(P * PAGE_SIZE, D, generator=gen)
    k_fp8, scale = quantize_indexer_fp8(k)
    pages = pack_indexer_page(k_fp8.view(P, PAGE_SIZE, D), scale.view(P, PAGE_SIZE))
    assert pages.dtype == torch.uint8 and pages.shape == (P, fmt.bytes_per_page)
    for p in range(P):
        toks = slice(p * PAGE_SIZE, (p + 1) * PAGE_SIZE)
        # keys first, token-major, then the 64 little-endian float32 scales
        assert torch.equal(pages[p, : PAGE_SIZE * D], k_fp8[toks].reshape(-1).view(torch.uint8))
        assert torch.equal(pages[p, PAGE_SIZE * D :], scale[toks].contiguous().view(torch.uint8))
    k_back, s_back = unpack_indexer_page(pages, fmt)
    assert torch.equal(k_back.view(torch.uint8), k_fp8.view(P, PAGE_SIZE, D).view(torch.uint8))
    assert torch.equal(s_back, scale.view(P, PAGE_SIZE))
    # DeepGEMM's (P, 64, 1, D + 4) view of the same bytes unpacks identically
    k_v, s_v = unpack_indexer_page(pages.view(P, PAGE_SIZE, 1, D + 4), fmt)
    assert torch.equal(k_v.view(torch.uint8), k_back.view(torch.uint8)) and torch.equal(s_v, s_back)
    with pytest.raises(ValueError):
        unpack_indexer_page(pages[:, :-4], fmt)
    with pytest.raises(ValueError):
        pack_indexer_page(k_fp8.view(P, PAGE_SIZE, D)[:, :63], scale.view(P, PAGE_SIZE))


def test_indexer_golden_pages_round_trip(load_golden):
    """DeepGEMM's golden pages unpack/pack to identical bytes; re-quantizing keeps the fp8 bytes
    (scales: one ulp at most, see test_mla_golden_cache_round_trips)."""
    fmt = IndexerFp8Format(128)
    cache = load_golden("deepgemm_paged_mqa_logits")["kv_cache_uint8"]
    k_fp8, scale = unpack_indexer_page(cache, fmt)
    assert torch.equal(pack_indexer_page(k_fp8, scale), cache.reshape(cache.shape[0], -1))
    assert bool((scale > 0).all())
    assert torch.equal(k_fp8.float().abs().amax(-1), torch.full(scale.shape, FP8_MAX))
    k2, s2 = quantize_indexer_fp8(dequantize_indexer_fp8(k_fp8, scale).reshape(-1, 128))
    assert torch.equal(k2.view(torch.uint8), k_fp8.reshape(-1, 128).view(torch.uint8))
    assert (f32_bits(s2) - f32_bits(scale.reshape(-1))).abs().max() <= 1
