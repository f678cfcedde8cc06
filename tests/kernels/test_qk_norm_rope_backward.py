"""The backward pass of normbook.qk_norm_rope (Triton kernels behind torch.autograd) against the
float64 reference (normbook.reference.qk_norm_rope) differentiated by torch's autograd, and
torch.autograd.gradcheck through the kernels.

Tolerance (see backward_helpers for the general argument). Per head, with x̂ = x·rstd,
RoPE's transpose gives dy₁ = do₁·cos₁ + do₂·sin₂ and dy₂ = do₂·cos₂ − do₁·sin₁, then
g = γ ⊙ dy and dx = rstd·(g − x̂·mean(x̂ ⊙ g)), dγ = Σ_rows dy ⊙ x̂. The kernel computes this in
fp32 from the same (already rounded) inputs as the float64 reference, so each element errs by
about 2**-24·log2(d) times the sum of the absolute values of its terms, far below
1e-5·scale, with scale = rstd·(|γ|·t + |x̂|·mean(|x̂|·|γ|·t)) for dx, t = |do₁ cos₁| + |do₂ sin₂|
(and likewise for the second half), and Σ_rows t·|x̂| for dγ; then one rounding to the
gradient's dtype (u·|ref|). The forward's roundings of x̂ and y do not enter: the gradient is
that of the formula at the given inputs, as for every kernel of the book. A wrong sign in the
rotation's transpose, or a missing head in the sum, is off by O(scale) and trips this bound.
"""

import importlib

import pytest
import torch
from backward_helpers import assert_grad_close
from conftest import LOW_PRECISION, randn

from normbook import DEVICE, qk_norm_rope
from normbook import reference as ref

qk_bwd = importlib.import_module("normbook.qk_norm_rope_backward")
EPS = 1e-6


def cos_sin(B, S, D, dtype, offset=0):
    positions = (torch.arange(B * S).view(B, S) * 7 + offset).double()
    return tuple(t.to(DEVICE, dtype) for t in ref.rope_cos_sin(positions, D))


def leaf(t):
    return None if t is None else t.detach().requires_grad_()


def run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out):
    q, k, qw, kw = leaf(q), leaf(k), leaf(qw), leaf(kw)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, EPS)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    return (
        q.grad,
        k.grad,
        (None if qw is None else qw.grad),
        (None if kw is None else kw.grad),
    )


def reference_grads(x, w, cos, sin, do):
    """Autograd of the float64 formula for one of q, k, and the scale of each gradient's terms."""
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = None if w is None else w.detach().cpu().double().requires_grad_()
    c, s, do = cos.cpu().double(), sin.cpu().double(), do.detach().cpu().double()
    ref.apply_rope(ref.rms_norm(x64, w64, EPS), c, s).backward(do)
    c, s = c[:, :, None, :], s[:, :, None, :]
    half = x.shape[-1] // 2
    # |terms| of RoPE's transpose: |do₁ cos₁| + |do₂ sin₂| and |do₂ cos₂| + |do₁ sin₁|.
    t = (do * c).abs() + (ref.rotate_half(do) * s).abs()
    xd = x.detach().cpu().double()
    rstd = 1.0 / ref.rms(xd, EPS)
    xhat = (xd * rstd).abs()
    gw = t if w is None else t * w.detach().cpu().double().abs()
    dx_scale = rstd * (gw + xhat * (xhat * gw).mean(-1, keepdim=True))
    dw_scale = (t * xhat).reshape(-1, x.shape[-1]).sum(0)
    assert half * 2 == x.shape[-1]
    return x64.grad, (None if w is None else w64.grad), dx_scale, dw_scale


def check(got, q, k, qw, kw, cos, sin, dq_out, dk_out, dtype):
    for i, (x, w, do, name) in enumerate([(q, qw, dq_out, "q"), (k, kw, dk_out, "k")]):
        dx_r, dw_r, sx, sw = reference_grads(x, w, cos, sin, do)
        assert_grad_close(got[i], dx_r, sx, dtype, f"d{name}")
        if w is None:
            assert got[2 + i] is None
        else:
            assert_grad_close(got[2 + i], dw_r, sw, w.dtype, f"d{name}_weight")


def make(B, S, Hq, Hk, D, dtype, weight=True):
    q = randn(B, S, Hq, D, dtype=dtype, scale=3.0)
    k = randn(B, S, Hk, D, dtype=dtype)
    qw = randn(D, dtype=dtype) if weight else None
    kw = randn(D, dtype=dtype) if weight else None
    cos, sin = cos_sin(B, S, D, dtype)
    return q, k, qw, kw, cos, sin


