"""Host-side helpers shared by the kernel wrappers (argument checks, pool geometry)."""

from __future__ import annotations

import torch

from ..formats import PAGE_SIZE


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)`` (Triton block shapes must be powers of two)."""
    return 1 << max(n - 1, 0).bit_length()


def pool_strides(pool: torch.Tensor, bytes_per_token: int, name: str) -> tuple[int, int]:
    """``(page_stride, token_stride)`` in bytes of a token-interleaved uint8 pool.

    Accepts ``[num_pages, 64, B]`` or FlashMLA's ``[num_pages, 64, 1, B]`` view,
    possibly a strided slice of a larger allocation (a page may be followed by
    other layers' pages), as long as one token's ``B`` bytes are contiguous.
    """
    if pool.dtype != torch.uint8:
        raise ValueError(f"{name}: expected a uint8 pool, got {pool.dtype}")
    if pool.dim() not in (3, 4) or pool.shape[1] != PAGE_SIZE or pool.shape[-1] != bytes_per_token:
        raise ValueError(
            f"{name}: expected pool [num_pages, {PAGE_SIZE}, (1,) {bytes_per_token}], got {tuple(pool.shape)}"
        )
    if pool.dim() == 4 and pool.shape[2] != 1:
        raise ValueError(f"{name}: expected a singleton head dim, got {tuple(pool.shape)}")
    if pool.stride(-1) != 1:
        raise ValueError(f"{name}: a token's bytes must be contiguous, strides {pool.stride()}")
    return pool.stride(0), pool.stride(1)


def page_pool_stride(pool: torch.Tensor, bytes_per_page: int, name: str) -> int:
    """Page stride in bytes of a page-blocked uint8 pool (the indexer cache).

    Accepts ``[num_pages, bytes_per_page]`` or DeepGEMM's
    ``[num_pages, 64, 1, D + 4]`` view; the page's bytes must be contiguous.
    """
    if pool.dtype != torch.uint8:
        raise ValueError(f"{name}: expected a uint8 pool, got {pool.dtype}")
    if pool.dim() < 2 or pool[0].numel() != bytes_per_page or not pool[0].is_contiguous():
        raise ValueError(
            f"{name}: expected contiguous pages of {bytes_per_page} bytes, got "
            f"{tuple(pool.shape)} strides {pool.stride()}"
        )
    return pool.stride(0)


def check_slots(slots: torch.Tensor, name: str) -> torch.Tensor:
    """1-D int32/int64 slot tensor (``page * 64 + offset``, ``-1`` = skip), made contiguous."""
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32/int64 slots [n], got {slots.dtype} {tuple(slots.shape)}")
    return slots.contiguous()


def rows_2d(x: torch.Tensor, n: int, width: int, name: str) -> torch.Tensor:
    """``x`` as ``[n, width]`` with a unit inner stride (copies only if needed)."""
    if x.dim() != 2 or tuple(x.shape) != (n, width):
        raise ValueError(f"{name}: expected [{n}, {width}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: expected float32/bfloat16/float16, got {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()
