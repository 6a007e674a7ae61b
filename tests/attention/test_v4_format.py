"""DeepSeek-V4 cache format (attention/v4_format.py), combined index row and sink attention
(attention/v4_attention.py), cache groups (attention/cache_groups.py, models/v4/cache_spec.py)."""

from __future__ import annotations

import pytest
import torch

from attention.cache_groups import CacheGroup
from attention.v4_attention import combined_index_row, sparse_attention_with_sink
from attention.v4_format import (
    PAGE_TOKENS,
    V4CacheFormat,
    dequantize_v4,
    kernel_view,
    new_pages,
    quantize_v4,
    read_v4,
    write_v4,
)


def _tokens(n: int, fmt: V4CacheFormat, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Tiles of very different magnitudes, an all-zero tile, and rope values bf16 cannot hold exactly.
    x = torch.randn(n, fmt.head_dim, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[0, :min(64, fmt.nope_dim)] = 0.0
    return x


def test_deepseek_v4_geometry():
    fmt = V4CacheFormat()
    assert (fmt.part_bytes, fmt.n_scales, fmt.scale_bytes, fmt.bytes_per_token) == (576, 7, 8, 584)
    assert fmt.scale_offset == 256 * 576
    assert fmt.page_bytes == 149_760 and fmt.page_bytes % 576 == 0
    assert V4CacheFormat.for_head(512, 64) == fmt
    # A narrow last tile (tiny models): 32 nope values -> one scale, padded to 8 bytes.
    tiny = V4CacheFormat.for_head(48, 16)
    assert (tiny.part_bytes, tiny.n_scales, tiny.scale_bytes) == (64, 1, 8)
    with pytest.raises(ValueError, match="rope_dim"):
        V4CacheFormat.for_head(64, 64)


@pytest.mark.parametrize("fmt", [V4CacheFormat(), V4CacheFormat(100, 12), V4CacheFormat(32, 16)])
def test_quantize_dequantize_round_trip(fmt):
    x = _tokens(40, fmt, seed=fmt.nope_dim)
    parts, scales = quantize_v4(x, fmt)
    assert parts.dtype == scales.dtype == torch.uint8
    assert parts.shape == (40, fmt.part_bytes) and scales.shape == (40, fmt.scale_bytes)
    y = dequantize_v4(parts, scales, fmt)
    # rope is stored as bf16, exactly.
    assert torch.equal(y[:, fmt.nope_dim:], x[:, fmt.nope_dim:].to(torch.bfloat16).float())
    # nope: e4m3 keeps 3 mantissa bits of each value divided by a power-of-two tile scale.
    nope, got = x[:, :fmt.nope_dim], y[:, :fmt.nope_dim]
    for t0 in range(0, fmt.nope_dim, 64):
        tile = nope[:, t0:t0 + 64]
        amax = tile.abs().amax(dim=1, keepdim=True)
        assert ((got[:, t0:t0 + 64] - tile).abs() <= amax / 16 + 1e-30).all()
    assert torch.equal(got[0, :min(64, fmt.nope_dim)], torch.zeros(min(64, fmt.nope_dim)))
    # Scales are UE8M0 bytes (exponent + 127) of powers of two >= amax / 448; padding bytes are zero.
    exp = scales[:, :fmt.n_scales].float() - 127
    amax = torch.zeros(40, fmt.n_scales)
    for t in range(fmt.n_scales):
        amax[:, t] = nope[:, t * 64:(t + 1) * 64].abs().amax(dim=1).clamp(min=1e-4)
    assert (torch.exp2(exp) >= amax / 448).all() and (torch.exp2(exp - 1) < amax / 448).all()
    assert (scales[:, fmt.n_scales:] == 0).all()
    # Re-quantizing a dequantized token gives the same values.
    assert torch.equal(dequantize_v4(*quantize_v4(y, fmt), fmt), y)


def test_round_trip_is_what_the_cache_gives_back():
    from attention.v4_format import read_tokens, round_trip_v4, token_bytes_at, write_tokens

    fmt = V4CacheFormat(100, 12)
    x = _tokens(30, fmt, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        y = round_trip_v4(x.to(dtype), fmt)
        assert y.dtype == dtype and torch.equal(y.float(), dequantize_v4(*quantize_v4(x.to(dtype), fmt), fmt))
        # Stored again, a rounded token reads back as itself (what the engine relies on).
        assert torch.equal(round_trip_v4(y, fmt), y)
    # Tokens at pages starting anywhere in a flat buffer (a group page holds one V4 page per layer).
    flat = torch.zeros(3 * fmt.page_bytes + 100, dtype=torch.uint8)
    base = torch.tensor([100, 100 + 2 * fmt.page_bytes])
    off = torch.tensor([255, 7])
    write_tokens(flat, base, off, x[:2], fmt)
    assert torch.equal(read_tokens(flat, base, off, fmt), dequantize_v4(*quantize_v4(x[:2], fmt), fmt))
    part_at, scale_at = token_bytes_at(base, off, fmt)
    assert part_at[0, 0] == 100 + 255 * fmt.part_bytes and scale_at[1, 0] == base[1] + fmt.scale_offset + 7 * 8


def test_pages_parts_then_scales_then_padding():
    fmt = V4CacheFormat(100, 12)  # part 124 bytes, 2 scales padded to 8
    pages = new_pages(3, fmt)
    x = _tokens(5, fmt, seed=1)
    slots = torch.tensor([256, 257, -1, 511, 3])  # page 1 offsets 0, 1, 255; page 0 offset 3; one skipped
    write_v4(pages, slots, x, fmt)
    parts, scales = quantize_v4(x, fmt)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, off = divmod(s, PAGE_TOKENS)
        row = pages[page]
        assert torch.equal(row[off * fmt.part_bytes:(off + 1) * fmt.part_bytes], parts[i])
        at = fmt.scale_offset + off * fmt.scale_bytes
        assert torch.equal(row[at:at + fmt.scale_bytes], scales[i])
    assert (pages[:, PAGE_TOKENS * fmt.bytes_per_token:] == 0).all()  # padding to a multiple of the part size
    assert (pages[2] == 0).all()
    got = read_v4(pages, torch.tensor([256, -1, 3, 511]), fmt)
    want = dequantize_v4(parts, scales, fmt)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[4]) and torch.equal(got[3], want[3])
    assert torch.equal(got[1], torch.zeros(fmt.head_dim))
    with pytest.raises(IndexError, match="outside a pool of 3 pages"):
        write_v4(pages, torch.tensor([3 * 256]), x[:1], fmt)
    view = kernel_view(new_pages(2, V4CacheFormat()), V4CacheFormat())
    assert view.shape == (2, 256, 1, 584) and view.stride() == (149_760, 584, 584, 1)


def test_combined_index_row():
    comp = torch.tensor([[2, 0, -1], [1, -1, -1]])
    swa = torch.tensor([[-1, 0, 1], [0, 1, 2]])
    row = combined_index_row(comp, swa, comp_offset=10, swa_offset=3)
    assert row.dtype == torch.int32 and row.shape == (2, 128)
    assert row[0, :6].tolist() == [12, 10, -1, -1, 3, 4]
    assert row[1, :6].tolist() == [11, -1, -1, 3, 4, 5]
    assert (row[:, 6:] == -1).all()
    assert combined_index_row(torch.zeros(1, 100, dtype=torch.long), torch.zeros(1, 60, dtype=torch.long),
                              0, 0).shape == (1, 256)
    assert combined_index_row(comp, swa, 0, 0, align=64).shape == (2, 64)


def test_sink_attention_against_dense_softmax():
    g = torch.Generator().manual_seed(0)
    S, H, D, N = 5, 3, 16, 9
    q, kv = torch.randn(S, H, D, generator=g), torch.randn(N, D, generator=g)
    sink = torch.randn(H, generator=g)
    idx = torch.randint(-1, N, (S, 7), generator=g)
    idx[4] = -1  # a row with nothing to attend: out 0
    out = sparse_attention_with_sink(q, kv, idx, sink, 0.3)
    for s in range(S):
        keep = idx[s][idx[s] >= 0]
        k = kv[keep]
        logits = torch.cat([q[s] @ k.T * 0.3, sink[:, None]], dim=1)  # [H, n + 1]
        p = logits.softmax(dim=1)[:, :-1]
        torch.testing.assert_close(out[s], p @ k, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[4], torch.zeros(H, D))
    with pytest.raises(IndexError):
        sparse_attention_with_sink(q, kv, torch.full((S, 1), N), sink, 0.3)


def test_cache_groups_of_deepseek_v4():
    from models.v4.cache_spec import v4_cache_groups
    from models.v4.config import v4_config_from_dict

    cfg = v4_config_from_dict({"model_type": "deepseek_v4"})  # transformers' defaults: V4-Flash shapes
    groups = {g.name: g for g in v4_cache_groups(cfg)}  # the serving format: kv_cache_dtype fp8, bf16 model
    assert sorted(groups) == ["csa_index", "csa_index_state", "csa_kv", "csa_state", "hca_kv", "hca_state", "swa"]
    swa, c4, c128 = groups["swa"], groups["csa_kv"], groups["hca_kv"]
    assert (swa.bytes_per_token, swa.page_bytes, swa.tokens_per_page, swa.window) == (584, 149_760, 256, 128)
    # The MTP layer (layer num_hidden_layers, sliding window only) has its keys in the swa group.
    assert cfg.num_nextn_predict_layers == 1 and swa.layers == tuple(range(cfg.num_hidden_layers + 1))
    main_only = {g.name: g.layers for g in v4_cache_groups(cfg, with_mtp=False)}
    assert main_only["swa"] == tuple(range(cfg.num_hidden_layers))
    assert (c4.ratio, c128.ratio) == (4, 128) and c4.bytes_per_token == c128.bytes_per_token == 584
    assert set(c4.layers) | set(c128.layers) == set(range(cfg.num_hidden_layers))
    # Indexer keys in fp8 with a float32 scale (128 + 4 bytes; attention/v4_index_format.py), in the model dtype
    # (bf16 x index_head_dim 128) with "auto"; state fp32 either way (models/v4/cache_spec.py).
    ix = groups["csa_index"]
    assert (ix.bytes_per_token, ix.page_bytes, ix.tokens_per_page) == (132, 256 * 132, 256) and ix.layers == c4.layers
    auto = {g.name: g for g in v4_cache_groups(cfg, "auto", torch.bfloat16)}
    assert (auto["swa"].bytes_per_token, auto["swa"].page_bytes) == (1024, 256 * 1024)
    assert (auto["csa_index"].bytes_per_token, auto["csa_index"].page_bytes) == (256, 256 * 256)
    assert auto["csa_state"] == groups["csa_state"]
    # State rings: the 2m (CSA) / m (HCA) source positions a resuming forward reads, and 2 more an MTP verify's
    # rejected drafts may have written past them (models/v4/cache_spec.py: state_slots).
    assert groups["csa_state"].tokens_per_page == 10 and groups["hca_state"].tokens_per_page == 130
    # Pages one sequence touches per layer.
    assert swa.pages_for_tokens(100) == 1 and swa.pages_for_tokens(300) == 2 and swa.pages_for_tokens(512) == 1
    assert c4.pages_for_tokens(4 * 256) == 1 and c4.pages_for_tokens(4 * 256 + 4) == 2
    assert c128.pages_for_tokens(127) == 0 and groups["hca_state"].pages_for_tokens(0) == 1


def test_cache_group_validation():
    with pytest.raises(ValueError, match="kind must be one of"):
        CacheGroup("x", "paged", 1, 1, 1, (0,))
    with pytest.raises(ValueError, match="window is set for"):
        CacheGroup("x", "swa", 256, 584, 149_760, (0,))
    with pytest.raises(ValueError, match="page_bytes"):
        CacheGroup("x", "compressed", 256, 584, 100, (0,), ratio=4)
    with pytest.raises(ValueError, match="layers must be"):
        CacheGroup("x", "compressed", 256, 584, 149_760, (1, 0), ratio=4)
