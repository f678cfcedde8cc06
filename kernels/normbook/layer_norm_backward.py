r"""LayerNorm's backward: the kernels behind
the operator ``normbook::layer_norm_backward``, their launch plan
(:func:`backward_plan`) and launcher (:func:`_backward`).

Apart from the forward (:mod:`normbook.layer_norm`) so that each module stays short; it
imports nothing from it. The tiling both use (``Config``, ``_warps``, ``LOOP_BLOCK_N``)
lives below them, in :mod:`normbook._config`. Like the forward's, the backward's tiles
are chosen from the row length N alone, never from the number of rows (batch
invariance); only G, the number of dγ/dβ partial rows, depends on M, and dγ, dβ are sums
over the batch.

Backward (vector-Jacobian product, per row, with :math:`\hat x =
(x-\mu)\,\mathrm{rstd}`, :math:`g = \gamma \odot dy` and a bar for the mean over the
row):

.. math:: dx = \mathrm{rstd}\bigl(g - \bar g - \hat x\;\overline{g \odot \hat x}\bigr),
          \qquad
          d\gamma = \textstyle\sum_\text{rows} dy \odot \hat x, \qquad
          d\beta = \textstyle\sum_\text{rows} dy .

Rows up to 8 KB take one kernel (x and dy read once). Wider rows take two: every row's
two dot products first, then a sweep over column blocks that writes dx and keeps dγ, dβ
in registers. Either way dγ and dβ are reduced over rows deterministically in two stages
(see :mod:`normbook._reduce`), each partial sum written once, and the number of partial
rows bounded (:func:`backward_plan`) so that they move at most 5 % of the backward's
essential bytes.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._config import LAUNCH, LOOP_BLOCK_N, Config, _warps, tl_accumulation_dtype
from ._reduce import sum_partials
from ._runtime import DEVICE, INTERPRET, device_guard
from ._triton_utils import round_to

# ---------------------------------------------------------------- launch plan

# Backward rows up to this many bytes take the one-kernel path (x and dy held in
# registers).
BWD_SINGLE_BYTES = 8192
BWD_TILE = 2048  # it holds x, dy, dx and two dγ/dβ sums: half the forward's TILE
# column block of the backward's column sweep (dx, dγ, dβ), on a GPU
COL_BLOCK_N = 512
# The interpreter runs programs one after another, each with a fixed overhead: wider
# blocks, so fewer programs (the same code path, with more columns per program).
_RUN_COL_BLOCK_N = 4096 if INTERPRET else COL_BLOCK_N
COL_BLOCK_M = 4  # rows per step of that sweep
# The second stage of dγ/dβ (the (G, N) partial sums) may move at most this share of the
# backward's essential bytes (read x and dy, write dx).
MAX_PARTIAL_SHARE = 0.05


@dataclass(frozen=True)
class BackwardPlan:
    # SINGLE_BLOCK: the one-kernel backward; else the row dot products
    single: Config
    cols: Config | None  # the column sweep (None on the one-kernel path)
    G: int  # rows of the (G, N) partial sums = programs along the rows


def _sm_count() -> int:
    if DEVICE.type == "cuda" and not INTERPRET:
        return torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return 2  # the interpreter runs programs one after another: a few suffice


def backward_plan(
    M: int,
    N: int,
    element_size: int,
    partial_params: int,
    sms: int,
    col_block_n: int = COL_BLOCK_N,
) -> BackwardPlan:
    """Tiling and number of partial-sum rows G of the backward (see :func:`_backward`).

    G is bounded so that the partial sums (``partial_params`` of dγ, dβ; written once,
    read once by the second stage, 4 bytes each) are at most MAX_PARTIAL_SHARE of the
    essential bytes 3·M·N·element_size; but at least enough programs (2 per SM, with the
    column blocks) to fill the GPU when the batch is tiny (decode), where the buffer is
    small anyway.
    """
    block_n = triton.next_power_of_2(N)
    single = block_n * element_size <= BWD_SINGLE_BYTES
    if single:
        block_m = max(1, BWD_TILE // block_n)
        cfg, cols, n_col_blocks = (
            Config(block_m, block_n, True, _warps(block_m * block_n)),
            None,
            1,
        )
        tiles = triton.cdiv(M, block_m)
    else:
        cfg = Config(1, LOOP_BLOCK_N // 2, False, _warps(LOOP_BLOCK_N // 2))
        cols = Config(
            COL_BLOCK_M,
            col_block_n,
            False,
            max(1, _warps(COL_BLOCK_M * col_block_n) // 2),
        )
        n_col_blocks = triton.cdiv(N, col_block_n)
        tiles = triton.cdiv(M, COL_BLOCK_M)
    target = 2 * sms
    g_fill = triton.cdiv(target, n_col_blocks)
    if partial_params:
        g_rule = int(MAX_PARTIAL_SHARE * 3 * M * element_size // (8 * partial_params))
        G = min(max(g_rule, 1), target) if g_rule * n_col_blocks >= target else g_fill
    else:
        G = g_fill
    return BackwardPlan(cfg, cols, max(1, min(G, tiles)))


def partial_traffic(plan: BackwardPlan, N: int, partial_params: int) -> int:
    """Bytes the (G, N) fp32 partial sums move: each written once and read once."""
    return 2 * 4 * plan.G * N * partial_params


# ---------------------------------------------------------------- kernels


@triton.jit
def _layer_norm_bwd(
    # pointers: input, weight, saved row statistics, upstream grad, dx, (G, N) partials
    # of dγ and dβ
    X,
    W,
    Mean,
    Rstd,
    DY,
    DX,
    DW,
    DB,
    stride_x,
    stride_dy,
    stride_dx,  # distance between rows, in elements
    M,
    N,
    G,  # rows, row length, programs (= rows of DW and DB)
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Rows that fit in one block: x and dy are read once, dγ/dβ stay in registers.
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        # γ is the same for every row: load it once per program.
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    # dγ and dβ for this program's rows stay in registers until the end.
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    # Row tiles pid, pid + G, ...: a fixed assignment, so the partial sums are
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
        # Saved by the forward: the backward needs no reduction over x of its own.
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        # padding stays 0, not -mean·rstd
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        # Two dot products per row: the centering projection (mean of g) and the
        # rank-one term.
        g_mean = tl.sum(g, axis=1) / N
        gx_mean = tl.sum(g * xhat, axis=1) / N
        dx = (g - g_mean[:, None] - xhat * gx_mean[:, None]) * rstd[:, None]
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            round_to(dx, DX.dtype.element_ty),
            mask=mask,
        )
        if COMPUTE_DW:
            dw_acc += dy * xhat  # masked rows and columns add nothing
        if COMPUTE_DB:
            db_acc += dy
    # Each partial is stored once, by the one program that owns this row of DW and DB.
    if COMPUTE_DW:
        tl.store(
            DW + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask
        )
    if COMPUTE_DB:
        tl.store(
            DB + pid.to(tl.int64) * N + cols, tl.sum(db_acc, axis=0), mask=col_mask
        )


@triton.jit
def _layer_norm_bwd_dots(
    # pointers: ..., per-row mean(g) and mean(g ⊙ x̂) (out)
    X,
    W,
    Mean,
    Rstd,
    DY,
    Gmean,
    GXmean,
    stride_x,
    stride_dy,
    M,
    N,
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Wide rows, step 1: each row's correction (two dot products) before any column is
    # written.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
    rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    acc_gx = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(
            X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        g = tl.load(
            DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        if HAS_WEIGHT:
            g = g * tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)[None, :]
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        acc_g += g
        acc_gx += g * xhat
    tl.store(Gmean + rows, tl.sum(acc_g, axis=1) / N, mask=row_mask)
    tl.store(GXmean + rows, tl.sum(acc_gx, axis=1) / N, mask=row_mask)


@triton.jit
def _layer_norm_bwd_cols(
    X,
    W,
    Mean,
    Rstd,
    Gmean,
    GXmean,
    DY,
    DX,
    DW,
    DB,  # DW, DB: (G, N) partial sums
    stride_x,
    stride_dy,
    stride_dx,
    M,
    N,
    G,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Wide rows, step 2: program (p, c) owns column block c of partial row p. It walks
    # row tiles p, p + G, ... (a fixed assignment: reproducible sums), writes dx, and
    # keeps dγ, dβ for its columns in registers, storing each partial once: no
    # read-modify-write of DW, DB.
    part = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for tile in range(part, tl.cdiv(M, BLOCK_M), G):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(
            X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        dy = tl.load(
            DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        g_mean = tl.load(Gmean + rows, mask=row_mask, other=0.0)
        gx_mean = tl.load(GXmean + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        dx = (g - g_mean[:, None] - xhat * gx_mean[:, None]) * rstd[:, None]
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            round_to(dx, DX.dtype.element_ty),
            mask=mask,
        )
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy
    if COMPUTE_DW:
        tl.store(
            DW + part.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask
        )
    if COMPUTE_DB:
        tl.store(
            DB + part.to(tl.int64) * N + cols, tl.sum(db_acc, axis=0), mask=col_mask
        )


def _backward(dy2d, x2d, weight, bias, mean, rstd, compute_dw: bool, compute_db: bool):
    """dx (shape of x2d, x's dtype), dγ and dβ (their parameter's dtype, or None) from
    the saved forward state.

    Rows up to BWD_SINGLE_BYTES: one kernel; each of G programs reads its rows once and
    keeps dγ, dβ in registers. Wider rows: first every row's two dot products (one
    kernel, one row per program), then a (G, column blocks) grid writes dx and keeps dγ,
    dβ per column block in registers. Either way each partial sum is written once, and
    :func:`normbook._reduce.sum_partials` adds the G rows in a fixed order
    (deterministic); G is bounded by :func:`backward_plan`.
    """
    M, N = x2d.shape
    dx = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    if M == 0 or N == 0:
        # An empty sum is 0.
        return (
            dx,
            torch.zeros_like(weight) if compute_dw else None,
            torch.zeros_like(bias) if compute_db else None,
        )
    plan = backward_plan(
        M,
        N,
        x2d.element_size(),
        int(compute_dw) + int(compute_db),
        _sm_count(),
        _RUN_COL_BLOCK_N,
    )
    G = plan.G
    # Partial sums, one row per program along the rows; every element is written exactly
    # once.
    dw_part = torch.empty(
        (G if compute_dw else 1, N), dtype=rstd.dtype, device=x2d.device
    )
    db_part = torch.empty(
        (G if compute_db else 1, N), dtype=rstd.dtype, device=x2d.device
    )
    # dummy pointer when HAS_WEIGHT is False
    w = weight.contiguous() if weight is not None else x2d
    acc = tl_accumulation_dtype(rstd.dtype)
    flags = dict(HAS_WEIGHT=weight is not None, ACC=acc)
    with device_guard(x2d):
        if plan.single.SINGLE_BLOCK:
            cfg = plan.single
            _layer_norm_bwd[(G,)](
                x2d,
                w,
                mean,
                rstd,
                dy2d,
                dx,
                dw_part,
                db_part,
                x2d.stride(0),
                dy2d.stride(0),
                dx.stride(0),
                M,
                N,
                G,
                COMPUTE_DW=compute_dw,
                COMPUTE_DB=compute_db,
                **flags,
                BLOCK_M=cfg.BLOCK_M,
                BLOCK_N=cfg.BLOCK_N,
                num_warps=cfg.num_warps,
                **LAUNCH,
            )
        else:
            dots, cols = plan.single, plan.cols
            g_mean = torch.empty((M,), dtype=rstd.dtype, device=x2d.device)
            gx_mean = torch.empty((M,), dtype=rstd.dtype, device=x2d.device)
            _layer_norm_bwd_dots[(triton.cdiv(M, dots.BLOCK_M),)](
                x2d,
                w,
                mean,
                rstd,
                dy2d,
                g_mean,
                gx_mean,
                x2d.stride(0),
                dy2d.stride(0),
                M,
                N,
                **flags,
                BLOCK_M=dots.BLOCK_M,
                BLOCK_N=dots.BLOCK_N,
                num_warps=dots.num_warps,
                **LAUNCH,
            )
            _layer_norm_bwd_cols[(G, triton.cdiv(N, cols.BLOCK_N))](
                x2d,
                w,
                mean,
                rstd,
                g_mean,
                gx_mean,
                dy2d,
                dx,
                dw_part,
                db_part,
                x2d.stride(0),
                dy2d.stride(0),
                dx.stride(0),
                M,
                N,
                G,
                COMPUTE_DW=compute_dw,
                COMPUTE_DB=compute_db,
                **flags,
                BLOCK_M=cols.BLOCK_M,
                BLOCK_N=cols.BLOCK_N,
                num_warps=cols.num_warps,
                **LAUNCH,
            )
        dw = sum_partials(dw_part, weight.dtype) if compute_dw else None
        db = sum_partials(db_part, bias.dtype) if compute_db else None
    return dx, dw, db
