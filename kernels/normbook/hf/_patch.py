"""``patch``, ``unpatch``, ``is_patched``: which transformers classes get which forward
(see :mod:`normbook.hf`)."""

from __future__ import annotations

from torch import nn

from ._attention import _attention_forward
from ._common import _is_transformers_class, _patched_fn, _set_forward
from ._forwards import (
    _causal_lm_forward,
    _decoder_layer_forward,
    _gemma_rms_norm_forward,
    _rms_norm_forward,
    _swiglu_mlp_forward,
)

#: ``config.model_type`` values that :func:`patch` accepts.
SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "gemma3_text")

# Class name -> RMSNorm convention ("llama": round x̂, then times γ; "gemma": fp32 (1 +
# γ), one cast).
_NORMS = {"Qwen3RMSNorm": "llama", "LlamaRMSNorm": "llama", "Gemma3RMSNorm": "gemma"}
# Decoder layers whose forward is "x + attn, post_attention_layernorm, mlp, + residual".
_FUSABLE_LAYERS = {"Qwen3DecoderLayer", "LlamaDecoderLayer"}
# Attention modules whose forward is "projections, (q/k norms), RoPE, cache, attention,
# o_proj".
_ATTENTION = {"Qwen3Attention", "LlamaAttention", "Gemma3Attention"}
# MLPs "down_proj(act_fn(gate_proj(x)) * up_proj(x))"; patched when act_fn is SiLU
# (SwiGLU). Gemma 3's MLP has the same form with GELU-tanh (GeGLU): no kernel for it,
# not patched.
_GATED_MLPS = {"Qwen3MLP", "LlamaMLP", "Gemma3MLP"}
_SILU = {"SiLU", "SiLUActivation"}
# Causal LMs whose loss (labels given) runs as normbook.linear_cross_entropy.
_CAUSAL_LMS = {"Qwen3ForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM"}

_PATCHED_FORWARDS = (
    _rms_norm_forward,
    _gemma_rms_norm_forward,
    _decoder_layer_forward,
    _attention_forward,
    _swiglu_mlp_forward,
    _causal_lm_forward,
)  # unpatch removes only these


def _ours(module: nn.Module) -> bool:
    return _patched_fn(module) in _PATCHED_FORWARDS


def _check_model(model) -> str:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a transformers model (an nn.Module), got "
            f"{type(model).__name__}"
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"normbook.hf.patch supports model types {SUPPORTED_MODEL_TYPES} (Qwen3, "
            "Llama, Gemma 3 "
            f"text models); got {type(model).__name__} with model_type={model_type!r}"
        )
    return model_type


def patch(model: nn.Module, *, strict: bool = False) -> nn.Module:
    """Make ``model`` run this package's kernels; returns the same model (patched in
    place).

    Every RMSNorm of the model runs :func:`normbook.rms_norm` with its model's
    convention; Qwen3 and Llama decoder layers run the first residual add with
    ``post_attention_layernorm`` as :func:`normbook.fused_add_rms_norm`;
    ``Qwen3Attention`` runs ``q_norm``, ``k_norm`` and RoPE as
    :func:`normbook.qk_norm_rope`; attention runs :func:`normbook.attention`, the SwiGLU
    gate :func:`normbook.swiglu` and, with ``labels``, the loss
    :func:`normbook.linear_cross_entropy` (see the module's docstring for what is not
    patched). Parameters, buffers and the state dict are untouched; patching twice is
    the same as once; :func:`unpatch` restores the model.

    Attention masks the kernels do not compute (see :mod:`normbook.hf`) run on
    transformers' attention with a warning; with ``strict=True`` they raise a
    ``ValueError`` instead, at the forward that meets them.

    Raises:
        TypeError: ``model`` is not a supported transformers model (see
            :data:`SUPPORTED_MODEL_TYPES`).
    """
    _check_model(model)
    found = 0
    for module in model.modules():
        if _is_transformers_class(module, _NORMS):
            gemma = _NORMS[type(module).__name__] == "gemma"
            _set_forward(
                module, _gemma_rms_norm_forward if gemma else _rms_norm_forward
            )
            found += 1
        elif _is_transformers_class(module, _FUSABLE_LAYERS):
            _set_forward(module, _decoder_layer_forward)
        elif _is_transformers_class(module, _ATTENTION):
            _set_forward(module, _attention_forward)
        elif (
            _is_transformers_class(module, _GATED_MLPS)
            and type(getattr(module, "act_fn", None)).__name__ in _SILU
        ):
            _set_forward(module, _swiglu_mlp_forward)
        elif _is_transformers_class(module, _CAUSAL_LMS):
            _set_forward(module, _causal_lm_forward)
    for module in model.modules():
        if _ours(module):  # read by the attention (a plain attribute: no state)
            module._normbook_strict = bool(strict)
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no RMSNorm module that normbook.hf "
            "knows "
            f"({sorted(_NORMS)}): nothing to patch"
        )
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every module runs its class's own forward again. Returns the
    model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if _ours(module):
            del module.forward
            module.__dict__.pop("_normbook_strict", None)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any module of ``model`` runs a forward installed by :func:`patch`."""
    return any(_ours(m) for m in model.modules())
