"""normbook.attention_varlen (packed sequences) against the float64 reference and, bit
for bit, against normbook.attention on each sequence alone.

Sizes. The interpreter's tiles are 32 rows (fp32) or 64 (fp16, bf16) in the forward and
16 to 64 in the backward (tile_config, bwd_tile_config), so the ragged batch RAGGED has
a sequence of 70 queries and 66 keys (partial tiles on both sides of every tile size,
the causal diagonal off the tile grid, 4 fully masked rows), short ones (5 queries
before 9 keys, 20 and 20: seq_q < = > seq_k), and both kinds of empty sequence (no
query; one query and no key). A sequence start off by one row, a length read from the
wrong entry, or a tile of one sequence reading its neighbour's keys moves whole rows by
~|v|: far above the bounds, and never bitwise equal to the per-sequence calls.
"""

import importlib
from itertools import accumulate

import pytest
import torch
from attention_bounds import assert_grads_within_bound, error_bound
from conftest import LOW_PRECISION, assert_rejected_before_launch, on_cpu, randn

from normbook import DEVICE, attention, attention_varlen
from normbook import reference as ref

# the module, not the function of the same name
varlen_module = importlib.import_module("normbook.attention_varlen")
dense_module = importlib.import_module("normbook.attention")

#: (lengths of q, lengths of k) per sequence: see the module docstring
RAGGED = ([5, 0, 70, 1, 20], [9, 4, 66, 0, 20])


def cumulative(lengths, dtype=torch.int32):
    """cu_seqlens: 0, then the running sums of the lengths."""
    return torch.tensor([0, *accumulate(lengths)], dtype=dtype, device=DEVICE)


