r"""Scaled dot-product attention as FlashAttention-style Triton kernels, forward and
backward.

.. math:: O = \mathrm{softmax}\bigl(\text{scale}\cdot Q K^\top + \text{mask}\bigr)\, V

Layout as ``F.scaled_dot_product_attention``: ``(batch, heads, seq, head_dim)``. One
program owns ``BLOCK_M`` query rows of one head and streams the keys and values past
them in tiles of ``BLOCK_N``, keeping only the online-softmax state per row: the running
maximum ``m``, the running sum ``l`` of ``exp(s - m)`` and the unnormalized output
``acc`` (all fp32). The ``seq_q × seq_k`` score matrix never exists in memory, only one
``BLOCK_M × BLOCK_N`` tile of it, in registers.

Masks (``causal``, ``window``) are computed from indices, never loaded. Key tiles that
are masked for every row of a query tile are not visited at all; :func:`tiles_visited`
counts the tiles each program visits, straight from the kernel.

Backward: :mod:`normbook.attention_backward` (FlashAttention-2, no atomics: bitwise
reproducible gradients), beside this module; the operator
``torch.ops.normbook.attention_backward`` calls it.
When a gradient will be needed, the forward also saves the log-sum-exp of each row,
``L = m + log l`` (natural log, fp32; ``+inf`` for a row that sees no key), from which
the backward recomputes the probabilities tile by tile instead of storing them.

Conventions (see the chapter "Causal masks"):

* ``causal=True`` is *bottom-right* aligned, as FlashAttention 2.1+ and decoding with a
  KV cache: query ``i`` sees keys ``j <= i + seq_k - seq_q`` (the last query sees every
  key). ``causal="top_left"`` is ``F.scaled_dot_product_attention(is_causal=True)``:
  ``j <= i``. Both agree when ``seq_q == seq_k``.
* ``window=W`` (with ``causal``), as Mistral: each query also sees at most ``W`` keys,
  itself and the ``W - 1`` before it.
* A query row that sees no key at all (fully masked) outputs **0**, not NaN: the sum
  over no keys is 0, which is what FlashAttention returns and what stops one empty row
  from poisoning everything downstream of it. Its gradients are 0 as well (it depends on
  no q, k or v).
* ``softcap=c`` (Gemma 2's ``attn_logit_softcapping``, FlashAttention's ``softcap``):
  each scaled score ``s = scale·q·k`` becomes ``c·tanh(s/c)``, before the mask and the
  softmax, so no score leaves (−c, c); the backward multiplies dS by ``1 − tanh²(s/c)``
  (the chain rule through the cap). tanh is built from exp2
  (:func:`normbook._triton_utils.tanh`); ``SOFTCAP`` is a constexpr: without a cap,
  none of the cap's code is compiled into the kernels.
* Packed sequences of different lengths (FlashAttention's varlen layout):
  :func:`normbook.attention_varlen` runs these kernels and their backward in their
  ``VARLEN`` mode; every convention above holds within each sequence (``causal`` is
  aligned per sequence), and each sequence's output is bitwise that of this function
  on it alone (checked in the interpreter).
"""

import numbers

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import LAUNCH, _capability, tile_config
from ._runtime import INTERPRET, device_guard
from ._triton_utils import round_to, tanh
from .attention_backward import _backward, _score_scales

LN2 = 0.6931471805599453  # log(x) = log2(x) · ln 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
ALIGNMENTS = {
    True: "bottom_right",
    "bottom_right": "bottom_right",
    "top_left": "top_left",
}


