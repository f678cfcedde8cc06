"""normbook.qk_norm_rope against the real reference (Hugging Face transformers' Qwen3Attention, built
from a tiny randomly initialised Qwen3Config; no weights are downloaded) and against the float64
formula (normbook.reference.qk_norm_rope).

Tolerances. The kernel performs the reference's roundings in the reference's order:
x̂ = rnd(x·rstd), y = rnd(x̂·γ), a = rnd(y·cos), b = rnd(rotate_half(y)·sin), out = rnd(a + b).

* Against float64: y carries at most two roundings and a, b one more each, so
  |a - a*| <= 3u|a*| (to first order in u), likewise b, and the final rounding adds u|out*|:
  |out - out*| <= 3u(|a*| + |b*|) + u|out*|. The bound is on the *terms* a*, b*, not on out*:
  a + b can cancel, and then the relative error of out itself is unbounded. The fp32 statistics
  add a relative error of at most ~1e-5 to rstd (as in conftest.norm_tolerance).
* Against transformers: the same roundings of the same values, so in half precision the results
  are bit-identical unless the fp32 statistics differ in their last bit (sum order, rsqrt vs
  1/sqrt) and that moves x̂ across a rounding boundary: rare (we require >= 99% identical), and
  then by about one ulp per later rounding (bounded by 4u(|a*| + |b*|) + 2u|out*|).
"""

import importlib
import math

import pytest
import torch
from conftest import UNIT_ROUNDOFF, assert_rejected_before_launch, randn
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import DEVICE, qk_norm_rope
from normbook import reference as ref
from normbook.qk_norm_rope import BUGS, qk_norm_rope_torch

mq = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
from transformers import AttentionInterface, Qwen3Config  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
_CAPTURED = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """An 'attention implementation' that records the q and k Qwen3Attention hands to attention."""
    _CAPTURED["q"], _CAPTURED["k"] = query, key
    b, h, s, d = query.shape
    return torch.zeros(b, s, h, d, dtype=query.dtype, device=query.device), None


AttentionInterface.register("capture_qk", _capture_attention)


def hf_attention(head_dim, n_heads, n_kv_heads, dtype, seed=0, gamma_spread=0.3):
    """A tiny Qwen3Attention with random projections and random q_norm/k_norm weights
    (Hugging Face initialises them to ones, which would hide every weight-related mistake)."""
    cfg = Qwen3Config(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=1,
        vocab_size=16,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=EPS,
        max_position_embeddings=4096,
    )
    cfg._attn_implementation = "capture_qk"
    torch.manual_seed(seed)
    attn = mq.Qwen3Attention(cfg, layer_idx=0)
    with torch.no_grad():
        attn.q_norm.weight.copy_(1 + gamma_spread * torch.randn(head_dim))
        attn.k_norm.weight.copy_(1 + gamma_spread * torch.randn(head_dim))
    return attn.to(DEVICE, dtype).requires_grad_(False), mq.Qwen3RotaryEmbedding(
        cfg
    ).to(DEVICE)


def run_hf(attn, rotary, batch, seq, dtype, first_position=0, scale=1.0):
    """Run the real module; return its q_proj/k_proj outputs as (batch, seq, heads, head_dim), cos,
    sin, and the q, k after QK-Norm and RoPE, transposed back to (batch, seq, heads, head_dim)."""
    hidden = randn(batch, seq, 64, dtype=dtype, scale=scale)
    positions = (torch.arange(seq, device=DEVICE) + first_position)[None].expand(
        batch, seq
    )
    cos, sin = rotary(hidden, positions)
    proj = {}
    hooks = [
        attn.q_proj.register_forward_hook(lambda m, i, o: proj.__setitem__("q", o)),
        attn.k_proj.register_forward_hook(lambda m, i, o: proj.__setitem__("k", o)),
    ]
    with torch.no_grad():
        attn(hidden, (cos, sin), None)
    for h in hooks:
        h.remove()
    q = proj["q"].view(batch, seq, -1, attn.head_dim)
    k = proj["k"].view(batch, seq, -1, attn.head_dim)
    return (
        q,
        k,
        cos,
        sin,
        _CAPTURED["q"].transpose(1, 2),
        _CAPTURED["k"].transpose(1, 2),
    )


