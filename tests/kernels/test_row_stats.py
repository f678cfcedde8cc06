"""normbook.row_variance (two-pass, one-pass, Welford/Chan) against the float64 reference.

The reference is ``normbook.reference.mean`` / ``variance`` of the numbers actually stored in ``x``
(upcast to float64, two passes). For every row used here float64 two-pass is exact to far below
the tolerances: its own relative error is about (log2 n)·2**-53·(1 + (κ·log2 n·2**-53)²), and
``test_float64_reference_agrees_with_mpmath`` checks it against 60-digit arithmetic at κ = 1e7.

Tolerances (``bounds``), worst-case bounds derived from the kernels' arithmetic. u is the unit
roundoff of the accumulation format (2**-24 for fp32; 2**-11, 2**-8 for the emulated fp16, bf16),
κ = |μ|/σ the row's offset-to-spread ratio (its condition number for the variance), and
``steps`` = log2(BLOCK_N) + N/BLOCK_N + 4 the longest chain of roundings one element passes
through (a sequential sum per lane over the row's blocks, then a pairwise tree across lanes, then
a division):

- mean: |δμ| <= steps·u·mean|x| for every method;
- two-pass: relative error of σ² <= (steps + 4)·u + (steps·u·(κ + 1))²: the deviations are formed
  from a mean that is off by δμ, which adds exactly (δμ)² to the computed variance;
- Welford/Chan: <= 2·(steps + 4)·u·(κ + 1): each update's deviation is taken from a running mean
  carrying a relative error, so the error grows like κ, not κ² (Chan, Golub & LeVeque);
- one-pass: <= (steps + 4)·u·(1 + κ²): E[x²] = σ²(1 + κ²) carries a relative error of steps·u
  that the subtraction of E[x]² leaves standing, now relative to σ² alone.

The last bound is the book's claim: the one-pass error grows with κ², so at κ ≈ u**-1/2 it is the
size of the variance itself (``test_one_pass_fails_where_the_book_says``).
"""

import math

import mpmath
import numpy as np
import pytest
import torch
from conftest import LOW_PRECISION, assert_rejected_before_launch, randn
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import DEVICE, layer_norm, row_variance
from normbook import reference as ref
from normbook._config import row_config

SIZES = [1, 2, 7, 1000, 4097, 262147]
METHODS = ["two_pass", "one_pass", "welford"]
U_ACC = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float64: 2.0**-53,
}


def rows_for(n):
    return 2 if n > 100_000 else 5


def bounds(x, method, acc_dtype=torch.float32):
    """(reference mean, reference var, |δμ| bound, |δσ²| bound) per row, float64 (see the module docstring)."""
    x64 = x.double().cpu().reshape(-1, x.shape[-1])
    m, n = x64.shape
    cfg = row_config(m, n, x.element_size())
    steps = math.log2(cfg.BLOCK_N) + math.ceil(n / cfg.BLOCK_N) + 4
    u = U_ACC[acc_dtype]
    mu, var = ref.mean(x64)[:, 0], ref.variance(x64)[:, 0]
    sigma = var.sqrt()
    # Written without dividing by σ, so that constant rows (σ = 0) get a bound too: κ·σ = |μ|.
    if method == "two_pass":
        dv = (steps + 4) * u * var + (steps * u * (mu.abs() + sigma)) ** 2
    elif method == "welford":
        dv = 2 * (steps + 4) * u * (mu.abs() + sigma) * sigma
    else:
        dv = (steps + 4) * u * ref.mean_square(x64)[:, 0]  # σ²(1 + κ²) = E[x²]
    return mu, var, steps * u * x64.abs().mean(-1), dv


def check(x, method, acc_dtype=None, what=""):
    mean, var = row_variance(x, method, acc_dtype)
    acc = acc_dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32)
    assert mean.shape == x.shape[:-1] and var.shape == x.shape[:-1]
    assert (
        mean.dtype
        == var.dtype
        == (torch.float64 if acc == torch.float64 else torch.float32)
    )
    mu, v, dmu, dv = bounds(x, method, acc)
    got_mu, got_v = mean.double().cpu().reshape(-1), var.double().cpu().reshape(-1)
    err_mu, err_v = (got_mu - mu).abs(), (got_v - v).abs()
    assert bool((err_mu <= dmu).all()), (
        f"{what} {method} mean: error {err_mu.max():.3g} > {dmu[err_mu.argmax()]:.3g}"
    )
    worst = int(torch.argmax(err_v - dv))
    assert bool((err_v <= dv).all()), (
        f"{what} {method} var: error {err_v[worst]:.3g} > bound {dv[worst]:.3g} at var {v[worst]:.6g}"
    )
    return got_mu, got_v, v


