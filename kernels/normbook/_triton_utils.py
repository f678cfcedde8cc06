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


# tanh's odd Taylor coefficients, x³ to x¹¹ (tanh x = x − x³/3 + 2x⁵/15 − …)
_T3 = tl.constexpr(-1.0 / 3.0)
_T5 = tl.constexpr(2.0 / 15.0)
_T7 = tl.constexpr(-17.0 / 315.0)
_T9 = tl.constexpr(62.0 / 2835.0)
_T11 = tl.constexpr(-1382.0 / 155925.0)


@triton.jit
def tanh(x):
    """tanh of fp32 ``x`` from ``exp2`` alone, in the interpreter and on sm_75 to sm_90.

    ``|x| >= 1/4``: tanh|x| = (1 − z) / (1 + z) with z = exp(−2|x|) in (0, 0.61]:
    nothing overflows (z → 0 as |x| grows, and tanh → 1 exactly; z = 0 at ±inf).
    ``|x| < 1/4``: 1 − z would cancel (a relative error of about u/(2|x|), u = 2⁻²⁴),
    so the Taylor polynomial to x¹¹ instead: the first term left out, 21844/6081075 ·
    x¹³, is below 2⁻³¹ of tanh x there, under fp32's own rounding. NaN stays NaN.

    Rounding, relative: the polynomial is x plus a correction below 2 % of it: about
    2u. The quotient: exp2's error (amplified by z/(1 − z) ≤ 1.55), the argument's
    product, 1 − z, 1 + z and the division, each about u: at most about 6u where exp2
    and the division are correctly rounded, as in the interpreter (3u measured by
    tests/kernels/test_attention.py, which holds it to 6u); we expect up to about 13u
    on a GPU, whose ex2.approx and div.full err by up to 2 ulp (not measured here).
    """
    a = tl.abs(x)
    z = tl.exp2(a * -2.8853900817779268)  # exp(−2|x|) = 2^(−2|x|·log2 e)
    quotient = (1.0 - z) / (1.0 + z)
    b = tl.minimum(a, 0.25)  # the polynomial's side only (and no overflow in b⁵)
    a2 = b * b
    poly = b + b * a2 * (_T3 + a2 * (_T5 + a2 * (_T7 + a2 * (_T9 + a2 * _T11))))
    t = tl.where(a < 0.25, poly, quotient)
    return tl.where(x < 0.0, -t, t)


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