def packed(lq, lk, H=2, H_kv=1, D=16, dtype=torch.float32, scale=2.0, grad=False):
    """q, k, v packed from sequences of lengths lq (queries) and lk (keys), and their
    cu_seqlens and max_seqlen."""
    q = randn(sum(lq), H, D, dtype=dtype, scale=scale)
    k = randn(sum(lk), H_kv, D, dtype=dtype, scale=scale)
    v = randn(sum(lk), H_kv, D, dtype=dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return (
        q,
        k,
        v,
        cumulative(lq),
        cumulative(lk),
        max(lq, default=0),
        max(lk, default=0),
    )


def sequences(t, cu):
    """Sequence b of a packed tensor as (1, heads, length, head_dim): a view."""
    cu = cu.tolist()
    return [t[a:b].transpose(0, 1)[None] for a, b in zip(cu, cu[1:])]


def bits(t):
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(
    "causal, softcap", [(False, None), (True, 2.0), ("top_left", None)]
)
def test_matches_reference(causal, softcap, dtype, poison_empty):
    q, k, v, cu_q, cu_k, max_q, max_k = packed(*RAGGED, dtype=dtype)
    kw = dict(causal=causal, softcap=softcap)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    exact = ref.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    for b, (o, qb, kb, vb) in enumerate(
        zip(
            *(
                sequences(t, c)
                for t, c in ((out, cu_q), (q, cu_q), (k, cu_k), (v, cu_k))
            )
        )
    ):
        if kb.shape[2] == 0:  # a sequence without keys: its queries give exactly 0
            assert bool((o == 0).all())
            continue
        if qb.shape[2] == 0:
            continue
        e, bound = error_bound(qb, kb, vb, dtype, causal, None, None, softcap)
        assert torch.equal(e, sequences(exact, cu_q)[b].cpu())
        err = (on_cpu(o).double() - e).abs()
        assert not torch.isnan(err).any(), f"sequence {b}: NaN (unwritten?)"
        assert bool((err <= bound).all()), f"sequence {b}: {err.max():.3g}"


def per_sequence(q, k, v, cu_q, cu_k, **kw):
    """normbook.attention on each sequence alone, packed back."""
    outs = [
        attention(qb, kb, vb, **kw)[0].transpose(0, 1)
        for qb, kb, vb in zip(
            sequences(q, cu_q), sequences(k, cu_k), sequences(v, cu_k)
        )
    ]
    return torch.cat(outs)


VARIANTS = [
    dict(),
    dict(causal=True),
    dict(causal="top_left", softcap=3.0),
    dict(causal=True, window=7, softcap=1.5, scale=0.3),
]


#: Every variant in fp32 (tiles of 32: the long sequence spans three); the fullest in
#: bf16 too (tiles of 64, 2-byte elements: other strides in bytes, the same in elements)
BITWISE = [(kw, torch.float32) for kw in VARIANTS] + [(VARIANTS[-1], torch.bfloat16)]


@pytest.mark.parametrize("kw, dtype", BITWISE, ids=str)
def test_bitwise_equal_to_attention_per_sequence(kw, dtype, poison_empty):
    """The same kernels on the same tiles: every output bit, every gradient bit and the
    number of key tiles each sequence's programs visit equal those of attention called
    on each sequence alone (the proof: attention_varlen's module docstring)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(*RAGGED, dtype=dtype, grad=True)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    do = randn(*out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    alone = per_sequence(*leaves, cu_q, cu_k, **kw)
    assert torch.equal(bits(out), bits(alone))
    alone_grads = torch.autograd.grad(alone, leaves, do)
    for name, g, a in zip("qkv", grads, alone_grads):
        assert torch.equal(bits(g), bits(a)), f"d{name}"
    # the tiles: each sequence's programs visit as many key tiles as attention's
    args = dense_module._check(q[:0].transpose(0, 1)[None], k[:0].transpose(0, 1)[None],
                               v[:0].transpose(0, 1)[None], kw.get("causal", False),
                               kw.get("scale"), kw.get("window"), kw.get("softcap"))  # fmt: skip
    _, visited, _ = varlen_module._forward(
        q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k, *args
    )
    per_seq = visited.view(len(RAGGED[0]), -1).sum(1).tolist()
    for b, (qb, kb, vb) in enumerate(
        zip(sequences(q, cu_q), sequences(k, cu_k), sequences(v, cu_k))
    ):
        if qb.shape[2] == 0 or kb.shape[2] == 0:
            assert per_seq[b] == 0
            continue
        dense = dense_module._forward(qb.detach(), kb.detach(), vb.detach(), *args)
        assert per_seq[b] == int(dense[1].sum()), f"sequence {b}"


#: Every masked variant in fp32; the fullest (causal, window, cap, scale) in every dtype
GRADIENTS = [(kw, torch.float32) for kw in VARIANTS[1:]] + [
    (VARIANTS[-1], dt) for dt in LOW_PRECISION[1:]
]


@pytest.mark.parametrize("kw, dtype", GRADIENTS, ids=str)
def test_gradients_match_float64(kw, dtype, poison_empty):
    """Against the float64 gradients of each sequence, within the dense backward's
    bound (attention_bounds.grad_bounds), sequence by sequence."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(*RAGGED, dtype=dtype, grad=True)
    do = randn(*q.shape, dtype=dtype)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
    pieces = zip(
        *(sequences(t, c) for t, c in ((q, cu_q), (k, cu_k), (v, cu_k), (do, cu_q))),
        *(sequences(g, c) for g, c in ((dq, cu_q), (dk, cu_k), (dv, cu_k))),
    )
    for qb, kb, vb, dob, *gb in pieces:
        if kb.shape[2] == 0 or qb.shape[2] == 0:  # nothing depends on anything: 0
            assert all(bool((g == 0).all()) for g in gb)
            continue
        assert_grads_within_bound(
            gb, qb, kb, vb, dob, kw["causal"], kw.get("window"), kw.get("scale"),
            kw.get("softcap"),
        )  # fmt: skip


def test_reference_is_the_dense_reference_per_sequence():
    """reference.attention_varlen: each sequence is reference.attention on its rows
    (causal bottom-right within it: 2 queries before 4 keys, 3 and 3); a query of a
    sequence without keys gives 0."""
    q, k, v, cu_q, cu_k, *_ = packed([2, 3, 1], [4, 3, 0], H=2, H_kv=1, D=3)
    got = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True, softcap=1.0)
    for b, (qb, kb, vb) in enumerate(
        zip(sequences(q, cu_q), sequences(k, cu_k), sequences(v, cu_k))
    ):
        rows = slice(*cu_q.tolist()[b : b + 2])
        if kb.shape[2] == 0:
            assert bool((got[rows] == 0).all())
            continue
        alone = ref.attention(qb, kb, vb, True, None, None, 1.0)[0].transpose(0, 1)
        assert torch.equal(got[rows], alone)


