"""normbook.quantize_fp8, dequantize_fp8 and linear_fp8 against PyTorch's own fp8 casts
and the float64 formulas (normbook.reference).

What is exact, and checked bit for bit:

* ``scale = max(amax / fmax, 2^-126)``, one correctly rounded fp32 division per block;
* ``q`` = PyTorch's ``(x.float() / scale).to(fp8)`` (the kernel rounds by hand, on the
  bits: Triton's interpreter casts 31.6 to 16), on random, heavy-tailed and planted
  values: the roundings that carry into the exponent, ties, fmax, the subnormals, -0;
* ``dequantize_fp8`` = PyTorch's ``(q.float() * scale).to(out_dtype)``, on all 256 bit
  patterns of both formats (NaN and Inf included).

What is bounded (normbook.reference): the round trip ``|x - q·s|`` by half the fp8
spacing at |x/s| times s (2^-4 relative for e4m3, 2^-3 for e5m2, an absolute floor
in the subnormals) plus the division's 2^-23 |x|; the bound is reached within a
factor of two, so truncating instead of rounding (a whole spacing) fails it.
``linear_fp8`` against the float64 product of the dequantized operands: exact
products, γ_127 within a 128-block, γ_{K/128+1} across blocks, one output rounding.

Sizes are small for the interpreter: K = 256 (two blocks of 128), N = 256, M a few
rows, 128 for the (128, 128) blocks; M = 129 puts a row into a second tile.
"""

import importlib

import pytest
import torch
from conftest import assert_rejected_before_launch, on_cpu, randn

import normbook
from normbook import DEVICE, bounds, dequantize_fp8, linear_fp8, quantize_fp8
from normbook import reference as ref

fp8 = importlib.import_module("normbook.fp8")
FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
BLOCKS = [(1, 128), (128, 128)]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t):
    return on_cpu(t).view(torch.uint8)


def _expand(s, block):
    return ref.fp8_blocks(s, block, (s.shape[0] * block[0], s.shape[1] * block[1]))


