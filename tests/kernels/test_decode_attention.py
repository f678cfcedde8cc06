"""normbook.decode_attention against the float64 per-row reference, SDPA, and itself.

The properties that make it a server's kernel: a row's bits do not depend on the batch
(its size, the other rows, their lengths, the cache's capacity), paged equals contiguous
bit for bit, and no slot at or past a row's length is ever read (those slots hold NaN in
every test here: a single read of one would put NaN in the output, since 0 · NaN = NaN
in P·V).

Interpreter sizes: KV_CHUNK = 128 keys, so rows of 130 … 700 keys span 2 … 6 chunks,
enough to exercise the merge; ``chunk=32`` (the private test knob) gives more chunks
cheaply.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from attention_bounds import error_bound
from conftest import (
    LOW_PRECISION,
    UNIT_ROUNDOFF,
    assert_rejected_before_launch,
    on_cpu,
    randn,
)

from normbook import DEVICE, decode_attention
from normbook import reference as ref
from normbook._triton_utils import tanh
from normbook.decode_attention import KV_CHUNK, _check, _forward

NAN = float("nan")


def contiguous_cache(lengths, H_kv, S_max, D, dtype=torch.float32, scale=1.0):
    """k, v (B, H_kv, S_max, D), every slot at or past a row's length NaN."""
    B = len(lengths)
    k = randn(B, H_kv, S_max, D, dtype=dtype, scale=scale)
    v = randn(B, H_kv, S_max, D, dtype=dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = NAN
        v[b, :, n:] = NAN
    return k, v


def paged_from(k, v, lengths, page, num_blocks=None, generator=None):
    """The same rows in a paged cache: blocks in a random physical order, unused blocks and the
    tail of each row's last block NaN, table entries past a row's blocks -1."""
    B, H_kv, S_max, D = k.shape
    need = [math.ceil(n / page) for n in lengths]
    max_blocks = max(math.ceil(S_max / page), 1)
    num_blocks = num_blocks or sum(need) + 3
    kp = torch.full((num_blocks, H_kv, page, D), NAN, dtype=k.dtype, device=k.device)
    vp = torch.full_like(kp, NAN)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    for b, n in enumerate(lengths):
        for blk in range(need[b]):
            phys = free.pop()
            table[b, blk] = phys
            j = torch.arange(blk * page, min((blk + 1) * page, n))
            kp[phys, :, : len(j)] = k[b, :, j]
            vp[phys, :, : len(j)] = v[b, :, j]
    return kp, vp, table.to(DEVICE)


def lens(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def assert_within_bound(out, q, k, v, lengths, window=None, scale=None, softcap=None):
    """Per row, attention_bounds.error_bound for bottom-right causal attention over the row's keys,
    plus the merge: each chunk merge rescales (m, ℓ, acc) by two exp2 and adds, about 4
    fp32 roundings per chunk, relative to Σ p|v|. A mask off by one key or a chunk
    merged twice or not at all moves the output by ~|v|/n, far above this at these sizes."""
    out64 = on_cpu(out).double()
    assert not torch.isnan(out64).any(), (
        "NaN in the output: a slot past a length was read"
    )
    for b, n in enumerate(lengths):
        if n == 0:
            assert bool((out64[b] == 0).all())
            continue
        kb, vb = on_cpu(k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        o, bound = error_bound(
            on_cpu(q[b : b + 1]),
            kb,
            vb,
            out.dtype,
            causal=True,
            window=window,
            scale=scale,
            softcap=softcap,
        )
        pv = ref.attention(
            on_cpu(q[b : b + 1]),
            kb,
            vb.abs(),
            causal=True,
            scale=scale,
            window=window,
            softcap=softcap,
        )
        bound = bound + (4 * (math.ceil(n / KV_CHUNK) + 1)) * 2.0**-24 * pv
        err = (out64[b : b + 1] - o).abs()
        assert bool((err <= bound).all()), (
            f"row {b}: error {err.max():.3g} > bound {bound.flatten()[torch.argmax(err - bound)]:.3g}"
        )


# (H, H_kv, Sq, D, lengths, S_max): odd lengths, one to several chunks, GQA, Sq > 1
CASES = [
    (1, 1, 1, 16, [1], 1),
    (4, 2, 1, 32, [7, 130, 300], 301),
    (8, 2, 1, 64, [129, 257], 400),
    (6, 3, 3, 24, [3, 50, 200], 256),
    (2, 2, 5, 128, [260, 5], 270),
    (4, 1, 2, 80, [64, 1], 130),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, dtype, poison_empty):
    H, H_kv, Sq, D, lengths, S_max = case
    q = randn(len(lengths), H, Sq, D, dtype=dtype, scale=2.0)
    k, v = contiguous_cache(lengths, H_kv, S_max, D, dtype, scale=2.0)
    out = decode_attention(q, k, v, lens(lengths))
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    assert_within_bound(out, q, k, v, lengths)


@pytest.mark.parametrize("page", [1, 16, 64, 100])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_paged_equals_contiguous_bitwise(dtype, page, poison_empty):
    """Same chunks, same tiles, same arithmetic: only the addresses differ. Pages smaller than
    a key tile (1, 16) and larger, and one that is not a power of two (100)."""
    lengths = [5, 300, 129, 0]
    q = randn(4, 4, 2, 32, dtype=dtype)
    k, v = contiguous_cache(lengths, 2, 310, 32, dtype)
    kp, vp, table = paged_from(k, v, lengths, page)
    contiguous = decode_attention(q, k, v, lens(lengths))
    paged = decode_attention(q, kp, vp, lens(lengths), block_table=table)
    assert torch.equal(paged, contiguous)
    r = ref.decode_attention(q, kp, vp, lens(lengths), block_table=table)
    torch.testing.assert_close(
        r, ref.decode_attention(q, k, v, lens(lengths)), rtol=0, atol=0
    )


@pytest.mark.slow  # large batches: a minute or more each on a CPU
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_row_bits_do_not_depend_on_the_batch(dtype):
    """Row 0 alone, then in batches of other sizes, with other rows' lengths (shorter, longer,
    empty), other capacities and, paged, other num_blocks and block placements: same bits."""
    D, H, H_kv = 32, 4, 2
    n0 = 2 * KV_CHUNK + 37
    q0 = randn(1, H, 1, D, dtype=dtype)
    k0, v0 = contiguous_cache([n0], H_kv, n0, D, dtype)
    alone = decode_attention(q0, k0, v0, lens([n0]))
    g = torch.Generator().manual_seed(0)
    for others, S_max in (
        ([], n0 + 1),
        ([3, 700], 700),
        ([0] * 5 + [n0], 1024),
        ([1], 3 * n0),
    ):
        lengths = [n0] + others
        k, v = contiguous_cache(lengths, H_kv, S_max, D, dtype)
        k[0, :, :n0], v[0, :, :n0] = k0[0], v0[0]
        q = torch.cat([q0, randn(len(others), H, 1, D, dtype=dtype)])
        out = decode_attention(q, k, v, lens(lengths, torch.int64))
        assert torch.equal(out[:1], alone), (others, S_max)
        for page, extra in ((16, 0), (32, 11)):
            kp, vp, table = paged_from(
                k,
                v,
                lengths,
                page,
                generator=g,
                num_blocks=sum(math.ceil(n / page) for n in lengths) + extra + 1,
            )
            out = decode_attention(q, kp, vp, lens(lengths), block_table=table)
            assert torch.equal(out[:1], alone), (others, S_max, page)


@pytest.mark.parametrize("window", [1, 5, 100, 1000])
@pytest.mark.parametrize("Sq", [1, 4])
def test_sliding_window(window, Sq, poison_empty):
    """Keys before every query's window are NaN too: they are never read either."""
    lengths = [3, 140, 333]
    q = randn(3, 4, Sq, 16)
    k, v = contiguous_cache(lengths, 2, 340, 16)
    out = decode_attention(q, k, v, lens(lengths), window=window)
    assert_within_bound(out, q, k, v, lengths, window=window)
    for b, n in enumerate(lengths):
        first = max(n - Sq - window + 1, 0)
        k[b, :, :first] = NAN
        v[b, :, :first] = NAN
    assert torch.equal(decode_attention(q, k, v, lens(lengths), window=window), out)
    kp, vp, table = paged_from(k, v, lengths, 16)
    paged = decode_attention(q, kp, vp, lens(lengths), block_table=table, window=window)
    assert torch.equal(paged, out)


def test_long_rows_bf16_several_chunks():
    """bf16 rows of 3 … 6 chunks with head_dim 128, the real chunk size."""
    lengths = [KV_CHUNK * 5 + 61, KV_CHUNK * 3]
    q = randn(2, 8, 1, 128, dtype=torch.bfloat16)
    k, v = contiguous_cache(lengths, 2, max(lengths), 128, torch.bfloat16)
    out = decode_attention(q, k, v, lens(lengths))
    assert_within_bound(out, q, k, v, lengths)


def test_many_small_chunks_match_one_chunk():
    """The merge, many times over: chunks of 32 keys give the same result as chunks of 512 to
    within fp32 rounding (not bitwise: the merge rounds), and the reference bound holds."""
    lengths = [250, 37]
    q = randn(2, 2, 1, 16)
    k, v = contiguous_cache(lengths, 1, 256, 16)
    args = _check(q, k, v, lens(lengths), None, None, None)
    small = _forward(q, k, v, lens(lengths), None, *args, chunk=32)
    one = _forward(q, k, v, lens(lengths), None, *args, chunk=512)
    assert_within_bound(small, q, k, v, lengths)
    torch.testing.assert_close(small, one, rtol=1e-5, atol=1e-6)


def test_matches_sdpa_over_the_same_cache():
    """SDPA over each row's slice of the contiguous cache, GQA, Sq = 3 bottom-right."""
    lengths = [40, 200]
    q = randn(2, 6, 3, 64)
    k, v = contiguous_cache(lengths, 2, 200, 64)
    out = decode_attention(q, k, v, lens(lengths))
    for b, n in enumerate(lengths):
        i = torch.arange(3, device=DEVICE)[:, None]
        j = torch.arange(n, device=DEVICE)[None, :]
        mask = j <= i + n - 3
        expected = F.scaled_dot_product_attention(
            q[b : b + 1],
            k[b : b + 1, :, :n],
            v[b : b + 1, :, :n],
            attn_mask=mask,
            enable_gqa=True,
        )
        torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_empty_rows_and_rows_shorter_than_sq_give_zeros(dtype, poison_empty):
    """A row of length 0 outputs 0; with n < Sq the first Sq − n queries (at negative
    positions) see no key and output 0, the others see the keys up to theirs."""
    lengths = [0, 2, 9]
    q = randn(3, 2, 4, 16, dtype=dtype)
    k, v = contiguous_cache(lengths, 1, 10, 16, dtype)
    out = decode_attention(q, k, v, lens(lengths))
    assert bool((out[0] == 0).all()) and bool((out[1, :, :2] == 0).all())
    assert_within_bound(out[2:], q[2:], k[2:], v[2:], lengths[2:])
    expected = ref.attention(
        on_cpu(q[1:2]), on_cpu(k[1:2, :, :2]), on_cpu(v[1:2, :, :2]), causal=True
    )
    tol = 4 * UNIT_ROUNDOFF[dtype]
    torch.testing.assert_close(on_cpu(out[1:2]).double(), expected, rtol=tol, atol=tol)


def test_empty_batch_and_zero_capacity():
    q = randn(0, 2, 1, 16)
    out = decode_attention(q, randn(0, 1, 5, 16), randn(0, 1, 5, 16), lens([]))
    assert out.shape == q.shape
    q = randn(2, 2, 1, 16)
    out = decode_attention(q, randn(2, 1, 0, 16), randn(2, 1, 0, 16), lens([0, 0]))
    assert bool((out == 0).all())


def test_strided_inputs():
    """q in Hugging Face's (B, S, H, D) layout transposed; caches sliced from wider buffers."""
    lengths = [20, 150]
    q = randn(2, 2, 4, 32).transpose(1, 2)
    k, v = contiguous_cache(lengths, 2, 160, 64)
    k, v = k[..., ::2], v[..., 32:]
    assert not q.is_contiguous() and k.stride(-1) == 2
    out = decode_attention(q, k, v, lens(lengths))
    assert torch.equal(
        out,
        decode_attention(q.contiguous(), k.contiguous(), v.contiguous(), lens(lengths)),
    )
    assert_within_bound(out, q, k, v, lengths)


def test_hand_calculation():
    """One query, two cached keys: scores (0, ln 3) → p = (1/4, 3/4); output 7 for v = (4, 8)."""
    q = torch.tensor([[[[1.0]]]], device=DEVICE)
    k = torch.tensor([[[[0.0], [math.log(3.0)], [NAN]]]], device=DEVICE)
    v = torch.tensor([[[[4.0], [8.0], [NAN]]]], device=DEVICE)
    out = decode_attention(q, k, v, lens([2]), scale=1.0)
    assert abs(out.item() - 7.0) < 1e-6


# ---------------------------------------------------------------- soft-capping


@pytest.mark.parametrize("softcap", [2.0, 20.0])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_softcap_matches_reference(dtype, softcap, poison_empty):
    """Scores c·tanh(s/c) (Gemma 2), contiguous and paged: within the bound of the float64
    reference (error_bound's δ grows by the cap's roundings, ~12u of |s|), paged equal to
    contiguous bit for bit. Scores of standard deviation ~16: c = 2 flattens most of them,
    c = 20 the largest; either moves the output by far more than the bound."""
    lengths = [7, 130, 300, 0]
    H, H_kv, Sq, D = 6, 3, 2, 32
    q = randn(len(lengths), H, Sq, D, dtype=dtype, scale=4.0)
    k, v = contiguous_cache(lengths, H_kv, 301, D, dtype, scale=4.0)
    out = decode_attention(q, k, v, lens(lengths), softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    assert_within_bound(out, q, k, v, lengths, softcap=softcap)
    capped = ref.decode_attention(q, k, v, lens(lengths), softcap=softcap)
    uncapped = ref.decode_attention(q, k, v, lens(lengths))
    assert (capped - uncapped).abs().amax() > 0.1  # the cap matters here
    kp, vp, table = paged_from(k, v, lengths, 16)
    paged = decode_attention(
        q, kp, vp, lens(lengths), block_table=table, softcap=softcap
    )
    assert torch.equal(paged, out)


@pytest.mark.parametrize("Sq", [1, 3])
def test_softcap_with_window(Sq, poison_empty):
    """Window and cap together, GQA: the bound holds; keys before every window are NaN and
    never read; paged (pages of 16) equals contiguous."""
    lengths = [3, 140, 333]
    window, softcap = 50, 5.0
    q = randn(3, 4, Sq, 16, scale=3.0)
    k, v = contiguous_cache(lengths, 2, 340, 16, scale=3.0)
    for b, n in enumerate(lengths):
        first = max(n - Sq - window + 1, 0)
        k[b, :, :first] = NAN
        v[b, :, :first] = NAN
    out = decode_attention(q, k, v, lens(lengths), window=window, softcap=softcap)
    kw = dict(window=window, softcap=softcap)
    for b, n in enumerate(lengths):
        first = max(n - Sq - window + 1, 0)
        # the bound's reference over the keys the row sees, at their positions
        kb, vb = k[b : b + 1, :, first:n], v[b : b + 1, :, first:n]
        assert_within_bound(out[b : b + 1], q[b : b + 1], kb, vb, [n - first], **kw)
    kp, vp, table = paged_from(k, v, lengths, 16)
    paged = decode_attention(q, kp, vp, lens(lengths), block_table=table, **kw)
    assert torch.equal(paged, out)


def test_softcap_zero_is_off_and_a_huge_cap_is_no_cap():
    """0 launches the uncapped kernel (same bits as None). A cap far above every score
    leaves the scores as they are (c·tanh(s/c) = s to within fp32 rounding: the tanh
    has a small relative error near 0, not only an absolute one), so the uncapped
    bound holds."""
    lengths = [40, 200]
    q = randn(2, 4, 2, 32, scale=2.0)
    k, v = contiguous_cache(lengths, 2, 200, 32, scale=2.0)
    off = decode_attention(q, k, v, lens(lengths))
    assert torch.equal(decode_attention(q, k, v, lens(lengths), softcap=0), off)
    huge = decode_attention(q, k, v, lens(lengths), softcap=1e30)
    assert_within_bound(huge, q, k, v, lengths)


@triton.jit
def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tanh(tl.load(X + i, mask=i < N)), mask=i < N)


def test_tanh_is_within_6_ulp():
    """The cap's tanh (exp2 above 0.625, a polynomial below) against float64's, relative:
    within the 6u its docstring argues (the interpreter measures under 3u), from 1e-30,
    where the polynomial gives x, through the switch at 0.625 to 20, where it is 1; odd;
    ±1 at ±inf; NaN kept. A 1 - 2/(exp(2x) + 1) alone is off by ~u/x near 0."""
    pos = torch.cat([torch.logspace(-30, 0, 3000), torch.linspace(0.5, 20, 4000)])
    x = torch.cat([pos, -pos, torch.tensor([math.inf, -math.inf, NAN])]).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    x, y = on_cpu(x, y)
    exact = torch.tanh(x.double())
    rel = ((y.double() - exact).abs() / exact.abs())[: 2 * len(pos)]
    assert rel.max() <= 6 * UNIT_ROUNDOFF[torch.float32], rel.max()
    assert torch.equal(y[: len(pos)], -y[len(pos) : 2 * len(pos)])
    assert y[-3:-1].tolist() == [1.0, -1.0] and math.isnan(y[-1])


def test_softcap_hand_calculation():
    """Scores (0, atanh(1/2)) capped at c = 1: (0, 1/2); output (4 + 8√e)/(1 + √e)."""
    q = torch.tensor([[[[1.0]]]], device=DEVICE)
    k = torch.tensor([[[[0.0], [math.atanh(0.5)], [NAN]]]], device=DEVICE)
    v = torch.tensor([[[[4.0], [8.0], [NAN]]]], device=DEVICE)
    out = decode_attention(q, k, v, lens([2]), scale=1.0, softcap=1.0)
    e = math.exp(0.5)
    assert abs(out.item() - (4 + 8 * e) / (1 + e)) < 1e-6


def _good():
    q = randn(2, 4, 1, 16)
    k, v = randn(2, 2, 8, 16), randn(2, 2, 8, 16)
    return q, k, v, lens([3, 8])


BAD = [
    (
        lambda q, k, v, n: (q.numpy(), k, v, n),
        {},
        TypeError,
        "q must be a torch.Tensor",
    ),
    (lambda q, k, v, n: (q.double(), k, v, n), {}, TypeError, "q must be float32"),
    (
        lambda q, k, v, n: (q, k.half(), v, n),
        {},
        TypeError,
        "k_cache must have q's dtype",
    ),
    (lambda q, k, v, n: (q[0], k, v, n), {}, ValueError, "q must have 4 dimensions"),
    (
        lambda q, k, v, n: (q, k[..., :8], v, n),
        {},
        ValueError,
        "k_cache must have q's head_dim",
    ),
    (
        lambda q, k, v, n: (q, k, v[:, :, :4], n),
        {},
        ValueError,
        "v_cache must have k_cache's",
    ),
    (lambda q, k, v, n: (q[:, :3], k, v, n), {}, ValueError, "must divide q's heads"),
    (
        lambda q, k, v, n: (q[:, :, :0], k, v, n),
        {},
        ValueError,
        "at least one new token",
    ),
    (
        lambda q, k, v, n: (q, k[:1], v[:1], n),
        {},
        ValueError,
        "must have q's batch size",
    ),
    (
        lambda q, k, v, n: (q, k, v, n.float()),
        {},
        TypeError,
        "cache_seqlens must be int32",
    ),
    (
        lambda q, k, v, n: (q, k, v, n[:1]),
        {},
        ValueError,
        "cache_seqlens must have shape (2,)",
    ),
    (
        lambda q, k, v, n: (q, k, v, [3, 8]),
        {},
        TypeError,
        "cache_seqlens must be a torch.Tensor",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"scale": "1"},
        TypeError,
        "scale must be a real",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"scale": math.inf},
        ValueError,
        "scale must be finite",
    ),
    (lambda q, k, v, n: (q, k, v, n), {"window": 0}, ValueError, "window must be >= 1"),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"window": 2.0},
        TypeError,
        "window must be an int",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": "30"},
        TypeError,
        "softcap must be a real",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": True},
        TypeError,
        "softcap must be a real number or None, got bool",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": torch.tensor(30.0)},
        TypeError,
        "softcap must be a real number or None, got Tensor",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": -30.0},
        ValueError,
        "softcap must be a finite number > 0",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": math.inf},
        ValueError,
        "softcap must be a finite number > 0 (None or 0: no cap), got inf",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": math.nan},
        ValueError,
        "softcap must be a finite number > 0 (None or 0: no cap), got nan",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"softcap": 1e-40},
        ValueError,
        "softcap = 1e-40 with scale = 0.25 leaves fp32's range",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"block_table": torch.zeros(2, 1, dtype=torch.int64)},
        TypeError,
        "block_table must be int32",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"block_table": torch.zeros(3, 1, dtype=torch.int32)},
        ValueError,
        "block_table must have shape (2, max_blocks)",
    ),
    (
        lambda q, k, v, n: (q, k, v, n),
        {"block_table": [[0], [1]]},
        TypeError,
        "block_table must be a torch.Tensor",
    ),
    # Values (one host synchronization): lengths in [0, capacity], used table entries
    # valid.
    (
        lambda q, k, v, n: (q, k, v, lens([3, 9])),
        {},
        ValueError,
        "capacity, k_cache.shape[2] = 8",
    ),
    (
        lambda q, k, v, n: (q, k, v, lens([-1, 2])),
        {},
        ValueError,
        "cache_seqlens must be >= 0",
    ),
    (
        lambda q, k, v, n: (q, k, v, lens([3, 9])),
        {"block_table": torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)},
        ValueError,
        "max_blocks · block_size = 8",
    ),
    (
        lambda q, k, v, n: (q, k, v, lens([3, 8])),
        {"block_table": torch.tensor([[0], [2]], dtype=torch.int32, device=DEVICE)},
        ValueError,
        "block_table entries a row uses must be in [0, 2)",
    ),
]


@pytest.mark.parametrize("make, kwargs, exc, words", BAD, ids=[b[3] for b in BAD])
def test_bad_arguments_rejected_before_launch(monkeypatch, make, kwargs, exc, words):
    args = make(*_good())
    assert_rejected_before_launch(
        monkeypatch,
        "decode_attention",
        lambda: decode_attention(*args, **kwargs),
        exc,
        words,
    )


def test_unused_table_entries_may_be_anything():
    """-1 (or any garbage) past a row's last block is never read, never rejected."""
    q, k, v, n = _good()
    table = torch.tensor([[1, -1], [0, 12345]], dtype=torch.int32, device=DEVICE)
    paged = decode_attention(q, k, v, lens([3, 8]), block_table=table[:, :1])
    assert torch.isfinite(paged).all()
    decode_attention(q, k[:, :, :4], v[:, :, :4], lens([3, 4]), block_table=table)


def test_refuses_grad():
    q, k, v, n = _good()
    with pytest.raises(NotImplementedError, match="no backward"):
        decode_attention(q.requires_grad_(), k, v, n)
    with torch.no_grad():
        decode_attention(q, k, v, n)