def cos_sin(positions, head_dim, dtype=torch.float32):
    """The float64 formula's cos/sin for these positions, rounded to ``dtype`` (as a rotary embedding returns them)."""
    return tuple(t.to(DEVICE, dtype) for t in ref.rope_cos_sin(positions, head_dim))


def rope_terms(x, weight, cos, sin):
    """float64 |a*| + |b*| and |out*| of the reference, elementwise (see the module docstring)."""
    x, weight, cos, sin = (
        None if t is None else t.detach().cpu() for t in (x, weight, cos, sin)
    )
    y = ref.rms_norm(x, weight, EPS)
    a = y * cos.double()[:, :, None, :]
    b = ref.rotate_half(y) * sin.double()[:, :, None, :]
    return a.abs() + b.abs(), (a + b).abs()


def assert_close_to_float64(out, x, weight, cos, sin, dtype, what):
    u = UNIT_ROUNDOFF[dtype]
    terms, mag = rope_terms(x, weight, cos, sin)
    expected = ref.apply_rope(ref.rms_norm(x, weight, EPS), cos, sin).cpu()
    bound = (
        (3 * u + (1e-5 if dtype != torch.float64 else 1e-12)) * terms + u * mag + 1e-30
    )
    if dtype == torch.float16:
        bound = (
            bound + 2.0**-24 * 4
        )  # subnormal results: absolute, half a spacing per rounding
    err = (out.double().cpu() - expected).abs()
    worst = torch.argmax(err - bound)
    assert bool((err <= bound).all()), (
        f"{what} ({dtype}): error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"
    )


def hf_mismatch(out, expected, x, weight, cos, sin, dtype):
    """(fraction of elements not bit-identical, whether any exceeds the bound of the module docstring)."""
    u = UNIT_ROUNDOFF[dtype]
    terms, mag = rope_terms(x, weight, cos, sin)
    rel = 4 * u + (1e-5 if dtype == torch.float32 else 0.0)
    bound = rel * terms + 2 * u * mag + (2.0**-22 if dtype == torch.float16 else 1e-30)
    out, expected = out.cpu(), expected.cpu()
    err = (out.double() - expected.double()).abs()
    return (out != expected).double().mean().item(), bool((err > bound).any())


