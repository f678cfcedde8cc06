"""normbook.hf.patch on Qwen2, Mistral, Phi3, Qwen3-MoE, OLMo2, Gemma 2 and Mixtral: each
patched model computes what transformers' own code computes.

One tiny model per family, built from a config (2 layers, hidden 64, vocab 64, 4 heads, 2 kv
heads, head_dim 16; the MoE families 4 experts, top 2; a sliding window of 4 keys over 8
tokens where the family has one, so that the window matters), norm weights drawn away from
their initial value (as test_hf.py does), on normbook.DEVICE. The bounds are test_hf.py's and
argued there: logits 1e-5 relative to the largest (fp32: a few u of each norm's 1/rms through
the layers), gradients 1e-5 relative to each parameter's gradient norm, the loss 1e-5 relative.
Covered per family: fp32 logits, a padded batch, a training step (loss and every gradient),
which kernels run (counted where normbook.hf calls them), greedy generation (slow); and the
MoE experts under transformers' "eager" loop as well as its default grouped forward.

A mixture of experts routes each token to its top 2 of 4 experts by the router's logits, which
read the (patched) post-attention norm: two experts whose probabilities differ by less than the
~1e-7 that separates the runs could swap: with the gap between the second and third
probability spread over ~0.1, a chance of about 1e-7 / 0.1 = 1e-6 per token, 2e-5 for the 16
tokens of a batch.
"""

import copy

import pytest
import torch

from normbook import DEVICE

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("normbook.hf")
from hf_helpers import TINY, count_kernels  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB, WINDOW = 64, 4
LAYERS = TINY["num_hidden_layers"]
SMALL = dict(TINY, vocab_size=VOCAB)
MOE = dict(num_experts_per_tok=2)
# token ids within the vocabulary (the families' defaults are their real tokenizers')
TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# A mask the kernels do not compute runs transformers' attention with a warning: the
# same logits, so here that warning is a failure (e.g. a family's window not passed on).
pytestmark = pytest.mark.filterwarnings("error:normbook.hf:UserWarning")


def _randomize_norms(model, center: float):
    """Norm weights around ``center`` (1 for γ, 0 for Gemma's offset form), not exactly it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(center + 0.2 * torch.randn_like(p))
    return model


def qwen2():
    # the second layer slides (layers from max_window_layers on), the first does not
    cfg = Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    return _randomize_norms(Qwen2ForCausalLM(cfg), 1.0)


def mistral():
    return _randomize_norms(
        MistralForCausalLM(MistralConfig(**SMALL, sliding_window=WINDOW)), 1.0
    )


def phi3():
    # RoPE on half of each head (partial_rotary_factor): transformers' RoPE, kept
    cfg = Phi3Config(
        **SMALL,
        **TOKENS,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.5,
        },
    )
    return _randomize_norms(Phi3ForCausalLM(cfg), 1.0)


def qwen3_moe(experts="grouped_mm"):
    # layer 0 sparse (4 experts), layer 1 a dense Qwen3MoeMLP
    cfg = Qwen3MoeConfig(
        **SMALL, **MOE, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1]
    )
    cfg._experts_implementation = experts
    return _randomize_norms(Qwen3MoeForCausalLM(cfg), 1.0)


def mixtral(experts="grouped_mm"):
    cfg = MixtralConfig(**SMALL, **MOE, num_local_experts=4, sliding_window=WINDOW)
    cfg._experts_implementation = experts
    return _randomize_norms(MixtralForCausalLM(cfg), 1.0)


def olmo2():
    return _randomize_norms(Olmo2ForCausalLM(Olmo2Config(**SMALL, **TOKENS)), 1.0)


def gemma2(softcap=50.0):
    # transformers' SDPA refuses soft-capping: eager, as Gemma 2 is run
    cfg = Gemma2Config(
        **SMALL,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=softcap,
        attn_implementation="eager",
    )
    return _randomize_norms(Gemma2ForCausalLM(cfg), 0.0)


def gemma2_no_softcap():
    return gemma2(softcap=None)


def qwen3_moe_eager():
    return qwen3_moe("eager")


def mixtral_eager():
    return mixtral("eager")


FAMILIES = [qwen2, mistral, phi3, qwen3_moe, mixtral, olmo2, gemma2, gemma2_no_softcap]
IDS = [f.__name__ for f in FAMILIES]


def _ids(batch=2, seq=8):
    return torch.randint(0, VOCAB, (batch, seq), device=DEVICE)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """The mask fallback warns once per module class and reason: once per test here."""
    hf._attention._WARNED.clear()
    yield
    hf._attention._WARNED.clear()


def _pair(build):
    ref = build().to(DEVICE)
    return ref, hf.patch(copy.deepcopy(ref))


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize(
    "build",
    [*FAMILIES, qwen3_moe_eager, mixtral_eager],
    ids=[*IDS, "qwen3_moe_eager", "mixtral_eager"],
)
def test_fp32_logits_match_transformers(build):
    ref, patched = _pair(build)
    ref.eval(), patched.eval()
    ids = _ids()
    with torch.no_grad():
        got, want = patched(ids).logits, ref(ids).logits
    assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),  # autocast's activations, fp32 weights
    ],
)
def test_olmo2_norm_convention(x_dtype, w_dtype):
    """The patched Olmo2RMSNorm against the module: γ · x̂ in fp32, one rounding to x's
    dtype. The same fp32 value up to the last bit of 1/rms: after a rounding to a half
    dtype nearly every element is identical (>= 99%), the rest one ulp apart; in fp32 that
    last bit, 4u relative."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    norm = Olmo2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64))
    norm = norm.to(DEVICE, w_dtype)
    x = (3 * torch.randn(5, 7, 64)).to(DEVICE, x_dtype)
    with torch.no_grad():
        want = norm(x)
        hf._set_forward(norm, hf._families._olmo_rms_norm_forward)
        got = norm(x)
    assert got.dtype == want.dtype == x_dtype
    if x_dtype == torch.float32:
        assert _rel(got, want) <= 2.0**-22
    else:
        assert float((got == want).double().mean()) >= 0.99
        ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[x_dtype]
        assert bool(
            ((got.double() - want.double()).abs() <= ulp * want.double().abs()).all()
        )


