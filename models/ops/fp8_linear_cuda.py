"""fp8 block-quantized linear layers on the GPU (`models.ops.fp8_linear` dispatches here).

Two kernels, chosen by the number of rows ``M``:

* ``w8a16`` (Triton; decode, and every M where DeepGEMM is missing): the weight
  tile is loaded as fp8, multiplied by its block scale in registers and cast to
  the activations' dtype, then a bf16 tensor-core dot with fp32 accumulation.
  It reads each weight byte once (half of bf16's bytes: what a memory-bound
  decode step pays for) and computes exactly the dequantized reference's
  product up to accumulation order. Small M splits K across programs (fp32
  partials summed in a fixed order: deterministic) so that a batch-1 GEMV
  occupies every SM.
* ``deepgemm`` (M >= `DEEPGEMM_MIN_M`, prefill): activations quantized per token
  and 128-column group (`act_quant`, one Triton kernel; scales written in the
  MN-major layout DeepGEMM's SM90 kernels read), then ``deep_gemm.fp8_gemm_nt``
  on fp8 tensor cores with the checkpoint's 128 x 128 weight scales as stored,
  over `deepgemm_rows` rows (zero rows pad M up to a power of two below 4096).

Both compile kernels on first use, and a compile stalls the engine for seconds:
`first_use_rows` lists the row counts that compile every variant `linear` can
launch, which the start-up warm-up (`workers/kernel_warmup.py`) runs.

Both take ``w`` float8_e4m3fn ``[N, K]``, ``scale`` float32 ``[ceil(N / b0),
ceil(K / b1)]`` and x ``[..., K]``, and return ``[..., N]`` in x's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
ACT_GROUP = 128  # DeepGEMM's activation scale granularity (1 x 128)
DEEPGEMM_MIN_M = 256  # below this the weight read dominates: w8a16 reads the same bytes without the quantization
DEEPGEMM_PAD_BELOW = 4096  # `deepgemm_rows`
W8A16_ROW_CLASSES = (16, 32, 64, 128)
"""Upper bounds of `w8a16_config`'s tile classes (above the last, up to `DEEPGEMM_MIN_M`: one more)."""


