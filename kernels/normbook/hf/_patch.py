"""``patch``, ``unpatch``, ``is_patched``: which transformers classes get which forward
(see :mod:`normbook.hf`)."""

from __future__ import annotations

from torch import nn

from ._attention import _attention_forward
from ._common import _is_transformers_class, _patched_fn, _set_forward
from ._families import (
    _experts_apply_gate,
    _experts_forward,
    _family_attention_forward,
    _olmo_rms_norm_forward,
    _phi3_decoder_layer_forward,
    _phi3_mlp_forward,
)
from ._forwards import (
    _causal_lm_forward,
    _decoder_layer_forward,
    _gemma_rms_norm_forward,
    _linear_forward,
    _rms_norm_forward,
    _swiglu_mlp_forward,
)

#: ``config.model_type`` values that :func:`patch` accepts.
SUPPORTED_MODEL_TYPES = (
    "qwen3",
    "llama",
    "gemma3_text",
    "qwen2",
    "mistral",
    "phi3",
    "qwen3_moe",
    "olmo2",
    "gemma2",
    "mixtral",
)

# Class name -> RMSNorm convention ("llama": round x̂, then times γ; "gemma": fp32 (1 +
# γ), one cast; "olmo": fp32 γ, one cast).
_NORMS = {
    **dict.fromkeys(
        (
            "Qwen3RMSNorm",
            "LlamaRMSNorm",
            "Qwen2RMSNorm",
            "MistralRMSNorm",
            "Phi3RMSNorm",
            "Qwen3MoeRMSNorm",
            "MixtralRMSNorm",
        ),
        "llama",
    ),
    "Gemma3RMSNorm": "gemma",
    "Gemma2RMSNorm": "gemma",
    "Olmo2RMSNorm": "olmo",
}
_NORM_FORWARDS = {
    "llama": _rms_norm_forward,
    "gemma": _gemma_rms_norm_forward,
    "olmo": _olmo_rms_norm_forward,
}
# Decoder layers whose forward is "x + attn, post_attention_layernorm, mlp, + residual".
# (OLMo2 and Gemma 2 normalize each branch *before* its add: nothing to fuse.)
_FUSABLE_LAYERS = {
    "Qwen3DecoderLayer",
    "LlamaDecoderLayer",
    "Qwen2DecoderLayer",
    "MistralDecoderLayer",
    "Qwen3MoeDecoderLayer",
    "MixtralDecoderLayer",
}
# Attention modules whose forward is "projections, (q/k norms), RoPE, cache, attention,
# o_proj" with the window (if any) in ``sliding_window``.
_ATTENTION = {
    "Qwen3Attention",
    "LlamaAttention",
    "Gemma3Attention",
    "Qwen2Attention",
    "Qwen3MoeAttention",
}
# Attention of that form but for the window in the config (Mistral, Mixtral, Phi3), a
# fused qkv_proj (Phi3), a QK-Norm over the whole projection (OLMo2) or soft-capped
# logits (Gemma 2).
_FAMILY_ATTENTION = {
    "MistralAttention",
    "MixtralAttention",
    "Phi3Attention",
    "Olmo2Attention",
    "Gemma2Attention",
}
# MLPs "down_proj(act_fn(gate_proj(x)) * up_proj(x))"; patched when act_fn is SiLU
# (SwiGLU). Gemma's MLPs have the same form with GELU-tanh (GeGLU): no kernel for it,
# not patched.
_GATED_MLPS = {
    "Qwen3MLP",
    "LlamaMLP",
    "Gemma3MLP",
    "Qwen2MLP",
    "MistralMLP",
    "Olmo2MLP",
    "Qwen3MoeMLP",
    "Gemma2MLP",
}
_SILU = {"SiLU", "SiLUActivation"}
# Experts with 3-D [gate; up] weights, transformers' default gate and a SiLU act_fn.
_EXPERTS = {"Qwen3MoeExperts", "MixtralExperts"}
# Causal LMs whose loss (labels given) runs as normbook.linear_cross_entropy. (The MoE
# LMs return MoeCausalLMOutputWithPast with the router's aux loss: left to
# transformers.)
_CAUSAL_LMS = {
    "Qwen3ForCausalLM",
    "LlamaForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "Gemma2ForCausalLM",
}

_PATCHED_FORWARDS = (
    _rms_norm_forward,
    _gemma_rms_norm_forward,
    _olmo_rms_norm_forward,
    _decoder_layer_forward,
    _phi3_decoder_layer_forward,
    _attention_forward,
    _family_attention_forward,
    _swiglu_mlp_forward,
    _phi3_mlp_forward,
    _experts_forward,
    _causal_lm_forward,
    _linear_forward,
)  # unpatch removes only these


def _ours(module: nn.Module) -> bool:
    return _patched_fn(module) in _PATCHED_FORWARDS


def _silu(module: nn.Module, name: str = "act_fn") -> bool:
    return type(getattr(module, name, None)).__name__ in _SILU


