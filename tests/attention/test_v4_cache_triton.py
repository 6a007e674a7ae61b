"""The Triton V4 cache kernels (``attention/cuda/v4_cache_ops.py``) against the torch spec
(``attention/v4_format.py``, ``attention/v4_index_format.py``).

* ``test_v4_cache_interpreter``: CPU tensors through Triton's interpreter (this file run as a script with
  ``TRITON_INTERPRET=1``), fresh random inputs each run (``V4CACHE_TEST_SEED`` replays one): for the
  584-byte V4 token and the fp8 indexer key, the Triton write equals torch's byte for byte over a
  poisoned pool (every byte the write must not touch keeps its poison: page padding, other slots, the
  gap between strided pages), the Triton read equals torch's bit for bit (of written tokens, and of
  random bytes: NaN codes, scale bytes 0 and 255), at random slots in random pages with ``-1`` holes,
  n not a multiple of the block, fp32 / bf16 / fp16 inputs, and values at the scale extremes (zero
  tiles, tiles under the 1e-4 floor, huge, mixed signs, every amax from 448 * 2^k a few ulps either
  side, where torch's fp32 ``log2`` is not the exact one); and ``GroupedPagedCache`` routed through
  the kernels equals it on torch.
* ``test_v4_cache_compiles_for_sm90``: every kernel compiles to an sm_90 cubin on the CPU.
* ``test_*_gpu`` (``gpu`` mark): the same checks on CUDA at serving-like sizes, and a pool past 2^31 bytes.
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

pytest.importorskip("triton")

from tests.triton_interpreter import compile_run, compile_sm90, compiled, kernel_suite, worker_main  # noqa: E402
from attention.v4_format import V4CacheFormat, read_tokens, read_v4, write_tokens, write_v4  # noqa: E402
from attention.v4_index_format import V4IndexFormat  # noqa: E402

SEED = int(os.environ.get("V4CACHE_TEST_SEED", secrets.randbits(31)))

V4 = V4CacheFormat()
INDEX = V4IndexFormat()


# -- inputs ---------------------------------------------------------------------------------------


def distinct_slots(num_pages: int, page_tokens: int, n: int, gen, holes: int) -> torch.Tensor:
    """``n`` distinct slots including the pool's first and last, ``holes`` of them ``-1``."""
    last = num_pages * page_tokens - 1
    slots = torch.cat([torch.tensor([0, last]), torch.randperm(last - 1, generator=gen)[:n - 2] + 1])
    slots = slots[torch.randperm(n, generator=gen)]
    slots[torch.randperm(n, generator=gen)[:holes]] = -1
    return slots


def near_pow2_amax(count: int, gen) -> torch.Tensor:
    """fp32 ``448 * 2^k`` moved 0..24 ulps up or down, k in [-40, 100]: amaxes whose ``amax / 448`` lies at
    or just beside a power of two (where ``ceil(log2(.))`` turns)."""
    k = torch.randint(-40, 101, (count,), generator=gen).float()
    base = (448.0 * torch.exp2(k)).view(torch.int32)
    step = torch.randint(-24, 25, (count,), generator=gen, dtype=torch.int32)
    return (base + step).view(torch.float32)


