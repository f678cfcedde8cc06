"""The patched attention of :mod:`normbook.hf`: projections, Qwen3's q/k norms and
RoPE as one :func:`normbook.qk_norm_rope`, the KV cache, the kernels' attention (dense
or varlen, as :mod:`normbook.hf._masks` reads transformers' mask), o_proj; else the
module's own attention, with a warning (or, under ``patch(model, strict=True)``, a
``ValueError``) when it is the mask that the kernels cannot compute.

:func:`_run_attention` is the step any patched attention forward shares: q, k, v after
RoPE and the cache, transformers' mask, in; the output and attention weights out."""

from __future__ import annotations

import sys
import warnings

from ..attention import DTYPES as ATTENTION_DTYPES
from ..attention import MAX_HEAD_DIM, attention
from ..qk_norm_rope import MAX_FUSED_BYTES, qk_norm_rope
from ._common import (
    _autocast_dtype,
    _cache_update,
    _is_transformers_class,
    _norm_eps,
    _pop_cache,
)
from ._masks import Dense, Unrecognized, mask_layout
from ._varlen import _varlen_attention

#: The name under which :func:`normbook.hf.register` adds the kernels' attention to
#: transformers' ``AttentionInterface`` (``attn_implementation="normbook"``).
ATTN_IMPLEMENTATION = "normbook"

# Attention modules with per-head q_norm/k_norm (Qwen3 convention) followed by RoPE.
_QK_NORM_ATTENTION = {"Qwen3Attention", "Qwen3MoeAttention"}


def _qk_fusable(self, hidden_states, cos, sin) -> bool:
    """Qwen3's q_norm, k_norm and RoPE can run as one normbook.qk_norm_rope:
    ``hidden_states`` is the q projection (under autocast in autocast's dtype, while the
    norms' weights and the rotary tables stay fp32: then the norms and RoPE run apart,
    promoted as transformers promotes them)."""
    if not _is_transformers_class(self, _QK_NORM_ATTENTION):
        return False
    qw, kw = self.q_norm.weight, self.k_norm.weight
    return (
        _norm_eps(self.q_norm) == _norm_eps(self.k_norm)
        and hidden_states.dtype == qw.dtype == kw.dtype == cos.dtype == sin.dtype
        and cos.dim() == 3
        and cos.shape == sin.shape
        and self.head_dim * hidden_states.element_size() <= MAX_FUSED_BYTES
    )


def _mask_kind(impl) -> str:
    """How the attention implementation ``impl`` reads its mask: "sdpa" (boolean, None
    is SDPA's is_causal), "flash" (None is bottom-right causal) or "eager" (additive;
    None is no mask: also transformers' default when ``impl`` is None or unknown)."""
    impl = (impl or "eager").removeprefix("paged|")
    if impl in ("sdpa", ATTN_IMPLEMENTATION):
        return "sdpa"
    return "flash" if impl.startswith("flash_attention") else "eager"


# (module class, reason) already warned about: one warning each, not one per call.
_WARNED: set = set()


def _mask_fallback(module, impl, reason) -> None:
    """The kernels cannot compute this mask: a ``ValueError`` under ``strict``, else a
    warning (once per module class and reason) that transformers' attention runs."""
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', None)})"
    message = (
        f"normbook.hf: the attention_mask of {name} is {reason}; normbook's kernels "
        "compute causal masks (with sliding windows, padding, packed sequences) only"
    )
    if getattr(module, "_normbook_strict", False):
        raise ValueError(
            message + ", and the model was patched with strict=True (without it, "
            "transformers' own attention would run)"
        )
    message += f", so transformers' own attention ({impl!r}) runs for such calls"
    key = (type(module).__name__, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=2)


