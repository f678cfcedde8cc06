"""normbook.fused_add_rms_norm against the float64 reference (normbook.reference.fused_add_rms_norm).

Two outputs, two arguments for the tolerance:

* ``residual_out = x + residual`` is one correctly rounded addition (the fp32 sum of two inputs of
  the same low-precision dtype is exact, then it is rounded once), so it must equal torch's own
  ``x + residual`` bit for bit, and lie within one unit roundoff u of the exact sum.
* ``y`` normalizes the *stored* ``residual_out``: against ``reference.rms_norm(residual_out)`` it
  obeys RMSNorm's own tolerance (``norm_tolerance``: two roundings plus the fp32 statistics).
  Against the exact ``x + residual`` it carries the rounding of h as well: each h_i moves by at most
  u·|h_i|, so rms(h) moves by at most u·rms(h) (the RMS is a norm) and h_i / rms(h) by at most 2u
  more, relatively.
"""

import importlib
import math

import pytest
import torch
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_close_to_reference,
    assert_rejected_before_launch,
    norm_tolerance,
    randn,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from normbook import DEVICE, fused_add_rms_norm, rms_norm
from normbook import reference as ref

SIZES = [1, 2, 7, 1000, 4097, 262147]


def rows_for(n):
    return 2 if n > 100_000 else 5


def assert_sum_is_rounded_once(h, x, r, dtype):
    exact = x.double() + r.double()
    u = UNIT_ROUNDOFF[dtype]
    tiny = (
        2.0**-25 if dtype == torch.float16 else 1e-30
    )  # fp16 subnormals: half a spacing, absolute
    assert bool(((h.double() - exact).abs() <= u * exact.abs() + tiny).all())


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(dtype, n, poison_empty):
    x = randn(rows_for(n), n, dtype=dtype, scale=3.0)
    r = randn(rows_for(n), n, dtype=dtype, scale=3.0)
    w = randn(n, dtype=dtype)
    y, h = fused_add_rms_norm(x, r, w, eps=1e-6)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == x.shape
    assert torch.equal(h, x + r), (
        "residual_out must be torch's x + residual, bit for bit"
    )
    assert_sum_is_rounded_once(h, x, r, dtype)
    wmax = w.abs().max().item()
    assert_close_to_reference(y, ref.rms_norm(h, w, 1e-6), dtype, weight_max=wmax)
    # Against the exact sum: two more unit roundoffs (see the module docstring).
    y_exact, _ = ref.fused_add_rms_norm(x, r, w, 1e-6)
    rtol, atol = norm_tolerance(dtype, wmax)
    err = (y.double() - y_exact).abs()
    assert bool((err <= (rtol + 2 * UNIT_ROUNDOFF[dtype]) * y_exact.abs() + atol).all())


@pytest.mark.parametrize(
    "n", [7, 4097, 40000]
)  # 40000 bf16 values pass 64 KB: the looped path
def test_equals_the_unfused_kernels_bit_for_bit(n):
    """Same roundings in the same order as residual add, then normbook.rms_norm."""
    x, r = randn(3, n, dtype=torch.bfloat16), randn(3, n, dtype=torch.bfloat16)
    w = randn(n, dtype=torch.bfloat16)
    y, h = fused_add_rms_norm(x, r, w)
    assert torch.equal(y, rms_norm(x + r, w))
    assert torch.equal(h, x + r)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_without_weight_and_leading_dims(dtype):
    x, r = randn(2, 3, 4, 33, dtype=dtype), randn(2, 3, 4, 33, dtype=dtype)
    y, h = fused_add_rms_norm(x, r, None)
    assert y.shape == h.shape == x.shape
    assert torch.equal(h, x + r)
    assert_close_to_reference(y, ref.rms_norm(h), dtype)


