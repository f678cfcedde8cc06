"""normbook.layer_norm against the float64 reference (normbook.reference.layer_norm) and torch.

Tolerance (``assert_ln_close``), derived from the kernel's arithmetic. Before the final rounding
everything is fp32 (unit roundoff u = 2**-24):

- the mean is a sum of N terms divided by N: |δμ| <= (log2 N + 1)·u·max|x|, which moves every
  x̂ = (x − μ)·rstd by rstd·|δμ| (an absolute error: it does not shrink with |x − μ|);
- rstd carries the relative error of the fp32 variance, <= 1e-5 for N <= 262,144 (as for RMSNorm,
  see conftest.norm_tolerance), so x̂ errs by 1e-5·|x̂| more;
- γ·x̂ + β is formed in fp32: u·(|γ x̂| + |β|);
- the result is rounded once to the output dtype: u_dtype·|y| (plus half a subnormal spacing in fp16).
"""

import importlib
import math

import pytest
import torch
from conftest import LOW_PRECISION, UNIT_ROUNDOFF, assert_rejected_before_launch, randn
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import DEVICE, layer_norm
from normbook import reference as ref

SIZES = [1, 2, 7, 1000, 4097, 262147]
U32 = 2.0**-24


def rows_for(n):
    return 2 if n > 100_000 else 5


def ln_bound(x, weight, bias, eps, dtype):
    """Elementwise error bound for layer_norm(x, weight, bias, eps) stored in ``dtype`` (see the module docstring)."""
    x64 = x.detach().double().cpu()
    n = x64.shape[-1]
    u_acc = 2.0**-53 if dtype == torch.float64 else U32
    stat = 1e-12 if dtype == torch.float64 else 1e-5
    xhat = ref.layer_norm(x64, None, None, eps)
    rstd = 1.0 / torch.sqrt(ref.variance(x64) + eps)
    g = (
        torch.ones(n, dtype=torch.float64)
        if weight is None
        else weight.detach().double().cpu()
    )
    b = (
        torch.zeros(n, dtype=torch.float64)
        if bias is None
        else bias.detach().double().cpu()
    )
    y = ref.layer_norm(x64, g, b, eps)
    d_mean = (math.log2(n) + 1) * u_acc * x64.abs().amax(dim=-1, keepdim=True)
    before_rounding = g.abs() * (rstd * d_mean + stat * xhat.abs()) + u_acc * (
        g.abs() * xhat.abs() + b.abs()
    )
    atol = (
        2.0**-24 if dtype == torch.float16 else 0.0
    )  # fp16 subnormals: absolute half-spacing 2**-25, twice
    return y, UNIT_ROUNDOFF[dtype] * y.abs() + before_rounding * (
        1 + UNIT_ROUNDOFF[dtype]
    ) + atol


def assert_ln_close(out, x, weight=None, bias=None, eps=1e-5, what="output"):
    """|out − ref| <= bound elementwise; NaN and ±Inf exactly where the float64 reference has them."""
    dtype = x.dtype
    expected, bound = ln_bound(x, weight, bias, eps, dtype)
    out64 = out.detach().double().cpu()
    assert out.dtype == dtype and out64.shape == expected.shape, (
        f"{what}: {out.dtype} {tuple(out.shape)}"
    )
    assert torch.equal(torch.isnan(out64), torch.isnan(expected)), (
        f"{what}: NaN pattern differs from the reference"
    )
    finite = torch.isfinite(expected)
    assert torch.equal(
        out64[~finite & ~torch.isnan(expected)],
        expected[~finite & ~torch.isnan(expected)],
    )
    err = (out64 - expected).abs()[finite]
    bound = bound[finite]
    if err.numel():
        worst = torch.argmax(err - bound)
        assert bool((err <= bound).all()), (
            f"{what} ({dtype}): error {err[worst].item():.3g} > bound {bound[worst].item():.3g} "
            f"at a reference value of {expected[finite][worst].item():.6g}"
        )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(dtype, n, poison_empty):
    x = (
        randn(rows_for(n), n, dtype=dtype, scale=3.0) + 1.0
    )  # a nonzero mean, so centering matters
    x = x.to(dtype)
    w, b = randn(n, dtype=dtype), randn(n, dtype=dtype)
    y = layer_norm(x, w, b, eps=1e-5)
    assert_ln_close(y, x, w, b, 1e-5)