# ------------------------------------------------------------------ gradcheck in float64


@pytest.mark.parametrize("weight", [True, False])
def test_gradcheck_float64(weight):
    """Finite differences against the analytic backward, every input that requires grad."""
    q, k, qw, kw, cos, sin = make(1, 2, 2, 1, 6, torch.float64, weight)
    args = tuple(leaf(t) for t in (q, k, qw, kw) if t is not None)

    def f(*a):
        if weight:
            return qk_norm_rope(*a, cos, sin, EPS)
        return qk_norm_rope(a[0], a[1], None, None, cos, sin, EPS)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------ low precision vs the float64 reference


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("head_dim", [6, 64, 80, 128])
def test_gradients_match_autograd_of_reference(dtype, head_dim, poison_empty):
    """head_dim 6 and 80 (halves of 3 and 40) exercise the masked columns; 64, 128 are real models'."""
    q, k, qw, kw, cos, sin = make(2, 3, 4, 2, head_dim, dtype)
    dq_out, dk_out = randn(*q.shape, dtype=dtype), randn(*k.shape, dtype=dtype)
    got = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    check(got, q, k, qw, kw, cos, sin, dq_out, dk_out, dtype)


@pytest.mark.parametrize(
    "n_heads, n_kv_heads", [(1, 1), (4, 1), (6, 3), (8, 2), (2, 4)]
)
def test_gqa_ratios(n_heads, n_kv_heads):
    """Every ratio of query to key heads (and more k heads than q heads, which the kernel allows)."""
    q, k, qw, kw, cos, sin = make(2, 3, n_heads, n_kv_heads, 16, torch.float32)
    dq_out, dk_out = randn(*q.shape), randn(*k.shape)
    got = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    check(got, q, k, qw, kw, cos, sin, dq_out, dk_out, torch.float32)


def test_without_weights_and_fp32_weights_with_bf16_activations():
    q, k, _, _, cos, sin = make(1, 4, 2, 1, 32, torch.bfloat16, weight=False)
    dq_out, dk_out = (
        randn(*q.shape, dtype=torch.bfloat16),
        randn(*k.shape, dtype=torch.bfloat16),
    )
    got = run_backward(q, k, None, None, cos, sin, dq_out, dk_out)
    check(got, q, k, None, None, cos, sin, dq_out, dk_out, torch.bfloat16)
    qw, kw = randn(32), randn(32)  # fp32 weights: their gradients come back in fp32
    got = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    assert got[2].dtype == got[3].dtype == torch.float32
    check(got, q, k, qw, kw, cos, sin, dq_out, dk_out, torch.bfloat16)


# ------------------------------------------------------------------ layouts


def test_views_of_a_fused_qkv_projection_and_broadcast_upstream_grads():
    """q, k as strided views of one qkv buffer; upstream grads with stride 0 (from .sum() and
    from an expand over the batch): each read in place, same bits as contiguous copies."""
    B, S, Hq, Hk, D = 2, 3, 4, 2, 32
    qkv = randn(B, S, (Hq + 2 * Hk) * D, dtype=torch.bfloat16).requires_grad_()
    q = qkv[..., : Hq * D].view(B, S, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, S, Hk, D)
    assert not q.is_contiguous()
    qw, kw = randn(D, dtype=torch.bfloat16), randn(D, dtype=torch.bfloat16)
    cos, sin = cos_sin(1, S, D, torch.bfloat16)  # a batch of 1, broadcast
    dq_out = randn(1, S, Hq, D, dtype=torch.bfloat16).expand(
        B, S, Hq, D
    )  # stride 0 over batch
    dk_out = torch.ones(1, dtype=torch.bfloat16, device=DEVICE).expand(
        B, S, Hk, D
    )  # all stride 0
    got = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    want = run_backward(
        q.contiguous(),
        k.contiguous(),
        qw,
        kw,
        cos.expand(B, S, D).contiguous(),
        sin.expand(B, S, D).contiguous(),
        dq_out.contiguous(),
        dk_out.contiguous(),
    )
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    check(
        got,
        q,
        k,
        qw,
        kw,
        cos.expand(B, S, D),
        sin.expand(B, S, D),
        dq_out,
        dk_out,
        torch.bfloat16,
    )
    # Through the view: the gradient lands in qkv's q and k columns, v's columns get zeros.
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    assert torch.equal(qkv.grad[..., : Hq * D].view(B, S, Hq, D), got[0])
    assert torch.equal(
        qkv.grad[..., (Hq + Hk) * D :], torch.zeros_like(qkv.grad[..., (Hq + Hk) * D :])
    )


