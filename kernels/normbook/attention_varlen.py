r"""Attention over packed sequences of different lengths, as FlashAttention's
``flash_attn_varlen_func``: the kernels of :mod:`normbook.attention` and
:mod:`normbook.attention_backward` in their ``VARLEN`` mode.

Layout. A batch of sequences is packed into rows, without padding: q is ``(total_q,
heads, head_dim)``, k and v ``(total_k, kv_heads, head_dim)``. ``cu_seqlens_q`` holds
the cumulative lengths (``batch + 1`` entries, from 0 to ``total_q``), so sequence
``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q, and likewise
``cu_seqlens_k`` for k and v. A sequence sees its own keys only, and every convention
of :func:`normbook.attention` holds within it: ``causal`` is aligned per sequence
(bottom-right: query ``i`` sees keys ``j <= i + len_k - len_q``), grouped-query heads,
``window``, ``softcap``, and a query that sees no key (a sequence without keys, or
rows above the causal diagonal) outputs 0.

The same kernels, not copies. The dense kernels already reach every element through
strides and compare rows and keys with ``seq_q`` and ``seq_k``. A packed batch is a
``(sequences, heads, packed rows, head_dim)`` view with batch stride 0, and ``VARLEN``
adds a few lines to each kernel: at its top, the program's batch index is a sequence,
whose first rows and lengths are read from ``cu_seqlens`` and take the place of
``seq_q`` and ``seq_k`` (and of the row offset of L and D); the grid covers
``max_seqlen_q`` (``max_seqlen_k`` for dk, dv), so a program whose tile starts past its
sequence's end visits no tile and writes nothing. The rest is the dense kernels' code:
masks, skipped tiles, the online softmax, the order of every sum. So there is one copy
to read and to keep right, and the result is *bitwise* that of
:func:`normbook.attention` on each sequence alone: a program of sequence ``b`` runs the
same operations, in the same order, on the same values (the tiles depend on head_dim,
the dtype and the GPU only), as a program of the dense kernel on that sequence; the
gradients too (dk, dv of a sequence only sum over its own queries).
tests/kernels/test_attention_varlen.py checks it bit for bit in Triton's interpreter;
on a GPU we expect the same (the same operations in the same order, FMA contraction
off), not yet checked there.

Checks. Shapes, dtypes, devices and keywords are checked from metadata; the values of
``cu_seqlens`` (first entry 0, non-decreasing, last entry = rows, no sequence longer
than ``max_seqlen``) need the host to read them, one synchronization, in
:func:`_check_cu_seqlens`, which the launch path calls right before the launch.
"""

import numbers

import torch
import triton

from . import _library
from ._config import _capability, tile_config
from .attention import _check_options, _check_tensors, _launch_forward
from .attention_backward import _launch_backward

CU_DTYPES = (torch.int32, torch.int64)


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
           scale, window, softcap):  # fmt: skip
    """The checks that need no value of a tensor (no host synchronization); returns
    (alignment or None, scale, window, softcap or None)."""
    _check_tensors(q, k, v, packed=True)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype not in CU_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(
                f"{name} must be 1-D with batch + 1 entries, got shape "
                f"{tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's length (batch + 1), "
            f"{cu_seqlens_q.numel()}, got {cu_seqlens_k.numel()}"
        )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    return _check_options(q.shape[2], causal, scale, window, softcap)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      total_q, total_k):  # fmt: skip
    """The checks of cu_seqlens' values, in one host synchronization, before any
    launch: each starts at 0, never decreases, ends at its tensor's rows, and no
    sequence is longer than its max_seqlen. Returns both as contiguous int32 (what the
    kernels read)."""
    both = torch.stack([cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)])
    for side, cu, longest, total in zip(
        "qk", both.tolist(), (max_seqlen_q, max_seqlen_k), (total_q, total_k)
    ):
        name = f"cu_seqlens_{side}"
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if lengths and min(lengths) < 0:
            b = lengths.index(min(lengths))
            raise ValueError(
                f"{name} must be non-decreasing, got {cu[b]} then {cu[b + 1]} "
                f"(sequence {b})"
            )
        if cu[-1] != total:
            rows = "q" if side == "q" else "k and v"
            raise ValueError(
                f"{name} must end at the rows of {rows}, {total}, got {cu[-1]}"
            )
        if lengths and max(lengths) > longest:
            raise ValueError(
                f"max_seqlen_{side} is {longest} but sequence "
                f"{lengths.index(max(lengths))} of {name} has {max(lengths)} rows"
            )
    return (
        cu_seqlens_q.to(torch.int32).contiguous(),
        cu_seqlens_k.to(torch.int32).contiguous(),
    )


def _batched(t, n):
    """(rows, heads, head_dim) as (n, heads, rows, head_dim), batch stride 0: the view
    the kernels take in their VARLEN mode (no copy)."""
    return t.permute(1, 0, 2).unsqueeze(0).expand(n, -1, -1, -1)


