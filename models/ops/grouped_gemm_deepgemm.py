"""Routed experts of an fp8 checkpoint on DeepGEMM's m-grouped contiguous fp8 GEMM (prefill, W8A8).

The Triton grouped GEMM (`models.ops.grouped_gemm_cuda`) reads fp8 expert weights and dequantizes each
tile in registers: the products run on bf16 tensor cores. A prefill's expert GEMMs are compute-bound
(thousands of rows per expert), so there the fp8 tensor cores' twice the rate is what matters:
``m_grouped_fp8_gemm_nt_contiguous`` takes activations quantized per 1 x 128 group (`act_quant`) and the
checkpoint's 128 x 128 weight scales as they are (SM90), over rows sorted by expert with each expert's run
padded to DeepGEMM's M alignment (128), a row's expert in ``m_indices`` (``-1``: a padding row, skipped).

Everything is sized from the shapes alone (no read-back): the padded row count is bounded by
``P + E_local * (align - 1)`` for ``P`` pairs, and rows past the last expert's run are padding too.

    rows = contiguous_rows(layout, align)     # where each pair's row goes, each row's expert
    y = expert_outputs(x, w13, w2, layout, w13_scale, w2_scale, block)   # [T * top_k, H], pair order

`fits` says when it runs (an fp8 contiguous layout of at least `MIN_PAIRS` pairs, every expert on this rank,
DeepGEMM installed with the grouped GEMM, 128 x 128 blocks, dims in whole blocks);
`grouped_gemm_cuda.expert_outputs` asks it. Under expert parallelism (tp > 1) the Triton kernel keeps the
experts: the rows are sized from the shapes, so every rank would pad for all ``P`` pairs while computing its
own share (at tp 8 about an eighth), and a count of the local pairs would be a read-back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from models.moe.dispatch import ExpertLayout
from models.ops import fp8_linear_cuda

MIN_PAIRS = 8192

SWITCH_ENV = "DSA_PD_GROUPED_DEEPGEMM"
"""``0`` in the environment (of ``serve run`` or the process): the Triton kernel keeps every prefill's
experts. A bisecting switch, not a setting: session 28's fp8 start-up passed 560 s with these kernels'
first uses in its warm-up, and the next lease tells whether they are why (``run_peer.sh`` passes
``GROUPED_DEEPGEMM=0`` on)."""
"""Fewest (token, expert) pairs that take DeepGEMM's contiguous GEMM: 1,024 tokens at top-8. Below, each
expert's run is short and its padding to 128 rows a large share (DESIGN.md: 71 TFLOP/s of useful work at 512
tokens against 476 at 4,096), and the Triton kernel keeps them. A first choice, not yet measured against the
Triton kernel at the crossover."""


@dataclass(frozen=True)
class ContiguousRows:
    """The padded row layout of one contiguous `ExpertLayout` (every tensor on the layout's device).

    m_indices:   int32 ``[M]``: local expert of each row, ``-1`` for a padding row
    row_of_pair: int64 ``[T * top_k]``: the row of each pair; other ranks' pairs point at row ``M - 1`` (padding
                 whenever there is a local pair, since the bound keeps at least ``align - 1`` spare rows)
    token_of_row: int64 ``[M]``: the token each row reads (0 for padding rows, whose output is never read)
    """

    m_indices: torch.Tensor
    row_of_pair: torch.Tensor
    token_of_row: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.m_indices.shape[0])


def padded_rows_bound(num_pairs: int, num_local: int, align: int) -> int:
    """Rows of the padded layout: every pair plus at most ``align - 1`` padding rows per expert, and one spare
    run (the landing row of other ranks' pairs), rounded up to ``align``."""
    rows = num_pairs + num_local * (align - 1) + align
    return -(-rows // align) * align


def contiguous_rows(layout: ExpertLayout, align: int) -> ContiguousRows:
    """The rows DeepGEMM's contiguous GEMM runs for ``layout`` (contiguous): expert ``e``'s pairs, in the
    layout's order, from row ``start[e]`` = the sum of the earlier experts' counts rounded up to ``align``."""
    if layout.masked:
        raise ValueError("contiguous_rows takes the contiguous layout (prefill), not the masked one")
    if layout.num_local < 1:
        raise ValueError("contiguous_rows needs at least one local expert")
    dev = layout.pairs.device
    P, E, K = layout.num_pairs, layout.num_local, layout.top_k
    M = padded_rows_bound(P, E, align)
    counts = layout.counts.long()
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(padded, 0) - padded                      # [E] first row of each expert
    # Sorted position i (the layout's order) holds pair pairs[i]; within expert e it is the (i - row_start[e])-th.
    pos = torch.arange(P, device=dev)
    expert = torch.searchsorted(torch.cumsum(counts, 0), pos, right=True)  # == E past the local pairs
    local = expert < E
    e = expert.clamp(max=E - 1)
    row = torch.where(local, start[e] + pos - layout.row_start.long()[e], M - 1)
    pairs = layout.pairs.long()
    row_of_pair = torch.empty(P, dtype=torch.int64, device=dev)
    row_of_pair.scatter_(0, pairs, row)
    m_indices = torch.full((M,), -1, dtype=torch.int32, device=dev)
    token_of_row = torch.zeros(M, dtype=torch.int64, device=dev)
    m_indices[row[local]] = expert[local].to(torch.int32)
    token_of_row[row[local]] = pairs[local] // K
    return ContiguousRows(m_indices, row_of_pair, token_of_row)


def _grouped_gemm():
    dg = fp8_linear_cuda._deep_gemm()
    return getattr(dg, "m_grouped_fp8_gemm_nt_contiguous", None) if dg is not None else None


def alignment() -> int:
    """DeepGEMM's M alignment of a contiguous group (128 on SM90; asked of the installed package)."""
    dg = fp8_linear_cuda._deep_gemm()
    get = getattr(dg, "get_mk_alignment_for_contiguous_layout", None) or getattr(dg, "get_m_alignment_for_contiguous_layout", None)
    return int(get()) if get is not None else 128


def fits(layout: ExpertLayout, w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether `expert_outputs` takes these experts: fp8 weights of 128 x 128 blocks with every dim in whole
    blocks, the contiguous layout of at least `MIN_PAIRS` pairs, DeepGEMM's grouped GEMM installed, and not
    switched off (`SWITCH_ENV`)."""
    if block is None or tuple(block) != (128, 128) or layout.masked or layout.num_pairs < MIN_PAIRS:
        return False
    if os.environ.get(SWITCH_ENV) == "0":
        return False
    if not layout.all_local:
        return False
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        return False
    E, I2, H = w13.shape
    if E < 1 or H % 128 or I2 % 256:
        return False
    return _grouped_gemm() is not None


SILU_BLOCK_ROWS = 4096
"""Rows `silu_mul` computes at once (its fp32 temporaries: 4,096 x 2,048 x 4 bytes, 32 MiB, per operand)."""


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[M, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[M, I]``, bf16, computed in fp32 (the Triton kernel's
    GATE_UP epilogue) over blocks of `SILU_BLOCK_ROWS` rows."""
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(M, I, dtype=torch.bfloat16, device=gate_up.device)
    for r0 in range(0, M, SILU_BLOCK_ROWS):
        blk = gate_up[r0:r0 + SILU_BLOCK_ROWS]
        out[r0:r0 + SILU_BLOCK_ROWS] = torch.nn.functional.silu(blk[:, :I].float()) * blk[:, I:].float()
    return out


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout,
                   w13_scale: torch.Tensor, w2_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x bf16 ``[T, H]``, fp8 w13 ``[E_local, 2I, H]`` / w2 ``[E_local, H, I]`` with their block scales ->
    bf16 ``[T * top_k, H]`` in pair order (rows of other ranks' pairs hold padding output: ``combine`` skips
    them). Two grouped GEMMs with the SiLU-and-multiply and the second activation quantization between.

    Its temporaries hold every padded row, each freed once the next is made: the peak is the last GEMM's
    bf16 output ``[M, H]`` beside its gather into pair order ``[T * top_k, H]``, ~1.9 GB for an 8,192-token
    chunk at DeepSeek-V3.2's dims and 16 experts (M ~ 67.7k rows; the Triton kernel gathers the rows through
    the pair table instead and holds ``[T * top_k, I + H]``, ~1.2 GB)."""
    gemm = _grouped_gemm()
    E, I2, H = w13.shape
    rows = contiguous_rows(layout, alignment())
    M = rows.num_rows
    xs = x.to(torch.bfloat16).index_select(0, rows.token_of_row)      # [M, H]; padding rows read token 0
    q, sf = fp8_linear_cuda.act_quant(xs)
    del xs
    gate_up = torch.empty(M, I2, dtype=torch.bfloat16, device=x.device)
    gemm((q, sf), (w13, w13_scale), gate_up, rows.m_indices)
    del q, sf
    act = silu_mul(gate_up)
    del gate_up
    q, sf = fp8_linear_cuda.act_quant(act)
    del act
    out = torch.empty(M, H, dtype=torch.bfloat16, device=x.device)
    gemm((q, sf), (w2, w2_scale), out, rows.m_indices)
    del q, sf
    return out.index_select(0, rows.row_of_pair).to(x.dtype)
