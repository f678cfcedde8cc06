r"""Run a Hugging Face ``transformers`` model on this package's kernels, in place.

``patch(model)`` swaps the *forward methods* of the model's own submodules (never its
modules, parameters or buffers, so weights and ``state_dict()`` are untouched) and
``unpatch(model)`` restores them:

- the RMSNorms of Qwen3, Llama, Qwen2, Mistral, Phi3, Qwen3-MoE and Mixtral →
  :func:`normbook.rms_norm` (Llama convention: fp32 statistics, round to the input
  dtype, times γ);
- ``Gemma3RMSNorm``, ``Gemma2RMSNorm`` → :func:`normbook.rms_norm` with the Gemma
  convention (everything in fp32 with ``1 + γ``, one rounding); ``Olmo2RMSNorm`` the
  same without the offset (``γ · x̂`` in fp32, one rounding);
- decoder layer: ``h = x + attn``, ``post_attention_layernorm(h)`` →
  :func:`normbook.fused_add_rms_norm` (Qwen3, Llama, Qwen2, Mistral, Qwen3-MoE,
  Mixtral; Phi3 where its residual dropout is the identity: eval, or ``resid_pdrop``
  0);
- ``Qwen3Attention``, ``Qwen3MoeAttention``: ``q_norm``, ``k_norm`` and
  ``apply_rotary_pos_emb`` → :func:`normbook.qk_norm_rope`; OLMo2's ``q_norm`` and
  ``k_norm``, over the whole projection (num_heads · head_dim, one statistic per
  token), → :func:`normbook.rms_norm`, then transformers' RoPE;
- attention (all ten families), prefill and the KV-cache steps of ``generate`` →
  :func:`normbook.attention` (causal, GQA, sliding windows: per layer type for Qwen2,
  Gemma 2 and 3, from the config for Mistral, Mixtral, Phi3), or its varlen form for
  padded batches and packed sequences (see Masks below); Phi3's fused ``qkv_proj`` is
  split as transformers splits it, and its partial RoPE (``partial_rotary_factor``) is
  transformers';
- the SwiGLU MLPs (SiLU: ``act_fn(gate_proj(x)) * up_proj(x)``) of Qwen3, Llama,
  Qwen2, Mistral, OLMo2 and Qwen3-MoE's dense layers, and Phi3's (``gate_up_proj``
  chunked in two) → :func:`normbook.swiglu`;
- the experts of Qwen3-MoE and Mixtral (3-D ``gate_up_proj``, ``down_proj``): each
  routed expert's ``act_fn(gate) * up`` → :func:`normbook.swiglu`, inside
  transformers' own expert code (the ``_apply_gate`` of its grouped and batched
  implementations; for ``experts_implementation="eager"``, its loop, copied, in its
  order): routing, projections and the weighted top-k sum are transformers';
- ``*ForCausalLM`` (not the MoE ones) called with ``labels`` in training
  (``model.train()``): ``lm_head`` then ``ForCausalLMLoss`` →
  :func:`normbook.linear_cross_entropy`, shifted as ``ForCausalLMLoss``
  (``ignore_index``, ``shift_labels``, ``num_items_in_batch``); ``logits`` is then
  ``None``: never computed;
- with ``patch(model, linear=True)``, every ``nn.Linear`` (the projections and
  ``lm_head``) → :func:`normbook.linear`, so that with the kernels above,
  batch-invariant too, a request's logits have the same bits alone and batched (a
  served model's answer does not depend on its neighbours in the batch).

Chosen: in training with ``labels`` the output's ``logits`` is ``None`` (as
Liger-Kernel's integration does): returning them would mean computing the (tokens ×
vocabulary) tensor the fused loss exists to avoid. In eval mode (a Trainer's
evaluation, whose ``compute_metrics`` reads them) the logits are computed and returned
with the loss, as transformers does.

Training as engineers run it: gradient checkpointing
(``model.gradient_checkpointing_enable()``) is honoured by the patched decoder layers
as by transformers' own; under ``torch.autocast`` every kernel computes in the dtype
the module's own code would produce there (a norm's ``weight * x̂`` promoted to fp32,
the projections' and attention's inputs in autocast's dtype, the loss from logits
rounded to it); a patched model can be deep-copied, pickled and saved whole with
``torch.save`` (it loads patched). ``torch.compile(model, fullgraph=True)`` traces a
patched model whole: every kernel is a PyTorch operator (``torch.ops.normbook``), and
the forwards read signatures and masks at trace time only (tested with the
``aot_eager`` backend on the CPU, forward and backward). A padded batch's mask is read
on the host: ``fullgraph=True`` refuses that data-dependent step, and without it the
graph breaks there and the result is eager's.

Not patched, and why: Gemma 2's and 3's MLPs (GELU-tanh, a GeGLU: no kernel here); a
model whose config sets ``final_logit_softcapping`` (Gemma 2's default) computes its
loss on transformers' code (the attention's ``attn_logit_softcapping`` runs on the
kernels' ``softcap``, dense and varlen); the MoE causal LMs' loss (their output,
``MoeCausalLMOutputWithPast``, carries the router's auxiliary loss: the fused loss is
not written for it); a Phi3 layer in training with ``resid_pdrop > 0`` (its dropout
sits between the branch and the add, so the layer is transformers', its norms,
attention and MLP still patched); so does
attention with dropout in training or
``output_attentions`` (silently: the results are the same), and attention under a mask
the kernels do not compute (see Masks).

Masks: the kernels take no mask tensor; they compute the causal pattern from indices.
So each mask transformers builds (once per forward: every layer receives the same
tensor, read once) is read as one of: the plain causal pattern (bottom-right, or
top-left where SDPA's ``is_causal`` would be), with the layer's sliding window;
padding (left or right: ``attention_mask`` with zeros, in prefill, training and each
KV-cache step of ``generate``) and packed sequences (``position_ids`` restarting at 0
without an ``attention_mask``; transformers puts them in the mask only when no KV cache
is used) → the rows that are not padding, gathered into sequences for varlen attention
(bottom-right causal per sequence) and scattered back; a padded query position outputs
zeros, as transformers' FlashAttention path does, where eager and SDPA output values
that no other position reads. A layout is used only if the mask it implies equals
transformers' mask exactly. Recognized forms: eager's float masks (0 keep, the dtype's
minimum drop), SDPA's boolean masks and ``None``. Any other mask (bidirectional, an
additive bias, a static cache's empty slots, a custom 4-D mask of another pattern) runs
on transformers' own attention for that call, with one warning per module class and
reason; ``patch(model, strict=True)`` raises a ``ValueError`` instead. Never a silently
ignored mask.

Without patching: importing this package registers the kernels' attention with
transformers as ``attn_implementation="normbook"`` (:func:`register`: its
``AttentionInterface`` and, for SDPA's masks, its ``AttentionMaskInterface``), so
``AutoModelForCausalLM.from_config(cfg, attn_implementation="normbook")`` or
``model.set_attn_implementation("normbook")`` runs the attention of any model that
dispatches through ``AttentionInterface`` on the kernels, with the same mask reading;
what they cannot compute runs on SDPA.

Supported: Qwen3 (``Qwen3ForCausalLM``, ``Qwen3Model``), Llama (``LlamaForCausalLM``,
``LlamaModel``), Gemma 3 text models (``Gemma3ForCausalLM``, ``Gemma3TextModel``),
Qwen2, Mistral, Phi3, Qwen3-MoE, OLMo2, Gemma 2 and Mixtral (``*ForCausalLM``,
``*Model``), as written in transformers 5.x: the pinned 5.24.0 is the version tested
(others are not claimed); anything else raises a ``TypeError``
(:data:`SUPPORTED_MODEL_TYPES`).

Where a kernel cannot compute exactly what the module computes, the patched forward runs
the module's own code for that call instead of a wrong or gradient-less answer:

* q and k norms with different ``eps``, or rotary tables in another dtype than q.

Not fused: the residual add *after* the MLP with the next layer's ``input_layernorm``.
That add ends a decoder layer, whose output transformers records
(``output_hidden_states``, hooks, gradient checkpointing); fusing across the boundary
would mean rewriting the model's layer loop. Gemma 2's and 3's sandwich norms and
OLMo2's post-norms (norm *then* add) are patched as norms, not fused: the fused kernel
normalizes the sum, these normalize a branch before it is added.
"""

from ._common import _set_forward as _set_forward
from ._forwards import _decoder_layer_forward as _decoder_layer_forward
from ._forwards import _gemma_rms_norm_forward as _gemma_rms_norm_forward
from ._interface import register
from ._patch import SUPPORTED_MODEL_TYPES, is_patched, patch, unpatch

__all__ = ["patch", "unpatch", "is_patched", "register", "SUPPORTED_MODEL_TYPES"]

try:
    register()
except ImportError:  # no transformers, or one without AttentionInterface: patch() only
    pass
# (_set_forward and the two forwards: shown and called by the qwen3_block chapter)
