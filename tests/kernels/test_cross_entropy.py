"""normbook.cross_entropy, forward and backward, against the float64 reference
(normbook.reference.cross_entropy / cross_entropy_grad) and torch.nn.functional.cross_entropy.

Tolerances. The kernel works in fp32 on the (rounded) logits. Per row, the running sum s of
exp(x - m) errs relatively by a few 2**-24 per term plus the summation's log2(BLOCK_N) + blocks
(<= 12 + 38 for V = 151,936) times 2**-24, and |x - m|·2**-24 where a GPU's exp2 rounds its
argument: log(s) is then off by < 2e-6 absolutely for these inputs (|x - m| < 40). Forming
lse = m + log s and ℓ = lse − x_t rounds twice more, 2**-24·(|lse| + |ℓ|) <= 2**-23·(|lse| + |x_t|).
So per row |ℓ' − ℓ| <= 2e-6 + 2**-23·(|lse| + |x_t|) =: e_r, and the reduced loss adds the fp32
sum's M·2**-24·Σ|ℓ| and one rounding to the output dtype, u·|result|. A kernel that dropped the
online rescaling, or summed the ignored rows, misses these bounds by orders of magnitude.

Gradient: dx = g·(p − e_t) with p = exp(x − lse): the relative error of p is below 1e-5 by the
same argument, then one rounding u·|dx|, and for fp16's subnormals 2**-25 absolute.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_rejected_before_launch,
    nothing_saved,
    randn,
)

from normbook import DEVICE, cross_entropy
from normbook import reference as ref

ce_mod = importlib.import_module(
    "normbook.cross_entropy"
)  # the module, not the function
QWEN3_VOCAB = 151_936
REDUCTIONS = ["mean", "sum", "none"]


def targets(m, v, ignored=(), ignore_index=-100, generator=None):
    t = torch.randint(0, v, (m,), generator=generator)
    for r in ignored:
        t[r] = ignore_index
    return t.to(DEVICE)


def loss_bound(x, t, reduction, dtype, ignore_index=-100):
    """The bound argued in the module docstring, reduced like the loss."""
    x64 = x.double().cpu().reshape(-1, x.shape[-1])
    t64 = t.cpu().reshape(-1)
    keep = t64 != ignore_index
    lse = ref.logsumexp(x64)[:, 0]
    x_t = x64.gather(1, torch.where(keep, t64, 0)[:, None])[:, 0]
    per_row = torch.where(
        keep, 2e-6 + 2.0**-23 * (lse.abs() + x_t.abs()), torch.zeros(())
    )
    expected = ref.cross_entropy(x, t, ignore_index, reduction).cpu()
    u = UNIT_ROUNDOFF[dtype]
    if reduction == "none":
        return expected, per_row.reshape(t.shape) + u * expected.abs()
    rows = torch.where(keep, lse - x_t, torch.zeros(())).abs()
    total = per_row.sum() + len(t64) * 2.0**-24 * rows.sum()
    if reduction == "mean":
        total = total / keep.sum()
    return expected, total + u * expected.abs()


def assert_loss_close(got, x, t, reduction, dtype, ignore_index=-100):
    expected, bound = loss_bound(x, t, reduction, dtype, ignore_index)
    assert got.dtype == dtype and got.shape == expected.shape
    got64 = got.detach().double().cpu()
    assert torch.equal(torch.isnan(got64), torch.isnan(expected))
    finite = torch.isfinite(expected)
    assert torch.equal(
        got64[~finite & ~torch.isnan(expected)],
        expected[~finite & ~torch.isnan(expected)],
    )
    err = (got64 - expected).abs()[finite]
    assert bool((err <= bound[finite]).all()), (
        f"{reduction} ({dtype}): error {err.max():.3g}"
    )


def assert_grad_close(dx, x, t, reduction, dtype, g=None, ignore_index=-100):
    """|dx − dx_ref| <= u|dx_ref| + 1e-5·|g|(p + e_t) (+2**-24 for fp16)."""
    x64 = x.double().cpu()
    t64 = t.cpu()
    if reduction == "none":
        g64 = g.double().cpu().reshape(-1, 1)
        expected = (
            ref.cross_entropy_grad(x64, t64, ignore_index, "sum").reshape(
                -1, x.shape[-1]
            )
            * g64
        )
        expected = expected.reshape(x.shape)
        gabs = g64.abs()
    else:
        g64 = 1.0 if g is None else g.double().item()
        expected = ref.cross_entropy_grad(x64, t64, ignore_index, reduction) * g64
        n = (t64 != ignore_index).sum().item()
        gabs = torch.tensor(abs(g64) / (n if reduction == "mean" and n else 1))
    p = ref.softmax(x64.reshape(-1, x.shape[-1]))
    size = (gabs * (p + 1)).reshape(x.shape)
    u = UNIT_ROUNDOFF[dtype]
    bound = (
        u * expected.abs() + 1e-5 * size + (2.0**-24 if dtype == torch.float16 else 0)
    )
    assert dx.dtype == dtype and dx.shape == x.shape
    err = (dx.double().cpu() - expected).abs()
    assert torch.equal(torch.isnan(err), torch.isnan(expected))
    ok = torch.isnan(err) | (err <= bound)
    assert bool(ok.all()), f"dx ({dtype}, {reduction}): error {err[~ok].max():.3g}"


def run_backward(x, t, reduction, g=None, **kw):
    x = x.detach().requires_grad_()
    loss = cross_entropy(x, t, reduction=reduction, **kw)
    loss.backward(torch.ones_like(loss) if g is None else g)
    return loss.detach(), x.grad


# ------------------------------------------------------------------ forward


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("v", [1, 7, 1000, 4097, 40000])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_reference(dtype, v, reduction, poison_empty):
    x = randn(6, v, dtype=dtype, scale=3.0)
    t = targets(6, v, ignored=[2])
    assert_loss_close(cross_entropy(x, t, reduction=reduction), x, t, reduction, dtype)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_qwen3_vocabulary_at_small_m(dtype, poison_empty):
    """V = 151,936: 38 blocks of 4096 per row, one pass each; the first target sits in the last,
    partial block."""
    x = randn(3, QWEN3_VOCAB, dtype=dtype, scale=2.0)
    t = torch.tensor([QWEN3_VOCAB - 1, -100, 12345], device=DEVICE)
    for reduction in REDUCTIONS:
        assert_loss_close(
            cross_entropy(x, t, reduction=reduction), x, t, reduction, dtype
        )
    assert ce_mod._config(3, QWEN3_VOCAB)[:2] == (1, 4096)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_torch(reduction):
    x = randn(9, 1000, scale=3.0)
    t = targets(9, 1000, ignored=[0, 4])
    got = cross_entropy(x, t, reduction=reduction)
    expected = F.cross_entropy(x, t, reduction=reduction)
    # Both within ~1e-6·(1 + |ℓ|) of the truth (the docstring's e_r with |lse|, |x_t| < 20).
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_closer_to_the_truth_than_torch_or_as_close(dtype):
    """The kernel rounds once, at the end; PyTorch's CPU path may round log_softmax to the
    input dtype first. Ours is within u·|ℓ| + e_r of float64 truth, whatever torch does."""
    x = randn(16, 3000, dtype=dtype, scale=3.0)
    t = targets(16, 3000)
    got = cross_entropy(x, t, reduction="none")
    truth = ref.cross_entropy(x, t, reduction="none").cpu()
    ours = (got.double().cpu() - truth).abs().max()
    theirs = (
        (F.cross_entropy(x, t, reduction="none").double().cpu() - truth).abs().max()
    )
    assert ours <= theirs + UNIT_ROUNDOFF[dtype] * truth.abs().max()


@pytest.mark.parametrize("ignore_index", [-100, 0, 3, -1])
def test_ignore_index(ignore_index):
    x = randn(8, 7)
    t = torch.tensor([0, 3, 3, 1, 6, 2, 0, 5], device=DEVICE)
    if ignore_index == -1:
        t[2] = -1
    for reduction in REDUCTIONS:
        got = cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)
        assert_loss_close(got, x, t, reduction, torch.float32, ignore_index)
        expected = F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction)
        torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)


def test_all_ignored_rows_match_torch():
    """Every target ignored: "mean" is 0/0 = NaN (as F.cross_entropy), "sum" is 0, "none" zeros;
    the gradient is zero everywhere, including for "mean"."""
    x = randn(4, 9)
    t = torch.full((4,), -100, device=DEVICE)
    for reduction in REDUCTIONS:
        loss, dx = run_backward(x, t, reduction)
        xt = x.clone().requires_grad_()
        expected = F.cross_entropy(xt, t, reduction=reduction)
        expected.backward(torch.ones_like(expected))
        assert torch.equal(
            torch.isnan(loss.cpu()), torch.isnan(expected.detach().cpu())
        )
        torch.testing.assert_close(loss.cpu(), expected.detach().cpu(), equal_nan=True)
        assert torch.equal(dx.cpu(), xt.grad.cpu()) and torch.equal(
            dx, torch.zeros_like(dx)
        )
    assert torch.isnan(cross_entropy(x, t)).item()


def test_no_rows():
    """M = 0: as F.cross_entropy, "mean" is NaN, "sum" 0, "none" empty; gradients empty."""
    x = torch.empty(0, 11, device=DEVICE)
    t = torch.empty(0, dtype=torch.int64, device=DEVICE)
    for reduction in REDUCTIONS:
        loss, dx = run_backward(x, t, reduction)
        expected = F.cross_entropy(x, t, reduction=reduction)
        assert loss.shape == expected.shape and dx.shape == (0, 11)
        torch.testing.assert_close(loss.cpu(), expected.cpu(), equal_nan=True)


def test_one_dimensional_logits():
    x = randn(50, scale=2.0)
    t = torch.tensor(17, device=DEVICE)
    for reduction in REDUCTIONS:
        got = cross_entropy(x, t, reduction=reduction)
        expected = F.cross_entropy(x, t, reduction=reduction)
        assert got.shape == expected.shape == ()
        torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-6, atol=1e-6)


def test_hand_calculation():
    """Logits (1, 2, 3), target 2: ℓ = log(e + e² + e³) − 3 = log(1 + e⁻¹ + e⁻²)."""
    import math

    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64, device=DEVICE)
    got = cross_entropy(x, torch.tensor([2], device=DEVICE)).item()
    assert abs(got - math.log(1 + math.exp(-1) + math.exp(-2))) < 1e-15


@pytest.mark.parametrize(
    "dtype, big", [(torch.float32, 1e4), (torch.float16, 6e4), (torch.bfloat16, 3e38)]
)
def test_large_logits_do_not_overflow(dtype, big):
    x = randn(2, 5000, dtype=dtype)
    x[0, 4999] = big  # the max arrives in the last block: the running sum is rescaled
    x[1, 0] = big  # the max comes first
    t = torch.tensor([4999, 7], device=DEVICE)
    loss = cross_entropy(x, t, reduction="none")
    assert (
        loss[0].item() == 0.0
    )  # lse = big exactly, up to fp32 rounding of big + log(1 + tiny)
    assert torch.isfinite(loss).all()
    assert_loss_close(loss, x, t, "none", dtype)


def test_strided_rows_and_non_contiguous_logits():
    base = randn(5, 1037)
    x = base[:, 5:1005]  # row stride 1037, used in place
    t = targets(5, 1000, ignored=[1])
    assert_loss_close(
        cross_entropy(x, t, reduction="none"), x, t, "none", torch.float32
    )
    xt = randn(30, 6).t()  # stride(-1) = 6: copied once
    t6 = targets(6, 30)
    assert_loss_close(
        cross_entropy(xt, t6, reduction="sum"), xt, t6, "sum", torch.float32
    )
    t_strided = targets(12, 30)[::2]  # a strided target
    assert_loss_close(
        cross_entropy(xt, t_strided), xt, t_strided, "mean", torch.float32
    )


def test_nan_inf_and_masked_logits_stay_in_their_row():
    x = randn(6, 5000)
    x[1, 17] = float("nan")
    x[2, 4000] = float("inf")
    x[3, :] = float("-inf")  # nothing finite: lse = -inf, loss NaN
    x[4, :4500] = float("-inf")  # masked vocabulary, -inf in the first blocks
    x[5, 3] = float("-inf")  # the target itself masked: loss = +inf
    t = torch.tensor([0, 1, 2, 3, 4700, 3], device=DEVICE)
    loss = cross_entropy(x, t, reduction="none")
    expected = F.cross_entropy(x, t, reduction="none")
    assert torch.equal(torch.isnan(loss), torch.isnan(expected))
    assert torch.isnan(loss[[1, 2, 3]]).all() and loss[5].item() == float("inf")
    assert_loss_close(loss[[0, 4]], x[[0, 4]], t[[0, 4]], "none", torch.float32)


def test_deterministic():
    x = randn(7, 40000, dtype=torch.bfloat16)
    t = targets(7, 40000, ignored=[3])
    assert torch.equal(cross_entropy(x, t), cross_entropy(x, t))
    assert torch.equal(run_backward(x, t, "mean")[1], run_backward(x, t, "mean")[1])


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("v", [1, 7, 1000, 4097, 40000])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradient_matches_reference(dtype, v, reduction, poison_empty):
    x = randn(5, v, dtype=dtype, scale=3.0)
    t = targets(5, v, ignored=[1])
    g = (
        randn(5, dtype=dtype)
        if reduction == "none"
        else torch.tensor(1.7, dtype=dtype, device=DEVICE)
    )
    _, dx = run_backward(x, t, reduction, g)
    assert_grad_close(dx, x, t, reduction, dtype, g)


def test_gradient_qwen3_vocabulary():
    x = randn(2, QWEN3_VOCAB, dtype=torch.bfloat16, scale=2.0)
    t = torch.tensor([QWEN3_VOCAB - 1, 5], device=DEVICE)
    _, dx = run_backward(x, t, "mean")
    assert_grad_close(dx, x, t, "mean", torch.bfloat16)


def test_gradient_matches_torch():
    x = randn(6, 300, scale=3.0)
    t = targets(6, 300, ignored=[5])
    for reduction in REDUCTIONS:
        g = randn(6) if reduction == "none" else None
        _, dx = run_backward(x, t, reduction, g)
        xt = x.clone().requires_grad_()
        loss = F.cross_entropy(xt, t, reduction=reduction)
        loss.backward(torch.ones_like(loss) if g is None else g)
        torch.testing.assert_close(dx.cpu(), xt.grad.cpu(), rtol=1e-5, atol=1e-7)


def test_gradcheck_float64_through_the_kernels():
    x = randn(4, 9, dtype=torch.float64).requires_grad_()
    t = torch.tensor([0, -100, 8, 3], device=DEVICE)
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(
            lambda a: cross_entropy(a, t, reduction=reduction),  # noqa: B023
            (x,),
        )


def test_gradcheck_float64_wide_vocab_fast_mode():
    x = randn(2, 9000, dtype=torch.float64).requires_grad_()
    t = torch.tensor([8999, 4], device=DEVICE)
    assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t), (x,), fast_mode=True)


def test_gradient_of_strided_logits():
    base = randn(5, 1037).requires_grad_()
    x = base[:, 5:1005]
    t = targets(5, 1000, ignored=[2])
    cross_entropy(x, t).backward()
    assert_grad_close(base.grad[:, 5:1005], x.detach(), t, "mean", torch.float32)
    assert torch.equal(base.grad[:, :5], torch.zeros(5, 5))


def test_gradient_nan_row_stays_in_its_row():
    x = randn(4, 50)
    x[1, 3] = float("nan")
    x[2, 7] = float("nan")
    t = torch.tensor([0, 1, -100, 3], device=DEVICE)
    _, dx = run_backward(x, t, "none")
    assert torch.isnan(dx[1]).all()
    assert torch.equal(dx[2], torch.zeros(50))  # ignored: no gradient, NaN or not
    assert torch.isfinite(dx[[0, 3]]).all()


def test_saves_one_float_per_row_not_the_probabilities(monkeypatch):
    """What the backward keeps: the logits (the caller's own tensor), the targets, one lse per
    row and the count: no (M, V) tensor is allocated between forward and backward."""
    x = randn(3, 5000).requires_grad_()
    t = targets(3, 5000)
    loss = cross_entropy(x, t)
    saved = loss.grad_fn.saved_tensors
    assert saved[0].data_ptr() == x.data_ptr()
    assert [tuple(s.shape) for s in saved[1:]] == [(3,), (3,), ()]


def test_no_grad_path_saves_nothing():
    x, t = randn(4, 50), targets(4, 50)
    with_grad = cross_entropy(x.clone().requires_grad_(), t)
    assert with_grad.grad_fn is not None
    with nothing_saved():
        y = cross_entropy(x, t)
    assert y.grad_fn is None and torch.equal(y, with_grad.detach())


# ------------------------------------------------------------------ bad arguments, before any launch


def _x():
    return torch.zeros(3, 5, device=DEVICE)


def _t():
    return torch.tensor([0, 1, 2], device=DEVICE)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (
            lambda: cross_entropy([[1.0]], _t()),
            TypeError,
            "logits must be a torch.Tensor",
        ),
        (lambda: cross_entropy(_x().long(), _t()), TypeError, "logits must be"),
        (
            lambda: cross_entropy(torch.tensor(1.0, device=DEVICE), _t()),
            ValueError,
            "at least one dimension",
        ),
        (
            lambda: cross_entropy(torch.zeros(2, 3, 5, device=DEVICE), _t()),
            ValueError,
            "logits must be (M, V) or (V,)",
        ),
        (
            lambda: cross_entropy(torch.zeros(3, 0, device=DEVICE), _t()),
            ValueError,
            "at least one class",
        ),
        (
            lambda: cross_entropy(_x(), [0, 1, 2]),
            TypeError,
            "target must be a torch.Tensor",
        ),
        (
            lambda: cross_entropy(_x(), _t().float()),
            TypeError,
            "target must hold class indices",
        ),
        (
            lambda: cross_entropy(_x(), torch.tensor([0, 1], device=DEVICE)),
            ValueError,
            "target must have shape (3,)",
        ),
        (
            lambda: cross_entropy(_x(), torch.tensor([0, 5, 1], device=DEVICE)),
            ValueError,
            "in [0, 4] or ignore_index (-100), got 5",
        ),
        (
            lambda: cross_entropy(_x(), torch.tensor([0, -1, 1], device=DEVICE)),
            ValueError,
            "got -1",
        ),
        (
            lambda: cross_entropy(_x(), _t(), ignore_index=1.5),
            TypeError,
            "ignore_index must be",
        ),
        (
            lambda: cross_entropy(_x(), _t(), ignore_index=True),
            TypeError,
            "ignore_index must be",
        ),
        (
            lambda: cross_entropy(_x(), _t(), reduction="avg"),
            ValueError,
            "reduction must be one of",
        ),
        (
            lambda: cross_entropy(_x(), _t(), reduction=None),
            ValueError,
            "reduction must be one of",
        ),
        (lambda: cross_entropy(_x(), _t().to("meta")), ValueError, "target is on meta"),
        (
            lambda: cross_entropy(torch.zeros(3, 5, device="meta"), _t()),
            ValueError,
            "logits is on meta",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, words, monkeypatch):
    assert_rejected_before_launch(monkeypatch, "cross_entropy", call, exc, words)
