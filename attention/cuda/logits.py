"""Indexer logits of the ``cuda`` backend: DeepGEMM paged (decode) and ragged (prefill) MQA logits.

Decode
------
``deep_gemm.fp8_paged_mqa_logits`` scores the ``next_n`` query tokens of every
request against its paged indexer keys. Everything about *which keys a query
row sees* goes through one helper, :func:`indexer_context_lens`, which builds
the 2-D ``[B, next_n]`` int32 context-length tensor for every forward mode:

* plain decode (``next_n = 1``): ``ctx[b, 0] = seq_len[b]``;
* MTP target verification (``q_len = next_n`` for every request):
  ``ctx[b, j] = seq_len[b] - next_n + j + 1``;
* MTP draft extend (request b brings ``q_len[b] <= next_n`` tokens, padded to
  ``next_n`` rows): ``ctx[b, j] = seq_len[b] - q_len[b] + j + 1`` for
  ``j < q_len[b]`` and ``0`` for the padding rows.

(``seq_len`` is the context length *after* the step, as in ``ForwardBatch``.)
Every value is clamped to ``[0, seq_len[b]]``; a row with context 0 sees
nothing: all ``-inf`` logits, no top-k.

DeepGEMM 0.1.4 on SM90 runs the native ``q [B, next_n, H, D]`` layout only for
``next_n`` in {1, 2}. :func:`paged_logits_layout` picks how a step is laid
out: ``next_n <= 2`` natively; an even ``next_n`` as ``next_n / 2`` pairs per
request (``q [B * next_n / 2, 2, H, D]``, the block table repeated per pair);
anything else per token (``q [B * next_n, 1, H, D]``, ``ctx [B * next_n, 1]``,
the block table repeated per token). Output row ``b * next_n + j`` is the same
in every layout.

With 2-D context lengths the kernel must run with ``clean_logits=False`` and
leaves garbage past each row's length: :func:`mask_logits_tail` (a Triton
kernel that writes only the tail) sets it to ``-inf``. Measured on the H100:
the kernel sizes the work of a multi-row request by the context of its last
row, so rows whose context exceeds the last row's (draft-extend padding rows
of context 0 after real rows) came back as garbage; the kernel is therefore
handed the running maximum of the context lengths along each request's rows,
and the true lengths are applied by the mask.

Prefill
-------
``deep_gemm.fp8_mqa_logits`` scores packed prefill rows against packed keys,
row s seeing ``[ks[s], ke[s])``. The full ``[S, N]`` f32 matrix of a long
prompt does not fit (32k x 32k is 4 GiB), so rows are processed in chunks
planned by :func:`plan_ragged_chunks` from a logits memory budget: each chunk
scores only the key window its rows can see, and :func:`ragged_topk` runs the
fused top-k on each chunk so that the full matrix never exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from ..formats import FP8_MAX, PAGE_SIZE, IndexerFp8Format, quantize_indexer_fp8
from . import _ext
from .index_transform import positions_to_slots
from .topk import topk_positions

NEG_INF = float("-inf")
DEFAULT_LOGITS_BUDGET_BYTES = 512 * 1024 * 1024
"""Default memory for one chunk of prefill logits (f32, with DeepGEMM's row padding)."""

SUPPORTED_INDEX_HEADS = (32, 64)  # DeepGEMM SM90 paged / ragged MQA logits
SUPPORTED_INDEX_HEAD_DIM = 128  # the 132-byte fp8 indexer token
_DG_BLOCK_KV = 256  # DeepGEMM's KV split: logits rows are padded by it
_DG_STRIDE_ALIGN = 256  # f32 elements per 1024 bytes: DeepGEMM aligns logits rows to this


# --------------------------------------------------------------------------
# Context lengths (the one authoritative helper) and the paged layout plan
# --------------------------------------------------------------------------


def indexer_context_lens(
    seq_lens: torch.Tensor,
    next_n: int = 1,
    q_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 ``[B, next_n]`` context length of every decode query row (see the module docstring).

    Args:
        seq_lens: int ``[B]``, each request's context length after this step
            (its new tokens included).
        next_n: query rows per request (1 for plain decode; draft tokens + 1
            for MTP verification; the padded width for draft extend).
        q_lens: int ``[B]``, the real new tokens per request, each in
            ``[0, next_n]`` (draft extend); None means ``next_n`` for every
            request (decode, verification).

    Returns:
        contiguous int32 ``[B, next_n]`` on ``seq_lens``' device:
        ``clamp(seq_len - q_len + j + 1, 0, seq_len)`` for ``j < q_len``, else 0.
    """
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n must be a positive int, got {next_n!r}")
    seq = torch.as_tensor(seq_lens).reshape(-1).long()
    if q_lens is None:
        q = torch.full_like(seq, next_n)
    else:
        q = torch.as_tensor(q_lens, device=seq.device).reshape(-1).long()
        if q.shape != seq.shape:
            raise ValueError(f"q_lens has {q.numel()} entries for {seq.numel()} requests")
        if bool(((q < 0) | (q > next_n)).any()):
            raise ValueError(f"q_lens must lie in [0, next_n = {next_n}]")
    if bool((seq < 0).any()):
        raise ValueError("seq_lens must be >= 0")
    j = torch.arange(next_n, device=seq.device)
    ctx = seq[:, None] - q[:, None] + j[None, :] + 1
    ctx = torch.minimum(ctx.clamp_min(0), seq[:, None])
    ctx = torch.where(j[None, :] < q[:, None], ctx, 0)
    return ctx.to(torch.int32).contiguous()


@dataclass(frozen=True)
class PagedLogitsLayout:
    """How a ``[B, next_n]`` decode step is handed to ``fp8_paged_mqa_logits``.

    ``atom`` query rows per kernel "request" (the kernel's next_n) and
    ``groups = next_n // atom`` kernel requests per real request (each gets a
    copy of its block-table row).
    """

    next_n: int
    atom: int

    @property
    def groups(self) -> int:
        return self.next_n // self.atom

    @property
    def name(self) -> str:
        if self.atom == self.next_n:
            return "native"
        return "per_token" if self.atom == 1 else f"grouped{self.atom}"


def paged_logits_layout(next_n: int, mode: str = "auto", max_native_next_n: int = 2) -> PagedLogitsLayout:
    """The layout of a decode step of ``next_n`` query rows per request.

    ``mode``: ``"auto"`` (native when ``next_n <= max_native_next_n``, else
    pairs when next_n is even, else per token), ``"native"`` (raises beyond
    the kernel's limit) or ``"per_token"``.
    """
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n must be a positive int, got {next_n!r}")
    if mode == "per_token":
        return PagedLogitsLayout(next_n, 1)
    if mode == "native":
        if next_n > max_native_next_n:
            raise ValueError(
                f"fp8_paged_mqa_logits runs next_n <= {max_native_next_n} natively on this GPU, got {next_n}"
            )
        return PagedLogitsLayout(next_n, next_n)
    if mode != "auto":
        raise ValueError(f"layout mode must be 'auto', 'native' or 'per_token', got {mode!r}")
    if next_n <= max_native_next_n:
        return PagedLogitsLayout(next_n, next_n)
    for atom in range(max_native_next_n, 1, -1):
        if next_n % atom == 0:
            return PagedLogitsLayout(next_n, atom)
    return PagedLogitsLayout(next_n, 1)


# --------------------------------------------------------------------------
# Masking the tail of each logits row
# --------------------------------------------------------------------------


@triton.jit
def _mask_tail_kernel(logits_ptr, stride, width, lens_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(lens_ptr + row), width), 0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    start = (n // BLOCK) * BLOCK
    while start < width:
        offs = start + tl.arange(0, BLOCK)
        tl.store(row_ptr + offs, tl.full([BLOCK], float("-inf"), tl.float32), mask=(offs >= n) & (offs < width))
        start += BLOCK


def mask_logits_tail(logits: torch.Tensor, lengths: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """Set ``logits[r, t] = -inf`` for ``t >= lengths[r]``, in place; only the tail is written.

    ``logits``: float32 ``[R, L]`` with unit inner stride (any row stride);
    ``lengths``: int ``[R]`` (clamped to ``[0, L]``).
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected float32 [R, L] with unit inner stride, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    R, L = logits.shape
    lengths = lengths.reshape(-1).to(torch.int32).contiguous()
    if lengths.numel() != R:
        raise ValueError(f"lengths: expected {R} entries, got {lengths.numel()}")
    if R and L:
        _mask_tail_kernel[(R,)](logits, logits.stride(0), L, lengths, BLOCK=block, num_warps=4)
    return logits


# --------------------------------------------------------------------------
# fp8 inputs
# --------------------------------------------------------------------------


def _fp8_query(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``q`` and f32 ``weights`` as DeepGEMM takes them.

    An fp8 ``q`` is used as is. A float ``q`` is quantized per (row, head) with
    ``scale = amax / 448`` and the scale folded into the weights
    (``relu(s * x) = s * relu(x)`` for ``s > 0``), the model's own recipe.
    """
    w = weights.to(torch.float32)
    if q.dtype == torch.float8_e4m3fn:
        return q.contiguous(), w.contiguous()
    if q.dtype == torch.uint8:
        return q.view(torch.float8_e4m3fn).contiguous(), w.contiguous()
    qf = q.float()
    amax = qf.abs().amax(-1).clamp_min(1e-10)
    scale = amax / FP8_MAX
    q8 = (qf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q8.contiguous(), (w * scale.reshape(w.shape)).contiguous()


def _fp8_keys(k: torch.Tensor, k_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_fp8 [N, D], scale f32 [N])``; float keys (``k_scale`` None) are quantized per token."""
    if k_scale is None:
        if k.dtype in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError("fp8 keys need their k_scale")
        # Keys read back from the fp8 cache (value * scale) re-quantize to the same bytes.
        k8, scale = quantize_indexer_fp8(k)
        return k8.contiguous(), scale.contiguous()
    if k.dtype == torch.uint8:
        k = k.view(torch.float8_e4m3fn)
    if k.dtype != torch.float8_e4m3fn:
        # Float keys with a separate scale: fold the scale into a per-token re-quantization.
        k8, s2 = quantize_indexer_fp8(k.float())
        return k8.contiguous(), (s2 * k_scale.float().reshape(-1)).contiguous()
    return k.contiguous(), k_scale.to(torch.float32).reshape(-1).contiguous()


def _check_heads(H: int, D: int) -> None:
    if D != SUPPORTED_INDEX_HEAD_DIM:
        raise ValueError(
            f"the cuda backend's indexer needs index_head_dim = {SUPPORTED_INDEX_HEAD_DIM} "
            f"(132-byte fp8 tokens), got {D}"
        )
    if H not in SUPPORTED_INDEX_HEADS:
        raise ValueError(f"the cuda backend's indexer (DeepGEMM SM90) needs index_n_heads in "
                         f"{SUPPORTED_INDEX_HEADS}, got {H}")


# --------------------------------------------------------------------------
# Paged (decode) logits
# --------------------------------------------------------------------------


def index_pool_view(index_cache_layer: torch.Tensor, head_dim: int) -> torch.Tensor:
    """DeepGEMM's ``(P, 64, 1, D + 4)`` uint8 view of one layer's fp8 indexer pool."""
    fmt = IndexerFp8Format(head_dim)
    if index_cache_layer.dtype != torch.uint8:
        raise ValueError(
            "the cuda backend reads the fp8 indexer cache (kv_cache_dtype='fp8'); got a "
            f"{index_cache_layer.dtype} cache (kv_cache_dtype='auto' runs on the reference backend)"
        )
    P = index_cache_layer.shape[0]
    page_bytes = index_cache_layer[0].numel() if P else fmt.bytes_per_page
    if page_bytes != fmt.bytes_per_page:
        raise ValueError(f"indexer pages of {page_bytes} bytes do not match head_dim "
                         f"{head_dim} ({fmt.bytes_per_page} bytes per page)")
    return index_cache_layer.reshape(P, PAGE_SIZE, 1, fmt.bytes_per_token)


def paged_mqa_logits(
    q: torch.Tensor,
    index_cache_layer: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_len: int,
    *,
    layout: str = "auto",
) -> torch.Tensor:
    """``attention.indexer.paged_mqa_logits`` on DeepGEMM's ``fp8_paged_mqa_logits``.

    Same arguments and result as the reference (``q [B, next_n, H, D]``,
    ``context_lens [B, next_n]`` -- build it with :func:`indexer_context_lens`
    -- ``page_table [B, max_pages]``), restricted to the fp8 indexer cache
    (uint8 pages), ``D = 128`` and ``H`` in {32, 64}. ``layout`` forces a
    :func:`paged_logits_layout` mode.

    Returns:
        f32 ``[B * next_n, max_len]`` (a view with DeepGEMM's padded row
        stride), ``-inf`` at ``t >= context_lens`` (masked here: the kernel
        leaves garbage there).
    """
    if q.dim() != 4:
        raise ValueError(f"expected q [B, next_n, H, D], got {tuple(q.shape)}")
    B, next_n, H, D = q.shape
    _check_heads(H, D)
    ctx = torch.as_tensor(context_lens, device=q.device)
    if ctx.dim() == 1 and next_n == 1:
        ctx = ctx[:, None]
    if tuple(ctx.shape) != (B, next_n):
        raise ValueError(f"context_lens must be [B, next_n] = [{B}, {next_n}], got {tuple(ctx.shape)}")
    ctx = ctx.to(torch.int32).contiguous()
    if weights.shape != (B * next_n, H):
        raise ValueError(f"weights must be [B*next_n, H] = [{B * next_n}, {H}], got {tuple(weights.shape)}")
    bt = torch.as_tensor(page_table, device=q.device)
    if bt.dim() != 2 or bt.shape[0] != B:
        raise ValueError(f"page_table must be [B, max_pages] with B = {B}, got {tuple(bt.shape)}")
    max_len = int(max_len)
    if max_len <= 0 or B == 0:
        return torch.full((B * next_n, max(max_len, 0)), NEG_INF, dtype=torch.float32, device=q.device)
    n_pages = -(-max_len // PAGE_SIZE)
    if bt.shape[1] < n_pages:  # the kernel may address up to ceil(max_len / 64) columns
        bt = torch.nn.functional.pad(bt, (0, n_pages - bt.shape[1]), value=0)
    bt = bt.to(torch.int32).contiguous()
    kv = index_pool_view(index_cache_layer, D)
    q8, w = _fp8_query(q, weights)

    plan = paged_logits_layout(next_n, layout)
    ctx_k = ctx.view(B * plan.groups, plan.atom)
    if plan.atom > 1:
        # The kernel sizes a request's work by the context of its *last* row
        # (verification rows grow by one key per row). Draft-extend padding
        # rows (context 0) after real rows would hide the real rows' keys, so
        # the kernel gets the running max; the mask below uses the true lengths.
        ctx_k = ctx_k.cummax(dim=1).values.contiguous()
    if plan.groups > 1:
        q8 = q8.view(B * plan.groups, plan.atom, H, D)
        bt = bt.repeat_interleave(plan.groups, dim=0)
    dg = _ext.deep_gemm()
    dev = (q.device.index or 0) if q.device.type == "cuda" else 0
    schedule = dg.get_paged_mqa_logits_metadata(ctx_k, PAGE_SIZE, _ext.num_sms(dev))
    logits = dg.fp8_paged_mqa_logits(q8, kv, w, ctx_k, bt, schedule, max_len, clean_logits=False)
    return mask_logits_tail(logits, ctx.view(-1))


# --------------------------------------------------------------------------
# Ragged (prefill) logits in row chunks
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RaggedChunk:
    """Rows ``[r0, r1)`` scored against keys ``[k0, k1)`` (the union of their windows)."""

    r0: int
    r1: int
    k0: int
    k1: int


def ragged_logits_bytes(rows: int, width: int, num_heads: int = 64) -> int:
    """Bytes DeepGEMM allocates for ``rows x width`` ragged logits (f32, padded rows and stride)."""
    block_q = max(1, 128 // num_heads)
    aligned_rows = -(-rows // block_q) * block_q
    stride = -(-(width + _DG_BLOCK_KV) // _DG_STRIDE_ALIGN) * _DG_STRIDE_ALIGN
    return aligned_rows * stride * 4


KV_START_ALIGN = 16
"""Keys a ragged chunk starts at are a multiple of this: DeepGEMM's ``fp8_mqa_logits`` builds TMA
descriptors on the chunk's key and scale slices, and a fp32 scale slice starting at an odd key is not
16-byte aligned (CUDA_ERROR_INVALID_VALUE; seen on the H100 once packed prefill rows started chunks
at a request's first key)."""


def plan_ragged_chunks(
    ks: Sequence[int],
    ke: Sequence[int],
    budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    num_heads: int = 64,
) -> list[RaggedChunk]:
    """Split prefill rows into consecutive chunks whose logits fit ``budget_bytes``.

    Row s sees keys ``[ks[s], ke[s])``. A chunk scores the union window of its
    rows (``[min ks, max ke)`` over rows with a non-empty window); it grows
    while :func:`ragged_logits_bytes` of (rows, window) stays within the
    budget, and always holds at least one row (a single row over the budget
    is its own chunk). Rows with an empty window widen nothing; a chunk of
    only such rows has an empty window (``k0 == k1``). A row whose window
    starts at or past the end of every window before it in the chunk (the
    next request of packed prefill rows) starts a new chunk. A chunk's
    ``k0`` is its lowest window start rounded down to `KV_START_ALIGN`.

    Vectorised over rows (numpy running min / max per chunk): a per-row Python
    loop took ~10 ms for a 4096-row prefill chunk on the H100 host, more than
    DeepGEMM's logits kernel itself (2 ms).

    Returns chunks covering ``[0, S)`` in order.
    """
    ks = np.asarray(ks, dtype=np.int64).reshape(-1)
    ke = np.asarray(ke, dtype=np.int64).reshape(-1)
    if ks.shape != ke.shape:
        raise ValueError(f"ks and ke differ in length ({ks.size} vs {ke.size})")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    nonempty = ke > ks
    none_lo, none_hi = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    lo_src = np.where(nonempty, ks, none_lo)
    hi_src = np.where(nonempty, ke, none_hi)
    block_q = max(1, 128 // num_heads)
    chunks: list[RaggedChunk] = []
    S, r0 = ks.size, 0
    while r0 < S:
        lo = np.minimum.accumulate(lo_src[r0:])
        hi = np.maximum.accumulate(hi_src[r0:])
        has = lo != none_lo
        width = np.where(has, hi - lo, 0)
        rows = np.arange(1, S - r0 + 1, dtype=np.int64)
        # ragged_logits_bytes(rows, width, num_heads), row by row
        # A chunk's keys start at a multiple of KV_START_ALIGN (below its first window, which masks the rest).
        width = np.where(has, hi - (lo - lo % KV_START_ALIGN), 0)
        nbytes = (-(-rows // block_q) * block_q) * (-(-(width + _DG_BLOCK_KV) // _DG_STRIDE_ALIGN)
                                                    * _DG_STRIDE_ALIGN) * 4
        over = np.flatnonzero(nbytes[1:] > budget_bytes)
        n = int(over[0]) + 1 if over.size else S - r0
        # A row whose window starts at or past the end of every window before it in the chunk (the
        # next request of packed prefill rows) starts a new chunk: one chunk over both would score
        # every row against both requests' keys.
        disjoint = np.flatnonzero(has[: n - 1] & nonempty[r0 + 1 : r0 + n] & (ks[r0 + 1 : r0 + n] >= hi[: n - 1]))
        n = int(disjoint[0]) + 1 if disjoint.size else n
        k0 = int(lo[n - 1]) - int(lo[n - 1]) % KV_START_ALIGN if has[n - 1] else 0
        k1 = int(hi[n - 1]) if has[n - 1] else k0
        chunks.append(RaggedChunk(r0, r0 + n, k0, k1))
        r0 += n
    return chunks


def _ragged_inputs(q, k, k_scale, weights, ks, ke):
    if q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2]:
        raise ValueError(f"expected q [S, H, D] and k [N, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    S, H, D = q.shape
    _check_heads(H, D)
    if weights.shape != (S, H):
        raise ValueError(f"weights must be [S, H] = [{S}, {H}], got {tuple(weights.shape)}")
    ks = torch.as_tensor(ks, device=q.device).reshape(-1).to(torch.int32)
    ke = torch.as_tensor(ke, device=q.device).reshape(-1).to(torch.int32)
    if ks.numel() != S or ke.numel() != S:
        raise ValueError(f"ks and ke must have S = {S} entries")
    N = k.shape[0]
    # Windows outside [0, N) are clipped (the reference masks by position the same way).
    ks = ks.clamp(0, N)
    ke = ke.clamp(0, N)
    q8, w = _fp8_query(q, weights)
    k8, ksc = _fp8_keys(k, k_scale)
    return q8, k8, ksc, w, ks, ke


def _chunk_logits(q8, k8, ksc, w, ks, ke, c: RaggedChunk) -> torch.Tensor:
    """DeepGEMM logits of chunk ``c``: f32 ``[r1 - r0, k1 - k0]``, ``-inf`` outside each row's window."""
    dg = _ext.deep_gemm()
    return dg.fp8_mqa_logits(
        q8[c.r0:c.r1], (k8[c.k0:c.k1], ksc[c.k0:c.k1]), w[c.r0:c.r1],
        (ks[c.r0:c.r1] - c.k0).clamp_min(0).contiguous(), (ke[c.r0:c.r1] - c.k0).clamp_min(0).contiguous(),
        clean_logits=True,
    )


def ragged_mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
) -> torch.Tensor:
    """``attention.indexer.ragged_mqa_logits`` on DeepGEMM's ``fp8_mqa_logits``, in row chunks.

    Same arguments and result (f32 ``[S, N]``, ``-inf`` outside ``[ks, ke)``).
    ``k`` may be fp8 with ``k_scale`` or float with ``k_scale=None`` (keys read
    back from the fp8 cache re-quantize to their stored bytes). The result
    itself is ``[S, N]``; the chunks bound DeepGEMM's padded workspace. For
    long prompts use :func:`ragged_topk`, which never holds ``[S, N]``.
    """
    q8, k8, ksc, w, ks_d, ke_d = _ragged_inputs(q, k, k_scale, weights, ks, ke)
    S, N = q.shape[0], k.shape[0]
    out = torch.full((S, N), NEG_INF, dtype=torch.float32, device=q.device)
    for c in plan_ragged_chunks(ks_d.cpu().numpy(), ke_d.cpu().numpy(), logits_budget_bytes, q.shape[1]):
        if c.k1 > c.k0:
            out[c.r0:c.r1, c.k0:c.k1] = _chunk_logits(q8, k8, ksc, w, ks_d, ke_d, c)
    return out


# The prefill top-k: the sampled kernels for long rows (4096 rows x ~32k on the
# H100: 1.36 ms vs 2.94 for the fused kernel, docs/perf.md); short rows the
# fused kernel at 2048/8 (many rows fill the GPU).
PREFILL_TOPK = {"method": "auto", "block": 2048, "num_warps": 8}


def ragged_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    page_table_rows: torch.Tensor | None = None,
    *,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    topk_config: dict | None = None,
    windows_host: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged logits + top-k, chunk by chunk: ``ragged_mqa_logits`` then ``topk_slots`` without ``[S, N]``.

    Returns ``(positions int32 [S, topk], slots int32 [S, topk])`` as the
    reference's ``topk_slots(ragged_mqa_logits(...), ke, topk, page_table_rows)``
    would (positions index the packed keys; ascending, ``-1`` padded; slots
    through ``page_table_rows [S, max_pages]``, or the positions when None).
    ``topk_config``: keyword arguments of ``topk_positions`` (``method``, ...); None: :data:`PREFILL_TOPK`.
    ``windows_host``: ``(ks, ke)`` on the host, equal to the device ones: the chunks are planned from
    them instead of reading ``ks`` / ``ke`` back (a read-back stalls the host until the device is idle).
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    q8, k8, ksc, w, ks_d, ke_d = _ragged_inputs(q, k, k_scale, weights, ks, ke)
    S = q.shape[0]
    positions = torch.full((S, topk), -1, dtype=torch.int32, device=q.device)
    if windows_host is not None:  # clipped to [0, N) as _ragged_inputs clips the device ones
        ks_h, ke_h = (np.clip(np.asarray(a, dtype=np.int64).reshape(-1), 0, k.shape[0]) for a in windows_host)
    else:
        ks_h, ke_h = ks_d.cpu().numpy(), ke_d.cpu().numpy()
    for c in plan_ragged_chunks(ks_h, ke_h, logits_budget_bytes, q.shape[1]):
        if c.k1 <= c.k0:
            continue
        logits = _chunk_logits(q8, k8, ksc, w, ks_d, ke_d, c)
        lengths = (ke_d[c.r0:c.r1] - c.k0).clamp(0, c.k1 - c.k0).to(torch.int32)
        pos = topk_positions(logits, lengths, topk, **(PREFILL_TOPK if topk_config is None else topk_config))
        positions[c.r0:c.r1] = torch.where(pos >= 0, pos + c.k0, -1)
    if page_table_rows is None:
        return positions, positions.clone()
    bt = torch.as_tensor(page_table_rows, device=q.device).to(torch.int32)
    return positions, positions_to_slots(positions, bt)
