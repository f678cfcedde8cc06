r"""Run a Hugging Face ``transformers`` model on this package's kernels, in place.

``patch(model)`` swaps the *forward methods* of the model's own submodules (never its modules,
parameters or buffers, so weights and ``state_dict()`` are untouched) and ``unpatch(model)``
restores them:

=========================================  ==================================================
Hugging Face                                kernel
=========================================  ==================================================
``Qwen3RMSNorm``, ``LlamaRMSNorm``          :func:`kernels.rms_norm` (Llama convention: fp32
                                            statistics, round to the input dtype, times γ)
``Gemma3RMSNorm``                           :func:`kernels.rms_norm` with the Gemma convention
                                            (everything in fp32 with ``1 + γ``, one rounding)
decoder layer: ``h = x + attn``,            :func:`kernels.fused_add_rms_norm` (Qwen3, Llama)
``post_attention_layernorm(h)``
``Qwen3Attention``: ``q_norm``, ``k_norm``  :func:`kernels.qk_norm_rope`
and ``apply_rotary_pos_emb``
=========================================  ==================================================

Supported: Qwen3 (``Qwen3ForCausalLM``, ``Qwen3Model``), Llama (``LlamaForCausalLM``,
``LlamaModel``) and Gemma 3 text models (``Gemma3ForCausalLM``, ``Gemma3TextModel``), as written in
transformers 5.x (the pinned 5.24.0 is tested) and 4.5x (4.57.1 checked by hand: logits,
gradients, generation); anything else raises a ``TypeError``.

Where a kernel cannot compute exactly what the module computes, the patched forward runs the
module's own code for that call instead of a wrong or gradient-less answer:

* a norm whose weight dtype differs from the input's (transformers would promote the product
  to the wider dtype; the kernels return the input's dtype);
* a fused kernel that has no backward yet, while gradients are needed (it is probed once, on a
  tiny input: as soon as the kernel gains an ``autograd.Function`` the fused path is used in
  training too);
* q and k norms with different ``eps``, or rotary tables in another dtype than q.

Not fused: the residual add *after* the MLP with the next layer's ``input_layernorm``. That add
ends a decoder layer, whose output transformers records (``output_hidden_states``, hooks,
gradient checkpointing); fusing across the boundary would mean rewriting the model's layer loop.
Gemma 3's sandwich norms (norm *then* add) are patched as norms, not fused.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types

import torch
from torch import nn

from . import _runtime  # noqa: F401  (the interpreter is set up before anything below imports triton)
from .fused_add_rms_norm import fused_add_rms_norm
from .qk_norm_rope import MAX_FUSED_BYTES, qk_norm_rope
from .rms_norm import rms_norm

__all__ = ["patch", "unpatch", "is_patched", "SUPPORTED_MODEL_TYPES"]

#: ``config.model_type`` values that :func:`patch` accepts.
SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "gemma3_text")

# Class name -> RMSNorm convention ("llama": round x̂, then times γ; "gemma": fp32 (1 + γ), one cast).
_NORMS = {"Qwen3RMSNorm": "llama", "LlamaRMSNorm": "llama", "Gemma3RMSNorm": "gemma"}
# Decoder layers whose forward is "x + attn, post_attention_layernorm, mlp, + residual".
_FUSABLE_LAYERS = {"Qwen3DecoderLayer", "LlamaDecoderLayer"}
# Attention modules with per-head q_norm/k_norm (Qwen3 convention) followed by RoPE.
_QK_NORM_ATTENTION = {"Qwen3Attention"}


def _is_transformers_class(module: nn.Module, names) -> bool:
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith("transformers.models.")


# ---------------------------------------------------------------- what the kernels can do today


@functools.cache
def _differentiable(name: str) -> bool:
    """Probe once, on a tiny input, whether a fused kernel keeps gradients (has a backward)."""
    fn = getattr(importlib.import_module(f"kernels.{name}"), name)  # the kernel module's own
    with torch.enable_grad():
        if name == "fused_add_rms_norm":
            x = torch.randn(2, 4, device=_runtime.DEVICE, requires_grad=True)
            y, _ = fn(x, torch.randn(2, 4, device=_runtime.DEVICE), None)
        else:
            q = torch.randn(1, 1, 1, 4, device=_runtime.DEVICE, requires_grad=True)
            c = torch.ones(1, 1, 4, device=_runtime.DEVICE)
            y, _ = fn(q, q.detach(), None, None, c, 0 * c)
    return y.grad_fn is not None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------- the patched forwards


def _norm_eps(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm`` / ``Qwen3RMSNorm`` on :func:`kernels.rms_norm`."""
    if hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states)  # transformers promotes; the kernel cannot
    return rms_norm(hidden_states, self.weight, _norm_eps(self))