def _forward(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, alignment, scale,
             window, softcap=None, save_lse=False):  # fmt: skip
    """Launch on checked inputs (``cu_q``, ``cu_k``: from :func:`_check_cu_seqlens`);
    returns (output, visited, L). visited: key tiles per program; L: the log-sum-exp
    per row, fp32, (heads, total_q), when ``save_lse``, else None."""
    total_q, H, D = q.shape
    n = cu_q.numel() - 1
    out = torch.empty((total_q, H, D), dtype=q.dtype, device=q.device)
    lse = None
    if save_lse:
        lse = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    BLOCK_M = tile_config(D, q.dtype, _capability(q))[0]
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), n * H)
    visited = torch.zeros(grid[::-1], dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out, visited, lse
    if k.shape[0] == 0:  # no key in any sequence: every row is 0, and L = +inf
        if save_lse:
            lse.fill_(float("inf"))
        return out.zero_(), visited, lse
    _launch_forward(
        *(_batched(t, n) for t in (q, k, v, out)),
        lse,
        visited,
        alignment,
        scale,
        window,
        softcap,
        cu_seqlens=(cu_q, cu_k),
    )
    return out, visited, lse


def _backward(do, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
              alignment, scale, window, softcap, needs=(True,) * 3):  # fmt: skip
    """(dq, dk, dv) in the packed layout from dO and the forward's saved tensors; None
    where ``needs`` (q, k, v) says no gradient is wanted."""
    n = cu_q.numel() - 1
    want_q, want_kv = needs[0], needs[1] or needs[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if want_q else None
    dk = dv = None
    if want_kv:
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty_like(dk)
    if q.numel() == 0 or k.shape[0] == 0:
        # No query, or no key: nothing depends on anything, every gradient is 0.
        return tuple(None if g is None else g.zero_() for g in (dq, dk, dv))
    _launch_backward(
        *(_batched(t, n) for t in (do, q, k, v, out)),
        lse,
        *(None if g is None else _batched(g, n) for g in (dq, dk, dv)),
        alignment,
        scale,
        window,
        softcap,
        varlen=(cu_q, cu_k, max_seqlen_q, max_seqlen_k),
    )
    return dq, dk, dv


# torch.ops.normbook.attention_varlen and its backward (the pattern: normbook._library).


@torch.library.custom_op("normbook::attention_varlen", mutates_args=())
def _op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alignment: str | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    save_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.attention_varlen``: cu_seqlens' values checked (a host
    read, so here and not in the public function, which fake tensors also run), then
    (output, L); L (fp32, (heads, total_q)) only when ``save_lse`` (else empty)."""
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    cu_q, cu_k = _check_cu_seqlens(*lengths, q.shape[0], k.shape[0])
    out, _, lse = _forward(
        q, k, v, cu_q, cu_k, *lengths[2:], alignment, scale, window, softcap, save_lse
    )
    return out, lse if save_lse else q.new_empty(0, dtype=torch.float32)


@_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, alignment, scale, window, softcap, save_lse):
    lse_shape = (q.shape[1], q.shape[0]) if save_lse else (0,)
    return _library.fresh(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("normbook::attention_varlen_backward", mutates_args=())
def _op_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alignment: str | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    need_dq: bool,
    need_dkv: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.attention_varlen_backward``: (dq, dk, dv) in the packed
    layout, :func:`~normbook._library.not_computed` where not asked for."""
    cu_q, cu_k = (c.to(torch.int32).contiguous() for c in (cu_seqlens_q, cu_seqlens_k))
    grads = _backward(
        do, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k, alignment,
        scale, window, softcap, needs=(need_dq, need_dkv, need_dkv),
    )  # fmt: skip
    return tuple(_library.not_computed(q) if g is None else g for g in grads)


@_op_backward.register_fake
def _(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alignment, scale, window,
      softcap, need_dq, need_dkv):  # fmt: skip
    def grad(t, needed):
        return _library.fresh(t) if needed else _library.not_computed(q)

    return grad(q, need_dq), grad(k, need_dkv), grad(v, need_dkv)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = tuple(args)  # max_seqlen_q, max_seqlen_k, alignment, scale, ...


def _autograd_backward(ctx, do, _):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    dq, dk, dv = torch.ops.normbook.attention_varlen_backward(
        do, q, k, v, out, lse, cu_q, cu_k, *ctx.args, need_q, need_k or need_v
    )
    return (
        dq if need_q else None,
        dk if need_k else None,
        dv if need_v else None,
        *(None,) * 9,
    )


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    scale=None,
    window=None,
    softcap=None,
):
    r"""Attention over packed sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func``): each sequence is :func:`normbook.attention` on its own
    rows, bit for bit (see the module's docstring).

    Args:
        q: ``(total_q, heads, head_dim)``, float32, float16 or bfloat16; any strides.
        k, v: ``(total_k, kv_heads, head_dim)``, q's dtype and device; ``kv_heads``
            divides ``heads`` (grouped-query attention, as :func:`normbook.attention`).
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) 1-D, ``batch + 1`` entries each,
            on q's device: 0, then the cumulative lengths, the last one the rows of q
            (of k and v). Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b +
            1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v. Zero
            lengths are allowed.
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence's lengths (the
            grid covers them).
        causal: as :func:`normbook.attention`, within each sequence: ``True`` or
            ``"bottom_right"``: query ``i`` sees keys ``j <= i + len_k - len_q``;
            ``"top_left"``: ``j <= i``.
        scale, window, softcap: as :func:`normbook.attention`.

    Returns ``(total_q, heads, head_dim)`` in q's dtype. A query that sees no key (its
    sequence has none, or it is above the causal diagonal) gives zeros.

    Differentiable in q, k and v, as :func:`normbook.attention` (no atomics: bitwise
    reproducible gradients); cu_seqlens and max_seqlen are indices, not differentiated.

    Raises:
        TypeError / ValueError naming the bad argument, before any launch; the values of
        cu_seqlens are read on the host (one synchronization) to check them.
    """
    args = _check(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        scale, window, softcap,
    )  # fmt: skip
    lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    # L is saved only when a gradient will be needed
    save_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    op = torch.ops.normbook.attention_varlen
    return op(q, k, v, *lengths, *args, save_lse)[0]
