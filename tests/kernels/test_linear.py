"""normbook.linear (x Wᵀ + b) and normbook.matmul, forward and backward, against float64
(normbook.reference), and their batch invariance, bit for bit.

Tolerance: the derived bound of the module's docstring, elementwise,
``bounds.gemm_error_bound`` = (1 + u_out)·γ_{K+1}·(|x|·|W|ᵀ + |b|) + u_out·|y| + η,
γ_n = n·u/(1 − n·u) with the fp32 accumulation's u = 2⁻²⁴. Inputs are rounded to their
dtype first and the reference reads the same rounded values. The bound is loose by
about √K on the accumulation, but it is tight where it matters: a dropped K tile errs
by a whole partial sum, a sum accumulated in bf16 or fp16 by u_out·|partial sum| at
every step, and both exceed it (``test_the_bound_sees_the_bugs_it_guards`` plays them
in float64; planted in the kernel they fail ``test_forward_within_the_derived_bound``),
as would TF32 products (u = 2⁻¹¹ per product, against γ_K's 2⁻²⁴·K).

Sizes, for the interpreter (one program at a time, ~5 ms per K step): N = 300 and
K = 200 are multiples of no tile (fp16/bf16 tiles are 128 × 128 × 64, fp32 64 × 64 ×
32), so the N and K tails and several column tiles are exercised; M = 129 spans two row
tiles of 128 (and three of 64) with one row in the last: its row 128 sits at position
0 of a tile, as it does alone. The batch-invariance rows 0, 63, 64, 127, 128 are the
edges of those tiles.
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    LOW_PRECISION,
    assert_rejected_before_launch,
    on_cpu,
    randn,
)

from normbook import DEVICE, bounds, linear, matmul
from normbook import reference as ref
from normbook._config import gemm_config

lin_mod = importlib.import_module("normbook.linear")
M, N, K = 129, 300, 200
ROWS = (0, 63, 64, 127, 128)


def _assert_within(out, want, bound, what):
    out = out.detach().double().cpu()
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)}"
    assert torch.equal(torch.isnan(out), torch.isnan(want)), f"{what}: NaN pattern"
    inf = torch.isinf(want)
    assert torch.equal(out[inf], want[inf]), f"{what}: Inf mismatch"
    ok = torch.isfinite(want)
    err, bound = (out - want).abs()[ok], bound[ok]
    if err.numel():
        worst = torch.argmax(err / bound)
        assert bool((err <= bound).all()), (
            f"{what}: error {err[worst]:.3g} > bound {bound[worst]:.3g}"
        )


def _poisoned():
    """torch.empty filled with NaN: an element the kernel forgets to write shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        return real(*args, **kwargs).fill_(math.nan)

    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "empty", empty)
    return mp


@pytest.fixture(scope="module", params=LOW_PRECISION, ids=str)
def case(request):
    """x (129, 200), W (300, 200), b (300) of one dtype and y = linear(x, W, b),
    computed once into poisoned memory; shared by the bound and batch-invariance
    tests."""
    dtype = request.param
    torch.manual_seed(0)
    x, w, b = randn(M, K, dtype=dtype), randn(N, K, dtype=dtype), randn(N, dtype=dtype)
    mp = _poisoned()
    try:
        y = linear(x, w, b)
    finally:
        mp.undo()
    return dtype, x, w, b, y


# ---------------------------------------------------------------- the forward


def test_forward_within_the_derived_bound(case):
    dtype, x, w, b, y = case
    assert y.shape == (M, N) and y.dtype == dtype
    x, w, b, y = on_cpu(x, w, b, y)
    _assert_within(y, ref.linear(x, w, b), bounds.gemm_error_bound(x, w, dtype, b), "y")


