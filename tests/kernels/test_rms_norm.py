"""normbook.rms_norm against the float64 reference (normbook.reference.rms_norm)."""

import importlib
import math

import pytest
import torch
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_close_to_reference,
    assert_rejected_before_launch,
    randn,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import DEVICE, rms_norm
from normbook import reference as ref
from normbook._config import rms_split

SIZES = [1, 2, 7, 1000, 4097, 262147]


def rows_for(n):
    return 2 if n > 100_000 else 5


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(dtype, n, poison_empty):
    x = randn(rows_for(n), n, dtype=dtype, scale=3.0)
    w = randn(n, dtype=dtype)
    y = rms_norm(x, w, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_to_reference(
        y, ref.rms_norm(x, w, 1e-6), dtype, weight_max=w.abs().max().item()
    )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_without_weight_and_leading_dims(dtype):
    x = randn(2, 3, 4, 33, dtype=dtype)
    y = rms_norm(x)
    assert y.shape == x.shape
    assert_close_to_reference(y, ref.rms_norm(x), dtype)


def test_float64_is_accumulated_in_float64():
    x = randn(4, 513, dtype=torch.float64)
    w = randn(513, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w), ref.rms_norm(x, w), rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_hugging_face_qwen3_rmsnorm(dtype):
    """The real reference: transformers' Qwen3RMSNorm (fp32 statistics, cast, then weight)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    n = 256
    module = Qwen3RMSNorm(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n).to(dtype))
    x = randn(7, n, dtype=dtype, scale=4.0)
    with torch.no_grad():
        expected = module(x)
    got = rms_norm(x, module.weight.detach(), eps=1e-6)
    # Same roundings in the same order. Only the fp32 statistics may differ in their last bit
    # (sum order; rsqrt vs 1/sqrt), which can move x̂ by one ulp and the product by one more.
    ulp = 2 * UNIT_ROUNDOFF[dtype] * expected.double().abs() + 2.0**-24
    assert bool(((got.double() - expected.double()).abs() <= 2 * ulp).all())
    assert (
        got == expected
    ).float().mean().item() > 0.95  # and nearly all bit-identical


def test_fp16_squares_do_not_overflow():
    """300**2 overflows fp16 (max 65504): the statistics must be accumulated in fp32."""
    x = torch.full((1, 64), 300.0, dtype=torch.float16, device=DEVICE)
    y = rms_norm(x)
    assert torch.isfinite(y).all()
    assert torch.allclose(y.float(), torch.ones_like(y, dtype=torch.float32), atol=1e-3)


def test_hand_calculation():
    y = rms_norm(torch.tensor([[3.0, 4.0]], device=DEVICE), eps=0.0)
    expected = torch.tensor([[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]])
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-6, atol=0)
    assert abs((y.double() ** 2).mean().item() - 1.0) < 1e-6


def test_strided_rows_are_used_in_place():
    base = randn(6, 1037, dtype=torch.float32)
    x = base[:, 5 : 5 + 1000]  # row stride 1037, last dimension contiguous
    assert not x.is_contiguous()
    w = randn(1000)
    assert_close_to_reference(
        rms_norm(x, w), ref.rms_norm(x, w), torch.float32, w.abs().max().item()
    )
    x3 = randn(3, 8, 70)[:, ::2, 3:67]  # strided leading dimensions too
    assert_close_to_reference(rms_norm(x3), ref.rms_norm(x3), torch.float32)


def test_non_contiguous_last_dimension_is_copied():
    x = randn(64, 9).t()  # stride(-1) == 9
    assert x.stride(-1) != 1
    assert_close_to_reference(rms_norm(x), ref.rms_norm(x), torch.float32)


def test_empty_inputs():
    for shape in [(0, 16), (3, 0), (0,), (2, 0, 5)]:
        x = torch.empty(shape, device=DEVICE)
        y = rms_norm(x, torch.ones(shape[-1], device=DEVICE))
        assert y.shape == x.shape and y.numel() == 0


@pytest.mark.parametrize("n", [7, 4097])
def test_nan_and_inf_stay_in_their_row(n):
    x = randn(4, n)
    x[1, n // 2] = float("nan")
    x[2, 0] = float("inf")
    y = rms_norm(x)
    assert torch.isnan(y[1]).all()  # NaN poisons its own row's statistics
    assert (
        torch.isnan(y[2, 0]) and (y[2, 1:] == 0).all()
    )  # 1/sqrt(inf) = 0: inf·0 = NaN, the rest 0
    assert torch.isfinite(y[[0, 3]]).all()  # and nothing leaks into the other rows
    assert_close_to_reference(y, ref.rms_norm(x), torch.float32)


def test_zero_row_gives_zeros_with_eps():
    y = rms_norm(torch.zeros(2, 10, device=DEVICE), eps=1e-6)
    assert torch.equal(y, torch.zeros_like(y))


def test_deterministic():
    x, w = randn(9, 4097, dtype=torch.bfloat16), randn(4097, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, w), rms_norm(x, w))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 4),
    n=st.integers(1, 300),
    log_scale=st.floats(-3, 3),
    a=st.floats(0.01, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_scale_invariance_and_unit_rms(m, n, log_scale, a, seed):
    """For eps negligible against the mean square: y(a·x) = y(x) for a > 0, and mean(y²) = 1."""
    g = torch.Generator().manual_seed(seed)
    x = randn(m, n, scale=10.0**log_scale, generator=g)
    y = rms_norm(x, eps=0.0)
    torch.testing.assert_close(rms_norm(a * x, eps=0.0), y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        (y.double() ** 2).mean(-1),
        torch.ones(m, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


# ------------------------------------------------------------------ bad arguments, before any launch


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: rms_norm([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: rms_norm(torch.ones(3, 4, dtype=torch.int32)), TypeError, "x must be"),
        (lambda: rms_norm(torch.tensor(1.0)), ValueError, "at least one dimension"),
        (
            lambda: rms_norm(torch.ones(3, 4), torch.ones(5)),
            ValueError,
            "weight must have shape (4,)",
        ),
        (
            lambda: rms_norm(torch.ones(3, 4), torch.ones(4, 1)),
            ValueError,
            "weight must have shape",
        ),
        (
            lambda: rms_norm(torch.ones(3, 4), torch.ones(4, dtype=torch.int64)),
            TypeError,
            "weight must be",
        ),
        (
            lambda: rms_norm(torch.ones(3, 4), "w"),
            TypeError,
            "weight must be a torch.Tensor",
        ),
        (
            lambda: rms_norm(torch.ones(3, 4), eps=-1e-6),
            ValueError,
            "eps must be finite and >= 0",
        ),
        (lambda: rms_norm(torch.ones(3, 4), eps=float("nan")), ValueError, "eps"),
        (lambda: rms_norm(torch.ones(3, 4), eps=float("inf")), ValueError, "eps"),
        (
            lambda: rms_norm(torch.ones(3, 4), eps="1e-6"),
            TypeError,
            "eps must be a real number",
        ),
        (lambda: rms_norm(torch.ones(3, 4), eps=True), TypeError, "eps"),
        (
            lambda: rms_norm(torch.ones(3, 4), torch.ones(4, device="meta")),
            ValueError,
            "weight is on meta",
        ),
        (lambda: rms_norm(torch.ones(3, 4, device="meta")), ValueError, "x is on meta"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "rms_norm", call, exc, words)


# ------------------------------------------------------------------ rows split over programs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_match_reference_and_do_not_depend_on_their_batch(
    dtype, poison_empty
):
    """8200 elements, past the single-block limit: the forward splits each row over three
    blocks of 4096 (the last holds 8) in two launches. The last 8 values are 40 times the
    others, so they carry most of the sum of squares: a merge that dropped the last block
    would move 1/rms several-fold, far outside the tolerance. Row 1 alone and in the batch
    of 3 gets the same bits (y and the saved 1/rms): its sums are formed by its own
    programs, the same way at any M."""
    rms_module = importlib.import_module("normbook.rms_norm")
    n = 8200  # the split is chosen from 512 KiB rows on; forced here, at interpreter size
    big = 512 * 1024 // dtype.itemsize
    assert rms_split(big, dtype.itemsize) and not rms_split(big - 1, dtype.itemsize)
    assert not rms_split(n, dtype.itemsize) and not rms_split(8192, dtype.itemsize)
    x = randn(3, n, dtype=dtype)
    x[:, -8:] *= 40
    w = randn(n, dtype=dtype)
    batch = rms_module._forward(x, w, 1e-6, split=True)
    alone = rms_module._forward(x[1:2], w, 1e-6, split=True)
    assert_close_to_reference(
        batch[0], ref.rms_norm(x, w, 1e-6), dtype, weight_max=w.abs().max().item()
    )
    assert torch.equal(alone[0][0], batch[0][1]) and torch.equal(
        alone[1][0], batch[1][1]
    )
    # The single-program loop (what rms_norm launches for such rows) agrees within rounding.
    y = rms_norm(x, w, eps=1e-6)
    assert torch.equal(y, rms_module._forward(x, w, 1e-6, split=False)[0])
    assert_close_to_reference(
        y, ref.rms_norm(x, w, 1e-6), dtype, weight_max=w.abs().max().item()
    )
