"""The backward pass of normbook.layer_norm (Triton kernels behind torch.autograd) against the float64
reference differentiated by torch's autograd, and torch.autograd.gradcheck through the kernels.

Tolerance: see backward_helpers. For LayerNorm the terms of dx = rstd·(g − mean(g) − x̂·mean(g ⊙ x̂))
are |g_j|, mean|g| and a_j·mean(|g|·a), where a_j = |x̂_j| + rstd·max|x| bounds x̂_j together with
its own fp32 error: the fp32 mean errs by about (log2 N + 1)·2**-24·max|x|, and x̂ = (x − μ)·rstd
inherits that as an absolute error (it does not shrink with |x − μ|; it matters when |μ| ≫ σ).
"""

import importlib

import pytest
import torch
from backward_helpers import NORM_BACKWARD_CASES, assert_grad_close
from conftest import LOW_PRECISION, nothing_saved, randn
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import layer_norm
from normbook import reference as ref

ln_mod = importlib.import_module(
    "normbook.layer_norm"
)  # the module, not the function of the same name
ln_bwd = importlib.import_module("normbook.layer_norm_backward")


def rows_for(n):
    return 2 if n > 100_000 else 5


def reference_grads(x, w, b, dy, eps):
    """Autograd of the float64 formula, plus the size of the terms each gradient is built from."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    ref.layer_norm(x64, w64, b64, eps).backward(dy.double())
    xd, dy64 = x.detach().double(), dy.double()
    rstd = 1.0 / torch.sqrt(ref.variance(xd) + eps)
    xhat = (xd - ref.mean(xd)) * rstd
    a = xhat.abs() + rstd * xd.abs().amax(-1, keepdim=True)
    g = dy64 if w is None else dy64 * w.double()
    dx_scale = rstd * (
        g.abs()
        + g.abs().mean(-1, keepdim=True)
        + a * (g.abs() * a).mean(-1, keepdim=True)
    )
    n = x.shape[-1]
    dw_scale = (dy64.abs() * a).reshape(-1, n).sum(0)
    db_scale = dy64.abs().reshape(-1, n).sum(0)
    grads = (x64.grad, None if w is None else w64.grad, None if b is None else b64.grad)
    return grads, (dx_scale, dw_scale, db_scale)


def run_backward(x, w, b, dy, eps):
    x = x.detach().requires_grad_()
    w = None if w is None else w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    layer_norm(x, w, b, eps).backward(dy)
    return x.grad, (None if w is None else w.grad), (None if b is None else b.grad)


def check_all(got, x, w, b, dy, eps, dtype, w_dtype=None):
    (dx_r, dw_r, db_r), (sx, sw, sb) = reference_grads(x, w, b, dy, eps)
    assert_grad_close(got[0], dx_r, sx, dtype, "dx")
    if w is not None:
        assert_grad_close(got[1], dw_r, sw, w_dtype or dtype, "dweight")
    else:
        assert got[1] is None
    if b is not None:
        assert_grad_close(got[2], db_r, sb, w_dtype or dtype, "dbias")
    else:
        assert got[2] is None


@pytest.mark.parametrize("n,dtype", NORM_BACKWARD_CASES)
def test_gradients_match_autograd_of_reference(dtype, n, poison_empty):
    """dx, dγ, dβ for fp32/fp16/bf16, one-block rows and rows wider than a block (4097 in every
    dtype; 262147 in fp32, 33001 in fp16 and bf16: NORM_BACKWARD_CASES)."""
    m = rows_for(n)
    x = (randn(m, n, scale=3.0) + 2.0).to(
        dtype
    )  # a nonzero mean, so that centering matters
    w, b, dy = randn(n, dtype=dtype), randn(n, dtype=dtype), randn(m, n, dtype=dtype)
    check_all(run_backward(x, w, b, dy, 1e-5), x, w, b, dy, 1e-5, dtype)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("has_w, has_b", [(False, False), (True, False), (False, True)])
def test_weight_and_bias_are_optional(dtype, has_w, has_b):
    x, dy = randn(2, 3, 4, 33, dtype=dtype), randn(2, 3, 4, 33, dtype=dtype)
    w = randn(33, dtype=dtype) if has_w else None
    b = randn(33, dtype=dtype) if has_b else None
    check_all(run_backward(x, w, b, dy, 1e-5), x, w, b, dy, 1e-5, dtype)


def test_parameters_in_another_dtype_get_their_own_dtype():
    x, dy = randn(6, 40, dtype=torch.bfloat16), randn(6, 40, dtype=torch.bfloat16)
    w, b = randn(40), randn(40)
    got = run_backward(x, w, b, dy, 1e-5)
    check_all(got, x, w, b, dy, 1e-5, torch.bfloat16, w_dtype=torch.float32)


def test_large_common_offset():
    """x = 1e4 + N(0, 1): x̂ carries the fp32 mean's absolute error; the bound accounts for it."""
    x, dy, w = 1e4 + randn(4, 300), randn(4, 300), randn(300)
    check_all(run_backward(x, w, None, dy, 1e-5), x, w, None, dy, 1e-5, torch.float32)


