"""The error bounds of an attention output and of its gradients, shared by the attention
tests (forward, backward, varlen and decode): how far the kernel's results may be from the
exact ones, from their roundings."""

import torch
from conftest import UNIT_ROUNDOFF, on_cpu

from normbook import reference as ref

U32 = 2.0**-24


def error_bound(
    q, k, v, out_dtype, causal=False, window=None, scale=None, softcap=None
):
    """Elementwise bound on |kernel − exact| (float64, CPU), from the kernel's roundings.

    * P is rounded to the input dtype before P·V: each p_j moves by u relatively, so the output
      moves by at most u·Σ_j p_j |v_j|, which is the reference attention applied to |v|.
    * The scores are fp32 dot products of length D, scaled (and multiplied by log2 e): each is
      off by at most δ = (D + 4)·2⁻²⁴·scale·Σ_d |q_d k_d|; exp turns that into a relative error
      of p_j of δ_j, and the normalization by ℓ adds another δ: 2·max_j δ_j · Σ p|v|.
    * P·V and the rescaling are summed in fp32 over seq_k keys: (seq_k + 64)·2⁻²⁴ · Σ p|v|.
    * The output is rounded once to its dtype (u·|o|; fp16 subnormals: 2⁻²⁵ absolute).
    * A soft cap c·tanh(s/c) (tanh's slope is at most 1, so it only shrinks the dot
      product's error) adds its own: tanh from exp2 within about 6·2⁻²⁴ relative, and
      the roundings of s/c and of the product by c: 12·2⁻²⁴ relative to |s| more in δ.
    A missing rescale, a mask off by one key or a wrong k/v head moves outputs by about
    1/seq_k · |v| or more: above this bound at the sizes tested in fp32.
    """
    u = UNIT_ROUNDOFF[out_dtype]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd = q.double().cpu(), k.double().cpu()
    group = q.shape[1] // k.shape[1]
    kd = kd.repeat_interleave(group, dim=1)
    qk = abs(scale) * (qd.abs() @ kd.abs().transpose(-1, -2))
    keep = ref.attention_mask(q.shape[2], k.shape[2], causal, window)
    qk = qk.masked_fill(~keep, 0.0)
    roundings = q.shape[-1] + 4 + (12 if softcap else 0)
    delta = roundings * U32 * qk.amax(dim=-1, keepdim=True)
    kw = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    o = ref.attention(q.cpu(), k.cpu(), v.cpu(), **kw)
    pv = ref.attention(q.cpu(), k.cpu(), v.abs().cpu(), **kw)
    u_p = 0.0 if out_dtype == torch.float32 else u
    acc = (k.shape[2] + 64) * U32
    atol = 2.0**-25 if out_dtype == torch.float16 else 0.0
    return o, (u_p + 2 * delta + acc) * pv + u * o.abs() + atol


