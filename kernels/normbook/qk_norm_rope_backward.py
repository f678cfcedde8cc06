r"""qk_norm_rope's backward: the kernels behind
the operator ``normbook::qk_norm_rope_backward``, their tiling and launcher.

Apart from the forward (:mod:`normbook.qk_norm_rope`) so that each module stays short;
it imports nothing from it. The forward's tiling (``_forward_config``, of which the
backward takes half the tile) lives below both in :mod:`normbook._config`, the layout
check ``_last_dim_contiguous`` in :mod:`normbook._validate`.

Per (token, head) row of length d, with :math:`\hat x = x\,\mathrm{rstd}` and
:math:`g = \gamma \odot dy`: RoPE is a rotation of each pair (i, i + d/2), so its
transpose rotates the upstream gradient ``do`` back into ``dy``; RMSNorm's
vector-Jacobian product over the head then gives

.. math:: dx = \mathrm{rstd}\,\bigl(g - \hat x\;\overline{\hat x \odot g}\bigr),
          \qquad d\gamma = \textstyle\sum_\text{rows} dy \odot \hat x .

Nothing is saved but the inputs: rstd is computed again with the forward's sums, in the
forward's order (the same bits). One launch covers q and k: a fixed number of programs
for each (:func:`normbook._reduce.num_partials`) strides over its tensor's row tiles and
stores its dγ partial sums once; :func:`normbook._reduce.sum_partials` adds them in a
fixed order, so dγ_q and dγ_k are reproducible bit for bit.
"""

import torch
import triton
import triton.language as tl

from ._config import (
    LAUNCH,
    MIN_TILE,
    RowConfig,
    _forward_config,
    accumulation_dtype,
    tl_accumulation_dtype,
)
from ._reduce import num_partials, sum_partials
from ._runtime import device_guard
from ._triton_utils import round_to
from ._validate import _last_dim_contiguous


