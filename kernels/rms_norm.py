r"""RMSNorm forward and backward as Triton kernels, differentiable through ``torch.autograd``.

.. math:: y_i = \gamma_i \, \frac{x_i}{\sqrt{\tfrac1n \sum_k x_k^2 + \epsilon}}

Forward: one program normalizes ``BLOCK_M`` rows. A row that fits in one block (``N`` up to 16K
fp32 / 32K half-precision elements) is read from memory once and kept in registers; a wider row
is reduced in a loop over blocks and read a second time to write the output.

Backward (vector-Jacobian product, per row, with :math:`\hat x = x/r` and :math:`g = \gamma \odot dy`):

.. math:: dx = \frac{1}{r}\Bigl(g - \hat x \,\tfrac1n \textstyle\sum_k \hat x_k g_k\Bigr), \qquad
          d\gamma = \textstyle\sum_\text{rows} dy \odot \hat x .

dx is computed row by row like the forward; dγ is reduced over rows deterministically in two
stages (see :mod:`kernels._reduce`).
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, accumulation_dtype, row_config, tl_accumulation_dtype
from ._reduce import num_partials, sum_partials
from ._triton_utils import round_to


@triton.jit
def _rms_norm_fwd(
    X, Y, W, Rstd,              # pointers: input, output, weight, per-row 1/rms (fp32)
    stride_x, stride_y,         # distance between rows, in elements
    M, N, eps,                  # rows, row length, epsilon
    HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr,  # ACC: accumulation dtype, fp32 (fp64 for fp64 input)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y

    if SINGLE_BLOCK:
        # The whole row fits in registers: read it once.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        ms = tl.sum(x * x, axis=1) / N  # fp32: fp16 squares overflow past 256
    else:
        # Wider than a block: accumulate the sum of squares block by block, in fp32.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            acc += x * x
        ms = tl.sum(acc, axis=1) / N
    # Padding rows of the last tile read as zeros: give them 1, not 1/0, when eps = 0.
    rstd = 1.0 / tl.sqrt(tl.where(row_mask, ms + eps, 1.0))
    tl.store(Rstd + rows, rstd, mask=row_mask)

    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        if not SINGLE_BLOCK:
            # Second read of the row; on a GPU it mostly hits L2.
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        # Hugging Face convention: normalize in fp32, round to the input dtype, then scale.
        y = round_to(x * rstd[:, None], Y.dtype.element_ty)
        if HAS_WEIGHT:
            # The product is formed in fp32 and rounded once: exactly a correctly rounded
            # half-precision multiply (and it avoids the interpreter's broken bf16 arithmetic).
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
            y = round_to(y.to(ACC) * w[None, :], Y.dtype.element_ty)
        tl.store(y_rows + cols[None, :], y, mask=mask)


def _forward(x2d: torch.Tensor, weight, eps: float):
    """Launch the kernel on a (M, N) view; returns (y2d, rstd), rstd of shape (M,) in the accumulation dtype."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    acc = accumulation_dtype(x2d.dtype)
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        return y, rstd.fill_(float("nan") if N == 0 else 0.0)
    cfg = row_config(M, N, x2d.element_size())
    w = weight.contiguous() if weight is not None else x2d  # dummy pointer when HAS_WEIGHT is False
    _rms_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
        x2d, y, w, rstd, x2d.stride(0), y.stride(0), M, N, eps,
        HAS_WEIGHT=weight is not None, ACC=tl_accumulation_dtype(acc),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SINGLE_BLOCK=cfg.SINGLE_BLOCK,
        num_warps=cfg.num_warps, **LAUNCH,
    )
    return y, rstd