@triton.jit
def _w8a16_kernel(
    a_ptr, a_stride, w_ptr, w_stride, s_ptr, s_stride, out_ptr, out_split_stride, out_stride, M,
    N: tl.constexpr, K: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, K_PER: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[split, m, n] = sum over this split's K range of a[m, k] * (w[n, k] * s[n // B0, k // B1])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * a_stride
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride
    s_rows = s_ptr + (offs_n // B0) * s_stride
    k_start = pid_k * K_PER
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K_PER, BK):
        kk = k_start + k0
        offs_k = kk + tl.arange(0, BK)
        k_ok = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        # BK divides B1 (`w8a16_config`): one scale column per tile.
        s = tl.load(s_rows + kk // B1, mask=n_ok & (kk < K), other=0.0)
        w = (w.to(tl.float32) * s[:, None]).to(a.dtype)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    out = out_ptr + pid_k * out_split_stride + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i] in fp32, in split order, cast to out's dtype (one launch
    where ``part.sum(0).to(dtype)`` takes two: ~0.18 ms of a batch-1 H200 step's 2.65)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _act_quant_kernel(x_ptr, x_stride, q_ptr, q_stride, sf_ptr, sf_stride, K, G: tl.constexpr):
    """Row ``pid(0)``, group ``pid(1)``: q = x / s in fp8 with s = max(|x|, 1e-4) / 448 over the group;
    s to ``sf[group, row]`` (MN-major)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * G + tl.arange(0, G)
    ok = offs < K
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4) / 448.0
    q = tl.clamp(x / s, -448.0, 448.0)
    tl.store(q_ptr + row * q_stride + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(sf_ptr + g * sf_stride + row, s)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def w8a16_config(M: int, N: int, K: int, block: tuple[int, int], sms: int) -> dict:
    """Tiles, K splits and launch options of `w8a16` for an ``[M, K] x [N, K]^T`` product."""
    small, mid, large, top = W8A16_ROW_CLASSES
    if M <= small:
        cfg = dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4)
    elif M <= mid:
        cfg = dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=4)
    elif M <= large:
        cfg = dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)
    elif M <= top:  # still weight-read bound: one m-tile, so every weight tile is read once
        cfg = dict(BM=128, BN=64, BK=64, num_warps=8, num_stages=3)
    else:
        cfg = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
    cfg["BN"] = min(cfg["BN"], _pow2_at_least_16(N))
    # One scale column per K tile: BK must divide the block's width (a power of two, >= 16 for tl.dot).
    cfg["BK"] = min(cfg["BK"], _pow2_at_least_16(K), block[1])
    if block[1] % cfg["BK"]:
        raise ValueError(f"fp8 block width {block[1]} is not a multiple of the K tile {cfg['BK']}")
    k_tiles = triton.cdiv(K, cfg["BK"])
    # Too few output tiles to occupy the GPU (decode sizes; H200, 4-layer model at batch 128: 3.8 ms a
    # step in 36 unsplit products of 12-192 tiles, against ~1 ms of bf16 cuBLAS): split K.
    tiles = triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"])
    split = max(1, min(triton.cdiv(2 * sms, tiles), k_tiles // 4))
    # A power of two: K_PER is a constexpr, so each distinct split compiles a kernel; rounding down
    # bounds them to a handful per shape whatever the prefill lengths are.
    split = 1 << (split.bit_length() - 1)
    k_per = triton.cdiv(k_tiles, split) * cfg["BK"]
    cfg["SPLIT"] = triton.cdiv(K, k_per)
    cfg["K_PER"] = k_per
    return cfg


def w8a16(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
          cfg: dict | None = None) -> torch.Tensor:
    """x ``[M, K]`` -> ``[M, N]`` in x's dtype (``cfg``: `w8a16_config`'s, or a tuning candidate)."""
    M, K = x.shape
    N = w.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device)
    cfg = dict(cfg or w8a16_config(M, N, K, block, _num_sms(x.device.index or 0) if x.is_cuda else 132))
    split = cfg.pop("SPLIT")
    out = torch.empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]), split)
    _w8a16_kernel[grid](
        x, x.stride(0), w, w.stride(0), scale, scale.stride(0), out, out.stride(0), out.stride(1), M,
        N=N, K=K, B0=block[0], B1=block[1], PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg,
    )
    if split == 1:
        return out[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _split_sum_kernel[(triton.cdiv(M * N, 1024),)](out, y, M * N, SPLIT=split, BLOCK=1024, num_warps=4)
    return y


def act_quant(x: torch.Tensor, group: int = ACT_GROUP, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> (fp8 ``[R, K]``, float32 scales ``[R, ceil(K / group)]``), x ~= q * s per group
    in the first M rows; R = ``rows`` (default M, at least M), the rows after M zero.

    The scales are a transposed view of a ``[groups, R']`` buffer, ``R'`` = R rounded up to 4
    (16-byte rows): the MN-major, TMA-aligned layout DeepGEMM's SM90 GEMMs read without a copy."""
    M, K = x.shape
    R = M if rows is None else rows
    if R < M:
        raise ValueError(f"act_quant: {R} rows cannot hold {M}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(K, group)
    q = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.empty(groups, (R + 3) // 4 * 4, dtype=torch.float32, device=x.device)
    if R > M:
        q[M:].view(torch.uint8).zero_()
        sf[:, M:].zero_()
    if M:
        _act_quant_kernel[(M, groups)](x, x.stride(0), q, q.stride(0), sf, sf.stride(0), K, G=group, num_warps=1)
    return q, sf[:, :R].t()


@functools.cache
def _deep_gemm():
    from attention.cuda import _ext

    try:
        dg = _ext.deep_gemm()  # every call under its lock: DeepGEMM's JIT is not thread-safe
    except _ext.KernelPackageMissing:
        return None
    return dg if hasattr(dg, "fp8_gemm_nt") else None


def deepgemm_fits(M: int, N: int, K: int, block: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether `deepgemm` takes this product: DeepGEMM installed, 128 x 128 weight blocks, bf16
    out, K a multiple of the 128-wide scale groups, N of its 64-wide output tiles."""
    return (tuple(block) == (128, 128) and dtype == torch.bfloat16 and K % ACT_GROUP == 0 and N % 64 == 0
            and _deep_gemm() is not None)


def deepgemm_rows(M: int) -> int:
    """Rows `deepgemm` runs for an M-row product: M, padded up to a power of two below
    `DEEPGEMM_PAD_BELOW`.

    DeepGEMM's JIT compiles a kernel for each tile configuration, which it picks from M. On the
    H100 (bench/fp8_first_use.py, the seven DeepSeek-V3.2 projection shapes, every power of two
    from 16 to 8192 run first) M = 300 compiled for 20.9 s; from 4096 rows on, M = 5120 to 8200
    reused the configurations of 4096 and 8192. Powers of two are what the warm-up prefills; the
    padding costs at most the rows' compute once more, where DeepGEMM's small products are still
    near their weight reads."""
    if M >= DEEPGEMM_PAD_BELOW:
        return M
    return max(DEEPGEMM_MIN_M, triton.next_power_of_2(M))


def deepgemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x bf16 ``[M, K]`` -> bf16 ``[M, N]`` on fp8 tensor cores (x quantized per 1 x 128 group), run
    over `deepgemm_rows` rows. A row's result does not depend on the others (per-row activation
    scales, a fixed K order)."""
    M = x.shape[0]
    rows = deepgemm_rows(M)
    q, sf = act_quant(x, rows=rows)
    out = torch.empty(rows, w.shape[0], dtype=torch.bfloat16, device=x.device)
    _deep_gemm().fp8_gemm_nt((q, sf), (w, scale), out)
    return out[:M]


def first_use_rows() -> list[int]:
    """Row counts whose `linear` calls compile every kernel variant it launches below
    `DEEPGEMM_MIN_M` rows (from there on the warm-up's powers of two are `deepgemm_rows`'s sizes).

    Triton compiles `w8a16` once per tile class (`W8A16_ROW_CLASSES`) and, within a class, once
    per specialization of the runtime row count: M == 1, M a multiple of 16, any other M (on the
    H100 each such first call took 2.3-3.1 s for the seven DeepSeek-V3.2 projection shapes). So:
    1, and per class its largest multiple of 16 and its smallest other M."""
    rows = {1}
    low = 0
    for high in (*W8A16_ROW_CLASSES, DEEPGEMM_MIN_M - 1):
        rows.add(high // 16 * 16)
        rows.add(next(m for m in range(low + 1, high + 1) if m % 16 and m != 1))
        low = high
    return sorted(rows)


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x ``[..., K]`` -> ``[..., N]`` in x's dtype: `deepgemm` from `DEEPGEMM_MIN_M` rows where it fits,
    `w8a16` otherwise."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], w.shape[0]
    if M >= DEEPGEMM_MIN_M and deepgemm_fits(M, N, K, block, x.dtype):
        y = deepgemm(x2, w, scale)
    else:
        y = w8a16(x2, w, scale, block)
    return y.view(*lead, N)