def _scale_formula(x, block, fmt):
    """max(amax / fmax, 2^-126) in fp32, as PyTorch computes it."""
    bm, bk = block
    M, K = x.shape
    blocks = on_cpu(x).float().abs().view(M // bm, bm, K // bk, bk)
    return torch.clamp_min(blocks.amax(dim=(1, 3)) / FMAX[fmt], 2.0**-126)


def _cast_formula(x, scale, block, fmt):
    """PyTorch's own cast of x / scale, the scale broadcast over its block."""
    return (on_cpu(x).float() / _expand(scale, block).float()).to(FMTS[fmt])


def _heavy(M, K, dtype, seed=0):
    """Random values over many binades (a log-normal spread), with planted zeros, a
    negative zero and a row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(2 * torch.randn(M, K, generator=g))
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 0.0])
    x[-1, 128:] = 0.0
    return x.to(dtype).to(DEVICE)


def _assert_quantized(x, block, fmt):
    q, s = quantize_fp8(x, block=block, fmt=fmt)
    assert q.dtype == FMTS[fmt] and s.dtype == torch.float32
    assert s.shape == (x.shape[0] // block[0], x.shape[1] // block[1])
    assert torch.equal(on_cpu(s), _scale_formula(x, block, fmt)), "scale formula"
    want = _cast_formula(x, on_cpu(s), block, fmt)
    diff = _bits(q) != want.view(torch.uint8)
    assert not diff.any(), (
        f"{int(diff.sum())} values differ from PyTorch's cast, e.g. x = "
        f"{on_cpu(x)[diff][:4].tolist()}: {on_cpu(q)[diff][:4].float().tolist()} "
        f"instead of {want[diff][:4].float().tolist()}"
    )
    return q, s


# ---------------------------------------------------------------- quantize: exact


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_q_and_scale_equal_pytorch(fmt, block, dtype, poison_empty):
    _assert_quantized(_heavy(128 if block[0] > 1 else 5, 256, dtype), block, fmt)


def _planted(fmt):
    """Values of x / s (s = 1: the block's amax is fmax) where rounding is delicate."""
    m, e_min = bounds.FP8[FMTS[fmt]]
    sub = 2.0 ** (e_min - m)  # the subnormal spacing
    v = [FMAX[fmt], 31.6, 15.9, 31.99, 0.99, 1.0 - 2.0**-7, 17.0, 19.0, 2.5, 3.5]
    # just below every power of two from the smallest normal up: rounds up (carry)
    v += [2.0**e * (1 - 2.0 ** -(m + 2)) for e in range(e_min + 1, 9)]
    # ties exactly between two neighbours, both parities
    v += [2.0**e * (1 + (2 * k + 1) * 2.0 ** -(m + 1)) for e in (0, 3) for k in (0, 1)]
    # subnormals: a spacing, 1.5 spacings (a tie), half (a tie to 0), just above
    # half, the top of the subnormals (carries into the smallest normal), -0
    v += [sub, 1.5 * sub, 0.5 * sub, 0.5 * sub * 1.01, 2.0**e_min * (1 - 2.0**-8)]
    v += [0.0, -0.0, 1e-45]
    return torch.tensor(v + [-t for t in v], dtype=torch.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_roundings_that_carry_ties_and_subnormals(fmt):
    v = _planted(fmt)
    x = torch.zeros(1, 128)
    x[0, : v.numel()] = v
    q, s = _assert_quantized(x.to(DEVICE), (1, 128), fmt)
    assert on_cpu(s).item() == 1.0  # amax = fmax: x / s = x exactly
    got = on_cpu(q)[0, : v.numel()].float()
    assert got[1] == 32.0 and got[2] == 16.0  # 31.6 and 15.9 carry
    assert torch.equal(torch.signbit(got), torch.signbit(v)), "signs (and -0) kept"


def test_x_over_scale_may_pass_fmax_by_an_ulp_and_rounds_to_fmax():
    # fl(amax / fl(amax / 448)) = 448.00003 for these amax: the largest value must
    # still be fp8's 448 (rounding, not overflow; the kernel's clamp is a no-op)
    amax = torch.tensor([69.16085815429688, 75.23362731933594, 4.315263748168945])
    assert bool((amax / (amax / 448.0) > 448.0).all())
    x = torch.zeros(3, 128)
    x[:, 5], x[:, 6] = amax, -amax
    q, _ = _assert_quantized(x.to(DEVICE), (1, 128), "e4m3")
    assert (
        _bits(q)[:, 5].tolist() == [0x7E] * 3 and _bits(q)[:, 6].tolist() == [0xFE] * 3
    )


def test_zero_blocks_give_exact_zeros_and_the_scale_floor():
    x = torch.zeros(128, 256)
    x[:, 128:] = torch.randn(128, 128)
    x[0, 3] = -0.0
    for block in BLOCKS:
        q, s = _assert_quantized(x.to(DEVICE), block, "e4m3")
        assert bool((on_cpu(s)[:, 0] == 2.0**-126).all())
        y = on_cpu(dequantize_fp8(q, s, block=block))
        assert torch.equal(y[:, :128], x[:, :128]) and not y.isnan().any()
        assert torch.signbit(y[0, 3]), "-0 stays -0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tiny_block_keeps_a_normal_scale(dtype):
    # amax = 2^-140: amax / 448 would be a subnormal scale (2^-149 after rounding) and
    # amax / s = 512 > 448; the floor 2^-126 keeps every x / s below fmax (bf16's
    # subnormals stop at 2^-133: larger values there)
    e = -140 if dtype == torch.float32 else -125
    assert torch.tensor(2.0**-140) / (torch.tensor(2.0**-140) / 448) == 512
    x = torch.zeros(2, 128)
    x[0, :4] = torch.tensor([2.0**e, -(2.0 ** (e - 1)), 3 * 2.0 ** (e - 3), 2.0**-133])
    x[1, 0] = 5 * 2.0**-128
    x = x.to(dtype)
    q, s = _assert_quantized(x.to(DEVICE), (1, 128), "e4m3")
    assert on_cpu(s).flatten().tolist() == [2.0**-126, 2.0**-126]
    err = (ref.dequantize_fp8(on_cpu(q), on_cpu(s)) - x.double()).abs()
    assert bool((err <= bounds.fp8_round_trip_bound(x, on_cpu(s), FMTS["e4m3"])).all())


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_or_inf_makes_its_block_nan(fmt):
    x = randn(4, 256)
    x[0, 7], x[1, 130], x[2, 0] = float("nan"), float("inf"), -float("inf")
    q, s = quantize_fp8(x, fmt=fmt)
    s, bits = on_cpu(s), _bits(q)
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[0, 0] = bad[1, 1] = bad[2, 0] = True
    assert torch.equal(s.isnan(), bad)
    assert bool((bits.view(4, 2, 128)[bad] == 0x7F).all()), "NaN, in both formats"
    # PyTorch's cast of x / NaN is NaN too; the finite blocks are untouched
    want = _cast_formula(x, s, (1, 128), fmt)
    assert torch.equal(want.float().isnan(), on_cpu(q).float().isnan())
    assert torch.equal(
        bits.view(4, 2, 128)[~bad], want.view(torch.uint8).view(4, 2, 128)[~bad]
    )
    y = on_cpu(dequantize_fp8(q, on_cpu(s).to(DEVICE)))
    assert torch.equal(y.isnan(), _expand(bad.double(), (1, 128)).bool())


def test_strided_rows_and_empty_inputs():
    wide = randn(6, 384)
    q, s = quantize_fp8(wide[:, :256])
    q2, s2 = quantize_fp8(wide[:, :256].contiguous())
    assert torch.equal(_bits(q), _bits(q2)) and torch.equal(s, s2)
    q, s = quantize_fp8(randn(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    y = linear_fp8(q, s, *quantize_fp8(randn(128, 256), block=(128, 128)))
    assert y.shape == (0, 128)


# ---------------------------------------------------------------- round trip: bounded


def _round_trip_ratio(x, block, fmt):
    q, s = quantize_fp8(x, block=block, fmt=fmt)
    q, s, x = on_cpu(q, s, x)
    err = (ref.dequantize_fp8(q, s, block) - x.double()).abs()
    return (err / bounds.fp8_round_trip_bound(x, s, FMTS[fmt], block)).max().item()


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_within_its_bound_and_the_bound_is_tight(fmt, block):
    ratio = _round_trip_ratio(_heavy(128, 256, torch.float32, seed=1), block, fmt)
    # within the bound, and reached to within a factor of two: truncation (a whole
    # spacing) or the other format's fmax would fail it
    assert 0.5 < ratio <= 1.0, ratio


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_equals_pytorch_on_every_bit_pattern(fmt, out_dtype, poison_empty):
    q = torch.arange(256, dtype=torch.uint8).repeat(2, 1).view(FMTS[fmt])
    s = torch.tensor([[0.75, 3.0], [2.0**-126, 1e30]])  # (2, 2) blocks of (1, 128)
    y = on_cpu(dequantize_fp8(q.to(DEVICE), s.to(DEVICE), out_dtype=out_dtype))
    want = (q.float() * _expand(s, (1, 128)).float()).to(out_dtype)
    assert torch.equal(y.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(
        y[ok].float().view(torch.int32), want[ok].float().view(torch.int32)
    )


def test_dequantize_weight_blocks():
    x = randn(256, 256)
    q, s = quantize_fp8(x, block=(128, 128))
    y = on_cpu(dequantize_fp8(q, s, block=(128, 128), out_dtype=torch.bfloat16))
    want = ref.dequantize_fp8(on_cpu(q), on_cpu(s), (128, 128)).float()
    assert torch.equal(y, want.to(torch.bfloat16))


# ---------------------------------------------------------------- linear_fp8


def _operands(M, N, K=256, fmt_x="e4m3", fmt_w="e4m3", bx=(1, 128), bw=(128, 128)):
    x = _heavy(M, K, torch.float32, seed=2)
    w = randn(N, K, scale=K**-0.5)
    x_q, x_s = quantize_fp8(x, block=bx, fmt=fmt_x)
    w_q, w_s = quantize_fp8(w, block=bw, fmt=fmt_w)
    return x_q, x_s, w_q, w_s


def _u_acc():
    """The unit roundoff of the accumulation inside a 128-block: fp32 in the
    interpreter; on a GPU, tensor cores truncate (2^-23), and Hopper's fp8 ``wgmma``
    keeps about 14 bits (DeepSeek-V3's measurement): 2^-13."""
    if normbook.INTERPRET:
        return 2.0**-24
    return 2.0**-13 if fp8.native_fp8_dot(torch.empty(0, device=DEVICE)) else 2.0**-23


def _assert_linear(x_q, x_s, w_q, w_s, out_dtype, **blocks):
    y = linear_fp8(x_q, x_s, w_q, w_s, out_dtype=out_dtype, **blocks)
    assert y.dtype == out_dtype and y.shape == (x_q.shape[0], w_q.shape[0])
    args = on_cpu(x_q, x_s, w_q, w_s)
    want = ref.linear_fp8(*args, **blocks)
    bound = bounds.linear_fp8_bound(*args, out_dtype, u_acc=_u_acc(), **blocks)
    err = (on_cpu(y).double() - want).abs()
    assert bool((err <= bound).all()), (err / bound).max().item()
    return y


@pytest.mark.parametrize("out_dtype", IN_DTYPES, ids=str)
def test_linear_within_its_bound(out_dtype, poison_empty):
    _assert_linear(*_operands(5, 256), out_dtype)


@pytest.mark.parametrize(
    "fmt_x, fmt_w, bx, bw",
    [
        ("e5m2", "e4m3", (1, 128), (128, 128)),  # a gradient times a weight
        ("e4m3", "e5m2", (128, 128), (1, 128)),  # the other blocks
    ],
)
def test_linear_formats_and_blocks(fmt_x, fmt_w, bx, bw):
    ops = _operands(128, 256, fmt_x=fmt_x, fmt_w=fmt_w, bx=bx, bw=bw)
    _assert_linear(*ops, torch.float32, block_x=bx, block_w=bw)


def test_linear_is_batch_invariant():
    x_q, x_s, w_q, w_s = _operands(129, 256)
    full = on_cpu(linear_fp8(x_q, x_s, w_q, w_s))
    for M in (1, 3):
        part = on_cpu(linear_fp8(x_q[:M], x_s[:M], w_q, w_s))
        assert torch.equal(part.view(torch.int16), full[:M].view(torch.int16)), M


@pytest.mark.skipif(not normbook.INTERPRET, reason="a GPU takes its own path")
def test_linear_fp8_operand_path_gives_the_same_bits(monkeypatch):
    # The GPU's path from sm_89 (fp8 tensors into tl.dot), run in the interpreter:
    # finite operands decode alike, so the products are the same bits.
    ops = _operands(129, 256, fmt_x="e5m2")
    decoded = linear_fp8(*ops, out_dtype=torch.float32)
    monkeypatch.setattr(fp8, "native_fp8_dot", lambda t: True)
    assert torch.equal(linear_fp8(*ops, out_dtype=torch.float32), decoded)


def test_linear_propagates_nan():
    x_q, x_s, w_q, w_s = _operands(3, 256)
    clean = on_cpu(linear_fp8(x_q, x_s, w_q, w_s, out_dtype=torch.float32))
    x_q = x_q.clone()
    x_q.view(torch.uint8)[1, 200] = 0x7F  # an e4m3 NaN
    y = on_cpu(linear_fp8(x_q, x_s, w_q, w_s, out_dtype=torch.float32))
    assert bool(y[1].isnan().all()) and torch.equal(y[[0, 2]], clean[[0, 2]])


# ---------------------------------------------------------------- refused arguments


def _no_launch(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the kernel was launched with a bad argument")

    monkeypatch.setattr(fp8, "_dequantize", refuse)
    monkeypatch.setattr(fp8, "_linear", refuse)


def _bad_calls():
    x, e4 = randn(4, 256), torch.float8_e4m3fn
    q, s = torch.zeros(4, 256, dtype=e4, device=DEVICE), torch.ones(4, 2, device=DEVICE)
    w, ws = (
        torch.zeros(128, 256, dtype=e4, device=DEVICE),
        torch.ones(1, 2, device=DEVICE),
    )
    grad = randn(4, 256).requires_grad_()
    yield lambda: quantize_fp8(randn(3, 200)), ValueError, "x's shape"
    yield lambda: quantize_fp8(randn(100, 256), block=(128, 128)), ValueError, "x's"
    yield lambda: quantize_fp8(x.double()), TypeError, "x must be"
    yield lambda: quantize_fp8(x.to(e4)), TypeError, "x must be"
    yield lambda: quantize_fp8(x[0]), ValueError, "x must be 2-D"
    yield lambda: quantize_fp8(x.tolist()), TypeError, "x must be a torch.Tensor"
    yield lambda: quantize_fp8(x, fmt="e4m3fnuz"), ValueError, "fmt"
    yield lambda: quantize_fp8(x, fmt=torch.float8_e4m3fn), ValueError, "fmt"
    yield lambda: quantize_fp8(x, block=(1, 64)), ValueError, "block"
    yield lambda: quantize_fp8(x, block=128), ValueError, "block"
    yield lambda: quantize_fp8(x, block=(True, 128)), ValueError, "block"
    yield lambda: quantize_fp8(grad), ValueError, "x requires grad"
    yield lambda: dequantize_fp8(x, s), TypeError, "q must be"
    yield lambda: dequantize_fp8(q, s[:, :1]), ValueError, "scale must have shape"
    yield lambda: dequantize_fp8(q, s.half()), TypeError, "scale must be float32"
    yield lambda: dequantize_fp8(q, s, out_dtype=torch.float64), TypeError, "out_dtype"
    yield lambda: dequantize_fp8(q[:, :200], s), ValueError, "q's shape"
    yield lambda: linear_fp8(q, s, w[:, :128], ws), ValueError, "w_q must have"
    yield lambda: linear_fp8(q, s[:, :1], w, ws), ValueError, "x_scale must have"
    yield lambda: linear_fp8(q, s, w, s), ValueError, "w_scale must have"
    yield lambda: linear_fp8(q, s, w, ws, block_w=(64, 64)), ValueError, "block_w"
    yield lambda: linear_fp8(q, s, w, ws, block_x=(128, 128)), ValueError, "x_q's"
    yield lambda: linear_fp8(q, s, w[:100], ws), ValueError, "w_q's shape"
    yield lambda: linear_fp8(x, s, w, ws), TypeError, "x_q must be"
    yield lambda: linear_fp8(q, s, w.float(), ws), TypeError, "w_q must be"
    yield lambda: linear_fp8(q, s, w, ws, out_dtype="bf16"), TypeError, "out_dtype"
    yield (
        lambda: linear_fp8(q, s.requires_grad_(), w, ws),
        ValueError,
        "x_scale requires grad",
    )


@pytest.mark.parametrize("i", range(27))
def test_bad_arguments_are_refused_before_launch(monkeypatch, i):
    calls = list(_bad_calls())
    assert len(calls) == 27
    call, exc, words = calls[i]
    _no_launch(monkeypatch)
    assert_rejected_before_launch(monkeypatch, "fp8", call, exc, words)


def test_no_grad_lets_a_tensor_that_requires_grad_through():
    x = randn(2, 128).requires_grad_()
    with torch.no_grad():
        q, s = quantize_fp8(x)
    assert q.grad_fn is None and s.shape == (2, 1)