@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
def test_padded_batch_logits_match_transformers(build):
    """A left-padded and a right-padded sequence in one batch: the kernels' varlen path (the
    mask's rows gathered into sequences) with each family's window, against transformers at
    the positions that are not padding (a padded query's output is read by nothing)."""
    ref, patched = _pair(build)
    ref.eval(), patched.eval()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    with torch.no_grad():
        got = patched(ids, attention_mask=mask).logits
        want = ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert _rel(got[keep], want[keep]) <= 1e-5


# ---------------------------------------------------------------- which kernels run


_count_kernels = count_kernels


L = LAYERS
# Per family: the calls of one forward. input_layernorm per layer and the final norm; the
# first residual add fused with post_attention_layernorm (Llama's layer form); attention per
# layer; the SwiGLU gate per MLP (a MoE layer: one call for all its routed tokens, in
# transformers' grouped forward); the loss where the LM is patched (not the MoE LMs, whose
# output carries the router's aux loss; not Gemma 2 with its final logit soft-capping).
LLAMA_FORM = dict(
    rms_norm=L + 1, fused_add_rms_norm=L, qk_norm_rope=0, attention=L, swiglu=L
)
EXPECTED = {
    qwen2: (LLAMA_FORM, True),
    mistral: (LLAMA_FORM, True),
    phi3: (LLAMA_FORM, True),
    # Qwen3's QK-Norm and RoPE as one kernel; layer 0's experts and layer 1's dense MLP
    qwen3_moe: ({**LLAMA_FORM, "qk_norm_rope": L}, False),
    mixtral: (LLAMA_FORM, False),
    # post-norm: post_attention and post_feedforward norms, q_norm and k_norm (whole
    # projection) per layer, the final norm; nothing fuses
    olmo2: (dict(LLAMA_FORM, rms_norm=4 * L + 1, fused_add_rms_norm=0), True),
    # sandwich norms (four a layer) and the final norm; GeGLU: no swiglu; soft-capped
    # attention on the kernel
    gemma2: (
        dict(
            rms_norm=4 * L + 1,
            fused_add_rms_norm=0,
            qk_norm_rope=0,
            attention=L,
            swiglu=0,
        ),
        False,
    ),
    gemma2_no_softcap: (
        dict(
            rms_norm=4 * L + 1,
            fused_add_rms_norm=0,
            qk_norm_rope=0,
            attention=L,
            swiglu=0,
        ),
        False,
    ),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
def test_the_kernels_really_run(monkeypatch, build, grad):
    calls = _count_kernels(monkeypatch)
    model = hf.patch(build().to(DEVICE))
    with torch.set_grad_enabled(grad):
        out = model(_ids(), labels=_ids() if grad else None)
    assert ((out.loss if grad else out.logits).grad_fn is not None) == grad
    counts, fused_loss = EXPECTED[build]
    assert calls == {**counts, "_linear_cross_entropy": int(grad and fused_loss)}


def test_gemma2_softcapped_attention_runs_the_kernel(monkeypatch):
    calls = _count_kernels(monkeypatch)
    model = hf.patch(gemma2().to(DEVICE)).eval()
    with torch.no_grad():
        model(_ids())
    assert calls["attention"] == LAYERS


def test_moe_experts_eager_loop_runs_swiglu_per_routed_expert(monkeypatch):
    """experts_implementation="eager": transformers' loop, the gate of each hit expert on the
    kernel (layer 0: 16 tokens × top 2 over 4 experts hit several; layer 1 is dense)."""
    calls = _count_kernels(monkeypatch)
    model = hf.patch(qwen3_moe_eager().to(DEVICE)).eval()
    with torch.no_grad():
        model(_ids())
    assert 1 + 2 <= calls["swiglu"] <= 1 + 4


def test_unpatch_removes_the_experts_gate_too():
    model = hf.patch(mixtral().to(DEVICE))
    experts = model.model.layers[0].mlp.experts
    assert {"forward", "_apply_gate"} <= experts.__dict__.keys()
    hf.unpatch(model)
    assert not hf.is_patched(model)
    assert all(
        "forward" not in m.__dict__ and "_apply_gate" not in m.__dict__
        for m in model.modules()
    )


def test_phi3_residual_dropout_in_training_keeps_transformers_layer(monkeypatch):
    """Phi3's layer drops out each branch before its residual add (resid_pdrop): in training
    that is not the fused add, so the layer runs transformers' forward (norms, attention and
    MLP still patched); in eval the dropout is the identity and the add fuses."""
    calls = _count_kernels(monkeypatch)
    ref = phi3()
    ref.config.resid_pdrop = 0.5
    model = hf.patch(Phi3ForCausalLM(ref.config).to(DEVICE))
    model.train()
    model(_ids())
    assert calls["fused_add_rms_norm"] == 0 and calls["rms_norm"] == 2 * LAYERS + 1
    model.eval()
    with torch.no_grad():
        model(_ids())
    assert calls["fused_add_rms_norm"] == LAYERS


# ---------------------------------------------------------------- training step


@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
def test_training_step_loss_and_gradients(build):
    """labels given: the loss (fused where the LM is patched) within 1e-5 of transformers' and
    every parameter's gradient within 1e-5 of its norm."""
    ref, patched = _pair(build)
    ids, labels = _ids(), _ids()
    labels[0, :3] = -100
    want, got = ref(ids, labels=labels), patched(ids, labels=labels)
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(patched.named_parameters(), ref.parameters()):
        if q.grad is None:  # e.g. an expert no token was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, f"{name}: no gradient through the patched model"
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel <= 1e-5, f"{name}: relative gradient difference {rel:.3g}"


@pytest.mark.slow  # whole models generating, one token at a time
@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
def test_greedy_generation_identical(build):
    """8 tokens through each family's KV cache after a 5-token prompt: every step after the
    first is the bottom-right causal case with seq_q = 1, and the windows (4 keys) slide past
    the prompt. Why identical tokens are expected: see test_hf.py's generation test."""
    ref = build().to(DEVICE).eval()
    patched = hf.patch(copy.deepcopy(ref))
    prompt = _ids(batch=1, seq=5)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    kw["attention_mask"] = torch.ones_like(prompt)
    with torch.no_grad():
        want = ref.generate(prompt, **kw)
        got = patched.generate(prompt, **kw)
    assert want.shape[1] == 13
    assert torch.equal(got, want)
