"""normbook.attention against the float64 reference (normbook.reference.attention) and SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F
from attention_bounds import error_bound
from conftest import LOW_PRECISION, UNIT_ROUNDOFF, assert_rejected_before_launch, randn

from normbook import DEVICE, attention
from normbook import reference as ref
from normbook._config import _capability, tile_config
from normbook.attention import tiles_visited


def assert_within_bound(
    out, q, k, v, causal=False, window=None, scale=None, softcap=None
):
    o, bound = error_bound(q, k, v, out.dtype, causal, window, scale, softcap)
    out64 = out.double().cpu()
    assert out64.shape == o.shape
    assert not torch.isnan(out64).any(), (
        "NaN in the output (poisoned, unwritten or 0/0)"
    )
    err = (out64 - o).abs()
    worst = torch.argmax(err - bound)
    assert bool((err <= bound).all()), (
        f"error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} ({out.dtype})"
    )
    return err.max().item()


def qkv(B, H, H_kv, seq_q, seq_k, D, dtype, scale=1.0):
    return (
        randn(B, H, seq_q, D, dtype=dtype, scale=scale),
        randn(B, H_kv, seq_k, D, dtype=dtype, scale=scale),
        randn(B, H_kv, seq_k, D, dtype=dtype),
    )


SHAPES = [  # (B, H, H_kv, seq_q, seq_k, D): odd lengths, seq_q < = > seq_k, GQA, head_dim 1…128
    (1, 1, 1, 1, 1, 16),
    (2, 4, 2, 7, 7, 16),
    (1, 2, 1, 5, 70, 32),
    (1, 3, 3, 70, 5, 24),
    (1, 2, 1, 65, 129, 64),
    (1, 2, 2, 33, 33, 1),
    (1, 2, 1, 20, 40, 80),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, causal, dtype, poison_empty):
    B, H, H_kv, seq_q, seq_k, D = shape
    q, k, v = qkv(B, H, H_kv, seq_q, seq_k, D, dtype, scale=2.0)
    out = attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    assert_within_bound(out, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_larger_head_dim_and_sequence(dtype):
    q, k, v = qkv(1, 1, 1, 150, 200, 128, dtype)
    assert_within_bound(attention(q, k, v, causal=True), q, k, v, causal=True)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa_with_gqa(dtype, is_causal):
    """SDPA's is_causal is top-left; its enable_gqa maps q head h to k/v head h // group."""
    q, k, v = qkv(1, 6, 2, 37, 53, 64, dtype)
    expected = F.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, enable_gqa=True
    )
    got = attention(q, k, v, causal="top_left" if is_causal else False)
    # Both are within about u·(|o| + Σp|v|) of the exact result (|v| ~ 1 here, the outputs
    # ~0.2): 4u covers the two errors together; a wrong head or mask is off by ~1e-2 or more.
    u = UNIT_ROUNDOFF[dtype]
    tol = 4 * u if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("seq_q, seq_k", [(3, 9), (9, 3), (6, 6), (1, 17)])