def _default_gate(experts: nn.Module) -> bool:
    """Experts gated as transformers' ``_default_apply_gate``: ``[gate; up]`` halves,
    ``act_fn(gate) * up``."""
    gate = getattr(type(experts), "_apply_gate", None)
    return (
        getattr(gate, "__name__", None) == "_default_apply_gate"
        and getattr(experts, "has_gate", False)
        and getattr(experts, "is_concatenated", False)
        and not getattr(experts, "has_post_expert_norm", False)
        and _silu(experts)
    )


def _check_model(model) -> str:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a transformers model (an nn.Module), got "
            f"{type(model).__name__}"
        )
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"normbook.hf.patch supports model types {SUPPORTED_MODEL_TYPES} (text "
            f"models); got {type(model).__name__} with model_type={model_type!r}"
        )
    return model_type


def patch(model: nn.Module, *, strict: bool = False, linear: bool = False) -> nn.Module:
    """Make ``model`` run this package's kernels; returns the same model (patched in
    place).

    Every RMSNorm of the model runs :func:`normbook.rms_norm` with its model's
    convention; decoder layers of Llama's form (Qwen3, Llama, Qwen2, Mistral, Phi3,
    Qwen3-MoE, Mixtral) run the first residual add with ``post_attention_layernorm`` as
    :func:`normbook.fused_add_rms_norm`; Qwen3's and Qwen3-MoE's attention run
    ``q_norm``, ``k_norm`` and RoPE as :func:`normbook.qk_norm_rope`; attention runs
    :func:`normbook.attention`, the SwiGLU gate (of an MLP, or of each routed expert)
    :func:`normbook.swiglu` and, with ``labels``, the loss
    :func:`normbook.linear_cross_entropy` (see the module's docstring for each
    family, and for what is not patched). Parameters, buffers and the state dict are
    untouched; patching twice is the same as once; :func:`unpatch` restores the model.

    Attention masks the kernels do not compute (see :mod:`normbook.hf`) run on
    transformers' attention with a warning; with ``strict=True`` they raise a
    ``ValueError`` instead, at the forward that meets them.

    With ``linear=True`` every ``torch.nn.Linear`` of the model (the projections q, k,
    v, o, gate, up, down of each decoder layer, and ``lm_head``) runs
    :func:`normbook.linear` too: with the kernels above, which are batch-invariant as
    well, a request's logits then have the same bits alone and in any batch (of
    requests of its length: padding changes the attention's layout). ``linear=False``
    (the default) leaves them on PyTorch, and restores any a previous
    ``patch(model, linear=True)`` replaced. The fused loss of training with labels keeps
    its own products.

    Raises:
        TypeError: ``model`` is not a supported transformers model (see
            :data:`SUPPORTED_MODEL_TYPES`).
    """
    _check_model(model)
    found = 0
    for module in model.modules():
        if _is_transformers_class(module, _NORMS):
            convention = _NORMS[type(module).__name__]
            _set_forward(module, _NORM_FORWARDS[convention])
            found += 1
        elif _is_transformers_class(module, _FUSABLE_LAYERS):
            _set_forward(module, _decoder_layer_forward)
        elif _is_transformers_class(module, {"Phi3DecoderLayer"}):
            _set_forward(module, _phi3_decoder_layer_forward)
        elif _is_transformers_class(module, _ATTENTION):
            _set_forward(module, _attention_forward)
        elif _is_transformers_class(module, _FAMILY_ATTENTION):
            _set_forward(module, _family_attention_forward)
        elif _is_transformers_class(module, _GATED_MLPS) and _silu(module):
            _set_forward(module, _swiglu_mlp_forward)
        elif _is_transformers_class(module, {"Phi3MLP"}) and _silu(
            module, "activation_fn"
        ):
            _set_forward(module, _phi3_mlp_forward)
        elif _is_transformers_class(module, _EXPERTS) and _default_gate(module):
            # the gate installed as a forward is (so that it is copied and pickled with
            # the module), then moved to the name transformers' expert code calls
            _set_forward(module, _experts_apply_gate)
            module._apply_gate = module.__dict__.pop("forward")
            _set_forward(module, _experts_forward)
        elif _is_transformers_class(module, _CAUSAL_LMS):
            _set_forward(module, _causal_lm_forward)
        elif type(module) is nn.Linear and linear:  # not a subclass (quantized, LoRA)
            _set_forward(module, _linear_forward)
        elif type(module) is nn.Linear and _patched_fn(module) is _linear_forward:
            del module.forward  # linear=False: nn.Linear's own forward again
            module.__dict__.pop("_normbook_strict", None)
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
            if _is_transformers_class(module, _EXPERTS):
                module.__dict__.pop("_apply_gate", None)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any module of ``model`` runs a forward installed by :func:`patch`."""
    return any(_ours(m) for m in model.modules())