def tokens(n: int, width: int, tile: int, gen) -> torch.Tensor:
    """fp32 ``[n, width]``: each ``tile``-wide group a random magnitude, with rows and tiles at the
    extremes (zeros, -0.0, under the 1e-4 floor, huge, mixed signs, amax at 448 * 2^k +- ulps)."""
    tiles = -(-width // tile)
    mag = torch.exp2(torch.randint(-30, 30, (n, tiles), generator=gen).float())
    x = torch.randn(n, tiles, tile, generator=gen) * mag[..., None]
    kinds = torch.randint(0, 8, (n, tiles), generator=gen)
    x[kinds == 1] = 0.0
    x[kinds == 2] = -0.0
    x[kinds == 3] *= 1e-12  # amax under the floor: the floor's scale
    x[kinds == 4] = torch.randn(int((kinds == 4).sum()), tile, generator=gen) * 1e36  # huge
    edge = kinds == 5  # the tile's amax exactly at a power-of-two boundary (+- ulps), either sign
    amax = near_pow2_amax(int(edge.sum()), gen)
    sub = torch.rand(int(edge.sum()), tile, generator=gen) * amax[:, None] * (torch.randint(0, 2, (int(edge.sum()), tile), generator=gen) * 2 - 1)
    sub[:, 0] = amax * (1 - 2 * torch.randint(0, 2, (int(edge.sum()),), generator=gen))
    x[edge] = sub
    x = x.reshape(n, tiles * tile)[:, :width].contiguous()
    if n > 3:
        x[0] = 0.0
        x[1] = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45]).repeat(width // 4 + 1)[:width]
        x[2] = near_pow2_amax(width, gen)
    return x


def poisoned_buffer(num_pages: int, fmt, gap: int, gen, device) -> torch.Tensor:
    """uint8 ``[num_pages, fmt.page_bytes + gap]`` of random bytes: a pool's pages (`pool_of`) with ``gap``
    poisoned bytes after each (one layer's pages inside a grouped cache's pages are so spaced)."""
    return torch.randint(0, 256, (num_pages, fmt.page_bytes + gap), generator=gen, dtype=torch.uint8).to(device)


def pool_of(buf: torch.Tensor, fmt) -> torch.Tensor:
    return buf[:, :fmt.page_bytes]


def torch_write(buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt) -> None:
    """The spec's write into `pool_of` ``buf``: `write_v4` when the pages are adjacent, else `write_tokens`
    at each page's byte base (how ``GroupedPagedCache`` places a layer's pages)."""
    if buf.shape[1] == fmt.page_bytes:
        write_v4(buf, slots, x, fmt)
        return
    keep = slots >= 0
    s = slots[keep].long()
    write_tokens(buf.view(-1), s // fmt.page_tokens * buf.stride(0), s % fmt.page_tokens, x[keep], fmt)


def torch_read(buf: torch.Tensor, slots: torch.Tensor, fmt) -> torch.Tensor:
    if buf.shape[1] == fmt.page_bytes:
        return read_v4(buf, slots, fmt)
    keep = slots >= 0
    s = torch.where(keep, slots, 0).long()
    got = read_tokens(buf.view(-1), s // fmt.page_tokens * buf.stride(0), s % fmt.page_tokens, fmt)
    return torch.where(keep[:, None], got, 0.0)


def same_floats(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bit for bit, except that any NaN equals any NaN (payloads are not specified)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32, (what, got.shape, want.shape)
    gn, wn = got.isnan(), want.isnan()
    assert torch.equal(gn, wn), f"{what}: NaN at different places"
    bad = (got.view(torch.int32) != want.view(torch.int32)) & ~gn
    assert not bad.any(), (f"{what}: {int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}: "
                           f"{got[bad][:4].tolist()} vs {want[bad][:4].tolist()}")


# -- checks: (gen, device, big) ----------------------------------------------------------------------


def _write_read_case(fmt, gen, device, num_pages: int, n: int, holes: int, gap: int, dtype) -> None:
    from attention.cuda import v4_cache_ops as ops

    tile = 64 if isinstance(fmt, V4CacheFormat) else fmt.head_dim
    fmax = torch.finfo(dtype).max  # finite inputs only (the kernels do not claim torch's inf / NaN handling)
    x = tokens(n, fmt.head_dim, tile, gen).clamp(-fmax, fmax).to(dtype).to(device)
    slots = distinct_slots(num_pages, fmt.page_tokens, n, gen, holes).to(device)
    buf = poisoned_buffer(num_pages, fmt, gap, gen, device)
    want, before = buf.clone(), buf.clone()
    ops.write_pages(pool_of(buf, fmt), slots, x, fmt)
    torch_write(want, slots, x, fmt)
    what = f"{fmt.describe()} {dtype} gap {gap}"
    diff = buf != want
    assert not diff.any(), f"{what}: {int(diff.sum())} bytes differ, first at {diff.nonzero()[0].tolist()}"
    # Only the written tokens' bytes changed (both writers agree, so this guards the spec's placement too).
    assert int((buf != before).sum()) <= int((slots >= 0).sum()) * fmt.bytes_per_token, what
    read_slots = torch.cat([slots, distinct_slots(num_pages, fmt.page_tokens, 7, gen, 2).to(device)])  # + unwritten
    same_floats(ops.read_pages(pool_of(buf, fmt), read_slots, fmt), torch_read(want, read_slots, fmt), f"read {what}")


def check_v4_write_read(gen, device="cpu", big=False) -> None:
    pages, n = (64, 4093) if big else (3, 37)  # n: not a multiple of the 4-token block
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for gap in (0, 1000):
            _write_read_case(V4, gen, device, pages, n, n // 9, gap, dtype)


def check_index_write_read(gen, device="cpu", big=False) -> None:
    pages, n = (64, 8191) if big else (3, 53)  # n: not a multiple of the 16-key block
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for gap in (0, 4096):
            _write_read_case(INDEX, gen, device, pages, n, n // 9, gap, dtype)


def check_read_random_bytes(gen, device="cpu", big=False) -> None:
    """Reading never-written bytes: every fp8 code (NaN included) and every scale byte, 0 and 255 too."""
    from attention.cuda import v4_cache_ops as ops

    for fmt in (V4, INDEX, V4CacheFormat(100, 8, page_tokens=16)):
        buf = poisoned_buffer(4, fmt, 0, gen, device)
        # Many of the extreme bytes: scale 0 (2^-127, subnormal) and 255 (inf), fp8 NaN codes.
        region = buf[:, fmt.scale_offset:]
        pick = torch.randint(0, 8, region.shape, generator=gen).to(device)
        region[pick == 0], region[pick == 1] = 0, 255
        part = buf[:, :fmt.scale_offset]
        pick = torch.randint(0, 16, part.shape, generator=gen).to(device)
        part[pick == 0], part[pick == 1] = 0x7F, 0xFF
        slots = distinct_slots(4, fmt.page_tokens, 40, gen, 5).to(device)
        same_floats(ops.read_pages(buf, slots, fmt), read_v4(buf, slots, fmt), f"{fmt.describe()} random bytes")


def check_other_geometry(gen, device="cpu", big=False) -> None:
    """A narrower last tile (nope 100: scales 2 of 8 bytes), a small page, an odd-width key."""
    for fmt in (V4CacheFormat(100, 8, page_tokens=16), V4CacheFormat(576, 64, page_tokens=8), V4IndexFormat(24, 32)):
        _write_read_case(fmt, gen, device, 5, 29, 3, 0, torch.float32)
        _write_read_case(fmt, gen, device, 5, 29, 3, 64, torch.bfloat16)


def check_grouped_cache_routed(gen, device="cpu", big=False) -> None:
    """``GroupedPagedCache`` writing / reading through the kernels (as `v4_page_ops` makes it on CUDA)
    leaves the same buffer and reads the same values as on the torch spec."""
    from attention import group_cache as gc
    from attention.cache_groups import CacheGroup
    from attention.cuda import v4_cache_ops

    groups = [CacheGroup("swa", "swa", layers=(0, 2, 3), tokens_per_page=256, bytes_per_token=V4.bytes_per_token,
                         page_bytes=V4.page_bytes, window=512),
              CacheGroup("csa_index", "indexer", layers=(1, 3), tokens_per_page=256, ratio=4,
                         bytes_per_token=INDEX.bytes_per_token, page_bytes=INDEX.page_bytes)]
    layouts = [gc.GroupLayout(groups[0], torch.uint8, V4.head_dim, V4),
               gc.GroupLayout(groups[1], torch.uint8, INDEX.head_dim, INDEX)]
    caches = [gc.GroupedPagedCache(layouts, {"swa": 4, "csa_index": 3}, device, page_kernels=True) for _ in range(2)]
    poison = torch.randint(0, 256, caches[0].buffer.shape, generator=gen, dtype=torch.uint8).to(device)
    for c in caches:
        c.buffer.copy_(poison)
    real = gc.v4_page_ops
    for routed, cache in zip((True, False), caches):
        gc.v4_page_ops = (lambda t: v4_cache_ops) if routed else (lambda t: None)
        try:
            g = torch.Generator().manual_seed(1234)  # the same values for both caches
            cache.write("swa", 2, [3, 1], torch.arange(5, 300, device=device), tokens(295, 512, 64, g).to(device))
            cache.write("csa_index", 3, [2, 0], torch.arange(0, 40, device=device) * 7, tokens(40, 128, 128, g).to(device))
            tables = torch.tensor([[0, 2], [3, 1]], device=device)
            cache.write_rows("swa", 0, tables, torch.tensor([1, 0, 1], device=device),
                             torch.tensor([300, 511, 2], device=device), tokens(3, 512, 64, g).to(device))
        finally:
            gc.v4_page_ops = real
    assert torch.equal(caches[0].buffer, caches[1].buffer)
    pos = torch.arange(0, 512, 3, device=device)
    for name, layer, pages in (("swa", 2, [3, 1]), ("swa", 0, [3, 1]), ("csa_index", 3, [2, 0])):
        try:
            gc.v4_page_ops = lambda t: v4_cache_ops
            got = caches[0].read(name, layer, pages, pos)
            gc.v4_page_ops = lambda t: None  # the torch spec's read (on CUDA the real rule would take Triton)
            want = caches[1].read(name, layer, pages, pos)
        finally:
            gc.v4_page_ops = real
        same_floats(got, want, f"grouped {name} layer {layer}")


CHECKS = {"v4_write_read": check_v4_write_read, "index_write_read": check_index_write_read,
          "read_random_bytes": check_read_random_bytes, "other_geometry": check_other_geometry,
          "grouped_cache_routed": check_grouped_cache_routed}

PRESTART, interpreter_results, test_v4_cache_interpreter = kernel_suite(
    __file__, SEED, CHECKS, "V4CACHE_TEST_SEED", "test_v4_cache_compiles_for_sm90")
"""The subprocesses this module reads, started early (tests/prestart.py); the interpreter checks' fixture and test."""


# -- in this process (no Triton launch) ---------------------------------------------------------------


def test_ceil_log2_thresholds_are_torchs_rounding():
    """The threshold table gives torch's ``ceil(log2(y))`` for every normal exponent, at the mantissas
    right above the power of two (where fp32 log2 rounds onto the integer) and at random ones."""
    from attention.cuda.v4_cache_ops import ceil_log2_thresholds

    thr = ceil_log2_thresholds(torch.device("cpu")).long()
    gen = torch.Generator().manual_seed(SEED)
    e = torch.arange(1, 255)
    m = torch.cat([torch.arange(0, 2048), torch.randint(0, 1 << 23, (2048,), generator=gen),
                   (1 << 23) - 1 - torch.arange(64)])
    bits = (e[:, None] << 23) | m[None, :]
    y = bits.to(torch.int32).view(torch.float32)
    want = torch.ceil(torch.log2(y))
    got = (e - 127)[:, None] + (m[None, :] >= thr[e][:, None]).long()
    assert torch.equal(got.float(), want), f"V4CACHE_TEST_SEED={SEED}"
    assert (thr[e] > 1).any(), "torch's log2 should round some 2^k (1 + 2^-23) onto k (the reason for the table)"


def test_cpu_buffers_keep_the_torch_path():
    from attention.group_cache import v4_page_ops

    assert v4_page_ops(torch.zeros(4, dtype=torch.uint8)) is None


# -- compiled: sm_90 without a GPU, and on the GPU ----------------------------------------------------


def _compile_worker() -> None:
    from attention.cuda import v4_cache_ops as k

    i64, i32 = "i64", "i32"
    v4 = dict(NOPE=448, ROPE=64, ROPE_P2=64, NS=7, NS_P2=8, SB=8, PART=576, PAGE=256, TILE=64, BLOCK_T=4)
    rd = dict(pool_ptr="*u8", page_stride=i64, slots_ptr="*i64", n_tokens=i32, out_ptr="*fp32", out_stride=i64)
    for x_t in ("*bf16", "*fp32"):
        wr = dict(pool_ptr="*u8", page_stride=i64, slots_ptr="*i64", n_tokens=i32, x_ptr=x_t, x_stride=i64,
                  thr_ptr="*i32")
        compile_sm90(k._write_v4_kernel, wr, dict(v4, SB_P2=8, AMAX_FLOOR=1e-4, FP8_MAX=448.0,
                                                  X_BF16=x_t == "*bf16"), 4)
        compile_sm90(k._write_index_kernel, wr, dict(HD=128, HD_P2=128, PAGE=256, AMAX_FLOOR=1e-4, FP8_MAX=448.0,
                                                     X_BF16=x_t == "*bf16", BLOCK_T=16), 4)
    compile_sm90(k._read_v4_kernel, rd, v4, 4)
    compile_sm90(k._read_index_kernel, rd, dict(HD=128, HD_P2=128, PAGE=256, BLOCK_T=16), 4)


def test_v4_cache_compiles_for_sm90():
    compiled(compile_run(__file__))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CHECKS))
def test_v4_cache_gpu(name):
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET for the GPU tests"
    print(f"V4CACHE_TEST_SEED={SEED}")
    CHECKS[name](torch.Generator().manual_seed(SEED + sum(map(ord, name))), "cuda", True)


@pytest.mark.gpu
def test_v4_pool_beyond_2_31_bytes_gpu():
    """Slots whose byte offsets pass 2^31 (int64 addressing) in a 2.2 GB V4 pool, written and read back."""
    from attention.cuda import v4_cache_ops as ops

    gen = torch.Generator().manual_seed(SEED)
    num_pages = 2**31 // V4.page_bytes + 300
    pool = torch.zeros(num_pages, V4.page_bytes, dtype=torch.uint8, device="cuda")
    n = 300
    slots = torch.cat([torch.arange(5), num_pages * 256 - 1 - torch.randperm(250 * 256, generator=gen)[:n - 5]])
    assert int(slots.max()) // 256 * V4.page_bytes > 2**31
    x = tokens(n, 512, 64, gen)
    ops.write_v4_fp8(pool, slots.cuda(), x.cuda(), V4)
    want = torch.zeros(num_pages, V4.page_bytes, dtype=torch.uint8)
    write_v4(want, slots, x, V4)
    assert torch.equal(pool.cpu(), want)
    same_floats(ops.read_v4_fp8(pool, slots.cuda(), V4).cpu(), read_v4(want, slots, V4), "beyond 2^31")


if __name__ == "__main__":
    worker_main(sys.argv[1:], CHECKS, _compile_worker)
