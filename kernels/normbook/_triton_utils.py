"""Small @triton.jit helpers shared by the kernels."""

import triton
import triton.language as tl

from ._runtime import INTERPRET

_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` rounding to nearest-even, as a GPU does.

    Triton's CPU interpreter truncates fp32 -> bf16 casts (rounds toward zero), which
    would make the interpreter's bf16 results differ from a GPU's by a rounding step.
    There we round by hand on the bit pattern; on a GPU the plain cast already rounds to
    nearest-even.
    """
    if _INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # add half an ulp of bf16, ties to even
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        # drop the 16 low bits: now exact in bf16
        bits = (bits >> 16) << 16
        rounded = bits.to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded).to(dtype)  # NaN stays NaN
    else:
        return x.to(dtype)


@triton.jit
def chan_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    """Merge two (mean, M2, count) summaries of disjoint parts of a row (Chan, Golub &
    LeVeque).

    delta = mean_b - mean_a;  n = n_a + n_b;  mean = mean_a + delta * n_b / n; M2 = M2_a
    + M2_b + delta**2 * n_a * n_b / n.  The variance of the union is M2 / n. Usable as
    the combine function of ``tl.reduce`` (it is associative up to rounding), and safe
    when both counts are zero (masked lanes).
    """
    n = n_a + n_b
    delta = mean_b - mean_a
    frac_b = tl.where(n > 0, n_b / tl.maximum(n, 1.0), 0.0)
    mean = mean_a + delta * frac_b
    m2 = m2_a + m2_b + delta * delta * n_a * frac_b
    return mean, m2, n


@triton.jit
def _mean(total, N):
    """total / N correctly rounded (div_rn; a plain fp32 ``/`` lowers to the approximate
    ``div.full.f32`` on a GPU, which the interpreter would not reproduce)."""
    if total.dtype == tl.float64:
        return total / N  # div.rn.f64: IEEE already
    else:
        return tl.math.div_rn(total, tl.zeros_like(total) + N)
