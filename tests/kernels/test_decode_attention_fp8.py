"""normbook.decode_attention over an fp8 KV cache (vLLM's convention: the cache holds
x / scale in fp8, the attention reads x8 · scale).

The kernel is held to the bound of its own arithmetic against the float64 reference of
the cache as stored (the fp8 values times their scales, exact in float64): the
quantization's error is quantize_kv's, measured in test_quantize_kv.py. Slots past a
row's length hold fp8 NaN (0x7F: e4m3fn's NaN, e5m2's); the interpreter reads an e4m3
NaN as ±480, which still moves the output by far more than the bound.
"""

import math

import pytest
import torch
from attention_bounds import U32, error_bound
from conftest import LOW_PRECISION, assert_rejected_before_launch, on_cpu, randn
from test_decode_attention import NAN, lens, paged_from

import normbook
from normbook import DEVICE, decode_attention, quantize_kv
from normbook import reference as ref
from normbook.decode_attention import KV_CHUNK, _check, _forward

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_cache(lengths, H_kv, S_max, D, fmt, per_head, scale=1.0):
    """(k8, v8, k_scale, v_scale): N(0, scale²) keys, N(0, 1) values quantized by
    quantize_kv, every slot at or past a row's length then fp8 NaN."""
    k, v = (
        randn(len(lengths), H_kv, S_max, D, scale=scale),
        randn(len(lengths), H_kv, S_max, D),
    )
    (k8, ks), (v8, vs) = (quantize_kv(t, fmt=fmt, per_head=per_head) for t in (k, v))
    k16, v16 = k8.half(), v8.half()  # exact, NaN kept: fp8 has no indexed writes
    for b, n in enumerate(lengths):
        k16[b, :, n:] = NAN
        v16[b, :, n:] = NAN
    return k16.to(k8.dtype), v16.to(v8.dtype), ks, vs


def paged_fp8(k8, v8, lengths, page):
    """paged_from through fp16 (exact both ways for fp8 values and NaN)."""
    kp, vp, table = paged_from(k8.half(), v8.half(), lengths, page)
    return kp.to(k8.dtype), vp.to(v8.dtype), table


def assert_fp8_within_bound(out, q, k8, v8, ks, vs, lengths, **kw):
    """attention_bounds.error_bound over the stored cache in float64, plus the merge's
    4 fp32 roundings per chunk (as test_decode_attention.assert_within_bound), plus the
    two roundings fp8 adds: the scores' multiplier scale·log2(e)·κ_k is rounded once
    more (a relative u32 of each score: 2·u32·max Σ|q k| · Σ p|v| after exp and the
    normalization), and κ_v multiplies each chunk's accumulator (u32 · Σ p|v| per
    chunk)."""
    out64 = on_cpu(out).double()
    assert not torch.isnan(out64).any(), "NaN in the output: a slot was misread"
    k64, v64 = ref.dequantize_kv(k8, ks), ref.dequantize_kv(v8, vs)
    scale = kw.get("scale") or q.shape[-1] ** -0.5
    for b, n in enumerate(lengths):
        if n == 0:
            assert bool((out64[b] == 0).all())
            continue
        qb, kb, vb = on_cpu(q[b : b + 1]), k64[b : b + 1, :, :n], v64[b : b + 1, :, :n]
        o, bound = error_bound(qb, kb, vb, out.dtype, causal=True, **kw)
        pv = ref.attention(qb, kb, vb.abs(), causal=True, **kw)
        group = q.shape[1] // kb.shape[1]
        qk = scale * (qb.double().abs() @ kb.repeat_interleave(group, 1).abs().mT)
        chunks = math.ceil(n / KV_CHUNK) + 1
        extra = (4 * chunks + chunks + 2 * qk.amax(-1, keepdim=True)) * U32
        err = (out64[b : b + 1] - o).abs()
        assert bool((err <= bound + extra * pv).all()), f"row {b}: {err.max():.3g}"