def test_loss_of_sum_gives_stride_zero_grads():
    q, k, qw, kw, cos, sin = make(1, 3, 2, 1, 16, torch.float32)
    q, k, qw, kw = leaf(q), leaf(k), leaf(qw), leaf(kw)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin, EPS)
    (q_out.sum() + 2 * k_out.sum()).backward()
    ones = torch.ones_like(q_out)
    check(
        (q.grad, k.grad, qw.grad, kw.grad),
        q,
        k,
        qw,
        kw,
        cos,
        sin,
        ones,
        2 * torch.ones_like(k_out),
        torch.float32,
    )


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize(
    "shape_q, shape_k", [((0, 3, 2, 8), (0, 3, 1, 8)), ((1, 3, 0, 8), (1, 3, 2, 8))]
)
def test_empty_inputs(shape_q, shape_k):
    """M = 0: empty dx, and weight gradients that are empty sums (zeros)."""
    q, k = (
        leaf(torch.randn(shape_q, device=DEVICE)),
        leaf(torch.randn(shape_k, device=DEVICE)),
    )
    qw, kw = leaf(torch.randn(8, device=DEVICE)), leaf(torch.randn(8, device=DEVICE))
    cos = torch.ones(shape_q[0], shape_q[1], 8, device=DEVICE)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, torch.zeros_like(cos))
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == shape_q and k.grad.shape == shape_k
    assert torch.equal(qw.grad, torch.zeros(8, device=DEVICE))
    if k.numel():
        assert torch.count_nonzero(kw.grad) > 0  # k's rows still contribute


def test_weight_gradients_are_deterministic():
    """Two runs, same bits: dγ is summed in a fixed order (no atomics), with several programs."""
    q, k, qw, kw, cos, sin = make(3, 8, 4, 2, 128, torch.bfloat16)
    dq_out, dk_out = (
        randn(*q.shape, dtype=torch.bfloat16),
        randn(*k.shape, dtype=torch.bfloat16),
    )
    a = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    b = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    cfg = qk_bwd._backward_config(128)
    assert (
        qk_bwd.num_partials(-(-q.shape[0] * q.shape[1] * q.shape[2] // cfg.BLOCK_M)) > 1
    )


def test_only_the_inputs_that_require_grad_get_one():
    q, k, qw, kw, cos, sin = make(1, 2, 2, 1, 16, torch.float32)
    q = leaf(q)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cos, sin)
    assert q_out.grad_fn is not None
    q_out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    kw = leaf(kw)
    _, k_out = qk_norm_rope(q.detach(), k, qw, kw, cos, sin)
    k_out.sum().backward()
    assert kw.grad is not None


def test_cos_sin_that_require_grad_are_refused_not_dropped():
    q, k, qw, kw, cos, sin = make(1, 2, 2, 1, 16, torch.float32)
    for name in ("cos", "sin"):
        args = dict(cos=cos, sin=sin)
        args[name] = leaf(args[name])
        with pytest.raises(ValueError, match=f"{name} requires grad"):
            qk_norm_rope(leaf(q), k, qw, kw, **args)
        with torch.no_grad():  # no graph: nothing to drop, so it runs
            qk_norm_rope(q, k, qw, kw, **args)


def test_batch_invariance():
    """A sequence alone (batch 1) and inside a batch of three: identical bits for q', k' and the
    input gradients (tiles are chosen from head_dim alone, never from the number of rows)."""
    q, k, qw, kw, cos, sin = make(3, 5, 4, 2, 64, torch.bfloat16)
    dq_out, dk_out = (
        randn(*q.shape, dtype=torch.bfloat16),
        randn(*k.shape, dtype=torch.bfloat16),
    )
    many = run_backward(q, k, qw, kw, cos, sin, dq_out, dk_out)
    outs = qk_norm_rope(q, k, qw, kw, cos, sin, EPS)
    for b in range(3):
        one = run_backward(
            q[b : b + 1],
            k[b : b + 1],
            qw,
            kw,
            cos[b : b + 1],
            sin[b : b + 1],
            dq_out[b : b + 1],
            dk_out[b : b + 1],
        )
        assert torch.equal(one[0], many[0][b : b + 1]) and torch.equal(
            one[1], many[1][b : b + 1]
        )
        alone = qk_norm_rope(
            q[b : b + 1], k[b : b + 1], qw, kw, cos[b : b + 1], sin[b : b + 1], EPS
        )
        assert torch.equal(alone[0], outs[0][b : b + 1]) and torch.equal(
            alone[1], outs[1][b : b + 1]
        )