# ------------------------------------------------------------------ accuracy against the reference


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(method, dtype, n, poison_empty):
    """Centered-ish rows (κ ≈ 0.3): every method is accurate; the input dtype only sets the stored numbers."""
    x = randn(rows_for(n), n, dtype=dtype, scale=2.0) + 0.5
    check(x.to(dtype), method, what=f"{dtype} N={n}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("offset", [1e2, 1e4, 1e6])
@pytest.mark.parametrize("n", [7, 4097, 262147])
def test_large_offsets_fp32(method, offset, n):
    """Rows c + z (σ = 1) stored in fp32: two-pass and Welford stay near u·κ or better, one-pass within u·κ²."""
    x = randn(rows_for(n), n) + offset
    check(x, method, what=f"offset {offset:g} N={n}")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_with_an_offset(method, dtype):
    """The common case in a model: bf16/fp16 activations with an offset, fp32 statistics."""
    x = (randn(6, 4096) * 0.5 + 60.0).to(dtype)
    check(x, method, what=str(dtype))


def test_wide_row_merges_blocks_exactly_like_chan():
    """A ramp plus an offset across 262147 elements: the blocks' means differ, Chan's δ² term must count."""
    n = 262147
    x = (
        (torch.linspace(-3, 3, n, dtype=torch.float64) + 500.0)
        .float()[None, :]
        .repeat(2, 1)
        .to(DEVICE)
    )
    x[1] += randn(n) * 0.1
    for method in ("two_pass", "welford"):
        check(x, method, what="ramp")


def test_float64_is_accumulated_in_float64():
    x = randn(3, 5000, dtype=torch.float64) + 1e6
    for method in METHODS:
        mean, var = row_variance(x, method)
        assert mean.dtype == torch.float64
        torch.testing.assert_close(mean, ref.mean(x)[:, 0], rtol=1e-14, atol=0)
        if method != "one_pass":
            torch.testing.assert_close(
                var, ref.variance(x)[:, 0], rtol=1e-7, atol=0
            )  # u64·κ·steps ≈ 1e-8


def test_float64_reference_agrees_with_mpmath():
    """The oracle itself: float64 two-pass vs 60-digit mpmath on an fp32 row with κ = 1e7."""
    x = randn(1, 4096) * 1e-3 + 1e4
    vals = [mpmath.mpf(float(v)) for v in x[0].double().tolist()]
    with mpmath.workdps(60):
        mu = mpmath.fsum(vals) / len(vals)
        var = mpmath.fsum([(v - mu) ** 2 for v in vals]) / len(vals)
        rel = abs((mpmath.mpf(ref.variance(x)[0, 0].item()) - var) / var)
    assert rel < 1e-12


# ------------------------------------------------------------------ the book's claim: one pass fails


def test_one_pass_fails_where_the_book_says():
    """At κ = 1e4 in fp32 (u·κ² ≈ 6) the one-pass variance is noise: wrong by more than 100 % on
    typical rows and negative on some; two-pass and Welford on the same rows err below 1e-2."""
    torch.manual_seed(1)
    x = randn(64, 1024) * 1e-2 + 100.0  # κ = 1e4
    exact = ref.variance(x)[:, 0]
    _, one = row_variance(x, "one_pass")
    rel_one = ((one.double() - exact) / exact).abs()
    assert rel_one.median() > 1.0
    assert (one < 0).any(), "no row came out negative"
    for method in ("two_pass", "welford"):
        _, v = row_variance(x, method)
        assert ((v.double() - exact) / exact).abs().max() < 1e-2


def test_negative_variance_makes_the_normalization_nan():
    """The chapter's concrete input: (1000.1, 1000.2) in fp32. Exact variance 0.0025; one pass gives
    −0.0625 (−0.0713 where the GPU fuses the last multiply-subtract), and sqrt(var + eps) is NaN."""
    x = torch.tensor([[1000.1, 1000.2]], dtype=torch.float32, device=DEVICE)
    exact = ref.variance(x)[0, 0].item()
    assert abs(exact - 0.0025) < 1e-5
    mean, var = row_variance(x, "one_pass")
    assert var.item() < -0.05
    y = (x - mean[:, None]) / torch.sqrt(var[:, None] + 1e-5)
    assert torch.isnan(y).all()
    for method in ("two_pass", "welford"):
        _, v = row_variance(x, method)
        assert abs(v.item() - exact) < 1e-3 * exact
    # The book's LayerNorm kernel uses a sound method: finite, and (x − μ)/σ = ∓1 here.
    y_ln = layer_norm(x, eps=0.0)
    torch.testing.assert_close(
        y_ln.double().cpu(), ref.layer_norm(x, eps=0.0), rtol=1e-3, atol=0
    )


def test_one_pass_in_low_precision_fails_at_small_offsets():
    """In bf16 (u = 2**-8) one pass is lost already at κ ≈ 30, while two-pass and Welford hold."""
    x = (randn(8, 512) * 0.25 + 8.0).to(torch.bfloat16)  # κ ≈ 32, stored in bf16
    exact = ref.variance(x)[:, 0]
    _, one = row_variance(x, "one_pass", torch.bfloat16)
    assert (((one.double() - exact) / exact).abs() > 0.5).any()
    for method in ("two_pass", "welford"):
        check(x, method, torch.bfloat16, what="bf16 acc")


# ------------------------------------------------------------------ low-precision accumulation (emulated)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("acc", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 1000, 4097])
def test_low_precision_accumulation_within_bounds(method, acc, n):
    """Inputs stored in the accumulation format, κ ≈ 3; small values so that fp16 sums stay finite."""
    x = (randn(3, n) * 0.5 + 1.5).to(acc)
    mean, var = row_variance(x, method, acc)
    # Every result is a number of the accumulation format: rounding it there changes nothing.
    assert torch.equal(mean.to(acc).float(), mean) and torch.equal(
        var.to(acc).float(), var
    )
    check(x, method, acc, what=f"acc {acc} N={n}")


def _next_pow2(n):
    return 1 << (n - 1).bit_length()


def _round(v, dtype):
    return np.float32(
        torch.tensor(float(v), dtype=torch.float32).to(dtype).float().item()
    )


def _tree_sum(vals, dtype):
    """Pairwise tree as the kernel builds it (lane j with lane j + H), every partial sum rounded."""
    vals = list(vals) + [np.float32(0.0)] * (_next_pow2(len(vals)) - len(vals))
    while len(vals) > 1:
        h = len(vals) // 2
        vals = [
            _round(np.float32(a) + np.float32(b), dtype)
            for a, b in zip(vals[:h], vals[h:])
        ]
    return vals[0]


@pytest.mark.parametrize("acc", [torch.float16, torch.bfloat16])
def test_emulation_rounds_every_intermediate(acc):
    """ "Accumulate in D" = round every intermediate to D: the kernels agree bit for bit with a
    scalar numpy emulation of the same operations in the same order."""
    x = (randn(1, 6) * 0.3 + 3.0).to(acc)
    xs = [np.float32(v) for v in x[0].float().tolist()]
    n = len(xs)
    mean = _round(_tree_sum(xs, acc) / np.float32(n), acc)
    d = [_round(v - mean, acc) for v in xs]
    var_two = _round(
        _tree_sum([_round(e * e, acc) for e in d], acc) / np.float32(n), acc
    )
    ms = _round(_tree_sum([_round(v * v, acc) for v in xs], acc) / np.float32(n), acc)
    var_one = _round(ms - _round(mean * mean, acc), acc)
    for method, expected in (("two_pass", var_two), ("one_pass", var_one)):
        m, v = row_variance(x, method, acc)
        assert m.item() == mean and v.item() == expected, (
            method,
            m.item(),
            mean,
            v.item(),
            expected,
        )


# ------------------------------------------------------------------ shapes, layouts, special values


def test_population_variance_not_sample():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=DEVICE)
    for method in METHODS:
        mean, var = row_variance(x, method)
        assert (
            mean.item() == 2.5 and var.item() == 1.25
        )  # torch.var(x) would say 5/3 (n − 1)
    assert torch.var(x, correction=0).item() == 1.25


