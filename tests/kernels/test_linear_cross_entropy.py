"""normbook.linear_cross_entropy = cross_entropy(h Wᵀ, t), without the (M, V) logits.

Against float64 (normbook.reference.linear_cross_entropy and autograd through it) in fp32 and
fp64; against the materialized path (F.linear, then normbook.cross_entropy) in bf16/fp16.

Tolerances (u = 2**-24 in fp32). A logit is a d-term dot product: its error is at most
d·u·Σ_k|h_k w_k| (the classical bound for a sum), and the loss of a row moves by at most twice
the largest logit error (lse and the target logit each move by at most that), plus a few u·|ℓ|
for the fp32 lse. The gradients add a V-term (dh) or M-term (dW) sum of the p - e_t terms:
normwise relative error at most about (d + max(M, V))·u; we allow 2·(d + max(M, V))·u. A bug
this guards — a vocabulary block skipped or shifted (its targets off by the block's start),
the mean's 1/count applied twice or not at all, a chunk of rows not written — errs by O(1).
In bf16 the products round to bf16 wherever F.linear rounds, so the kernel must be as accurate
as the materialized path against float64, within a factor of 2 (plus u_bf16 for a flipped
rounding: the recomputed block may differ from the forward's chunk in the last fp32 bit).

Sizes are small for the interpreter, yet every chunking path is taken: M = 37 rows give
chunks of 5 rows with a short last one; V = 300 gives vocabulary blocks of 48 with a short
last one, and target values on every block (ignore_index rows mixed in).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import UNIT_ROUNDOFF, assert_rejected_before_launch, on_cpu, randn

from normbook import DEVICE, cross_entropy, linear_cross_entropy
from normbook import reference as ref

lce = importlib.import_module("normbook.linear_cross_entropy")
M, D, V = 37, 24, 300


def _inputs(dtype, m=M, d=D, v=V, ignore_every=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = randn(m, d, dtype=dtype, generator=gen).requires_grad_()
    w = randn(v, d, dtype=dtype, scale=0.5, generator=gen).requires_grad_()
    t = torch.randint(0, v, (m,), generator=gen)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t.to(DEVICE)


def _exact(h, w, t, reduction, upstream, ignore_index=-100):
    """Loss and (dh, dW) in float64 by autograd through the reference."""
    h64 = on_cpu(h).double().requires_grad_()
    w64 = on_cpu(w).double().requires_grad_()
    loss = ref.linear_cross_entropy(h64, w64, on_cpu(t), ignore_index, reduction)
    dh, dw = torch.autograd.grad(loss, (h64, w64), on_cpu(upstream).double())
    return loss.detach(), dh, dw


def _normwise(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_float64(dtype, reduction, poison_empty):
    h, w, t = _inputs(dtype)
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    assert loss.dtype == dtype and loss.shape == (
        t.shape if reduction == "none" else ()
    )
    upstream = (
        randn(*loss.shape, dtype=dtype) if loss.dim() else randn(1, dtype=dtype)[0]
    )
    dh, dw = torch.autograd.grad(loss, (h, w), upstream)
    want, want_dh, want_dw = _exact(h, w, t, reduction, upstream)
    u = UNIT_ROUNDOFF[dtype]
    hc, wc = on_cpu(h).double(), on_cpu(w).double()
    per_row = (
        2 * D * u * (hc.abs() @ wc.abs().T).max(dim=1).values + 8 * u * want.abs().max()
    )
    keep = on_cpu(t) != -100
    bound = {
        "none": torch.where(keep, per_row, 0.0),
        "sum": per_row[keep].sum(),
        "mean": per_row[keep].mean(),
    }[reduction]
    assert bool(((on_cpu(loss).double() - want).abs() <= bound).all())
    grad_rtol = 2 * (D + max(M, V)) * u
    assert _normwise(on_cpu(dh), want_dh) <= grad_rtol
    assert _normwise(on_cpu(dw), want_dw) <= grad_rtol
    assert bool((on_cpu(dh)[~keep] == 0).all())  # an ignored row gets no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_as_accurate_as_materialized(dtype):
    h, w, t = _inputs(dtype)
    ours = linear_cross_entropy(h, w, t)
    dh, dw = torch.autograd.grad(ours, (h, w))
    mat = cross_entropy(F.linear(h, w), t)
    mdh, mdw = torch.autograd.grad(mat, (h, w))
    want, want_dh, want_dw = _exact(h, w, t, "mean", torch.ones(()))
    u = UNIT_ROUNDOFF[dtype]
    err = lambda a: abs(on_cpu(a).double().item() - want.item())  # noqa: E731
    assert err(ours) <= 2 * err(mat) + u * abs(want.item())
    for got, base, exact in ((dh, mdh, want_dh), (dw, mdw, want_dw)):
        assert _normwise(on_cpu(got), exact) <= 2 * _normwise(on_cpu(base), exact) + u


def test_no_intermediate_of_a_quarter_of_the_logits():
    """A TorchDispatchMode records every storage an op allocates (the Triton kernels' buffers
    are allocated through PyTorch, so they are seen too): forward and backward, none reaches
    M·V/4 elements. The shapes keep V·d below M·V/4, because the weight's gradient (V, d) is an
    output every method must produce (at Qwen3-8B's head it is larger than M·V/4 elements; the
    GPU benchmark therefore measures the memory beyond the inputs and the gradients)."""
    m, d, v = 64, 8, 1000
    h, w, t = _inputs(torch.float32, m, d, v)
    limit = m * v // 4 * 4  # bytes: a quarter of the fp32 logits

    def step(fn):
        loss = fn(h, w, t)
        loss.backward()
        return loss

    _, largest = lce.largest_intermediate(step, linear_cross_entropy)
    assert largest < limit, (largest, limit)
    # The mode sees inside the operator: the backward's block of logits (M, block) is
    # there, and it is larger than every output (dW is V·d elements).
    assert largest >= m * lce.block_words(v) * 4 > v * d * 4, largest
    # The mode sees a materialized path's logits: the measurement can fail.
    _, materialized = lce.largest_intermediate(
        step, lambda h, w, t: cross_entropy(F.linear(h, w), t)
    )
    assert materialized >= m * v * 4


def test_chunk_rule():
    assert lce.chunk_rows(8192) == 1024 and lce.chunk_rows(1) == 1
    assert lce.block_words(151_936) % lce.VOCAB_ALIGN == 0
    assert lce.block_words(151_936) * lce.CHUNKS >= 151_936
    # Peak extra memory at Qwen3-8B's head in bf16, by the module's rule, against a quarter of
    # the logits: the backward's block, the fp32 dh accumulator and one (M, d) bf16 product.
    m, v, d, e = 8192, 151_936, 4096, 2
    peak = max(lce.chunk_rows(m) * v * e, m * lce.block_words(v) * e + m * d * (4 + e))
    assert peak <= m * v * e / 4


def test_ignore_index_value_and_every_target_ignored():
    h, w, t = _inputs(torch.float32)
    t7 = torch.where(
        t == -100, 7, t
    )  # 7 is now the ignored class, -100 no longer occurs
    t7[t7 == 7] = 8
    t7[::5] = 7
    a = linear_cross_entropy(h, w, t7, ignore_index=7)
    b = F.cross_entropy(F.linear(h, w), t7, ignore_index=7)
    assert torch.allclose(a, b, rtol=1e-5)
    # Every target ignored: "mean" is 0/0 = NaN, "sum" 0, and the gradients are 0 (PyTorch).
    none = torch.full_like(t, -100)
    for reduction in ("mean", "sum"):
        loss = linear_cross_entropy(h, w, none, reduction=reduction)
        want = F.cross_entropy(F.linear(h, w), none, reduction=reduction)
        assert torch.equal(loss.isnan(), want.isnan()) and (
            want.isnan() or loss == want
        )
        dh, dw = torch.autograd.grad(loss, (h, w))
        assert bool((dh == 0).all() and (dw == 0).all())


def test_shapes_empty_and_one_row():
    h, w, t = _inputs(torch.float32)
    one = linear_cross_entropy(h[3], w, t[3])  # (d,) hidden, () target
    assert one.shape == () and torch.allclose(
        one, F.cross_entropy(F.linear(h[3], w), t[3])
    )
    empty = h[:0]
    assert linear_cross_entropy(empty, w, t[:0]).isnan()
    assert linear_cross_entropy(empty, w, t[:0], reduction="sum") == 0
    loss = linear_cross_entropy(empty, w, t[:0], reduction="sum")
    (dw,) = torch.autograd.grad(loss, w)
    assert bool((dw == 0).all())


def test_strided_hidden_and_only_weight_requires_grad():
    h, w, t = _inputs(torch.float32)
    wide = randn(M, 2 * D)
    hs = wide[:, 5 : 5 + D]  # rows strided
    w_only = w.detach().clone().requires_grad_()
    a = linear_cross_entropy(hs, w_only, t)
    (dw,) = torch.autograd.grad(a, w_only)
    w2 = w.detach().clone().requires_grad_()
    b = linear_cross_entropy(hs.contiguous(), w2, t)
    (dw2,) = torch.autograd.grad(b, w2)
    # The BLAS may sum a strided operand in another order: equal up to rounding. Elementwise
    # that is not a few ulps of dW (an entry is a sum of M terms that may cancel: measured
    # 4e-5 relatively in one run of many): normwise, as test_matches_float64 bounds
    # each against float64, so the two differ by at most twice that bound.
    assert torch.allclose(a, b, rtol=1e-6)
    assert (
        _normwise(on_cpu(dw), on_cpu(dw2).double())
        <= 2 * 2 * (D + max(M, V)) * 2.0**-24
    )


def test_deterministic():
    h, w, t = _inputs(torch.float32)
    runs = []
    for _ in range(2):
        loss = linear_cross_entropy(h, w, t, reduction="sum")
        runs.append((loss, *torch.autograd.grad(loss, (h, w))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_gradcheck_float64():
    # fast_mode: a random projection of the Jacobian (a few evaluations, not one per input
    # element), which still exposes any wrong entry with probability 1.
    h, w, t = _inputs(torch.float64, m=6, d=5, v=40, ignore_every=4)
    for reduction in ("mean", "none"):
        assert torch.autograd.gradcheck(
            lambda h, w: linear_cross_entropy(h, w, t, reduction=reduction),  # noqa: B023
            (h, w),
            fast_mode=True,
        )


def _bad(**change):
    h, w, t = randn(4, 8), randn(16, 8), torch.tensor([0, 1, 2, 3]).to(DEVICE)
    args = {"hidden": h, "weight": w, "target": t, **change}
    kwargs = {k: args.pop(k) for k in ("ignore_index", "reduction") if k in args}
    return lambda: linear_cross_entropy(
        args["hidden"], args["weight"], args["target"], **kwargs
    )


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (_bad(hidden=randn(2, 4, 8)), ValueError, "hidden"),
        (_bad(weight=randn(16, 7)), ValueError, "weight"),
        (_bad(weight=randn(16)), ValueError, "weight"),
        (_bad(weight=randn(0, 8)), ValueError, "weight"),
        (_bad(weight=randn(16, 8, dtype=torch.float16)), TypeError, "weight"),
        (_bad(hidden=torch.ones(4, 8, dtype=torch.int64)), TypeError, "hidden"),
        (_bad(target=torch.tensor([0, 1, 2])), ValueError, "target"),
        (_bad(target=torch.tensor([0.0, 1, 2, 3])), TypeError, "target"),
        (_bad(target=torch.tensor([0, 1, 2, 16])), ValueError, "target"),
        (_bad(target=[0, 1, 2, 3]), TypeError, "target"),
        (_bad(reduction="avg"), ValueError, "reduction"),
        (_bad(ignore_index=1.5), TypeError, "ignore_index"),
        (_bad(hidden=torch.ones(4, 8, device="meta")), ValueError, "hidden"),
        (_bad(weight=torch.ones(16, 8, device="meta")), ValueError, "weight"),
    ],
    ids=[
        "hidden-3d",
        "weight-d",
        "weight-1d",
        "weight-empty",
        "weight-dtype",
        "hidden-int",
        "target-shape",
        "target-float",
        "target-range",
        "target-list",
        "reduction",
        "ignore_index",
        "hidden-device",
        "weight-device",
    ],
)
def test_bad_arguments_are_refused_before_any_product(monkeypatch, call, exc, words):
    assert_rejected_before_launch(monkeypatch, "linear_cross_entropy", call, exc, words)


def test_benchmark_case_runs_and_measures():
    """The GPU benchmark's memory case, at a CPU size: every provider's loss agrees with the
    materialized one, and the measured extra memory of ours is below a quarter of the logits
    while the materialized path's is the logits (so the measurement can tell them apart)."""
    from normbook.lab.bench import cases

    rows = cases.measure_linear_cross_entropy(
        lambda f: 0.0, DEVICE, torch.float32, (64, 1000, 8)
    )
    ok = {r["provider"]: r for r in rows if r["status"] == "ok"}
    assert {"normbook", "F.linear + normbook.cross_entropy"} <= set(ok)
    assert ok["normbook"]["extra_over_logits"] <= 0.25
    assert ok["F.linear + normbook.cross_entropy"]["extra_over_logits"] >= 1.0
    assert all(r["loss_diff"] <= 1e-5 * abs(r["loss"]) for r in ok.values())
