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


@triton.jit
def tanh(x):
    """tanh of fp32 ``x`` from ``tl.exp2``, with a small relative error: the same code
    runs in the interpreter and on sm_75, sm_80 and sm_90 (Triton has no tanh that all
    of them run; the GPU's tanh.approx is off by up to 2^-11 relative).

    For |x| ≥ 0.625: tanh|x| = (1 - t) / (1 + t) with t = exp(-2|x|) = 2^(-2 log2(e)
    |x|) in (0, 0.29]: t never overflows (it underflows to 0 for |x| > ~52, giving 1
    exactly). Below 0.625, where 1 - t would cancel, an odd polynomial instead
    (Cephes' tanhf: x + x·z·P(z), z = x², within 2.2 ulp of tanh). The sign comes back
    by a select (tanh is odd; NaN stays NaN).

    Rounding, relative to tanh x (at least 0.55 on the exp2 side): exp2's relative
    error ε (an ulp or two: ex2.approx on a GPU) and the rounding of its argument
    (2u|x| relative to t) move the quotient by 2t(ε + 2u|x|)/(1 + t)² ≤ 0.3ε + 0.4u;
    1 - t, 1 + t and the division (IEEE in the interpreter, div.full's 2 ulp on a GPU)
    add at most 4u; the polynomial's Horner steps add about 2u to its 2.2. In all
    about 6u, u = 2^-24 (the tests measure it below 3u in the interpreter).
    """
    a = tl.abs(x)
    t = tl.exp2(-2.8853900817779268 * a)  # 2·log2(e)
    big = (1.0 - t) / (1.0 + t)
    b = tl.minimum(a, 0.625)  # the polynomial only where it is used
    z = b * b
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = b + b * (p * z)
    r = tl.where(a < 0.625, small, big)
    return tl.where(x < 0.0, -r, r)