def test_batch_invariance_bitwise(case):
    """Row r of the 129-row product has the same bits computed alone, in the first 1, 3
    or 64 rows, and at another position of a batch of 3 (the tiles never follow M)."""
    dtype, x, w, b, y = case
    for m in (1, 3, 64):
        assert torch.equal(linear(x[:m], w, b), y[:m]), f"first {m} rows"
    for r in ROWS:
        assert torch.equal(linear(x[r : r + 1], w, b), y[r : r + 1]), f"row {r} alone"
    mixed = torch.cat([x[5:6], x[128:129], x[64:65]])
    assert torch.equal(linear(mixed, w, b), y[[5, 128, 64]]), "rows in another batch"


def test_tiles_follow_n_k_dtype_and_gpu_only():
    """The tile is a function of (N, K, dtype, GPU): it has no M to follow."""
    import inspect

    assert "M" not in inspect.signature(gemm_config).parameters
    assert gemm_config(4096, 4096, torch.bfloat16).BLOCK_K == 64
    assert gemm_config(1, 1, torch.float32).BLOCK_N == 16  # tl.dot's least


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize(
    "xs, n", [((1, 1), 1), ((3, 17), 33), ((2, 3, 40), 5), ((40,), 7)], ids=str
)
def test_small_and_odd_shapes(xs, n, dtype, poison_empty):
    """A single element, sizes below every tile, leading batch dimensions, a 1-D x."""
    x, w, b = randn(*xs, dtype=dtype), randn(n, xs[-1], dtype=dtype), randn(n)
    b = b.to(dtype)
    for bias in (b, None):
        y = linear(x, w, bias)
        assert y.shape == F.linear(x.float(), w.float()).shape
        xc, wc, bc, yc = on_cpu(x, w, bias, y)
        want = ref.linear(xc, wc, bc)
        _assert_within(yc, want, bounds.gemm_error_bound(xc, wc, dtype, bc), "y")


def test_empty_sizes(poison_empty):
    """M = 0: an empty result, no launch; N = 0: likewise; K = 0: the bias (or zeros),
    written by the kernel into poisoned memory."""
    w, b = randn(5, 0), randn(5)
    assert linear(randn(0, 7), randn(5, 7), b).shape == (0, 5)
    assert linear(randn(3, 7), randn(0, 7)).shape == (3, 0)
    assert torch.equal(linear(randn(3, 0), w, b), b.expand(3, 5))
    assert torch.equal(linear(randn(3, 0), w), torch.zeros(3, 5, device=DEVICE))
    assert torch.equal(matmul(randn(2, 0), randn(0, 4)), torch.zeros(2, 4).to(DEVICE))


def test_strided_inputs_are_read_in_place():
    """A column slice of x, a transposed weight, a 3-D x whose rows do not fold into
    one stride: the same bits as contiguous copies (same kernel, same order)."""
    wide = randn(33, 90)
    x = wide[:, 7:77]  # (33, 70), row stride 90
    assert lin_mod._rows(x).data_ptr() == x.data_ptr()  # no copy
    wt = randn(70, 40).t()  # (40, 70), strides (1, 40)
    want = linear(x.contiguous(), wt.contiguous())
    assert torch.equal(linear(x, wt), want)
    x3 = randn(11, 3, 70).transpose(0, 1)  # (3, 11, 70): rows not one stride
    assert torch.equal(linear(x3, wt), linear(x3.contiguous(), wt.contiguous()))
    b = randn(70, 40)
    assert torch.equal(matmul(x, b), matmul(x.contiguous(), b))
    assert torch.equal(matmul(x, wt.t()), want)  # matmul(x, Wᵀ) is linear(x, W)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_nan_and_inf_propagate(dtype):
    """A NaN in x poisons its row; ±Inf gives ±Inf (or NaN where +Inf meets -Inf, or
    Inf meets a zero weight), as the float64 formula says."""
    x, w = randn(4, 20, dtype=dtype), randn(6, 20, dtype=dtype)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    x[2, 5], x[2, 6] = float("inf"), -float("inf")
    w[1, 0] = 0.0
    y, xc, wc = on_cpu(linear(x, w), x, w)
    want = ref.linear(xc, wc)
    assert torch.isnan(want[0]).all() and torch.isnan(want[1, 1])
    _assert_within(y, want, bounds.gemm_error_bound(xc, wc, dtype).nan_to_num(), "y")


