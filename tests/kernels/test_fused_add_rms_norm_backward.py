"""The backward of normbook.fused_add_rms_norm against autograd of the float64 reference.

With ḡ_y, ḡ_h the gradients reaching y and h = x + r: dx = dr = vjp_RMSNorm(ḡ_y) + ḡ_h and
dγ = Σ_rows ḡ_y ⊙ ĥ. The kernel is rms_norm's backward on the saved h (plus ḡ_h, added in fp32
before the one rounding of dx), so its tolerance is rms_norm's (backward_helpers.py) with the
size of ḡ_h added to the terms' scale: one more fp32 addition, relative error 2**-24 of it.
The reference differentiates the formula at the stored h: rounding h is a forward detail that
autograd of the unfused code also treats as the identity.
"""

import pytest
import torch
from backward_helpers import NORM_BACKWARD_CASES, assert_grad_close
from conftest import randn

from normbook import fused_add_rms_norm
from normbook import reference as ref


def rows_for(n):
    return 2 if n > 100_000 else 5


def reference_grads(h, w, dy, dh, eps, offset=0.0):
    """Autograd of the float64 formula at the stored h, plus the scale of each gradient's terms."""
    h64 = h.detach().cpu().double().requires_grad_()
    w64 = None if w is None else w.detach().cpu().double().requires_grad_()
    y64 = ref.rms_norm(h64, w64, eps, offset)
    loss = (y64 * dy.cpu().double()).sum()
    if dh is not None:
        loss = loss + (h64 * dh.cpu().double()).sum()
    loss.backward()
    rstd = torch.rsqrt(h64.detach().pow(2).mean(-1, keepdim=True) + eps)
    hhat = h64.detach() * rstd
    dy64 = dy.cpu().double()
    g = dy64 if w is None else dy64 * (offset + w.cpu().double())
    dx_scale = rstd * (g.abs() + hhat.abs() * (hhat * g).abs().mean(-1, keepdim=True))
    if dh is not None:
        dx_scale = dx_scale + dh.cpu().double().abs()
    dw_scale = (dy64 * hhat).abs().reshape(-1, h.shape[-1]).sum(0)
    return h64.grad, (None if w is None else w64.grad), dx_scale, dw_scale


def run_backward(x, r, w, dy, dh, eps=1e-6, **kw):
    x, r = x.detach().requires_grad_(), r.detach().requires_grad_()
    w = None if w is None else w.detach().requires_grad_()
    y, h = fused_add_rms_norm(x, r, w, eps, **kw)
    assert y.grad_fn is not None and h.grad_fn is not None
    outs, grads = [y], [dy]
    if dh is not None:
        outs.append(h)
        grads.append(dh)
    torch.autograd.backward(outs, grads)
    return x.grad, r.grad, (None if w is None else w.grad), h.detach()


@pytest.mark.parametrize("n,dtype", NORM_BACKWARD_CASES)
def test_gradients_match_autograd_of_reference(dtype, n, poison_empty):
    """dx, dr and dγ through both outputs; one-block rows and rows wider than a block."""
    m = rows_for(n)
    x, r = randn(m, n, dtype=dtype, scale=2.0), randn(m, n, dtype=dtype, scale=2.0)
    w, dy, dh = (
        randn(n, dtype=dtype),
        randn(m, n, dtype=dtype),
        randn(m, n, dtype=dtype),
    )
    dx, dr, dw, h = run_backward(x, r, w, dy, dh)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(h, w, dy, dh, 1e-6)
    assert_grad_close(dx, dx_ref, dx_scale, dtype, "dx")
    assert_grad_close(dr, dx_ref, dx_scale, dtype, "dresidual")
    assert_grad_close(dw, dw_ref, dw_scale, dtype, "dweight")


def test_only_y_used_and_only_h_used():
    x, r, w, dy = randn(4, 50), randn(4, 50), randn(50), randn(4, 50)
    dx, dr, dw, h = run_backward(x, r, w, dy, None)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(h, w, dy, None, 1e-6)
    assert_grad_close(dx, dx_ref, dx_scale, torch.float32, "dx")
    assert torch.equal(dx, dr)
    assert_grad_close(dw, dw_ref, dw_scale, torch.float32, "dweight")
    # h alone: its gradient passes to x and residual unchanged, and dγ is zero
    xg, rg, wg = (
        x.clone().requires_grad_(),
        r.clone().requires_grad_(),
        w.clone().requires_grad_(),
    )
    _, h = fused_add_rms_norm(xg, rg, wg)
    dh = randn(4, 50)
    h.backward(dh)
    assert torch.equal(xg.grad, dh) and torch.equal(rg.grad, dh)
    assert torch.equal(wg.grad.cpu(), torch.zeros(50))


