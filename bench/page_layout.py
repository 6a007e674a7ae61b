#!/usr/bin/env python
"""The decode kernels on a ``cross_layer`` cache vs a ``per_layer`` one (issue 4).

A ``cross_layer`` cache (`attention.cache.CacheSpec.page_layout`) keeps every
layer's bytes of a page id back to back, so a KV push moves a run of pages as
one descriptor instead of one per layer. The kernels then read each layer's
pages at a stride of the whole model's page (61 x 50,432 B = 3.08 MB for
DeepSeek-V3.2 instead of 50,432 B), and a realistic pool puts byte offsets
far beyond 2^31. This bench builds both caches at full size on the GPU with
the same random tokens in the same layer and page ids, then, per layout:

1. writes every slot of ``--layer`` through the Triton fp8 cache writes and
   checks the two layouts' page bytes equal (a wrong offset lands elsewhere);
2. gathers slots near the end of the pool with the Triton MLA dequant and
   indexer gather (the prefill path) and checks the outputs equal;
3. runs DeepGEMM's paged logits (+ tail mask) for ``--batch`` requests of
   ``--context`` tokens, each on a contiguous run of pages (what
   ``workers/page_pool.py`` hands out) spread over the pool, and FlashMLA's
   sparse fp8 decode over the top-k of those logits, checks bit-identical
   outputs, and times both layouts interleaved (medians of
   ``triton.testing.do_bench``): does the 3 MB page stride cost the kernels
   anything (e.g. TLB reach)?

GPU only: ``python bench/page_layout.py [--pages 9000] [--batch 64] [--context 32768]``.
"""

from __future__ import annotations

import os
import sys

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:] = [_ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != _BENCH]

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from attention.cache import PAGE_LAYOUTS, CacheSpec, PagedKVCache  # noqa: E402
from attention.formats import PAGE_SIZE, IndexerFp8Format, MlaFp8Format  # noqa: E402

TOPK = 2048
H_INDEX, D_INDEX = 64, 128


def bench(fn, rep_ms: int = 200) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def build(args) -> dict[str, PagedKVCache]:
    from attention.cuda import backend as cb

    caches = {}
    for layout in PAGE_LAYOUTS:
        spec = CacheSpec(num_layers=args.layers, num_pages=args.pages, kv_lora_rank=512, rope_dim=64,
                         index_head_dim=D_INDEX, kv_cache_dtype="fp8", dtype=torch.bfloat16, page_layout=layout)
        caches[layout] = PagedKVCache(spec, "cuda")
    n = args.pages * PAGE_SIZE
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    for s0 in range(0, n, 1 << 19):
        sl = torch.arange(s0, min(n, s0 + (1 << 19)), device="cuda")
        latent = torch.randn(sl.numel(), 512, device="cuda", generator=gen)
        rope = torch.randn(sl.numel(), 64, device="cuda", generator=gen)
        k = torch.randn(sl.numel(), D_INDEX, device="cuda", generator=gen)
        for cache in caches.values():
            cb.write_mla(cache, args.layer, sl, latent, rope)
            cb.write_index(cache, args.layer, sl, k)
    torch.cuda.synchronize()
    return caches


