"""The casting conventions of normbook.rms_norm and normbook.fused_add_rms_norm.

``casting_mode`` decides where the result is rounded to the input dtype and ``offset`` shifts
the weight (γ' = offset + γ). Each convention is checked against its float64 model with the
roundings written out (``reference.rms_norm_rounded``). For fp16/bf16 the kernel's only other
error is its fp32 statistics (relative ≲ 1e-7 on these sizes), which can move a value that lies that close
to a rounding boundary to the neighbouring representable number: rarely (a probability of about
1e-7 / u per rounding), and never by more than one ulp per rounding it crosses. Measured in
units of 2u·|y| (at least one ulp): gemma rounds once (1); llama's first rounding may flip x̂
by an ulp, which moves the product by up to one more before its own rounding (2); ``"none"``
also rounds its statistics, so an rstd one ulp off (2u relative) moves x·rstd by up to 2u,
then two more roundings (3). Nearly all elements are equal: at most 1 % (or 3) differ. For fp32 outputs the statistics' error is of the size of an fp32 ulp,
so RMSNorm's own tolerance applies (conftest.norm_tolerance).
"""

import importlib

import pytest
import torch
from conftest import LOW_PRECISION, UNIT_ROUNDOFF, assert_close_to_reference, randn

from normbook import DEVICE, fused_add_rms_norm, rms_norm
from normbook import reference as ref

MODES = ["llama", "gemma", "none"]
rms_mod = importlib.import_module("normbook.rms_norm")


def assert_within_ulps(got, model, dtype, ulps, min_equal):
    got64, model = got.double().cpu(), model.double().cpu()
    tiny = 2.0**-24 if dtype == torch.float16 else 1e-30  # fp16 subnormal spacing
    bound = ulps * 2 * UNIT_ROUNDOFF[dtype] * model.abs() + ulps * tiny
    err = (got64 - model).abs()
    assert bool((err <= bound).all()), (
        f"max error {err.max().item():.3g} beyond {ulps} ulp"
    )
    unequal = (got64 != model).sum().item()
    assert unequal <= max((1 - min_equal) * model.numel(), 3), unequal


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "n", [7, 1000, 20000]
)  # 20000 fp32 values pass 64 KB: the looped path
def test_each_convention_matches_its_rounding_model(dtype, mode, n, poison_empty):
    x, w = randn(6, n, dtype=dtype, scale=3.0), randn(n, dtype=dtype, scale=0.3)
    y = rms_norm(x, w, 1e-6, offset=1.0, casting_mode=mode)
    model = ref.rms_norm_rounded(x.cpu(), w.cpu(), 1e-6, 1.0, mode)
    if dtype == torch.float32:
        # fp32 statistics err by as much as an fp32 ulp: RMSNorm's own tolerance applies
        assert_close_to_reference(
            y, model, dtype, weight_max=1.0 + w.abs().max().item()
        )
    else:
        ulps = {"gemma": 1, "llama": 2, "none": 3}[mode]  # see the module docstring
        assert_within_ulps(y, model, dtype, ulps, 0.99)
    # and the fused kernel computes the same on h = x + r, bit for bit
    r = randn(6, n, dtype=dtype)
    yf, h = fused_add_rms_norm(x - r, r, w, 1e-6, offset=1.0, casting_mode=mode)
    assert torch.equal(yf, rms_norm(h, w, 1e-6, offset=1.0, casting_mode=mode))


def test_default_is_llama_with_zero_offset():
    x, w = randn(5, 300, dtype=torch.bfloat16), randn(300, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, w), rms_norm(x, w, offset=0.0, casting_mode="llama"))
    # gemma differs from llama in bf16 (one rounding fewer) on a visible share of elements
    assert not torch.equal(rms_norm(x, w, casting_mode="gemma"), rms_norm(x, w))


@pytest.mark.parametrize("mode", MODES)
def test_float64_conventions_all_equal_the_formula(mode):
    """In float64 every rounding is the identity: each convention is the formula itself."""
    x, w = randn(4, 300, dtype=torch.float64), randn(300, dtype=torch.float64)
    y = rms_norm(x, w, 1e-6, offset=0.5, casting_mode=mode)
    torch.testing.assert_close(
        y.cpu(), ref.rms_norm(x, w, 1e-6, 0.5).cpu(), rtol=1e-13, atol=0
    )


def test_none_overflows_in_fp16_like_the_naive_code():
    """x² rounded to fp16 overflows past 256: the cautionary mode shows the naive code's failure,
    while llama (fp32 statistics) does not."""
    x = torch.full((1, 64), 300.0, dtype=torch.float16, device=DEVICE)
    naive = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (naive.cpu() == 0).all()
    assert torch.equal(rms_norm(x, casting_mode="none").cpu(), naive.cpu())
    assert torch.allclose(
        rms_norm(x).float(), torch.ones(1, 64, device=DEVICE), atol=1e-3
    )


