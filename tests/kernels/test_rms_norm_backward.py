"""The backward pass of normbook.rms_norm (Triton kernels behind torch.autograd) against the float64
reference differentiated by torch's autograd, and torch.autograd.gradcheck through the kernels."""

import importlib

import pytest
import torch
from backward_helpers import NORM_BACKWARD_CASES, assert_grad_close
from conftest import LOW_PRECISION, nothing_saved, randn
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import reference as ref
from normbook import rms_norm

rms_mod = importlib.import_module(
    "normbook.rms_norm"
)  # the module, not the function of the same name
rms_bwd = importlib.import_module("normbook.rms_norm_backward")


def rows_for(n):
    return 2 if n > 100_000 else 5


def reference_grads(x, w, dy, eps):
    """Autograd of the float64 formula, plus the size of the terms each gradient is built from."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    ref.rms_norm(x64, w64, eps).backward(dy.double())
    dy64 = dy.double()
    xhat = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    g = dy64 if w is None else dy64 * w.double()
    rstd = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    dx_scale = rstd * (g.abs() + xhat.abs() * (xhat * g).abs().mean(-1, keepdim=True))
    dw_scale = (dy64 * xhat).abs().reshape(-1, x.shape[-1]).sum(0)
    return x64.grad, (None if w is None else w64.grad), dx_scale, dw_scale


def run_backward(x, w, dy, eps):
    x = x.detach().requires_grad_()
    w = None if w is None else w.detach().requires_grad_()
    y = rms_norm(x, w, eps)
    y.backward(dy)
    return x.grad, (None if w is None else w.grad)


@pytest.mark.parametrize("n,dtype", NORM_BACKWARD_CASES)
def test_gradients_match_autograd_of_reference(dtype, n, poison_empty):
    """dx and dγ for fp32/fp16/bf16, one-block rows and rows wider than a block (4097 in every
    dtype; 262147 in fp32, 33001 in fp16 and bf16: NORM_BACKWARD_CASES)."""
    x = randn(rows_for(n), n, dtype=dtype, scale=3.0)
    w = randn(n, dtype=dtype)
    dy = randn(rows_for(n), n, dtype=dtype)
    dx, dw = run_backward(x, w, dy, 1e-6)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(x, w, dy, 1e-6)
    assert_grad_close(dx, dx_ref, dx_scale, dtype, "dx")
    assert_grad_close(dw, dw_ref, dw_scale, dtype, "dweight")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_without_weight_and_leading_dims(dtype):
    x = randn(2, 3, 4, 33, dtype=dtype)
    dy = randn(2, 3, 4, 33, dtype=dtype)
    dx, _ = run_backward(x, None, dy, 1e-6)
    dx_ref, _, dx_scale, _ = reference_grads(x, None, dy, 1e-6)
    assert_grad_close(dx, dx_ref, dx_scale, dtype, "dx")


def test_weight_in_another_dtype_gets_its_own_dtype():
    x, dy = randn(6, 40, dtype=torch.bfloat16), randn(6, 40, dtype=torch.bfloat16)
    w = randn(40, dtype=torch.float32)
    dx, dw = run_backward(x, w, dy, 1e-6)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(x, w, dy, 1e-6)
    assert_grad_close(dx, dx_ref, dx_scale, torch.bfloat16, "dx")
    assert_grad_close(dw, dw_ref, dw_scale, torch.float32, "dweight")


def test_gradcheck_float64_through_the_kernels():
    """Finite differences of the kernel's own forward against its backward, in float64 (the
    kernels accumulate fp64 inputs in fp64, so gradcheck's default tolerances apply)."""
    x = randn(3, 7, dtype=torch.float64).requires_grad_()
    w = randn(7, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda a: rms_norm(a, None, 0.0), (x,))