# ------------------------------------------------------------------ the real reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim, n_heads, n_kv_heads, batch, seq",
    [(64, 4, 4, 2, 5), (128, 8, 2, 1, 1), (128, 6, 3, 2, 9), (256, 4, 1, 1, 3)],
)
def test_matches_transformers_qwen3_attention(
    dtype, head_dim, n_heads, n_kv_heads, batch, seq, poison_empty
):
    attn, rotary = hf_attention(head_dim, n_heads, n_kv_heads, dtype)
    q, k, cos, sin, q_hf, k_hf = run_hf(
        attn, rotary, batch, seq, dtype, first_position=1000
    )
    qw, kw = attn.q_norm.weight, attn.k_norm.weight
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, eps=EPS)
    assert (
        q_out.shape == q.shape
        and k_out.shape == k.shape
        and q_out.dtype == k_out.dtype == dtype
    )
    for out, expected, x, w, name in [
        (q_out, q_hf, q, qw, "q"),
        (k_out, k_hf, k, kw, "k"),
    ]:
        differing, beyond = hf_mismatch(out, expected, x, w, cos, sin, dtype)
        assert not beyond, f"{name} differs from transformers by more than the bound"
        if dtype != torch.float32:
            assert differing <= 0.01, (
                f"{name}: {differing:.2%} of elements differ from transformers"
            )
        assert_close_to_float64(out, x, w, cos, sin, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfused_torch_path_is_the_reference(dtype):
    """qk_norm_rope_torch (bug=None) performs transformers' operations: bit-identical."""
    attn, rotary = hf_attention(128, 4, 2, dtype)
    q, k, cos, sin, q_hf, k_hf = run_hf(attn, rotary, 2, 6, dtype)
    q_t, k_t = qk_norm_rope_torch(
        q, k, attn.q_norm.weight, attn.k_norm.weight, cos, sin, EPS
    )
    assert torch.equal(q_t, q_hf) and torch.equal(k_t, k_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_every_bug_in_the_zoo_is_detected(dtype, bug):
    """Each mistake differs from transformers by more than the tolerance the kernel meets, on an input
    whose tokens span scales 1e-4..1e2 and whose heads differ in loudness (as real heads do).
    'gamma_before_cast' only changes roundings: in fp32 there is no cast, so it is harmless there."""
    attn, rotary = hf_attention(128, 4, 2, dtype)
    seq = 7
    q, k, cos, sin, _, _ = run_hf(attn, rotary, 1, seq, dtype)
    token_scale = (10.0 ** torch.linspace(-4, 2, seq))[None, :, None, None]
    token_scale = token_scale.to(DEVICE)
    head_scale = torch.tensor([0.1, 1.0, 3.0, 10.0], device=DEVICE)[None, None, :, None]
    q = (
        q.float()
        / q.float().pow(2).mean(-1, keepdim=True).sqrt()
        * token_scale
        * head_scale
    ).to(dtype)
    k = (k.float() / k.float().pow(2).mean(-1, keepdim=True).sqrt() * token_scale).to(
        dtype
    )
    qw, kw = attn.q_norm.weight, attn.k_norm.weight
    q_ref, k_ref = mq.apply_rotary_pos_emb(
        attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2), cos, sin
    )
    q_ref, k_ref = q_ref.transpose(1, 2), k_ref.transpose(1, 2)

    def detected(out_q, out_k):
        dq, bq = hf_mismatch(out_q, q_ref, q, qw, cos, sin, dtype)
        dk, bk = hf_mismatch(out_k, k_ref, k, kw, cos, sin, dtype)
        return bq or bk or (dtype != torch.float32 and max(dq, dk) > 0.01)

    assert not detected(*qk_norm_rope(q, k, qw, kw, cos, sin, EPS))  # the kernel passes
    wrong = qk_norm_rope_torch(q, k, qw, kw, cos, sin, EPS, bug=bug)
    if bug == "gamma_before_cast" and dtype == torch.float32:
        assert torch.equal(wrong[0], q_ref)
    else:
        assert detected(*wrong), f"the bug {bug!r} went unnoticed in {dtype}"


# ------------------------------------------------------------------ against the float64 formula


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [2, 6, 80, 128])
def test_matches_float64_formula(dtype, head_dim, poison_empty):
    """Odd half-widths (head_dim 6, 80: halves of 3 and 40) exercise the masked columns."""
    q = randn(2, 5, 3, head_dim, dtype=dtype, scale=3.0)
    k = randn(2, 5, 1, head_dim, dtype=dtype)
    qw, kw = randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)
    cos, sin = cos_sin(torch.arange(10).view(2, 5) * 37, head_dim, dtype)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, eps=EPS)
    assert_close_to_float64(q_out, q, qw, cos, sin, dtype, "q")
    assert_close_to_float64(k_out, k, kw, cos, sin, dtype, "k")


def test_float64_is_accumulated_in_float64():
    q, k = (
        randn(1, 4, 2, 64, dtype=torch.float64),
        randn(1, 4, 2, 64, dtype=torch.float64),
    )
    w = randn(64, dtype=torch.float64)
    cos, sin = cos_sin(torch.arange(4)[None], 64, torch.float64)
    got = qk_norm_rope(q, k, w, w, cos, sin)
    expected = ref.qk_norm_rope(q, k, w, w, cos, sin)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-13, atol=1e-15)