@triton.jit
def _rms_norm_bwd(
    X, W, Rstd, DY, DX, DW,     # pointers: input, weight, per-row 1/rms, upstream grad, dx, (G, N) dγ partials
    stride_x, stride_dy, stride_dx,  # distance between rows, in elements
    M, N, G,                    # rows, row length, programs (= rows of DW)
    HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    dw_row = DW + pid.to(tl.int64) * N  # this program's own row of partial sums: no other program writes it
    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if HAS_WEIGHT:
            # γ is the same for every row: load it once per program.
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
        # dγ for this program's rows stays in registers until the end.
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        # Row tiles pid, pid + G, ...: a fixed assignment, so the dγ partial sums are reproducible.
        for tile in range(pid, num_tiles, G):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
            rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)  # saved by the forward: no second reduction
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            # The rank-one part of the Jacobian needs one dot product per row: c = mean(x̂ ⊙ g).
            c = tl.sum(xhat * g, axis=1) / N
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], round_to(dx, DX.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw_acc += dy * xhat  # masked rows and columns load as 0 and add nothing
        if COMPUTE_DW:
            tl.store(dw_row + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    else:
        # Wider than a block (BLOCK_M == 1): two sweeps over the row, and dγ partials kept in
        # this program's row of DW (zero-initialised by the launcher) instead of registers.
        for tile in range(pid, num_tiles, G):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows = rows.to(tl.int64)
            rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
            # Sweep 1: the dot product c = mean(x̂ ⊙ g), accumulated block by block.
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < N)[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
                if HAS_WEIGHT:
                    dy = dy * tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)[None, :]
                acc += x * rstd[:, None] * dy
            c = tl.sum(acc, axis=1) / N
            # The previous row's partial-sum stores may come from other threads of this program:
            # make them visible before sweep 2 reads them back.
            tl.debug_barrier()
            # Sweep 2: read the row again (mostly from L2 on a GPU) and write dx.
            for off in range(0, N, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
                dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
                xhat = x * rstd[:, None]
                if HAS_WEIGHT:
                    g = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
                else:
                    g = dy
                dx = (g - xhat * c[:, None]) * rstd[:, None]
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :], round_to(dx, DX.dtype.element_ty), mask=mask)
                if COMPUTE_DW:
                    # Only this program touches its row of DW, so load-add-store is race-free and ordered.
                    part = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, part + tl.sum(dy * xhat, axis=0), mask=col_mask)


def _backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight, rstd: torch.Tensor, compute_dw: bool):
    """dx (shape of x2d, x's dtype) and dγ (weight's dtype, or None) from the saved forward state."""
    M, N = x2d.shape
    dx = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    compute_dw = compute_dw and weight is not None
    if M == 0 or N == 0:
        dw = torch.zeros_like(weight) if compute_dw else None  # an empty sum is 0
        return dx, dw
    cfg = row_config(M, N, x2d.element_size())
    G = num_partials(triton.cdiv(M, cfg.BLOCK_M))
    # Partial sums of dγ, one row per program; zeros because the wide-row path accumulates into them.
    partial = torch.zeros((G if compute_dw else 1, N), dtype=rstd.dtype, device=x2d.device)
    w = weight.contiguous() if weight is not None else x2d  # dummy pointer when HAS_WEIGHT is False
    _rms_norm_bwd[(G,)](
        x2d, w, rstd, dy2d, dx, partial,
        x2d.stride(0), dy2d.stride(0), dx.stride(0), M, N, G,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
        ACC=tl_accumulation_dtype(rstd.dtype),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SINGLE_BLOCK=cfg.SINGLE_BLOCK,
        num_warps=cfg.num_warps, **LAUNCH,
    )
    dw = sum_partials(partial, weight.dtype) if compute_dw else None
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with its Triton backward: gradients with respect to x and weight."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.x_shape = x.shape
        if x.numel() == 0:
            # Nothing to normalize; the gradients are empty (dx) and zero (dγ, an empty sum).
            ctx.save_for_backward(None, weight, None)
            return torch.empty_like(x, memory_format=torch.contiguous_format)
        x2d = _validate.as_rows(x)
        y2d, rstd = _forward(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return y2d.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        if x2d is None:
            dw = torch.zeros_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
            return torch.zeros_like(dy), dw, None
        dx, dw = _backward(_validate.as_rows(dy), x2d, weight, rstd, ctx.needs_input_grad[1])
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    r"""RMSNorm over the last dimension of ``x``: ``y = x / sqrt(mean(x**2) + eps) * weight``.

    Follows the Hugging Face Qwen3/Llama convention: statistics and normalization in fp32, the
    normalized value rounded to ``x``'s dtype, then multiplied by ``weight``. With ``weight`` in
    ``x``'s dtype the result equals ``Qwen3RMSNorm`` bit for bit up to the fp32 sum's order; the
    output always has ``x``'s dtype and shape.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape ``(..., N)`` (float64 is accepted and
            accumulated in float64, for gradient checks). Rows may be strided
            (last dimension contiguous); other layouts are copied once.
        weight: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device.
        eps: finite, >= 0, added to the mean square inside the square root.

    Differentiable with respect to ``x`` and ``weight`` (Triton backward kernels, see
    :class:`RMSNormFunction`); without ``requires_grad`` nothing is saved for a backward pass.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    eps = _validate.check_eps(eps)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return RMSNormFunction.apply(x, weight, eps)
    # No gradient wanted: launch the forward directly and save nothing.
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    y, _ = _forward(_validate.as_rows(x), weight, eps)
    return y.view(x.shape)