def _kernel_attention(
    module, q, k, v, attention_mask, *, impl, scaling, window, dropout, softcap, kwargs
):
    """The kernels' attention on (batch, heads, seq, head_dim) q, k, v, as transformers'
    attention ``impl`` would compute it under ``attention_mask``: (batch, seq_q, heads,
    head_dim). None where the kernels cannot compute what the module computes (its own
    attention runs instead): dropout, logit soft-capping, attention weights or a
    position bias asked for, a dtype or head_dim the kernels lack (all silently), and a
    mask they do not compute (a warning, or strict's ``ValueError``). Under autocast,
    q, k and v are cast to autocast's dtype first, as SDPA's (and eager's products')
    inputs are."""
    cast = _autocast_dtype(q)
    if cast is not None:
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    if (
        dropout
        or softcap is not None
        or getattr(module, "attn_logit_softcapping", None) is not None
        or kwargs.get("output_attentions")
        or kwargs.get("position_bias") is not None
        or q.dtype not in ATTENTION_DTYPES
        or not k.dtype == v.dtype == q.dtype
        or q.shape[-1] > MAX_HEAD_DIM
    ):
        return None
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        layout = Unrecognized("bidirectional (the module is not causal)")
    else:
        (batch, _, seq_q, _), seq_k = q.shape, k.shape[2]
        kind = _mask_kind(impl)
        layout = mask_layout(attention_mask, kind, batch, seq_q, seq_k, window)
    if isinstance(layout, Unrecognized):
        _mask_fallback(module, impl, layout.reason)
        return None
    if isinstance(layout, Dense):
        out = attention(q, k, v, causal=layout.alignment, scale=scaling, window=window)
        return out.transpose(1, 2)
    # varlen: gather the rows that are not padding, attend per sequence, scatter back
    batch, heads, seq_q, head_dim = q.shape

    def rows(t, index):  # (batch, heads, seq, d) -> the chosen (heads, d) rows
        return t.transpose(1, 2).reshape(-1, t.shape[1], head_dim)[index]

    out = _varlen_attention(
        rows(q, layout.q_index),
        rows(k, layout.k_index),
        rows(v, layout.k_index),
        layout.cu_seqlens_q,
        layout.cu_seqlens_k,
        layout.max_seqlen_q,
        layout.max_seqlen_k,
        causal=True,
        scale=scaling,
        window=window,
    )
    full = out.new_zeros(batch * seq_q, heads, head_dim)
    return full.index_copy(0, layout.q_index, out).view(batch, seq_q, heads, head_dim)


def _transformers_attention(module, impl):
    """transformers' attention function for ``impl`` (for "normbook": SDPA, whose masks
    it shares)."""
    if impl == ATTN_IMPLEMENTATION:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    tf_module = sys.modules[type(module).__module__]
    functions = tf_module.ALL_ATTENTION_FUNCTIONS
    if hasattr(functions, "get_interface"):  # transformers 5.x
        return functions.get_interface(impl, tf_module.eager_attention_forward)
    # 4.5x
    return tf_module.eager_attention_forward if impl == "eager" else functions[impl]


def _run_attention(
    module,
    q,
    k,
    v,
    attention_mask,
    *,
    scaling,
    sliding_window=None,
    dropout=0.0,
    softcap=None,
    **kwargs,
):
    """Attention of a transformers attention module on (batch, heads, seq, head_dim) q,
    k, v (after RoPE and the cache): the kernels where they compute what transformers
    would, else transformers' attention function for the model's implementation.
    Returns (output (batch, seq_q, heads, head_dim), attention weights or None)."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    out = _kernel_attention(
        module,
        q,
        k,
        v,
        attention_mask,
        impl=impl,
        scaling=scaling,
        window=sliding_window,
        dropout=dropout,
        softcap=softcap,
        kwargs=kwargs,
    )
    if out is not None:
        return out, None
    if softcap is not None:
        kwargs["softcap"] = softcap
    return _transformers_attention(module, impl)(
        module,
        q,
        k,
        v,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        **kwargs,
    )


def _attention_forward(
    self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs
):
    """Qwen3/Llama/Gemma 3 attention: projections; Qwen3's q/k norms and RoPE as one
    :func:`normbook.qk_norm_rope` (else the module's norms, patched, and transformers'
    RoPE); the KV cache; :func:`normbook.attention`; o_proj."""
    cache = _pop_cache(cache, kwargs)
    cos, sin = position_embeddings
    module = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # (batch, seq, heads, head_dim) views of the projections, read in place by the
    # kernel.
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if _qk_fusable(self, query_states, cos, sin):
        if cos.shape[0] not in (1, query_states.shape[0]):
            batch = query_states.shape[0]
            cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        query_states, key_states = qk_norm_rope(
            query_states,
            key_states,
            self.q_norm.weight,
            self.k_norm.weight,
            cos,
            sin,
            _norm_eps(self.q_norm),
        )
        query_states, key_states = (
            query_states.transpose(1, 2),
            key_states.transpose(1, 2),
        )
    else:
        query_states, key_states = (
            query_states.transpose(1, 2),
            key_states.transpose(1, 2),
        )
        # Qwen3 (not fusable here), Gemma 3: per-head RMSNorms
        if hasattr(self, "q_norm"):
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        query_states, key_states = module.apply_rotary_pos_emb(
            query_states, key_states, cos, sin
        )
    if cache is not None:
        key_states, value_states = _cache_update(
            cache, key_states, value_states, self.layer_idx, cos, sin, kwargs
        )
    attn_output, attn_weights = _run_attention(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),
        dropout=self.attention_dropout if self.training else 0.0,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
