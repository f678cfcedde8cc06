"""decode_attention's ``return_lse`` and ``cache_leftpad`` (FlashAttention's
``flash_attn_with_kvcache`` semantics), against float64 formulas.

Tolerances. The lse is ln 2·(m + log2 ℓ) from fp32 scores: the scores err by about
(D + 4)·u·scale·Σ|q k| (u = 2⁻²⁴; D = 16 and unit inputs: ~1e-5 at most), ℓ by a few u
relative per key, log2 and the product by ln 2 by a few u: 1e-4 absolute holds with
room, for every dtype (q, k are exact in fp32 whatever their storage). A wrong base
(log2 for ln: a factor 0.69), a missed key (ln(ℓ) moves by ≥ 1e-3 for these sizes) or
the unscaled scores are orders above it. The merged halves are fp32 arithmetic on fp32
outputs: 1e-5. Slots before a row's left padding hold NaN: reading one would poison the
row.
"""

import math

import pytest
import torch
from conftest import on_cpu, randn

from normbook import DEVICE, decode_attention

B, H, H_KV, D, S_MAX = 3, 4, 2, 16, 40


def cache(seed):
    g = torch.Generator().manual_seed(seed)
    k = randn(B, H_KV, S_MAX, D, generator=g)
    v = randn(B, H_KV, S_MAX, D, generator=g)
    return k, v, g


def reference(q, k, v, lens, pad, scale, softcap=None):
    """float64: (out, lse) of query i over keys [pad_b, n_b - S_q + i]."""
    q, k, v = (on_cpu(t).double() for t in (q, k, v))
    Bq, Hq, Sq, _ = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(Bq, Hq, Sq, D, dtype=torch.float64)
    lse = torch.full((Bq, Hq, Sq), math.inf, dtype=torch.float64)
    for b in range(Bq):
        for h in range(Hq):
            for i in range(Sq):
                lo, hi = pad[b], lens[b] - Sq + i + 1
                if hi <= lo:
                    continue
                s = k[b, h // group, lo:hi] @ q[b, h, i] * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, h, i] = torch.softmax(s, 0) @ v[b, h // group, lo:hi]
    return out, lse


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("Sq", [1, 3])
def test_lse_and_left_padding_against_float64(Sq, softcap):
    k, v, g = cache(Sq)
    lens, pad = [37, 20, 9], [5, 0, 9 - Sq + 1]  # the last: one key for its first query
    for b, p in enumerate(pad):
        k[b, :, :p] = float("nan")  # never read
        v[b, :, :p] = float("nan")
    q = randn(B, H, Sq, D, generator=g)
    scale = D**-0.5
    out, lse = decode_attention(
        q, k, v, torch.tensor(lens, device=DEVICE), scale=scale, softcap=softcap,
        cache_leftpad=torch.tensor(pad, device=DEVICE), return_lse=True,
    )  # fmt: skip
    want_out, want_lse = reference(q, k, v, lens, pad, scale, softcap)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Sq)
    torch.testing.assert_close(on_cpu(lse).double(), want_lse, atol=1e-4, rtol=0)
    torch.testing.assert_close(on_cpu(out).double(), want_out, atol=1e-5, rtol=1e-5)


def test_two_halves_merge_into_the_whole_row():
    """Keys [0, 23) by cache_seqlens, [23, 37) by cache_leftpad: merged by their lse,
    the whole row's output and lse."""
    k, v, g = cache(7)
    q = randn(B, H, 1, D, generator=g)
    n = torch.full((B,), 37, device=DEVICE)
    cut = torch.full((B,), 23, device=DEVICE)
    o, lse = decode_attention(q, k, v, n, return_lse=True)
    o1, lse1 = decode_attention(q, k, v, cut, return_lse=True)
    o2, lse2 = decode_attention(q, k, v, n, cache_leftpad=cut, return_lse=True)
    merged = torch.logaddexp(lse1, lse2)
    w1, w2 = (torch.exp(x - merged)[..., None] for x in (lse1, lse2))
    torch.testing.assert_close(merged, lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(o1 * w1 + o2 * w2, o, atol=1e-5, rtol=1e-5)


def test_left_padding_on_a_paged_cache_and_rows_without_keys():
    """Paged: the same answer as contiguous; a row padded up to its length and an empty
    row output 0 with lse +inf."""
    k, v, g = cache(9)
    q = randn(B, H, 1, D, generator=g)
    lens = torch.tensor([30, 12, 0], device=DEVICE)
    pad = torch.tensor([7, 12, 0], device=DEVICE)
    page = 8
    blocks = S_MAX // page
    kp = k.view(B, H_KV, blocks, page, D).transpose(1, 2).reshape(-1, H_KV, page, D)
    vp = v.view(B, H_KV, blocks, page, D).transpose(1, 2).reshape(-1, H_KV, page, D)
    table = torch.arange(B * blocks, dtype=torch.int32, device=DEVICE).view(B, blocks)
    a, lse_a = decode_attention(q, k, v, lens, cache_leftpad=pad, return_lse=True)
    b, lse_b = decode_attention(q, kp, vp, lens, block_table=table, cache_leftpad=pad,
                                return_lse=True)  # fmt: skip
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)
    assert bool((a[1:] == 0).all()) and bool(torch.isinf(lse_a[1:]).all())
    assert bool((lse_a[1:] > 0).all())


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(cache_leftpad=torch.tensor([0, 21, 0])), ValueError, "[0, cache_seqlens"),
        (dict(cache_leftpad=torch.tensor([0, -1, 0])), ValueError, "[0, cache_seqlens"),
        (dict(cache_leftpad=torch.tensor([0, 1])), ValueError, "(3,)"),
        (dict(cache_leftpad=torch.tensor([0.0, 1.0, 0.0])), TypeError, "int32"),
        (dict(cache_leftpad=[0, 1, 0]), TypeError, "cache_leftpad"),
        (dict(return_lse=1), TypeError, "return_lse"),
    ],
)
def test_bad_arguments(kw, exc, words):
    k, v, g = cache(1)
    q = randn(B, H, 1, D, generator=g)
    if isinstance(kw.get("cache_leftpad"), torch.Tensor):
        kw = {**kw, "cache_leftpad": kw["cache_leftpad"].to(DEVICE)}
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):  # fmt: skip
        decode_attention(q, k, v, torch.tensor([30, 20, 9], device=DEVICE), **kw)
