#!/usr/bin/env python
"""Do the cuda backend's decode kernels read cache pages at a stride other than the page size?

A cache with one region per layer (each page's MLA bytes then its indexer
bytes, 41,984 + 8,448 B for DeepSeek-V3.2) would halve the descriptors of a
KV push (docs/perf.md, session 4). Its per-kind views have a page stride of
50,432 B instead of their own page size. This probe runs DeepGEMM's
``fp8_paged_mqa_logits`` and FlashMLA's sparse fp8 decode through the
backend on the same bytes, stored contiguously and as such strided views,
and reports whether the outputs are bit-identical (or what raised).

GPU only: ``python bench/page_stride_probe.py``.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(ROOT, "bench")]

import torch  # noqa: E402

from tests.attention import test_cuda_backend as t  # noqa: E402  (its case builders)

MLA_B, IDX_B = 64 * 656, 64 * 132


def combined(n: int, dev) -> torch.Tensor:
    return torch.full((n, MLA_B + IDX_B), 0x7F, dtype=torch.uint8, device=dev)


def report(name: str, fn) -> None:
    try:
        print(f"{name}: {fn()}")
    except Exception as e:  # noqa: BLE001 - the point is to see what raises
        print(f"{name}: raised {type(e).__name__}: {str(e)[:300]}")


def main() -> int:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    be = t._be()

    # Indexer: paged logits over [P, 8448] pages, contiguous vs every page 50,432 B apart.
    P = 24 * 150 + 7
    cache = t._index_cache(P, gen, dev)
    buf = combined(P, dev)
    buf[:, MLA_B:] = cache.index[0]
    strided = buf[:, MLA_B:]
    assert strided.stride(0) == MLA_B + IDX_B and torch.equal(strided, cache.index[0])

    def logits():
        B, next_n = 24, 1
        seq = torch.randint(1, 9000, (B,), generator=gen)
        ctx = t.indexer_context_lens(seq, next_n).to(dev)
        bt = torch.randint(0, P, (B, -(-9000 // 64) + 2), generator=gen, dtype=torch.int32).to(dev)
        q, _ = t._fp8_queries((B, next_n, 64, 128), gen, dev)
        w = (torch.randn(B * next_n, 64, generator=gen) * 0.1).to(dev)
        a = be.paged_mqa_logits(q, cache.index[0], w, ctx, bt, 9037)
        b = be.paged_mqa_logits(q, strided, w, ctx, bt, 9037)
        fin = torch.isfinite(a)
        return (f"bit-identical={torch.equal(a, b)} max|diff| on finite="
                f"{float((a[fin] - b[fin]).abs().max()) if bool(fin.any()) else 0.0:.3e}")

    report("fp8_paged_mqa_logits, page stride 50432", logits)

    # MLA: sparse fp8 decode over [P, 64, 656] pages, contiguous vs strided.
    P2 = 400
    mcache = t._mla_cache(P2, gen, dev)
    mbuf = combined(P2, dev)
    mbuf[:, :MLA_B] = mcache.mla[1].view(P2, MLA_B)
    mstrided = mbuf[:, :MLA_B].view(P2, 64, 656)
    assert mstrided.stride(0) == MLA_B + IDX_B and torch.equal(mstrided, mcache.mla[1])

    def decode():
        out = []
        for b, s_q, h, topk in [(32, 1, 128, 2048), (8, 2, 64, 2048)]:
            q, idx = t._decode_case(dev, gen, mcache, b, s_q, h, topk)
            q, idx = q.to(dev), idx.to(dev)
            mcache.mla[1] = mcache.mla[1].contiguous()
            a, la = be.sparse_mla_decode(q, mcache, 1, idx, 576 ** -0.5, 512)
            keep = mcache.mla[1]
            mcache.mla[1] = mstrided
            try:
                bb, lb = be.sparse_mla_decode(q, mcache, 1, idx, 576 ** -0.5, 512)
            finally:
                mcache.mla[1] = keep
            out.append(f"b={b} s_q={s_q}: bit-identical={torch.equal(a, bb) and torch.equal(la, lb)} "
                       f"max|diff|={float((a.float() - bb.float()).abs().max()):.3e}")
        return "; ".join(out)

    report("flash_mla_with_kvcache sparse fp8, page stride 50432", decode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