@pytest.mark.parametrize("n", [1000, 262147])
def test_saved_mean_and_rstd(n, poison_empty):
    """The per-row statistics kept for the backward pass: fp32, one per row, every row written."""
    mod = importlib.import_module("normbook.layer_norm")
    x = randn(3, n, scale=2.0) + 0.5
    y, mean, rstd = mod._forward(x, None, None, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (
        3,
    )
    # Mean: fp32 summation error (log2 N + 1)·u·max|x|; rstd: the variance's relative error, 1e-5.
    tol_mean = (math.log2(n) + 1) * U32 * x.abs().max().item()
    assert (mean.double() - ref.mean(x)[:, 0]).abs().max().item() <= tol_mean
    torch.testing.assert_close(
        rstd.double(), 1 / torch.sqrt(ref.variance(x)[:, 0] + 1e-5), rtol=1e-5, atol=0
    )
    assert_ln_close(y, x)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_weight_and_bias_are_optional(dtype):
    x = randn(2, 3, 4, 33, dtype=dtype)
    w, b = randn(33, dtype=dtype), randn(33, dtype=dtype)
    for weight, bias in [(None, None), (w, None), (None, b), (w, b)]:
        y = layer_norm(x, weight, bias)
        assert y.shape == x.shape
        assert_ln_close(
            y,
            x,
            weight,
            bias,
            what=f"weight={weight is not None}, bias={bias is not None}",
        )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", [7, 768, 20000])
def test_matches_torch_layer_norm(dtype, n):
    """torch.nn.functional.layer_norm does the same roundings (fp32 statistics and affine, one
    rounding at the end). Only the fp32 sums' order may differ, which can move a half-precision
    result by one ulp; so: within 2 ulps everywhere, and nearly all bit-identical."""
    x = randn(4, n, dtype=dtype, scale=2.0) + 0.25
    x = x.to(dtype)
    w, b = randn(n, dtype=dtype), randn(n, dtype=dtype)
    got = layer_norm(x, w, b, eps=1e-5)
    expected = torch.nn.functional.layer_norm(x, (n,), w, b, eps=1e-5)
    if dtype == torch.float32:
        assert_ln_close(
            expected, x, w, b, what="torch itself"
        )  # the bound holds for torch too
        assert_ln_close(got, x, w, b)
    else:
        # Both round one fp32 value γ·x̂ + β to the dtype; those fp32 values differ by a few
        # fp32 roundings of the terms (the sums' order), |γ·x̂| + |β| in size, which matters
        # where the two terms cancel (the result is then far smaller than either term).
        x64 = x.double()
        xhat = (x64 - x64.mean(-1, keepdim=True)) / x64.std(
            -1, correction=0, keepdim=True
        )
        terms = (w.double() * xhat).abs() + b.double().abs()
        ulp = 2 * UNIT_ROUNDOFF[dtype] * expected.double().abs() + 8 * 2.0**-24 * terms
        assert bool(((got.double() - expected.double()).abs() <= 2 * ulp).all())
        assert (got == expected).float().mean().item() > 0.95


def test_mixed_parameter_dtype():
    """fp32 γ and β with bf16 x (a common mixed-precision set-up): the output is in x's dtype."""
    x = randn(3, 300, dtype=torch.bfloat16)
    w, b = randn(300), randn(300)
    y = layer_norm(x, w, b)
    assert y.dtype == torch.bfloat16
    assert_ln_close(y, x, w, b)


def test_float64_is_accumulated_in_float64():
    x = randn(4, 513, dtype=torch.float64) + 3.0
    w, b = randn(513, dtype=torch.float64), randn(513, dtype=torch.float64)
    torch.testing.assert_close(
        layer_norm(x, w, b), ref.layer_norm(x, w, b), rtol=1e-12, atol=1e-13
    )
    mod = importlib.import_module("normbook.layer_norm")
    _, mean, rstd = mod._forward(x, w, b, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float64


def test_hand_calculation():
    """x = (1, 2, 3, 6): μ = 3, σ² = (4 + 1 + 0 + 9)/4 = 3.5, y = (x − 3)/sqrt(3.5)."""
    y = layer_norm(torch.tensor([[1.0, 2.0, 3.0, 6.0]], device=DEVICE), eps=0.0)
    expected = torch.tensor([[-2.0, -1.0, 0.0, 3.0]]) / math.sqrt(3.5)
    torch.testing.assert_close(y.cpu(), expected, rtol=2e-7, atol=0)


@pytest.mark.parametrize(
    "n", [1000, 20000]
)  # 20000 fp32 values exceed one block: the Chan merge path
def test_large_common_offset_is_normalized_accurately(n):
    """x = 1e4 + N(0, 1) in fp32. E[x²] − E[x]² would subtract two numbers near 1e8, whose fp32
    spacing is 8: the variance (about 1) would be lost entirely. Mean-then-deviations keeps it.

    The variance (hence rstd) must be right to the fp32 statistics' 1e-5; the output errs by at most
    a few units in the last place of μ (no fp32 kernel that subtracts an fp32 mean can beat half an
    ulp of μ ≈ 1e4, i.e. 2**-11 ≈ 4.9e-4, relative to σ = 1)."""
    mod = importlib.import_module("normbook.layer_norm")
    x = 1e4 + randn(2, n)
    y, _, rstd = mod._forward(x, None, None, 1e-5)
    torch.testing.assert_close(
        rstd.double(), 1 / torch.sqrt(ref.variance(x)[:, 0] + 1e-5), rtol=1e-5, atol=0
    )
    ulp_mu = 2.0**-10  # fp32 spacing at 1e4 (between 2**13 and 2**14)
    err = (y.double() - ref.layer_norm(x)).abs().max().item()
    assert err <= 4 * ulp_mu, err
    # The one-pass identity in the same fp32 is wrong by orders of magnitude more.
    one_pass = (x * x).mean(-1) - x.mean(-1) ** 2
    assert ((one_pass.double() - ref.variance(x)[:, 0]).abs() > 0.05).any()


def test_blocks_with_different_means_merge_exactly():
    """A wide row whose blocks have very different means (a ramp plus an offset): Chan's merge term
    δ²·n_a·n_b/n carries the spread between blocks into the variance."""
    n = 262147
    ramp = torch.linspace(0.0, 50.0, n)
    x = torch.stack([1e3 + ramp + torch.randn(n), -ramp + 0.01 * torch.randn(n)]).to(
        DEVICE
    )
    mod = importlib.import_module("normbook.layer_norm")
    y, mean, rstd = mod._forward(x, None, None, 1e-5)
    torch.testing.assert_close(
        rstd.double(), 1 / torch.sqrt(ref.variance(x)[:, 0] + 1e-5), rtol=1e-5, atol=0
    )
    assert_ln_close(y, x)


def test_strided_rows_are_used_in_place():
    base = randn(6, 1037)
    x = base[:, 5 : 5 + 1000]  # row stride 1037, last dimension contiguous
    assert not x.is_contiguous()
    w, b = randn(1000), randn(1000)
    assert_ln_close(layer_norm(x, w, b), x, w, b)
    x3 = randn(3, 8, 70)[:, ::2, 3:67]  # strided leading dimensions too
    assert_ln_close(layer_norm(x3), x3)


def test_non_contiguous_last_dimension_is_copied():
    x = randn(64, 9).t()  # stride(-1) == 9
    assert x.stride(-1) != 1
    assert_ln_close(layer_norm(x), x)


def test_empty_inputs():
    for shape in [(0, 16), (3, 0), (0,), (2, 0, 5)]:
        x = torch.empty(shape, device=DEVICE)
        n = shape[-1]
        y = layer_norm(x, torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE))
        assert y.shape == x.shape and y.numel() == 0
    mod = importlib.import_module("normbook.layer_norm")
    _, mean, rstd = mod._forward(
        torch.empty(0, 8, device=DEVICE), None, None, 1e-5
    )  # M = 0: nothing launched
    assert mean.shape == rstd.shape == (0,)


@pytest.mark.parametrize("n", [7, 20000])
def test_nan_and_inf_stay_in_their_row(n):
    x = randn(4, n)
    x[1, n // 2] = float("nan")
    x[2, 0] = float("inf")
    y = layer_norm(x)
    assert torch.isnan(y[1]).all()  # NaN poisons its own row's mean
    assert torch.isnan(y[2]).all()  # μ = inf, and inf − inf = NaN in every deviation
    assert torch.isfinite(y[[0, 3]]).all()  # nothing leaks into the other rows
    assert_ln_close(y, x)


def test_constant_row_gives_the_bias():
    """σ² = 0 exactly (every deviation is 0), so y = β; a one-pass variance could come out negative."""
    x = torch.full((2, 1000), 3.0, device=DEVICE)
    b = randn(1000)
    assert torch.equal(layer_norm(x, randn(1000), b, eps=1e-5), b.expand(2, -1))
    assert torch.equal(
        layer_norm(torch.zeros(2, 10, device=DEVICE)), torch.zeros(2, 10)
    )


def test_length_one_rows_give_the_bias():
    x, b = randn(5, 1), randn(1)
    assert torch.equal(layer_norm(x, randn(1), b), b.expand(5, 1))


def test_deterministic():
    x, w, b = (
        randn(9, 4097, dtype=torch.bfloat16),
        randn(4097, dtype=torch.bfloat16),
        randn(4097, dtype=torch.bfloat16),
    )
    assert torch.equal(layer_norm(x, w, b), layer_norm(x, w, b))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 4),
    n=st.integers(2, 300),
    log_scale=st.floats(-3, 3),
    shift=st.floats(-100, 100),
    k=st.integers(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_zero_mean_unit_variance_and_invariances(
    m, n, log_scale, shift, k, seed
):
    """With eps = 0: mean(y) = 0 and var(y) = 1 (unless the row is constant); y(2**k·x) = y(x) bit
    for bit (scaling by a power of two is exact in every step); y(x + c) ≈ y(x)."""
    g = torch.Generator().manual_seed(seed)
    x = randn(m, n, scale=10.0**log_scale, generator=g)
    y = layer_norm(x, eps=0.0)
    y64 = y.double()
    assert y64.mean(-1).abs().max().item() < 1e-5
    torch.testing.assert_close(
        y64.var(-1, correction=0), torch.ones(m, dtype=torch.float64), rtol=1e-5, atol=0
    )
    assert torch.equal(layer_norm(x * 2.0**k, eps=0.0), y)
    # x + c is rounded in fp32: it moves each entry by up to u·|x + c|, i.e. x̂ by that times rstd.
    xs = x + shift * 10.0**log_scale
    rstd = 1 / x.double().std(-1, correction=0, keepdim=True)
    tol = (
        4
        * U32
        * (
            xs.double().abs().amax(-1, keepdim=True)
            + x.double().abs().amax(-1, keepdim=True)
        )
        * rstd
    )
    assert bool(
        (
            (layer_norm(xs, eps=0.0).double() - y64).abs()
            <= tol * math.log2(4 * n) + 1e-6
        ).all()
    )


# ------------------------------------------------------------------ bad arguments, before any launch


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: layer_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (
            lambda: layer_norm(torch.ones(3, 4, dtype=torch.int32)),
            TypeError,
            "x must be",
        ),
        (lambda: layer_norm(torch.tensor(1.0)), ValueError, "at least one dimension"),
        (
            lambda: layer_norm(torch.ones(3, 4), torch.ones(5)),
            ValueError,
            "weight must have shape (4,)",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), torch.ones(4, 1)),
            ValueError,
            "weight must have shape",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), torch.ones(4, dtype=torch.int64)),
            TypeError,
            "weight must be",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), "w"),
            TypeError,
            "weight must be a torch.Tensor",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), None, torch.ones(3)),
            ValueError,
            "bias must have shape (4,)",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), None, torch.ones(4, dtype=torch.bool)),
            TypeError,
            "bias must be",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), None, 0.0),
            TypeError,
            "bias must be a torch.Tensor",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), None, torch.ones(4, device="meta")),
            ValueError,
            "bias is on meta",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), torch.ones(4, device="meta")),
            ValueError,
            "weight is on meta",
        ),
        (
            lambda: layer_norm(torch.ones(3, 4), eps=-1e-5),
            ValueError,
            "eps must be finite and >= 0",
        ),
        (lambda: layer_norm(torch.ones(3, 4), eps=float("nan")), ValueError, "eps"),
        (lambda: layer_norm(torch.ones(3, 4), eps=float("inf")), ValueError, "eps"),
        (
            lambda: layer_norm(torch.ones(3, 4), eps="1e-5"),
            TypeError,
            "eps must be a real number",
        ),
        (lambda: layer_norm(torch.ones(3, 4), eps=True), TypeError, "eps"),
        (
            lambda: layer_norm(torch.ones(3, 4, device="meta")),
            ValueError,
            "x is on meta",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "layer_norm", call, exc, words)