def test_gradcheck_float64_through_the_kernels():
    x, r = randn(3, 7, dtype=torch.float64), randn(3, 7, dtype=torch.float64)
    w = randn(7, dtype=torch.float64)
    args = tuple(t.requires_grad_() for t in (x, r, w))
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused_add_rms_norm(a, b, c, 1e-6), args
    )
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused_add_rms_norm(
            a, b, c, 1e-6, offset=1.0, casting_mode="gemma"
        ),
        args,
    )
    assert torch.autograd.gradcheck(
        lambda a, b: fused_add_rms_norm(a, b, None, 0.0), args[:2]
    )


def test_gradcheck_float64_wide_rows_fast_mode():
    n = 8200  # > 64 KiB of float64: the two-sweep path
    args = tuple(
        randn(*s, dtype=torch.float64).requires_grad_() for s in [(2, n), (2, n), (n,)]
    )
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused_add_rms_norm(a, b, c, 1e-6), args, fast_mode=True
    )


def test_strided_and_broadcast_upstream_gradients():
    """x and r strided slices of wider buffers, dy strided, dh expanded (row stride 0)."""
    bx, br = randn(6, 1037).requires_grad_(), randn(6, 1100).requires_grad_()
    x, r = bx[:, 5:1005], br[:, 90:1090]
    w = randn(1000).requires_grad_()
    y, h = fused_add_rms_norm(x, r, w)
    dy = randn(6, 2000)[:, ::2]
    dh = randn(1000).expand(6, 1000)
    torch.autograd.backward([y, h], [dy, dh])
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(h, w, dy, dh, 1e-6)
    assert_grad_close(bx.grad[:, 5:1005], dx_ref, dx_scale, torch.float32, "dx")
    assert_grad_close(br.grad[:, 90:1090], dx_ref, dx_scale, torch.float32, "dresidual")
    assert torch.equal(bx.grad[:, :5].cpu(), torch.zeros(6, 5))
    assert_grad_close(w.grad, dw_ref, dw_scale, torch.float32, "dweight")
    # y.sum() + h.sum(): both upstream gradients are expanded ones
    x2, r2, w2 = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y2, h2 = fused_add_rms_norm(x2, r2, w2)
    (y2.sum() + h2.sum()).backward()
    ones = torch.ones(6, 1000)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(h2, w2, ones, ones, 1e-6)
    assert_grad_close(x2.grad, dx_ref, dx_scale, torch.float32, "dx (broadcast)")
    assert_grad_close(w2.grad, dw_ref, dw_scale, torch.float32, "dweight (broadcast)")


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 5), (3, 0)])
def test_empty_inputs(shape):
    """M = 0 (or N = 0): dx and dr are empty, dγ (an empty sum) is zero; the graph is kept."""
    n = shape[-1]
    x, r = torch.empty(shape).requires_grad_(), torch.empty(shape).requires_grad_()
    w = torch.ones(n).requires_grad_()
    y, h = fused_add_rms_norm(x, r, w)
    assert y.grad_fn is not None and y.shape == h.shape == x.shape
    (y.sum() + h.sum()).backward()
    assert x.grad.shape == r.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros(n))


@pytest.mark.parametrize(
    "dtype, m, n", [(torch.bfloat16, 64, 300), (torch.float32, 9, 20000)]
)
def test_dweight_is_bitwise_deterministic(dtype, m, n):
    x, r, w = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype), randn(n, dtype=dtype)
    dy, dh = randn(m, n, dtype=dtype), randn(m, n, dtype=dtype)
    first = run_backward(x, r, w, dy, dh)
    again = run_backward(x, r, w, dy, dh)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_equals_autograd_of_the_unfused_kernels():
    """Same kernel, same inputs: the fused backward equals rms_norm's backward on x + r, plus dh."""
    from normbook import rms_norm

    x, r, w = (
        randn(5, 333, dtype=torch.bfloat16),
        randn(5, 333, dtype=torch.bfloat16),
        randn(333),
    )
    dy = randn(5, 333, dtype=torch.bfloat16)
    dx, dr, dw, h = run_backward(x, r, w, dy, None)
    hg, wg = (x + r).requires_grad_(), w.clone().requires_grad_()
    rms_norm(hg, wg).backward(dy)
    assert torch.equal(dx, hg.grad) and torch.equal(dw, wg.grad)
