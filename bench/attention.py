#!/usr/bin/env python
"""Attention kernels of the ``cuda`` backend at DeepSeek-V3.2 shapes (issue 3).

Every figure is a ratio against something measured in the same run:

1. roofs: a device-to-device copy (bytes read + written / time) and a bf16
   matmul (``--mm`` cube, TFLOP/s);
2. indexer decode (``paged_mqa_logits`` = DeepGEMM + tail mask) at ``--batch``
   requests with contexts uniform in [context/2, 3*context/2], for each
   ``--next-n``: the key bytes it must read (sum of contexts x 132 B, once per
   request) plus the logits it writes, over its time, as a fraction of the
   copy bandwidth; then the Triton top-k (k = 2048) on those logits — the
   fused one-program-per-row kernel and the sampled kernels (a threshold from
   a sample, one compaction, the exact select of the candidates), checked
   equal bit for bit — vs ``torch.topk`` on the same logits, and the whole
   indexer step (logits + the backend's top-k, which takes the sampled
   kernels for long rows) over the logits alone; ``--sections topk`` compares
   the kernels alone and graph-replayed, for decode and prefill rows;
3. sparse prefill (``flash_mla_sparse_fwd``, h = 128 and 64, top-k 2048):
   ``2 * s * h * topk * (576 + 512)`` FLOP over its time, as a fraction of the
   bf16 matmul;
4. sparse decode (``flash_mla_with_kvcache`` on the fp8 pool): the 656-byte
   tokens it gathers over its time, vs the copy;
5. one attention layer's decode step through the backend (Triton cache writes,
   indexer logits, top-k, sparse decode, back to back) vs the sum of the
   same kernels timed alone.

``python bench/attention.py [--batch 128] [--context 32768] [--json out.json]``
(needs a GPU with flash_mla and deep_gemm). Times are medians of
``triton.testing.do_bench`` (L2 flushed between runs).
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

from attention.formats import PAGE_SIZE  # noqa: E402
from bench.cuda_profile import profile_calls  # noqa: E402

TOPK = 2048
H_INDEX, D_INDEX = 64, 128
INDEX_TOKEN_BYTES = 132
MLA_TOKEN_BYTES = 656


def bench(fn, rep_ms=200) -> float:
    """Median milliseconds of ``fn``."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def versions() -> dict:
    import triton

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton.__version__}
    for pkg in ("sgl-flash-mla", "sgl-deep-gemm"):
        try:
            from importlib.metadata import version

            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = "?"
    return out


def roofs(args) -> dict:
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 256)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    copy_gbs = 2 * n / t / 1e6
    del x, y
    m = args.mm
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = bench(lambda: a @ b)
    mm_tflops = 2 * m**3 / t / 1e9
    return {"copy_GBps": copy_gbs, "bf16_mm_TFLOPs": mm_tflops}


