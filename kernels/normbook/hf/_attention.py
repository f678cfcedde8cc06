"""The patched attention of :mod:`normbook.hf`: projections, Qwen3's q/k norms and
RoPE as one :func:`normbook.qk_norm_rope`, the KV cache, :func:`normbook.attention`,
o_proj; transformers' mask recognized or the module's own attention run."""

from __future__ import annotations

import sys
import weakref

import torch

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

# Attention modules with per-head q_norm/k_norm (Qwen3 convention) followed by RoPE.
_QK_NORM_ATTENTION = {"Qwen3Attention"}


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


# mask -> ((version, seq_q, seq_k, window), is it the causal pattern?): each layer of
# one forward receives the same mask tensor, so it is compared with the pattern once.
_MASK_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _purely_causal(mask, seq_q: int, seq_k: int, window) -> bool:
    """Whether transformers' ``attention_mask`` is exactly the bottom-right causal
    pattern (with the sliding window, if any) that normbook.attention computes from
    indices. None is what transformers passes when SDPA's own is_causal suffices (seq_q
    == seq_k, or one query: both alignments agree there). A padded batch, a static
    cache's unused slots, a packed or bidirectional mask are not this pattern."""
    if mask is None:
        return True
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dim() != 4
        or tuple(mask.shape[-2:]) != (seq_q, seq_k)
    ):
        return False
    key = (mask._version, seq_q, seq_k, window)
    hit = _MASK_CHECKED.get(mask)
    if hit is not None and hit[0] == key:
        return hit[1]
    # float masks: 0 keep, min: drop
    keep = mask if mask.dtype == torch.bool else mask == 0
    i = torch.arange(seq_q, device=mask.device)[:, None] + (seq_k - seq_q)
    j = torch.arange(seq_k, device=mask.device)[None, :]
    want = j <= i
    if window is not None:
        want &= j > i - window
    ok = bool((keep == want).all())
    _MASK_CHECKED[mask] = (key, ok)
    return ok


def _kernel_attention(self, q, k, v, attention_mask, kwargs):
    """normbook.attention on (batch, heads, seq, head_dim) q, k, v, as transformers'
    eager or SDPA attention would compute it: (batch, seq_q, heads, head_dim). None
    where the kernel cannot compute what the module computes (the module's own attention
    runs instead): dropout in training, logit soft-capping, bidirectional attention,
    attention weights asked for, a dtype or head_dim the kernel lacks, a gradient the
    kernel cannot give yet."""
    cast = _autocast_dtype(q)
    if cast is not None:
        # autocast runs SDPA (and eager's products) on its dtype: so does the kernel
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    if (
        self.training
        and self.attention_dropout > 0
        or getattr(self, "attn_logit_softcapping", None) is not None
        or not getattr(self, "is_causal", True)
        or kwargs.get("output_attentions")
        or q.dtype not in ATTENTION_DTYPES
        or not k.dtype == v.dtype == q.dtype
        or q.shape[-1] > MAX_HEAD_DIM
    ):
        return None
    window = getattr(self, "sliding_window", None)
    if not _purely_causal(attention_mask, q.shape[2], k.shape[2], window):
        raise ValueError(
            f"normbook.hf: attention_mask of {type(self).__name__} (layer "
            f"{self.layer_idx}) is "
            "not the plain causal mask (a padded batch, a static cache or a packed "
            "sequence): "
            "normbook.attention takes no mask tensor, and ignoring it would be wrong. "
            "Pass "
            "unpadded sequences of one length, or run this model unpatched "
            "(normbook.hf.unpatch(model))"
        )
    out = attention(q, k, v, causal=True, scale=self.scaling, window=window)
    return out.transpose(1, 2)


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
    attn_output = _kernel_attention(
        self, query_states, key_states, value_states, attention_mask, kwargs
    )
    attn_weights = None
    if attn_output is None:
        functions = module.ALL_ATTENTION_FUNCTIONS
        impl = self.config._attn_implementation
        if hasattr(functions, "get_interface"):  # transformers 5.x
            interface = functions.get_interface(impl, module.eager_attention_forward)
        else:  # 4.5x
            interface = (
                module.eager_attention_forward if impl == "eager" else functions[impl]
            )
        attn_output, attn_weights = interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=getattr(self, "sliding_window", None),
            **kwargs,
        )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
