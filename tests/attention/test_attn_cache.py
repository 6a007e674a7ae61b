"""CacheSpec / PagedKVCache: geometry, scattered writes, reads, kernel views, regions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attention.cache import CacheRegion, CacheSpec, PagedKVCache
from attention.formats import (
    PAGE_SIZE,
    IndexerFp8Format,
    MlaFp8Format,
    dequantize_indexer_fp8,
    dequantize_mla_fp8,
    quantize_indexer_fp8,
    quantize_mla_fp8,
    unpack_indexer_page,
)


def spec(mode="fp8", dtype=torch.bfloat16, layers=3, pages=6, r=96, d=16, D=32, indexer_layers=None,
         layout="cross_layer"):
    return CacheSpec(
        num_layers=layers, num_pages=pages, kv_lora_rank=r, rope_dim=d, index_head_dim=D,
        kv_cache_dtype=mode, dtype=dtype, indexer_layers=indexer_layers, page_layout=layout,
    )


LAYOUTS = pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])


def scattered_slots(num_pages: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct slots spread over every page (including the first and last slot)."""
    last = num_pages * PAGE_SIZE - 1
    perm = torch.randperm(last - 1, generator=gen)[: n - 2] + 1  # from [1, last)
    return torch.cat([torch.tensor([0, last]), perm])


def fill_random_bytes(cache: PagedKVCache, gen: torch.Generator) -> None:
    """Fill every region with random (finite-decoding) bytes so that untouched bytes are recognisable."""
    for region in cache.regions():
        region.tensor.copy_(torch.randint(0, 256, region.tensor.shape, generator=gen, dtype=torch.uint8))
        # fp8 byte 0x7f / 0xff is NaN: keep it out so that reads stay finite (it is not what is tested).
        region.tensor[region.tensor == 0x7F] = 0x3F
        region.tensor[region.tensor == 0xFF] = 0xBF


# ----------------------------------------------------------------- spec


def test_spec_bytes_per_page_deepseek():
    s = spec("fp8", layers=2, pages=4, r=512, d=64, D=128)
    assert s.mla_bytes_per_page() == 64 * 656
    assert s.index_bytes_per_page() == 8448
    a = dataclasses.replace(s, kv_cache_dtype="auto")
    assert a.mla_bytes_per_page() == 64 * 576 * 2
    assert a.index_bytes_per_page() == 64 * 128 * 2
    f = dataclasses.replace(a, dtype=torch.float32)
    assert f.mla_bytes_per_page() == 64 * 576 * 4


def test_spec_defaults_and_normalisation():
    s = spec(layers=3)
    assert s.indexer_layers == (True, True, True)
    s2 = spec(layers=3, indexer_layers=[1, 0, True])
    assert s2.indexer_layers == (True, False, True)
    hash(s2)  # frozen and hashable (used as a compatibility key)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s2.num_pages = 3


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="bf16"),
        dict(mode="auto", dtype=torch.int8),
        dict(layers=0),
        dict(pages=0),
        dict(r=0),
        dict(d=-1),
        dict(D=0),
        dict(layers=2, indexer_layers=(True,)),
    ],
)
def test_spec_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        spec(**kwargs)


# ----------------------------------------------------------------- storage layout


@pytest.mark.parametrize("mode", ["fp8", "auto"])
def test_storage_shapes_and_kernel_views(mode):
    s = spec(mode, layers=2, pages=5, r=96, d=16, D=32, indexer_layers=(True, False))
    c = PagedKVCache(s)
    B = MlaFp8Format(96, 16).bytes_per_token
    if mode == "fp8":
        assert c.mla[0].shape == (5, 64, B) and c.mla[0].dtype == torch.uint8
        assert c.index[0].shape == (5, 64 * 36) and c.index[0].dtype == torch.uint8
        assert c.mla_view_for_kernel(1).shape == (5, 64, 1, B)
        assert c.index_view_for_kernel(0).shape == (5, 64, 1, 36)
    else:
        assert c.mla[0].shape == (5, 64, 112) and c.mla[0].dtype == torch.bfloat16
        assert c.index[0].shape == (5, 64, 32) and c.index[0].dtype == torch.bfloat16
        assert c.mla_view_for_kernel(1).shape == (5, 64, 1, 112)
        assert c.index_view_for_kernel(0).shape == (5, 64, 1, 32)
    assert c.index[1] is None
    # views alias the storage
    assert c.mla_view_for_kernel(0).data_ptr() == c.mla[0].data_ptr()
    assert c.index_view_for_kernel(0).data_ptr() == c.index[0].data_ptr()
    with pytest.raises(ValueError, match="indexer"):
        c.write_index(1, torch.tensor([0]), torch.zeros(1, 32))
    with pytest.raises(ValueError, match="indexer"):
        c.read_index(1, torch.tensor([0]))
    with pytest.raises(ValueError, match="indexer"):
        c.index_view_for_kernel(1)
    with pytest.raises(IndexError):
        c.read_mla(2, torch.tensor([0]))


