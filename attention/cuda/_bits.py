"""Bit-exact float conversions (and little-endian byte loads / stores) shared by the Triton kernels.

Every conversion that decides a stored bit is done here with integer
arithmetic instead of Triton's ``.to(...)`` casts, for two reasons:

* the cache bytes must be bit-identical to the torch reference
  (``attention/formats.py``), which rounds to nearest-even; doing the rounding
  ourselves makes that independent of which PTX ``cvt`` a Triton version
  happens to emit;
* Triton's CPU interpreter (``TRITON_INTERPRET=1``, used by CI) does *not*
  round fp32 -> bf16 / fp8 to nearest-even (it truncates, or rounds half away
  from zero and mishandles the mantissa carry), so a cast-based kernel would
  pass on the GPU and fail in CI, or the other way round. With these helpers the
  interpreter and the GPU execute the same integer program.

The only floating-point operations left in the kernels are IEEE
round-to-nearest ``div_rn`` and ``mul`` (identical on numpy and on the GPU) and
exact conversions (small integers, fp16 -> fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_u32_le(ptrs, bits, mask):
    """Store uint32 ``bits`` as 4 little-endian bytes at uint8 ``ptrs`` (any alignment)."""
    for b in tl.static_range(4):
        tl.store(ptrs + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def load_u32_le(ptrs, mask):
    """Load 4 little-endian bytes at uint8 ``ptrs`` (any alignment) as uint32."""
    bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint32)
    for b in tl.static_range(1, 4):
        bits = bits | (tl.load(ptrs + b, mask=mask, other=0).to(tl.uint32) << (8 * b))
    return bits


@triton.jit
def f32_to_e4m3fn_bits(x):
    """fp32 tensor, already clamped to [-448, 448] -> uint32 tensor of float8_e4m3fn bits (0..255).

    Round to nearest, ties to even, subnormals included; identical to
    ``torch.Tensor.to(torch.float8_e4m3fn)`` on clamped finite inputs.
    """
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = (a >> 23).to(tl.int32)
    # Normal e4m3 range (|x| >= 2^-6, fp32 exponent field >= 121): keep 3 of the
    # 23 mantissa bits, rounding the dropped 20 to nearest-even. A carry out of
    # the mantissa correctly bumps the exponent (1.111b * 2^e -> 1.000b * 2^(e+1)),
    # which is why the rounding is done on the whole exponent|mantissa word.
    rounded = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)  # rebias: fp32 bias 127 -> e4m3 bias 7
    # Subnormal e4m3 range: the value is k * 2^-9 with k = rne(|x| * 2^9) in 0..8
    # (k = 8 is the smallest normal, whose bit pattern is exactly 8).
    # |x| = m * 2^(e - 150) with the implicit bit, so k = rne(m >> (141 - e)).
    m = (a & 0x7FFFFF) | 0x800000
    # Shifts >= 32 are undefined on the GPU; any shift >= 25 already gives 0.
    s = tl.minimum(141 - e, 31).to(tl.uint32)
    q = m >> s
    rem = m & ((tl.zeros_like(m) + 1 << s) - 1)
    half = tl.zeros_like(m) + 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
    mag = tl.where(e >= 121, normal, q)
    return mag | sign


@triton.jit
def e4m3fn_bits_to_f32(b):
    """uint32 tensor of float8_e4m3fn bits (0..255) -> fp32 tensor (exact; 0x7f / 0xff -> NaN)."""
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + 120) << 23) | (m << 20)
    # Subnormal: m * 2^-9; both factors and the product are exact in fp32.
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, mag)
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 tensor -> uint32 tensor holding bfloat16 bits in the low 16 bits.

    Round to nearest, ties to even; NaN -> 0x7fc0 (torch's canonical bf16 NaN).
    """
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)


@triton.jit
def bf16_to_f32(v):
    """bfloat16 tensor -> fp32 tensor, exact (a 16-bit shift of the bits)."""
    return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """Load fp32 / fp16 / bf16 elements as exact fp32 (masked lanes read 0)."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    if IS_BF16:
        return bf16_to_f32(v)
    else:
        return v.to(tl.float32)


@triton.jit
def float_order_key(x):
    """fp32 tensor -> uint32 key whose unsigned order is the numeric order.

    Positive floats get the sign bit set, negative ones are bit-inverted, so
    ``-inf < -1 < -0 == +0 < 1 < +inf`` maps to increasing keys. ``-0.0`` is
    folded onto ``+0.0`` (they compare equal, so they must tie) and every NaN
    onto the largest key (``torch.topk`` ranks NaN above +inf).
    """
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(x == 0.0, 0, u)
    # `u ^ 0xFFFFFFFF`, not `~u`: the interpreter cannot build ~ for unsigned types.
    key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)