def test_matmul_within_the_derived_bound():
    a, b = randn(2, 5, 70), randn(70, 30)
    y, ac, bc = on_cpu(matmul(a, b), a, b)
    want = ref.linear(ac, bc.T)
    _assert_within(y, want, bounds.gemm_error_bound(ac, bc.T, torch.float32), "a @ b")


def _accumulated_in(dtype, x, w, block_k, drop_last=False):
    """The float64 product summed tile by tile, the running sum rounded to ``dtype``
    after each tile (or its last tile of K dropped): the two bugs the bound guards."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    starts = list(range(0, x.shape[1], block_k))
    for k0 in starts[:-1] if drop_last else starts:
        acc = (acc + x[:, k0 : k0 + block_k] @ w[:, k0 : k0 + block_k].T).to(dtype)
        acc = acc.double()
    return acc


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_bound_sees_the_bugs_it_guards(dtype):
    """The bound is not so loose that an accumulator in the input dtype or a dropped
    last K tile would pass it (played in float64 at the forward test's sizes)."""
    torch.manual_seed(0)
    x, w = randn(M, K, dtype=dtype).cpu().double(), randn(N, K, dtype=dtype).cpu()
    w = w.double()
    bound = bounds.gemm_error_bound(x, w, dtype)
    want = ref.linear(x, w)
    bk = gemm_config(N, K, dtype).BLOCK_K
    for drop in (False, True):
        bad = _accumulated_in(dtype, x, w, bk, drop).to(dtype).double()
        assert ((bad - want).abs() > bound).any(), f"drop_last={drop} passes"


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: linear(randn(2, 4), randn(3, 5)), ValueError, "in_features, 5"),
        (lambda: linear(randn(2, 4), randn(3, 4, 1)), ValueError, "weight must be 2-D"),
        (lambda: linear(randn(2, 4), randn(4)), ValueError, "weight must be 2-D"),
        (lambda: linear(torch.tensor(1.0), randn(3, 1)), ValueError, "x must have"),
        (
            lambda: linear(randn(2, 4), randn(3, 4, dtype=torch.float16)),
            TypeError,
            "weight must have x's dtype",
        ),
        (
            lambda: linear(torch.ones(2, 4, dtype=torch.int32), randn(3, 4)),
            TypeError,
            "x must be",
        ),
        (lambda: linear([[1.0] * 4], randn(3, 4)), TypeError, "x must be a torch"),
        (lambda: linear(randn(2, 4), randn(3, 4), randn(4)), ValueError, "bias"),
        (lambda: linear(randn(2, 4), randn(3, 4), 1.0), TypeError, "bias"),
        (
            lambda: linear(randn(2, 4), randn(3, 4), randn(3, dtype=torch.float16)),
            TypeError,
            "bias must have x's dtype",
        ),
        (
            lambda: linear(torch.ones(2, 4, device="meta"), randn(3, 4)),
            ValueError,
            "x is on meta",
        ),
        (
            lambda: linear(randn(2, 4), torch.ones(3, 4, device="meta")),
            ValueError,
            "weight is on meta",
        ),
        (lambda: matmul(randn(2, 4), randn(5, 3)), ValueError, "b's first dimension"),
        (lambda: matmul(randn(2, 4), randn(4)), ValueError, "b must be 2-D"),
        (
            lambda: matmul(randn(2, 4), randn(4, 3, dtype=torch.bfloat16)),
            TypeError,
            "b must have a's dtype",
        ),
    ],
    ids=[
        "K-mismatch",
        "weight-3d",
        "weight-1d",
        "x-scalar",
        "dtype",
        "int",
        "list",
        "bias-shape",
        "bias-float",
        "bias-dtype",
        "device-x",
        "device-w",
        "matmul-K",
        "matmul-b-1d",
        "matmul-dtype",
    ],
)
def test_bad_arguments_are_refused_before_launch(monkeypatch, call, exc, words):
    assert_rejected_before_launch(monkeypatch, "linear", call, exc, words)