def test_gradcheck_float64_through_the_kernels():
    """Finite differences of the kernel's own forward against its backward, in float64."""
    x = randn(3, 7, dtype=torch.float64).requires_grad_()
    w = randn(7, dtype=torch.float64).requires_grad_()
    b = randn(7, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, c, d: layer_norm(a, c, d, 1e-5), (x, w, b)
    )
    assert torch.autograd.gradcheck(lambda a: layer_norm(a, None, None, 1e-5), (x,))


def test_gradcheck_float64_wide_rows_fast_mode():
    """A float64 row of 8200 elements (> 64 KiB) takes the two-sweep path (fast gradcheck: uᵀJv)."""
    x = randn(2, 8200, dtype=torch.float64).requires_grad_()
    w = randn(8200, dtype=torch.float64).requires_grad_()
    b = randn(8200, dtype=torch.float64).requires_grad_()
    assert not ln_bwd.backward_plan(2, 8200, 8, 2, 2).single.SINGLE_BLOCK
    assert torch.autograd.gradcheck(
        lambda a, c, d: layer_norm(a, c, d, 1e-5), (x, w, b), fast_mode=True
    )


def test_only_the_gradients_asked_for():
    x, w, b, dy = randn(4, 9), randn(9), randn(9), randn(4, 9)
    (dx_r, dw_r, db_r), (sx, sw, sb) = reference_grads(x, w, b, dy, 1e-5)
    bg = b.clone().requires_grad_()
    layer_norm(x, w, bg).backward(dy)  # only the bias trains
    assert_grad_close(bg.grad, db_r, sb, torch.float32, "dbias")
    wg = w.clone().requires_grad_()
    layer_norm(x, wg, b).backward(dy)
    assert_grad_close(wg.grad, dw_r, sw, torch.float32, "dweight")
    xg = x.clone().requires_grad_()
    layer_norm(xg, w, b).backward(dy)
    assert_grad_close(xg.grad, dx_r, sx, torch.float32, "dx")


@pytest.mark.parametrize("shape", [(0, 16), (0,), (2, 0, 5), (3, 0)])
def test_empty_inputs(shape):
    """M = 0 (or N = 0): dx is empty and dγ, dβ, empty sums, are zero."""
    n = shape[-1]
    x = torch.empty(shape).requires_grad_()
    w, b = torch.ones(n).requires_grad_(), torch.ones(n).requires_grad_()
    y = layer_norm(x, w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros(n)) and torch.equal(b.grad, torch.zeros(n))


def test_strided_inputs_and_gradients():
    base = randn(6, 1037).requires_grad_()
    x = base[:, 5:1005]
    w, b = randn(1000).requires_grad_(), randn(1000).requires_grad_()
    dy = randn(6, 2000)[:, ::2]
    layer_norm(x, w, b).backward(dy)
    (dx_r, dw_r, db_r), (sx, sw, sb) = reference_grads(x, w, b, dy, 1e-5)
    assert_grad_close(base.grad[:, 5:1005], dx_r, sx, torch.float32, "dx")
    assert torch.equal(base.grad[:, :5], torch.zeros(6, 5))
    assert_grad_close(w.grad, dw_r, sw, torch.float32, "dweight")
    assert_grad_close(b.grad, db_r, sb, torch.float32, "dbias")

    xt = randn(64, 9).t().requires_grad_()
    dy = randn(9, 64)
    layer_norm(xt).backward(dy)
    (dx_r, _, _), (sx, _, _) = reference_grads(xt, None, None, dy, 1e-5)
    assert_grad_close(xt.grad, dx_r, sx, torch.float32, "dx (transposed x)")


def test_broadcast_upstream_gradient():
    """y.sum().backward() hands the kernel an expanded dy with row stride 0."""
    x, w, b = randn(5, 33), randn(33), randn(33)
    got = run_backward(x, w, b, torch.ones(5, 33).expand(5, 33), 1e-5)
    check_all(got, x, w, b, torch.ones(5, 33), 1e-5, torch.float32)


