"""`attention.v4_index_format`: DeepSeek-V4's fp8 indexer keys (fp8 bytes + one float32 power-of-two scale)."""

from __future__ import annotations

import pytest
import torch

from attention.v4_format import read_tokens, round_trip_v4, token_bytes_at, write_tokens
from attention.v4_index_format import V4IndexFormat


def test_geometry():
    f = V4IndexFormat()
    assert (f.head_dim, f.part_bytes, f.scale_bytes, f.bytes_per_token) == (128, 128, 4, 132)
    assert (f.scale_offset, f.page_bytes) == (256 * 128, 256 * 132) == (32_768, 33_792)
    assert f.describe() == "idxfp8[128]x132"
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError):
            V4IndexFormat(bad)


def test_round_trip_is_the_fp8_value_and_idempotent():
    f = V4IndexFormat(24)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 24, generator=g) * torch.logspace(-6, 3, 50)[:, None]  # keys of very different sizes
    x[3] = 0  # an all-zero key: zeros, a finite scale
    parts, scales = f.quantize(x)
    assert parts.dtype == scales.dtype == torch.uint8 and parts.shape == (50, 24) and scales.shape == (50, 4)
    scale = scales.view(torch.float32)[:, 0]
    assert torch.all(torch.log2(scale) == torch.round(torch.log2(scale)))  # powers of two
    want = parts.view(torch.float8_e4m3fn).float() * scale[:, None]
    got = f.dequantize(parts, scales)
    assert torch.equal(got, want) and torch.equal(got[3], torch.zeros(24)) and torch.isfinite(scale).all()
    # Close to the key: e4m3's 3 mantissa bits, relative to the key's largest value.
    assert ((got - x).abs().amax(dim=-1) <= x.abs().amax(dim=-1) * 2 ** -4 + 1e-30).all()
    # What a forward uses is what the cache gives back, and quantizing it again keeps its values.
    rt = round_trip_v4(x, f)
    assert torch.equal(rt, got) and torch.equal(round_trip_v4(rt, f), rt)
    with pytest.raises(ValueError, match=r"\[n, 24\]"):
        f.quantize(torch.zeros(2, 23))
    with pytest.raises(ValueError, match="parts"):
        f.dequantize(parts[:, :3], scales)


def test_page_bytes_are_keys_then_scales():
    f = V4IndexFormat(8, page_tokens=4)
    flat = torch.zeros(2 * f.page_bytes, dtype=torch.uint8)
    base = torch.tensor([f.page_bytes, 0, f.page_bytes])  # page 1, page 0, page 1
    off = torch.tensor([3, 0, 1])
    x = torch.randn(3, 8)
    write_tokens(flat, base, off, x, f)
    parts, scales = f.quantize(x)
    # By hand: page p's key i at p * page_bytes + i * 8, its scale at p * page_bytes + 4 * 8 + i * 4.
    assert torch.equal(flat[f.page_bytes + 24:f.page_bytes + 32], parts[0])
    assert torch.equal(flat[f.page_bytes + 32 + 12:f.page_bytes + 32 + 16], scales[0])
    assert torch.equal(flat[0:8], parts[1]) and torch.equal(flat[32:36], scales[1])
    part_at, scale_at = token_bytes_at(base, off, f)
    assert part_at.shape == (3, 8) and scale_at.shape == (3, 4)
    assert torch.equal(read_tokens(flat, base, off, f), f.dequantize(parts, scales))
    untouched = torch.ones_like(flat, dtype=torch.bool)
    untouched[part_at.reshape(-1)] = False
    untouched[scale_at.reshape(-1)] = False
    assert (flat[untouched] == 0).all()