# ---------------------------------------------------------------- the backward


@pytest.fixture(scope="module", params=LOW_PRECISION, ids=str)
def grads(request):
    """x (2, 33, 70) (66 rows), W (50, 70), b (50), δ, and the three gradients, into
    poisoned memory: dW sums over 66 rows, two tiles of 64 in fp32 with a tail."""
    dtype = request.param
    torch.manual_seed(1)
    x = randn(2, 33, 70, dtype=dtype).requires_grad_()
    w = randn(50, 70, dtype=dtype).requires_grad_()
    b = randn(50, dtype=dtype).requires_grad_()
    dy = randn(2, 33, 50, dtype=dtype)
    mp = _poisoned()
    try:
        got = torch.autograd.grad(linear(x, w, b), (x, w, b), dy)
    finally:
        mp.undo()
    return dtype, x, w, b, dy, got


def test_gradients_within_the_derived_bound(grads):
    dtype, x, w, b, dy, (dx, dw, db) = grads
    assert (dx.dtype, dw.dtype, db.dtype) == (dtype,) * 3
    x, w, dy, dx, dw, db = on_cpu(x, w, dy, dx, dw, db)
    want_dx, want_dw, want_db = ref.linear_vjp(x, w, dy)
    d2, x2 = dy.reshape(-1, 50), x.reshape(-1, 70)
    ones = torch.ones(1, d2.shape[0])
    _assert_within(dx, want_dx, bounds.gemm_error_bound(dy, w.T, dtype), "dx")
    _assert_within(dw, want_dw, bounds.gemm_error_bound(d2.T, x2.T, dtype), "dW")
    _assert_within(db, want_db, bounds.gemm_error_bound(d2.T, ones, dtype)[:, 0], "db")


def test_weight_gradient_is_deterministic(grads):
    """dW and db sum over the batch in one fixed order (no atomics): the same bits."""
    dtype, x, w, b, dy, (dx, dw, db) = grads
    again = torch.autograd.grad(linear(x, w, b), (w, b), dy)
    assert torch.equal(again[0], dw) and torch.equal(again[1], db)


def test_only_the_gradients_asked_for_are_computed(monkeypatch):
    """Each gradient is one launch, made only when its input requires grad."""
    launches = []
    real = lin_mod._forward

    def counting(*args, **kwargs):
        launches.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(lin_mod, "_forward", counting)
    x, w, b, dy = randn(4, 6), randn(5, 6), randn(5), randn(4, 5)
    for wanted in ("x", "weight", "bias"):
        args = {"x": x, "weight": w, "bias": b}
        args[wanted] = args[wanted].clone().requires_grad_()
        y = linear(**args)
        del launches[:]
        y.backward(dy)
        assert len(launches) == 1, (wanted, launches)
        assert [n for n, t in args.items() if t.grad is not None] == [wanted]


def test_matmul_gradients():
    a = randn(2, 5, 40, dtype=torch.float32).requires_grad_()
    b = randn(40, 24).requires_grad_()
    dy = randn(2, 5, 24)
    da, db = on_cpu(*torch.autograd.grad(matmul(a, b), (a, b), dy))
    ac, bc, dyc = on_cpu(a, b, dy)
    want_da, want_dwt, _ = ref.linear_vjp(ac, bc.T, dyc)
    d2, a2 = dyc.reshape(-1, 24), ac.reshape(-1, 40)
    _assert_within(da, want_da, bounds.gemm_error_bound(dyc, bc, torch.float32), "da")
    bound = bounds.gemm_error_bound(a2.T, d2.T, torch.float32)
    _assert_within(db, want_dwt.T, bound, "db")


def test_gradcheck_float64():
    x = randn(3, 5, dtype=torch.float64).requires_grad_()
    w = randn(4, 5, dtype=torch.float64).requires_grad_()
    b = randn(4, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(linear, (x, w, b))
    assert torch.autograd.gradcheck(matmul, (x, w.detach().T.requires_grad_()))
