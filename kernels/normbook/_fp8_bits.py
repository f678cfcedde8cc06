"""fp8 bits by hand: the @triton.jit helpers of :mod:`normbook.fp8` that encode and
decode fp8 values without any fp8 cast, and two interpreter workarounds (bf16 in and
out). Why: the module docstring of :mod:`normbook.fp8`."""

import triton
import triton.language as tl

from ._runtime import INTERPRET
from ._triton_utils import round_to

_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def to_f32(x):
    """``x`` as fp32, exactly. Triton 3.9's interpreter gets bf16's subnormals wrong
    in this cast; there the bits move by hand (a bf16 is the top half of an fp32)."""
    if _INTERPRET and x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def fp8_bits(v, E5M2: tl.constexpr):
    """The fp8 bits (int32, 0..255) of finite fp32 ``v`` with |v| <= fmax, rounded to
    nearest-even as PyTorch (c10) rounds: no fp8 cast is involved."""
    MBITS: tl.constexpr = 2 if E5M2 else 3  # mantissa bits
    BIAS: tl.constexpr = 15 if E5M2 else 7  # exponent bias
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    # Below the smallest normal 2^(1 - BIAS): add the fp32 number whose spacing is the
    # fp8 subnormal spacing; the fp32 addition rounds to nearest-even on that grid.
    MAGIC: tl.constexpr = (127 - BIAS + SHIFT + 1) << 23
    magic = tl.full(v.shape, MAGIC, tl.int32).to(tl.float32, bitcast=True)
    sub = (mag.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True)
    sub = sub - MAGIC
    # Normal: rebias the exponent, add half a spacing less one plus the parity of the
    # kept mantissa (ties to even), keep the top bits; a carry into the exponent is
    # the right answer (31.6 -> 32).
    odd = (mag >> SHIFT) & 1
    normal = (mag + ((BIAS - 127) << 23) + ((1 << (SHIFT - 1)) - 1) + odd) >> SHIFT
    return tl.where(mag < ((128 - BIAS) << 23), sub, normal) | sign


@triton.jit
def fp8_value(bits, E5M2: tl.constexpr):
    """The fp32 value of fp8 ``bits`` (int32, 0..255), exactly, NaN and Inf too."""
    MBITS: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    SUB: tl.constexpr = 2.0**-16 if E5M2 else 2.0**-9  # the subnormal spacing
    mag = bits & 0x7F
    # normal: the exponent and mantissa fields moved into fp32's, rebiased
    normal = ((mag << (23 - MBITS)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    # subnormal: the mantissa times the spacing (exact, no fp32 subnormal on the way)
    sub = (mag & ((1 << MBITS) - 1)).to(tl.float32) * SUB
    v = tl.where(mag < (1 << MBITS), sub, normal)
    if E5M2:  # exponent all ones: Inf (mantissa 0) or NaN
        special = tl.where(mag == 0x7C, float("inf"), float("nan"))
        v = tl.where(mag >= 0x7C, special, v)
    else:  # e4m3fn: S.1111.111 is NaN; there is no Inf
        v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where(bits >= 0x80, -v, v)


@triton.jit
def store_rounded(ptrs, y, mask):
    """Store fp32 ``y`` rounded to the pointers' dtype. The interpreter's fp32 -> bf16
    cast truncates and flushes bf16's subnormals to zero: there the rounded bits are
    stored as uint16 (round_to's arithmetic, NaN as PyTorch writes it)."""
    if _INTERPRET and ptrs.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = tl.where(y != y, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        tl.store(ptrs.to(tl.pointer_type(tl.uint16)), bits.to(tl.uint16), mask=mask)
    else:
        tl.store(ptrs, round_to(y, ptrs.dtype.element_ty), mask=mask)
