"""The error bound of an attention output, shared by the attention tests (forward, backward
and decode): how far the kernel's result may be from the exact one, from its roundings."""

import torch
from conftest import UNIT_ROUNDOFF

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
