"""DeepSeek-V4 sparse decode over the paged caches (``attention.cuda.v4_decode.v4_sparse_decode``) against
the reference's decode attention: per query, the keys the reference model gathers into its workspace
(``models.v4.attention.V4Attention._sequence``: compressed entries, then the window), read back from the
same pages (``GroupedPagedCache.read``, dequantized) and attended by ``attention.v4_attention.
sparse_attention_with_sink`` over a combined index row.

Fresh random pages of every layer kind (sliding-window only; CSA: top-k entries of a c4 cache + window;
HCA: every complete c128 entry + window), in real V4 geometry (584-byte tokens, 256-token pages, window
128), several requests whose contexts cross windows, compressed blocks and pages, page ids shuffled.

* CPU (CI): on ``cuda_fakes``' ``flash_mla_with_kvcache(..., kv_format="V4")``, which asserts the kernel's
  contract (bf16 q of 512 with 64 / 128 heads, uint8 (P, 256, 1, 584) caches, int32 indices padded to a
  multiple of 64 with ``-1``, no index outside the pool, int32 lengths per batch row, f32 sink, metadata
  reused only with equal shapes and lengths) and reads each token's bytes at the kernel's own offsets;
* ``gpu``: the same comparison on the real kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from attention.cache_groups import CacheGroup
from attention.group_cache import GroupedPagedCache, GroupLayout, V4Source, padded_tables
from attention.v4_attention import combined_index_row
from attention.v4_attention import sparse_attention_with_sink as reference
from attention.v4_format import V4CacheFormat
from models.v4.paged_decode import causal_entries, window_positions

SEED = random.randrange(1 << 30)
FMT = V4CacheFormat()
WINDOW, C4, C128, TOPK = 128, 4, 128, 64
SWA_LAYERS, CSA_LAYERS, HCA_LAYERS = (0, 1, 2, 3), (1, 3), (2,)


def _cache(num_pages: int, device) -> GroupedPagedCache:
    def group(name, kind, layers, **kw):
        return GroupLayout(CacheGroup(name, kind, 256, FMT.bytes_per_token, FMT.page_bytes, layers, **kw),
                           torch.uint8, FMT.head_dim, FMT)

    layouts = [group("swa", "swa", SWA_LAYERS, window=WINDOW), group("csa_kv", "compressed", CSA_LAYERS, ratio=C4),
               group("hca_kv", "compressed", HCA_LAYERS, ratio=C128)]
    return GroupedPagedCache(layouts, {lay.name: num_pages for lay in layouts}, device)


def _fill(cache, gen, lengths):
    """Random keys at every position of every request; pages drawn from the pool, shuffled."""
    pages = []
    free = {g: torch.randperm(cache.num_pages[g], generator=gen).tolist() for g in cache.layouts}
    for n in lengths:
        sizes = {"swa": n, "csa_kv": n // C4, "hca_kv": n // C128}
        table = {g: [free[g].pop() for _ in range(max(1, -(-k // 256)))] for g, k in sizes.items()}
        for g, k in sizes.items():
            for layer in (cache.layouts[g].group.layers if k else ()):
                x = torch.randn(k, FMT.head_dim, generator=gen) * 2
                cache.write(g, layer, table[g], torch.arange(k), x.to(cache.device))
        pages.append(table)
    return pages


def _queries(lengths, width):
    """The last ``width`` positions of each request (an MTP verify's rows when width > 1)."""
    rows = torch.tensor([r for r, _ in enumerate(lengths) for _ in range(width)])
    pos = torch.tensor([n - width + j for n in lengths for j in range(width)])
    return rows, pos


def _topk(gen, pos):
    """An indexer-like selection per query: up to TOPK distinct complete c4 entries, -1 holes anywhere."""
    out = torch.full((pos.shape[0], TOPK), -1, dtype=torch.long)
    for t, p in enumerate(pos.tolist()):
        n = (p + 1) // C4
        pick = torch.randperm(n, generator=gen)[:TOPK]
        out[t, :pick.numel()] = pick
        out[t, torch.rand(TOPK, generator=gen) < 0.2] = -1  # holes even where there are TOPK entries
        out[t] = out[t][torch.randperm(TOPK, generator=gen)]  # -1 interleaved: the wrapper moves them back
    return out


def _reference(cache, layer, kind, q, pages, rows, pos, comp, sink, scale):
    """The reference model's attention of each query: [entries | window] workspace, combined index row."""
    out = []
    for t in range(q.shape[0]):
        table = pages[int(rows[t])]
        p = int(pos[t])
        win = window_positions(pos[t:t + 1], WINDOW)  # positions p, p - 1, ... (-1 before 0)
        keys = cache.read("swa", layer, table["swa"], torch.arange(p + 1))
        if kind == "sliding":
            ws, c = keys, torch.zeros(1, 0, dtype=torch.long)
            row = combined_index_row(c, win, 0, 0)
        else:
            group = "csa_kv" if kind == "csa" else "hca_kv"
            m = C4 if kind == "csa" else C128
            entries = cache.read(group, layer, table[group], torch.arange((p + 1) // m))
            ws = torch.cat([entries, keys])
            row = combined_index_row(comp[t:t + 1], win, 0, entries.shape[0])
        out.append(reference(q[t:t + 1], ws, row.to(q.device), sink, scale))
    return torch.cat(out)


def _check(kind, lengths, width, H, device, gen):
    from attention.cuda.v4_decode import v4_sparse_decode

    cache = _cache(12, device)
    pages = _fill(cache, gen, lengths)
    rows, pos = _queries(lengths, width)
    q = torch.randn(pos.shape[0], H, 512, generator=gen).to(torch.bfloat16).float()
    sink = torch.randn(H, generator=gen)
    scale = 512 ** -0.5
    layer = {"sliding": 0, "csa": 3, "hca": 2}[kind]  # csa layer 3: the second layer of its group's pages
    tables = {g: padded_tables([p[g] for p in pages], device) for g in cache.layouts}
    swa = V4Source("swa", tables["swa"], window_positions(pos, WINDOW).to(device))
    comp = None
    if kind == "sliding":
        main, extra = swa, None
    elif kind == "csa":
        comp = _topk(gen, pos)
        main, extra = V4Source("csa_kv", tables["csa_kv"], comp.to(device)), swa
    else:
        comp = causal_entries(pos, C128, max(lengths) // C128)
        main, extra = V4Source("hca_kv", tables["hca_kv"], comp.to(device)), swa
    got = v4_sparse_decode(q.to(device), cache, layer, main, extra, rows.to(device), sink.to(device), scale)
    want = _reference(cache, layer, kind, q.to(device), pages, rows, pos, comp, sink.to(device), scale)
    assert got.dtype == torch.bfloat16 and got.shape == (pos.shape[0], H, 512)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=f"V4_DECODE_SEED={SEED}")


CASES = [  # (kind, request lengths, queries per request, heads)
    ("sliding", [1, 130, 700], 1, 64),     # a first token; a window crossing position 0; one crossing a page
    ("csa", [3, 41, 300, 1000], 1, 64),    # no entry yet; 10 entries; top-64 of 75 / 250; window across pages
    ("hca", [127, 128, 900], 1, 128),      # no entry; the first entry; 7 entries of the longest request
    ("csa", [260, 611], 3, 16),            # an MTP verify (3 rows a request), 16 heads padded to 64
    ("hca", [255, 257, 513], 2, 64),
]


@pytest.mark.parametrize("kind,lengths,width,H", CASES)
def test_v4_decode_matches_reference_on_fakes(cuda_fake_kernels, kind, lengths, width, H):
    _check(kind, lengths, width, H, "cpu", torch.Generator().manual_seed(SEED))
    assert cuda_fake_kernels.CALLS["flash_mla_with_kvcache[V4]"] == 1


def test_v4_decode_positions_past_the_table_read_nothing(cuda_fake_kernels):
    """A position beyond a request's pages (or negative) is -1 for the kernel, never an out-of-pool read."""
    from attention.cuda.v4_decode import v4_sparse_decode

    gen = torch.Generator().manual_seed(SEED)
    cache = _cache(4, "cpu")
    pages = _fill(cache, gen, [40])
    tables = {g: padded_tables([p[g] for p in pages], "cpu") for g in cache.layouts}
    q, sink, rows = torch.randn(1, 64, 512, generator=gen), torch.zeros(64), torch.zeros(1, dtype=torch.long)
    good = window_positions(torch.tensor([39]), WINDOW)
    bad = good.clone()
    bad[0, 50:60] = 256 * 5  # past the request's one page (and the pool)
    got = v4_sparse_decode(q, cache, 0, V4Source("swa", tables["swa"], bad), None, rows, sink, 0.05)
    want = v4_sparse_decode(q, cache, 0, V4Source("swa", tables["swa"], good), None, rows, sink, 0.05)
    assert torch.equal(got, want)
    # A table naming a page the pool does not have (a caller's bug): its slots become -1 on the device
    # (the stand-in, like the kernel's contract, refuses an index past the pool).
    broken = tables["swa"].clone()
    broken[0, 0] = cache.num_pages["swa"] + 3
    alone = torch.tensor([[39] + [-1] * (good.shape[1] - 1)])  # the query's own key only: then nothing at all
    out = v4_sparse_decode(q, cache, 0, V4Source("swa", broken, alone), None, rows, sink, 0.05)
    assert torch.equal(out, torch.zeros_like(out))


def test_write_rows_is_write_per_sequence():
    """The batched key write of a decode step stores what `write` stores, sequence by sequence."""
    gen = torch.Generator().manual_seed(SEED)
    one, many = _cache(6, "cpu"), _cache(6, "cpu")
    pages = [{"swa": [4, 1]}, {"swa": [0]}, {"swa": [5, 2, 3]}]
    pos = torch.tensor([300, 301, 7, 700, 511])
    rows = torch.tensor([0, 0, 1, 2, 2])
    x = torch.randn(5, FMT.head_dim, generator=gen)
    for i in range(5):
        one.write("swa", 2, pages[int(rows[i])]["swa"], pos[i:i + 1], x[i:i + 1])
    many.write_rows("swa", 2, padded_tables([p["swa"] for p in pages], "cpu"), rows, pos, x)
    assert torch.equal(one.buffer, many.buffer) and bool(one.buffer.any())


def test_v4_decode_metadata_is_reused_only_with_equal_lengths(cuda_fake_kernels):
    """The stand-in refuses what the real kernel silently gets wrong: one metadata, other lengths."""
    from attention.cuda.v4_decode import new_meta, v4_sparse_decode

    gen = torch.Generator().manual_seed(SEED)
    cache = _cache(4, "cpu")
    pages = _fill(cache, gen, [40, 90])
    tables = {g: padded_tables([p[g] for p in pages], "cpu") for g in cache.layouts}
    q, sink, rows = torch.randn(2, 64, 512, generator=gen), torch.zeros(64), torch.arange(2)
    meta = new_meta()
    src = V4Source("swa", tables["swa"], window_positions(torch.tensor([39, 89]), WINDOW))
    v4_sparse_decode(q, cache, 0, src, None, rows, sink, 0.05, meta=meta)
    v4_sparse_decode(q, cache, 1, src, None, rows, sink, 0.05, meta=meta)  # another layer, same lengths: fine
    later = V4Source("swa", tables["swa"], window_positions(torch.tensor([10, 89]), WINDOW))
    with pytest.raises(AssertionError, match="other topk_length"):
        v4_sparse_decode(q, cache, 0, later, None, rows, sink, 0.05, meta=meta)


def test_v4_decode_refuses_what_it_cannot_run(cuda_fake_kernels):
    from attention.cuda.v4_decode import v4_sparse_decode

    cache = _cache(2, "cpu")
    src = V4Source("swa", torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    rows = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"q \[n, H, 512\]"):
        v4_sparse_decode(torch.zeros(1, 64, 576), cache, 0, src, None, rows, torch.zeros(64), 1.0)
    with pytest.raises(ValueError, match="at most 128 query heads"):
        v4_sparse_decode(torch.zeros(1, 256, 512), cache, 0, src, None, rows, torch.zeros(256), 1.0)
    auto = GroupedPagedCache([GroupLayout(CacheGroup("swa", "swa", 256, 1024, 256 * 1024, (0,), window=WINDOW),
                                          torch.bfloat16, 512)], {"swa": 2}, "cpu")
    with pytest.raises(ValueError, match="not stored in the V4 fp8 token format"):
        v4_sparse_decode(torch.zeros(1, 64, 512), auto, 0, src, None, rows, torch.zeros(64), 1.0)
    assert "flash_mla_with_kvcache" not in cuda_fake_kernels.CALLS


@pytest.mark.gpu
@pytest.mark.parametrize("kind,lengths,width,H", CASES)
def test_v4_decode_matches_reference_gpu(kind, lengths, width, H):
    _check(kind, lengths, width, H, "cuda", torch.Generator().manual_seed(SEED))
