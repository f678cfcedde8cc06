r"""How far a kernel's result may be from the float64 formula of
:mod:`normbook.reference`: the rounding-error bounds the tests hold the matrix products
and fp8 kernels to, each derived in its docstring (and in the book's Part III).

With :math:`u` the unit roundoff of a format, a sum of :math:`n` terms in any order errs
by at most :math:`\gamma_n \sum |t_i|`, :math:`\gamma_n = n u / (1 - n u)` (Higham,
*Accuracy and Stability of Numerical Algorithms*, chapter 3).
"""

import torch

from .reference import dequantize_fp8, fp8_blocks, linear

f64 = torch.float64


def _d(t):
    return None if t is None else torch.as_tensor(t).to(f64)


def gemm_error_bound(x, weight, dtype, bias=None, u_acc=None):
    r"""Elementwise bound on |ŷ − y| for y = x Wᵀ + b summed in a dtype of unit
    roundoff ``u_acc`` (fp32's 2⁻²⁴; fp64's for fp64) and rounded once to ``dtype``:

    .. math:: (1 + u_{out})\,\gamma_{K+1}\bigl(|x|\,|W|^{\mathsf T} + |b|\bigr)
              + u_{out}\,|y| + \eta, \qquad \gamma_n = \frac{n u}{1 - n u},

    the bias counted as a (K+1)-th product b·1, η half the spacing of ``dtype``'s
    subnormals (an output that underflows errs absolutely). Any summation order obeys
    it (Higham, §3.1); fp16/bf16 products are exact in fp32, so for them it is
    generous by one term."""
    u_out = torch.finfo(dtype).eps / 2
    if u_acc is None:
        u_acc = 2.0**-53 if dtype == f64 else 2.0**-24
    n = x.shape[-1] + 1
    gamma = n * u_acc / (1 - n * u_acc)
    terms = _d(x).abs() @ _d(weight).abs().T
    if bias is not None:
        terms = terms + _d(bias).abs()
    eta = torch.finfo(dtype).tiny * u_out
    return (1 + u_out) * gamma * terms + u_out * linear(x, weight, bias).abs() + eta


#: (mantissa bits m, smallest normal exponent e_min) of each fp8 dtype
FP8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


#: half the smallest (subnormal) spacing of each output dtype: the floor of a rounding
UNDERFLOW = {
    torch.float32: 2.0**-150,
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
}


def fp8_round_trip_bound(x, scale, dtype, block=(1, 128)):
    r"""|x − q·s| ≤ s · h(x/s) + 2^-23 |x|: h(v) = 2^(max(⌊log2|v|⌋, e_min) − m − 1) is
    half the fp8 spacing at |v| (nearest rounding), 2^-(m+1) = 2^-4 (e4m3) or 2^-3
    (e5m2) of |v| above the subnormal range, 2^(e_min − m − 1) below; the second term
    is the fp32 division's rounding of x/s."""
    m, e_min = FP8[dtype]
    s = fp8_blocks(scale, block, x.shape)
    v = (_d(x) / s).abs()
    e = torch.floor(torch.log2(v)).clamp(min=e_min)  # log2(0) = -inf: e_min
    return s * torch.exp2(e - m - 1) + 2.0**-23 * _d(x).abs()


def _gamma(n, u):
    return n * u / (1 - n * u)


def linear_fp8_bound(x_q, x_scale, w_q, w_scale, out_dtype, u_acc=2.0**-24, **blocks):
    r"""|ŷ − y| for ``normbook.linear_fp8``, elementwise. Per 128-block of K the
    products of fp8 values are exact and their sum errs by γ_127(u_acc) Σ|x̃||w̃|
    (u_acc: the accumulation's unit roundoff, 2^-24 for fp32); (p·sx)·sw rounds twice
    and the K/128 promoted terms are summed in fp32: γ_{K/128 + 1}, u = 2^-24. Then
    one rounding to out_dtype: u_out |ỹ| plus half its smallest spacing."""
    bx, bw = blocks.get("block_x", (1, 128)), blocks.get("block_w", (128, 128))
    x, w = dequantize_fp8(x_q, x_scale, bx), dequantize_fp8(w_q, w_scale, bw)
    y, absolute = x @ w.T, x.abs() @ w.abs().T
    g = (1 + _gamma(127, u_acc)) * (1 + _gamma(x.shape[1] // 128 + 1, 2.0**-24)) - 1
    u_out = torch.finfo(out_dtype).eps / 2
    return g * absolute + u_out * (y.abs() + g * absolute) + UNDERFLOW[out_dtype]
