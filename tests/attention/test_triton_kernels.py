"""Triton kernels of the ``cuda`` backend (``attention/cuda``) vs the torch reference.

Every check runs in two ways:

* ``test_*_interpreter``: CPU tensors through Triton's interpreter. It runs in a
  subprocess with ``TRITON_INTERPRET=1`` (this very file, run as a script),
  because the variable must be set before ``triton`` is imported and would
  otherwise leak into every other test of the session. One subprocess serves
  all the interpreter tests; shapes are tiny. These run in CI (CPU-only).
* ``test_*_gpu`` (``gpu`` mark): CUDA tensors through the compiled kernels, at
  serving-like shapes (k = 2048, pools beyond 2^31 bytes).

``test_kernels_compile_for_sm90`` compiles every kernel to an sm_90 cubin on
the CPU (Triton ships ptxas): it catches what the interpreter cannot see
(type unification of loop-carried values, unsupported ops in codegen).

Inputs are random with a fresh seed per run (``ATTN_TEST_SEED`` replays one);
outputs and untouched cache bytes are poisoned before a kernel writes them.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.triton_interpreter import compile_run, compiled, interpreter_run, report, results  # noqa: E402
from attention.formats import (  # noqa: E402
    PAGE_SIZE,
    IndexerFp8Format,
    MlaFp8Format,
    dequantize_mla_fp8,
    pack_indexer_page,
    quantize_indexer_fp8,
    quantize_mla_fp8,
    unpack_indexer_page,
)

SEED = int(os.environ.get("ATTN_TEST_SEED", secrets.randbits(31)))


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def random_bytes(shape, gen) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def distinct_slots(num_pages: int, n: int, gen, *, holes: int = 0) -> torch.Tensor:
    """``n`` distinct slots including the first and last of the pool, ``holes`` of them -1 (skip)."""
    last = num_pages * PAGE_SIZE - 1
    perm = torch.randperm(last - 1, generator=gen)[: n - 2] + 1
    slots = torch.cat([torch.tensor([0, last]), perm])[torch.randperm(n, generator=gen)]
    slots[torch.randperm(n, generator=gen)[:holes]] = -1
    return slots


def rounding_probe_values() -> torch.Tensor:
    """fp32 values in [-448, 448] that probe every float8_e4m3fn rounding decision.

    Every finite e4m3 value, every midpoint between neighbours (ties to even)
    and the fp32 neighbours of each midpoint, in both signs, plus the
    subnormal corner (2^-10 is the tie between 0 and the smallest subnormal).
    """
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7f is NaN
    vals = codes.view(torch.float8_e4m3fn).float()  # ascending, 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, 1e-45, 447.99997, 448.0])
    pos = torch.cat([vals, mids, up, down, tiny])
    return torch.cat([pos, -pos])


def random_bit_floats(n: int, gen, lo_exp: int, hi_exp: int) -> torch.Tensor:
    """fp32 with uniformly random mantissa bits, sign, and binary exponent in [lo_exp, hi_exp]."""
    mant = torch.randint(0, 1 << 23, (n,), generator=gen, dtype=torch.int64)
    exp = torch.randint(lo_exp + 127, hi_exp + 128, (n,), generator=gen, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64)
    bits = (sign << 31) | (exp << 23) | mant
    return bits.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits


def stable_topk_oracle(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> list[list[int]]:
    """Per row, the positions the documented rule selects, ascending.

    Candidates: t < length and logit != -inf. The k largest, ties broken by
    lower position (a stable descending sort), NaN largest, -0.0 == +0.0.
    """
    out = []
    for r in range(logits.shape[0]):
        n = int(lengths[r])
        v = logits[r, :n].double()
        cand = torch.nonzero(v != float("-inf")).flatten()
        order = torch.sort(v[cand], descending=True, stable=True).indices
        out.append(sorted(cand[order[:k]].tolist()))
    return out


def page_lookup(positions: torch.Tensor, page_table: torch.Tensor, rows_per_table: int) -> torch.Tensor:
    """int64 slots of valid positions ``[R, K]`` (>= 0, in the table) through ``page_table``."""
    rows = torch.arange(positions.shape[0], device=positions.device) // rows_per_table
    pages = page_table.long()[rows[:, None], positions.long() // PAGE_SIZE]
    return pages * PAGE_SIZE + positions.long() % PAGE_SIZE


# ---------------------------------------------------------------------------
# checks: each takes (device, gen, big) and raises AssertionError on mismatch
# ---------------------------------------------------------------------------


def check_fp8_rounding(device, gen, big):
    """Scale pinned to exactly 1 (one 448 per key): the kernel's rne cast == torch's, value by value."""
    from attention import cuda as ck

    D = 128
    probes = rounding_probe_values()
    per_row = D - 1
    n_rows = -(-probes.numel() // per_row)
    k = torch.zeros(n_rows * per_row)
    k[: probes.numel()] = probes
    k = torch.cat([torch.full((n_rows, 1), 448.0), k.view(n_rows, per_row)], dim=1)
    fmt = IndexerFp8Format(D)
    num_pages = -(-n_rows // PAGE_SIZE)
    pool = random_bytes((num_pages, fmt.bytes_per_page), gen)
    slots = torch.arange(n_rows)
    pool_d = pool.to(device)
    ck.write_indexer_fp8(pool_d, slots.to(device), k.to(device))
    got_k, got_s = unpack_indexer_page(pool_d.cpu(), fmt)
    got_k = got_k.reshape(-1, D)[:n_rows].view(torch.uint8)
    assert torch.all(got_s.reshape(-1)[:n_rows] == 1.0)
    want = k.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = torch.nonzero(got_k != want)
    assert bad.numel() == 0, (
        f"{bad.shape[0]} fp8 roundings differ, e.g. x={k[tuple(bad[0])].item()!r}: "
        f"got {got_k[tuple(bad[0])].item():#04x}, torch {want[tuple(bad[0])].item():#04x}"
    )


def check_mla_write(device, gen, big):
    from attention import cuda as ck

    n = 3000 if big else 21
    # (kv_lora_rank, rope_dim): the real 656-byte token, an unaligned tiny one
    # (scales at byte 100, rope at 2-byte alignment only), one with no rope.
    for r, d in [(512, 64), (100, 6), (130, 0)]:
        fmt = MlaFp8Format(r, d)
        num_pages = -(-n // PAGE_SIZE) + 2
        slots = distinct_slots(num_pages, n, gen, holes=3)
        # Wide dynamic range: tiles with a large amax push small elements into
        # the e4m3 subnormals; one all-zero tile and one all-zero token.
        latent = random_bit_floats(n * r, gen, -20, 14).view(n, r)
        latent[1] = 0
        latent[2, : min(r, 128)] = 0
        rope = random_bit_floats(n * max(d, 1), gen, -24, 14).view(n, max(d, 1))[:, :d]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            lat, rp = latent.to(dtype), rope.to(dtype)
            # The pool is layer 1 of a [pages, layers, 64, B] allocation, so the
            # page stride is not 64 * B and layer 0 must stay untouched.
            big_pool = random_bytes((num_pages, 2, PAGE_SIZE, fmt.bytes_per_token), gen)
            want = big_pool.clone()
            valid = slots >= 0
            layer = want[:, 1].reshape(-1, fmt.bytes_per_token)  # a copy: the slice is strided
            layer[slots[valid]] = quantize_mla_fp8(lat[valid], rp[valid], fmt)
            want[:, 1] = layer.view(num_pages, PAGE_SIZE, fmt.bytes_per_token)
            got = big_pool.to(device)
            # The FlashMLA (num_pages, 64, 1, B) view of that layer.
            ck.write_mla_fp8(got[:, 1].unsqueeze(2), slots.to(device), lat.to(device), rp.to(device), fmt)
            diff = torch.nonzero(got.cpu() != want)
            assert diff.numel() == 0, f"r={r} d={d} {dtype}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


def check_indexer_write(device, gen, big):
    from attention import cuda as ck

    n = 5000 if big else 40
    for D in (128, 24):
        fmt = IndexerFp8Format(D)
        num_pages = -(-n // PAGE_SIZE) + 1
        slots = distinct_slots(num_pages, n, gen, holes=2)
        k = random_bit_floats(n * D, gen, -12, 12).view(n, D)
        k[3] = 0
        for dtype in (torch.float32, torch.bfloat16):
            kk = k.to(dtype)
            pool = random_bytes((num_pages, fmt.bytes_per_page), gen)
            kf, ks = unpack_indexer_page(pool, fmt)
            kf, ks = kf.clone().reshape(-1, D), ks.clone().reshape(-1)
            valid = slots >= 0
            qk, qs = quantize_indexer_fp8(kk[valid])
            kf[slots[valid]] = qk
            ks[slots[valid]] = qs
            want = pack_indexer_page(kf.view(num_pages, PAGE_SIZE, D), ks.view(num_pages, PAGE_SIZE))
            got = pool.to(device)
            # DeepGEMM's (num_pages, 64, 1, D + 4) view of the same bytes.
            ck.write_indexer_fp8(got.view(num_pages, PAGE_SIZE, 1, D + 4), slots.to(device), kk.to(device), fmt)
            diff = torch.nonzero(got.cpu() != want)
            assert diff.numel() == 0, f"D={D} {dtype}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


def check_mla_dequant(device, gen, big):
    from attention import cuda as ck

    for r, d in [(512, 64), (100, 6)]:
        fmt = MlaFp8Format(r, d)
        num_pages = 40 if big else 3
        n_tok = num_pages * PAGE_SIZE
        pool = quantize_mla_fp8(
            random_bit_floats(n_tok * r, gen, -20, 20).view(n_tok, r),
            torch.randn(n_tok, d, generator=gen), fmt,
        ).view(num_pages, PAGE_SIZE, fmt.bytes_per_token)
        lat, rope = dequantize_mla_fp8(pool, fmt)
        table = torch.cat([lat, rope], dim=1).to(torch.bfloat16)  # reference, row = slot

        n = 1000 if big else 13
        slots = torch.randint(0, n_tok, (n,), generator=gen)  # repeats allowed for reads
        slots[torch.randperm(n, generator=gen)[:2]] = -1
        want = torch.where((slots >= 0)[:, None], table[slots.clamp(min=0)], torch.zeros((), dtype=torch.bfloat16))
        pool_d = pool.to(device)
        got = ck.dequantize_mla_fp8(pool_d, slots.to(device), fmt).cpu()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"r={r} d={d}: slot gather differs"

        # Whole pages into a slice of a persistent, poisoned workspace.
        pages = torch.tensor([num_pages - 1, -1, 0])
        ws = torch.full((5 * PAGE_SIZE, r + d), float("nan"), dtype=torch.bfloat16, device=device)
        out = ck.dequantize_mla_fp8_pages(pool_d, pages.to(device), fmt, out=ws[PAGE_SIZE : 4 * PAGE_SIZE])
        assert out.data_ptr() == ws[PAGE_SIZE].data_ptr()
        ps = ck.page_slots(pages)
        want = torch.where((ps >= 0)[:, None], table[ps.clamp(min=0)], torch.zeros((), dtype=torch.bfloat16))
        ws = ws.cpu()
        assert torch.equal(ws[PAGE_SIZE : 4 * PAGE_SIZE].view(torch.int16), want.view(torch.int16))
        assert ws[:PAGE_SIZE].isnan().all() and ws[4 * PAGE_SIZE :].isnan().all(), "wrote outside out="


def check_indexer_gather(device, gen, big):
    from attention import cuda as ck

    D = 128
    fmt = IndexerFp8Format(D)
    num_pages = 30 if big else 2
    pool = random_bytes((num_pages, fmt.bytes_per_page), gen)
    kf, ks = unpack_indexer_page(pool, fmt)
    n = 700 if big else 9
    slots = torch.randint(0, num_pages * PAGE_SIZE, (n,), generator=gen)
    slots[0] = -1
    gk, gs = ck.gather_indexer_fp8(pool.to(device), slots.to(device), fmt)
    c = slots.clamp(min=0)
    want_k = kf.reshape(-1, D)[c].view(torch.uint8).clone()
    want_k[0] = 0
    want_s = ks.reshape(-1)[c].clone()
    want_s[0] = 0
    assert torch.equal(gk.cpu().view(torch.uint8), want_k)
    assert torch.equal(gs.cpu().view(torch.int32), want_s.view(torch.int32))  # bitwise (NaN bytes too)


def check_index_transform(device, gen, big):
    from attention import cuda as ck

    B, next_n, max_pages = (64, 2, 600) if big else (3, 2, 5)
    R = B * next_n
    K = 2048 if big else 40
    page_table = torch.randperm(B * max_pages * 2, generator=gen)[: B * max_pages].view(B, max_pages).int()
    page_table[0, 1] = -1  # a hole in the table
    ctx = max_pages * PAGE_SIZE + 10  # some positions fall past the table's width
    positions = torch.randint(-1, ctx, (R, K), generator=gen, dtype=torch.int32)
    lengths = torch.randint(1, ctx, (R,), generator=gen, dtype=torch.int32)

    for lens in (None, lengths):
        p = positions.long()
        valid = (p >= 0) & (p < max_pages * PAGE_SIZE)
        if lens is not None:
            valid &= p < lens[:, None]
        safe = torch.where(valid, p, 0)
        pages = page_table.long()[(torch.arange(R) // next_n)[:, None], safe // PAGE_SIZE]
        valid &= pages >= 0
        want = torch.where(valid, page_lookup(safe, page_table, next_n), -1).int()
        out = torch.full((R, K), 12345, dtype=torch.int32, device=device)
        got = ck.positions_to_slots(
            positions.to(device), page_table.to(device), rows_per_table=next_n,
            lengths=None if lens is None else lens.to(device), out=out,
        )
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(got.cpu(), want), f"lengths={'yes' if lens is not None else 'no'}"
    # int64 positions, one table row per position row.
    got = ck.positions_to_slots(positions[:B].long().to(device), page_table.to(device))
    p = positions[:B].long()
    ok = (p >= 0) & (p < max_pages * PAGE_SIZE)
    pages = page_table.long()[torch.arange(B)[:, None], torch.where(ok, p, 0) // PAGE_SIZE]
    want = torch.where(ok & (pages >= 0), page_lookup(torch.where(ok, p, 0), page_table, 1), -1).int()
    assert torch.equal(got.cpu(), want)


def _topk_case(device, gen, logits, lengths, k, rows_per_table, block, label):
    from attention import cuda as ck

    R, L = logits.shape
    max_pages = -(-L // PAGE_SIZE)
    T = -(-R // rows_per_table)
    page_table = torch.randperm(T * max_pages * 3, generator=gen)[: T * max_pages].view(T, max_pages).int()
    pos, slots = ck.topk_slots(
        logits.to(device), lengths.to(device), k, page_table.to(device),
        rows_per_table=rows_per_table, return_positions=True, block=block, method="fused",
    )
    pos, slots = pos.cpu(), slots.cpu()
    if label == "random":  # the page-table-free entry point runs the same kernel
        plain = ck.topk_positions(logits.to(device), lengths.to(device), k, block=block, method="fused").cpu()
        assert torch.equal(plain, pos), f"{label}: topk_positions != topk_slots positions"
    assert pos.shape == slots.shape == (R, k) and pos.dtype == slots.dtype == torch.int32
    want = stable_topk_oracle(logits, lengths, k)
    for r in range(R):
        cnt = len(want[r])
        got_r = pos[r, :cnt].tolist()
        assert got_r == want[r], f"{label}: row {r} (len {int(lengths[r])}) selects a different set"
        assert torch.all(pos[r, cnt:] == -1) and torch.all(slots[r, cnt:] == -1), f"{label}: row {r} padding"
        # Same multiset of values as torch.topk over the candidates (ties aside,
        # the same set: the reference's definition).
        v = logits[r, : int(lengths[r])]
        v = v[v != float("-inf")]
        ref_vals = torch.topk(v, cnt).values if cnt else v[:0]
        got_vals = logits[r, pos[r, :cnt].long()]
        torch.testing.assert_close(
            torch.sort(got_vals).values, torch.sort(ref_vals).values, rtol=0, atol=0, equal_nan=True,
            msg=f"{label}: row {r} values",
        )
        if cnt and (cnt == v.numel() or ref_vals.min() > v.sort(descending=True).values[cnt]):
            # No tie at the threshold: exactly torch.topk's index set.
            idx = torch.nonzero(logits[r, : int(lengths[r])] != float("-inf")).flatten()
            ref_set = set(idx[torch.topk(v, cnt).indices].tolist())
            assert set(got_r) == ref_set, f"{label}: row {r} differs from torch.topk"
    valid = pos >= 0
    want_slots = page_lookup(torch.where(valid, pos, 0), page_table, rows_per_table)
    assert torch.equal(slots[valid].long(), want_slots[valid]), f"{label}: slots through the page table"


def check_topk(device, gen, big):
    if big:
        R, L, k, block = 64, 70_000, 2048, 1024
    else:
        R, L, k, block = 6, 1200, 100, 512
    # Random logits; row lengths around k (below, equal, just above) and long.
    logits = torch.randn(R, L, generator=gen)
    lengths = torch.randint(k + 1, L + 1, (R,), generator=gen, dtype=torch.int32)
    lengths[0], lengths[1], lengths[2], lengths[3] = 0, k - 7, k, k + 1
    # Poison past each row's length: never read, so never selected.
    past = torch.arange(L)[None, :] >= lengths[:, None].long()
    logits = torch.where(past, torch.full_like(logits, float("nan")), logits)
    logits[4, past[4]] = float("inf")
    _topk_case(device, gen, logits, lengths, k, 1, block, "random")

    # Heavy ties (a handful of integer levels), -0.0 vs +0.0, -inf holes and a
    # NaN; MTP-style rows sharing a table row.
    levels = torch.randint(-2, 3, (R, L), generator=gen).float()
    levels[levels == 0] = torch.where(torch.rand((levels == 0).sum(), generator=gen) < 0.5, -0.0, 0.0)
    levels[torch.rand(R, L, generator=gen) < 0.2] = float("-inf")
    levels[5, 7] = float("nan")
    lengths = torch.full((R,), L, dtype=torch.int32)
    lengths[1] = k + 3  # few candidates left after the -inf holes
    _topk_case(device, gen, levels, lengths, k, 2, block, "ties")

    # Every logit equal (the whole row is the tie group), and a row of all -inf.
    same = torch.full((2, L), 0.5)
    same[1] = float("-inf")
    _topk_case(device, gen, same, torch.tensor([L, L], dtype=torch.int32), k, 1, block, "constant")

    # Exactly k logits far above the rest: the first pass's bin is taken whole
    # (early exit), so the remaining passes are skipped.
    exact = torch.randn(1, L, generator=gen)
    exact[0, torch.randperm(L, generator=gen)[:k]] = 100.0 + torch.rand(k, generator=gen)
    _topk_case(device, gen, exact, torch.tensor([L], dtype=torch.int32), k, 1, block, "exact")

    # Values differing only in the lowest key bits: all four radix passes run.
    base = torch.full((1, L), 1.0).view(torch.int32)
    close = (base + torch.randint(0, 300, (1, L), generator=gen, dtype=torch.int32)).view(torch.float32)
    _topk_case(device, gen, close, torch.tensor([L], dtype=torch.int32), k, 1, block, "close")


def expected_slots(positions: torch.Tensor, page_table: torch.Tensor, rows_per_table: int) -> torch.Tensor:
    """int32 slots of ``positions`` (``-1`` padded) by the kernels' rule: ``-1`` where the page is missing."""
    valid = positions >= 0
    page_idx = torch.where(valid, positions.long() // PAGE_SIZE, 0)
    inside = page_idx < page_table.shape[1]
    rows = torch.arange(positions.shape[0]) // rows_per_table
    table = page_table.long() if page_table.shape[1] else torch.full((page_table.shape[0], 1), -1)
    page = torch.where(inside, table[rows[:, None], torch.where(inside, page_idx, 0)], -1)
    ok = valid & (page >= 0)
    return torch.where(ok, page * PAGE_SIZE + positions.long() % PAGE_SIZE, -1).int()


def _sampled_case(device, gen, logits, lengths, k, label, *, rows_per_table=1, configs, page_table=None,
                  entry_points=False):
    """The sampled top-k == the fused top-k, bit for bit (slots and positions, every entry point), == the oracle."""
    from attention.cuda import topk as tk

    slots_fn, positions_fn = tk.topk_slots_sampled, tk.topk_positions_sampled

    R, L = logits.shape
    if page_table is None:
        T = -(-R // rows_per_table)
        max_pages = -(-L // PAGE_SIZE)
        page_table = torch.randperm(T * max_pages * 3, generator=gen)[: T * max_pages].view(T, max_pages).int()
    lg, ln, bt = logits.to(device), lengths.to(device), page_table.to(device)
    kw = dict(rows_per_table=rows_per_table, return_positions=True)
    want_pos, want_slots = tk.topk_slots(lg, ln, k, bt, method="fused", **kw)
    want_pos, want_slots = want_pos.cpu(), want_slots.cpu()
    for i, cfg in enumerate(configs):
        got_pos, got_slots = slots_fn(lg, ln, k, bt, **kw, **cfg)
        got_pos, got_slots = got_pos.cpu(), got_slots.cpu()
        for r in range(R):
            assert torch.equal(got_pos[r], want_pos[r]), (
                f"{label} {cfg}: row {r} (len {int(lengths[r])}) positions differ from the fused kernel: "
                f"first at {torch.nonzero(got_pos[r] != want_pos[r])[0].item()}")
        assert torch.equal(got_slots, want_slots), f"{label} {cfg}: slots differ from the fused kernel"
        if not (entry_points and i == 0):
            continue
        only_slots = slots_fn(lg, ln, k, bt, rows_per_table=rows_per_table, **cfg).cpu()
        assert torch.equal(only_slots, want_slots), f"{label} {cfg}: slots without positions"
        only_pos = positions_fn(lg, ln, k, **cfg).cpu()
        assert torch.equal(only_pos, want_pos), f"{label} {cfg}: topk_positions_sampled"
    want = stable_topk_oracle(logits, lengths.clamp(0, L), k)
    for r in range(R):
        cnt = len(want[r])
        assert want_pos[r, :cnt].tolist() == want[r], f"{label}: row {r} selects a different set"
        assert torch.all(want_pos[r, cnt:] == -1), f"{label}: row {r} padding"
    assert torch.equal(want_slots, expected_slots(want_pos, page_table, rows_per_table)), f"{label}: slots"


def check_topk_sampled(device, gen, big):
    """The sampled top-k (threshold from a sample, one compaction, exact select
    of the candidates; the fused select where the sample missed) against the
    fused kernel and the oracle, bit for bit, on rows that take each path."""
    from attention.cuda import topk as tk

    if big:
        R, L, k = 128, 49_152, 2048
        configs = [{}, {"sample": 4096}, {"seg": 8192, "block": 4096, "num_warps": 16}]
        lengths = torch.randint(16_384, L + 1, (R,), generator=gen, dtype=torch.int32)
        small = {}
    else:
        R, L, k = 12, 320, 24
        configs = [{"sample": 64, "cap": 64, "seg": 32, "block": 16, "num_warps": 4},
                   {"sample": 32, "cap": 32, "seg": 64, "block": 64, "num_warps": 4}]
        lengths = torch.randint(k + 1, L + 1, (R,), generator=gen, dtype=torch.int32)
        small = configs[0]
    cap = small.get("cap", tk.SAMPLED_DEFAULTS["cap"])
    sample = small.get("sample", tk.SAMPLED_DEFAULTS["sample"])

    def paths(logits, lengths):
        """(rows the candidates served, rows that fell back) at the first config."""
        lg = logits.to(device)
        pos = torch.empty(lg.shape[0], k, dtype=torch.int32, device=device)
        thr, cnt = tk._launch_sampled(lg, lengths.to(device), k, None, 1, None, pos, **small)
        back = tk.sampled_fallback_rows(thr.cpu(), cnt.cpu(), k, cap)
        return int((~back).sum()), int(back.sum())

    # Random rows (the candidate path), rows around k and cap, lengths past L
    # and negative, poison past each length, a NaN, -inf holes, a narrow block
    # table with -1 holes; one row whose sampled positions hold the largest
    # logits (the sample overestimates the threshold: fewer than k candidates,
    # the row usually falls back; seed 1590438618 gave it 28 candidates), and one row of a single
    # value (its tie group overflows cap: it always falls back).
    lengths[:8] = torch.tensor([0, k - 7, k, k + 1, cap, cap + 1, L + 5, -3], dtype=torch.int32)
    lengths[R - 3] = lengths[R - 2] = L
    logits = torch.randn(R, L, generator=gen)
    past = torch.arange(L)[None, :] >= lengths.clamp(0, L)[:, None].long()
    logits = torch.where(past, torch.full_like(logits, float("nan")), logits)
    logits[4, past[4]] = float("inf")
    logits[R - 1, 3] = float("nan")
    logits[torch.rand(R, L, generator=gen) < 0.05] = float("-inf")
    sampled_at = (torch.arange(sample) * L) // sample
    logits[R - 2, sampled_at] = 50.0 + torch.rand(sample, generator=gen)
    logits[R - 3] = 0.5
    max_pages = -(-L // PAGE_SIZE)
    table = torch.randperm(R * max_pages * 2, generator=gen)[: R * (max_pages - 2)].view(R, max_pages - 2).int()
    table[torch.rand(table.shape, generator=gen) < 0.1] = -1
    served, fell_back = paths(logits, lengths)
    assert served >= R // 2 and fell_back >= 1, f"random rows: {served} served by the candidates, {fell_back} fell back"
    _sampled_case(device, gen, logits, lengths, k, "sampled random", configs=configs, page_table=table,
                entry_points=True)
    configs = configs[:1]

    # Heavy ties: the threshold's tie group overflows cap (fallback) or fits;
    # MTP rows share a table row.
    levels = torch.randint(-2, 3, (R, L), generator=gen).float()
    levels[levels == 0] = torch.where(torch.rand(int((levels == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    levels[torch.rand(R, L, generator=gen) < 0.2] = float("-inf")
    lengths = torch.full((R,), L, dtype=torch.int32)
    lengths[1] = k + 3
    lengths[2] = 3 * k
    _sampled_case(device, gen, levels, lengths, k, "sampled ties", rows_per_table=3, configs=configs)

    # A whole-row tie group under k/2 larger logits, rows of one value, of
    # -inf only, of NaN only; exactly k logits far above the rest; values
    # differing only in the lowest key bits; bf16-rounded logits.
    tie = torch.full((4, L), 0.25)
    for r in range(4):
        tie[r, torch.randperm(L, generator=gen)[: k // 2]] = 1.0 + torch.rand(k // 2, generator=gen)
    tie[1] = 0.25
    tie[2] = float("-inf")
    tie[3] = float("nan")
    _sampled_case(device, gen, tie, torch.full((4,), L, dtype=torch.int32), k, "sampled tie group", configs=configs)
    exact = torch.randn(3, L, generator=gen)
    exact[0, torch.randperm(L, generator=gen)[:k]] = 100.0 + torch.rand(k, generator=gen)
    base = torch.full((1, L), 1.0).view(torch.int32)
    exact[1] = (base + torch.randint(0, 300, (1, L), generator=gen, dtype=torch.int32)).view(torch.float32)
    exact[2] = torch.randn(L, generator=gen).to(torch.bfloat16).float()
    _sampled_case(device, gen, exact, torch.full((3,), L, dtype=torch.int32), k, "sampled exact/close/bf16",
                configs=configs)

    # method="auto" takes the sampled kernels (their defaults) for rows of >= SAMPLED_MIN_LEN logits.
    saved = tk.SAMPLED_MIN_LEN
    try:
        tk.SAMPLED_MIN_LEN = L
        assert tk._pick_method("auto", L, 2) == "sampled" and tk._pick_method("auto", L - 1, 2) == "fused"
        assert tk._pick_method("fused", L, 2) == "fused" and tk._pick_method("sampled", 1, 2) == "sampled"
        lg, ln = exact.to(device), torch.full((3,), L, dtype=torch.int32, device=device)
        auto = tk.topk_positions(lg, ln, k)
        assert torch.equal(auto.cpu(), tk.topk_positions(lg, ln, k, method="fused").cpu()), "auto dispatch"
    finally:
        tk.SAMPLED_MIN_LEN = saved
    with pytest.raises(ValueError, match="method must be one of"):
        tk._pick_method("split", L, 2)


CHECKS = {
    "fp8_rounding": check_fp8_rounding,
    "mla_write": check_mla_write,
    "indexer_write": check_indexer_write,
    "mla_dequant": check_mla_dequant,
    "indexer_gather": check_indexer_gather,
    "index_transform": check_index_transform,
    "topk": check_topk,
    "topk_sampled": check_topk_sampled,
}


def run_check(name: str, device: str, seed: int, big: bool) -> None:
    gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
    CHECKS[name](device, gen, big)


# ---------------------------------------------------------------------------
# interpreter mode: one subprocess runs every check on CPU tensors
# ---------------------------------------------------------------------------


def _worker_main(argv: list[str]) -> None:
    """``python test_triton_kernels.py SEED``: run CHECKS in the interpreter, print JSON results."""
    seed = int(argv[0])
    report({name: (lambda n=name: run_check(n, "cpu", seed, big=False)) for name in CHECKS})


PRESTART = {"interpreter_results": lambda: interpreter_run(__file__, SEED),
            "test_kernels_compile_for_sm90": lambda: compile_run(__file__)}
"""The subprocesses this module reads, started early (tests/prestart.py)."""


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    return results(interpreter_run(__file__, SEED))


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_interpreter(name, interpreter_results):
    result = interpreter_results[name]
    assert result == "ok", f"ATTN_TEST_SEED={SEED}\n{result}"


# ---------------------------------------------------------------------------
# compiled, on the GPU
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_gpu(name):
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET for the GPU tests"
    print(f"ATTN_TEST_SEED={SEED}")
    run_check(name, "cuda", SEED, big=True)


@pytest.mark.gpu
def test_pool_beyond_2_31_bytes_gpu():
    """Slots whose byte offset exceeds 2^31 (int64 addressing) in a 2.1 GB MLA pool."""
    from attention import cuda as ck

    fmt = MlaFp8Format(512, 64)
    num_pages = (2**31 // fmt.bytes_per_page) + 300
    pool = torch.zeros(num_pages, PAGE_SIZE, fmt.bytes_per_token, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(SEED)
    n = 200
    slots = torch.cat([torch.arange(5), num_pages * PAGE_SIZE - 1 - torch.randperm(250 * PAGE_SIZE, generator=gen)[: n - 5]])
    assert int(slots.max()) * fmt.bytes_per_token > 2**31
    latent = torch.randn(n, 512, generator=gen)
    rope = torch.randn(n, 64, generator=gen)
    ck.write_mla_fp8(pool, slots.cuda(), latent.cuda(), rope.cuda())
    want = quantize_mla_fp8(latent, rope, fmt)
    got_bytes = pool.view(-1, fmt.bytes_per_token)[slots.cuda()].cpu()
    assert torch.equal(got_bytes, want)
    got = ck.dequantize_mla_fp8(pool, slots.cuda(), fmt).cpu()
    lat, rp = dequantize_mla_fp8(want, fmt)
    assert torch.equal(got.view(torch.int16), torch.cat([lat, rp], 1).to(torch.bfloat16).view(torch.int16))


@pytest.mark.gpu
def test_topk_sampled_cuda_graph_gpu():
    """The sampled top-k captured in a CUDA graph (scratch allocated in capture, no host sync),
    replayed on new data."""
    from attention.cuda import topk as tk

    fn = tk.topk_slots_sampled

    gen = torch.Generator().manual_seed(SEED)
    R, L, k = 128, 49_152, 2048
    max_pages = L // PAGE_SIZE
    logits = torch.randn(R, L, generator=gen).cuda()
    lengths = torch.randint(16_384, L + 1, (R,), generator=gen, dtype=torch.int32).cuda()
    bt = torch.randperm(R * max_pages * 2, generator=gen)[: R * max_pages].view(R, max_pages).int().cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn(logits, lengths, k, bt, return_positions=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pos, slots = fn(logits, lengths, k, bt, return_positions=True)
    for trial in range(3):
        logits.copy_(torch.randn(R, L, generator=gen).to(torch.bfloat16).float())  # ties too
        lengths.copy_(torch.randint(0, L + 1, (R,), generator=gen, dtype=torch.int32))
        graph.replay()
        want_pos, want_slots = tk.topk_slots(logits, lengths, k, bt, return_positions=True, method="fused")
        assert torch.equal(pos, want_pos) and torch.equal(slots, want_slots), f"replay {trial}"


# ---------------------------------------------------------------------------
# compiles for sm_90 without a GPU
# ---------------------------------------------------------------------------


def _compile_worker() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attention.cuda import cache_write, dequant, index_transform, topk

    def compile_one(fn, sig, consts, num_warps):
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    i64, i32 = "i64", "i32"
    mla = dict(R=512, D=64, NT=4, NT_P2=4, D_P2=64, TILE=128, PAGE=64, BLOCK_T=8)
    for lat_t in ("*fp32", "*bf16"):
        compile_one(
            cache_write._write_mla_fp8_kernel,
            dict(pool_ptr="*u8", page_stride=i64, token_stride=i64, slots_ptr="*i64", n_tokens=i32,
                 latent_ptr=lat_t, latent_stride=i64, rope_ptr=lat_t, rope_stride=i64),
            dict(mla, LATENT_BF16=lat_t == "*bf16", ROPE_BF16=lat_t == "*bf16"), 4,
        )
    compile_one(
        cache_write._write_indexer_fp8_kernel,
        dict(pool_ptr="*u8", page_stride=i64, slots_ptr="*i32", n_tokens=i32, k_ptr="*bf16", k_stride=i64),
        dict(HD=128, HD_P2=128, PAGE=64, K_BF16=True, BLOCK_T=16), 4,
    )
    compile_one(
        dequant._dequant_mla_fp8_kernel,
        dict(pool_ptr="*u8", page_stride=i64, token_stride=i64, slots_ptr="*i64", n_tokens=i32,
             out_ptr="*i16", out_stride=i64),
        mla, 4,
    )
    compile_one(
        dequant._gather_indexer_fp8_kernel,
        dict(pool_ptr="*u8", page_stride=i64, slots_ptr="*i64", n_tokens=i32, k_out_ptr="*u8",
             k_out_stride=i64, scale_out_ptr="*i32"),
        dict(HD=128, HD_P2=128, PAGE=64, BLOCK_T=16), 4,
    )
    compile_one(
        index_transform._positions_to_slots_kernel,
        dict(pos_ptr="*i32", pos_stride=i64, out_ptr="*i32", out_stride=i64, K=i32, bt_ptr="*i32",
             bt_stride=i64, bt_cols=i32, rows_per_table=i32, lengths_ptr="*i32"),
        dict(HAS_LENGTHS=True, PAGE=64, BLOCK=256), 4,
    )
    for write_slots in (True, False):
        compile_one(
            topk._topk_kernel,
            dict(logits_ptr="*fp32", logits_stride=i64, L=i32, lengths_ptr="*i32", K=i32, bt_ptr="*i32",
                 bt_stride=i64, bt_cols=i32, rows_per_table=i32, slots_ptr="*i32", pos_ptr="*i32",
                 out_stride=i64),
            dict(WRITE_SLOTS=write_slots, WRITE_POS=True, PAGE=64, BLOCK=1024), 8,
        )
    # The sampled top-k's four kernels, at the defaults and at the interpreter tests' small config.
    for sample, cap, seg, block, warps in ((2048, 4096, 4096, 2048, 8), (64, 64, 32, 16, 4)):
        compile_one(topk._sample_threshold_kernel,
                    dict(logits_ptr="*fp32", logits_stride=i64, L=i32, lengths_ptr="*i32", K=i32, thr_ptr="*i32"),
                    dict(SAMPLE=sample, CAP=cap), warps)
        compile_one(topk._sample_count_kernel,
                    dict(logits_ptr="*fp32", logits_stride=i64, L=i32, lengths_ptr="*i32", thr_ptr="*i32",
                         cnt_ptr="*i32", NSEG=i32),
                    dict(SEG=seg, BLOCK=block), warps)
        compile_one(topk._sample_compact_kernel,
                    dict(logits_ptr="*fp32", logits_stride=i64, L=i32, lengths_ptr="*i32", thr_ptr="*i32",
                         cnt_ptr="*i32", NSEG=i32, cand_ptr="*i32", cand_plane=i32),
                    dict(SEG=seg, BLOCK=block, CAP=cap, NSEG_P2=16), warps)
        for write_slots in (True, False):
            compile_one(topk._sample_select_kernel,
                        dict(logits_ptr="*fp32", logits_stride=i64, L=i32, lengths_ptr="*i32", K=i32, thr_ptr="*i32",
                             cnt_ptr="*i32", NSEG=i32, cand_ptr="*i32", cand_plane=i32, bt_ptr="*i32",
                             bt_stride=i64, bt_cols=i32, rows_per_table=i32, slots_ptr="*i32", pos_ptr="*i32",
                             out_stride=i64),
                        dict(WRITE_SLOTS=write_slots, WRITE_POS=True, PAGE=64, CAP=cap, NSEG_P2=16, BLOCK=block), warps)
    print("COMPILED")


def test_kernels_compile_for_sm90():
    compiled(compile_run(__file__))


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile"]:
        _compile_worker()
    else:
        _worker_main(sys.argv[1:])
