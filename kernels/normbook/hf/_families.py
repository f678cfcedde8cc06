"""The forwards of :mod:`normbook.hf` for the families whose modules differ from the
Qwen3/Llama forms of :mod:`._forwards` and :mod:`._attention`:

- OLMo2's RMSNorm: ``(γ · x̂)`` in fp32, one rounding (Gemma's casting, no offset);
- attention with the window in the config (Mistral, Mixtral, Phi3), one fused
  ``qkv_proj`` (Phi3), a QK-Norm over the whole projection (OLMo2) or logit
  soft-capping (Gemma 2): transformers' projections, norms and RoPE, then the
  attention step every patched attention shares (``_run_attention``);
- Phi3's decoder layer (residual dropout) and its ``gate_up_proj`` MLP;
- the gate ``act_fn(gate) * up`` of a mixture of experts' fused expert weights
  (Qwen3-MoE, Mixtral) → :func:`normbook.swiglu`, inside transformers' own routing.
"""

from __future__ import annotations

import inspect
import sys

import torch

from ..attention import DTYPES as ATTENTION_DTYPES
from ..attention import MAX_HEAD_DIM, attention
from ..rms_norm import rms_norm
from ..swiglu import swiglu
from ._attention import _mask_kind, _run_attention
from ._common import _cache_update, _is_transformers_class, _norm_eps, _pop_cache
from ._forwards import _decoder_layer_forward
from ._masks import Dense, mask_layout

# Attention modules that read their sliding window from ``config.sliding_window`` (no
# ``sliding_window`` attribute; the mask has the window whenever the config sets it).
_CONFIG_WINDOW = {"MistralAttention", "MixtralAttention", "Phi3Attention"}
# QK-Norm over the whole projection (num_heads · head_dim), before the heads are split.
_WHOLE_PROJECTION_QK_NORM = {"Olmo2Attention"}


def _olmo_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Olmo2RMSNorm``: ``(γ · x̂)`` in fp32, rounded once to the input dtype (the
    Gemma casting with offset 0; Llama would round x̂ before the product). transformers
    promotes the product to fp32 whatever the weight's dtype, and so does the kernel."""
    return rms_norm(hidden_states, self.weight, _norm_eps(self), casting_mode="gemma")


# normbook.attention soft-caps the scores once it has this keyword (read at import:
# the kernel is looked up by name at each call, which a test may wrap to count calls)
_ATTENTION_TAKES_SOFTCAP = "softcap" in inspect.signature(attention).parameters


def _softcapped_kernel_attention(
    self, q, k, v, attention_mask, *, window, softcap, dropout, kwargs
):
    """Gemma 2's soft-capped scores, ``softcap · tanh(s / softcap)``, on
    :func:`normbook.attention` where it takes ``softcap`` and the mask is the plain
    causal (sliding-window) pattern; else None: ``_run_attention`` then runs
    transformers' attention, soft-capped (or, once it passes ``softcap`` on, the
    kernels for padded and packed masks too). The conditions are
    ``_kernel_attention``'s."""
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        # autocast runs eager's products on its dtype: so does the kernel
        cast = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    is_causal = kwargs.get("is_causal")
    if (
        not _ATTENTION_TAKES_SOFTCAP
        or dropout
        or not (getattr(self, "is_causal", True) if is_causal is None else is_causal)
        or kwargs.get("output_attentions")
        or kwargs.get("position_bias") is not None
        or q.dtype not in ATTENTION_DTYPES
        or not k.dtype == v.dtype == q.dtype
        or q.shape[-1] > MAX_HEAD_DIM
    ):
        return None
    (batch, _, seq_q, _), seq_k = q.shape, k.shape[2]
    kind = _mask_kind(self.config._attn_implementation)
    layout = mask_layout(attention_mask, kind, batch, seq_q, seq_k, window)
    if not isinstance(layout, Dense):
        return None
    out = attention(
        q,
        k,
        v,
        causal=layout.alignment,
        scale=self.scaling,
        window=window,
        softcap=softcap,
    )
    return out.transpose(1, 2)


def _family_attention_forward(
    self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs
):
    """Mistral/Mixtral/Phi3/OLMo2/Gemma 2 attention: the family's projections (Phi3:
    one ``qkv_proj`` split as Phi3Attention splits it; OLMo2: ``q_norm``/``k_norm``,
    patched, over the whole projection), transformers' RoPE (Phi3's partial rotary
    too), the KV cache, then ``_run_attention`` with the family's window and
    soft-cap: the kernels, or transformers' attention where they cannot serve."""
    cache = _pop_cache(cache, kwargs)
    cos, sin = position_embeddings
    module = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if hasattr(self, "qkv_proj"):
        qkv = self.qkv_proj(hidden_states)
        q_end = self.config.num_attention_heads * self.head_dim
        k_end = q_end + self.num_key_value_heads * self.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    else:
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
    if _is_transformers_class(self, _WHOLE_PROJECTION_QK_NORM):
        # rows of num_heads · head_dim: one statistic for all the heads of a token
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
    q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = _cache_update(cache, k, v, self.layer_idx, cos, sin, kwargs)
    if _is_transformers_class(self, _CONFIG_WINDOW):
        window = getattr(self.config, "sliding_window", None)
    else:
        window = getattr(self, "sliding_window", None)
    softcap = getattr(self, "attn_logit_softcapping", None)
    dropout = self.attention_dropout if self.training else 0.0
    out, weights = None, None
    if softcap is not None:
        out = _softcapped_kernel_attention(
            self,
            q,
            k,
            v,
            attention_mask,
            window=window,
            softcap=softcap,
            dropout=dropout,
            kwargs=kwargs,
        )
    if out is None:
        out, weights = _run_attention(
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,
            sliding_window=window,
            dropout=dropout,
            softcap=softcap,
            **kwargs,
        )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _phi3_decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """Phi3's layer is Llama's with a dropout on each branch before its residual add:
    fused as Llama's where those dropouts are the identity (eval, or p = 0)."""
    dropouts = (self.resid_attn_dropout, self.resid_mlp_dropout)
    if self.training and any(d.p > 0 for d in dropouts):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return _decoder_layer_forward(self, hidden_states, *args, **kwargs)


def _phi3_mlp_forward(self, hidden_states):
    """``down_proj(up · act(gate))`` with ``gate, up = gate_up_proj(x).chunk(2)``: the
    gate as :func:`normbook.swiglu` (``silu(gate) · up``, the same product)."""
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(swiglu(gate, up))


def _experts_apply_gate(self, gate_up_out):
    """transformers' ``_default_apply_gate`` for fused expert weights: ``act(gate) ·
    up`` of the ``[gate; up]`` halves, as :func:`normbook.swiglu`. transformers'
    grouped and batched expert forwards call it on the routed tokens; their routing,
    the projections and the weighted sum over the top-k stay theirs."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return swiglu(gate, up)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' forward for ``experts_implementation="eager"``: transformers' loop
    over the hit experts (same order, same ``index_add_`` accumulation) with each
    expert's gate as :func:`normbook.swiglu`; any other implementation is
    transformers' own, calling :func:`_experts_apply_gate`."""
    if self.config._experts_implementation not in (None, "eager"):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(
            top_k_index, num_classes=self.num_experts + 1
        )
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current = hidden_states[token_idx]
        gate_up = torch.nn.functional.linear(current, self.gate_up_proj[expert_idx])
        current = self._apply_gate(gate_up)
        current = torch.nn.functional.linear(current, self.down_proj[expert_idx])
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(
            0, token_idx, current.to(final_hidden_states.dtype)
        )
    return final_hidden_states