def exact_statistics_rows(m, n, dtype):
    """Rows whose mean square is exactly 4 (eps = 0): the fp32 sum of squares is exact in any
    order and 1/sqrt(4) = 0.5 exactly, so no implementation's statistics can differ. Random
    signs, order and power-of-two scale per row; magnitudes 3 (x4), 2 (x6), 1 (x4), 0 (x2)."""
    mags = torch.tensor([3.0] * 4 + [2.0] * 6 + [1.0] * 4 + [0.0] * 2)
    assert n % 16 == 0 and (mags**2).mean() == 4
    rows = []
    for _ in range(m):
        row = mags.repeat(n // 16)[torch.randperm(n)] * torch.randint(0, 2, (n,)).mul(
            2
        ).sub(1)
        rows.append(row * 2.0 ** torch.randint(-3, 4, ()).item())
    return torch.stack(rows).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_gemma_matches_gemma3_rmsnorm_bit_for_bit(dtype):
    """transformers' Gemma3RMSNorm: x̂ in fp32 times (1 + γ) in fp32, one cast at the end.
    With exact statistics (see above) every remaining operation is the same correctly rounded
    fp32 operation in the same order: the same bits."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    n = 64
    module = Gemma3RMSNorm(n, eps=0.0).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n).mul(0.3).to(dtype))
    x = exact_statistics_rows(5, n, dtype)
    with torch.no_grad():
        expected = module(x)
    got = rms_norm(x, module.weight.detach(), 0.0, offset=1.0, casting_mode="gemma")
    assert torch.equal(got.cpu(), expected.cpu())
    # offset=1.0 is not the same as passing weight + 1: that sum is rounded to the dtype first
    shifted = rms_norm(x, module.weight.detach() + 1.0, 0.0, casting_mode="gemma")
    assert dtype == torch.float32 or not torch.equal(shifted.cpu(), expected.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemma_matches_gemma3_rmsnorm_on_random_rows(dtype):
    """Random rows: torch's CPU statistics differ from ours in the last fp32 bits (its sum order,
    and its rsqrt is not correctly rounded): at most one ulp of the output, rarely."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    n = 256
    module = Gemma3RMSNorm(n, eps=1e-6).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n).mul(0.3).to(dtype))
    x = randn(7, n, dtype=dtype, scale=4.0)
    with torch.no_grad():
        expected = module(x)
    got = rms_norm(x, module.weight.detach(), 1e-6, offset=1.0, casting_mode="gemma")
    assert_within_ulps(got, expected, dtype, 1, 0.99)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_with_offset_match_autograd_of_reference(mode):
    """Backward with offset: dx uses γ' = offset + γ, dγ is unchanged (∂γ'/∂γ = 1). fp32 is
    checked tightly (the gradient's fp32 bound, tests/kernels/backward_helpers.py)."""
    from backward_helpers import assert_grad_close

    x, w, dy = randn(5, 300, scale=2.0), randn(300, scale=0.3), randn(5, 300)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(xg, wg, 1e-6, offset=1.0, casting_mode=mode).backward(dy)
    x64, w64 = x.cpu().double().requires_grad_(), w.cpu().double().requires_grad_()
    ref.rms_norm(x64, w64, 1e-6, 1.0).backward(dy.cpu().double())
    rstd = torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat, g = x64.detach() * rstd, dy.cpu().double() * (1.0 + w64.detach())
    dx_scale = rstd * (g.abs() + xhat.abs() * (xhat * g).abs().mean(-1, keepdim=True))
    dw_scale = (dy.cpu().double() * xhat).abs().sum(0)
    assert_grad_close(xg.grad, x64.grad, dx_scale, torch.float32, "dx")
    assert_grad_close(wg.grad, w64.grad, dw_scale, torch.float32, "dweight")


def test_gradcheck_float64_with_offset():
    x = randn(3, 7, dtype=torch.float64).requires_grad_()
    w = randn(7, dtype=torch.float64).requires_grad_()
    for mode in MODES:
        assert torch.autograd.gradcheck(
            lambda a, b: rms_norm(a, b, 1e-6, offset=1.0, casting_mode=mode),  # noqa: B023
            (x, w),
        )


def ones(*shape):
    return torch.ones(*shape, device=DEVICE)


@pytest.mark.parametrize("fn", ["rms_norm", "fused_add_rms_norm"])
@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"casting_mode": "Llama"}, ValueError, "casting_mode must be one of"),
        ({"casting_mode": None}, ValueError, "casting_mode must be one of"),
        ({"casting_mode": 1}, ValueError, "casting_mode must be one of"),
        ({"offset": float("nan")}, ValueError, "offset must be finite"),
        ({"offset": float("inf")}, ValueError, "offset must be finite"),
        ({"offset": "1"}, TypeError, "offset must be a real number"),
        ({"offset": True}, TypeError, "offset must be a real number"),
        ({"offset": 1.0, "weight": None}, ValueError, "offset=1.0 scales the weight"),
    ],
)
def test_bad_conventions_are_rejected_before_launch(
    fn, kwargs, exc, words, monkeypatch
):
    from conftest import assert_rejected_before_launch

    kwargs = dict(kwargs)
    weight = kwargs.pop("weight", ones(4))
    x = ones(3, 4).requires_grad_()
    if fn == "rms_norm":
        call = lambda: rms_norm(x, weight, **kwargs)  # noqa: E731
    else:
        call = lambda: fused_add_rms_norm(x, ones(3, 4), weight, **kwargs)  # noqa: E731
    assert_rejected_before_launch(monkeypatch, fn, call, exc, words)
