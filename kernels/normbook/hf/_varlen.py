"""Attention over packed sequences of different lengths, as FlashAttention's
``flash_attn_varlen_func``: the one place :mod:`normbook.hf` calls it.

q, k and v hold every sequence's rows end to end, ``(total, heads, head_dim)``;
sequence ``s`` is rows ``cu_seqlens[s]:cu_seqlens[s + 1]``. ``causal=True`` is
bottom-right per sequence (query ``i`` of a sequence sees its keys
``j <= i + len_k - len_q``), ``window`` as :func:`normbook.attention`'s, GQA when k and
v have fewer heads.

This body runs :func:`normbook.attention` on each sequence (a batch of one) and
concatenates: exact and differentiable, one launch per sequence. A varlen kernel, one
launch for all of them, replaces the body, not the signature.
"""

from __future__ import annotations

import torch

from ..attention import attention


def _varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    scale=None,
    window=None,
    softcap=None,
):
    """``(total_q, heads, head_dim)``: each sequence's attention, rows in q's order. A
    query that sees no key (an empty sequence of keys) gets zeros."""
    if softcap is not None:
        raise ValueError("softcap: not supported by this varlen attention yet")
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for s in range(len(starts_q) - 1):
        q0, q1 = starts_q[s], starts_q[s + 1]
        k0, k1 = starts_k[s], starts_k[s + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(q.new_zeros((q1 - q0, *q.shape[1:])))
            continue
        # (len, heads, head_dim) -> (1, heads, len, head_dim): views, no copy
        qs, ks, vs = (
            t[a:b].transpose(0, 1)[None]
            for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
        )
        out = attention(qs, ks, vs, causal=causal, scale=scale, window=window)
        outs.append(out[0].transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs)
