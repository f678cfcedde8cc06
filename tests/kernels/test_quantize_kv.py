"""normbook.quantize_kv: an fp8 cache and its scales (vLLM's convention), and what the
quantization costs the attention output (normbook.lab.kv_quant, the decode chapter's
figures)."""

import math

import pytest
import torch
from conftest import LOW_PRECISION, on_cpu, randn

from normbook import quantize_kv
from normbook import reference as ref
from normbook.quantize_kv import FORMATS

# fmt → (relative rounding in the normal range, smallest normal, half a subnormal step)
ROUNDING = {"e4m3": (2.0**-4, 2.0**-6, 2.0**-10), "e5m2": (2.0**-3, 2.0**-14, 2.0**-17)}


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_round_trip_within_fp8_rounding(dtype, fmt, per_head):
    """x8 · scale is x to within fp8's rounding: relative 2^-4 (e4m3) or 2^-3 (e5m2) in
    the normal range, half a subnormal step times the scale below it; the largest
    magnitude maps onto the format's largest value; heads of very different sizes
    each get their own scale."""
    x = randn(3, 4, 10, 16, dtype=dtype) * torch.tensor(
        [1.0, 1e-3, 50.0, 1.0], device=randn(1).device
    ).view(1, 4, 1, 1).to(dtype)
    x8, scale = quantize_kv(x, fmt=fmt, per_head=per_head)
    dtype8, largest = FORMATS[fmt]
    assert x8.dtype == dtype8 and x8.shape == x.shape and x8.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == ((4,) if per_head else ())
    x64, s64 = on_cpu(x).double(), on_cpu(scale).double()
    amax = x64.abs().amax(dim=(0, 2, 3) if per_head else None)
    torch.testing.assert_close(s64, (amax / largest).float().double())
    back = ref.dequantize_kv(x8, scale)
    rel, _, half_sub = ROUNDING[fmt]
    s = s64.reshape(-1)[None, :, None, None]
    assert bool(((back - x64).abs() <= rel * x64.abs() + half_sub * s).all())
    assert on_cpu(x8).double().abs().amax() <= largest


def test_paged_layout_scales_dimension_1():
    """A paged cache (num_blocks, H_kv, block_size, D): one scale per k/v head too."""
    x = randn(7, 2, 16, 8)
    x[:, 1] *= 10
    x8, scale = quantize_kv(x)
    expected = on_cpu(x).abs().amax(dim=(0, 2, 3)) / 448
    torch.testing.assert_close(on_cpu(scale), expected)


def test_zero_head_and_empty_tensor():
    """A head of zeros gets scale 1 (a scale must be > 0) and zeros; an empty cache
    gives an empty fp8 tensor and scales of 1."""
    x = randn(2, 3, 4, 8)
    x[:, 1] = 0
    x8, scale = quantize_kv(x)
    assert on_cpu(scale)[1] == 1.0 and bool((on_cpu(x8[:, 1]).float() == 0).all())
    x8, scale = quantize_kv(randn(0, 3, 4, 8))
    assert x8.shape == (0, 3, 4, 8) and bool((on_cpu(scale) == 1).all())


def test_non_finite_input_gives_a_non_finite_scale():
    """decode_attention then refuses the scale: no silent cache of NaN."""
    x = randn(1, 2, 4, 8)
    x[0, 0, 0, 0] = math.inf
    x[0, 1, 0, 0] = math.nan
    _, scale = quantize_kv(x)
    assert not torch.isfinite(scale).any()


BAD = [
    ((lambda: (randn(2, 8).numpy(),), {}), TypeError, "x must be a torch.Tensor"),
    ((lambda: (randn(2, 2, 4, 8).double(),), {}), TypeError, "x must be float32"),
    ((lambda: (randn(2, 4, 8),), {}), ValueError, "x must have 4 dimensions"),
    ((lambda: (randn(1, 2, 4, 8),), {"fmt": "fp8"}), ValueError, "fmt must be"),
    ((lambda: (randn(1, 2, 4, 8),), {"per_head": 1}), TypeError, "per_head must be"),
    (
        (lambda: (randn(1, 2, 4, 8).requires_grad_(),), {}),
        NotImplementedError,
        "x requires grad",
    ),
]


@pytest.mark.parametrize("make, exc, words", BAD, ids=[b[2] for b in BAD])
def test_bad_arguments(make, exc, words):
    args, kwargs = make[0](), make[1]
    with pytest.raises(exc, match=words):
        quantize_kv(*args, **kwargs)


# ---------------------------------------------------------------- what it costs


def test_quantization_error_figures():
    """The decode chapter's figures (normbook.lab.kv_quant.fp8_kv_errors) at a small
    size: fp8 costs an order of magnitude more than a bf16 cache; e5m2 (2 mantissa
    bits) about twice e4m3 (3 bits); and one scale per head pays only where an outlier
    pushes the other heads below fp8's normal range under one scale for the tensor
    (×1000, not ×20: fp8 rounds relatively, unlike int8)."""
    from normbook.lab.kv_quant import fp8_kv_errors

    e = fp8_kv_errors(outliers=(None, 20.0, 1000.0), B=1, H=4, H_kv=2, S=64, D=32)
    for data in ("N(0,1)", "outlier ×20"):
        assert e[data, "bf16"][0] * 4 < e[data, "e4m3 per head"][0]
        assert e[data, "e4m3 per head"][0] * 1.3 < e[data, "e5m2 per head"][0]
    # the other heads' error: per head as without the outlier; per tensor worse
    clean = e["N(0,1)", "e4m3 per head"][1]
    assert e["outlier ×1000", "e4m3 per head"][1] == clean
    assert e["outlier ×1000", "e4m3 per tensor"][1] > 1.1 * clean
