"""The backward of normbook.attention against float64 autograd of the explicit-mask
reference.

Sizes are small for the interpreter (seq ≤ 70) but odd and chosen to cross tile
boundaries: the interpreter's tiles are 16–64 rows and keys (tile_config,
bwd_tile_config), so 33, 37, 65 and 70 leave partial tiles on both sides, and seq_q ≠
seq_k moves the causal diagonal off the tile grid. A wrong mask at a tile edge, a
skipped tile, a missing group head or a dropped term changes whole gradient rows by
amounts far above the bounds (attention_bounds.grad_bounds).
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from attention_bounds import assert_grads_within_bound
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_rejected_before_launch,
    on_cpu,
    randn,
)

from normbook import DEVICE, attention
from normbook import reference as ref

# the module, not the function of the same name
attention_module = importlib.import_module("normbook.attention")


def qkv(B, H, H_kv, seq_q, seq_k, D, dtype, scale=1.0):
    return (
        randn(B, H, seq_q, D, dtype=dtype, scale=scale).requires_grad_(),
        randn(B, H_kv, seq_k, D, dtype=dtype, scale=scale).requires_grad_(),
        randn(B, H_kv, seq_k, D, dtype=dtype).requires_grad_(),
    )


def grads_of(q, k, v, do, **kw):
    for t in (q, k, v):
        t.grad = None
    attention(q, k, v, **kw).backward(do)
    return q.grad, k.grad, v.grad


# (B, H, H_kv, seq_q, seq_k, D): odd lengths, seq_q < = > seq_k, GQA, head_dim 1…128
SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 4, 2, 7, 7, 16),
    (1, 2, 1, 5, 70, 32),
    (1, 3, 3, 70, 5, 24),
    (1, 2, 1, 37, 65, 64),
    (1, 2, 2, 33, 33, 1),
    (1, 2, 1, 20, 40, 80),
    (1, 1, 1, 17, 19, 128),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gradients_match_float64(shape, causal, dtype, poison_empty):
    B, H, H_kv, seq_q, seq_k, D = shape
    q, k, v = qkv(B, H, H_kv, seq_q, seq_k, D, dtype, scale=2.0)
    do = randn(B, H, seq_q, D, dtype=dtype)
    grads = grads_of(q, k, v, do, causal=causal)
    for g, t in zip(grads, (q, k, v)):
        assert g.dtype == dtype and g.shape == t.shape and g.device == t.device
    assert_grads_within_bound(grads, q, k, v, do, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("seq_q, seq_k", [(40, 40), (10, 70), (70, 30)])
def test_sliding_window(seq_q, seq_k, window, dtype, poison_empty):
    q, k, v = qkv(1, 2, 1, seq_q, seq_k, 32, dtype)
    do = randn(1, 2, seq_q, 32, dtype=dtype)
    grads = grads_of(q, k, v, do, causal=True, window=window)
    assert_grads_within_bound(grads, q, k, v, do, causal=True, window=window)


def test_reference_formula_is_autograd_of_the_reference():
    """dS = P ∘ (dP − D) (normbook.reference.attention_backward) is what float64 autograd
    of the explicit-mask forward gives, masks, GQA and fully masked rows included."""
    for causal, window, seq_q, seq_k in [
        (False, None, 6, 9),
        (True, None, 9, 4),
        ("top_left", None, 5, 8),
        (True, 3, 8, 8),
    ]:
        q, k, v = (
            torch.randn(2, h, s, 5, dtype=torch.float64).requires_grad_()
            for h, s in ((4, seq_q), (2, seq_k), (2, seq_k))
        )
        do = torch.randn(2, 4, seq_q, 5, dtype=torch.float64)
        ref.attention(q, k, v, causal=causal, scale=0.7, window=window).backward(do)
        got = ref.attention_backward(q, k, v, do, causal, 0.7, window)
        for g, t in zip(got, (q, k, v)):
            torch.testing.assert_close(g, t.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_saved_log_sum_exp(dtype, poison_empty):
    """L = m + log ℓ per row, fp32; +inf where a row sees no key (the first 30 of 40
    here).
    """
    q, k, v = (t.detach() for t in qkv(1, 2, 1, 40, 10, 16, dtype, scale=3.0))
    _, _, lse = attention_module._forward(
        q, k, v, "bottom_right", 0.25, None, save_lse=True
    )
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 40)
    exact = ref.attention_lse(q.cpu(), k.cpu(), True, 0.25)
    empty = on_cpu(lse)[..., :30]
    assert bool(torch.isinf(empty).all()) and bool((empty > 0).all())
    # The scores' error δ (as the forward's bound: (D + 4)·2⁻²⁴·scale·Σ|q k| ≲ 1e-5
    # here), the fp32 sum of ≤ 10 exponentials, two roundings of |L| (≲ 10): 1e-5 covers
    # them all; a missing log, a wrong base (log2 instead of ln) or a mask off by one
    # key does not.
    torch.testing.assert_close(
        on_cpu(lse)[..., 30:].double(), exact[..., 30:], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_fully_masked_rows_give_zero_gradients(dtype, poison_empty):
    """Bottom-right with seq_q > seq_k: queries 0…29 see no key. Their output is 0
    whatever q, k, v are, so dq is exactly 0 there and they add nothing to dk and dv;
    never NaN."""
    q, k, v = qkv(1, 2, 1, 40, 10, 16, dtype)
    do = randn(1, 2, 40, 16, dtype=dtype)
    dq, dk, dv = grads_of(q, k, v, do, causal=True)
    assert bool((dq[:, :, :30] == 0).all())
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
    # The empty rows' dO cannot reach dk or dv: changing it changes nothing, bit for
    # bit.
    do2 = do.clone()
    do2[:, :, :30] = randn(1, 2, 30, 16, dtype=dtype) * 100
    dq2, dk2, dv2 = grads_of(q, k, v, do2, causal=True)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2) and torch.equal(dq, dq2)
    assert_grads_within_bound((dq, dk, dv), q, k, v, do, causal=True)


def test_no_keys_or_no_queries(poison_empty):
    q, k, v = qkv(2, 2, 1, 5, 0, 16, torch.float32)
    dq, dk, dv = grads_of(q, k, v, randn(2, 2, 5, 16), causal=True)
    assert bool((dq == 0).all()) and dk.shape == k.shape and dv.shape == v.shape
    q, k, v = qkv(2, 2, 1, 0, 7, 16, torch.float32)
    dq, dk, dv = grads_of(q, k, v, randn(2, 2, 0, 16))
    assert dq.shape == q.shape and bool((dk == 0).all()) and bool((dv == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_bitwise_reproducible(dtype):
    """No atomics: every sum is taken in an order fixed by the code (dK, dV: group heads
    in order, then query tiles in order; dQ: key tiles in order). Two runs, the same
    bits."""
    q, k, v = qkv(1, 4, 1, 37, 45, 32, dtype)
    do = randn(1, 4, 37, 32, dtype=dtype)
    first = [g.clone() for g in grads_of(q, k, v, do, causal=True)]
    second = grads_of(q, k, v, do, causal=True)
    for a, b in zip(first, second):
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits))


def test_gqa_sums_the_group_heads():
    """dk, dv of a k/v head shared by 4 q heads = the sum of the 4 heads' gradients when
    k, v are repeated (SDPA with enable_gqa does the same); fp32, against SDPA's
    backward."""
    q, k, v = qkv(1, 8, 2, 21, 29, 16, torch.float32)
    do = randn(1, 8, 21, 16)
    dq, dk, dv = grads_of(q, k, v, do, causal="top_left")
    kr, vr = (t.detach().repeat_interleave(4, 1).requires_grad_() for t in (k, v))
    q2 = q.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(q2, kr, vr, is_causal=True).backward(do)
    # fp32 on both sides: each within ~1e-6 relative of the exact gradient at these
    # sizes (bound above); a missing or doubled group head is off by ~|dk|/4, far above
    # 1e-4.
    torch.testing.assert_close(dq, q2.grad, rtol=1e-4, atol=1e-5)
    for ours, repeated in ((dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(
            ours, repeated.unflatten(1, (2, 4)).sum(2), rtol=1e-4, atol=1e-5
        )
    assert_grads_within_bound((dq, dk, dv), q, k, v, do, causal="top_left")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_matches_sdpa_backward(dtype):
    """Against PyTorch's own backward in the same dtype (both err by ≈ u·|g| and more;
    8u of the largest gradient covers the two together; a wrong term is off by ~|g|)."""
    q, k, v = qkv(1, 6, 2, 37, 53, 64, dtype)
    do = randn(1, 6, 37, 64, dtype=dtype)
    ours = grads_of(q, k, v, do, causal="top_left")
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True)
    out.backward(do)
    tol = 1e-5 if dtype == torch.float32 else 8 * UNIT_ROUNDOFF[dtype]
    for a, b in zip(ours, (q2.grad, k2.grad, v2.grad)):
        scale = b.abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)


def test_strided_inputs_and_upstream_gradient(poison_empty):
    """(batch, seq, heads, dim) transposed, a slice of a wider buffer, a head_dim with
    stride 2, and a transposed dO: the kernels read them in place, with the same bits as
    contiguous copies (the same tiles, the same order)."""
    B, S, H, D = 2, 19, 4, 32
    q = randn(B, S, H, D).transpose(1, 2).requires_grad_()
    k = randn(B, S, 2, 2 * D)[..., :D].transpose(1, 2).requires_grad_()
    v = randn(B, 2, S, 2 * D)[..., ::2].detach().requires_grad_()
    do = randn(B, S, H, D).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(-1) == 2
    grads = grads_of(q, k, v, do, causal=True)
    assert_grads_within_bound(grads, q, k, v, do, causal=True)
    flat = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    again = grads_of(*flat, do.contiguous(), causal=True)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


def test_scale_argument():
    q, k, v = qkv(1, 2, 2, 9, 11, 16, torch.float32)
    do = randn(1, 2, 9, 16)
    for scale in (0.0, 0.3, -1.5):
        grads = grads_of(q, k, v, do, scale=scale)
        assert_grads_within_bound(grads, q, k, v, do, scale=scale)


def test_hand_calculation():
    """One query, two keys, scale 1: s = (0, ln 3) → p = (1/4, 3/4), v = (4, 8), o = 7.
    With dO = 1: dV = p = (1/4, 3/4); dP = v; D = dO·o = 7; dS = p(dP − D) = (−3/4,
    3/4); dq = dS·k = 3/4 ln 3; dk = dS·q = (−3/4, 3/4)."""
    q = torch.tensor([[[[1.0]]]], device=DEVICE, requires_grad=True)
    k = torch.tensor([[[[0.0], [math.log(3.0)]]]], device=DEVICE, requires_grad=True)
    v = torch.tensor([[[[4.0], [8.0]]]], device=DEVICE, requires_grad=True)
    dq, dk, dv = grads_of(q, k, v, torch.ones(1, 1, 1, 1, device=DEVICE), scale=1.0)
    assert abs(dq.item() - 0.75 * math.log(3.0)) < 1e-6
    assert torch.allclose(on_cpu(dk).flatten(), torch.tensor([-0.75, 0.75]), atol=1e-6)
    assert torch.allclose(on_cpu(dv).flatten(), torch.tensor([0.25, 0.75]), atol=1e-6)


def test_only_the_inputs_that_require_grad_get_one():
    q, k, v = qkv(1, 2, 1, 9, 11, 16, torch.float32)
    do = randn(1, 2, 9, 16)
    full = grads_of(q, k, v, do)
    for wanted in ((True, False, False), (False, True, False), (False, False, True)):
        ts = [t.detach().requires_grad_(w) for t, w in zip((q, k, v), wanted)]
        attention(*ts).backward(do)
        for t, w, g in zip(ts, wanted, full):
            assert (t.grad is None) == (not w)
            if w:
                assert torch.equal(t.grad, g)


def test_backward_never_allocates_the_score_matrix():
    """Every tensor created during forward and backward is counted: q-, k- and v-sized
    gradients, L and D (one number a row), never anything of size seq_q × seq_k."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    size = t.untyped_storage().nbytes()
                    Allocations.biggest = max(Allocations.biggest, size)
            return out

    seq = 256
    q, k, v = qkv(1, 1, 1, seq, seq, 16, torch.float16)
    do = randn(1, 1, seq, 16, dtype=torch.float16)
    with Allocations():
        attention(q, k, v, causal=True).backward(do)
    assert Allocations.biggest <= q.numel() * q.element_size()
    assert Allocations.biggest <= seq * seq * 2 // 4