@pytest.mark.parametrize("alignment", ["bottom_right", "top_left"])
def test_alignments_match_explicit_masks(seq_q, seq_k, alignment):
    """Each alignment equals SDPA with the explicit boolean mask it names (fp32)."""
    i = torch.arange(seq_q)[:, None]
    j = torch.arange(seq_k)[None, :]
    mask = j <= i + (seq_k - seq_q if alignment == "bottom_right" else 0)
    q, k, v = qkv(1, 2, 2, seq_q, seq_k, 16, torch.float32)
    got = attention(q, k, v, causal=alignment)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(DEVICE))
    visible = mask.any(
        dim=1
    )  # rows with no key: SDPA and we both return 0 (checked below)
    torch.testing.assert_close(
        got[:, :, visible], sdpa[:, :, visible], rtol=1e-5, atol=1e-6
    )
    assert bool((got[:, :, ~visible] == 0).all())
    if alignment == "bottom_right":
        torch.testing.assert_close(got, attention(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("window", [1, 3, 16, 100])
@pytest.mark.parametrize("seq_q, seq_k", [(40, 40), (10, 90), (90, 70)])
def test_sliding_window_matches_explicit_mask(seq_q, seq_k, window):
    q, k, v = qkv(1, 2, 1, seq_q, seq_k, 32, torch.float32)
    out = attention(q, k, v, causal=True, window=window)
    assert_within_bound(out, q, k, v, causal=True, window=window)
    i = torch.arange(seq_q)[:, None]
    j = torch.arange(seq_k)[None, :]
    offset = seq_k - seq_q
    mask = (j <= i + offset) & (
        j > i + offset - window
    )  # Mistral: itself and window-1 before
    assert bool((mask.sum(dim=1) <= window).all())
    visible = mask.any(dim=1)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.to(DEVICE), enable_gqa=True
    )
    torch.testing.assert_close(
        out[:, :, visible], sdpa[:, :, visible], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_fully_masked_rows_are_zero_not_nan(dtype, poison_empty):
    """Bottom-right with seq_q > seq_k: the first seq_q − seq_k queries see no key at all."""
    q, k, v = qkv(1, 2, 1, 40, 10, 16, dtype)
    out = attention(q, k, v, causal=True)
    assert bool((out[:, :, :30] == 0).all())
    assert torch.isfinite(out).all()
    assert_within_bound(out, q, k, v, causal=True)
    # The textbook formula, softmax over a row of −∞, is 0/0:
    row = torch.full((4,), float("-inf"))
    assert torch.isnan(torch.softmax(row, dim=0)).all()


def test_no_keys_at_all_gives_zeros(poison_empty):
    q = randn(2, 2, 5, 16)
    k = randn(2, 1, 0, 16)
    out = attention(q, k, k)
    assert out.shape == q.shape and bool((out == 0).all())


@pytest.mark.parametrize("shape", [(0, 2, 5, 16), (2, 2, 0, 16)])
def test_empty_inputs(shape):
    q = randn(*shape)
    k = randn(shape[0], 1, 7, 16)
    out = attention(q, k, k, causal=True)
    assert out.shape == q.shape


def test_strided_inputs_are_used_in_place():
    """The Hugging Face layout (batch, seq, heads, dim) transposed to (batch, heads, seq, dim),
    a slice of a wider buffer, and a head_dim with stride 2."""
    B, S, H, D = 2, 19, 4, 32
    q = randn(B, S, H, D).transpose(1, 2)
    kv = randn(B, S, 2, 2 * D)
    k = kv[..., :D].transpose(1, 2)
    v = randn(B, 2, S, 2 * D)[..., ::2]
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(-1) == 2
    out = attention(q, k, v, causal=True)
    assert_within_bound(out, q, k, v, causal=True)
    torch.testing.assert_close(
        out,
        attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True),
        rtol=0,
        atol=0,
    )


def test_scale_argument():
    q, k, v = qkv(1, 2, 2, 9, 11, 16, torch.float32)
    for scale in (0.0, 0.3, -1.5):
        assert_within_bound(attention(q, k, v, scale=scale), q, k, v, scale=scale)


def test_hand_calculation():
    """One query, two keys: scores (0, ln 3) → p = (1/4, 3/4); output 1/4·v_0 + 3/4·v_1."""
    q = torch.tensor([[[[1.0]]]], device=DEVICE)
    k = torch.tensor([[[[0.0], [math.log(3.0)]]]], device=DEVICE)
    v = torch.tensor([[[[4.0], [8.0]]]], device=DEVICE)
    out = attention(q, k, v, scale=1.0)
    assert abs(out.item() - 7.0) < 1e-6


def test_nan_propagates_only_where_it_is_seen():
    """A NaN query row gives a NaN output row; a NaN key hides behind the causal mask from
    earlier queries (the mask selects −∞ with `where`, so NaN·0 never enters the sum)."""
    q, k, v = qkv(1, 1, 1, 8, 8, 16, torch.float32)
    q[0, 0, 2, 0] = float("nan")
    k[0, 0, 5, 3] = float("nan")
    out = attention(q, k, v, causal=True)
    nan_rows = torch.isnan(out[0, 0]).any(dim=1).cpu()
    assert nan_rows.tolist() == [False, False, True, False, False, True, True, True]


# ---------------------------------------------------------------- work and memory


def planned_tiles(seq_q, seq_k, causal, window, BLOCK_M, BLOCK_N):
    """The tiles a query tile must visit, counted the slow way: any visible key in the tile."""
    keep = ref.attention_mask(seq_q, seq_k, causal, window)
    n = 0
    for i0 in range(0, seq_q, BLOCK_M):
        cols = keep[i0 : i0 + BLOCK_M].any(dim=0)
        if window is None or not causal:
            # the kernel starts at key 0 (no window): count tiles up to the last visible one
            last = int(cols.nonzero().max()) if cols.any() else -1
            n += (last // BLOCK_N + 1) if last >= 0 else 0
        else:
            n += sum(
                bool(cols[j0 : j0 + BLOCK_N].any()) for j0 in range(0, seq_k, BLOCK_N)
            )
    return n


@pytest.mark.parametrize(
    "causal, window", [(False, None), (True, None), ("top_left", None), (True, 40)]
)
@pytest.mark.parametrize("seq_q, seq_k", [(256, 256), (100, 300), (300, 100)])
def test_masked_tiles_are_skipped(seq_q, seq_k, causal, window):
    q, k, v = qkv(1, 1, 1, seq_q, seq_k, 16, torch.float16)
    visited, total = tiles_visited(q, k, v, causal=causal, window=window)
    BLOCK_M, BLOCK_N = tile_config(16, torch.float16, _capability(q))[:2]
    assert total == math.ceil(seq_q / BLOCK_M) * math.ceil(seq_k / BLOCK_N)
    assert visited == planned_tiles(seq_q, seq_k, causal, window, BLOCK_M, BLOCK_N)
    if causal and seq_q == seq_k and window is None:
        n = math.ceil(seq_q / BLOCK_M)
        assert visited == n * (n + 1) // 2  # the diagonal and below: about half


def test_no_score_matrix_is_allocated():
    """Every tensor created during a call is counted: only the output and the per-program
    tile counters, never anything of size seq_q × seq_k."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Allocations.biggest = max(
                        Allocations.biggest, t.untyped_storage().nbytes()
                    )
            return out

    seq = 256
    q, k, v = qkv(1, 1, 1, seq, seq, 16, torch.float16)
    with Allocations():
        out = attention(q, k, v, causal=True)
    assert Allocations.biggest <= out.numel() * out.element_size()
    assert Allocations.biggest < seq * seq * 4 // 8


# ---------------------------------------------------------------- arguments


def test_requires_grad_takes_the_autograd_path():
    """An input that requires grad gets a graph (its backward: test_attention_backward.py);
    under no_grad nothing is saved and the same output comes out."""
    q, k, v = qkv(1, 1, 1, 4, 4, 16, torch.float32)
    out = attention(q.requires_grad_(), k, v)
    assert out.grad_fn is not None
    with torch.no_grad():
        plain = attention(q, k, v)
    assert plain.grad_fn is None and torch.equal(out.detach(), plain)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda q, k, v: attention(q, k, v, softcap=-1.0), ValueError, "softcap"),
        (lambda q, k, v: attention(q, k, v, softcap=math.inf), ValueError, "softcap"),
        (lambda q, k, v: attention(q, k, v, softcap=math.nan), ValueError, "softcap"),
        (lambda q, k, v: attention(q, k, v, softcap=True), TypeError, "softcap"),
        (lambda q, k, v: attention(q, k, v, softcap="30"), TypeError, "softcap"),
        (
            lambda q, k, v: attention(q, k, v, softcap=torch.tensor(30.0)),
            TypeError,
            "softcap",
        ),
        (lambda q, k, v: attention(q.double(), k, v), TypeError, "q must be float32"),
        (lambda q, k, v: attention(q, k.half(), v), TypeError, "k must have q's dtype"),
        (lambda q, k, v: attention(q[0], k, v), ValueError, "q must have 4 dimensions"),
        (lambda q, k, v: attention(q, k[:, :, :, :8], v), ValueError, "head_dim"),
        (
            lambda q, k, v: attention(q, k, v[:, :, :3]),
            ValueError,
            "v must have k's heads",
        ),
        (
            lambda q, k, v: attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)),
            ValueError,
            "must divide q's heads",
        ),
        (lambda q, k, v: attention(q, k[:1], v[:1]), ValueError, "batch size"),
        (
            lambda q, k, v: attention(q, k, v, causal="bottom"),
            ValueError,
            "causal must be",
        ),
        (lambda q, k, v: attention(q, k, v, scale="1"), TypeError, "scale must be"),
        (
            lambda q, k, v: attention(q, k, v, scale=math.inf),
            ValueError,
            "scale must be finite",
        ),
        (
            lambda q, k, v: attention(q, k, v, causal=True, window=0),
            ValueError,
            "window must be",
        ),
        (
            lambda q, k, v: attention(q, k, v, causal=True, window=2.0),
            TypeError,
            "window must be",
        ),
        (
            lambda q, k, v: attention(q, k, v, window=4),
            ValueError,
            "window needs causal",
        ),
        (
            lambda q, k, v: attention(q.tolist(), k, v),
            TypeError,
            "q must be a torch.Tensor",
        ),
    ],
)
def test_bad_arguments_are_rejected_before_launch(monkeypatch, call, exc, words):
    q, k, v = qkv(2, 4, 2, 5, 6, 16, torch.float32)
    assert_rejected_before_launch(
        monkeypatch, "attention", lambda: call(q, k, v), exc, words
    )


def test_head_dim_above_128_is_rejected(monkeypatch):
    q, k, v = qkv(1, 1, 1, 2, 2, 160, torch.float32)
    assert_rejected_before_launch(
        monkeypatch,
        "attention",
        lambda: attention(q, k, v),
        ValueError,
        "head_dim must be between 1 and 128",
    )


# ---------------------------------------------------------------- soft-capping


#: (B, H, H_kv, seq_q, seq_k, D): one tile and partial tiles, seq_q < = > seq_k, GQA.
#: The caps 1.5 (below most scores: inputs ×2, so |s| ~ 4 and tanh saturates) and 50
#: (Gemma 2's; nearly linear) take both branches of tanh; a cap left out or applied
#: after the mask moves outputs by ~|v|, far above the bound.
SOFTCAP_SHAPES = [(1, 2, 1, 7, 7, 16), (1, 2, 2, 37, 70, 32), (1, 4, 2, 70, 33, 64)]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("softcap", [1.5, 50.0])
@pytest.mark.parametrize("shape", SOFTCAP_SHAPES, ids=str)
def test_softcap_matches_reference(shape, softcap, causal, dtype, poison_empty):
    B, H, H_kv, seq_q, seq_k, D = shape
    q, k, v = qkv(B, H, H_kv, seq_q, seq_k, D, dtype, scale=2.0)
    out = attention(q, k, v, causal=causal, softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    assert_within_bound(out, q, k, v, causal=causal, softcap=softcap)


@pytest.mark.parametrize("window", [1, 5])
def test_softcap_with_window_and_scale(window):
    q, k, v = qkv(1, 2, 1, 40, 50, 16, torch.float32, scale=3.0)
    kw = dict(causal=True, window=window, softcap=2.0, scale=0.4)
    assert_within_bound(attention(q, k, v, **kw), q, k, v, **kw)


def test_softcap_is_gemma2s():
    """Against transformers' Gemma 2 eager attention (scaling, / softcap, tanh, ·
    softcap, then the mask and the softmax) in float64, GQA and a causal mask."""
    pytest.importorskip("transformers")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    class Module(torch.nn.Module):
        num_key_value_groups, head_dim = 2, 16

    q, k, v = qkv(1, 4, 2, 9, 9, 16, torch.float32, scale=3.0)
    mask = torch.full((9, 9), -math.inf).triu(1)[None, None]
    hf, _ = eager_attention_forward(
        Module().eval(), *(t.double().cpu() for t in (q, k, v)), mask, 0.0, 0.25, 5.0
    )
    ours = attention(q, k, v, causal=True, scale=0.25, softcap=5.0)
    o, bound = error_bound(q, k, v, torch.float32, True, None, 0.25, 5.0)
    assert bool(((ours.double().cpu() - hf.transpose(1, 2)).abs() <= bound).all())


def test_softcap_zero_or_none_is_no_cap():
    """softcap=0 (FlashAttention's default) or None: the uncapped kernel, bit for bit."""
    q, k, v = qkv(1, 2, 1, 20, 20, 16, torch.float16, scale=2.0)
    plain = attention(q, k, v, causal=True)
    assert torch.equal(attention(q, k, v, causal=True, softcap=0), plain)
    assert torch.equal(attention(q, k, v, causal=True, softcap=None), plain)
    assert not torch.equal(attention(q, k, v, causal=True, softcap=1.0), plain)


def test_softcap_keeps_nan_keys_masked():
    """The cap is taken before the mask, and the mask selects −∞ with where: a NaN
    key behind the causal mask still cannot reach earlier queries."""
    q, k, v = qkv(1, 1, 1, 8, 8, 16, torch.float32)
    k[0, 0, 5, 3] = float("nan")
    out = attention(q, k, v, causal=True, softcap=3.0)
    nan_rows = torch.isnan(out[0, 0]).any(dim=1).cpu()
    assert nan_rows.tolist() == [False] * 5 + [True] * 3