def test_float64_is_accumulated_in_float64():
    x, r, w = (
        randn(4, 513, dtype=torch.float64),
        randn(4, 513, dtype=torch.float64),
        randn(513, dtype=torch.float64),
    )
    y, h = fused_add_rms_norm(x, r, w)
    y_ref, h_ref = ref.fused_add_rms_norm(x, r, w)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_hugging_face_residual_then_qwen3_rmsnorm(dtype):
    """The real reference: a decoder layer's `residual + hidden_states`, then Qwen3RMSNorm."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    n = 256
    module = Qwen3RMSNorm(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n).to(dtype))
    x, r = randn(7, n, dtype=dtype, scale=4.0), randn(7, n, dtype=dtype, scale=4.0)
    with torch.no_grad():
        h_hf = r + x
        y_hf = module(h_hf)
    y, h = fused_add_rms_norm(x, r, module.weight.detach(), eps=1e-6)
    assert torch.equal(h, h_hf)
    # Only the fp32 statistics may differ in their last bit (sum order; rsqrt vs 1/sqrt), which can
    # move x̂ by one ulp and the product by one more.
    ulp = 2 * UNIT_ROUNDOFF[dtype] * y_hf.double().abs() + 2.0**-24
    assert bool(((y.double() - y_hf.double()).abs() <= 2 * ulp).all())
    assert (y == y_hf).float().mean().item() > 0.95


def test_hand_calculation():
    """x + r = (3, 4): rms = sqrt((9 + 16) / 2) = sqrt(12.5)."""
    x = torch.tensor([[1.0, 2.0]], device=DEVICE)
    r = torch.tensor([[2.0, 2.0]], device=DEVICE)
    y, h = fused_add_rms_norm(x, r, None, eps=0.0)
    assert h.tolist() == [[3.0, 4.0]]
    expected = torch.tensor([[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]])
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-6, atol=0)


def test_fp16_squares_do_not_overflow():
    """150 + 150 = 300 and 300**2 overflows fp16 (max 65504): statistics must be fp32."""
    x = torch.full((1, 64), 150.0, dtype=torch.float16, device=DEVICE)
    y, h = fused_add_rms_norm(x, x.clone(), None)
    assert torch.isfinite(y).all() and (h == 300).all()
    assert torch.allclose(y.float(), torch.ones_like(y, dtype=torch.float32), atol=1e-3)


def test_inputs_are_not_modified():
    x, r, w = randn(3, 100), randn(3, 100), randn(100)
    x0, r0, w0 = x.clone(), r.clone(), w.clone()
    fused_add_rms_norm(x, r, w)
    assert torch.equal(x, x0) and torch.equal(r, r0) and torch.equal(w, w0)


def test_strided_rows_are_used_in_place():
    base_x, base_r = randn(6, 1037), randn(6, 1100)
    x, r = (
        base_x[:, 5:1005],
        base_r[:, 90:1090],
    )  # two different row strides, last dimension contiguous
    assert not x.is_contiguous() and not r.is_contiguous()
    w = randn(1000)
    y, h = fused_add_rms_norm(x, r, w)
    assert torch.equal(h, x + r)
    assert_close_to_reference(
        y, ref.rms_norm(h, w), torch.float32, w.abs().max().item()
    )
    xt, rt = randn(64, 9).t(), randn(9, 64)  # a transposed x is copied once
    y, h = fused_add_rms_norm(xt, rt, None)
    assert torch.equal(h, xt + rt)
    assert_close_to_reference(y, ref.rms_norm(h), torch.float32)


def test_empty_inputs():
    for shape in [(0, 16), (3, 0), (0,), (2, 0, 5)]:
        x = torch.empty(shape, device=DEVICE)
        y, h = fused_add_rms_norm(
            x, torch.empty(shape, device=DEVICE), torch.ones(shape[-1], device=DEVICE)
        )
        assert y.shape == h.shape == x.shape and y.numel() == h.numel() == 0


@pytest.mark.parametrize(
    "n", [7, 17000]
)  # 17000 fp32 values pass 64 KB: the looped path
def test_nan_and_inf_stay_in_their_row(n):
    x, r = randn(4, n), randn(4, n)
    x[1, n // 2] = float("nan")
    r[2, 0] = float("inf")
    y, h = fused_add_rms_norm(x, r, None)
    assert torch.isnan(h[1, n // 2]) and torch.isinf(h[2, 0])
    assert torch.isnan(y[1]).all()  # NaN poisons its own row's statistics
    assert (
        torch.isnan(y[2, 0]) and (y[2, 1:] == 0).all()
    )  # 1/sqrt(inf) = 0: inf·0 = NaN, the rest 0
    assert torch.isfinite(y[[0, 3]]).all() and torch.isfinite(h[[0, 3]]).all()
    assert_close_to_reference(y, ref.rms_norm(h), torch.float32)


def test_deterministic():
    x, r, w = (
        randn(9, 4097, dtype=torch.bfloat16),
        randn(9, 4097, dtype=torch.bfloat16),
        randn(4097, dtype=torch.bfloat16),
    )
    a, b = fused_add_rms_norm(x, r, w), fused_add_rms_norm(x, r, w)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 4),
    n=st.integers(1, 300),
    log_scale=st.floats(-3, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_symmetric_in_x_and_residual_and_unit_rms(m, n, log_scale, seed):
    """x + r = r + x exactly, so swapping the inputs changes nothing; and mean(y²) = 1 (eps = 0)."""
    g = torch.Generator().manual_seed(seed)
    x, r = (
        randn(m, n, scale=10.0**log_scale, generator=g),
        randn(m, n, scale=10.0**log_scale, generator=g),
    )
    y, h = fused_add_rms_norm(x, r, None, eps=0.0)
    y2, h2 = fused_add_rms_norm(r, x, None, eps=0.0)
    assert torch.equal(y, y2) and torch.equal(h, h2)
    torch.testing.assert_close(
        (y.double() ** 2).mean(-1),
        torch.ones(m, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )


# ------------------------------------------------------------------ bad arguments, before any launch


def ones(*shape, **kw):
    """A tensor on the kernels' device unless the test asks for another one."""
    kw.setdefault("device", DEVICE)
    return torch.ones(*shape, **kw)