def _index_setup(B, context, next_n, gen):
    from attention.cuda.logits import indexer_context_lens
    from models.indexer import quantize_query_fp8

    seq = torch.randint(context // 2, 3 * context // 2 + 1, (B,), generator=gen)
    pages = [-(-int(s) // PAGE_SIZE) for s in seq]
    num_pages = sum(pages) + 8
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.zeros(B, max(pages), dtype=torch.int32)
    o = 0
    for b, p in enumerate(pages):
        bt[b, :p] = perm[o:o + p].to(torch.int32)
        o += p
    pool = torch.randint(0, 256, (num_pages, PAGE_SIZE * INDEX_TOKEN_BYTES), dtype=torch.uint8, device="cuda")
    keys = pool[:, : PAGE_SIZE * D_INDEX]
    keys[(keys & 0x7F) == 0x7F] = 0  # no NaN fp8 codes
    # valid scales (small positive floats) in each page's scale area
    pool[:, PAGE_SIZE * D_INDEX:] = (torch.rand(num_pages, PAGE_SIZE, device="cuda") * 0.01 + 1e-3).view(
        torch.uint8).view(num_pages, -1)
    q, qs = quantize_query_fp8(torch.randn(B * next_n, H_INDEX, D_INDEX, generator=gen))
    w = torch.randn(B * next_n, H_INDEX, generator=gen) * qs * 0.01
    ctx = indexer_context_lens(seq, next_n)
    return (q.view(B, next_n, H_INDEX, D_INDEX).cuda(), pool, w.cuda(), ctx.cuda(), bt.cuda(),
            int(seq.max()), int(seq.sum()))


def indexer_decode(args, roof, gen) -> list[dict]:
    from attention.cuda import backend as cb
    from attention.cuda import logits as cl
    from attention.cuda import topk as tk

    rows = []
    cases = [(n, "auto") for n in args.next_n] + [(n, "per_token") for n in args.next_n if n > 2]
    for next_n, mode in cases:
        q, pool, w, ctx, bt, max_len, total = _index_setup(args.batch, args.context, next_n, gen)
        B = args.batch
        plan = cl.paged_logits_layout(next_n, mode)
        logits = cl.paged_mqa_logits(q, pool, w, ctx, bt, max_len, layout=mode)
        t_logits = bench(lambda: cl.paged_mqa_logits(q, pool, w, ctx, bt, max_len, layout=mode))
        lengths = ctx.view(-1)
        bt_rows = bt.repeat_interleave(next_n, 0)
        cfg = cb.topk_launch_config(logits.shape[1])
        fused = tk.topk_slots(logits, lengths, TOPK, bt_rows, return_positions=True, method="fused", **cfg)
        sampled = tk.topk_slots_sampled(logits, lengths, TOPK, bt_rows, return_positions=True)
        sampled_ok = all(torch.equal(a, b) for a, b in zip(fused, sampled))
        t_topk = bench(lambda: tk.topk_slots(logits, lengths, TOPK, bt_rows, return_positions=True,
                                             method="fused", **cfg))
        t_sampled = bench(lambda: tk.topk_slots_sampled(logits, lengths, TOPK, bt_rows, return_positions=True))
        # The sampled top-k is four launches: alone and eager it may be bound by
        # host launch overhead; replayed from a CUDA graph (as decode runs it) it is not.
        graph = _graph_of(lambda: tk.topk_slots_sampled(logits, lengths, TOPK, bt_rows, return_positions=True))
        t_sampled_graph = bench(graph.replay)
        del graph
        t_backend_topk = bench(lambda: cb.topk_slots(logits, lengths, TOPK, bt_rows))
        t_torch_topk = bench(lambda: torch.topk(logits, TOPK, dim=1))
        t_step = bench(lambda: cb.topk_slots(cl.paged_mqa_logits(q, pool, w, ctx, bt, max_len, layout=mode),
                                             lengths, TOPK, bt_rows))
        if next_n == 1:
            res_topk = topk_tuning(logits, lengths, bt_rows, t_torch_topk)
        key_bytes = total * INDEX_TOKEN_BYTES  # each request's keys, read once
        logit_bytes = B * next_n * max_len * 4
        gbs = (key_bytes + logit_bytes) / t_logits / 1e6
        rows.append({
            "next_n": next_n, "layout": plan.name, "batch": B, "avg_context": total / B, "max_len": max_len,
            "logits_ms": t_logits, "logits_GBps": gbs, "logits_frac_of_copy": gbs / roof["copy_GBps"],
            "keys_read_x": plan.groups,
            "fused_topk_ms": t_topk, "sampled_topk_ms": t_sampled, "sampled_topk_graph_ms": t_sampled_graph,
            "sampled_equals_fused": sampled_ok,
            "sampled_speedup_vs_fused": t_topk / t_sampled_graph, "backend_topk_ms": t_backend_topk,
            "torch_topk_ms": t_torch_topk, "topk_speedup": t_torch_topk / t_topk,
            "indexer_step_ms": t_step, "step_over_logits": t_step / t_logits,
            "step_frac_of_copy": (key_bytes + logit_bytes) / t_step / 1e6 / roof["copy_GBps"],
        })
        del q, pool, w, logits
        torch.cuda.empty_cache()
    if 1 in args.next_n:
        rows.append({"topk_tuning": res_topk})
    return rows


def _kernel_times(fn, reps=20) -> dict:
    """Mean GPU microseconds per call of each kernel ``fn`` launches (torch.profiler)."""
    prof = profile_calls(fn, reps)
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0) > 0:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                out[e.key[:60]] = t / reps
    return out


def _graph_of(fn):
    """``fn`` captured in a CUDA graph (after one warm-up run on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def topk_tuning(logits, lengths, bt_rows, t_torch) -> list[dict]:
    """The fused top-k at several (block, num_warps) and the sampled top-k at several
    (seg, block, num_warps), vs torch.topk on the same logits."""
    from attention.cuda.topk import topk_slots, topk_slots_sampled

    out = []
    for block, warps in ((1024, 8), (2048, 8), (4096, 16)):
        try:
            t = bench(lambda: topk_slots(logits, lengths, TOPK, bt_rows, return_positions=True,
                                         block=block, num_warps=warps, method="fused"))
            out.append({"kernel": "fused", "block": block, "num_warps": warps, "ms": t, "vs_torch_topk": t / t_torch})
        except Exception as exc:  # a config that does not compile
            out.append({"kernel": "fused", "block": block, "num_warps": warps, "error": str(exc)[:200]})
    for seg, block, warps in ((2048, 2048, 8), (4096, 2048, 8), (8192, 4096, 8)):
        try:
            t = bench(lambda: topk_slots_sampled(logits, lengths, TOPK, bt_rows, return_positions=True,
                                                 seg=seg, block=block, num_warps=warps))
            out.append({"kernel": "sampled", "seg": seg, "block": block, "num_warps": warps, "ms": t,
                        "vs_torch_topk": t / t_torch})
        except Exception as exc:
            out.append({"kernel": "sampled", "seg": seg, "block": block, "num_warps": warps, "error": str(exc)[:200]})
    return out


def _prefill_index_inputs(args):
    """One prefill chunk's indexer inputs: ``--prefill-tokens`` causal rows at the
    end of a ``--prefill-kv``-token context -> (q [s, 64, 128], weights [s, 64],
    keys [s_kv, 128] f32, ks, ke int32 [s])."""
    s, s_kv = args.prefill_tokens, args.prefill_kv
    q_idx = torch.randn(s, H_INDEX, D_INDEX, device="cuda")
    w = torch.rand(s, H_INDEX, device="cuda")
    k_idx = torch.randn(s_kv, D_INDEX, device="cuda")
    ks = torch.zeros(s, dtype=torch.int32, device="cuda")
    ke = torch.arange(s_kv - s + 1, s_kv + 1, dtype=torch.int32, device="cuda")
    return q_idx, w, k_idx, ks, ke


def topk_compare(args, roof, gen) -> dict:
    """The three top-k kernels on the same logits, checked equal bit for bit:
    decode (next_n = 1 paged logits of ``--batch`` requests) and prefill
    (``--prefill-tokens`` causal rows at the end of ``--prefill-kv`` ragged
    logits). Decode also runs graph-replayed, alone and after the logits kernel
    (the indexer step as the captured decode step runs it), vs the logits alone."""
    from attention.cuda import logits as cl
    from attention.cuda import topk as tk

    out = {"decode": [], "prefill": []}
    q, pool, w, ctx, bt, max_len, total = _index_setup(args.batch, args.context, 1, gen)
    logits = cl.paged_mqa_logits(q, pool, w, ctx, bt, max_len)
    lengths = ctx.view(-1)
    want = tk.topk_slots(logits, lengths, TOPK, bt, return_positions=True, method="fused", block=4096, num_warps=16)

    def logits_fn():
        return cl.paged_mqa_logits(q, pool, w, ctx, bt, max_len)

    g_logits = _graph_of(logits_fn)
    t_logits_graph = bench(g_logits.replay)
    del g_logits
    kernels = [("fused 4096/16", lambda lg: tk.topk_slots(lg, lengths, TOPK, bt, return_positions=True,
                                                          method="fused", block=4096, num_warps=16))]
    for cfg in ({}, {"seg": 4096}, {"sample": 1024}, {"seg": 8192, "block": 4096}):
        kernels.append((f"sampled {cfg or 'default'}",
                        lambda lg, cfg=cfg: tk.topk_slots_sampled(lg, lengths, TOPK, bt, return_positions=True, **cfg)))
    for name, fn in kernels:
        row = {"kernel": name}
        try:
            got = fn(logits)
            row["equal_to_fused"] = all(torch.equal(a, b) for a, b in zip(got, want))
            row["eager_ms"] = bench(lambda: fn(logits))
            g = _graph_of(lambda: fn(logits))
            row["graph_ms"] = bench(g.replay)
            del g
            g = _graph_of(lambda: fn(logits_fn()))
            row["step_graph_ms"] = bench(g.replay)
            del g
            row["step_over_logits"] = row["step_graph_ms"] / t_logits_graph
        except Exception as exc:  # a config that does not compile must not cost the rest
            row["error"] = str(exc)[:300]
        out["decode"].append(row)
    for cfg in ({},):
        out.setdefault("decode_kernel_us", {})[str(cfg or "default")] = _kernel_times(
            lambda: tk.topk_slots_sampled(logits, lengths, TOPK, bt, return_positions=True, **cfg))
    pos = torch.empty(logits.shape[0], TOPK, dtype=torch.int32, device="cuda")
    thr, cnt = tk._launch_sampled(logits, lengths, TOPK, None, 1, None, pos)
    out["decode_fallback_rows"] = int(tk.sampled_fallback_rows(thr, cnt, TOPK, tk.SAMPLED_DEFAULTS["cap"]).sum())
    out["decode_candidates_mean"] = float(cnt.sum(1).float().mean())
    out["logits_graph_ms"] = t_logits_graph
    out["batch"], out["avg_context"] = args.batch, total / args.batch
    del q, pool, w, logits
    torch.cuda.empty_cache()

    # prefill: the logits of one ragged chunk (causal rows at the end of the context)
    s = args.prefill_tokens
    q_idx, wp, k_idx, ks, ke = _prefill_index_inputs(args)
    lg = cl.ragged_mqa_logits(q_idx, k_idx, None, wp, ks, ke)
    want = tk.topk_positions(lg, ke, TOPK, method="fused", block=2048, num_warps=8)
    for name, fn in (("fused 2048/8", lambda: tk.topk_positions(lg, ke, TOPK, method="fused", block=2048,
                                                                 num_warps=8)),
                     ("sampled (default)", lambda: tk.topk_positions_sampled(lg, ke, TOPK)),
                     ("sampled sample 1024", lambda: tk.topk_positions_sampled(lg, ke, TOPK, sample=1024)),
                     ("sampled seg 8192", lambda: tk.topk_positions_sampled(lg, ke, TOPK, seg=8192, block=4096)),
                     ("torch.topk", lambda: torch.topk(lg, TOPK, dim=1))):
        row = {"kernel": name}
        try:
            got = fn()
            if name != "torch.topk":
                row["equal_to_fused"] = bool(torch.equal(got, want))
            row["ms"] = bench(fn)
        except Exception as exc:
            row["error"] = str(exc)[:300]
        out["prefill"].append(row)
    pos = torch.empty(s, TOPK, dtype=torch.int32, device="cuda")
    thr, cnt = tk._launch_sampled(lg, ke, TOPK, None, 1, None, pos)
    out["prefill_fallback_rows"] = int(tk.sampled_fallback_rows(thr, cnt, TOPK, tk.SAMPLED_DEFAULTS["cap"]).sum())
    out["prefill_rows"] = s
    return out


def sparse_prefill(args, roof, gen) -> list[dict]:
    from attention.cuda import mla

    rows = []
    s, s_kv = args.prefill_tokens, args.prefill_kv
    kv = torch.randn(s_kv, 1, 576, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv, device="cuda")[:TOPK] for _ in range(64)]).to(torch.int32)
    idx = idx[torch.randint(0, 64, (s,), device="cuda")][:, None, :].contiguous()
    for h in (128, 64):
        q = torch.randn(s, h, 576, device="cuda", dtype=torch.bfloat16)
        scale = 576 ** -0.5
        t = bench(lambda: mla.sparse_mla_prefill(q, kv, idx, scale, 512))
        flop = 2 * s * h * TOPK * (576 + 512)
        tf = flop / t / 1e9
        rows.append({"s": s, "h": h, "s_kv": s_kv, "topk": TOPK, "ms": t, "TFLOPs": tf,
                     "frac_of_bf16_mm": tf / roof["bf16_mm_TFLOPs"]})
        del q
    return rows


def layer_prefill(args, roof, gen) -> dict:
    """One prefill chunk of an attention layer: ``s`` query rows at the end of an
    ``s_kv``-token context: indexer logits + top-k (``ragged_topk``, row chunks,
    float keys re-quantized as the model passes them) then sparse prefill, vs
    ``flash_mla_sparse_fwd`` alone on the same selection."""
    from attention.cuda import logits as lg
    from attention.cuda import mla

    s, s_kv = args.prefill_tokens, args.prefill_kv
    q_idx, w, k_idx, ks, ke = _prefill_index_inputs(args)
    q = torch.randn(s, 128, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, device="cuda", dtype=torch.bfloat16)
    scale = 576 ** -0.5
    # The two top-k kernels named explicitly (ragged_topk's default picks one of them).
    fused = {"method": "fused", "block": 2048, "num_warps": 8}
    sampled = {"method": "sampled"}
    pos, _ = lg.ragged_topk(q_idx, k_idx, None, w, ks, ke, TOPK, topk_config=fused)
    idx = pos[:, None, :].contiguous()

    def layer(cfg):
        p, _ = lg.ragged_topk(q_idx, k_idx, None, w, ks, ke, TOPK, topk_config=cfg)
        mla.sparse_mla_prefill(q, kv, p[:, None, :], scale, 512)

    t_logits = bench(lambda: lg.ragged_mqa_logits(q_idx, k_idx, None, w, ks, ke))
    t_index = bench(lambda: lg.ragged_topk(q_idx, k_idx, None, w, ks, ke, TOPK, topk_config=fused))
    t_index_sampled = bench(lambda: lg.ragged_topk(q_idx, k_idx, None, w, ks, ke, TOPK, topk_config=sampled))
    same = torch.equal(lg.ragged_topk(q_idx, k_idx, None, w, ks, ke, TOPK, topk_config=sampled)[0], pos)
    t_attn = bench(lambda: mla.sparse_mla_prefill(q, kv, idx, scale, 512))
    t_layer = bench(lambda: layer(fused))
    t_layer_sampled = bench(lambda: layer(sampled))
    flop = 2 * s * 128 * TOPK * (576 + 512)
    # The indexer's own FLOPs (fp8): each row's causal keys x 64 heads x 128 dims.
    idx_flop = 2 * int((ke - ks).sum()) * H_INDEX * D_INDEX
    best = min(t_layer, t_layer_sampled)
    return {"s": s, "s_kv": s_kv, "indexer_logits_ms": t_logits, "indexer_logits_topk_ms": t_index,
            "indexer_logits_topk_sampled_ms": t_index_sampled, "sampled_equals_fused": same,
            "sparse_prefill_ms": t_attn, "layer_ms": t_layer, "layer_sampled_ms": t_layer_sampled,
            "layer_TFLOPs": flop / best / 1e9,
            "sparse_prefill_TFLOPs": flop / t_attn / 1e9, "layer_over_sparse_prefill": t_attn / t_layer,
            "layer_sampled_over_sparse_prefill": t_attn / t_layer_sampled,
            "layer_all_flop_TFLOPs": (flop + idx_flop) / best / 1e9,
            "layer_all_flop_over_sparse_prefill": (flop + idx_flop) / best / (flop / t_attn)}


def _mla_cache(num_pages, device="cuda"):
    from attention.cache import CacheSpec, PagedKVCache

    spec = CacheSpec(num_layers=1, num_pages=num_pages, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                     kv_cache_dtype="fp8", dtype=torch.bfloat16)
    cache = PagedKVCache(spec, device)
    n = spec.num_slots
    for s0 in range(0, n, 1 << 20):
        sl = torch.arange(s0, min(n, s0 + (1 << 20)), device=device)
        cache.write_mla(0, sl, torch.randn(sl.numel(), 512, device=device), torch.randn(sl.numel(), 64, device=device))
        cache.write_index(0, sl, torch.randn(sl.numel(), 128, device=device))
    return cache


def sparse_decode(args, roof, gen, cache) -> list[dict]:
    from attention.cuda import mla

    rows = []
    B = args.batch
    for s_q, h in ((1, 128), (2, 128), (1, 64)):
        q = torch.randn(B, s_q, h, 576, device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(0, cache.spec.num_slots, (B, s_q, TOPK), device="cuda", dtype=torch.int32)
        t = bench(lambda: mla.sparse_mla_decode(q, cache, 0, idx, 576 ** -0.5, 512))
        gbs = B * s_q * TOPK * MLA_TOKEN_BYTES / t / 1e6
        tf = 2 * B * s_q * h * TOPK * (576 + 512) / t / 1e9
        rows.append({"batch": B, "s_q": s_q, "h": h, "topk": TOPK, "ms": t, "gather_GBps": gbs,
                     "frac_of_copy": gbs / roof["copy_GBps"], "TFLOPs": tf,
                     "frac_of_bf16_mm": tf / roof["bf16_mm_TFLOPs"]})
    return rows


def layer_step(args, roof, gen, cache) -> dict:
    """One attention layer's decode step through the backend vs its kernels timed alone."""
    from attention.cuda import backend as cb
    from attention.cuda import logits as cl
    from attention.cuda import mla

    B = args.batch
    # contexts live in the same pool as the MLA cache: reuse its index layer
    num_pages = cache.spec.num_pages
    seq = torch.randint(args.context // 2, 3 * args.context // 2 + 1, (B,), generator=gen)
    seq = seq.clamp(max=(num_pages // B) * PAGE_SIZE)
    per = num_pages // B
    bt = torch.randperm(num_pages, generator=gen)[: B * per].view(B, per).to(torch.int32).cuda()
    ctx = cl.indexer_context_lens(seq).cuda()
    max_len = int(seq.max())
    out_slots = (bt.long().gather(1, ((seq.cuda() - 1) // PAGE_SIZE)[:, None])[:, 0] * PAGE_SIZE
                 + (seq.cuda() - 1) % PAGE_SIZE)
    from models.indexer import quantize_query_fp8

    qi, qs = quantize_query_fp8(torch.randn(B, H_INDEX, D_INDEX, device="cuda"))
    w = torch.randn(B, H_INDEX, device="cuda") * qs * 0.01
    q = torch.randn(B, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    latent = torch.randn(B, 512, device="cuda", dtype=torch.bfloat16)
    rope = torch.randn(B, 64, device="cuda", dtype=torch.bfloat16)
    kidx = torch.randn(B, 128, device="cuda", dtype=torch.bfloat16)
    qi4 = qi.view(B, 1, H_INDEX, D_INDEX)

    def k_write():
        cb.write_mla(cache, 0, out_slots, latent, rope)
        cb.write_index(cache, 0, out_slots, kidx)

    logits = cl.paged_mqa_logits(qi4, cache.index[0], w, ctx, bt, max_len)
    slots = cb.topk_slots(logits, ctx.view(-1), TOPK, bt)[1].view(B, 1, TOPK)
    parts = {
        "cache_writes": bench(k_write),
        "indexer_logits": bench(lambda: cl.paged_mqa_logits(qi4, cache.index[0], w, ctx, bt, max_len)),
        "topk": bench(lambda: cb.topk_slots(logits, ctx.view(-1), TOPK, bt)),
        "sparse_decode": bench(lambda: mla.sparse_mla_decode(q, cache, 0, slots, 576 ** -0.5, 512)),
    }

    def step():
        k_write()
        lg = cl.paged_mqa_logits(qi4, cache.index[0], w, ctx, bt, max_len)
        sl = cb.topk_slots(lg, ctx.view(-1), TOPK, bt)[1].view(B, 1, TOPK)
        mla.sparse_mla_decode(q, cache, 0, sl, 576 ** -0.5, 512)

    t_step = bench(step)
    total = sum(parts.values())
    return {"batch": B, "avg_context": float(seq.float().mean()), **{f"{k}_ms": v for k, v in parts.items()},
            "sum_of_kernels_ms": total, "step_ms": t_step, "step_over_sum": t_step / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--next-n", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--prefill-kv", type=int, default=32768)
    ap.add_argument("--mm", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sections", default="indexer_decode,topk,sparse_prefill,sparse_decode,layer_step,layer_prefill",
                    help="comma-separated sections to run")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    res = {"versions": versions(), "args": vars(args)}
    print(json.dumps(res["versions"]))
    res["roofs"] = roof = roofs(args)
    print(f"roofs: copy {roof['copy_GBps']:.0f} GB/s, bf16 matmul {roof['bf16_mm_TFLOPs']:.0f} TFLOP/s")

    wanted = set(args.sections.split(","))

    def section(name, fn, *a):
        # one failing section must not cost the others (device time is scarce)
        if name not in wanted:
            res[name] = None
            return
        try:
            res[name] = fn(*a)
        except Exception:
            import traceback

            res[name] = None
            res.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"{name} FAILED:\n{traceback.format_exc()}")
        torch.cuda.empty_cache()

    section("indexer_decode", indexer_decode, args, roof, gen)
    section("topk", topk_compare, args, roof, gen)
    section("sparse_prefill", sparse_prefill, args, roof, gen)
    if wanted & {"sparse_decode", "layer_step"}:
        pages = args.batch * (-(-3 * args.context // 2 // PAGE_SIZE)) + 8
        cache = _mla_cache(pages)
        section("sparse_decode", sparse_decode, args, roof, gen, cache)
        section("layer_step", layer_step, args, roof, gen, cache)
        del cache
    section("layer_prefill", layer_prefill, args, roof, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    print("\nindexer decode (DeepGEMM paged logits + tail mask; top-k k=2048: fused = one program per row, "
          "sampled = threshold from a sample + compaction; step = logits + the backend's top-k, eager)")
    print("| next_n | layout | B | avg ctx | logits ms | GB/s | of copy | fused top-k ms | sampled top-k ms | "
          "sampled graph ms | sampled = fused | fused / sampled graph | torch.topk ms | step ms | step / logits | "
          "step of copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res.get("indexer_decode") or []:
        if "topk_tuning" in r:
            continue
        print(f"| {r['next_n']} | {r['layout']} | {r['batch']} | {r['avg_context']:.0f} | {r['logits_ms']:.3f} | "
              f"{r['logits_GBps']:.0f} | {r['logits_frac_of_copy']:.2f} | {r['fused_topk_ms']:.3f} | "
              f"{r['sampled_topk_ms']:.3f} | {r['sampled_topk_graph_ms']:.3f} | "
              f"{'yes' if r['sampled_equals_fused'] else '**NO**'} | "
              f"{r['sampled_speedup_vs_fused']:.2f} | {r['torch_topk_ms']:.3f} | {r['indexer_step_ms']:.3f} | "
              f"{r['step_over_logits']:.2f} | {r['step_frac_of_copy']:.2f} |")
    for r in res.get("indexer_decode") or []:
        if "topk_tuning" in r:
            print("\ntop-k configs (B x 1 rows of next_n=1 logits) -> ms (x torch.topk)")
            for t in r["topk_tuning"]:
                name = (f"fused {t['block']}/{t['num_warps']}" if t["kernel"] == "fused"
                        else f"sampled seg {t['seg']} block {t['block']}/{t['num_warps']}")
                print(f"  {name}: " + (f"{t['ms']:.3f} ({t['vs_torch_topk']:.2f})" if "ms" in t
                                        else "error " + t["error"]))
    tc = res.get("topk")
    if tc:
        print("\ntop-k kernels, decode (B=%d x next_n 1, avg ctx %.0f; logits alone graph-replayed %.3f ms; "
              "sampled: %d fallback rows, %.0f candidates per row)" % (tc["batch"], tc["avg_context"],
              tc["logits_graph_ms"], tc["decode_fallback_rows"], tc["decode_candidates_mean"]))
        print("| kernel | = fused | eager ms | graph ms | logits + top-k graph ms | step / logits |")
        print("|---|---|---|---|---|---|")
        for r in tc["decode"]:
            if "error" in r:
                print(f"| {r['kernel']} | error: {r['error'][:120]} |")
                continue
            print(f"| {r['kernel']} | {'yes' if r['equal_to_fused'] else '**NO**'} | {r['eager_ms']:.3f} | "
                  f"{r['graph_ms']:.3f} | {r['step_graph_ms']:.3f} | **{r['step_over_logits']:.2f}** |")
        for name, ks in (tc.get("decode_kernel_us") or {}).items():
            print(f"sampled {name}, kernels (us per call): " + ", ".join(f"{k} {v:.1f}" for k, v in ks.items()))
        print("\ntop-k kernels, prefill (%d rows, ragged causal logits; sampled: %d fallback rows)"
              % (tc["prefill_rows"], tc["prefill_fallback_rows"]))
        print("| kernel | = fused | ms |")
        print("|---|---|---|")
        for r in tc["prefill"]:
            eq = "" if "equal_to_fused" not in r else ("yes" if r["equal_to_fused"] else "**NO**")
            print(f"| {r['kernel']} | {eq} | " + (f"{r['ms']:.3f} |" if "ms" in r else f"error: {r['error'][:120]} |"))
    print("\nsparse prefill (flash_mla_sparse_fwd, top-k 2048)")
    print("| s | h | s_kv | ms | TFLOP/s | of bf16 matmul |")
    print("|---|---|---|---|---|---|")
    for r in res.get("sparse_prefill") or []:
        print(f"| {r['s']} | {r['h']} | {r['s_kv']} | {r['ms']:.3f} | {r['TFLOPs']:.0f} | {r['frac_of_bf16_mm']:.2f} |")
    print("\nsparse decode (flash_mla_with_kvcache, fp8 pool, top-k 2048)")
    print("| B | s_q | h | ms | gather GB/s | of copy | TFLOP/s | of bf16 matmul |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res.get("sparse_decode") or []:
        print(f"| {r['batch']} | {r['s_q']} | {r['h']} | {r['ms']:.3f} | {r['gather_GBps']:.0f} | "
              f"{r['frac_of_copy']:.2f} | {r['TFLOPs']:.0f} | {r['frac_of_bf16_mm']:.2f} |")
    ls = res.get("layer_step")
    if ls:
        print("\nattention layer decode step (B=%d, avg ctx %.0f)" % (ls["batch"], ls["avg_context"]))
        print(" | ".join(f"{k} {v:.3f}" for k, v in ls.items() if k.endswith("_ms")))
        print(f"step / sum of kernels = {ls['step_over_sum']:.2f}")
    lp = res.get("layer_prefill")
    if lp:
        print("\nattention layer prefill chunk (s=%d rows at the end of %d tokens, 128 heads, top-k %d)"
              % (lp["s"], lp["s_kv"], TOPK))
        print(" | ".join(f"{k} {v:.3f}" for k, v in lp.items() if k.endswith("_ms")))
        print(f"layer (fused top-k) / sparse prefill alone: {lp['layer_over_sparse_prefill']:.2f}; "
              f"(sampled top-k, {'same' if lp['sampled_equals_fused'] else '**DIFFERENT**'} selection): "
              f"**{lp['layer_sampled_over_sparse_prefill']:.2f}** (target >= 0.7)")
        print(f"counting the indexer's fp8 FLOPs too: layer {lp['layer_all_flop_TFLOPs']:.0f} TFLOP/s = "
              f"{lp['layer_all_flop_over_sparse_prefill']:.2f} of sparse prefill alone "
              f"({lp['sparse_prefill_TFLOPs']:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
