r"""RMSNorm's backward: the kernels behind the operator ``normbook::rms_norm_backward``
and :func:`normbook.fused_add_rms_norm`'s backward, their launch plan and launcher.

Apart from the forward (:mod:`normbook.rms_norm`) so that each module stays short; it
imports nothing from it. What both use lives below them: the tiles in
:mod:`normbook._config` (:func:`~normbook._config.rms_config` with ``backward=True``),
the correctly rounded mean in :mod:`normbook._triton_utils`.

Backward (vector-Jacobian product, per row, with :math:`\hat x = x/r` and :math:`g =
\gamma \odot dy`):

.. math:: dx = \frac{1}{r}\Bigl(g - \hat x\,\tfrac1n \sum_k \hat x_k g_k\Bigr),
          \qquad
          d\gamma = \textstyle\sum_\text{rows} dy \odot \hat x .

dx is computed row by row like the forward; dγ is reduced over rows deterministically in
two stages (see :mod:`normbook._reduce`): a fixed number G of programs each store one
row of a (G, N) buffer of partial sums, once (no read-modify-write), and a small kernel
adds the rows. G is chosen so that this buffer's traffic is at most 5 % of the bytes the
backward moves anyway (:func:`backward_plan`). Rows up to 4096 elements are handled
whole by one program, which keeps x, dy, γ and its dγ partial sums in registers. Wider
rows take two steps: one program per row computes the correction :math:`c = \tfrac1n
\sum_k \hat x_k g_k`, then program (p, j) writes dx for column block j of the row tiles
p, p + G, ... with that block's dγ partial sums in registers. x and dy are read twice on
that path, as they were by the single-program two-sweep loop it replaces; what goes is
the per-row read-modify-write of the partial buffer.

The backward is the gradient of the formula for every casting convention, computed in
fp32 from the saved 1/rms (for ``"none"`` that rstd is the rounded one the forward
used).
"""

import torch
import triton
import triton.language as tl

from ._config import (
    LAUNCH,
    RMS_LOOP_BLOCK_N,
    rms_config,
    tl_accumulation_dtype,
)
from ._reduce import num_partials_within, partial_traffic_bytes, sum_partials
from ._runtime import device_guard
from ._triton_utils import _mean, round_to