def test_leading_dims_strided_and_transposed():
    x = randn(2, 3, 70)[:, :, 3:67]  # strided rows, last dimension contiguous
    assert not x.is_contiguous()
    for method in METHODS:
        check(x, method, what="strided")
    xt = randn(64, 9).t()  # stride(-1) != 1: copied once
    check(xt, "welford", what="transposed")


def test_single_element_rows_have_zero_variance():
    x = randn(5, 1) + 7.0
    for method in ("two_pass", "welford"):
        mean, var = row_variance(x, method)
        assert torch.equal(mean, x[:, 0]) and torch.equal(var, torch.zeros_like(var))
    check(
        x, "one_pass", what="n = 1"
    )  # fl(x²) − x·x: 0, or one rounding error where a GPU fuses it


def test_empty_inputs():
    for method in METHODS:
        for shape in [(0, 16), (2, 0, 5)]:
            mean, var = row_variance(torch.empty(shape, device=DEVICE), method)
            assert mean.shape == var.shape == shape[:-1] and mean.numel() == 0
        for shape in [(3, 0), (0,)]:  # rows with no elements: mean 0/0, as torch.mean
            mean, var = row_variance(torch.empty(shape, device=DEVICE), method)
            assert (
                mean.shape == shape[:-1]
                and torch.isnan(mean).all()
                and torch.isnan(var).all()
            )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [7, 20000])