def test_hand_calculation():
    """head_dim 2, q = (3, 4), γ = 1, ε = 0, position 1 (θ = 1 rad): q̂ = (3, 4)/√12.5, rotated by 1 rad."""
    q = torch.tensor([3.0, 4.0], device=DEVICE).view(1, 1, 1, 2)
    c, s = math.cos(1.0), math.sin(1.0)
    cos = torch.tensor([[[c, c]]], device=DEVICE)
    sin = torch.tensor([[[s, s]]], device=DEVICE)
    q_out, _ = qk_norm_rope(q, q, None, None, cos, sin, eps=0.0)
    r = math.sqrt(12.5)
    expected = [(3 * c - 4 * s) / r, (4 * c + 3 * s) / r]
    torch.testing.assert_close(
        q_out.flatten().cpu(), torch.tensor(expected), rtol=1e-6, atol=1e-7
    )
    assert (
        abs(q_out.double().pow(2).mean().item() - 1.0) < 1e-6
    )  # the rotation kept the unit RMS


# ------------------------------------------------------------------ layouts


def test_views_of_a_fused_qkv_projection_are_read_in_place(monkeypatch):
    """q and k as views of one (batch, seq, (Hq + 2·Hk)·d) buffer: strided, last dimension contiguous."""
    mod = importlib.import_module("normbook.qk_norm_rope")
    B, S, Hq, Hk, D = 2, 5, 4, 2, 64
    qkv = randn(B, S, (Hq + 2 * Hk) * D, dtype=torch.bfloat16)
    q = qkv[..., : Hq * D].view(B, S, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, S, Hk, D)
    assert not q.is_contiguous() and not k.is_contiguous()
    w = randn(D, dtype=torch.bfloat16)
    cos, sin = cos_sin(torch.arange(S)[None].expand(B, S), D, torch.bfloat16)
    seen = {}
    real = mod._forward

    def spy(q_, k_, *rest):
        seen["ptrs"] = (q_.data_ptr(), k_.data_ptr())
        return real(q_, k_, *rest)

    monkeypatch.setattr(mod, "_forward", spy)
    q_out, k_out = qk_norm_rope(q, k, w, w, cos, sin)
    assert seen["ptrs"] == (q.data_ptr(), k.data_ptr())  # no copy was made
    q_c, k_c = qk_norm_rope(q.contiguous(), k.contiguous(), w, w, cos, sin)
    assert torch.equal(q_out, q_c) and torch.equal(k_out, k_c)
    assert_close_to_float64(q_out, q, w, cos, sin, torch.bfloat16, "q")


def test_other_strides_and_broadcast_cos_sin():
    B, S, H, D = 2, 4, 3, 32
    base = randn(B, S, 2 * H, D + 8)
    q = base[:, :, ::2, 4 : 4 + D]  # every other head, and an offset inside each row
    k = randn(B, D, S, 2).permute(0, 2, 3, 1)  # head_dim not contiguous: copied once
    assert k.stride(-1) != 1
    cos1, sin1 = cos_sin(
        torch.arange(S)[None] + 5, D
    )  # a batch of 1, as for shared positions
    wq, wk = randn(D), randn(D)
    q_out, k_out = qk_norm_rope(q, k, wq, wk, cos1, sin1)
    q_exp, k_exp = qk_norm_rope(
        q.contiguous(),
        k.contiguous(),
        wq,
        wk,
        cos1.expand(B, S, D),
        sin1.expand(B, S, D),
    )
    assert torch.equal(q_out, q_exp) and torch.equal(k_out, k_exp)
    cos_wide = randn(B, S, 2 * D)[..., :D].copy_(
        cos1.expand(B, S, D)
    )  # strided rows of cos
    q_out2, _ = qk_norm_rope(q, k, wq, wk, cos_wide, sin1)
    assert torch.equal(q_out2, q_exp)
    assert_close_to_float64(
        q_out, q, wq, cos1.expand(B, S, D), sin1.expand(B, S, D), torch.float32, "q"
    )