# ----------------------------------------------------------------- MLA write / read


@LAYOUTS
@pytest.mark.parametrize("r,d", [(512, 64), (96, 16), (32, 8)])
def test_fp8_write_mla_touches_only_its_slots(r, d, layout, gen):
    s = spec("fp8", layers=2, pages=7, r=r, d=d, D=32, layout=layout)
    c = PagedKVCache(s)
    fill_random_bytes(c, gen)
    before = [page.clone() for page in c.pages]
    mla_before, index_before = c.mla[1].clone(), c.index[1].clone()
    n = 40
    slots = scattered_slots(7, n, gen)
    latent = torch.randn(n, r, generator=gen) * 3
    rope = torch.randn(n, d, generator=gen)
    c.write_mla(1, slots, latent.bfloat16(), rope)

    fmt = MlaFp8Format(r, d)
    expect = quantize_mla_fp8(latent.bfloat16(), rope, fmt)
    rows = c.mla[1].reshape(-1, fmt.bytes_per_token)  # a copy: the pages are strided
    assert torch.equal(rows[slots], expect)
    touched = torch.zeros(7 * 64, dtype=torch.bool)
    touched[slots] = True
    assert torch.equal(rows[~touched], mla_before.reshape(-1, fmt.bytes_per_token)[~touched])
    # The indexer bytes sharing those pages, and every other layer, are untouched.
    assert torch.equal(c.index[1], index_before) and torch.equal(c.pages[0], before[0])

    got = c.read_mla(1, slots)
    lat_q, rope_q = dequantize_mla_fp8(expect, fmt)
    assert got.dtype == torch.float32 and got.shape == (n, r + d)
    assert torch.equal(got, torch.cat([lat_q, rope_q], 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_write_mla_exact_in_dtype(dtype, gen):
    s = spec("auto", dtype=dtype, layers=2, pages=4, r=96, d=16)
    c = PagedKVCache(s)
    fill_random_bytes(c, gen)
    other = c.mla[0].clone()
    n = 30
    slots = scattered_slots(4, n, gen)
    latent, rope = torch.randn(n, 96, generator=gen), torch.randn(n, 16, generator=gen)
    c.write_mla(1, slots, latent, rope)
    got = c.read_mla(1, slots)
    assert torch.equal(got, torch.cat([latent, rope], 1).to(dtype).float())
    assert torch.equal(c.mla[0], other)


@LAYOUTS
@pytest.mark.parametrize("mode", ["fp8", "auto"])
def test_invalid_slots(mode, layout, gen):
    c = PagedKVCache(spec(mode, pages=2, layout=layout))
    latent, rope = torch.randn(3, 96, generator=gen), torch.randn(3, 16, generator=gen)
    raw_before = [page.clone() for page in c.pages]
    # -1 = padding: write skips it, read yields zeros
    c.write_mla(0, torch.tensor([-1, 5, -1]), latent, rope)
    got = c.read_mla(0, torch.tensor([-1, 5, -1, 6]))
    assert torch.equal(got[0], torch.zeros(112)) and torch.equal(got[2], torch.zeros(112))
    assert got[1].abs().sum() > 0 and torch.equal(got[3], torch.zeros(112))  # 6 never written
    c.write_index(0, torch.tensor([-1, 5, -1]), torch.randn(3, 32, generator=gen))
    assert torch.equal(c.read_index(0, torch.tensor([-1]))[0], torch.zeros(32))
    changed = [not torch.equal(page, b) for page, b in zip(c.pages, raw_before)]
    assert changed == [True] + [False] * (len(changed) - 1)  # layer 0's pages only
    for bad in ([128], [-2], [0, 1000]):
        with pytest.raises(IndexError):
            c.read_mla(0, torch.tensor(bad))
        with pytest.raises(IndexError):
            c.write_mla(0, torch.tensor(bad), latent[: len(bad)], rope[: len(bad)])
        with pytest.raises(IndexError):
            c.read_index(0, torch.tensor(bad))
    with pytest.raises(ValueError):
        c.write_mla(0, torch.tensor([0, 1]), latent, rope)  # 2 slots, 3 tokens


# ----------------------------------------------------------------- index write / read


@LAYOUTS
@pytest.mark.parametrize("D", [128, 32])
def test_fp8_write_index_layout_and_isolation(D, layout, gen):
    s = spec("fp8", layers=2, pages=5, D=D, layout=layout)
    c = PagedKVCache(s)
    fill_random_bytes(c, gen)
    before = [page.clone() for page in c.pages]
    index_before, mla_before = c.index[0].clone(), c.mla[0].clone()
    n = 50
    slots = scattered_slots(5, n, gen)
    k = torch.randn(n, D, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    c.write_index(0, slots, k)

    k_fp8, scale = quantize_indexer_fp8(k)
    pages_fp8, pages_scale = unpack_indexer_page(c.index[0], IndexerFp8Format(D))
    page, off = slots // 64, slots % 64
    assert torch.equal(pages_fp8[page, off].view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(pages_scale[page, off], scale)
    # Untouched tokens keep their key bytes and their scale bytes.
    old_fp8, old_scale = unpack_indexer_page(index_before, IndexerFp8Format(D))
    touched = torch.zeros(5, 64, dtype=torch.bool)
    touched[page, off] = True
    assert torch.equal(pages_fp8[~touched].view(torch.uint8), old_fp8[~touched].view(torch.uint8))
    assert torch.equal(pages_scale[~touched].view(torch.int32), old_scale[~touched].view(torch.int32))
    # The MLA bytes sharing those pages, and every other layer, are untouched.
    assert torch.equal(c.mla[0], mla_before) and torch.equal(c.pages[1], before[1])
    assert torch.equal(c.read_index(0, slots), dequantize_indexer_fp8(k_fp8, scale))


def test_auto_write_index(gen):
    c = PagedKVCache(spec("auto", dtype=torch.float32, pages=3, D=32))
    slots = scattered_slots(3, 20, gen)
    k = torch.randn(20, 32, generator=gen)
    c.write_index(2, slots, k)
    assert torch.equal(c.read_index(2, slots), k)
    assert torch.equal(c.index_view_for_kernel(2)[slots // 64, slots % 64, 0], k)


# ----------------------------------------------------------------- regions


@pytest.mark.parametrize("mode", ["fp8", "auto"])
def test_regions_describe_every_page(mode, gen):
    s = spec(mode, layers=3, pages=4, indexer_layers=(True, False, True), layout="per_layer")
    c = PagedKVCache(s)
    regs = c.regions()
    M, I = s.mla_bytes_per_page(), s.index_bytes_per_page()
    # One region per layer: a page is the layer's MLA bytes, then its indexer bytes (if it has an indexer).
    assert [(r.layer, r.kind) for r in regs] == [(0, "kv"), (1, "kv"), (2, "kv")]
    for reg in regs:
        assert isinstance(reg, CacheRegion)
        assert reg.num_pages == 4 and reg.tensor.dtype == torch.uint8 and reg.tensor.is_contiguous()
        expect = M + (I if reg.layer != 1 else 0)
        assert reg.bytes_per_page == expect and reg.tensor.shape == (4, expect)
        assert reg.nbytes == reg.tensor.nbytes
        mla = c.mla[reg.layer]
        assert mla.data_ptr() == reg.tensor.data_ptr() and mla.stride(0) * mla.element_size() == expect
        if reg.layer != 1:
            assert c.index[reg.layer].data_ptr() == reg.tensor.data_ptr() + M
    # A token written to slot 2*64+5 changes page 2 of its layer's region only.
    c.write_mla(2, torch.tensor([2 * 64 + 5]), torch.randn(1, 96, generator=gen) + 1, torch.randn(1, 16, generator=gen))
    c.write_index(2, torch.tensor([2 * 64 + 5]), torch.randn(1, 32, generator=gen) + 1)
    for reg in c.regions():
        nonzero_pages = (reg.tensor != 0).any(dim=1).nonzero().flatten().tolist()
        assert nonzero_pages == ([2] if reg.layer == 2 else []), (reg.layer, reg.kind)
        if reg.layer == 2:  # both kinds landed in the page
            assert bool(reg.tensor[2, :M].any()) and bool(reg.tensor[2, M:].any())
    # Copying a page's bytes between two caches moves the token (what a transfer does).
    c2 = PagedKVCache(s)
    for dst, src in zip(c2.regions(), c.regions()):
        dst.tensor[1].copy_(src.tensor[2])
    assert torch.equal(c2.read_mla(2, torch.tensor([64 + 5])), c.read_mla(2, torch.tensor([2 * 64 + 5])))
    assert torch.equal(c2.read_index(2, torch.tensor([64 + 5])), c.read_index(2, torch.tensor([2 * 64 + 5])))


@pytest.mark.parametrize("mode", ["fp8", "auto"])
def test_cross_layer_region_holds_every_layer_of_a_page(mode, gen):
    s = spec(mode, layers=3, pages=4, indexer_layers=(True, False, True))
    c = PagedKVCache(s)
    M, I = s.mla_bytes_per_page(), s.index_bytes_per_page()
    widths = [M + I, M, M + I]
    assert s.layer_page_bytes() == tuple(widths)
    (reg,) = c.regions()
    # One region: page p is every layer's page p back to back (a run of pages is one descriptor).
    assert (reg.layer, reg.kind, reg.num_pages, reg.bytes_per_page) == (-1, "kv", 4, sum(widths))
    assert reg.tensor.is_contiguous() and reg.tensor.shape == (4, sum(widths)) and reg.nbytes == reg.tensor.nbytes
    starts = [0, widths[0], widths[0] + widths[1]]
    for layer in range(3):
        mla = c.mla[layer]
        assert mla.data_ptr() == reg.tensor.data_ptr() + starts[layer]
        assert mla.stride(0) * mla.element_size() == sum(widths)  # the kernels read at the whole page's stride
        if layer != 1:
            assert c.index[layer].data_ptr() == reg.tensor.data_ptr() + starts[layer] + M
    # A token of layer 2 at slot 2*64+5 lands in page 2, within layer 2's bytes only.
    c.write_mla(2, torch.tensor([2 * 64 + 5]), torch.randn(1, 96, generator=gen) + 1, torch.randn(1, 16, generator=gen))
    c.write_index(2, torch.tensor([2 * 64 + 5]), torch.randn(1, 32, generator=gen) + 1)
    assert (reg.tensor != 0).any(dim=1).nonzero().flatten().tolist() == [2]
    assert not reg.tensor[2, : starts[2]].any() and bool(reg.tensor[2, starts[2]:starts[2] + M].any())
    assert bool(reg.tensor[2, starts[2] + M:].any())
    # Copying one page's bytes between two caches moves every layer's tokens of that page.
    c2 = PagedKVCache(s)
    c2.regions()[0].tensor[1].copy_(reg.tensor[2])
    assert torch.equal(c2.read_mla(2, torch.tensor([64 + 5])), c.read_mla(2, torch.tensor([2 * 64 + 5])))
    assert torch.equal(c2.read_index(2, torch.tensor([64 + 5])), c.read_index(2, torch.tensor([2 * 64 + 5])))


@pytest.mark.parametrize("mode", ["fp8", "auto"])
def test_layouts_store_the_same_tokens(mode, gen):
    """Both page layouts read back exactly what was written, per layer, with and without indexers."""
    caches = {lay: PagedKVCache(spec(mode, layers=3, pages=3, indexer_layers=(True, False, True), layout=lay))
              for lay in ("cross_layer", "per_layer")}
    slots = scattered_slots(3, 60, gen)
    for layer in range(3):
        latent, rope = torch.randn(60, 96, generator=gen), torch.randn(60, 16, generator=gen)
        k = torch.randn(60, 32, generator=gen)
        for c in caches.values():
            c.write_mla(layer, slots, latent, rope)
            if layer != 1:
                c.write_index(layer, slots, k)
    a, b = caches["cross_layer"], caches["per_layer"]
    for layer in range(3):
        assert torch.equal(a.pages[layer], b.pages[layer])
        assert torch.equal(a.read_mla(layer, slots), b.read_mla(layer, slots))
        if layer != 1:
            assert torch.equal(a.read_index(layer, slots), b.read_index(layer, slots))
            assert torch.equal(a.index_view_for_kernel(layer), b.index_view_for_kernel(layer))


def test_transfer_formats_name_the_layout():
    fp8 = spec("fp8", r=512, d=64, D=128)
    assert fp8.transfer_formats() == ("fp8_mla_656+index/cross_layer", "fp8_index_132")
    assert dataclasses.replace(fp8, page_layout="per_layer").transfer_formats()[0] == "fp8_mla_656+index/per_layer"
    assert spec("auto", dtype=torch.float32).transfer_formats() == ("fp32_mla_112+index/cross_layer", "fp32_index_32")
    with pytest.raises(ValueError, match="page_layout"):
        spec(layout="page_major")
