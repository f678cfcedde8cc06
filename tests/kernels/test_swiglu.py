"""normbook.swiglu = silu(gate)·up, forward and backward, against float64 (normbook.reference).

Tolerances. Inputs are rounded to their dtype first and the float64 reference reads the same
rounded values, so only the kernel's arithmetic and its one final rounding count:

* fp32 inside: e^{-g} on a GPU is ex2.approx of g·log2(e), whose argument rounding costs
  |g|·2**-24 relatively and the instruction about 2 ulp; the division (approximate on a GPU)
  2 ulp; two or three products 1 ulp each. We allow (2|g| + 16)·2**-24 relatively, per element.
* the store: u of the output dtype (one rounding; eager PyTorch rounds twice), plus half an fp16
  subnormal spacing (2**-25) absolutely, where fp16 results are subnormal.
* the backward's dg = dy·u·σ(1 + g(1 - σ)) vanishes at g ≈ -1.28, so its fp32 error is bounded
  by the size of its terms, |dy·u|·(σ + |g|σ(1 - σ)), not by |dg|.

A wrong derivative (σ instead of silu', a dropped "1 +", a swapped dg/du) errs by O(1), far
outside these bounds; an element the kernel forgot to write is NaN (``poison_empty``).
Sizes are small for the interpreter; 5000 columns exceed one block (4096), so the column grid
and its masked tail are exercised, and 3 × 5 × 7 puts several short rows in one tile.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_rejected_before_launch,
    on_cpu,
    randn,
)

from normbook import DEVICE, swiglu
from normbook import reference as ref

sw_mod = importlib.import_module("normbook.swiglu")
SHAPES = [(1,), (3, 5, 7), (4, 5000), (2, 3, 129)]


def _bound(dtype, g, size):
    """Elementwise bound: fp32 arithmetic on a value of magnitude ``size``, then one rounding."""
    g = g.abs()
    arith = (2 * g + 16) * 2.0**-24 * size
    atol = 2.0**-25 if dtype == torch.float16 else 0.0
    return arith + UNIT_ROUNDOFF[dtype] * size + atol


def _assert_within(out, want, bound, what):
    out = out.double()
    assert torch.equal(torch.isnan(out), torch.isnan(want)), (
        f"{what}: NaN pattern differs"
    )
    ok = torch.isfinite(want)
    err = (out - want).abs()[ok]
    worst = (err - bound[ok]).max() if err.numel() else torch.tensor(0.0)
    assert bool((err <= bound[ok]).all()), (
        f"{what}: error above its bound by {worst.item():.3g}"
    )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64(shape, dtype, poison_empty):
    g, u = randn(*shape, dtype=dtype, scale=3.0), randn(*shape, dtype=dtype)
    y = swiglu(g, u)
    assert y.shape == g.shape and y.dtype == dtype
    g, u, y = on_cpu(g, u, y)
    want = ref.swiglu(g, u)
    _assert_within(y, want, _bound(dtype, g.double(), want.abs()), "y")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_float64(shape, dtype, poison_empty):
    g = randn(*shape, dtype=dtype, scale=3.0).requires_grad_()
    u = randn(*shape, dtype=dtype).requires_grad_()
    dy = randn(*shape, dtype=dtype)
    dg, du = torch.autograd.grad(swiglu(g, u), (g, u), dy)
    assert dg.dtype == du.dtype == dtype
    g, u, dy, dg, du = on_cpu(g, u, dy, dg, du)
    want_dg, want_du = ref.swiglu_vjp(g, u, dy)
    g64 = g.double()
    s = torch.sigmoid(g64)
    terms = (dy.double() * u.double()).abs() * (s + g64.abs() * s * (1 - s))
    _assert_within(
        dg,
        want_dg,
        _bound(dtype, g64, terms) + UNIT_ROUNDOFF[dtype] * want_dg.abs(),
        "dgate",
    )
    _assert_within(du, want_du, _bound(dtype, g64, want_du.abs()), "dup")


def test_one_rounding_is_at_least_as_accurate_as_eager_bf16():
    """Eager PyTorch (Hugging Face's act_fn(g) * u) rounds silu(g) to bf16, then the product:
    the kernel rounds once, so it is never further from float64 (summed over a tensor)."""
    g, u = (
        randn(64, 256, dtype=torch.bfloat16, scale=3.0),
        randn(64, 256, dtype=torch.bfloat16),
    )
    ours, eager = on_cpu(swiglu(g, u), F.silu(g) * u)
    exact = ref.swiglu(*on_cpu(g, u))
    assert (ours.double() - exact).abs().sum() <= (eager.double() - exact).abs().sum()


def test_strided_inputs():
    """Slices of wider buffers are read in place (row strides differ between gate and up); a
    transposed input (last dimension not contiguous) is copied once; the results are the same."""
    wide_g = randn(6, 40, scale=3.0)
    wide_u = randn(6, 70)
    g, u = wide_g[:, 3:35], wide_u[:, 10:42]
    assert g.stride() != u.stride()
    assert torch.equal(swiglu(g, u), swiglu(g.contiguous(), u.contiguous()))
    gt = randn(32, 6, scale=3.0).t()  # (6, 32), last-dimension stride 6
    assert torch.equal(swiglu(gt, u), swiglu(gt.contiguous(), u.contiguous()))
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    gs = wide_g.clone().requires_grad_()
    dy = randn(6, 32)
    got = torch.autograd.grad(swiglu(gs[:, 3:35], u), gs, dy)[0][:, 3:35]
    assert torch.equal(got, torch.autograd.grad(swiglu(gr, ur), gr, dy)[0])


def test_nan_and_inf_as_float64():
    """NaN propagates; silu(+inf)·u = inf·u; silu(-inf) = -inf·0 = NaN (as F.silu); far
    negative gates give silu(g) = -0, never NaN (σ = 1/(1 + inf) = 0)."""
    values = [float("nan"), float("inf"), -float("inf"), -200.0, -90.0, 0.0, 30.0]
    g = torch.tensor(values).to(DEVICE).repeat(2, 1)
    u = torch.tensor([1.0] * len(values)).to(DEVICE).repeat(2, 1)
    u[1] = -2.0
    y = on_cpu(swiglu(g, u))
    want = ref.swiglu(*on_cpu(g, u))
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.allclose(y.double()[finite], want[finite], rtol=1e-6, atol=1e-30)


def test_empty_and_scalar_like():
    e = randn(0, 8)
    assert swiglu(e, e).shape == (0, 8)
    x = randn(1)
    assert torch.allclose(swiglu(x, x).cpu(), (F.silu(x) * x).cpu())


def test_gradcheck_float64():
    g = randn(3, 7, dtype=torch.float64, scale=3.0).requires_grad_()
    u = randn(3, 7, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (g, u))


def test_gradient_only_for_what_requires_it():
    g = randn(2, 8).requires_grad_()
    u = randn(2, 8)
    y = swiglu(g, u)
    (dg,) = torch.autograd.grad(y, g, torch.ones_like(y))
    want, _ = ref.swiglu_vjp(*on_cpu(g, u), torch.ones(2, 8))
    assert torch.allclose(on_cpu(dg).double(), want, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert swiglu(g, u).grad_fn is None


def test_deterministic():
    g, u = randn(5, 300, scale=3.0).requires_grad_(), randn(5, 300).requires_grad_()
    dy = randn(5, 300)
    a = [swiglu(g, u), *torch.autograd.grad(swiglu(g, u), (g, u), dy)]
    b = [swiglu(g, u), *torch.autograd.grad(swiglu(g, u), (g, u), dy)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (
            lambda: swiglu(randn(2, 4), randn(2, 5)),
            ValueError,
            "gate (2, 4) and up (2, 5)",
        ),
        (
            lambda: swiglu(randn(2, 4), randn(4, 2)),
            ValueError,
            "gate (2, 4) and up (4, 2)",
        ),
        (
            lambda: swiglu(randn(2, 4), randn(2, 4, dtype=torch.float16)),
            TypeError,
            "up",
        ),
        (
            lambda: swiglu(torch.ones(2, 4, dtype=torch.int32), randn(2, 4)),
            TypeError,
            "gate",
        ),
        (lambda: swiglu(randn(2, 4), [1.0] * 4), TypeError, "up"),
        (lambda: swiglu(torch.tensor(1.0), torch.tensor(1.0)), ValueError, "gate"),
        (
            lambda: swiglu(torch.ones(2, 4, device="meta"), randn(2, 4)),
            ValueError,
            "gate",
        ),
        (
            lambda: swiglu(randn(2, 4), torch.ones(2, 4, device="meta")),
            ValueError,
            "up",
        ),
    ],
    ids=[
        "shape",
        "shape-transposed",
        "dtype",
        "int",
        "list",
        "scalar",
        "device-g",
        "device-u",
    ],
)
def test_bad_arguments_are_refused_before_launch(monkeypatch, call, exc, words):
    assert_rejected_before_launch(monkeypatch, "swiglu", call, exc, words)