@torch.no_grad()
def grad_bounds(q, k, v, do, causal=False, window=None, scale=None, softcap=None):
    """((dq, dk, dv) exact, (bounds)): elementwise bounds on |kernel − exact|, float64,
    CPU.

    First-order error analysis of the kernels' roundings (u: the input dtype's unit
    roundoff; u_low = u for fp16/bf16, 0 for fp32, where nothing is rounded before a
    product):

    * p = exp2(s·log2 e − L·log2 e) is recomputed with the score error δ_i of the
      forward's bound ((D + 4)·2⁻²⁴·scale·max_j Σ|q k|), L's own error (δ_i, the fp32
      sum ℓ over seq_k keys, and three roundings of |L|: m + log2 ℓ, ·ln 2, ·log2 e) and
      the exponential (4·2⁻²⁴: a GPU's ex2.approx is within 2 ulp): relative error ε_i
      per row.
    * dV = Σ_i round(p) dO_i: (ε_i + u_low + fp32 sum over the group's queries) ·
      Pᵀ|dO|.
    * dP = dO·v (fp32, length D): (D + 4)·2⁻²⁴ · |dO||v|. D_i = dO·Õ uses the forward's
      stored, rounded output: its error bound (attention_bounds.error_bound) times |dO|,
      plus the fp32 dot.
    * dS = round(p (dP − D)): P∘(e_dP + e_D) + ε·P|dP − D| + u_low·|dS|.
    * dQ = scale·dS K and dK = scale·dSᵀQ: the dS errors times |K| (|Q|), plus the fp32
      sums over seq_k keys (over the group's queries), plus the final rounding u·|g|.
    * fp16's subnormals (below 2⁻¹⁴) err by 2⁻²⁵ absolutely at each rounding of p and
      dS. A dropped D, a wrong group sum, a missing scale or a mask off by one key moves
      gradients by about |P|·|dO|·|v| — orders of magnitude above these bounds at these
      sizes.
    * A soft cap c: the scores' δ grows by 12·2⁻²⁴·scale·Σ|q k| as in error_bound,
      and dS is multiplied by g = 1 − t², t = tanh(x) recomputed with an error of
      (1 − t²)·δ/c (the input's) plus 12·2⁻²⁴·|t| (its own, as error_bound allows): g
      errs by 2|t| times that, plus two roundings. A dropped g moves dq, dk by |dS|·t², far above the bound where the
      cap bites.
    """
    dtype = q.dtype
    u = UNIT_ROUNDOFF[dtype]
    u_low = 0.0 if dtype == torch.float32 else u
    sub = 2.0**-25 if dtype == torch.float16 else 0.0
    q64, k64, v64, do64 = (t.detach().double().cpu() for t in (q, k, v, do))
    B, H, M, Dh = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    G = H // H_kv
    scale = Dh**-0.5 if scale is None else scale
    kr, vr = k64.repeat_interleave(G, 1), v64.repeat_interleave(G, 1)
    keep = ref.attention_mask(M, N, causal, window).double()
    P = ref.attention_probs(q64, k64, causal, scale, window, softcap)
    L = ref.attention_lse(q64, k64, causal, scale, window, softcap)
    exact = ref.attention_backward(q64, k64, v64, do64, causal, scale, window, softcap)
    O = P @ vr
    dP = do64 @ vr.transpose(-1, -2)
    Dv = (do64 * O).sum(-1, keepdim=True)
    dS = P * (dP - Dv)  # with a cap: dS of the capped scores, g = 1 − t² applied below
    qk = abs(scale) * (q64.abs() @ kr.abs().transpose(-1, -2)) * keep
    delta = (Dh + 4) * U32 * qk.amax(-1, keepdim=True)
    delta_cap = delta
    if softcap:
        t = torch.tanh(ref.attention_scores(q64, k64, scale) / softcap)
        delta_cap = delta + 12 * U32 * qk.amax(-1, keepdim=True)
    L_abs = torch.where(torch.isfinite(L), L.abs(), torch.zeros_like(L))[..., None]
    eps = 2 * delta_cap + (N + 72) * U32 + 4 * L_abs * U32
    _, err_o = error_bound(q, k, v, dtype, causal, window, scale, softcap)
    e_D = (Dh + 4) * U32 * (do64.abs() * O.abs()).sum(-1, keepdim=True) + (
        do64.abs() * err_o
    ).sum(-1, keepdim=True)
    e_dP = (Dh + 4) * U32 * (do64.abs() @ vr.abs().transpose(-1, -2))
    err_ds = P * (e_dP + e_D) + eps * P * (dP - Dv).abs()
    if softcap:
        g = 1 - t * t
        err_g = 2 * t.abs() * (g * delta / softcap + 12 * U32 * t.abs()) + 2 * U32
        err_ds = err_ds * g + dS.abs() * err_g
        dS = dS * g
    err_ds = err_ds + u_low * dS.abs() + sub * keep

    def acc(n):  # fp32 sum of n terms, any order (a GPU's reduction tree too)
        return (n + 64) * U32

    def per_kv_head(t):
        return t.unflatten(1, (H_kv, G)).sum(2)

    b_dq = abs(scale) * (err_ds @ kr.abs() + acc(N) * (dS.abs() @ kr.abs()))
    dSt = dS.abs().transpose(-1, -2)
    b_dk = abs(scale) * per_kv_head(
        err_ds.transpose(-1, -2) @ q64.abs() + acc(G * M) * (dSt @ q64.abs())
    )
    b_dv = per_kv_head(
        ((eps + u_low + acc(G * M)) * P).transpose(-1, -2) @ do64.abs()
        + sub * (keep.transpose(-1, -2) @ do64.abs())
    )
    bounds = tuple(b + u * g.abs() + sub for b, g in zip((b_dq, b_dk, b_dv), exact))
    return exact, bounds


def assert_grads_within_bound(
    grads, q, k, v, do, causal=False, window=None, scale=None, softcap=None
):
    exact, bounds = grad_bounds(q, k, v, do, causal, window, scale, softcap)
    worst = 0.0
    for name, g, e, b in zip(("dq", "dk", "dv"), grads, exact, bounds):
        g = on_cpu(g).double()
        assert g.shape == e.shape, f"{name}: shape {tuple(g.shape)} != {tuple(e.shape)}"
        assert not torch.isnan(g).any(), f"{name}: NaN (poisoned, unwritten or 0/0)"
        err = (g - e).abs()
        i = torch.argmax(err - b)
        assert bool((err <= b).all()), (
            f"{name} ({q.dtype}): error {err.flatten()[i]:.3g} > "
            f"bound {b.flatten()[i]:.3g}"
        )
        worst = max(worst, (err / b.clamp_min(1e-300)).max().item())
    return worst  # the largest error as a fraction of its bound