@triton.jit
def _rms_norm_bwd(
    # pointers: input, weight, 1/rms, upstream grads of y and of x itself, dx, (G, N) dγ
    # partials
    X,
    W,
    Rstd,
    DY,
    DH,
    DX,
    DW,
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,  # distance between rows, in elements
    # rows, row length, programs (= rows of DW), γ' = offset + γ
    M,
    N,
    G,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows that fit in one block: each program reads whole rows once and keeps dγ in
    registers."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        # γ is the same for every row: load it once per program.
        w = offset + tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    # dγ for this program's rows stays in registers until the end.
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    # Row tiles pid, pid + G, ...: a fixed assignment, so the dγ partial sums are
    # reproducible.
    for tile in range(pid, num_tiles, G):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(
            X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        dy = tl.load(
            DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        # saved by the forward: no second reduction
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        xhat = x * rstd[:, None]
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        # The rank-one part of the Jacobian needs one dot product per row: c = mean(x̂ ⊙
        # g).
        c = _mean(tl.sum(xhat * g, axis=1), N)
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        if HAS_DH:
            # fused_add_rms_norm: the gradient reaching h = x + r directly adds to the
            # norm's.
            dx += tl.load(
                DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0
            ).to(ACC)
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            round_to(dx, DX.dtype.element_ty),
            mask=mask,
        )
        if COMPUTE_DW:
            dw_acc += dy * xhat  # masked rows and columns load as 0 and add nothing
    if COMPUTE_DW:
        # Each program's row of partial sums is stored once: no read-modify-write.
        tl.store(
            DW + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask
        )


@triton.jit
def _rms_norm_bwd_dot(
    # pointers: input, weight, 1/rms, upstream grad, per-row correction
    X,
    W,
    Rstd,
    DY,
    C,
    stride_x,
    stride_dy,  # distance between rows, in elements
    N,
    offset,  # row length, γ' = offset + γ
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Wide rows, step 1: each row's correction c = mean(x̂ ⊙ γ' ⊙ dy), one program per
    row."""
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(Rstd + row)
    acc = tl.zeros([BLOCK_N], dtype=ACC)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < N
        xhat = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC) * rstd
        g = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(ACC)
        if HAS_WEIGHT:
            g = g * (offset + tl.load(W + cols, mask=mask, other=0.0).to(ACC))
        acc += xhat * g
    # The order of this sum depends on N only: a row's dx does not depend on the batch.
    tl.store(C + row, _mean(tl.sum(acc, axis=0), N))


@triton.jit
def _rms_norm_bwd_cols(
    # pointers: ..., per-row correction (step 1), ..., (G, N) dγ partials
    X,
    W,
    Rstd,
    C,
    DY,
    DH,
    DX,
    DW,
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,  # distance between rows, in elements
    # rows, row length, programs per column block (= rows of DW), γ' = offset + γ
    M,
    N,
    G,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Wide rows, step 2: program (p, j) writes dx for column block j of row tiles p, p
    + G, ... and keeps that block's dγ partial sums in registers: each partial is stored
    once."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = offset + tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), G):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        c = tl.load(C + rows, mask=row_mask, other=0.0)
        x = tl.load(
            X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        dy = tl.load(
            DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        xhat = x * rstd[:, None]
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(
                DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0
            ).to(ACC)
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            round_to(dx, DX.dtype.element_ty),
            mask=mask,
        )
        if COMPUTE_DW:
            dw_acc += dy * xhat
    if COMPUTE_DW:
        tl.store(
            DW + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask
        )


def backward_plan(
    M: int,
    N: int,
    element_size: int,
    weight_size: int = 0,
    acc_size: int = 4,
    sms: int | None = None,
):
    """(config, G, column blocks, essential bytes, partial-sum bytes) of the backward at
    (M, N).

    Essential bytes: what any backward must move (x and dy read, dx written, γ read and
    dγ written when there is a weight). The partial sums of dγ add ``2·G·N·acc_size``
    (written once, read once); G is bounded so that this stays within
    ``MAX_PARTIAL_SHARE`` of the essential bytes
    (normbook._reduce.num_partials_within)."""
    cfg = rms_config(N, element_size, backward=True)
    col_blocks = 1 if cfg.SINGLE_BLOCK else triton.cdiv(N, cfg.BLOCK_N)
    essential = 3 * M * N * element_size + 2 * N * weight_size
    G = num_partials_within(
        triton.cdiv(M, cfg.BLOCK_M), N, essential, acc_size, col_blocks, sms
    )
    partial = partial_traffic_bytes(G, N, acc_size) if weight_size else 0
    return cfg, G, col_blocks, essential, partial


def _backward(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight,
    rstd: torch.Tensor,
    compute_dw: bool,
    offset: float = 0.0,
    dh2d: torch.Tensor | None = None,
):
    """dx (shape of x2d, x's dtype) and dγ (weight's dtype, or None) from the saved
    forward state.

    ``dh2d``, when given, is a gradient that reaches the normalized tensor directly (the
    ``h`` output of :func:`normbook.fused_add_rms_norm`): it is added to dx in the same
    pass."""
    M, N = x2d.shape
    dx = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    compute_dw = compute_dw and weight is not None
    if M == 0 or N == 0:
        dw = torch.zeros_like(weight) if compute_dw else None  # an empty sum is 0
        return dx, dw
    cfg, G, col_blocks, _, _ = backward_plan(
        M,
        N,
        x2d.element_size(),
        weight.element_size() if compute_dw else 0,
        rstd.element_size(),
    )
    # Partial sums of dγ, one row per program (per column block): each written exactly
    # once.
    partial = torch.empty(
        (G if compute_dw else 1, N), dtype=rstd.dtype, device=x2d.device
    )
    # dummy pointer when HAS_WEIGHT is False
    w = weight.contiguous() if weight is not None else x2d
    dh = dh2d if dh2d is not None else dy2d  # dummy pointer when HAS_DH is False
    flags = dict(
        HAS_WEIGHT=weight is not None,
        HAS_DH=dh2d is not None,
        COMPUTE_DW=compute_dw,
        ACC=tl_accumulation_dtype(rstd.dtype),
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        num_warps=cfg.num_warps,
        **LAUNCH,
    )
    strides = (x2d.stride(0), dy2d.stride(0), dh.stride(0), dx.stride(0))
    with device_guard(x2d):
        if cfg.SINGLE_BLOCK:
            _rms_norm_bwd[(G,)](
                x2d, w, rstd, dy2d, dh, dx, partial, *strides, M, N, G, offset, **flags
            )
        else:
            # Step 1: every row's correction; step 2: column blocks with dγ in
            # registers.
            c = torch.empty((M,), dtype=rstd.dtype, device=x2d.device)
            _rms_norm_bwd_dot[(M,)](
                x2d,
                w,
                rstd,
                dy2d,
                c,
                x2d.stride(0),
                dy2d.stride(0),
                N,
                offset,
                HAS_WEIGHT=weight is not None,
                ACC=flags["ACC"],
                BLOCK_N=RMS_LOOP_BLOCK_N,
                num_warps=RMS_LOOP_BLOCK_N // 256,
                **LAUNCH,
            )
            _rms_norm_bwd_cols[(G, col_blocks)](
                x2d,
                w,
                rstd,
                c,
                dy2d,
                dh,
                dx,
                partial,
                *strides,
                M,
                N,
                G,
                offset,
                **flags,
            )
    dw = sum_partials(partial, weight.dtype) if compute_dw else None
    return dx, dw