@pytest.mark.filterwarnings("ignore:Input #.*not a double precision")
def test_gradcheck_fp32():
    """torch.autograd.gradcheck through the varlen kernels (fp32: they take no float64;
    central differences with step 1e-2, fast mode), on a tiny ragged batch with an
    empty sequence, GQA, causal and a cap."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed([3, 0, 4], [2, 3, 5], H=2, H_kv=1, D=4,
                                               grad=True)  # fmt: skip
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softcap=2.0
        ),
        (q, k, v),
        eps=1e-2,
        atol=2e-3,
        rtol=2e-2,
        fast_mode=True,
    )


def test_int64_cu_seqlens_and_larger_max_seqlen_change_nothing():
    """int64 cu_seqlens (converted to int32 for the kernels) and a max_seqlen above the
    longest sequence (more programs, each past its sequence's end, writing nothing):
    the same bits."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(*RAGGED)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    again = attention_varlen(
        q, k, v, cu_q.long(), cu_k.long(), max_q + 100, max_k + 1, causal=True
    )
    assert torch.equal(bits(out), bits(again))


def test_strided_inputs_are_used_in_place(poison_empty):
    """q, k, v sliced from one fused qkv projection (rows of 3 · heads · head_dim) and
    a head_dim with stride 2: the same bits as contiguous copies."""
    lq = [7, 30, 11]
    cu = cumulative(lq)
    qkv = randn(sum(lq), 8, 2 * 16)
    q, k, v = qkv[:, :4, ::2], qkv[:, 4:6, :16], qkv[:, 6:8, 16:]
    assert not q.is_contiguous() and q.stride(-1) == 2
    out = attention_varlen(q, k, v, cu, cu, 30, 30, causal=True)
    flat = attention_varlen(
        q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 30, 30, causal=True
    )
    assert torch.equal(out, flat)


def test_empty_batches(poison_empty):
    """No sequence (cu_seqlens [0]); sequences without rows; no key anywhere: zeros
    (and zero gradients), never NaN."""
    q, k, v, cu_q, cu_k, *_ = packed([], [])
    assert attention_varlen(q, k, v, cu_q, cu_k, 0, 0).shape == (0, 2, 16)
    q, k, v, cu_q, cu_k, *_ = packed([0, 0], [3, 0])
    assert attention_varlen(q, k, v, cu_q, cu_k, 0, 3, causal=True).shape == (0, 2, 16)
    q, k, v, cu_q, cu_k, max_q, _ = packed([4, 2], [0, 0], grad=True)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, 0)
    assert bool((out == 0).all())
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert bool((dq == 0).all())


def test_differentiable_and_no_grad_paths_agree():
    q, k, v, cu_q, cu_k, max_q, max_k = packed([3, 9], [5, 9])
    plain = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    out = attention_varlen(q.requires_grad_(), k, v, cu_q, cu_k, max_q, max_k,
                           causal=True)  # fmt: skip
    assert plain.grad_fn is None and out.grad_fn is not None
    assert torch.equal(out.detach(), plain)


# ---------------------------------------------------------------- arguments