ONES = ones(3, 4)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (
            lambda: fused_add_rms_norm([1.0], ONES, None),
            TypeError,
            "x must be a torch.Tensor",
        ),
        (
            lambda: fused_add_rms_norm(ONES, [1.0], None),
            TypeError,
            "residual must be a torch.Tensor",
        ),
        (
            lambda: fused_add_rms_norm(ones(3, 4, dtype=torch.int32), ONES, None),
            TypeError,
            "x must be",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ones(3, 4, dtype=torch.int32), None),
            TypeError,
            "residual must be",
        ),
        (
            lambda: fused_add_rms_norm(ones(()), ones(()), None),
            ValueError,
            "x must have at least one dimension",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ones(3, 5), None),
            ValueError,
            "residual must have the same shape as x",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ones(4), None),
            ValueError,
            "residual must have the same shape as x",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ones(3, 4, dtype=torch.float16), None),
            TypeError,
            "residual must have the same dtype as x",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ones(3, 4, device="meta"), None),
            ValueError,
            "residual is on meta",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, ones(5)),
            ValueError,
            "weight must have shape (4,)",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, "w"),
            TypeError,
            "weight must be a torch.Tensor",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, ones(4, dtype=torch.int64)),
            TypeError,
            "weight must be",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, ones(4, device="meta")),
            ValueError,
            "weight is on meta",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, None, eps=-1e-6),
            ValueError,
            "eps must be finite and >= 0",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, None, eps=float("nan")),
            ValueError,
            "eps",
        ),
        (
            lambda: fused_add_rms_norm(ONES, ONES, None, eps="1e-6"),
            TypeError,
            "eps must be a real number",
        ),
        (lambda: fused_add_rms_norm(ONES, ONES, None, eps=True), TypeError, "eps"),
        (
            lambda: fused_add_rms_norm(ones(3, 4, device="meta"), ONES, None),
            ValueError,
            "x is on meta",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "fused_add_rms_norm", call, exc, words)


def test_split_rows_match_rms_norm_and_do_not_depend_on_their_batch(poison_empty):
    """8200 bf16 values, past the single-block limit: the split forward (h and its sums per
    block, then the normalization of h) equals residual add then normbook.rms_norm bit for
    bit (the same sums, added the same way), and row 1's y, h and 1/rms are the same alone
    and in a batch of 3. The tail (last block, 8 values) is 40 times larger than the rest, so
    a dropped block would move 1/rms several-fold."""
    fused_module = importlib.import_module("normbook.fused_add_rms_norm")
    n = 8200
    x, r = randn(3, n, dtype=torch.bfloat16), randn(3, n, dtype=torch.bfloat16)
    x[:, -8:] *= 40
    w = randn(n, dtype=torch.bfloat16)
    rms_module = importlib.import_module("normbook.rms_norm")
    # the split is chosen from 512 KiB rows on (normbook._config.rms_split); forced here
    y, h, _ = fused_module._forward(x, r, w, 1e-6, split=True)
    assert torch.equal(h, x + r)
    assert torch.equal(y, rms_module._forward(x + r, w, 1e-6, split=True)[0])
    assert_close_to_reference(
        y, ref.rms_norm(h, w, 1e-6), torch.bfloat16, weight_max=w.abs().max().item()
    )
    batch = fused_module._forward(x, r, w, 1e-6, split=True)
    alone = fused_module._forward(x[1:2], r[1:2], w, 1e-6, split=True)
    assert all(torch.equal(a[0], b[1]) for a, b in zip(alone, batch))