def check_bytes(args, caches) -> dict:
    from attention.cuda.dequant import dequantize_mla_fp8, gather_indexer_fp8

    a, b = caches["per_layer"], caches["cross_layer"]
    out = {"pages_equal": bool(torch.equal(a.pages[args.layer], b.pages[args.layer])),
           "other_layers_untouched": bool(all(not b.pages[lay].any() for lay in (0, args.layers // 2)
                                              if lay != args.layer))}
    last = b.pages[args.layer]
    out["max_byte_offset"] = (last[-1].data_ptr() + last.shape[1] - b.storage.data_ptr())
    n = args.pages * PAGE_SIZE
    slots = torch.cat([torch.arange(n - 4096, n), torch.randint(0, n, (4096,)), torch.tensor([-1])]).cuda()
    fmt, ifmt = MlaFp8Format(512, 64), IndexerFp8Format(D_INDEX)
    ga = dequantize_mla_fp8(a.mla[args.layer], slots, fmt)
    gb = dequantize_mla_fp8(b.mla[args.layer], slots, fmt)
    ka, sa = gather_indexer_fp8(a.index[args.layer], slots, ifmt)
    kb, sb = gather_indexer_fp8(b.index[args.layer], slots, ifmt)
    out["mla_gather_equal"] = bool(torch.equal(ga, gb))
    out["index_gather_equal"] = bool(torch.equal(ka.view(torch.uint8), kb.view(torch.uint8)) and torch.equal(sa, sb))
    # And against the cache's own torch read (the reference layout math).
    ref = b.read_mla(args.layer, slots[:64]).to(torch.bfloat16)
    out["mla_gather_equals_torch_read"] = bool(torch.equal(ga[:64], ref))
    return out


def decode(args, caches) -> dict:
    from attention.cuda import backend as cb
    from attention.cuda import logits as cl
    from attention.cuda import mla
    from models.indexer import quantize_query_fp8

    gen = torch.Generator().manual_seed(args.seed + 1)
    B, per = args.batch, -(-args.context // PAGE_SIZE)
    if B * per > args.pages:
        raise SystemExit(f"--batch {B} x {per} pages per request exceeds --pages {args.pages}")
    # Each request one contiguous run of pages; runs spread over the whole pool (last one at its end).
    starts = torch.linspace(0, args.pages - per, B).long()[torch.randperm(B, generator=gen)]
    bt = (starts[:, None] + torch.arange(per)[None, :]).to(torch.int32).cuda()
    seq = torch.randint(args.context // 2, args.context + 1, (B,), generator=gen)
    ctx = cl.indexer_context_lens(seq).cuda()
    max_len = int(seq.max())
    qi, qs = quantize_query_fp8(torch.randn(B, H_INDEX, D_INDEX, generator=gen).cuda())
    w = torch.randn(B, H_INDEX, generator=gen).cuda() * qs * 0.01
    qi4 = qi.view(B, 1, H_INDEX, D_INDEX)
    q = torch.randn(B, 1, 128, 576, generator=gen).to(torch.bfloat16).cuda()
    res = {"batch": B, "context": args.context, "pages_per_request": per}
    logits = {k: cl.paged_mqa_logits(qi4, c.index[args.layer], w, ctx, bt, max_len) for k, c in caches.items()}
    res["logits_equal"] = bool(torch.equal(logits["per_layer"], logits["cross_layer"]))
    slots = cb.topk_slots(logits["per_layer"], ctx.view(-1), TOPK, bt)[1].view(B, 1, TOPK)
    outs = {k: mla.sparse_mla_decode(q, c, args.layer, slots, 576 ** -0.5, 512) for k, c in caches.items()}
    res["decode_equal"] = bool(all(torch.equal(x, y) for x, y in zip(outs["per_layer"], outs["cross_layer"])))
    for rnd in range(args.rounds):  # interleaved: per_layer, cross_layer, per_layer, ...
        for k, c in caches.items():
            res.setdefault(f"{k}_logits_ms", []).append(
                bench(lambda c=c: cl.paged_mqa_logits(qi4, c.index[args.layer], w, ctx, bt, max_len)))
            res.setdefault(f"{k}_decode_ms", []).append(
                bench(lambda c=c: mla.sparse_mla_decode(q, c, args.layer, slots, 576 ** -0.5, 512)))
    for kind in ("logits", "decode"):
        pl, cl_ = res[f"per_layer_{kind}_ms"], res[f"cross_layer_{kind}_ms"]
        res[f"{kind}_cross_over_per"] = [y / x for x, y in zip(pl, cl_)]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--pages", type=int, default=9000, help="pages per cache (two caches are built)")
    ap.add_argument("--layer", type=int, default=None, help="layer exercised (default: the last)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.layer = args.layers - 1 if args.layer is None else args.layer
    caches = build(args)
    spec = caches["cross_layer"].spec
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
           "cross_layer_page_stride": caches["cross_layer"].mla[args.layer].stride(0),
           "per_layer_page_stride": caches["per_layer"].mla[args.layer].stride(0),
           "cache_gb_each": spec.num_pages * spec.page_bytes() / 1e9}
    res["bytes"] = check_bytes(args, caches)
    print(json.dumps(res, indent=1), flush=True)
    res["decode"] = decode(args, caches)
    print(json.dumps(res["decode"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    ok = all(res["bytes"][k] for k in ("pages_equal", "other_layers_untouched", "mla_gather_equal",
                                        "index_gather_equal", "mla_gather_equals_torch_read"))
    ok = ok and res["decode"]["logits_equal"] and res["decode"]["decode_equal"]
    print("all equal" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