def _int(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


#: Each call takes the good (q, k, v, cu_q, cu_k): q 8 rows in sequences [3, 5], k and
#: v 9 rows in [4, 5], max_seqlen 5.
BAD = [
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq.float(), ck, 5, 5),
     TypeError, "cu_seqlens_q must be int32 or int64"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck.tolist(), 5, 5),
     TypeError, "cu_seqlens_k must be a torch.Tensor"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq[None], ck, 5, 5),
     ValueError, "cu_seqlens_q must be 1-D"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq[:0], ck[:0], 5, 5),
     ValueError, "cu_seqlens_q must be 1-D with batch + 1 entries"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck.to("meta"), 5, 5),
     ValueError, "cu_seqlens_k is on meta"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, _int([0, 9]), 5, 5),
     ValueError, "cu_seqlens_k must have cu_seqlens_q's length"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, _int([1, 3, 8]), ck, 5, 5),
     ValueError, "cu_seqlens_q must start at 0"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, _int([0, 6, 4]), 5, 5),
     ValueError, "cu_seqlens_k must be non-decreasing"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, _int([0, 3, 7]), ck, 5, 5),
     ValueError, "cu_seqlens_q must end at the rows of q, 8"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, _int([0, 4, 10]), 5, 6),
     ValueError, "cu_seqlens_k must end at the rows of k and v, 9"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 4, 5),
     ValueError, "max_seqlen_q is 4 but sequence 1"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, 3),
     ValueError, "max_seqlen_k is 3 but sequence 1 of cu_seqlens_k has 5"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, -1, 5),
     ValueError, "max_seqlen_q must be >= 0"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5.0, 5),
     TypeError, "max_seqlen_q must be an int"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, True),
     TypeError, "max_seqlen_k must be an int"),
    (lambda q, k, v, cq, ck: attention_varlen(q[None], k, v, cq, ck, 5, 5),
     ValueError, "q must have 3 dimensions (rows, heads, head_dim)"),
    (lambda q, k, v, cq, ck: attention_varlen(q.double(), k, v, cq, ck, 5, 5),
     TypeError, "q must be float32"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k.half(), v, cq, ck, 5, 5),
     TypeError, "k must have q's dtype"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v[:8], cq, ck, 5, 5),
     ValueError, "v must have k's heads and rows"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k.repeat(1, 3, 1),
                                              v.repeat(1, 3, 1), cq, ck, 5, 5),
     ValueError, "must divide q's heads"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k[..., :8], v[..., :8], cq, ck, 5, 5),
     ValueError, "k must have q's head_dim"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, 5, causal="x"),
     ValueError, "causal must be"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, 5, window=2),
     ValueError, "window needs causal"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, 5, softcap=-2.0),
     ValueError, "softcap"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, 5, softcap=False),
     TypeError, "softcap"),
    (lambda q, k, v, cq, ck: attention_varlen(q, k, v, cq, ck, 5, 5, scale="1"),
     TypeError, "scale must be"),
]  # fmt: skip


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("call, exc, words", BAD)
def test_bad_arguments_are_rejected_before_launch(monkeypatch, call, exc, words, grad):
    """Every bad argument is refused with an error naming it and no launch, on both
    paths (the autograd Function checks cu_seqlens' values before its _forward)."""
    q, k, v, cu_q, cu_k, *_ = packed([3, 5], [4, 5], grad=grad)
    assert_rejected_before_launch(
        monkeypatch, "attention_varlen", lambda: call(q, k, v, cu_q, cu_k), exc, words
    )


def test_value_checks_run_in_one_place(monkeypatch):
    """cu_seqlens' values are read in _check_cu_seqlens only (one host
    synchronization), on the launch path: the public call and the autograd Function
    both go through it, with the values they launch with."""
    seen = []
    real = varlen_module._check_cu_seqlens

    def spy(*args):
        seen.append(args[2:])
        return real(*args)

    monkeypatch.setattr(varlen_module, "_check_cu_seqlens", spy)
    q, k, v, cu_q, cu_k, max_q, max_k = packed([3, 5], [4, 5])
    attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    attention_varlen(q.requires_grad_(), k, v, cu_q, cu_k, max_q, max_k)
    assert seen == [(5, 5, 8, 9)] * 2