def test_without_weights():
    q, k = randn(1, 3, 2, 16), randn(1, 3, 1, 16)
    cos, sin = cos_sin(torch.arange(3)[None], 16)
    q_out, k_out = qk_norm_rope(q, k, None, None, cos, sin)
    assert_close_to_float64(q_out, q, None, cos, sin, torch.float32, "q")
    assert_close_to_float64(k_out, k, None, cos, sin, torch.float32, "k")


@pytest.mark.parametrize(
    "shape_q, shape_k",
    [
        ((0, 3, 2, 8), (0, 3, 1, 8)),
        ((2, 0, 2, 8), (2, 0, 1, 8)),
        ((1, 3, 0, 8), (1, 3, 2, 8)),
    ],
)
def test_empty_inputs(shape_q, shape_k):
    q, k = torch.randn(shape_q, device=DEVICE), torch.randn(shape_k, device=DEVICE)
    cos = torch.ones(shape_q[0], shape_q[1], 8, device=DEVICE)
    q_out, k_out = qk_norm_rope(q, k, None, None, cos, torch.zeros_like(cos))
    assert q_out.shape == shape_q and k_out.shape == shape_k
    if (
        k.numel()
    ):  # with no q heads, k is still normalized (cos = 1, sin = 0: no rotation)
        torch.testing.assert_close(
            k_out, ref.rms_norm(k, None, EPS).float(), rtol=1e-6, atol=1e-7
        )


def test_nan_stays_in_its_head():
    q, k = randn(1, 3, 4, 16), randn(1, 3, 2, 16)
    q[0, 1, 2, 5] = float("nan")
    cos, sin = cos_sin(torch.arange(3)[None], 16)
    q_out, k_out = qk_norm_rope(q, k, None, None, cos, sin)
    bad = torch.isnan(q_out).any(-1)
    assert bad[0, 1, 2] and torch.isnan(q_out[0, 1, 2]).all() and bad.sum() == 1
    assert torch.isfinite(k_out).all()


def test_deterministic():
    q, k = (
        randn(2, 7, 4, 128, dtype=torch.bfloat16),
        randn(2, 7, 2, 128, dtype=torch.bfloat16),
    )
    w = randn(128, dtype=torch.bfloat16)
    cos, sin = cos_sin(torch.arange(7)[None].expand(2, 7), 128, torch.bfloat16)
    a, b = qk_norm_rope(q, k, w, w, cos, sin), qk_norm_rope(q, k, w, w, cos, sin)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@settings(max_examples=12, deadline=None)
