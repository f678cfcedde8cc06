"""normbook.softmax, forward and backward, against the float64 reference (normbook.reference) and
torch.softmax.

Tolerances. The forward computes exp(x - m) and the sum in fp32 on the rounded input and rounds
p once: per element |p' - p| <= u·p (the rounding) + an fp32 relative error of a few 2**-24 for
exp, |x - m|·2**-24 where a GPU's exp2 rounds its argument (|x - m| < 40 for these inputs) and
log2(N)·2**-24 for the sum: together below 1e-5 relatively, the constant conftest.norm_tolerance
uses (2u + 1e-5, plus 2**-24 absolute for fp16's subnormals). A kernel that forgot the max
shift overflows (tested below); one that dropped the rescaling of the wide-row sum errs by
factors like exp(m - m'), far outside these bounds.

The backward reads the saved, rounded p (relative error u) and dy: with c = Σ p·dy the error of
dx = p ⊙ (dy − c) is at most 2u·p(|dy| + Σ p|dy|) from p's rounding, 1e-5 times that size from
fp32 sums, and u·|dx| from the final rounding (see backward_helpers for the same argument).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_close_to_reference,
    assert_rejected_before_launch,
    norm_tolerance,
    nothing_saved,
    randn,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import DEVICE, softmax
from normbook import reference as ref

sm_mod = importlib.import_module("normbook.softmax")  # the module, not the function
# 4097: one block with padding; 20000: fp32 loops (80 KB row), fp16/bf16 one block;
# 262147: every dtype loops over 64+ blocks.
SIZES = [1, 7, 1000, 4097, 20000, 262147]


def rows_for(n):
    return 2 if n > 100_000 else 5


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference_and_torch(dtype, n, poison_empty):
    x = randn(rows_for(n), n, dtype=dtype, scale=3.0)
    y = softmax(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_to_reference(y, ref.softmax(x), dtype)
    if n > 100_000:
        # PyTorch's CPU softmax sums a 262,147-wide fp32 row less accurately (relative errors
        # near 3e-5 measured) than our bound: the float64 reference above is the judge there.
        return
    # PyTorch is within the same bound of the truth, so the two differ by at most twice it.
    rtol, atol = norm_tolerance(dtype)
    torch.testing.assert_close(
        y.cpu(), F.softmax(x, dim=-1).cpu(), rtol=2 * rtol, atol=2 * atol
    )


def test_wide_rows_take_the_looping_path():
    assert sm_mod.row_config(2, 20000, 4).SINGLE_BLOCK is False
    assert sm_mod.row_config(2, 20000, 2).SINGLE_BLOCK is True
    assert sm_mod.row_config(2, 262147, 2).SINGLE_BLOCK is False


def test_rows_sum_to_one():
    x = randn(6, 4097, scale=5.0)
    s = softmax(x).double().sum(-1)
    # 4097 roundings of size <= u·p each: |Σp' − 1| <= (2u + 1e-5)·Σp.
    assert bool(((s - 1).abs() <= 2 * 2.0**-24 + 1e-5).all())


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_any_dim(dim):
    x = randn(4, 5, 6, scale=2.0)
    y = softmax(x, dim=dim)
    expected = ref.softmax(x.movedim(dim, -1)).movedim(-1, dim)
    assert y.shape == x.shape
    assert_close_to_reference(y, expected, torch.float32)


def test_float64_is_accumulated_in_float64():
    x = randn(4, 513, dtype=torch.float64, scale=4.0)
    torch.testing.assert_close(softmax(x), ref.softmax(x), rtol=1e-13, atol=0)


def test_hand_calculation():
    """(1, 2, 3): p = (1, e, e²)/(1 + e + e²)."""
    import math

    y = softmax(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64, device=DEVICE))
    z = 1 + math.e + math.e**2
    expected = torch.tensor([[1 / z, math.e / z, math.e**2 / z]], dtype=torch.float64)
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    "dtype, big", [(torch.float32, 1e4), (torch.float16, 6e4), (torch.bfloat16, 3e38)]
)
@pytest.mark.parametrize("n", [7, 40000])
def test_large_logits_do_not_overflow(dtype, big, n):
    """exp(big) overflows every format; the max shift keeps every exponent <= 0."""
    x = randn(3, n, dtype=dtype)
    x[:, 1] = big
    y = softmax(x)
    assert torch.isfinite(y).all()
    assert bool((y[:, 1].float() == 1.0).all()) and bool((y[:, 0] == 0).all())


@pytest.mark.parametrize("n", [7, 4097, 40000])
def test_shift_invariance(n):
    # x on the grid of multiples of 2**-13, |x| < 1024: x + 1024 is exact in fp32 (spacing 2**-13
    # there) and so is x - max, hence the kernel sees the same exponents: bit-identical output.
    x = torch.round(randn(3, n) * 2**13) / 2**13
    assert torch.equal((x + 1024.0) - 1024.0, x)
    assert torch.equal(softmax(x + 1024.0), softmax(x))


def test_strided_rows_are_used_in_place():
    base = randn(6, 1037)
    x = base[:, 5 : 5 + 1000]  # row stride 1037, last dimension contiguous
    assert not x.is_contiguous()
    assert_close_to_reference(softmax(x), ref.softmax(x), torch.float32)
    xw = randn(2, 41000)[:, 3:40003]  # strided and wide
    assert_close_to_reference(softmax(xw), ref.softmax(xw), torch.float32)


def test_non_contiguous_last_dimension_is_copied():
    x = randn(64, 9).t()
    assert x.stride(-1) != 1
    assert_close_to_reference(softmax(x), ref.softmax(x), torch.float32)


def test_empty_inputs():
    for shape in [(0, 16), (3, 0), (0,), (2, 0, 5)]:
        x = torch.empty(shape, device=DEVICE)
        for dim in range(len(shape)):
            y = softmax(x, dim=dim)
            assert y.shape == x.shape and y.numel() == 0


@pytest.mark.parametrize("n", [7, 4097, 40000])
def test_nan_and_inf_stay_in_their_row(n):
    x = randn(6, n)
    x[1, n // 2] = float("nan")
    x[2, 0] = float("inf")
    x[3, :] = float("-inf")  # a fully masked row: 0/0, as torch
    x[4, : n // 2 + 1] = float("-inf")  # -inf first (the looping path's first blocks)
    y = softmax(x)
    expected = F.softmax(x, dim=-1)
    assert (
        torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and torch.isnan(y[3]).all()
    )
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert (y[4, : n // 2 + 1] == 0).all()
    assert torch.isfinite(y[[0, 4, 5]]).all()
    assert_close_to_reference(y[[0, 4, 5]], ref.softmax(x[[0, 4, 5]]), torch.float32)


def test_deterministic():
    x = randn(9, 40000, dtype=torch.bfloat16)
    assert torch.equal(softmax(x), softmax(x))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 4),
    n=st.integers(1, 300),
    log_scale=st.floats(-3, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_is_a_probability_vector(m, n, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(m, n, scale=10.0**log_scale, generator=g)
    y = softmax(x).double()
    assert bool((y >= 0).all())
    torch.testing.assert_close(
        y.sum(-1), torch.ones(m, dtype=torch.float64), rtol=0, atol=1e-5
    )
    # Monotone: the largest logit gets the largest probability.
    assert bool(
        (y.max(-1).values == y.gather(-1, x.argmax(-1, keepdim=True))[:, 0]).all()
    )


# ------------------------------------------------------------------ backward


def assert_vjp_close(dx, x, dy, dtype, what="dx"):
    """|dx − dx_ref| <= u|dx_ref| + (2u + 1e-5)·p(|dy| + Σp|dy|), and for fp16, whose saved p
    and dx may be subnormal (absolute error up to 2**-25 each), + 2**-24·(1 + |dy| + Σp|dy|)."""
    p = ref.softmax(x).cpu()
    dy64 = dy.double().cpu()
    expected = ref.softmax_vjp(x, dy).cpu()
    size = dy64.abs() + (p * dy64.abs()).sum(-1, keepdim=True)
    u = UNIT_ROUNDOFF[dtype]
    fp = 1e-12 if dtype == torch.float64 else 1e-5
    bound = u * expected.abs() + (2 * u + fp) * p * size
    if dtype == torch.float16:
        bound = bound + 2.0**-24 * (1 + size)
    assert dx.dtype == dtype and dx.shape == x.shape
    err = (dx.double().cpu() - expected).abs()
    worst = torch.argmax(err - bound)
    assert bool((err <= bound).all()), (
        f"{what} ({dtype}): error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"
    )


def run_backward(x, dy, dim=-1):
    x = x.detach().requires_grad_()
    softmax(x, dim=dim).backward(dy)
    return x.grad


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", SIZES)
def test_backward_matches_reference(dtype, n, poison_empty):
    x = randn(rows_for(n), n, dtype=dtype, scale=3.0)
    dy = randn(rows_for(n), n, dtype=dtype)
    assert_vjp_close(run_backward(x, dy), x, dy, dtype)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_backward_any_dim(dim):
    x, dy = randn(4, 5, 6), randn(4, 5, 6)
    dx = run_backward(x, dy, dim)
    assert_vjp_close(
        dx.movedim(dim, -1), x.movedim(dim, -1), dy.movedim(dim, -1), torch.float32
    )


def test_backward_matches_torch_autograd():
    x, dy = randn(5, 300, scale=3.0), randn(5, 300)
    xt = x.clone().requires_grad_()
    F.softmax(xt, dim=-1).backward(dy)
    torch.testing.assert_close(
        run_backward(x, dy).cpu(), xt.grad.cpu(), rtol=1e-5, atol=1e-7
    )


def test_gradcheck_float64_through_the_kernels():
    x = randn(3, 7, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(softmax, (x,))
    assert torch.autograd.gradcheck(lambda a: softmax(a, dim=0), (x,))


def test_gradcheck_float64_wide_rows_fast_mode():
    x = randn(2, 8200, dtype=torch.float64).requires_grad_()
    assert sm_mod.row_config(2, 8200, 8).SINGLE_BLOCK is False
    assert torch.autograd.gradcheck(softmax, (x,), fast_mode=True)


def test_backward_strided_and_broadcast_gradients():
    base = randn(6, 1037).requires_grad_()
    x = base[:, 5:1005]
    dy = randn(6, 2000)[:, ::2]  # stride(-1) = 2: copied before the launch
    softmax(x).backward(dy)
    assert_vjp_close(base.grad[:, 5:1005], x.detach(), dy, torch.float32)
    assert torch.equal(base.grad[:, :5], torch.zeros(6, 5))
    # y.sum().backward(): dy expanded with row stride 0; the gradient of Σp = 1 is 0.
    x2 = randn(5, 33).requires_grad_()
    softmax(x2).sum().backward()
    assert_vjp_close(x2.grad, x2.detach(), torch.ones(5, 33), torch.float32)


def test_backward_empty_and_deterministic():
    x = torch.empty(0, 16, device=DEVICE).requires_grad_()
    softmax(x).sum().backward()
    assert x.grad.shape == (0, 16)
    x, dy = randn(9, 40000, dtype=torch.bfloat16), randn(9, 40000, dtype=torch.bfloat16)
    assert torch.equal(run_backward(x, dy), run_backward(x, dy))


def test_backward_nan_stays_in_its_row():
    x, dy = randn(4, 7), randn(4, 7)
    x[1, 3] = float("nan")
    dx = run_backward(x, dy)
    assert torch.isnan(dx[1]).all() and torch.isfinite(dx[[0, 2, 3]]).all()


def test_no_grad_path_saves_nothing():
    x = randn(4, 50)
    with_grad = softmax(x.clone().requires_grad_())
    assert with_grad.grad_fn is not None
    with nothing_saved():
        y = softmax(x)
    assert y.grad_fn is None and torch.equal(y, with_grad.detach())


# ------------------------------------------------------------------ bad arguments, before any launch


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: softmax([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (
            lambda: softmax(torch.ones(3, 4, dtype=torch.int32, device=DEVICE)),
            TypeError,
            "x must be",
        ),
        (
            lambda: softmax(torch.tensor(1.0, device=DEVICE)),
            ValueError,
            "at least one dimension",
        ),
        (
            lambda: softmax(torch.ones(3, 4, device=DEVICE), dim=2),
            ValueError,
            "dim must be in [-2, 1]",
        ),
        (
            lambda: softmax(torch.ones(3, 4, device=DEVICE), dim=-3),
            ValueError,
            "dim must be in",
        ),
        (
            lambda: softmax(torch.ones(3, 4, device=DEVICE), dim=1.0),
            TypeError,
            "dim must be an int",
        ),
        (
            lambda: softmax(torch.ones(3, 4, device=DEVICE), dim=True),
            TypeError,
            "dim must be an int",
        ),
        (
            lambda: softmax(torch.ones(3, 4, device=DEVICE), dim=None),
            TypeError,
            "dim must be an int",
        ),
        (lambda: softmax(torch.ones(3, 4, device="meta")), ValueError, "x is on meta"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "softmax", call, exc, words)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1000, 40000])
def test_rounds_to_nearest_once(dtype, n):
    """p is computed in fp32 and rounded once, to nearest: almost every element equals float64
    rounded to the dtype (a differing one needs fp32 p within ~1e-6 relative of a halfway point,
    a fraction ~1e-6/u of elements). Truncation (the interpreter's plain bf16 cast) or an
    intermediate rounding would leave about half the elements one unit off."""
    x = randn(4, n, dtype=dtype, scale=3.0)
    exact = ref.softmax(x).to(dtype)
    got = softmax(x).cpu()
    assert (got == exact).double().mean().item() > 0.99
    ulp = torch.finfo(dtype).eps * exact.double().abs() + 2.0**-24
    assert bool(((got.double() - exact.double()).abs() <= ulp).all())
