"""normbook.hf.patch: a Hugging Face model on this package's kernels computes what it computed before.

Tiny models built from a config (2 layers, hidden 64, vocab 64; random weights, nothing
downloaded), on normbook.DEVICE. The unpatched model *is* the reference: transformers 5.x's own
Qwen3/Llama/Gemma 3 code. The norm weights are drawn away from their initial 1 (Gemma: 0) so that a
dropped or misapplied γ changes the result.

Tolerances (fp32, unit roundoff u = 2**-24 ≈ 6e-8):

* Logits. The kernels perform transformers' roundings in transformers' order; what can differ is
  the fp32 statistic 1/rms (sum order, 1/sqrt vs rsqrt): a few u, relatively, on each norm's
  output. There are 2L + 1 = 5 hidden norms and 2L = 4 q/k norms; at initialization each block is
  a near-identity map of the residual stream with O(1) Jacobian, so the perturbations add:
  about 9 · 3u · O(1) ≈ 2e-6 relative to the largest logit. We require 1e-5 (measured: ~4e-7).
  A wrong γ, eps or convention moves logits by 1e-2 or more.
* Gradients. The backward kernels sum in another order than autograd (dγ in two deterministic
  stages, one dot product per row): a few u per reduction, through 2L layers, relative to each
  parameter's gradient norm: we require 1e-5 (measured: ~1e-6). A dropped gradient path is O(1).
* bf16 (u = 2**-8). Same roundings, so the logits are usually bit-identical; a last-bit
  difference of an fp32 statistic can flip one bf16 rounding, which is then an error of the same
  size as the ones transformers itself makes. So we require the patched model to be as accurate
  as transformers against the float64 model, within a factor of 2 (measured: identical).
* AdamW: see test_adamw_20_steps_loss_within_bound_at_every_step.
* Greedy generation: 20 tokens identical. Logits that differ by ~1e-7 can only change an argmax
  whose top two logits are that close: with 64 logits spread over ~0.5, a chance of about
  20 · 1e-7 / 1e-2 ≈ 2e-4 per run.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from normbook import DEVICE
from normbook.lab import op_count

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("normbook.hf")
from hf_helpers import count_kernels  # noqa: E402
from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

VOCAB, HIDDEN, LAYERS = 64, 64, 2
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def _randomize_norms(model, center: float):
    """Norm weights around ``center`` (1 for γ, 0 for Gemma's offset form), not exactly it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(center + 0.2 * torch.randn_like(p))
    return model


def qwen3(cls=Qwen3ForCausalLM):
    return _randomize_norms(cls(Qwen3Config(**SMALL)), 1.0).to(DEVICE)


def llama():
    cfg = LlamaConfig(**SMALL)
    return _randomize_norms(LlamaForCausalLM(cfg), 1.0).to(DEVICE)


def gemma3():
    cfg = Gemma3TextConfig(
        **SMALL,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    return _randomize_norms(Gemma3ForCausalLM(cfg), 0.0).to(DEVICE)


def _ids(batch=2, seq=8):
    return torch.randint(0, VOCAB, (batch, seq), device=DEVICE)


def _loss(model, ids, labels):
    return F.cross_entropy(model(ids).logits.flatten(0, 1).float(), labels.flatten())


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------- patching itself


def test_patch_keeps_weights_and_state_dict_and_unpatch_restores():
    model = qwen3()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    assert hf.patch(model) is model and hf.is_patched(model)
    hf.patch(model)  # twice is the same as once
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value), k
    assert dict(model.named_modules()).keys() == modules.keys()
    assert hf.unpatch(model) is model and not hf.is_patched(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_deep_copy_is_patched_and_runs_its_own_weights():
    model = hf.patch(qwen3()).eval()
    twin = copy.deepcopy(model)
    assert hf.is_patched(twin)
    with torch.no_grad():
        twin.model.norm.weight.mul_(2)  # only the copy's final norm changes
        ids = _ids()
        patched_twin = twin(ids).logits
        assert not torch.equal(patched_twin, model(ids).logits)
        # ... and the copy's patched forward computes what the copy itself computes unpatched.
        assert _rel(patched_twin, hf.unpatch(twin)(ids).logits) <= 1e-5


@pytest.mark.parametrize(
    "bad",
    [
        lambda: torch.nn.Linear(4, 4),
        lambda: GPT2LMHeadModel(
            GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)
        ),
        lambda: "Qwen3ForCausalLM",
    ],
    ids=["nn.Linear", "GPT-2", "a string"],
)
def test_unknown_architecture_is_refused(bad):
    with pytest.raises(TypeError, match="model"):
        hf.patch(bad())


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize(
    "build", [qwen3, llama, gemma3], ids=["qwen3", "llama", "gemma3"]
)
def test_the_kernels_really_run(monkeypatch, build, grad):
    """Each kernel is called where it belongs (equality of logits alone would not show it), in
    training too. Attention runs the kernel in training once normbook.attention has a backward
    (probed: until then that one call falls back to transformers' attention)."""
    calls = count_kernels(monkeypatch)
    model = hf.patch(build())
    with torch.set_grad_enabled(grad):
        out = model(_ids(), labels=_ids() if grad else None)
    assert ((out.loss if grad else out.logits).grad_fn is not None) == grad
    attention = LAYERS
    expected = {
        # input_layernorm per layer + the final norm; add + post_attention_layernorm fused; q/k;
        # attention and the SwiGLU gate per layer; the loss once (training: labels given).
        qwen3: {
            "rms_norm": LAYERS + 1,
            "fused_add_rms_norm": LAYERS,
            "qk_norm_rope": LAYERS,
            "attention": attention,
            "swiglu": LAYERS,
            "_linear_cross_entropy": int(grad),
        },
        llama: {
            "rms_norm": LAYERS + 1,
            "fused_add_rms_norm": LAYERS,
            "qk_norm_rope": 0,
            "attention": attention,
            "swiglu": LAYERS,
            "_linear_cross_entropy": int(grad),
        },
        # Gemma 3: four sandwich norms and q_norm, k_norm per layer, the final norm; no fusion;
        # GELU-tanh MLP (GeGLU): no kernel, so no swiglu.
        gemma3: {
            "rms_norm": 6 * LAYERS + 1,
            "fused_add_rms_norm": 0,
            "qk_norm_rope": 0,
            "attention": attention,
            "swiglu": 0,
            "_linear_cross_entropy": int(grad),
        },
    }[build]
    assert calls == expected


def test_kernels_hf_after_import_kernels_alone():
    """``import normbook`` imports no transformers; ``normbook.hf`` loads on first use."""
    import subprocess
    import sys

    code = (
        "import sys, normbook; assert 'transformers' not in sys.modules; "
        "assert 'normbook.hf' not in sys.modules; "
        "assert callable(normbook.hf.patch) and normbook.hf is sys.modules['normbook.hf']"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- Qwen3 against transformers


@pytest.mark.parametrize("cls", [Qwen3ForCausalLM, Qwen3Model])
def test_qwen3_fp32_outputs(cls):
    ref = qwen3(cls).eval()
    patched = hf.patch(copy.deepcopy(ref))
    ids = _ids()
    with torch.no_grad():
        out = patched(ids)
        want = ref(ids)
    key = "logits" if cls is Qwen3ForCausalLM else "last_hidden_state"
    assert _rel(out[key], want[key]) <= 1e-5


@pytest.mark.parametrize(
    "build", [qwen3, llama, gemma3], ids=["qwen3", "llama", "gemma3"]
)
def test_bf16_as_accurate_as_transformers(build):
    ref = build().eval()
    ids = _ids()
    with torch.no_grad():
        exact = copy.deepcopy(ref).double()(ids).logits
        ref16 = ref.to(torch.bfloat16)
        got = hf.patch(copy.deepcopy(ref16))(ids).logits
        want = ref16(ids).logits
    err_hf = (want.double() - exact).abs().max().item()
    err_kernels = (got.double() - exact).abs().max().item()
    assert err_kernels <= 2 * err_hf, (err_kernels, err_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemma_convention_matches_gemma3_rms_norm(dtype):
    """The patched Gemma3RMSNorm against the module itself: x̂·(1 + γ) in fp32, one rounding.
    Both compute the same fp32 value up to the last bit of 1/rms (sum order, rsqrt), so after the
    single rounding to a half-precision dtype nearly every element is identical (>= 99%) and the
    rest one ulp apart; in fp32 the difference is that last bit: relative 4u = 2**-22."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.2 * torch.randn(HIDDEN))
    norm = norm.to(DEVICE, dtype)
    x = (3 * torch.randn(5, 7, HIDDEN)).to(DEVICE, dtype)
    with torch.no_grad():
        want = norm(x)
        hf._set_forward(norm, hf._gemma_rms_norm_forward)
        got = norm(x)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        assert _rel(got, want) <= 2.0**-22
    else:
        assert float((got == want).double().mean()) >= 0.99
        ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
        assert bool(
            ((got.double() - want.double()).abs() <= ulp * want.double().abs()).all()
        )


@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
def test_llama_and_gemma3_fp32_logits(build):
    ref = build().eval()
    patched = hf.patch(copy.deepcopy(ref))
    ids = _ids()
    with torch.no_grad():
        assert _rel(patched(ids).logits, ref(ids).logits) <= 1e-5


def test_qwen3_gradients_of_every_parameter():
    ref = qwen3()
    patched = hf.patch(copy.deepcopy(ref))
    ids, labels = _ids(), _ids()
    _loss(ref, ids, labels).backward()
    _loss(patched, ids, labels).backward()
    for (name, p), q in zip(patched.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name}: no gradient through the patched model"
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel <= 1e-5, f"{name}: relative gradient difference {rel:.3g}"


@pytest.mark.slow  # whole models generating: a minute or more each on a CPU
@pytest.mark.parametrize(
    "build", [qwen3, llama, gemma3], ids=["qwen3", "llama", "gemma3"]
)
def test_greedy_generation_identical(build):
    """20 tokens through the KV cache: every step after the first has seq_q = 1 < seq_k, the
    bottom-right causal case (and Gemma 3's sliding layers, window 4, slide past the prompt)."""
    ref = build().eval()
    patched = hf.patch(copy.deepcopy(ref))
    prompt = _ids(batch=1, seq=5)
    # eos_token_id=None: Llama's config ends a sequence at token 2 and Gemma 3's at 1, which
    # a random model over 64 tokens emits now and then (random prompts, no seed): such a run
    # stopped early (Llama at 8 of 25 tokens under transformers 5.17, Gemma 3 at 12 under
    # 5.24) and would have compared fewer steps than this test says. Not min_new_tokens:
    # that sets the EOS logit to -inf, and the argmax over every logit is what is compared.
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    # The mask given: generate() would otherwise infer padding wherever the random prompt
    # holds pad_token_id (0) (padding itself: test_hf_masks.py).
    kw["attention_mask"] = torch.ones_like(prompt)
    with torch.no_grad():
        want = ref.generate(prompt, **kw)
        got = patched.generate(prompt, **kw)
    assert want.shape[1] == 25
    assert torch.equal(got, want)


# ---------------------------------------------------------------- the loss, training (masks: test_hf_masks.py)


@pytest.mark.parametrize(
    "build", [qwen3, llama, gemma3], ids=["qwen3", "llama", "gemma3"]
)
def test_loss_with_labels_and_its_gradients(build):
    """labels given: the loss is normbook.linear_cross_entropy's (shifted as ForCausalLMLoss),
    the logits are not returned (None), and every parameter's gradient matches transformers'.
    Bounds as for the logits above (the loss is a mean of lse − logit: its relative error is
    that of the logits, 1e-5) and the gradients (1e-5 relative)."""
    ref = build()
    patched = hf.patch(copy.deepcopy(ref))
    ids, labels = _ids(), _ids()
    labels[0, :3] = -100  # ignored positions, as a prompt is masked in fine-tuning
    want, got = ref(ids, labels=labels), patched(ids, labels=labels)
    assert got.logits is None and got.loss.dtype == want.loss.dtype == torch.float32
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(patched.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name}: no gradient through the patched model"
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel <= 1e-5, f"{name}: relative gradient difference {rel:.3g}"


def test_num_items_in_batch_and_shift_labels():
    """``num_items_in_batch`` (gradient accumulation: the sum over tokens divided by the
    tokens of all micro-batches) and a given ``shift_labels``, as ForCausalLMLoss."""
    ref = qwen3()
    patched = hf.patch(copy.deepcopy(ref))
    ids, labels = _ids(), _ids()
    n = torch.tensor(37)
    with torch.no_grad():
        for kw in (
            {"labels": labels, "num_items_in_batch": n},
            {"labels": labels, "shift_labels": labels},
        ):
            want, got = ref(ids, **kw).loss, patched(ids, **kw).loss
            assert abs(got.item() - want.item()) <= 1e-5 * want.item(), kw.keys()


@pytest.mark.slow  # a whole model trained for 20 steps
@pytest.mark.parametrize("build", [qwen3, llama], ids=["qwen3", "llama"])
def test_adamw_20_steps_loss_within_bound_at_every_step(build):
    """20 AdamW steps (lr 1e-2) from the same weights on the same batch, the loss from labels.
    The gradients differ by δ ≲ 1e-6 relatively (measured; bounded by 1e-5 above). Adam's step
    m̂/(√v̂ + ε) is scale-free, so step j moves the two runs' parameters apart by about δ·lr per
    coordinate; to first order the loss gap grows at most linearly in k: k · 1e-5 · ℓ_0
    (δ_max = 1e-5 of the initial loss per step). Beyond first order Adam can amplify a gap
    (an entry whose v̂ is tiny takes a full step in a direction rounding picks): a control
    run, transformers itself with every weight moved by one ulp (nextafter), measures that
    amplification on this very model, and we allow 8 times it. So at every step k:
    |ℓ_k − ℓ'_k| <= max(k · 1e-5 · ℓ_0, 8 · max gap of the control). Measured on Llama with
    attention's backward on the kernels: the control reaches ~1e-4, the kernels ~1e-3 at
    the worst step, both far below a frozen γ's ~4e-2 (its gradient dropped)."""
    ref = build()
    patched = hf.patch(copy.deepcopy(ref))
    control = copy.deepcopy(ref)
    coin = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in control.parameters():
            up = torch.randint(0, 2, p.shape, generator=coin).bool().to(p.device)
            p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf)))
    ids, labels = _ids(batch=1), _ids(batch=1)
    losses = {}
    for name, model in (
        ("transformers", ref),
        ("kernels", patched),
        ("control", control),
    ):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(20):
            opt.zero_grad()
            loss = model(ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    a, b = torch.tensor(losses["kernels"]), torch.tensor(losses["transformers"])
    c = torch.tensor(losses["control"])
    # It trains, so the gap below is not that of two idle runs. Half, not a tenth: over 8
    # fresh draws (random weights and tokens each) transformers' own Llama ended at 0.002 to
    # 0.145 of its first loss, Qwen3 at 0.001 to 0.005; a tenth failed one Llama draw in 8.
    assert float(b[-1]) < 0.5 * float(b[0])
    k = torch.arange(1, 21, dtype=torch.float32)
    bound = torch.maximum(k * 1e-5 * b[0], 8 * (c - b).abs().max())
    assert bool(((a - b).abs() <= bound).all()), losses


@pytest.mark.parametrize("build", [qwen3, llama], ids=["qwen3", "llama"])
def test_what_stays_on_pytorch_in_one_layer(build):
    """One patched decoder layer's forward (inference, KV cache on): of the arithmetic only
    the seven projections (q, k, v, o, gate, up, down), the second residual add and the KV
    cache's concatenation stay on PyTorch's side; Llama adds its RoPE (no QK-Norm to fuse it
    with: rotate_half's neg and cat, two products and a sum for q and for k each)."""
    model = hf.patch(build()).eval()
    layer, captured = model.model.layers[0], {}
    handle = layer.register_forward_pre_hook(
        lambda mod, a, k: captured.update(a=a, k=k), with_kwargs=True
    )
    with torch.no_grad():
        model(_ids())
    handle.remove()
    with torch.no_grad():
        _, counts = op_count.torch_ops(layer, *captured["a"], **captured["k"])
    work = {
        key: n
        for key, n in counts.items()
        if key[0] in ("matmul", "embedding", "elementwise", "attention", "cache")
    }
    rope = {
        ("elementwise", "mul"): 4,
        ("elementwise", "neg"): 2,
        ("elementwise", "cat"): 2,
    }
    expected = {
        ("matmul", "mm"): 7,
        ("cache", "cat"): 2,
        ("elementwise", "add"): 1 if build is qwen3 else 3,
        **({} if build is qwen3 else rope),
    }
    assert work == expected