def test_double_backward_is_refused():
    q, k, v = qkv(1, 1, 1, 4, 4, 16, torch.float32)
    out = attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    # the backward is an operator without a backward of its own: PyTorch refuses
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        dq.sum().backward()


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda q, k, v: attention(q, k.half(), v), TypeError, "k must have q's dtype"),
        (
            lambda q, k, v: attention(q, k, v, causal="bottom"),
            ValueError,
            "causal must be",
        ),
        (
            lambda q, k, v: attention(q, k, v, window=4),
            ValueError,
            "window needs causal",
        ),
        (lambda q, k, v: attention(q, k[:, :, :, :8], v), ValueError, "head_dim"),
    ],
)
def test_bad_arguments_requiring_grad_are_rejected_before_launch(
    monkeypatch, call, exc, words
):
    """With inputs that require grad the same checks run first (the autograd path
    launches through the same _forward, which must never be reached)."""
    q, k, v = qkv(2, 4, 2, 5, 6, 16, torch.float32)
    assert_rejected_before_launch(
        monkeypatch, "attention", lambda: call(q, k, v), exc, words
    )


# ---------------------------------------------------------------- soft-capping


def test_softcap_derivative():
    """d/ds c·tanh(s/c) = 1 − tanh²(s/c) (sympy): the factor the kernels apply to dS,
    dS₀ = dS ∘ (1 − tanh²(S₀/c)), by the chain rule through the cap."""
    import sympy

    s, c = sympy.symbols("s c", positive=True)
    capped = c * sympy.tanh(s / c)
    assert sympy.simplify(sympy.diff(capped, s) - (1 - sympy.tanh(s / c) ** 2)) == 0