# (H, H_kv, Sq, D, lengths, S_max): GQA, several chunks, Sq > 1, an empty row
CASES = [
    (4, 2, 1, 32, [7, 300, 0], 301),
    (6, 3, 3, 24, [3, 200], 256),
]


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head", "per_tensor"])
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_matches_reference_of_the_stored_cache(
    case, dtype, fmt, per_head, poison_empty
):
    """Contiguous and paged (pages of 16, in a random order): within the kernel's bound
    of the float64 reference over x8 · scale; paged equals contiguous bit for bit."""
    H, H_kv, Sq, D, lengths, S_max = case
    q = randn(len(lengths), H, Sq, D, dtype=dtype, scale=2.0)
    k8, v8, ks, vs = fp8_cache(lengths, H_kv, S_max, D, fmt, per_head, scale=2.0)
    assert k8.dtype == FMTS[fmt] and ks.shape == ((H_kv,) if per_head else ())
    out = decode_attention(q, k8, v8, lens(lengths), k_scale=ks, v_scale=vs)
    assert out.dtype == dtype and out.shape == q.shape
    assert_fp8_within_bound(out, q, k8, v8, ks, vs, lengths)
    kp, vp, table = paged_fp8(k8, v8, lengths, 16)
    paged = decode_attention(
        q, kp, vp, lens(lengths), block_table=table, k_scale=ks, v_scale=vs
    )
    assert torch.equal(paged, out)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_fp8_with_window_and_softcap(dtype, poison_empty):
    """The scale folded into the capped score's multiplier (scale/c · κ_k): the bound
    holds with a window and a cap, per-head scales."""
    lengths = [140, 33]
    window, softcap = 50, 5.0
    q = randn(2, 4, 2, 16, dtype=dtype, scale=3.0)
    k8, v8, ks, vs = fp8_cache(lengths, 2, 150, 16, "e4m3", True, scale=3.0)
    kw = dict(window=window, softcap=softcap)
    out = decode_attention(q, k8, v8, lens(lengths), k_scale=ks, v_scale=vs, **kw)
    for b, n in enumerate(lengths):
        first = max(n - 2 - window + 1, 0)
        kb, vb = k8[b : b + 1, :, first:n], v8[b : b + 1, :, first:n]
        ob, qb = out[b : b + 1], q[b : b + 1]
        assert_fp8_within_bound(ob, qb, kb, vb, ks, vs, [n - first], **kw)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_e4m3_as_bytes_equals_fp8_e4m3(dtype, poison_empty):
    """Before sm_89 an e4m3 cache is read as bytes and shifted into fp16 (2^-8 times
    the value; the scales take the 2^8 back): exactly what converting fp8 gives, bit
    for bit, paged, with a window, a cap and per-tensor scales too."""
    lengths = [130, 5, 0]
    q = randn(3, 4, 2, 32, dtype=dtype)
    k8, v8, ks, vs = fp8_cache(lengths, 2, 140, 32, "e4m3", True)
    # subnormal fp8 values (below 2^-6) and the largest, 448, among them
    k8 = k8.view(torch.uint8)
    k8[0, 0, :8, 0] = torch.tensor([1, 2, 7, 8, 0x7E, 0xFE, 0x81, 0], dtype=torch.uint8)
    k8 = k8.view(torch.float8_e4m3fn)
    kp, vp, table = paged_fp8(k8, v8, lengths, 16)
    for kw in (
        {},
        {"window": 7, "softcap": 3.0, "k_scale": 0.01, "v_scale": 0.02},
        {"block_table": table},
    ):
        kw = {"k_scale": ks, "v_scale": vs, **kw}
        k, v = (kp, vp) if "block_table" in kw else (k8, v8)
        args = (q, k, v, lens(lengths), kw.pop("block_table", None))
        checked = _check(*args, None, kw.pop("window", None), **kw)
        native = _forward(*args, *checked, e4m3_bits=False)
        as_bytes = _forward(*args, *checked, e4m3_bits=True)
        assert torch.equal(native, as_bytes), kw


def test_e4m3_nan_read_as_bytes_is_nan():
    """e4m3fn's NaN (S.1111.111) stays NaN through the byte path (a key at a valid slot:
    the output is NaN, as with a NaN key of a bf16 cache)."""
    q = randn(1, 1, 1, 16)
    k8, v8, ks, vs = fp8_cache([4], 1, 4, 16, "e4m3", False)
    k8 = k8.view(torch.uint8)
    k8[0, 0, 2, 3] = 0x7F
    k8 = k8.view(torch.float8_e4m3fn)
    args = (q, k8, v8, lens([4]), None)
    checked = _check(*args, None, None, k_scale=ks, v_scale=vs)
    assert torch.isnan(_forward(*args, *checked, e4m3_bits=True)).all()


def test_scale_forms_agree():
    """A float, a 0-d tensor, a (1,) tensor and an (H_kv,) tensor of equal values: the
    same bits."""
    lengths = [50, 9]
    q = randn(2, 4, 1, 16, dtype=torch.bfloat16)
    k8, v8, _, _ = fp8_cache(lengths, 2, 64, 16, "e4m3", False)
    n = lens(lengths)
    forms = [
        0.0125,
        torch.tensor(0.0125, device=DEVICE),
        torch.tensor([0.0125], device=DEVICE),
        torch.full((2,), 0.0125, device=DEVICE),
    ]
    outs = [decode_attention(q, k8, v8, n, k_scale=s, v_scale=s) for s in forms]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_per_head_scales_reach_their_heads():
    """Scales (1, 4) per head against the float64 reference: a kernel that read one
    head's scale for both (or forgot κ_v) is off by far more than the bound."""
    lengths = [40]
    q = randn(1, 4, 1, 16)
    k8, v8, _, _ = fp8_cache(lengths, 2, 40, 16, "e4m3", True)
    ks = torch.tensor([0.01, 0.04], device=DEVICE)
    vs = torch.tensor([1.0, 4.0], device=DEVICE)
    out = decode_attention(q, k8, v8, lens(lengths), k_scale=ks, v_scale=vs)
    assert_fp8_within_bound(out, q, k8, v8, ks, vs, lengths)
    expected = ref.decode_attention(q, k8, v8, lens(lengths), k_scale=ks, v_scale=vs)
    err = (on_cpu(out).double() - expected).abs().max()
    assert err < 1e-5 * expected.abs().max()