@given(
    m=st.integers(0, 5000),
    n=st.integers(0, 5000),
    shift=st.integers(-2000, 2000),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_logit_depends_only_on_relative_position(m, n, shift, seed):
    """With γ = 1: |q'| = |q̂| (rotation keeps length), and q'_m·k'_n = q'_{m+t}·k'_{n+t}."""
    g = torch.Generator().manual_seed(seed)
    d = 64
    q1, k1 = randn(1, 1, 1, d, generator=g), randn(1, 1, 1, d, generator=g)
    q, k = (
        q1.expand(1, 2, 1, d),
        k1.expand(1, 2, 1, d),
    )  # one vector at two positions, stride 0
    pos_q = torch.tensor([[m, max(m + shift, 0)]])
    pos_k = torch.tensor([[n, max(m + shift, 0) - m + n]])
    cq, sq = cos_sin(pos_q, d)
    ck, sk = cos_sin(pos_k, d)
    q_out, _ = qk_norm_rope(q, q, None, None, cq, sq, eps=0.0)
    k_out, _ = qk_norm_rope(k, k, None, None, ck, sk, eps=0.0)
    torch.testing.assert_close(
        q_out.double().pow(2).mean(-1).cpu(),
        torch.ones(1, 2, 1, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    logits = (q_out * k_out).double().sum(-1).flatten()
    # angles up to ~7000 rad lose ~7000·2**-24 in fp32 cos/sin: an absolute error of ~1e-3 on |logit| <= d.
    assert abs(logits[0] - logits[1]) < 2e-3 * d**0.5


# ------------------------------------------------------------------ bad arguments, before any launch


def _args(**over):
    B, S, D = 1, 3, 8
    a = dict(
        q=torch.ones(B, S, 2, D),
        k=torch.ones(B, S, 1, D),
        q_weight=torch.ones(D),
        k_weight=torch.ones(D),
        cos=torch.ones(B, S, D),
        sin=torch.zeros(B, S, D),
    )
    a.update(over)
    # Built at collection time on the CPU: move to the kernels' device (a meta tensor stays put).
    return {
        n: v.to(DEVICE)
        if isinstance(v, torch.Tensor) and v.device.type != "meta"
        else v
        for n, v in a.items()
    }


@pytest.mark.parametrize(
    "over, exc, words",
    [
        (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
        (dict(k=torch.ones(1, 3, 1, 8, dtype=torch.int32)), TypeError, "k must be"),
        (
            dict(q=torch.ones(3, 2, 8)),
            ValueError,
            "q must have shape (batch, seq, n_heads, head_dim)",
        ),
        (dict(k=torch.ones(3, 1, 8)), ValueError, "k must have shape"),
        (
            dict(k=torch.ones(1, 3, 1, 8, dtype=torch.float64)),
            TypeError,
            "k must have q's dtype",
        ),
        (
            dict(k=torch.ones(1, 4, 1, 8)),
            ValueError,
            "k must match q in batch, seq and head_dim",
        ),
        (dict(k=torch.ones(1, 3, 1, 6)), ValueError, "k must match q"),
        (
            dict(
                q=torch.ones(1, 3, 2, 7),
                k=torch.ones(1, 3, 1, 7),
                q_weight=torch.ones(7),
                k_weight=torch.ones(7),
                cos=torch.ones(1, 3, 7),
                sin=torch.ones(1, 3, 7),
            ),
            ValueError,
            "head_dim must be even",
        ),
        (
            dict(q=torch.ones(1, 1, 1, 32768), k=torch.ones(1, 1, 1, 32768)),
            ValueError,
            "too large",
        ),
        (dict(q_weight=torch.ones(7)), ValueError, "q_weight must have shape (8,)"),
        (
            dict(k_weight=torch.ones(8, dtype=torch.int64)),
            TypeError,
            "k_weight must be",
        ),
        (dict(k_weight=None), ValueError, "both be given or both be None"),
        (
            dict(cos=torch.ones(1, 3, 8, dtype=torch.bfloat16)),
            TypeError,
            "cos must have q's dtype",
        ),
        (
            dict(sin=torch.ones(1, 3, 4)),
            ValueError,
            "sin must have shape (batch, seq, head_dim) = (1, 3, 8)",
        ),
        (dict(cos=torch.ones(3, 8)), ValueError, "cos must have shape"),
        (
            dict(
                q=torch.ones(2, 3, 2, 8),
                k=torch.ones(2, 3, 1, 8),
                cos=torch.ones(3, 3, 8),
            ),
            ValueError,
            "cos must have shape",
        ),
        (dict(sin=None), TypeError, "sin must be a torch.Tensor"),
        (dict(eps=-1.0), ValueError, "eps must be finite and >= 0"),
        (dict(eps="1e-6"), TypeError, "eps must be a real number"),
        (dict(q=torch.ones(1, 3, 2, 8, device="meta")), ValueError, "q is on meta"),
        (dict(cos=torch.ones(1, 3, 8, device="meta")), ValueError, "cos is on meta"),
    ],
)
def test_bad_arguments_raise_clear_errors(over, exc, words, monkeypatch):
    assert_rejected_before_launch(
        monkeypatch, "qk_norm_rope", lambda: qk_norm_rope(**_args(**over)), exc, words
    )


def test_unknown_bug_name_is_rejected():
    with pytest.raises(ValueError, match="bug must be None or one of"):
        qk_norm_rope_torch(**_args(), bug="typo")