def test_gradcheck_float64_wide_rows_fast_mode():
    """A float64 row of 8200 elements (> 64 KiB) takes the two-sweep path; fast gradcheck compares
    random projections uᵀJv instead of the full 16400 x 16400 Jacobian."""
    x = randn(2, 8200, dtype=torch.float64).requires_grad_()
    w = randn(8200, dtype=torch.float64).requires_grad_()
    assert rms_mod.rms_config(8200, 8, backward=True).SINGLE_BLOCK is False
    assert torch.autograd.gradcheck(
        lambda a, b: rms_norm(a, b, 1e-6), (x, w), fast_mode=True
    )


def test_only_the_gradients_asked_for():
    x, w, dy = randn(4, 9), randn(9), randn(4, 9)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(x, w, dy, 1e-6)
    # weight frozen: no dγ
    xg = x.clone().requires_grad_()
    rms_norm(xg, w).backward(dy)
    assert_grad_close(xg.grad, dx_ref, dx_scale, torch.float32, "dx")
    # x frozen (e.g. a frozen embedding): dγ only
    wg = w.clone().requires_grad_()
    rms_norm(x, wg).backward(dy)
    assert_grad_close(wg.grad, dw_ref, dw_scale, torch.float32, "dweight")


@pytest.mark.parametrize("shape", [(0, 16), (0,), (2, 0, 5), (3, 0)])
def test_empty_inputs(shape):
    """M = 0 (or N = 0): dx is empty and dγ, an empty sum, is zero."""
    n = shape[-1]
    x = torch.empty(shape).requires_grad_()
    w = torch.ones(n).requires_grad_()
    y = rms_norm(x, w)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros(n))


def test_strided_inputs_and_gradients():
    """x a column slice of a wider buffer (used in place), dy a strided slice too, x transposed (copied)."""
    base = randn(6, 1037).requires_grad_()
    x = base[:, 5:1005]
    w = randn(1000).requires_grad_()
    dy_base = randn(6, 2000)
    dy = dy_base[:, ::2]  # stride(-1) = 2: copied once before the launch
    rms_norm(x, w).backward(dy)
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(x, w, dy, 1e-6)
    assert_grad_close(base.grad[:, 5:1005], dx_ref, dx_scale, torch.float32, "dx")
    assert torch.equal(base.grad[:, :5], torch.zeros(6, 5)) and torch.equal(
        base.grad[:, 1005:], torch.zeros(6, 32)
    )
    assert_grad_close(w.grad, dw_ref, dw_scale, torch.float32, "dweight")

    xt = randn(64, 9).t().requires_grad_()  # stride(-1) == 9
    dy = randn(9, 64)
    rms_norm(xt, None).backward(dy)
    dx_ref, _, dx_scale, _ = reference_grads(xt, None, dy, 1e-6)
    assert_grad_close(xt.grad, dx_ref, dx_scale, torch.float32, "dx (transposed x)")


def test_broadcast_upstream_gradient():
    """y.sum().backward() hands the kernel an expanded dy with row stride 0."""
    x, w = randn(5, 33).requires_grad_(), randn(33).requires_grad_()
    rms_norm(x, w).sum().backward()
    dx_ref, dw_ref, dx_scale, dw_scale = reference_grads(x, w, torch.ones(5, 33), 1e-6)
    assert_grad_close(x.grad, dx_ref, dx_scale, torch.float32, "dx")
    assert_grad_close(w.grad, dw_ref, dw_scale, torch.float32, "dweight")


