"""The kernels' attention as one of transformers' attention implementations:
``attn_implementation="normbook"`` runs attention on :func:`normbook.attention` (or its
varlen form) in any model that dispatches through ``AttentionInterface``, without
:func:`normbook.hf.patch`. Its masks are SDPA's (registered with
``AttentionMaskInterface`` under the same name): boolean, or None where SDPA's own
``is_causal`` suffices; what the kernels cannot compute runs on transformers' SDPA."""

from __future__ import annotations

from ._attention import ATTN_IMPLEMENTATION, _run_attention


def normbook_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers' attention-function signature: (batch, heads, seq, head_dim) q, k,
    v; returns ((batch, seq_q, heads, head_dim), None)."""
    return _run_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        sliding_window=sliding_window,
        dropout=dropout,
        softcap=softcap,
        **kwargs,
    )


def register() -> str:
    """Register the kernels' attention with transformers as ``"normbook"``
    (``AttentionInterface``, and SDPA's mask builder in ``AttentionMaskInterface``:
    without a mask builder transformers would pass no mask at all). Idempotent;
    ``import normbook.hf`` calls it. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, normbook_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
