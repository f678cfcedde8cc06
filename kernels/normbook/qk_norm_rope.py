r"""Qwen3's attention input path as one Triton kernel: per-head RMSNorm of q and k, then
RoPE.

.. math::
    \hat q = \gamma_q \odot \frac{q}{\sqrt{\tfrac1d \sum_i q_i^2 + \epsilon}}, \qquad
    q' = \hat q \odot \cos + \operatorname{rotate\_half}(\hat q) \odot \sin

for every (token, head) row of length ``d = head_dim``, and likewise for k with its own
weight. ``rotate_half`` pairs dimension ``i`` with ``i + d/2`` (the Hugging Face
layout), so a program
loads each row as its two halves: the rotation partner of the first half is the second
half.

One launch covers q and k: the first programs take tiles of q's rows, the rest tiles of
k's. Each program handles ``BLOCK_M`` rows, so a short head (d = 128) still gives a
program a few thousand elements. The roundings follow the reference (``Qwen3RMSNorm``
then ``apply_rotary_pos_emb``) step by step, so that bf16 results are bit-identical to
it but for the fp32 statistics' last bit.

Backward: :mod:`normbook.qk_norm_rope_backward` (the vector-Jacobian product, its
kernels and their tiling), beside this module; the backward operator calls it.
"""

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import LAUNCH, MAX_FUSED_BYTES, _forward_config, tl_accumulation_dtype
from ._runtime import device_guard
from ._triton_utils import round_to
from ._validate import _last_dim_contiguous
from .qk_norm_rope_backward import _backward