@pytest.mark.parametrize(
    "dtype, m, n", [(torch.bfloat16, 64, 300), (torch.float32, 9, 20000)]
)
def test_dweight_is_bitwise_deterministic(dtype, m, n):
    """The two-stage reduction has a fixed order: repeated runs give the same bits. The shapes make
    every program handle several row tiles (64 rows) and take the wide-row path (20000 fp32)."""
    x, w, dy = randn(m, n, dtype=dtype), randn(n, dtype=dtype), randn(m, n, dtype=dtype)
    first = run_backward(x, w, dy, 1e-6)
    for _ in range(2):
        again = run_backward(x, w, dy, 1e-6)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_two_stage_reduction_uses_a_fixed_number_of_programs(monkeypatch):
    """More row tiles than programs: each program loops over tiles p, p + G, ... (G from backward_plan)."""
    launches = []
    real = rms_bwd.sum_partials

    def spy(partial, dtype):
        launches.append(tuple(partial.shape))
        return real(partial, dtype)

    monkeypatch.setattr(rms_bwd, "sum_partials", spy)
    run_backward(randn(64, 300), randn(300), randn(64, 300), 1e-6)
    cfg, G, _, _, _ = rms_bwd.backward_plan(64, 300, 4, 4)
    assert launches == [(G, 300)] and G < 64 // cfg.BLOCK_M


def test_no_grad_path_saves_nothing():
    x, w = randn(4, 50), randn(50)
    with_grad = rms_norm(x.clone().requires_grad_(), w)
    assert with_grad.grad_fn is not None
    with nothing_saved():
        y = rms_norm(x, w)
        with torch.no_grad():
            y_ng = rms_norm(x.clone().requires_grad_(), w)
    assert y.grad_fn is None and y_ng.grad_fn is None
    assert torch.equal(y, with_grad.detach()) and torch.equal(y_ng, y)


def test_nan_stays_in_its_row():
    x, dy = randn(4, 7), randn(4, 7)
    x[1, 3] = float("nan")
    dx, _ = run_backward(x, None, dy, 1e-6)
    assert torch.isnan(dx[1]).all()
    assert torch.isfinite(dx[[0, 2, 3]]).all()


def test_bad_arguments_are_rejected_before_autograd(monkeypatch):
    monkeypatch.setattr(rms_mod, "_forward", lambda *a, **k: pytest.fail("launched"))
    x = torch.ones(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.ones(5, requires_grad=True))
    with pytest.raises(ValueError, match="eps must be finite"):
        rms_norm(x, None, eps=-1.0)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 3), n=st.integers(2, 200), seed=st.integers(0, 2**31 - 1))
def test_property_gradient_is_orthogonal_to_x_when_eps_is_zero(m, n, seed):
    """With ε = 0, y(a·x) = y(x) so J·x = 0 (Euler), hence x·dx = dyᵀ J x = 0 for every dy:
    the gradient has no component along the row. fp32 leaves |x·dx| ≲ 1e-5·|x|·|dx|·√n."""
    g = torch.Generator().manual_seed(seed)
    x, dy, w = randn(m, n, generator=g), randn(m, n, generator=g), randn(n, generator=g)
    dx, _ = run_backward(x, w, dy, 0.0)
    dot = (dx.double() * x.double()).sum(-1).abs()
    size = x.double().norm(dim=-1) * dx.double().norm(dim=-1)
    assert bool((dot <= 1e-5 * size * n**0.5 + 1e-30).all())


def test_the_backward_cases_reach_every_path():
    """NORM_BACKWARD_CASES (backward_helpers) runs RMSNorm's paths: the single block, the
    column sweeps in every dtype, the split forward (fp32 at 262,147), the looped forward
    (fp16 and bf16 at 33,001)."""
    from normbook._config import rms_config, rms_split

    rows = {(p.values[0], p.values[1]) for p in NORM_BACKWARD_CASES}
    for dt in LOW_PRECISION:
        size = torch.tensor([], dtype=dt).element_size()
        assert rms_config(1000, size, backward=True).SINGLE_BLOCK and (1000, dt) in rows
        assert (
            not rms_config(4097, size, backward=True).SINGLE_BLOCK
            and (4097, dt) in rows
        )
    assert rms_split(262147, 4) and (262147, torch.float32) in rows
    for dt in (torch.float16, torch.bfloat16):  # their widest row: looped, not split
        assert (33001, dt) in rows and not rms_config(33001, 2).SINGLE_BLOCK
        assert not rms_split(33001, 2)