def _gemma_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Gemma3RMSNorm``: ``(x̂ · (1 + γ))`` in fp32, rounded once to the input dtype."""
    if hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, _norm_eps(self), offset=1.0, casting_mode="gemma")


def _pop_cache(cache, kwargs):
    # transformers 5.x calls the KV cache ``cache`` (renaming ``past_key_values`` in a decorator
    # around the original forward); 4.5x calls it ``past_key_values`` (or ``past_key_value``).
    for old_name in ("past_key_values", "past_key_value"):
        if old_name in kwargs:
            cache = kwargs.pop(old_name)
    return cache


@functools.cache
def _cache_name(fn) -> str:
    """The name under which ``fn`` (a transformers forward) takes the KV cache."""
    params = inspect.signature(fn).parameters
    return next((n for n in ("cache", "past_key_values", "past_key_value") if n in params), "cache")


def _cache_update(cache, key_states, value_states, layer_idx, cos, sin, kwargs):
    if "kwargs" in inspect.signature(cache.update).parameters:  # transformers 5.x
        return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    # transformers 4.5x: the cache kwargs are a dict argument.
    cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
    return cache.update(key_states, value_states, layer_idx, cache_kwargs)


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """Qwen3/Llama decoder layer with ``residual + attn`` and ``post_attention_layernorm`` fused."""
    cache = _pop_cache(cache, kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    attn = self.self_attn
    # Our own attention forward, or the class's (Llama), under the cache's name for this version.
    attn_forward = type(attn).forward if "forward" not in attn.__dict__ else _qwen3_attention_forward
    hidden_states, _ = attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        use_cache=use_cache, position_embeddings=position_embeddings,
        **{_cache_name(attn_forward): cache}, **kwargs,
    )
    norm = self.post_attention_layernorm
    fusable = (
        hidden_states.dtype == residual.dtype == norm.weight.dtype
        and hidden_states.shape == residual.shape
        and (_differentiable("fused_add_rms_norm")
             or not _needs_grad(hidden_states, residual, norm.weight))
    )
    if fusable:
        # One pass: residual stream h = residual + attn (rounded as transformers rounds it) and
        # its norm; attn + residual is the same IEEE sum as residual + attn.
        hidden_states, residual = fused_add_rms_norm(hidden_states, residual, norm.weight,
                                                     _norm_eps(norm))
    else:
        residual = residual + hidden_states
        hidden_states = norm(residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _qwen3_attention_forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                             **kwargs):
    """``Qwen3Attention`` with ``q_norm``/``k_norm`` and RoPE in one :func:`kernels.qk_norm_rope`."""
    cache = _pop_cache(cache, kwargs)
    cos, sin = position_embeddings
    qw, kw = self.q_norm.weight, self.k_norm.weight
    fusable = (
        _norm_eps(self.q_norm) == _norm_eps(self.k_norm)
        and hidden_states.dtype == qw.dtype == kw.dtype == cos.dtype == sin.dtype
        and cos.dim() == 3 and cos.shape == sin.shape
        and self.head_dim * hidden_states.element_size() <= MAX_FUSED_BYTES
        and (_differentiable("qk_norm_rope") or not _needs_grad(hidden_states, qw, kw))
    )
    if not fusable:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  **{_cache_name(type(self).forward): cache}, **kwargs)
    module = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # (batch, seq, heads, head_dim) views of the projections, read in place by the kernel.
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if cos.shape[0] not in (1, query_states.shape[0]):
        cos, sin = cos.expand(query_states.shape[0], -1, -1), sin.expand(query_states.shape[0], -1, -1)
    query_states, key_states = qk_norm_rope(query_states, key_states, qw, kw, cos, sin,
                                            _norm_eps(self.q_norm))
    query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
    if cache is not None:
        key_states, value_states = _cache_update(cache, key_states, value_states, self.layer_idx,
                                                 cos, sin, kwargs)
    functions, impl = module.ALL_ATTENTION_FUNCTIONS, self.config._attn_implementation
    if hasattr(functions, "get_interface"):  # transformers 5.x
        attention_interface = functions.get_interface(impl, module.eager_attention_forward)
    else:  # 4.5x
        attention_interface = module.eager_attention_forward if impl == "eager" else functions[impl]
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


# ---------------------------------------------------------------- patch / unpatch

_PATCHED_FORWARDS = (_rms_norm_forward, _gemma_rms_norm_forward, _decoder_layer_forward,
                     _qwen3_attention_forward)  # unpatch removes only these


def _set_forward(module: nn.Module, fn) -> None:
    # A bound method stored as an instance attribute: not a parameter, buffer or submodule, so the
    # state dict is unchanged; and copy.deepcopy rebinds a bound method to the *copied* module (a
    # closure over ``module`` would keep running the original's weights).
    module.forward = types.MethodType(fn, module)


def _ours(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ in _PATCHED_FORWARDS


def _check_model(model) -> str:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers model (an nn.Module), got {type(model).__name__}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"kernels.hf.patch supports model types {SUPPORTED_MODEL_TYPES} (Qwen3, Llama, Gemma 3 "
            f"text models); got {type(model).__name__} with model_type={model_type!r}"
        )
    return model_type


def patch(model: nn.Module) -> nn.Module:
    """Make ``model`` run this package's kernels; returns the same model (patched in place).

    Every RMSNorm of the model runs :func:`kernels.rms_norm` with its model's convention; Qwen3 and
    Llama decoder layers run the first residual add with ``post_attention_layernorm`` as
    :func:`kernels.fused_add_rms_norm`; ``Qwen3Attention`` runs ``q_norm``, ``k_norm`` and RoPE as
    :func:`kernels.qk_norm_rope`. Parameters, buffers and the state dict are untouched; patching
    twice is the same as once; :func:`unpatch` restores the model.

    Raises:
        TypeError: ``model`` is not a supported transformers model (see
            :data:`SUPPORTED_MODEL_TYPES`).
    """
    _check_model(model)
    found = 0
    for module in model.modules():
        if _is_transformers_class(module, _NORMS):
            gemma = _NORMS[type(module).__name__] == "gemma"
            _set_forward(module, _gemma_rms_norm_forward if gemma else _rms_norm_forward)
            found += 1
        elif _is_transformers_class(module, _FUSABLE_LAYERS):
            _set_forward(module, _decoder_layer_forward)
        elif _is_transformers_class(module, _QK_NORM_ATTENTION):
            _set_forward(module, _qwen3_attention_forward)
    if not found:
        raise TypeError(f"{type(model).__name__} has no RMSNorm module that kernels.hf knows "
                        f"({sorted(_NORMS)}): nothing to patch")
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every module runs its class's own forward again. Returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if _ours(module):
            del module.forward
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any module of ``model`` runs a forward installed by :func:`patch`."""
    return any(_ours(m) for m in model.modules())