@triton.jit
def _norm_rope_tile(
    # pointers: input, output (contiguous), weight, cos, sin
    X,
    Y,
    W,
    Cos,
    Sin,
    # this tile, rows (= batch·seq·heads), heads, sequence length
    tile,
    M,
    H,
    S,
    # x may be a strided view (e.g. of a fused qkv projection)
    stride_xb,
    stride_xs,
    stride_xh,
    # cos/sin: stride_*b is 0 when broadcast over batch
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    HALF,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # offsets can pass 2**31 on a long context
    # A row is one (batch, position, head): recover its coordinates to follow any
    # strides.
    head = rows % H
    token = rows // H
    pos = token % S
    batch = token // S
    x_rows = X + batch * stride_xb + pos * stride_xs + head * stride_xh
    y_rows = Y + rows * (2 * HALF)

    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    mask = row_mask[:, None] & col_mask[None, :]
    # The two halves of each row: x1 is rotated against x2 (rotate_half pairs i with i +
    # d/2).
    x1 = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
    x2 = tl.load(x_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(ACC)
    # Statistics in fp32 (fp64 for fp64 input), over the whole head: both halves.
    mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    # Padding rows of the last tile read as zeros: give them 1, not 1/0, when eps = 0.
    rstd = 1.0 / tl.sqrt(tl.where(row_mask, mean_sq + eps, 1.0))

    # Qwen3RMSNorm: normalize in fp32, round to the input dtype, then multiply by the
    # weight. Each product of two half-precision values is exact in fp32, so rounding it
    # once is exactly torch's half-precision multiply (and avoids the interpreter's bf16
    # arithmetic).
    DT = Y.dtype.element_ty
    y1 = round_to(x1 * rstd[:, None], DT).to(ACC)
    y2 = round_to(x2 * rstd[:, None], DT).to(ACC)
    if HAS_WEIGHT:
        w1 = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
        w2 = tl.load(W + HALF + cols, mask=col_mask, other=0.0).to(ACC)
        y1 = round_to(y1 * w1[None, :], DT).to(ACC)
        y2 = round_to(y2 * w2[None, :], DT).to(ACC)

    # cos/sin are indexed by (batch, position) only: every head of a token shares them.
    c_rows = Cos + batch * stride_cb + pos * stride_cs
    s_rows = Sin + batch * stride_sb + pos * stride_ss
    c1 = tl.load(c_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
    c2 = tl.load(c_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(ACC)
    s1 = tl.load(s_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
    s2 = tl.load(s_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(ACC)
    # RoPE as the reference computes it in the input dtype: x·cos + rotate_half(x)·sin,
    # with rotate_half(x) = (−x2, x1). Each product and the sum are rounded, like
    # torch's three ops.
    out1 = round_to(round_to(y1 * c1, DT).to(ACC) - round_to(y2 * s1, DT).to(ACC), DT)
    out2 = round_to(round_to(y2 * c2, DT).to(ACC) + round_to(y1 * s2, DT).to(ACC), DT)
    tl.store(y_rows[:, None] + cols[None, :], out1, mask=mask)
    tl.store(y_rows[:, None] + HALF + cols[None, :], out2, mask=mask)


@triton.jit
def _qk_norm_rope_fwd(
    Q,
    K,
    QO,
    KO,
    QW,
    KW,
    Cos,
    Sin,
    Mq,
    Mk,
    Hq,
    Hk,
    S,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    HALF,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One launch for both tensors: the first programs take q's tiles, the others k's.
    pid = tl.program_id(0)
    q_tiles = tl.cdiv(Mq, BLOCK_M)
    if pid < q_tiles:
        _norm_rope_tile(
            Q,
            QO,
            QW,
            Cos,
            Sin,
            pid,
            Mq,
            Hq,
            S,
            stride_qb,
            stride_qs,
            stride_qh,
            stride_cb,
            stride_cs,
            stride_sb,
            stride_ss,
            HALF,
            eps,
            HAS_WEIGHT,
            ACC,
            BLOCK_M,
            BLOCK_HALF,
        )
    else:
        _norm_rope_tile(
            K,
            KO,
            KW,
            Cos,
            Sin,
            pid - q_tiles,
            Mk,
            Hk,
            S,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_cb,
            stride_cs,
            stride_sb,
            stride_ss,
            HALF,
            eps,
            HAS_WEIGHT,
            ACC,
            BLOCK_M,
            BLOCK_HALF,
        )


def _forward(q, k, q_weight, k_weight, cos, sin, eps: float):
    """Launch the kernel on validated 4-D q, k (last dimension contiguous) and 3-D cos,
    sin."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    q_out = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((B, S, Hk, D), dtype=k.dtype, device=k.device)
    Mq, Mk = B * S * Hq, B * S * Hk
    if Mq + Mk == 0:
        return q_out, k_out
    cfg = _forward_config(D)
    cos = cos.expand(B, S, D)  # a batch of 1 is broadcast with stride 0, without a copy
    sin = sin.expand(B, S, D)
    has_weight = q_weight is not None
    # dummy pointers when there is no weight
    qw = q_weight.contiguous() if has_weight else q
    kw = k_weight.contiguous() if has_weight else k
    grid = (triton.cdiv(Mq, cfg.BLOCK_M) + triton.cdiv(Mk, cfg.BLOCK_M),)
    with device_guard(q):
        _qk_norm_rope_fwd[grid](
            q,
            k,
            q_out,
            k_out,
            qw,
            kw,
            cos,
            sin,
            Mq,
            Mk,
            Hq,
            Hk,
            S,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            D // 2,
            eps,
            HAS_WEIGHT=has_weight,
            ACC=tl_accumulation_dtype(q.dtype),
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_HALF=cfg.BLOCK_N // 2,
            num_warps=cfg.num_warps,
            **LAUNCH,
        )
    return q_out, k_out


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::qk_norm_rope", mutates_args=())
def _op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.qk_norm_rope``: (q_out, k_out) from checked inputs."""
    q, k, cos, sin = (_last_dim_contiguous(t) for t in (q, k, cos, sin))
    return _forward(q, k, q_weight, k_weight, cos, sin, eps)


@_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps):
    return _library.fresh(q), _library.fresh(k)


@torch.library.custom_op("normbook::qk_norm_rope_backward", mutates_args=())
def _op_backward(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    need_dqw: bool,
    need_dkw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.qk_norm_rope_backward``: (dq, dk, dγ_q, dγ_k); a weight's
    gradient is :func:`~normbook._library.not_computed` unless asked for (and there
    are weights)."""
    need_dqw, need_dkw = (n and q_weight is not None for n in (need_dqw, need_dkw))
    q, k, cos, sin = (_last_dim_contiguous(t) for t in (q, k, cos, sin))
    dq, dk, dqw, dkw = _backward(
        dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, need_dqw, need_dkw
    )
    return (
        dq,
        dk,
        dqw if need_dqw else _library.not_computed(q),
        dkw if need_dkw else _library.not_computed(q),
    )


@_op_backward.register_fake
def _(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, need_dqw, need_dkw):
    need_dqw, need_dkw = (n and q_weight is not None for n in (need_dqw, need_dkw))
    return (
        _library.fresh(q),
        _library.fresh(k),
        _library.fresh(q_weight) if need_dqw else _library.not_computed(q),
        _library.fresh(k_weight) if need_dkw else _library.not_computed(q),
    )


def _setup_context(ctx, inputs, output):
    # cos and sin are constants (the public function refuses them when they require
    # grad): saved to recompute the rotation, never differentiated
    *tensors, ctx.eps = inputs
    ctx.save_for_backward(*tensors)


def _autograd_backward(ctx, dq_out, dk_out):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dqw, need_dkw = (n and q_weight is not None for n in need[2:4])
    dq, dk, dqw, dkw = torch.ops.normbook.qk_norm_rope_backward(
        dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, ctx.eps, need_dqw, need_dkw
    )
    return (
        dq if need[0] else None,
        dk if need[1] else None,
        dqw if need_dqw else None,
        dkw if need_dkw else None,
        None,
        None,
        None,
    )


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_rotary(t, name: str, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != q.dtype:
        raise TypeError(
            f"{name} must have q's dtype {q.dtype} (the rotary embedding "
            "returns it cast to "
            f"the activations' dtype), got {t.dtype}"
        )
    B, S, _, D = q.shape
    if t.dim() != 3 or tuple(t.shape[1:]) != (S, D) or t.shape[0] not in (1, B):
        raise ValueError(
            f"{name} must have shape (batch, seq, head_dim) = ({B}, {S}, "
            f"{D}) "
            f"(or a batch of 1), got {tuple(t.shape)}"
        )
    if t.device != q.device:
        raise ValueError(
            f"{name} is on {t.device} but q is on {q.device}; put them on one device"
        )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Per-head RMSNorm of ``q`` and ``k`` over ``head_dim``, then rotary position
    embedding.

    Computes what Hugging Face's ``Qwen3Attention`` does to its queries and keys:
    ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)``, with the same roundings in
    the same order (statistics in fp32; the normalized value rounded to the input dtype,
    then times the weight; ``x·cos``, ``rotate_half(x)·sin`` and their sum each rounded
    to the input dtype).

    Args:
        q: ``(batch, seq, n_heads, head_dim)``, float32/float16/bfloat16 (float64 is
            accumulated in float64). Leading dimensions may have any strides (e.g. a
            view of a fused qkv projection is read in place); a non-contiguous last
            dimension is copied once.
        k: ``(batch, seq, n_kv_heads, head_dim)``, q's dtype and device.
        q_weight, k_weight: ``(head_dim,)`` weights of q_norm and k_norm (both ``None``:
            no weight). In q's dtype, as in a model stored in that dtype, the result
            matches transformers bit for bit; with fp32 weights and half-precision q,
            transformers would promote the product to fp32, whereas this kernel rounds
            it to q's dtype.
        cos, sin: ``(batch, seq, head_dim)`` as the rotary embedding returns them (a
            batch of 1 is broadcast), in q's dtype, in the ``rotate_half`` layout
            (dimension i and i + head_dim/2 share an angle).
        eps: finite, >= 0, added to the mean square inside the square root.

    Returns:
        ``(q_out, k_out)`` contiguous, in the shapes (``(batch, seq, heads, head_dim)``,
        not transposed) and the dtype of ``q`` and ``k``.

    Differentiable with respect to ``q``, ``k``, ``q_weight`` and ``k_weight`` (Triton
    backward kernels, ``normbook::qk_norm_rope_backward``; the weight gradients are
    summed in a fixed order, so they are reproducible bit for bit). ``cos`` and
    ``sin`` are treated as constants: if either requires grad (with grad mode on) a
    ``ValueError`` is raised rather than dropping its gradient.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(q, "q")
    _validate.check_input(k, "k")
    if q.dim() != 4:
        raise ValueError(
            f"q must have shape (batch, seq, n_heads, head_dim), got "
            f"{q.dim()} dimensions {tuple(q.shape)}"
        )
    if k.dim() != 4:
        raise ValueError(
            f"k must have shape (batch, seq, n_kv_heads, head_dim), got "
            f"{k.dim()} dimensions {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if k.device != q.device:
        raise ValueError(
            f"k is on {k.device} but q is on {q.device}; put them on one device"
        )
    B, S, _, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, S, D):
        raise ValueError(
            f"k must match q in batch, seq and head_dim: q is "
            f"{tuple(q.shape)}, k is {tuple(k.shape)} "
            "(only the number of heads may differ)"
        )
    if D % 2 or D == 0:
        raise ValueError(
            f"head_dim must be even and > 0 (RoPE rotates pairs of dimensions), got {D}"
        )
    if D * q.element_size() > MAX_FUSED_BYTES:
        raise ValueError(
            f"head_dim {D} is too large for one block ({MAX_FUSED_BYTES} "
            "bytes per row at most)"
        )
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    _validate.check_param(q_weight, "q_weight", D, q)
    _validate.check_param(k_weight, "k_weight", D, q)
    _check_rotary(cos, "cos", q)
    _check_rotary(sin, "sin", q)
    eps = _validate.check_eps(eps)
    grad = torch.is_grad_enabled()
    for t, name in ((cos, "cos"), (sin, "sin")):
        if grad and t.requires_grad:
            raise ValueError(
                f"{name} requires grad, but qk_norm_rope treats cos and "
                "sin as constants "
                "(it has no gradient for them); pass them detached, e.g. "
                f"{name}.detach(), as the rotary embedding (computed "
                "under no_grad) does"
            )
    return torch.ops.normbook.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps)


# ---------------------------------------------------------------- the unfused torch
# path, and a bug zoo

#: Five plausible mistakes, each a value of ``qk_norm_rope_torch(..., bug=...)``.
BUGS = {
    "eps_outside_sqrt": "x / (sqrt(mean(x²)) + ε) instead of x / sqrt(mean(x²) + ε)",
    "one_plus_gamma": "(1 + γ) instead of γ (Gemma's convention, applied to Qwen3's "
    "weights)",
    "whole_vector": "statistics over all heads of a token instead of over each head",
    "norm_after_rope": "RoPE first, then the norm",
    "gamma_before_cast": "γ multiplied in fp32 before rounding to the input dtype",
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (Hugging Face's
    pairing)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope_torch(
    q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6, bug: str | None = None
):
    """What the reference computes, as plain torch operations in the reference's order
    and dtypes (one kernel launch per operation), or, with ``bug`` one of :data:`BUGS`,
    a deliberately wrong variant of it. Layout as :func:`qk_norm_rope`: (batch, seq,
    heads, head_dim) in and out."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be None or one of {sorted(BUGS)}, got {bug!r}")

    def norm(x, weight):
        xf = x.to(torch.float32)
        dims = (-2, -1) if bug == "whole_vector" else -1
        mean_sq = xf.pow(2).mean(dims, keepdim=True)
        if bug == "eps_outside_sqrt":
            xn = xf / (mean_sq.sqrt() + eps)
        else:
            xn = xf * torch.rsqrt(mean_sq + eps)
        gamma = 1 + weight if bug == "one_plus_gamma" else weight
        if bug == "gamma_before_cast":
            return (xn * gamma.to(torch.float32)).to(x.dtype)
        return gamma * xn.to(x.dtype)

    def rope(x):
        c, s = cos[:, :, None, :], sin[:, :, None, :]  # shared by every head
        return x * c + rotate_half(x) * s

    if bug == "norm_after_rope":
        return norm(rope(q), q_weight), norm(rope(k), k_weight)
    return rope(norm(q, q_weight)), rope(norm(k, k_weight))