def closed_form(**kw):
    """An autograd Function: the reference forward, the reference's closed-form
    backward (the formula the kernels implement)."""

    class Closed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return ref.attention(q, k, v, **kw)

        @staticmethod
        def backward(ctx, dout):
            return ref.attention_backward(*ctx.saved_tensors, dout, **kw)

    return Closed


def test_softcap_reference_formula_is_autograd_and_gradcheck():
    """The closed form the kernels implement (normbook.reference.attention_backward
    with softcap) equals float64 autograd of the capped forward, and passes
    torch.autograd.gradcheck (finite differences, float64) as a Function's backward.
    The kernels take no float64, so their own check is test_softcap_gradcheck_fp32."""
    for causal, window, seq_q, seq_k in [(False, None, 4, 6), (True, 2, 6, 5)]:
        q, k, v = (
            (torch.randn(1, h, n, 3, dtype=torch.float64) * 2).requires_grad_()
            for h, n in ((4, seq_q), (2, seq_k), (2, seq_k))
        )
        do = torch.randn(1, 4, seq_q, 3, dtype=torch.float64)
        kw = dict(causal=causal, scale=0.9, window=window, softcap=1.3)
        ref.attention(q, k, v, **kw).backward(do)
        got = ref.attention_backward(q, k, v, do, causal, 0.9, window, 1.3)
        for g, t in zip(got, (q, k, v)):
            torch.testing.assert_close(g, t.grad, rtol=1e-12, atol=1e-12)
        inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
        assert torch.autograd.gradcheck(closed_form(**kw).apply, inputs)