@triton.jit
def _norm_rope_bwd_tiles(
    # pointers: input, upstream grad, dx (contiguous), weight, (G, d) dγ partials
    X,
    DO,
    DX,
    W,
    DWP,
    Cos,
    Sin,
    # this program's partial row, programs for this tensor, rows, heads, seq
    part,
    G,
    M,
    H,
    S,
    # x and dy may be strided views (stride 0 for a broadcast grad)
    stride_xb,
    stride_xs,
    stride_xh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    HALF,
    eps,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    if HAS_WEIGHT:
        # γ is the same for every row: load it once per program.
        w1 = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
        w2 = tl.load(W + HALF + cols, mask=col_mask, other=0.0).to(ACC)
    # dγ for this program's rows stays in registers; it is stored once, at the end.
    dw1_acc = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=ACC)
    dw2_acc = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=ACC)
    # Row tiles part, part + G, ...: a fixed assignment, so the dγ partial sums are
    # reproducible.
    for tile in range(part, tl.cdiv(M, BLOCK_M), G):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows = rows.to(tl.int64)  # offsets can pass 2**31 on a long context
        head = rows % H
        token = rows // H
        pos = token % S
        batch = token // S
        x_rows = X + batch * stride_xb + pos * stride_xs + head * stride_xh
        o_rows = DO + batch * stride_ob + pos * stride_os + head * stride_oh
        dx_rows = DX + rows * (2 * HALF)
        mask = row_mask[:, None] & col_mask[None, :]
        x1 = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        x2 = tl.load(x_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(
            ACC
        )
        do1 = tl.load(o_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        do2 = tl.load(o_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(
            ACC
        )
        c_rows = Cos + batch * stride_cb + pos * stride_cs
        s_rows = Sin + batch * stride_sb + pos * stride_ss
        c1 = tl.load(c_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        c2 = tl.load(c_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(
            ACC
        )
        s1 = tl.load(s_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        s2 = tl.load(s_rows[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(
            ACC
        )
        # rstd again, as the forward computed it (same sums, same order: same bits);
        # padding rows get 1 instead of 1/sqrt(eps), which is inf for eps = 0 and would
        # poison dγ with 0·inf.
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        rstd = 1.0 / tl.sqrt(tl.where(row_mask, mean_sq + eps, 1.0))
        # RoPE is a rotation of each pair (i, i + d/2); its transpose rotates dy back:
        # out1 = y1·cos1 − y2·sin1, out2 = y2·cos2 + y1·sin2 gives the two lines below.
        dy1 = do1 * c1 + do2 * s2
        dy2 = do2 * c2 - do1 * s1
        xh1 = x1 * rstd[:, None]
        xh2 = x2 * rstd[:, None]
        if HAS_WEIGHT:
            g1 = dy1 * w1[None, :]
            g2 = dy2 * w2[None, :]
        else:
            g1 = dy1
            g2 = dy2
        # RMSNorm's vector-Jacobian product over the whole head: dx = rstd·(g −
        # x̂·mean(x̂ ⊙ g)).
        c = (tl.sum(xh1 * g1, axis=1) + tl.sum(xh2 * g2, axis=1)) / (2 * HALF)
        dx1 = (g1 - xh1 * c[:, None]) * rstd[:, None]
        dx2 = (g2 - xh2 * c[:, None]) * rstd[:, None]
        DT = DX.dtype.element_ty
        tl.store(dx_rows[:, None] + cols[None, :], round_to(dx1, DT), mask=mask)
        tl.store(dx_rows[:, None] + HALF + cols[None, :], round_to(dx2, DT), mask=mask)
        if COMPUTE_DW:
            dw1_acc += dy1 * xh1  # masked rows and columns load as 0 and add nothing
            dw2_acc += dy2 * xh2
    if COMPUTE_DW:
        # no other program writes this row
        dw_row = DWP + part.to(tl.int64) * (2 * HALF)
        tl.store(dw_row + cols, tl.sum(dw1_acc, axis=0), mask=col_mask)
        tl.store(dw_row + HALF + cols, tl.sum(dw2_acc, axis=0), mask=col_mask)


@triton.jit
def _qk_norm_rope_bwd(
    Q,
    K,
    DQO,
    DKO,
    DQ,
    DK,
    QW,
    KW,
    DQW,
    DKW,
    Cos,
    Sin,
    Mq,
    Mk,
    Hq,
    Hk,
    S,
    Gq,
    Gk,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    HALF,
    eps,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DQW: tl.constexpr,
    COMPUTE_DKW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One launch for both tensors: Gq programs stride over q's row tiles, Gk over k's.
    pid = tl.program_id(0)
    if pid < Gq:
        _norm_rope_bwd_tiles(
            Q,
            DQO,
            DQ,
            QW,
            DQW,
            Cos,
            Sin,
            pid,
            Gq,
            Mq,
            Hq,
            S,
            stride_qb,
            stride_qs,
            stride_qh,
            stride_dqb,
            stride_dqs,
            stride_dqh,
            stride_cb,
            stride_cs,
            stride_sb,
            stride_ss,
            HALF,
            eps,
            HAS_WEIGHT,
            COMPUTE_DQW,
            ACC,
            BLOCK_M,
            BLOCK_HALF,
        )
    else:
        _norm_rope_bwd_tiles(
            K,
            DKO,
            DK,
            KW,
            DKW,
            Cos,
            Sin,
            pid - Gq,
            Gk,
            Mk,
            Hk,
            S,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_dkb,
            stride_dks,
            stride_dkh,
            stride_cb,
            stride_cs,
            stride_sb,
            stride_ss,
            HALF,
            eps,
            HAS_WEIGHT,
            COMPUTE_DKW,
            ACC,
            BLOCK_M,
            BLOCK_HALF,
        )


def _backward_config(D: int) -> RowConfig:
    """The forward's tiling at half the elements per program: the backward holds about
    twice as many values per element (x, dy, cos, sin and the dγ sums), and must not
    spill."""
    return _forward_config(D, MIN_TILE // 2)


def _backward(
    dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, need_dqw, need_dkw
):
    """dq, dk (contiguous, q's and k's dtype) and dγ_q, dγ_k (each weight's dtype, or
    None)."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    dq = torch.empty((B, S, Hq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, S, Hk, D), dtype=k.dtype, device=k.device)
    Mq, Mk = B * S * Hq, B * S * Hk
    has_weight = q_weight is not None
    need_dqw, need_dkw = need_dqw and has_weight, need_dkw and has_weight
    if Mq + Mk == 0:
        # An empty sum is 0.
        return (
            dq,
            dk,
            torch.zeros_like(q_weight) if need_dqw else None,
            torch.zeros_like(k_weight) if need_dkw else None,
        )
    cfg = _backward_config(D)
    # A fixed number of programs per tensor (see normbook._reduce): deterministic dγ.
    Gq = num_partials(triton.cdiv(Mq, cfg.BLOCK_M))
    Gk = num_partials(triton.cdiv(Mk, cfg.BLOCK_M))
    acc = accumulation_dtype(q.dtype)
    dqw_part = torch.empty((Gq if need_dqw else 1, D), dtype=acc, device=q.device)
    dkw_part = torch.empty((Gk if need_dkw else 1, D), dtype=acc, device=q.device)
    cos, sin = cos.expand(B, S, D), sin.expand(B, S, D)
    dq_out, dk_out = _last_dim_contiguous(dq_out), _last_dim_contiguous(dk_out)
    # dummy pointers when there is no weight
    qw = q_weight.contiguous() if has_weight else q
    kw = k_weight.contiguous() if has_weight else k
    with device_guard(q):
        _qk_norm_rope_bwd[(Gq + Gk,)](
            q,
            k,
            dq_out,
            dk_out,
            dq,
            dk,
            qw,
            kw,
            dqw_part,
            dkw_part,
            cos,
            sin,
            Mq,
            Mk,
            Hq,
            Hk,
            S,
            Gq,
            Gk,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            dq_out.stride(0),
            dq_out.stride(1),
            dq_out.stride(2),
            dk_out.stride(0),
            dk_out.stride(1),
            dk_out.stride(2),
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            D // 2,
            eps,
            HAS_WEIGHT=has_weight,
            COMPUTE_DQW=need_dqw,
            COMPUTE_DKW=need_dkw,
            ACC=tl_accumulation_dtype(q.dtype),
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_HALF=cfg.BLOCK_N // 2,
            num_warps=cfg.num_warps,
            **LAUNCH,
        )
        dqw = sum_partials(dqw_part, q_weight.dtype) if need_dqw else None
        dkw = sum_partials(dkw_part, k_weight.dtype) if need_dkw else None
    return dq, dk, dqw, dkw