def test_fp8_against_the_fp32_cache():
    """The quantization's effect through the kernel: the fp8 cache's output against the
    fp32 cache's within the reference's own quantization error (the kernel adds ~1e-7)
    and above zero; the lab's figure is the same number."""
    from normbook.lab.kv_quant import decode_inputs, output_error

    q, k, v = decode_inputs(B=2, H=4, H_kv=2, S=160, D=32)
    n = lens([160, 160])
    exact = decode_attention(q, k, v, n)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    fp8 = decode_attention(q, k8, v8, n, k_scale=ks, v_scale=vs)
    err = (fp8 - exact).abs().max().item()
    figure, _ = output_error(q, k, v, "e4m3", True)
    assert 1e-4 < err and abs(err - figure) < 1e-5, (err, figure)


# ---------------------------------------------------------------- bad arguments


def _good():
    q = randn(2, 4, 1, 16)
    k8, v8, ks, vs = fp8_cache([3, 8], 2, 8, 16, "e4m3", True)
    return q, k8, v8, lens([3, 8]), ks, vs


def _bad(make, exc, words):
    return (make, exc, words)


BAD = [
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"v_scale": vs}), ValueError,
     "k_scale is required with an fp8 cache"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks}), ValueError,
     "v_scale is required with an fp8 cache"),
    (lambda q, k, v, n, ks, vs: ((q, k.float(), v.float(), n), {"k_scale": ks,
     "v_scale": vs}), ValueError, "k_scale is only for an fp8 cache"),
    (lambda q, k, v, n, ks, vs: ((q.bfloat16(), k.bfloat16(), v.bfloat16(), n),
     {"v_scale": 1.0}), ValueError, "v_scale is only for an fp8 cache"),
    (lambda q, k, v, n, ks, vs: ((q.to(torch.float8_e4m3fn), k, v, n), {"k_scale": ks,
     "v_scale": vs}), TypeError, "q must be float32, float16 or bfloat16"),
    (lambda q, k, v, n, ks, vs: ((q, k, v.to(torch.float8_e5m2), n), {"k_scale": ks,
     "v_scale": vs}), TypeError, "v_cache must have k_cache's dtype"),
    (lambda q, k, v, n, ks, vs: ((q, k.view(torch.uint8), v, n), {"k_scale": ks,
     "v_scale": vs}), TypeError, "k_cache must be float32, float16, bfloat16, float8"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks[:1].repeat(3),
     "v_scale": vs}), ValueError, "k_scale must have shape () or (1,)"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks, "v_scale":
     vs[:, None]}), ValueError, "v_scale must have shape () or (1,) (per tensor) or "
     "(2,)"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks.double(),
     "v_scale": vs}), TypeError, "k_scale must be float32, got torch.float64"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": "1", "v_scale": vs}),
     TypeError, "k_scale must be a float or a torch.Tensor"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": True, "v_scale": vs}),
     TypeError, "k_scale must be a float or a torch.Tensor, got bool"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": -1.0, "v_scale": vs}),
     ValueError, "k_scale must be a finite number > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks, "v_scale": 0}),
     ValueError, "v_scale must be a finite number > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": math.nan, "v_scale": vs}),
     ValueError, "k_scale must be a finite number > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": math.inf, "v_scale": vs}),
     ValueError, "k_scale must be a finite number > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks.requires_grad_(),
     "v_scale": vs}), NotImplementedError, "k_scale or v_scale requires grad"),
    # Values of a scale tensor: in the operator, before its launch (one host read)
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": -ks, "v_scale": vs}),
     ValueError, "k_scale must be finite and > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks, "v_scale":
     torch.tensor(0.0, device=DEVICE)}), ValueError, "v_scale must be finite and > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks, "v_scale":
     torch.tensor([1.0, math.nan], device=DEVICE)}), ValueError,
     "v_scale must be finite and > 0"),
    (lambda q, k, v, n, ks, vs: ((q, k, v, n), {"k_scale": ks * math.inf,
     "v_scale": vs}), ValueError, "k_scale must be finite and > 0"),
]  # fmt: skip


@pytest.mark.parametrize("make, exc, words", BAD, ids=[b[2] for b in BAD])
def test_bad_arguments_rejected_before_launch(monkeypatch, make, exc, words):
    args, kwargs = make(*_good())
    assert_rejected_before_launch(
        monkeypatch,
        "decode_attention",
        lambda: decode_attention(*args, **kwargs),
        exc,
        words,
    )


def test_is_exported():
    assert normbook.quantize_kv is quantize_kv