def test_nan_and_inf_stay_in_their_row(method, n):
    x = randn(4, n)
    x[1, n // 2] = float("nan")
    x[2, 0] = float("inf")
    mean, var = row_variance(x, method)
    assert torch.isnan(mean[1]) and torch.isnan(var[1])
    assert not torch.isfinite(mean[2]) and torch.isnan(
        var[2]
    )  # inf − inf: as the float64 reference
    assert torch.isnan(ref.variance(x)[2, 0])
    check(x[[0, 3]], method, what="clean rows")
    torch.testing.assert_close(var[[0, 3]], row_variance(x[[0, 3]], method)[1])


def test_deterministic():
    x = randn(9, 20001, dtype=torch.bfloat16) + 3
    for method in METHODS:
        a, b = row_variance(x, method), row_variance(x, method)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 3),
    n=st.integers(1, 300),
    log_offset=st.floats(-2, 5),
    log_scale=st.floats(-3, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_every_method_within_its_bound(m, n, log_offset, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    scale = 10.0**log_scale
    x = randn(m, n, scale=scale, generator=g) + scale * 10.0**log_offset
    for method in METHODS:
        check(x, method, what=f"property n={n}")


# ------------------------------------------------------------------ bad arguments, before any launch


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: row_variance([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (
            lambda: row_variance(torch.ones(3, 4, dtype=torch.int32)),
            TypeError,
            "x must be",
        ),
        (lambda: row_variance(torch.tensor(1.0)), ValueError, "at least one dimension"),
        (
            lambda: row_variance(torch.ones(3, 4, device="meta")),
            ValueError,
            "x is on meta",
        ),
        (
            lambda: row_variance(torch.ones(3, 4), "three_pass"),
            ValueError,
            "method must be one of",
        ),
        (
            lambda: row_variance(torch.ones(3, 4), 2),
            TypeError,
            "method must be a string",
        ),
        (
            lambda: row_variance(torch.ones(3, 4), method=None),
            TypeError,
            "method must be a string",
        ),
        (
            lambda: row_variance(torch.ones(3, 4), acc_dtype="float16"),
            TypeError,
            "acc_dtype must be a torch.dtype",
        ),
        (
            lambda: row_variance(torch.ones(3, 4), acc_dtype=torch.int32),
            ValueError,
            "acc_dtype must be float16",
        ),
        (
            lambda: row_variance(
                torch.ones(3, 4, dtype=torch.float64), acc_dtype=torch.float32
            ),
            ValueError,
            "narrower than x's float64",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "row_stats", call, exc, words)


def test_input_that_requires_grad_is_refused_not_detached(monkeypatch):
    """row_variance has no backward (by design, see its docstring): with grad mode on, an input
    that requires grad gets a clear error before any launch, never statistics without a grad_fn."""
    x = randn(3, 16).requires_grad_()
    assert_rejected_before_launch(
        monkeypatch,
        "row_stats",
        lambda: row_variance(x),
        ValueError,
        "x requires grad, but row_variance is not differentiable",
    )
    monkeypatch.undo()
    with torch.no_grad():
        mean, var = row_variance(x)
    torch.testing.assert_close(
        var, x.detach().var(-1, correction=0), rtol=1e-5, atol=1e-6
    )
    mean, var = row_variance(x.detach())
    assert mean.grad_fn is None and not x.detach().requires_grad