@pytest.mark.filterwarnings("ignore:Input #.*not a double precision")
def test_softcap_gradcheck_fp32():
    """torch.autograd.gradcheck through the kernels themselves, in fp32 (they take no
    float64): central differences with step 1e-2 err by ~1e-5 (fp32 rounding over the
    step, the step² term); a dropped 1 − tanh² factor (cap 1, |s| ~ 2) is off by ~1."""
    q, k, v = qkv(1, 2, 1, 5, 6, 4, torch.float32, scale=2.0)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, causal=True, softcap=1.0),
        (q, k, v),
        eps=1e-2,
        atol=2e-3,
        rtol=2e-2,
        fast_mode=True,  # uᵀJv for random u, v: a few launches, not one per element
    )


#: (B, H, H_kv, seq_q, seq_k, D): partial tiles on both sides, seq_q < and > seq_k,
#: GQA (dk, dv sum a group); caps 1.5 (saturating: inputs ×2, |s| ~ 4) and 50 (Gemma 2's)
SOFTCAP_SHAPES = [(1, 4, 2, 20, 45, 16), (1, 2, 2, 37, 9, 32)]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("softcap", [1.5, 50.0])
@pytest.mark.parametrize("shape", SOFTCAP_SHAPES, ids=str)
def test_softcap_gradients_match_float64(shape, softcap, causal, dtype, poison_empty):
    B, H, H_kv, seq_q, seq_k, D = shape
    q, k, v = qkv(B, H, H_kv, seq_q, seq_k, D, dtype, scale=2.0)
    do = randn(B, H, seq_q, D, dtype=dtype)
    grads = grads_of(q, k, v, do, causal=causal, softcap=softcap)
    assert_grads_within_bound(grads, q, k, v, do, causal=causal, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7])
def test_softcap_with_window(window, dtype, poison_empty):
    q, k, v = qkv(1, 2, 1, 30, 40, 16, dtype, scale=3.0)
    do = randn(1, 2, 30, 16, dtype=dtype)
    kw = dict(causal=True, window=window, softcap=2.0, scale=0.3)
    assert_grads_within_bound(grads_of(q, k, v, do, **kw), q, k, v, do, **kw)
