"""The ``cuda`` attention backend vs the ``reference`` backend.

Three layers of tests:

* host-side helpers (no kernels, CI): the one context-length helper for every
  forward mode, the paged-logits layout plan, the ragged chunk planner;
* ``test_*_fakes`` (CI): every ``check_*`` below, on CPU tensors, with the
  Triton kernels in interpreter mode and ``deep_gemm`` / ``flash_mla``
  replaced by the argument-checking stand-ins of ``cuda_fakes.py``: this pins
  the glue (layouts, padding, masking, chunking, metadata reuse). It runs in a
  subprocess because ``TRITON_INTERPRET`` must be set before triton is imported;
* ``gpu``-marked: the same checks on the real kernels at serving-like sizes,
  and ``LLM(backend="cuda")`` vs ``LLM(backend="reference")`` on the same GPU
  for both tiny architectures (real attention dims): logits teacher-forced on
  the reference's greedy tokens (exact greedy equality is reported, not
  asserted: see ``test_llm_cuda_matches_reference_gpu``); MTP greedy ==
  plain greedy on the cuda backend (verification at next_n = 2, 3, 4).

Inputs are random with a fresh seed per run (``ATTN_TEST_SEED`` replays one).
Kernel outputs are allocated by the kernels themselves; the logits tails the
paged kernel leaves as garbage are checked to come back ``-inf``.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

from attention import indexer as ref_indexer  # noqa: E402
from attention import sparse_mla as ref_mla  # noqa: E402
from attention.cache import CacheSpec, PagedKVCache  # noqa: E402
from attention.cuda.logits import (  # noqa: E402
    KV_START_ALIGN,
    RaggedChunk,
    indexer_context_lens,
    paged_logits_layout,
    plan_ragged_chunks,
    ragged_logits_bytes,
)
from attention.formats import PAGE_SIZE, quantize_indexer_fp8  # noqa: E402
from tests.prestart import temp_dir  # noqa: E402
from tests.triton_interpreter import code_compile_run, compiled, interpreter_run  # noqa: E402

SEED = int(os.environ.get("ATTN_TEST_SEED", secrets.randbits(31)))
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# host-side helpers (CPU, CI)
# ---------------------------------------------------------------------------


def test_context_lens_decode():
    seq = torch.tensor([1, 7, 64, 65, 4096])
    ctx = indexer_context_lens(seq)
    assert ctx.dtype == torch.int32 and ctx.is_contiguous() and ctx.shape == (5, 1)
    assert ctx[:, 0].tolist() == seq.tolist()


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_context_lens_target_verify(next_n):
    seq = torch.tensor([next_n, next_n + 1, 100, 4096])
    ctx = indexer_context_lens(seq, next_n)
    assert ctx.shape == (4, next_n)
    for b, L in enumerate(seq.tolist()):
        # draft position j of a request of length L sees L - next_n + j + 1 keys
        assert ctx[b].tolist() == [L - next_n + j + 1 for j in range(next_n)]
    # the model's own recipe (positions + 1) agrees
    pos = torch.cat([torch.arange(L - next_n, L) for L in seq.tolist()])
    assert torch.equal(ctx.view(-1), (pos + 1).to(torch.int32))


def test_context_lens_shorter_than_next_n_and_draft_extend():
    # a context shorter than next_n: the rows before the first token see nothing
    assert indexer_context_lens(torch.tensor([1, 2]), 4).tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]
    # draft extend: q_len[b] real rows, padded to next_n with empty rows
    ctx = indexer_context_lens(torch.tensor([10, 20, 5]), 3, q_lens=torch.tensor([1, 3, 0]))
    assert ctx.tolist() == [[10, 0, 0], [18, 19, 20], [0, 0, 0]]
    with pytest.raises(ValueError, match="q_lens"):
        indexer_context_lens(torch.tensor([10]), 2, q_lens=torch.tensor([3]))
    with pytest.raises(ValueError, match="next_n"):
        indexer_context_lens(torch.tensor([10]), 0)


def test_paged_logits_layout():
    assert [(p.atom, p.groups, p.name) for p in map(paged_logits_layout, [1, 2, 3, 4, 6])] == [
        (1, 1, "native"), (2, 1, "native"), (1, 3, "per_token"), (2, 2, "grouped2"), (2, 3, "grouped2")]
    assert paged_logits_layout(4, "per_token").atom == 1
    assert paged_logits_layout(2, "native").atom == 2
    with pytest.raises(ValueError, match="natively"):
        paged_logits_layout(3, "native")


def _check_plan(ks, ke, budget, chunks):
    S = len(ks)
    assert chunks and chunks[0].r0 == 0 and chunks[-1].r1 == S
    for a, b in zip(chunks, chunks[1:]):
        assert a.r1 == b.r0
    for c in chunks:
        assert c.r1 > c.r0
        assert c.k0 % KV_START_ALIGN == 0, c
        for r in range(c.r0, c.r1):
            if ke[r] > ks[r]:
                assert c.k0 <= ks[r] and ke[r] <= c.k1, (c, r)
        if c.r1 - c.r0 > 1:
            assert ragged_logits_bytes(c.r1 - c.r0, c.k1 - c.k0) <= budget
    # greedy: the next row would not have fitted, or its window starts past every window of the chunk
    for a, b in zip(chunks, chunks[1:]):
        before = [ke[r] for r in range(a.r0, b.r0) if ke[r] > ks[r]]
        if before and ke[b.r0] > ks[b.r0] and ks[b.r0] >= max(before):
            continue
        rows = range(a.r0, b.r0 + 1)
        lo = min([ks[r] for r in rows if ke[r] > ks[r]], default=0)
        lo -= lo % KV_START_ALIGN
        hi = max([ke[r] for r in rows if ke[r] > ks[r]], default=0)
        assert ragged_logits_bytes(b.r0 + 1 - a.r0, max(hi - lo, 0)) > budget


def test_plan_ragged_chunks_causal_prefill():
    gen = torch.Generator().manual_seed(SEED)
    # two packed requests: 300 rows over a 700-token prefix, then 500 rows from scratch
    ks = [0] * 300 + [1000] * 500
    ke = [700 + i + 1 for i in range(300)] + [1000 + i + 1 for i in range(500)]
    for budget in (1, 4096, ragged_logits_bytes(10, 1000), ragged_logits_bytes(333, 1000), 1 << 40):
        chunks = plan_ragged_chunks(ks, ke, budget)
        _check_plan(ks, ke, budget, chunks)
    # one chunk per request at any budget: a row of the second never scores the first's keys
    assert [(c.r0, c.r1, c.k0, c.k1) for c in plan_ragged_chunks(ks, ke, 1 << 40)] == [(0, 300, 0, 1000),
                                                                                     (300, 800, 992, 1500)]
    assert len(plan_ragged_chunks(ks[:300], ke[:300], 1 << 40)) == 1
    assert len(plan_ragged_chunks(ks, ke, 1)) == len(ks)  # a row over budget is its own chunk
    # random windows, some empty
    S = 200
    a = torch.randint(0, 5000, (S,), generator=gen)
    b = a + torch.randint(-50, 3000, (S,), generator=gen)
    budget = int(torch.randint(10_000, 3_000_000, (1,), generator=gen))
    _check_plan(a.tolist(), b.tolist(), budget, plan_ragged_chunks(a.tolist(), b.tolist(), budget))


def test_plan_ragged_chunks_edges():
    assert plan_ragged_chunks([], [], 100) == []
    assert plan_ragged_chunks([5, 5], [5, 3], 1 << 20) == [RaggedChunk(0, 2, 0, 0)]  # no row sees anything
    with pytest.raises(ValueError, match="budget"):
        plan_ragged_chunks([0], [1], 0)


def test_chunk_bytes_cover_deepgemm_padding():
    # f32 rows padded to 1024 bytes with an extra KV block: 1 row x 1 key is one 256-float row
    # (rounded up to the 2-row query block of 64 heads).
    assert ragged_logits_bytes(1, 1) == 2 * 512 * 4
    assert ragged_logits_bytes(2, 256) == 2 * 512 * 4
    assert ragged_logits_bytes(3, 257) == 4 * 768 * 4


def test_cuda_backend_unavailable_without_kernel_packages():
    import importlib.util

    from attention.backend import BackendUnavailableError, get_backend

    if importlib.util.find_spec("flash_mla") and importlib.util.find_spec("deep_gemm") and torch.cuda.is_available():
        pytest.skip("kernel packages present")
    with pytest.raises(BackendUnavailableError, match="flash_mla.*deep_gemm"):
        get_backend("cuda")


# ---------------------------------------------------------------------------
# checks shared by the fake-kernel (CPU) and GPU runs
# ---------------------------------------------------------------------------


def _be():
    from attention.cuda.backend import make_backend

    return make_backend()


def _fp8_queries(shape, gen, device):
    from models.indexer import quantize_query_fp8

    q, scale = quantize_query_fp8(torch.randn(*shape, generator=gen))
    return q.to(device), scale.to(device)


def _index_cache(num_pages, gen, device):
    spec = CacheSpec(num_layers=1, num_pages=num_pages, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                     kv_cache_dtype="fp8", dtype=torch.bfloat16)
    cache = PagedKVCache(spec, device)
    slots = torch.arange(spec.num_slots)
    k = torch.randn(spec.num_slots, 128, generator=gen) * torch.rand(spec.num_slots, 1, generator=gen) * 3
    cache.write_index(0, slots.to(device), k.to(device))
    return cache


def _mla_cache(num_pages, gen, device):
    spec = CacheSpec(num_layers=2, num_pages=num_pages, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                     kv_cache_dtype="fp8", dtype=torch.bfloat16)
    cache = PagedKVCache(spec, device)
    n = spec.num_slots
    latent = torch.randn(n, 512, generator=gen) * torch.rand(n, 1, generator=gen) * 2
    rope = torch.randn(n, 64, generator=gen)
    cache.write_mla(1, torch.arange(n).to(device), latent.to(device), rope.to(device))
    return cache


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_logits(got, ref, label, tol=2e-3):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, f"{label}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    ref_inf = ref == NEG_INF
    assert torch.equal(got == NEG_INF, ref_inf), (
        f"{label}: -inf pattern differs at {torch.nonzero((got == NEG_INF) != ref_inf)[:5].tolist()}")
    fin = ~ref_inf
    assert bool(torch.isfinite(got[fin]).all()), f"{label}: non-finite logits where the reference is finite"
    if bool(fin.any()):
        scale = float(ref[fin].abs().max().clamp_min(1e-6))
        err = float((got[fin] - ref[fin]).abs().max()) / scale
        assert err <= tol, f"{label}: max |err| / max |ref| = {err:.2e} > {tol}"


def check_paged_logits(device, gen, big):
    from attention.cuda import logits as cl

    be = _be()
    B, H, D = (24, 64, 128) if big else (5, 64, 128)
    max_seq = 9000 if big else 300
    num_pages = B * (-(-max_seq // PAGE_SIZE)) + 7
    cache = _index_cache(num_pages, gen, device)
    for next_n in (1, 2, 3, 4):
        for mode in ("auto", "per_token"):
            for draft_extend in (False, True):
                seq = torch.randint(next_n, max_seq + 1, (B,), generator=gen)
                seq[0], seq[1], seq[2] = 1, next_n, PAGE_SIZE  # contexts shorter than / equal to next_n
                q_lens = torch.randint(0, next_n + 1, (B,), generator=gen) if draft_extend else None
                if q_lens is not None:
                    q_lens[3] = 0  # a request with only padding rows
                ctx = indexer_context_lens(seq, next_n, q_lens).to(device)
                pages_per_req = -(-int(seq.max()) // PAGE_SIZE) + 2
                # random page ids, also past each request's last page (never visible)
                bt = torch.randint(0, num_pages, (B, pages_per_req), generator=gen, dtype=torch.int32).to(device)
                max_len = int(seq.max()) + 37
                q, _ = _fp8_queries((B, next_n, H, D), gen, device)
                w = (torch.randn(B * next_n, H, generator=gen) * 0.1).to(device)
                if mode == "auto":  # through the backend, as the model calls it
                    got = be.paged_mqa_logits(q, cache.index[0], w, ctx, bt, max_len)
                else:
                    got = cl.paged_mqa_logits(q, cache.index[0], w, ctx, bt, max_len, layout=mode)
                ref = ref_indexer.paged_mqa_logits(q, cache.index[0], w, ctx, bt, max_len)
                _check_logits(got, ref, f"next_n={next_n} layout={mode} draft_extend={draft_extend}")


def check_ragged_logits(device, gen, big):
    be = _be()
    from attention.cuda import logits as cl

    H, D = 64, 128
    # three packed requests: (prefix, new rows); the last with a long prefix
    reqs = [(0, 700), (300, 500), (2000, 300)] if big else [(0, 40), (25, 30), (90, 20)]
    ks, ke, start = [], [], 0
    for prefix, rows in reqs:
        ks += [start] * rows
        ke += [start + prefix + i + 1 for i in range(rows)]
        start += prefix + rows
    N, S = start, len(ks)
    ks[5], ke[5] = 7, 7  # an empty row
    ks_t, ke_t = torch.tensor(ks, dtype=torch.int32).to(device), torch.tensor(ke, dtype=torch.int32).to(device)
    q, _ = _fp8_queries((S, H, D), gen, device)
    k8, ksc = quantize_indexer_fp8(torch.randn(N, D, generator=gen) * 2)
    k8, ksc = k8.to(device), ksc.to(device)
    w = (torch.randn(S, H, generator=gen) * 0.1).to(device)
    ref = ref_indexer.ragged_mqa_logits(q, k8, ksc, w, ks_t, ke_t)
    small = cl.ragged_logits_bytes(13, N // 3)
    for budget in (small, 1 << 40):
        got = cl.ragged_mqa_logits(q, k8, ksc, w, ks_t, ke_t, logits_budget_bytes=budget)
        _check_logits(got, ref, f"ragged budget={budget}")
    # the model's path: float keys read back from the fp8 cache, k_scale None
    kf = k8.float() * ksc[:, None]
    _check_logits(be.ragged_mqa_logits(q, kf, None, w, ks_t, ke_t), ref, "ragged float keys")

    # chunked logits + top-k never holding [S, N]
    topk = 512 if big else 16
    bt_rows = torch.randint(0, 10_000, (S, -(-N // PAGE_SIZE)), generator=gen, dtype=torch.int32).to(device)
    pos, slots = cl.ragged_topk(q, k8, ksc, w, ks_t, ke_t, topk, bt_rows, logits_budget_bytes=small)
    _check_selection(pos, slots, ref, ke_t, topk, bt_rows, "ragged_topk")
    # the reference backend's ragged_topk agrees on the same contract
    from attention.backend import get_backend

    rpos, rslots = get_backend("reference").ragged_topk(q, k8, ksc, w, ks_t, ke_t, topk, bt_rows)
    _check_selection(rpos, rslots, ref, ke_t, topk, bt_rows, "reference ragged_topk")


def _check_selection(pos, slots, ref_logits, lengths, topk, bt_rows, label, tol=2e-3):
    """Top-k quality against reference logits: valid, distinct, and no unselected candidate clearly above."""
    pos, slots, ref = pos.long().cpu(), slots.long().cpu(), ref_logits.float().cpu()
    lengths = lengths.long().cpu()
    assert pos.shape == (ref.shape[0], topk) and slots.shape == pos.shape, label
    L = ref.shape[1]
    for r in range(ref.shape[0]):
        cand = (torch.arange(L) < lengths[r]) & (ref[r] != NEG_INF)
        n_cand = int(cand.sum())
        p = pos[r]
        chosen = p[p >= 0]
        assert len(chosen) == min(topk, n_cand), f"{label}: row {r} picked {len(chosen)} of {n_cand}"
        assert bool((p[len(chosen):] == -1).all()), f"{label}: row {r} padding"
        assert len(set(chosen.tolist())) == len(chosen), f"{label}: row {r} duplicates"
        assert bool(cand[chosen].all()), f"{label}: row {r} picked a non-candidate"
        if len(chosen) < n_cand:
            scale = float(ref[r][cand].abs().max().clamp_min(1e-6))
            rest = cand.clone()
            rest[chosen] = False
            gap = float(ref[r][rest].max() - ref[r][chosen].min()) / scale
            assert gap <= tol, f"{label}: row {r} left out a logit {gap:.2e} above its selection"
        if bt_rows is not None:
            bt = bt_rows.long().cpu()
            want = bt[r, chosen // PAGE_SIZE] * PAGE_SIZE + chosen % PAGE_SIZE
            assert torch.equal(slots[r, : len(chosen)], want), f"{label}: row {r} slots"
        else:
            assert torch.equal(slots[r], p), f"{label}: row {r} slots == positions"


def check_topk(device, gen, big):
    be = _be()
    R, L, topk = (64, 40_000, 2048) if big else (6, 700, 50)
    logits = torch.randn(R, L, generator=gen)
    logits[torch.rand(R, L, generator=gen) < 0.1] = NEG_INF
    lengths = torch.randint(0, L + 1, (R,), generator=gen)
    lengths[0], lengths[1] = 0, topk // 2
    bt = torch.randint(0, 5000, (R, -(-L // PAGE_SIZE)), generator=gen, dtype=torch.int32)
    pos, slots = be.topk_slots(logits.to(device), lengths.to(device), topk, bt.to(device))
    rpos, rslots = ref_indexer.topk_slots(logits, lengths, topk, bt)
    for r in range(R):  # random floats: no ties, so the selected sets are identical
        assert set(pos[r].tolist()) == set(rpos[r].tolist()), f"row {r} positions"
        assert set(slots[r].tolist()) == set(rslots[r].tolist()), f"row {r} slots"
    pos2, slots2 = be.topk_slots(logits.to(device), lengths.to(device), topk, None)
    assert torch.equal(pos2.cpu(), pos.cpu()) and torch.equal(slots2.cpu(), pos.cpu())


def _tied_rows(gen, R, L, lengths, topk):
    """Logits with many exact ties: half the rows on a handful of levels, about
    ``topk / 2`` positive ones and half zeros of both signs (as ReLU-zero index
    scores come out: the k-th place falls in the zeros), half bf16-rounded
    normals (ties in the k-th value's neighbourhood, few enough to stay on the
    sampled kernels' candidate path); -inf holes; garbage past each length."""
    u = torch.rand(R, L, generator=gen)
    pick = lambda vals: torch.tensor(vals)[torch.randint(0, len(vals), (R, L), generator=gen)]  # noqa: E731
    p_pos = topk / (2 * L)
    x = torch.where(u < p_pos, pick([0.25, 2.0]), torch.where(u < p_pos + 0.5, pick([-0.0, 0.0]), pick([-1.0, -0.5])))
    x[1::2] = torch.randn(R // 2, L, generator=gen).to(torch.bfloat16).float()
    x[torch.rand(R, L, generator=gen) < 0.1] = NEG_INF
    past = torch.arange(L)[None, :] >= lengths[:, None]
    garbage = torch.tensor([float("nan"), float("inf"), 3e38])[torch.randint(0, 3, (R, L), generator=gen)]
    return torch.where(past, garbage, x)


def _rule_ascending(ref_pos: torch.Tensor) -> list[int]:
    """The reference's selection (descending logit, ties by position) listed the cuda way: ascending."""
    return sorted(p for p in ref_pos.tolist() if p >= 0)


def check_topk_ties(device, gen, big):
    """Exact ties at the top-k boundary (issue 19): the cuda top-k selects what the
    reference selects (lower position wins), on rows of different widths, batched
    and alone, on both top-k kernels (fused for narrow rows, sampled for wide ones),
    and through the logits kernels with zero queries (every score ties)."""
    from attention.cuda import topk as tk

    be = _be()
    saved = tk.SAMPLED_MIN_LEN
    if not big:
        tk.SAMPLED_MIN_LEN = 256  # the interpreter's rows are short: let the wide ones take the sampled kernels
    try:
        # 1. top-k of given logits
        R, L, topk = (16, 40_000, 2048) if big else (8, 400, 24)
        lengths = torch.randint(topk + 1, L + 1, (R,), generator=gen)
        lengths[:6] = torch.tensor([L, 0, topk - 1, topk, topk + 1, 3 * topk])
        logits = _tied_rows(gen, R, L, lengths, topk)
        bt = torch.randperm(R * 3 * (-(-L // PAGE_SIZE)), generator=gen)[: R * (-(-L // PAGE_SIZE))]
        bt = bt.view(R, -1).to(torch.int32)
        rpos, rslots = ref_indexer.topk_slots(logits, lengths, topk, bt)
        pos, slots = be.topk_slots(logits.to(device), lengths.to(device), topk, bt.to(device))
        pos, slots = pos.cpu(), slots.cpu()
        cut = 0
        for r in range(R):
            want = _rule_ascending(rpos[r])
            got = pos[r].tolist()
            assert got[: len(want)] == want and all(p == -1 for p in got[len(want):]), f"batched row {r}"
            want_slots = [int(bt[r, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in want]
            assert slots[r].tolist() == want_slots + [-1] * (topk - len(want)), f"batched row {r} slots"
            v = logits[r, : int(lengths[r])]
            v = v[v != NEG_INF].sort(descending=True).values
            cut += v.numel() > topk and bool(v[topk - 1] == v[topk])
        assert cut >= R // 3, f"only {cut} rows have a tie across the k-th place"
        for r in range(R):  # alone: the row's own width (plus a little garbage), narrower than the batch
            n = int(lengths[r])
            w = n + int(torch.randint(0, 4, (1,), generator=gen)) + (n == 0)
            lone = logits[r : r + 1, :w].clone()
            apos, aslots = be.topk_slots(lone.to(device), lengths[r : r + 1].to(device), topk, bt[r : r + 1].to(device))
            assert torch.equal(apos.cpu()[0], pos[r]) and torch.equal(aslots.cpu()[0], slots[r]), f"alone row {r}"
        npos, nslots = be.topk_slots(logits.to(device), lengths.to(device), topk, None)
        assert torch.equal(npos.cpu(), pos) and torch.equal(nslots.cpu(), pos), "without a page table"

        # 2. decode: paged logits of zero queries (every visible score is 0) -> top-k
        H, D = 64, 128
        B = 6
        seq = torch.randint(1, (20_000 if big else 600) + 1, (B,), generator=gen)
        seq[:3] = torch.tensor([1, topk, topk + 1])
        seq[3] = 20_000 if big else 600
        pages = [-(-int(n) // PAGE_SIZE) for n in seq]
        num_pages = sum(pages) + 3
        cache = _index_cache(num_pages, gen, device)
        perm = torch.randperm(num_pages, generator=gen)
        table = torch.zeros(B, max(pages), dtype=torch.int32)
        o = 0
        for b, n in enumerate(pages):
            table[b, :n] = perm[o : o + n].to(torch.int32)
            o += n
        q = torch.zeros(B, 1, H, D, dtype=torch.float8_e4m3fn, device=device)
        w = (torch.randn(B, H, generator=gen) * 0.1).to(device)  # negative weights: -0.0 scores too
        ctx = indexer_context_lens(seq).to(device)

        def decode_select(rows: slice):
            lg = be.paged_mqa_logits(q[rows], cache.index[0], w[rows], ctx[rows], table[rows].to(device),
                                     int(seq[rows].max()))
            return be.topk_slots(lg, ctx[rows].view(-1), topk, table[rows].to(device))

        allb = slice(0, B)
        dpos, dslots = (t.cpu() for t in decode_select(allb))
        for b in range(B):
            n = min(int(seq[b]), topk)
            assert dpos[b].tolist() == list(range(n)) + [-1] * (topk - n), f"decode row {b}: the first positions"
            apos, aslots = decode_select(slice(b, b + 1))
            assert torch.equal(apos.cpu()[0], dpos[b]) and torch.equal(aslots.cpu()[0], dslots[b]), f"decode alone {b}"
        # the reference pipeline selects the same set
        ref_lg = ref_indexer.paged_mqa_logits(q.cpu(), cache.index[0].cpu(), w.cpu(), ctx.cpu(), table,
                                              int(seq.max()))
        rp, rs = ref_indexer.topk_slots(ref_lg, ctx.cpu().view(-1), topk, table)
        for b in range(B):
            assert _rule_ascending(rp[b]) == [p for p in dpos[b].tolist() if p >= 0], f"decode vs reference {b}"
            assert sorted(s_ for s_ in rs[b].tolist() if s_ >= 0) == sorted(s_ for s_ in dslots[b].tolist() if s_ >= 0)

        # 3. prefill: ragged logits + top-k, a request packed behind another == alone
        n_a, n_b = (700, 3000) if big else (8, 32)
        N = n_a + n_b
        k8, ksc = quantize_indexer_fp8(torch.randn(N, D, generator=gen))
        qp, _ = _fp8_queries((N, H, D), gen, "cpu")
        qp[n_a:] = 0.0  # request b: every score ties
        qp = qp.to(device)
        k8, ksc = k8.to(device), ksc.to(device)
        wp = (torch.randn(N, H, generator=gen) * 0.1).to(device)
        ks = torch.tensor([0] * n_a + [n_a] * n_b, dtype=torch.int32)
        ke = torch.cat([torch.arange(1, n_a + 1), n_a + torch.arange(1, n_b + 1)]).to(torch.int32)
        packed, _ = be.ragged_topk(qp, k8, ksc, wp, ks.to(device), ke.to(device), topk)
        alone, _ = be.ragged_topk(qp[n_a:], k8[n_a:], ksc[n_a:], wp[n_a:], (ks[n_a:] - n_a).to(device),
                                  (ke[n_a:] - n_a).to(device), topk)
        packed, alone = packed.cpu()[n_a:], alone.cpu()
        assert torch.equal(torch.where(packed >= 0, packed - n_a, -1), alone), "ragged: packed != alone"
        for s_ in range(n_b):
            n = min(s_ + 1, topk)
            assert alone[s_].tolist() == list(range(n)) + [-1] * (topk - n), f"ragged row {s_}"
    finally:
        tk.SAMPLED_MIN_LEN = saved


def _prefill_case(device, gen, s, h, s_kv, topk, empty_row):
    q = torch.randn(s, h, 576, generator=gen).to(torch.bfloat16)
    kv = (torch.randn(s_kv, 1, 576, generator=gen) * 1.5).to(torch.bfloat16)
    idx = torch.randint(-1, s_kv + 20, (s, 1, topk), generator=gen, dtype=torch.int32)  # -1 and >= s_kv invalid
    idx[empty_row] = -1
    idx[empty_row, 0, 0] = s_kv + 3
    return q, kv, idx


def check_sparse_prefill(device, gen, big):
    be = _be()
    cases = [(512, 128, 6000, 2048), (300, 16, 4000, 2048), (200, 64, 3000, 64)] if big else \
        [(12, 16, 150, 16), (9, 64, 90, 128), (5, 128, 70, 40)]
    scale = 576 ** -0.5
    for s, h, s_kv, topk in cases:
        q, kv, idx = _prefill_case(device, gen, s, h, s_kv, topk, empty_row=s // 2)
        out, mx, lse = be.sparse_mla_prefill(q.to(device), kv.to(device), idx.to(device), scale, 512)
        rout, rmx, rlse = ref_mla.sparse_mla_prefill(q, kv, idx, scale, 512)
        label = f"prefill s={s} h={h} topk={topk}"
        assert out.shape == (s, h, 512) and mx.shape == (s, h) and lse.shape == (s, h), label
        keep = torch.ones(s, dtype=torch.bool)
        keep[s // 2] = False
        err = _rel_err(out.cpu()[keep], rout[keep])
        assert err < 1e-2, f"{label}: out rel err {err:.2e}"
        assert float((lse.cpu()[keep] - rlse[keep]).abs().max()) < 1e-2, f"{label}: lse"
        assert float((mx.cpu()[keep] - rmx[keep]).abs().max()) < 1e-2, f"{label}: max_logits"


def check_prefill_empty_rows(device, gen, big):
    be = _be()
    s, h, s_kv, topk = 8, 16, 100, 128
    q, kv, idx = _prefill_case(device, gen, s, h, s_kv, topk, empty_row=3)
    out, mx, lse = be.sparse_mla_prefill(q.to(device), kv.to(device), idx.to(device), 576 ** -0.5, 512)
    assert bool((out[3] == 0).all()), "an empty row's output must be 0"
    assert bool((lse[3] == float("inf")).all()) and bool((mx[3] == NEG_INF).all()), \
        f"empty row: lse {lse[3, :2].tolist()} max_logits {mx[3, :2].tolist()}"


def _decode_case(device, gen, cache, b, s_q, h, topk):
    q = torch.randn(b, s_q, h, 576, generator=gen).to(torch.bfloat16)
    n = cache.spec.num_slots
    idx = torch.randint(0, n, (b, s_q, topk), generator=gen)
    idx[torch.rand(b, s_q, topk, generator=gen) < 0.15] = -1
    return q, idx


def check_sparse_decode(device, gen, big):
    be = _be()
    cache = _mla_cache(400 if big else 12, gen, device)
    cases = [(32, 1, 128, 2048), (16, 2, 16, 2048), (8, 4, 64, 2048), (4, 3, 32, 64)] if big else \
        [(3, 1, 16, 64), (2, 2, 64, 128), (2, 4, 128, 40)]
    scale = 576 ** -0.5
    for b, s_q, h, topk in cases:
        q, idx = _decode_case(device, gen, cache, b, s_q, h, topk)
        for _ in range(2):  # the second call reuses the cached scheduling metadata
            out, lse = be.sparse_mla_decode(q.to(device), cache, 1, idx.to(device), scale, 512)
        rout, rlse = ref_mla.sparse_mla_decode(q.to(device), cache, 1, idx.to(device), scale, 512)
        label = f"decode b={b} s_q={s_q} h={h} topk={topk}"
        assert out.shape == (b, s_q, h, 512) and lse.shape == (b, h, s_q), label
        err = _rel_err(out, rout)
        assert err < 1e-2, f"{label}: out rel err {err:.2e}"
        lerr = float((lse.cpu() - rlse.cpu()).abs().max())
        # FlashMLA rounds dequantized keys and the probabilities to bf16: 1.1e-2 seen at h=128, top-k 2048 (H100)
        assert lerr < 2e-2, f"{label}: lse max abs err {lerr:.2e}"


def check_decode_empty_rows(device, gen, big):
    be = _be()
    cache = _mla_cache(4, gen, device)
    q, idx = _decode_case(device, gen, cache, 2, 2, 16, 64)
    idx[1, 0] = -1
    out, lse = be.sparse_mla_decode(q.to(device), cache, 1, idx.to(device), 576 ** -0.5, 512)
    assert bool((out[1, 0] == 0).all()), "an empty row's output must be 0"
    assert bool((lse[1, :, 0] == float("inf")).all()), f"empty row lse {lse[1, :3, 0].tolist()}"
    # out-of-range indices are dropped like -1 (the kernel reads any other index)
    idx2 = idx.clone()
    idx2[0, 1, :5] = cache.spec.num_slots + 100
    out2, _ = be.sparse_mla_decode(q.to(device), cache, 1, idx2.to(device), 576 ** -0.5, 512)
    idx3 = idx.clone()
    idx3[0, 1, :5] = -1
    out3, _ = be.sparse_mla_decode(q.to(device), cache, 1, idx3.to(device), 576 ** -0.5, 512)
    assert torch.equal(out2[0, 1].cpu(), out3[0, 1].cpu())


def check_cache_writes(device, gen, big):
    """The backend's Triton writes give the bytes of ``PagedKVCache.write_*`` run on CPU (the spec)."""
    be = _be()
    n_pages = 40 if big else 3
    a = PagedKVCache(CacheSpec(2, n_pages, 512, 64, 128, "fp8", torch.bfloat16), device)
    ref = PagedKVCache(a.spec, "cpu")
    n = a.spec.num_slots // 2
    slots = torch.randperm(a.spec.num_slots, generator=gen)[:n]
    slots[:3] = -1
    latent = torch.randn(n, 512, generator=gen).to(torch.bfloat16)
    rope = torch.randn(n, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(n, 128, generator=gen)
    be.write_mla(a, 1, slots.to(device), latent.to(device), rope.to(device))
    be.write_index(a, 0, slots.to(device), k.to(device))
    ref.write_mla(1, slots, latent, rope)
    ref.write_index(0, slots, k)
    bad_mla = int((a.mla[1].cpu() != ref.mla[1]).sum())
    bad_idx = int((a.index[0].cpu() != ref.index[0]).sum())
    assert bad_mla == 0 and bad_idx == 0, f"{bad_mla} MLA and {bad_idx} indexer bytes differ from the CPU spec"
    if device != "cpu":
        # For the record: the cache's own torch write run on the GPU.
        g = PagedKVCache(a.spec, device)
        g.write_mla(1, slots.to(device), latent.to(device), rope.to(device))
        g.write_index(0, slots.to(device), k.to(device))
        print(f"torch write on {device}: {int((g.mla[1].cpu() != ref.mla[1]).sum())} MLA bytes and "
              f"{int((g.index[0].cpu() != ref.index[0]).sum())} indexer bytes differ from the CPU spec")


def check_refusals(device, gen, big):
    be = _be()
    for kwargs, match in [
        (dict(kv_cache_dtype="auto"), "kv_cache_dtype='fp8'"),
        (dict(kv_lora_rank=32), "kv_lora_rank = 512"),
        (dict(rope_dim=16), "qk_rope_head_dim = 64"),
        (dict(index_head_dim=32), "index_head_dim = 128"),
    ]:
        spec = dict(num_layers=1, num_pages=2, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                    kv_cache_dtype="fp8", dtype=torch.bfloat16) | kwargs
        with pytest.raises(ValueError, match=match):
            be.check_cache_spec(CacheSpec(**spec))
    be.check_cache_spec(CacheSpec(1, 2, 512, 64, 128, "fp8", torch.bfloat16))
    cache = _index_cache(2, gen, device)
    with pytest.raises(ValueError, match="index_n_heads"):
        be.paged_mqa_logits(torch.zeros(1, 1, 16, 128).to(device), cache.index[0], torch.zeros(1, 16).to(device),
                            torch.ones(1, 1, dtype=torch.int32).to(device), torch.zeros(1, 2, dtype=torch.int32).to(device), 64)
    with pytest.raises(ValueError, match="576"):
        be.sparse_mla_prefill(torch.zeros(2, 16, 48).to(device), torch.zeros(3, 1, 48).to(device),
                              torch.zeros(2, 1, 4, dtype=torch.int32).to(device), 1.0, 32)
    auto = PagedKVCache(CacheSpec(1, 2, 512, 64, 128, "auto", torch.bfloat16), device)
    with pytest.raises(ValueError, match="fp8"):
        be.sparse_mla_decode(torch.zeros(1, 1, 16, 576).to(device), auto, 0,
                             torch.zeros(1, 1, 64, dtype=torch.int64).to(device), 1.0, 512)


CHECKS = {
    "paged_logits": check_paged_logits,
    "ragged_logits": check_ragged_logits,
    "topk": check_topk,
    "topk_ties": check_topk_ties,
    "sparse_prefill": check_sparse_prefill,
    "prefill_empty_rows": check_prefill_empty_rows,
    "sparse_decode": check_sparse_decode,
    "decode_empty_rows": check_decode_empty_rows,
    "cache_writes": check_cache_writes,
    "refusals": check_refusals,
}


def run_check(name: str, device: str, seed: int, big: bool) -> None:
    gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
    CHECKS[name](device, gen, big)


# ---------------------------------------------------------------------------
# end to end: LLM(backend="cuda") vs LLM(backend="reference")
# ---------------------------------------------------------------------------

REAL_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64,
                 num_attention_heads=16, index_topk=64)
PROMPT_LENS = (5, 70, 150, 260)


def _prompts(lens=PROMPT_LENS):
    return [[40 + (i * 7 + j * 13) % 80 for j in range(n)] for i, n in enumerate(lens)]


def llm_outputs(model_dir, backend, device, max_new_tokens=24, prompt_lens=PROMPT_LENS, **kw):
    from workers.offline import LLM

    llm = LLM(model_dir, backend=backend, device=device, dtype="bfloat16", kv_cache_dtype="fp8",
              num_pages=64, chunk_size=128, **kw)
    return llm.generate(_prompts(prompt_lens), max_new_tokens=max_new_tokens, ignore_eos=True)


def make_real_dims_tiny(arch: str, out: Path) -> Path:
    from models.tiny import make_tiny

    return make_tiny(arch, out, seed=5, **REAL_DIMS)


# ---------------------------------------------------------------------------
# CPU: the glue on fake kernels, Triton in interpreter mode (one subprocess)
# ---------------------------------------------------------------------------


def _worker_main(argv: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must run with TRITON_INTERPRET=1"
    seed, tmp = int(argv[0]), Path(argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cuda_fakes

    cuda_fakes.install()
    results = {}
    for name in CHECKS:
        try:
            run_check(name, "cpu", seed, big=False)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    try:  # the whole model on the cuda backend's glue (CPU, fake kernels)
        model = make_real_dims_tiny("glm_moe_dsa", tmp / "glm")
        # prompts longer than index_topk (64): attention is really sparse
        got = llm_outputs(model, "cuda", "cpu", max_new_tokens=3, prompt_lens=(5, 90), mtp_draft_tokens=2)
        want = llm_outputs(model, "reference", "cpu", max_new_tokens=3, prompt_lens=(5, 90))
        assert got == want, f"cuda {got} != reference {want}"
        assert cuda_fakes.CALLS.get("fp8_paged_mqa_logits") and cuda_fakes.CALLS.get("flash_mla_with_kvcache")
        results["llm"] = "ok"
    except Exception:
        results["llm"] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


@functools.cache
def _fakes_run():
    return interpreter_run(__file__, SEED, temp_dir("cuda-fakes-"), timeout=900)


MASK_TAIL_COMPILE = (
    "import triton\n"
    "from triton.backends.compiler import GPUTarget\n"
    "from triton.compiler import ASTSource\n"
    "from attention.cuda.logits import _mask_tail_kernel\n"
    "src = ASTSource(fn=_mask_tail_kernel, signature={'logits_ptr': '*fp32', 'stride': 'i64', 'width': 'i32',"
    " 'lens_ptr': '*i32', 'BLOCK': 'constexpr'}, constexprs={'BLOCK': 1024})\n"
    "triton.compile(src, target=GPUTarget('cuda', 90, 32), options={'num_warps': 4})\n"
    "print('COMPILED')\n"
)
PRESTART = {"fake_results": _fakes_run,
            "test_mask_tail_kernel_compiles_for_sm90": lambda: code_compile_run(MASK_TAIL_COMPILE)}
"""The subprocesses this module reads, started early (tests/prestart.py)."""


@pytest.fixture(scope="module")
def fake_results() -> dict[str, str]:
    proc = _fakes_run().wait()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"fake-kernel worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", [*CHECKS, "llm"])
def test_glue_on_fake_kernels(name, fake_results):
    assert fake_results[name] == "ok", f"ATTN_TEST_SEED={SEED}\n{fake_results[name]}"


def test_mask_tail_kernel_compiles_for_sm90():
    """The one new Triton kernel compiles to an sm_90 cubin without a GPU."""
    compiled(code_compile_run(MASK_TAIL_COMPILE))


# ---------------------------------------------------------------------------
# GPU: the real kernels
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHECKS))
def test_cuda_backend_gpu(name):
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET for the GPU tests"
    from attention.backend import get_backend

    assert get_backend("cuda").name == "cuda"
    print(f"ATTN_TEST_SEED={SEED}")
    run_check(name, "cuda", SEED, big=True)


@pytest.fixture(scope="module")
def real_dims_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_real_dims")
    return {arch: make_real_dims_tiny(arch, root / arch) for arch in ("deepseek_v32", "glm_moe_dsa")}


def teacher_forced_logits(llm, prompt, continuation):
    """f32 ``[len(continuation), vocab]``: the logits predicting each continuation token,
    the prompt prefilled (PREFILL) and the continuation fed one token per DECODE step."""
    from models.batch import ForwardMode
    from workers.model_runner import WorkItem

    pages = llm.pool.allocate_for_tokens(len(prompt) + len(continuation))
    try:
        with torch.inference_mode():
            _, h = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt), 0, tuple(pages))])
            out = [llm.model.logits(h[-1:]).float()]
            for i, t in enumerate(continuation[:-1]):
                _, h = llm.runner.forward(ForwardMode.DECODE, [WorkItem((t,), len(prompt) + i, tuple(pages))])
                out.append(llm.model.logits(h).float())
        return torch.cat(out).cpu()
    finally:
        llm.pool.free(pages)


def greedy_single(llm, prompt, n):
    """Greedy continuation of one request alone (no batch-mates): ``(tokens, f32 logits [n, vocab])``."""
    from models.batch import ForwardMode
    from workers.model_runner import WorkItem

    pages = llm.pool.allocate_for_tokens(len(prompt) + n)
    try:
        with torch.inference_mode():
            _, h = llm.runner.forward(ForwardMode.PREFILL, [WorkItem(tuple(prompt), 0, tuple(pages))])
            logits = [llm.model.logits(h[-1:]).float()]
            tokens = [int(logits[-1].argmax())]
            for i in range(n - 1):
                _, h = llm.runner.forward(ForwardMode.DECODE, [WorkItem((tokens[-1],), len(prompt) + i, tuple(pages))])
                logits.append(llm.model.logits(h).float())
                tokens.append(int(logits[-1].argmax()))
        return tokens, torch.cat(logits).cpu()
    finally:
        llm.pool.free(pages)


def compare_backends(model_dir, dtype, device="cuda", max_new_tokens=24, ref_dir=None, ref_backend="reference"):
    """The reference's greedy continuation of each prompt (alone), the cuda backend's logits
    teacher-forced on it, and both backends' free-running batched greedy outputs. ``ref_dir`` /
    ``ref_backend``: what plays the reference (default: ``model_dir`` on the reference backend)."""
    from workers.offline import LLM

    kw = dict(device=device, dtype=dtype, kv_cache_dtype="fp8", num_pages=64, chunk_size=128)
    ref_llm = LLM(ref_dir or model_dir, backend=ref_backend, **kw)
    cuda_llm = LLM(model_dir, backend="cuda", **kw)
    prompts = _prompts()
    steps = []
    for p in prompts:
        cont, lr = greedy_single(ref_llm, p, max_new_tokens)
        lc = teacher_forced_logits(cuda_llm, p, cont)
        for i in range(len(cont)):
            top2 = lr[i].topk(2).values
            steps.append({
                "rel_err": float((lc[i] - lr[i]).abs().max() / lr[i].abs().max()),
                "margin": float(top2[0] - top2[1]),
                "max_abs_diff": float((lc[i] - lr[i]).abs().max()),
                "agree": int(lc[i].argmax()) == cont[i],
            })
    ref_out = ref_llm.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
    cuda_out = cuda_llm.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
    first_div = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(cuda_out, ref_out)]
    return {"greedy_equal": cuda_out == ref_out, "first_divergence": first_div, "steps": steps,
            "cuda": cuda_out, "reference": ref_out, "cuda_llm": cuda_llm}


# Tolerances of the teacher-forced comparison, from the H100 runs of 2026-11-22
# (docs/gpu-results.md), per step: max |logit diff| / max |logit|, its median over all steps,
# and the share of steps whose argmax agrees. Observed (4 prompts x 24 steps):
#   deepseek_v32 f32 max 0.19 median 0.037 agree 0.92 | bf16 max 0.20 median 0.043 agree 0.90
#   glm_moe_dsa  f32 max 0.046 median 0.011 agree 0.93 | bf16 max 0.12 median 0.017 agree 0.91
# FlashMLA computes with bf16 queries, bf16-rounded dequantized keys and bf16 probabilities and
# returns bf16; the reference computes in f32. The maxima are single steps (a top-k selection
# that flips one of the 64 chosen keys moves the logits in steps, not by rounding); DeepSeek's
# 4 indexer layers to GLM's 2 computing layers would explain its larger numbers (not verified).
# For scale: the *same* reference backend, bf16, on CPU vs on the GPU differed by up to 0.16
# and flipped 3 of 36 argmaxes.
E2E_MAX_REL_TOL = 0.3
E2E_MEDIAN_REL_TOL = 0.06
E2E_MIN_AGREEMENT = 0.85


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_llm_cuda_matches_reference_gpu(arch, dtype, real_dims_models):
    """LLM(backend="cuda") vs LLM(backend="reference") on the same GPU, same dtype, fp8 KV.

    Exact greedy equality is not a property these random tiny models can have across two
    numerics (the reference disagrees with itself between CPU and GPU, and between batched
    and single-request decoding): their top-2 margins are often below the bf16 rounding of
    FlashMLA. Asserted instead, teacher-forced on the reference's greedy tokens: the cuda
    backend's logits stay within E2E_MAX_REL_TOL at every step and E2E_MEDIAN_REL_TOL at the
    median step, and its argmax agrees on at least E2E_MIN_AGREEMENT of the steps; every
    disagreement is printed with its reference margin.
    Printed: whether the free-running batched greedy outputs are identical, and where not,
    the first divergence.
    """
    r = compare_backends(real_dims_models[arch], dtype)
    worst = max(s["rel_err"] for s in r["steps"])
    median = sorted(s["rel_err"] for s in r["steps"])[len(r["steps"]) // 2]
    flips = [s for s in r["steps"] if not s["agree"]]
    agreement = 1 - len(flips) / len(r["steps"])
    print(f"E2E {arch} {dtype}: greedy_equal={r['greedy_equal']} first_divergence={r['first_divergence']} "
          f"max_rel_err={worst:.3e} median_rel_err={median:.3e} "
          f"argmax_agreement={agreement:.3f} ({len(r['steps']) - len(flips)}/{len(r['steps'])}) "
          f"flip_margins={[round(s['margin'], 4) for s in flips]} "
          f"flip_diffs={[round(s['max_abs_diff'], 4) for s in flips]}")
    assert worst <= E2E_MAX_REL_TOL, f"logits rel err {worst:.3e} > {E2E_MAX_REL_TOL}"
    assert median <= E2E_MEDIAN_REL_TOL, f"median logits rel err {median:.3e} > {E2E_MEDIAN_REL_TOL}"
    assert agreement >= E2E_MIN_AGREEMENT, f"argmax agreement {agreement:.3f} < {E2E_MIN_AGREEMENT}"


@pytest.mark.gpu
def test_reference_cpu_vs_gpu_noise_floor_gpu(real_dims_models):
    """Diagnostic: the *same* reference backend on CPU vs GPU (bf16), teacher-forced as above.

    Nothing to tune here: it records how far two correct runs of one bf16 model drift
    apart on two devices, the scale against which the cuda-vs-reference numbers are read.
    """
    from workers.offline import LLM

    model = real_dims_models["deepseek_v32"]
    kw = dict(backend="reference", dtype="bfloat16", kv_cache_dtype="fp8", num_pages=64, chunk_size=128)
    gpu, cpu = LLM(model, device="cuda", **kw), LLM(model, device="cpu", **kw)
    prompts = _prompts()[:3]
    g_out = gpu.generate(prompts, max_new_tokens=12, ignore_eos=True)
    c_out = cpu.generate(prompts, max_new_tokens=12, ignore_eos=True)
    rel, flips = [], 0
    for p, cont in zip(prompts, g_out):
        lg, lc = teacher_forced_logits(gpu, p, cont), teacher_forced_logits(cpu, p, cont)
        rel += [float((lc[i] - lg[i]).abs().max() / lg[i].abs().max()) for i in range(len(cont))]
        flips += int((lc.argmax(-1) != lg.argmax(-1)).sum())
    print(f"NOISE reference cpu vs gpu bf16: greedy_equal={g_out == c_out} max_rel_err={max(rel):.3e} "
          f"argmax_disagreements={flips}/{len(rel)}")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 3])
def test_llm_cuda_mtp_greedy_equals_plain_gpu(k, real_dims_models):
    """MTP verification runs decode with next_n = k + 1 (native, per-token, pairs)."""
    model = real_dims_models["deepseek_v32"]
    assert llm_outputs(model, "cuda", "cuda", mtp_draft_tokens=k) == llm_outputs(model, "cuda", "cuda")


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