@triton.jit
def _attention_fwd(
    Q,
    K,
    V,
    O,
    Tiles,
    LSE,  # pointers: inputs, output, tiles visited, L
    CuSeqQ,
    CuSeqK,  # VARLEN: cumulative sequence lengths of the packed q and k rows
    sqb,
    sqh,
    sqm,
    sqd,  # strides of Q (batch, head, seq, dim), in elements
    skb,
    skh,
    skn,
    skd,  # strides of K
    svb,
    svh,
    svn,
    svd,  # strides of V
    sob,
    soh,
    som,  # strides of O (contiguous in dim)
    H,
    GROUP,
    seq_q,
    seq_k,
    D,  # q heads, q heads per k/v head, lengths (VARLEN: packed rows), head_dim
    # scale·log2(e) (SOFTCAP: scale/c); causal diagonal offset (VARLEN: 1 bottom-right,
    # 0 top-left); window (keys per query); c·log2(e)
    qk_scale,
    offset,
    window,
    softcap,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SAVE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64: batch · stride can pass 2**31
    h = bh % H
    # grouped-query attention: GROUP q heads share a k/v head
    h_kv = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    o_base = O + b * sob + h * soh
    lse_base = LSE + bh.to(tl.int64) * seq_q  # L: (batch, heads, seq_q)
    if VARLEN:
        # Packed sequences (batch strides 0): b is a sequence, rows cu[b] to cu[b + 1]
        # of the packed q (and of k, v); from here on seq_q, seq_k are its lengths.
        row0 = tl.load(CuSeqQ + b).to(tl.int64)
        col0 = tl.load(CuSeqK + b).to(tl.int64)
        lse_base = LSE + h * seq_q + row0  # L: (heads, packed rows)
        seq_q = (tl.load(CuSeqQ + b + 1) - row0).to(tl.int32)
        seq_k = (tl.load(CuSeqK + b + 1) - col0).to(tl.int32)
        offset = offset * (seq_k - seq_q)  # bottom-right within the sequence
        q_base += row0 * sqm
        k_base += col0 * skn
        v_base += col0 * svn
        o_base += row0 * som

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < D  # head_dim padded up to a power of two >= 16 (tl.dot's minimum)
    q = tl.load(
        q_base + rows[:, None] * sqm + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        # the interpreter's bf16 dot is broken; fp32 holds bf16 exactly
        q = q.to(tl.float32)

    # The online-softmax state of each row: max m, sum l of exp(s - m), output acc = Σ
    # exp(s-m) v.
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Which keys can any row of this tile see? Tiles outside [lo, hi) are masked for
    # every row: skip them (about half of all tiles for a causal mask, most of them for
    # a short window).
    lo = 0
    hi = seq_k
    if CAUSAL:
        last_row = tl.minimum(tile_m * BLOCK_M + BLOCK_M, seq_q) - 1
        hi = tl.maximum(tl.minimum(hi, last_row + offset + 1), 0)
        if WINDOW:
            first_row = tile_m * BLOCK_M
            lo = tl.maximum(first_row + offset - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N  # start on a tile boundary
    if VARLEN:
        # the grid covers the longest sequence: a tile past this one's end has no row
        hi = tl.where(tile_m * BLOCK_M < seq_q, hi, lo)
    visited = 0
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        kt = tl.load(
            k_base + cols[None, :] * skn + dims[:, None] * skd,
            # K tile, transposed
            mask=col_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        # Scores in base 2: s·log2(e), so that exp2 gives exp(s).
        s = (
            tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            * qk_scale
        )
        if SOFTCAP:
            # c·tanh(scale·q·k/c), before the mask (qk_scale: scale/c; softcap: c·log2e)
            s = tanh(s) * softcap
        keep = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
            if WINDOW:
                keep = keep & (cols[None, :] > rows[:, None] + offset - window)
        # where, not +(-inf): a NaN key stays masked
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row with no visible key yet has m_new = -inf; shift by 0 instead, so that
        # exp2(-inf - (-inf)) = NaN never appears and its p and l stay exactly 0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        # rescales the old state to the new maximum (0 if m = -inf)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        vt = tl.load(
            v_base + cols[:, None] * svn + dims[None, :] * svd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        # P is rounded to V's dtype for the tensor-core product, as FlashAttention does.
        p_low = round_to(p, V.dtype.element_ty)
        if UPCAST:
            p_low = p_low.to(tl.float32)
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(
            p_low, vt, input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
        m = m_new
        visited += 1

    # A fully masked row has l = 0 and acc = 0: divide by 1, output 0, not 0/0.
    l_pos = tl.where(l > 0.0, l, 1.0)
    if SAVE_LSE:
        # For the backward: L = log Σ_j exp(s_j) = (m + log2 l)·ln 2 (m is in base 2).
        # A row that sees no key gets +inf, so that exp(s - L) = 0 there: 0 gradients.
        lse = tl.where(l > 0.0, (m + tl.log2(l_pos)) * 0.6931471805599453, float("inf"))
        tl.store(lse_base + rows, lse, mask=row_ok)
    # Normalize once at the end.
    out = acc / l_pos[:, None]
    o_ptr = o_base + rows[:, None] * som + dims[None, :]
    tl.store(
        o_ptr, round_to(out, O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
    )
    tl.store(Tiles + bh.to(tl.int64) * tl.num_programs(0) + tile_m, visited)


def _check_tensors(q, k, v, packed=False):
    """The checks of q, k and v: types, dtypes, devices and shapes, either
    ``(batch, heads, seq, head_dim)`` or, ``packed``, ``(rows, heads, head_dim)``."""
    ndim, seq, what = (3, 0, "(rows, heads, head_dim)") if packed else (4, 2, "")
    what = what or "(batch, heads, seq, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(
                f"{name} must be float32, float16 or bfloat16, got {t.dtype}"
            )
        if t.dim() != ndim:
            raise ValueError(
                f"{name} must have {ndim} dimensions {what}, got shape {tuple(t.shape)}"
            )
        _validate.check_device(t, name)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype, {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; put "
                "them on one device"
            )
        if not packed and t.shape[0] != q.shape[0]:
            raise ValueError(
                f"{name} must have q's batch size, {q.shape[0]}, got {t.shape[0]}"
            )
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"{name} must have q's head_dim, {q.shape[-1]}, got {t.shape[-1]}"
            )
    if k.shape[1] != v.shape[1] or k.shape[seq] != v.shape[seq]:
        raise ValueError(
            f"v must have k's heads and {'rows' if packed else 'seq_k'}, "
            f"{(k.shape[1], k.shape[seq])}, got {(v.shape[1], v.shape[seq])}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"k and v heads ({k.shape[1]}) must divide q's heads "
            f"({q.shape[1]}): "
            "grouped-query attention shares each k/v head among a group "
            "of q heads"
        )
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {q.shape[-1]}"
        )


def _check_options(head_dim, causal, scale, window, softcap):
    """The checks of the keywords; returns (alignment or None, scale, window, softcap
    or None)."""
    if isinstance(causal, bool):
        alignment = ALIGNMENTS[True] if causal else None
    elif isinstance(causal, str) and causal in ALIGNMENTS:
        alignment = ALIGNMENTS[causal]
    else:
        raise ValueError(
            f"causal must be False, True, 'bottom_right' or 'top_left', got {causal!r}"
        )
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a real number or None, got {type(scale).__name__}"
        )
    scale = float(scale)
    if not abs(scale) < float("inf"):
        raise ValueError(f"scale must be finite, got {scale}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(
                f"window must be an int or None, got {type(window).__name__}"
            )
        if window < 1:
            raise ValueError(
                f"window must be >= 1 (keys each query sees), got {window}"
            )
        if alignment is None:
            raise ValueError(
                "window needs causal: a sliding window limits how far "
                "back a "
                "causal query looks (window=W: itself and the W - 1 keys "
                "before)"
            )
        window = int(window)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(
                f"softcap must be a real number or None, got {type(softcap).__name__}"
            )
        softcap = float(softcap)
        if softcap == 0.0:
            softcap = None  # 0 means no cap, as FlashAttention's softcap=0.0
        elif not 0.0 < softcap < float("inf"):
            raise ValueError(
                f"softcap must be a finite number > 0 (or 0 or None: no cap), "
                f"got {softcap}"
            )
    return alignment, scale, window, softcap


def _check(q, k, v, causal, scale, window, softcap=None):
    """Every argument check, before any launch; returns (alignment or None, scale,
    window, softcap or None)."""
    _check_tensors(q, k, v)
    return _check_options(q.shape[3], causal, scale, window, softcap)


def _launch_forward(q, k, v, out, lse, visited, alignment, scale, window, softcap,
                    cu_seqlens=None):  # fmt: skip
    """Run the forward kernel on ``(batch, heads, seq, head_dim)`` tensors and write
    ``out``, ``visited`` and, unless it is None, ``lse`` ((batch, heads, seq_q)).

    ``cu_seqlens = (cu_q, cu_k)`` (int32): packed sequences, as
    :mod:`normbook.attention_varlen` passes them: q, k, v and out are views of the
    packed rows with batch stride 0 (batch = sequences, seq = all packed rows), lse is
    (heads, packed rows) and the grid is ``visited``'s shape, transposed."""
    B, H, seq_q, D = q.shape
    H_kv, seq_k = k.shape[1], k.shape[2]
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps = tile_config(D, q.dtype, _capability(q))
    varlen = cu_seqlens is not None
    if varlen:  # the kernel takes each sequence's own offset: 1 says bottom-right
        offset = 1 if alignment == "bottom_right" else 0
    else:  # bottom-right: the diagonal ends at the last key (seq_k - seq_q); top-left 0
        offset = seq_k - seq_q if alignment == "bottom_right" else 0
    cu_q, cu_k = cu_seqlens if varlen else (visited, visited)  # placeholders
    qk_scale, cap = _score_scales(scale, softcap)
    with device_guard(q):
        _attention_fwd[visited.shape[::-1]](
            q,
            k,
            v,
            out,
            visited,
            out if lse is None else lse,  # out: a placeholder
            cu_q,
            cu_k,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride()[:3],
            H,
            H // H_kv,
            seq_q,
            seq_k,
            D,
            qk_scale,
            offset,
            window or 0,
            cap,
            CAUSAL=alignment is not None,
            WINDOW=window is not None,
            SOFTCAP=softcap is not None,
            VARLEN=varlen,
            UPCAST=INTERPRET,
            DOT_PRECISION="ieee",  # fp32 products, not TF32
            SAVE_LSE=lse is not None,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            num_warps=num_warps,
            **LAUNCH,
        )


def _forward(q, k, v, alignment, scale, window, softcap=None, save_lse=False):
    """Launch on checked inputs; returns (output, visited, L). visited: key tiles per
    program; L: the log-sum-exp per row (fp32, (batch, heads, seq_q)) when ``save_lse``,
    else None."""
    B, H, seq_q, D = q.shape
    seq_k = k.shape[2]
    out = torch.empty((B, H, seq_q, D), dtype=q.dtype, device=q.device)
    lse = None
    if save_lse:
        lse = torch.empty((B, H, seq_q), dtype=torch.float32, device=q.device)
    BLOCK_M = tile_config(D, q.dtype, _capability(q))[0]
    grid = (triton.cdiv(seq_q, BLOCK_M), B * H)
    visited = torch.empty(grid[::-1], dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out, visited, lse
    if seq_k == 0:  # no key at all: every row is fully masked: 0, and L = +inf
        if save_lse:
            lse.fill_(float("inf"))
        return out.zero_(), visited.zero_(), lse
    _launch_forward(q, k, v, out, lse, visited, alignment, scale, window, softcap)
    return out, visited, lse


# torch.ops.normbook.attention and its backward (the pattern: normbook._library).


@torch.library.custom_op("normbook::attention", mutates_args=())
def _op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alignment: str | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    save_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.attention``: (output, L); L, the per-row log-sum-exp the
    backward reads (fp32, (batch, heads, seq_q)), only when ``save_lse`` (else
    empty)."""
    out, _, lse = _forward(q, k, v, alignment, scale, window, softcap, save_lse)
    return out, lse if save_lse else q.new_empty(0, dtype=torch.float32)


@_op.register_fake
def _(q, k, v, alignment, scale, window, softcap, save_lse):
    lse_shape = q.shape[:3] if save_lse else (0,)
    return _library.fresh(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("normbook::attention_backward", mutates_args=())
def _op_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    alignment: str | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    need_dq: bool,
    need_dkv: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.attention_backward``: (dq, dk, dv), each
    :func:`~normbook._library.not_computed` where not asked for (dk and dv go
    together: one kernel writes both)."""
    needs = (need_dq, need_dkv, need_dkv)
    grads = _backward(
        do, q, k, v, out, lse, alignment, scale, window, softcap, needs=needs
    )
    return tuple(_library.not_computed(q) if g is None else g for g in grads)


@_op_backward.register_fake
def _(do, q, k, v, out, lse, alignment, scale, window, softcap, need_dq, need_dkv):
    def grad(t, needed):
        return _library.fresh(t) if needed else _library.not_computed(q)

    return grad(q, need_dq), grad(k, need_dkv), grad(v, need_dkv)


def _setup_context(ctx, inputs, output):
    q, k, v, alignment, scale, window, softcap, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (alignment, scale, window, softcap)


def _autograd_backward(ctx, do, _):
    q, k, v, out, lse = ctx.saved_tensors
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    dq, dk, dv = torch.ops.normbook.attention_backward(
        do, q, k, v, out, lse, *ctx.args, need_q, need_k or need_v
    )
    return (
        dq if need_q else None,
        dk if need_k else None,
        dv if need_v else None,
        *(None,) * 5,
    )


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=None):
    r"""``softmax(scale · q kᵀ + mask) v``, never holding the ``seq_q × seq_k`` scores
    in memory.

    Args:
        q: ``(batch, heads, seq_q, head_dim)``, float32, float16 or bfloat16; any
        strides.
        k, v: ``(batch, kv_heads, seq_k, head_dim)``, q's dtype and device; ``kv_heads``
            divides ``heads`` (grouped-query attention: q head ``h`` uses k/v head ``h
            // (heads // kv_heads)``, as SDPA's ``enable_gqa=True``).
        causal: ``False``; ``True`` or ``"bottom_right"`` (query ``i`` sees keys ``j <=
            i + seq_k - seq_q``: decoding with a KV cache, FlashAttention 2.1+); or
            ``"top_left"`` (``j <= i``: SDPA's ``is_causal=True``). Equal when seq_q ==
            seq_k.
        scale: multiplies the scores; default ``1/sqrt(head_dim)``.
        window: with ``causal``, each query sees at most ``window`` keys: itself and the
            ``window - 1`` before it (Mistral's sliding window).
        softcap: a cap ``c > 0`` turns each scaled score ``s`` into ``c·tanh(s/c)``
            before the mask and the softmax (Gemma 2's ``attn_logit_softcapping``,
            FlashAttention's ``softcap``); ``None`` or ``0``: no cap.

    Returns a tensor of q's shape and dtype. Scores, softmax state and output are
    accumulated in fp32; the probabilities are rounded to the input dtype before
    multiplying ``v`` (as FlashAttention does). A query row that sees no key returns
    zeros.

    Differentiable in q, k and v (FlashAttention-2 backward, the operator
    ``torch.ops.normbook.attention_backward``): the forward then also saves the per-row
    log-sum-exp (4 bytes a query row); the gradients are computed without atomics and
    are bitwise reproducible from run to run. dk and dv sum the group's q heads in a
    fixed order; a fully masked row contributes zero gradients.

    Raises:
        TypeError / ValueError naming the bad argument, before any launch.
    """
    args = _check(q, k, v, causal, scale, window, softcap)
    # L is saved only when a gradient will be needed
    save_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return torch.ops.normbook.attention(q, k, v, *args, save_lse)[0]


def tiles_visited(q, k, v, *, causal=False, scale=None, window=None, softcap=None):
    """(visited, total): key tiles the kernel visited, summed over its programs, and the
    tiles a kernel without skipping would visit. Runs the kernel; the count comes from
    the kernel."""
    args = _check(q, k, v, causal, scale, window, softcap)
    out, visited, _ = _forward(q, k, v, *args)
    BLOCK_N = tile_config(q.shape[3], q.dtype, _capability(q))[1]
    total = visited.numel() * triton.cdiv(k.shape[2], BLOCK_N)
    return int(visited.sum()), total