@pytest.mark.parametrize(
    "dtype, m, n", [(torch.bfloat16, 64, 300), (torch.float32, 9, 20000)]
)
def test_parameter_gradients_are_bitwise_deterministic(dtype, m, n):
    x, w, b, dy = (
        randn(m, n, dtype=dtype),
        randn(n, dtype=dtype),
        randn(n, dtype=dtype),
        randn(m, n, dtype=dtype),
    )
    first = run_backward(x, w, b, dy, 1e-5)
    for _ in range(2):
        again = run_backward(x, w, b, dy, 1e-5)
        assert all(torch.equal(a, f) for a, f in zip(again, first))


def test_no_grad_path_saves_nothing():
    x, w, b = randn(4, 50), randn(50), randn(50)
    with_grad = layer_norm(x, w, b.clone().requires_grad_())
    assert with_grad.grad_fn is not None
    with nothing_saved():
        y = layer_norm(x, w, b)
        with torch.no_grad():
            y_ng = layer_norm(x.clone().requires_grad_(), w, b)
    assert y.grad_fn is None and y_ng.grad_fn is None
    assert torch.equal(y, with_grad.detach()) and torch.equal(y_ng, y)


def test_length_one_rows_have_zero_dx():
    """N = 1: x̂ = 0 whatever x, so y = β does not depend on x."""
    dx, dw, db = run_backward(randn(5, 1), randn(1), randn(1), randn(5, 1), 1e-5)
    assert torch.equal(dx, torch.zeros(5, 1)) and torch.equal(dw, torch.zeros(1))


def test_nan_stays_in_its_row():
    x, dy = randn(4, 7), randn(4, 7)
    x[1, 3] = float("nan")
    dx, _, _ = run_backward(x, None, None, dy, 1e-5)
    assert torch.isnan(dx[1]).all()
    assert torch.isfinite(dx[[0, 2, 3]]).all()


def test_bad_arguments_are_rejected_before_autograd(monkeypatch):
    monkeypatch.setattr(ln_mod, "_forward", lambda *a, **k: pytest.fail("launched"))
    x = torch.ones(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, None, torch.ones(5, requires_grad=True))
    with pytest.raises(TypeError, match="eps must be a real number"):
        layer_norm(x, eps="1e-5")


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 3),
    n=st.integers(2, 200),
    shift=st.floats(-10, 10),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_gradient_is_centered_and_orthogonal_to_xhat(m, n, shift, seed):
    """J·1 = 0 (shift invariance) gives Σ_j dx_j = 0 for any ε; with ε = 0, J·(x − μ) = 0 (scale
    invariance) gives x̂·dx = 0. Each dx_j errs by at most 1e-5·scale_j + 2**-24·|dx_j| (see the
    module docstring), so the sums are held to twice the sum of those bounds, weighted by |x̂_j|."""
    g = torch.Generator().manual_seed(seed)
    x = randn(m, n, generator=g) + shift
    dy, w = randn(m, n, generator=g), randn(n, generator=g)
    dx, _, _ = run_backward(x, w, None, dy, 0.0)
    _, (sx, _, _) = reference_grads(x, w, None, dy, 0.0)
    xd, dxd = x.double(), dx.double()
    xhat = (xd - xd.mean(-1, keepdim=True)) / xd.std(-1, unbiased=False, keepdim=True)
    per_element = 1e-5 * sx + 2.0**-24 * dxd.abs()
    assert bool((dxd.sum(-1).abs() <= 2 * per_element.sum(-1)).all())
    assert bool(
        (
            (xhat * dxd).sum(-1).abs() <= 2 * ((1 + xhat.abs()) * per_element).sum(-1)
        ).all()
    )


def test_the_backward_cases_reach_every_path():
    """NORM_BACKWARD_CASES (backward_helpers) runs LayerNorm's paths in every dtype: the
    one-kernel backward, the column sweeps, the looped forward (whose mean and rstd the
    backward reads): 4097 in fp32, 33,001 in fp16 and bf16, 262,147 in fp32."""
    rows = {(p.values[0], p.values[1]) for p in NORM_BACKWARD_CASES}
    widest = {dt: max(n for n, d in rows if d == dt) for dt in LOW_PRECISION}
    for dt in LOW_PRECISION:
        size = torch.tensor([], dtype=dt).element_size()
        assert (
            ln_bwd.backward_plan(5, 1000, size, 2, 2).cols is None
            and (1000, dt) in rows
        )
        assert ln_bwd.backward_plan(5, 4097, size, 2, 2).cols is not None
        assert not ln_mod.forward_config(widest[dt], size).SINGLE_BLOCK
    assert (
        ln_mod.forward_config(4097, 2).SINGLE_BLOCK and widest[torch.float16] == 33001
    )
