"""Small @triton.jit helpers shared by the kernels."""

import triton
import triton.language as tl

from ._runtime import INTERPRET

_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` rounding to nearest-even, as a GPU does.

    Triton's CPU interpreter truncates fp32 -> bf16 casts (rounds toward zero), which would make
    the interpreter's bf16 results differ from a GPU's by a rounding step. There we round by hand
    on the bit pattern; on a GPU the plain cast already rounds to nearest-even.
    """
    if _INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # add half an ulp of bf16, ties to even
        bits = (bits >> 16) << 16                   # drop the 16 low bits: now exact in bf16
        rounded = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(dtype)  # NaN stays NaN
    else:
        return x.to(dtype)
