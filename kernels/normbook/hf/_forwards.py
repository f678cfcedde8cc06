"""The patched forwards of :mod:`normbook.hf` other than attention's: the RMSNorms, the
decoder layer's fused residual add and norm, the SwiGLU MLP, the causal LM's fused
loss, and (``patch(model, linear=True)``) the projections."""

from __future__ import annotations

import sys

import torch

from .._runtime import DEVICE
from ..fused_add_rms_norm import fused_add_rms_norm
from ..linear import DTYPES as LINEAR_DTYPES
from ..linear import linear
from ..linear_cross_entropy import _linear_cross_entropy
from ..rms_norm import rms_norm
from ..swiglu import swiglu
from ._attention import _attention_forward
from ._common import (
    _autocast_dtype,
    _cache_name,
    _checkpointed,
    _norm_eps,
    _pop_cache,
)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm`` / ``Qwen3RMSNorm`` on :func:`normbook.rms_norm`.

    With the weight in another dtype than the input (autocast's bf16 activations with
    fp32 weights; a bf16 model fed fp32), transformers computes ``weight *
    x̂.to(input dtype)``, promoted to the wider dtype: the kernel normalizes (x̂ rounded
    to the input's dtype, no weight) and that same product runs on PyTorch."""
    if hidden_states.dtype != self.weight.dtype:
        return self.weight * rms_norm(hidden_states, None, _norm_eps(self))
    return rms_norm(hidden_states, self.weight, _norm_eps(self))


def _gemma_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Gemma3RMSNorm``: ``(x̂ · (1 + γ))`` in fp32, rounded once to the input
    dtype. (transformers upcasts the weight to fp32 too, so the kernel computes the
    same whatever the weight's dtype.)"""
    return rms_norm(
        hidden_states, self.weight, _norm_eps(self), offset=1.0, casting_mode="gemma"
    )


@_checkpointed
def _decoder_layer_forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    cache=None,
    use_cache=False,
    position_embeddings=None,
    **kwargs,
):
    """Qwen3/Llama decoder layer with ``residual + attn`` and
    ``post_attention_layernorm`` fused."""
    cache = _pop_cache(cache, kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    attn = self.self_attn
    # Our own attention forward, or the class's, under the cache's name for this
    # version.
    attn_forward = (
        type(attn).forward if "forward" not in attn.__dict__ else _attention_forward
    )
    hidden_states, _ = attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **{_cache_name(attn_forward): cache},
        **kwargs,
    )
    norm = self.post_attention_layernorm
    if hidden_states.dtype != residual.dtype == norm.weight.dtype:
        # autocast: o_proj's output in bf16 on an fp32 residual stream. PyTorch's
        # promotion adds in fp32 with the bf16 operand converted exactly: so do we.
        hidden_states = hidden_states.to(residual.dtype)
    fusable = (
        hidden_states.dtype == residual.dtype == norm.weight.dtype
        and hidden_states.shape == residual.shape
    )
    if fusable:
        # One pass: residual stream h = residual + attn (rounded as transformers rounds
        # it) and its norm; attn + residual is the same IEEE sum as residual + attn.
        hidden_states, residual = fused_add_rms_norm(
            hidden_states, residual, norm.weight, _norm_eps(norm)
        )
    else:
        residual = residual + hidden_states
        hidden_states = norm(residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _swiglu_mlp_forward(self, x):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gate as
    :func:`normbook.swiglu`."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype or gate.shape != up.shape:
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(swiglu(gate, up))


def _linear_forward(self, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` on :func:`normbook.linear`: a row's output does not depend on the
    other rows of its batch (the GEMM's tiles never follow the number of rows), so a
    request's logits are the same alone and batched. Under autocast the input, weight
    and bias are cast to autocast's dtype first, as ``F.linear``'s are. Where the kernel
    cannot compute what the module computes (a dtype it lacks, input and weight in two
    dtypes, which ``nn.Linear`` refuses, another device) the module's own forward runs.
    """
    weight, bias = self.weight, self.bias
    cast = _autocast_dtype(input)
    if cast is not None:
        input, weight = input.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    if (
        input.dtype == weight.dtype in LINEAR_DTYPES
        and (bias is None or bias.dtype == weight.dtype)
        and input.device == weight.device
        and input.device.type == DEVICE.type
        and input.dim() >= 1
    ):
        return linear(input, weight, bias)
    return type(self).forward(self, input)


def _causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """With ``labels``: the decoder, then the shifted causal-LM loss of ``lm_head`` as
    :func:`normbook.linear_cross_entropy` (transformers' ``ForCausalLMLoss``: labels
    shifted by one, ``ignore_index``, ``num_items_in_batch``), and **no logits**
    (``logits=None``): they never exist — in training only (``model.train()``). In eval
    mode (a Trainer's evaluation, whose metrics need the logits), without labels
    (inference, ``generate``) or with options the fused loss lacks: the class's own
    forward (its norms, attention and MLP still patched).

    Under autocast, ``lm_head``'s inputs are cast to autocast's dtype as ``nn.Linear``'s
    would be, so the logits are rounded to it before the fp32 loss, as transformers
    rounds them."""
    cache = _pop_cache(cache, kwargs)
    head = self.lm_head
    fused = (
        labels is not None
        and self.training
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and getattr(head, "bias", None) is None
        and getattr(self.config, "final_logit_softcapping", None) is None
        and kwargs.get("return_dict", True) is not False
    )
    cache_kw = {_cache_name(type(self).forward): cache}
    if not fused:
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **cache_kw,
            **kwargs,
        )
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **{_cache_name(type(self.model).forward): cache},
        **kwargs,
    )
    hidden = outputs.last_hidden_state
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:  # tokens < n predict n; the last position predicts nothing
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[
            ..., 1:
        ]
    num_items = kwargs.get("num_items_in_batch")
    weight = head.weight
    h2d = hidden.reshape(-1, hidden.shape[-1])
    cast = _autocast_dtype(h2d)
    if cast is not None:  # what autocast does to nn.Linear's inputs
        h2d, weight = h2d.to(cast), weight.to(cast)
    elif h2d.dtype != weight.dtype:
        # what nn.Linear would refuse; transformers keeps one dtype
        h2d = h2d.to(weight.dtype)
    target = shift_labels.reshape(-1).to(h2d.device)
    # transformers upcasts the logits to fp32 before its loss: the loss is rounded to
    # fp32.
    loss = _linear_cross_entropy(
        h2d,
        weight,
        target,
        ignore_index,
        "mean" if num_items is None else "sum",
        torch.float32,
    )
    if num_items is not None:
        loss = loss / (
            num_items.to(loss.device) if torch.is_tensor(num_items) else num_items
        )
    out_cls = sys.modules[type(self).__module__].CausalLMOutputWithPast
    fields = out_cls.__dataclass_fields__
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return out_cls(
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **{cache_field: getattr(outputs, cache_field, None)},
    )
