"""Counter-based random numbers: uniforms as a pure function of (seed, offset, index).

A request's randomness is two ints, its seed and its offset (how many draws
it has consumed), never a generator state: the same (seed, offset, index)
gives the same number on CPU and CUDA, in any batch, at any row, and a
prefill replica hands decode the two ints. The hash is splitmix64 (Steele et
al., "Fast splittable pseudorandom number generators", OOPSLA 2014; the
finaliser is Stafford's "variant 13") in int64 tensor ops:

    stream = mix64(seed + GOLDEN)                      # one stream per seed
    h      = mix64(stream + (offset * 2**16 + index + 1) * GOLDEN)

i.e. the ``offset * 2**16 + index + 1``-th output of splitmix64 started at the
seed's scrambled key. Integer ops are exact on every device (int64
multiplication wraps modulo 2**64 on CPU and CUDA alike; right shifts are made
logical by masking), and the float is made from the hash's top 23 bits
without rounding.
"""

from __future__ import annotations

import torch

INDEX_BITS = 16
"""Numbers one draw may use: ``index`` in ``[0, 2**16)``; offsets below ``2**47``."""

_M64 = (1 << 64) - 1


def to_int64(x: int) -> int:
    """An int modulo 2**64 as a signed int64 (how a seed of any size enters a tensor)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


GOLDEN = to_int64(0x9E3779B97F4A7C15)
_C1 = to_int64(0xBF58476D1CE4E5B9)
_C2 = to_int64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: mask the sign copies off)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 ``[...]`` (a bijection of 64-bit words)."""
    x = x ^ _srl(x, 30)
    x = x * _C1
    x = x ^ _srl(x, 27)
    x = x * _C2
    return x ^ _srl(x, 31)


def random_bits(seed: torch.Tensor, offset: torch.Tensor, index: torch.Tensor | int = 0) -> torch.Tensor:
    """int64 hash words of (seed, offset, index), broadcast together.

    seed, offset: int64 ``[...]`` (typically ``[N, 1]`` or ``[N]``); index:
    int64 ``[...]`` or an int in ``[0, 2**16)``.
    """
    stream = mix64(seed + GOLDEN)
    counter = (offset << INDEX_BITS) + index + 1
    return mix64(stream + counter * GOLDEN)


def uniforms(seed: torch.Tensor, offset: torch.Tensor, index: torch.Tensor | int = 0) -> torch.Tensor:
    """fp32 uniforms in the open interval (0, 1), bit-identical on every device.

    ``(2 m + 1) / 2**24`` for ``m`` the hash's top 23 bits: an odd integer
    below 2**24 converts to fp32 exactly and the scale is a power of two, so
    no rounding anywhere; never 0 or 1, so ``u * total < total`` and
    ``-log(u)`` need no special cases. Shapes as `random_bits`.
    """
    odd = (_srl(random_bits(seed, offset, index), 41) << 1) | 1
    return odd.to(torch.float32) * (1.0 / (1 << 24))
