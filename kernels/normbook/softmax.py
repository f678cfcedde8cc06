r"""Softmax forward and backward as Triton kernels, differentiable through
``torch.autograd``.

.. math:: p_i = \frac{e^{x_i - m}}{\sum_k e^{x_k - m}}, \qquad m = \max_k x_k

Subtracting the row maximum ``m`` changes nothing mathematically (softmax is shift
invariant) and keeps every exponent <= 0, so ``exp`` cannot overflow.

Forward: one program handles ``BLOCK_M`` rows. A row that fits in one block (``N`` up to
16K fp32 / 32K half-precision elements) is read once and kept in registers: max,
exponentials, sum and the division all happen on the registers. A wider row is swept
once with an *online* maximum and sum (when the running maximum grows from ``m`` to
``m'``, the sum so far is rescaled by ``exp(m - m')``), then read a second time to write
``p``.

Backward (vector-Jacobian product of the Jacobian ``diag(p) - p pᵀ``, per row):

.. math:: dx = p \odot \bigl(dy - \textstyle\sum_k p_k\, dy_k\bigr)

computed from the saved output ``p``: one dot product per row, never the n×n Jacobian.
"""

import numbers

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, accumulation_dtype, row_config, tl_accumulation_dtype
from ._runtime import device_guard
from ._triton_utils import round_to


@triton.jit
def _softmax_fwd(
    X,
    Y,  # pointers: input rows, output rows
    stride_x,
    stride_y,  # distance between rows, in elements
    M,
    N,  # rows, row length
    ACC: tl.constexpr,  # accumulation dtype: fp32 (fp64 for fp64 input)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y

    if SINGLE_BLOCK:
        # The whole row fits in registers: read it once, write it once.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        # Padding reads as -inf: it adds exp(-inf) = 0 to the sum and never wins the
        # max.
        x = tl.load(x_rows + cols[None, :], mask=mask, other=-float("inf")).to(ACC)
        m = tl.max(x, axis=1)
        # The max trick: every exponent is <= 0, so exp cannot overflow. A row of -inf
        # (or a padding row) is shifted by 0, not by -inf, so that no -inf - (-inf) is
        # formed.
        shift = tl.where(m == -float("inf"), 0.0, m)
        e = tl.exp(x - shift[:, None])
        # A padding row divides by 1; a real row of -inf gives 0/0 = NaN, as
        # torch.softmax.
        s = tl.where(row_mask, tl.sum(e, axis=1), 1.0)
        y = e / s[:, None]
        tl.store(y_rows + cols[None, :], round_to(y, Y.dtype.element_ty), mask=mask)
    else:
        # Wider than a block (BLOCK_M == 1): one sweep with a running max m and a
        # running sum s of exp(x - m). A larger max m' rescales the sum so far by exp(m
        # - m').
        m = tl.full([BLOCK_M], -float("inf"), dtype=ACC)
        s = tl.zeros([BLOCK_M], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=-float("inf")).to(ACC)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # A row that is -inf so far would give exp(-inf - (-inf)) = NaN: shift by 0
            # instead (every term is then exp(-inf) = 0), so later finite values still
            # count.
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
            m = m_new
        # Second read of the row (mostly from L2 on a GPU) to write p. A row of -inf has
        # s = 0 and gives 0/0 = NaN, as torch.softmax does.
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=-float("inf")).to(ACC)
            y = tl.exp(x - m[:, None]) / s[:, None]
            tl.store(y_rows + cols[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd(
    # pointers: saved output p, upstream gradient, input gradient
    Y,
    DY,
    DX,
    stride_y,
    stride_dy,
    stride_dx,  # distance between rows, in elements
    M,
    N,  # rows, row length
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    y_rows = Y + rows[:, None] * stride_y
    dy_rows = DY + rows[:, None] * stride_dy
    dx_rows = DX + rows[:, None] * stride_dx

    if SINGLE_BLOCK:
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        p = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        # The rank-one part -p pᵀ of the Jacobian needs one dot product per row: c = p ·
        # dy.
        c = tl.sum(p * dy, axis=1)
        dx = p * (dy - c[:, None])
        tl.store(dx_rows + cols[None, :], round_to(dx, DX.dtype.element_ty), mask=mask)
    else:
        # Sweep 1: the dot product c = p · dy, accumulated block by block in ACC.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            p = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            acc += p * dy
        c = tl.sum(acc, axis=1)
        # Sweep 2: read p and dy again and write dx.
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            p = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            dx = p * (dy - c[:, None])
            tl.store(
                dx_rows + cols[None, :], round_to(dx, DX.dtype.element_ty), mask=mask
            )


def _forward(x2d: torch.Tensor) -> torch.Tensor:
    """Launch the forward on a (M, N) view whose rows are contiguous; returns p, shape
    (M, N)."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if M == 0 or N == 0:
        return y
    cfg = row_config(M, N, x2d.element_size())
    with device_guard(x2d):
        _softmax_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
            x2d,
            y,
            x2d.stride(0),
            y.stride(0),
            M,
            N,
            ACC=tl_accumulation_dtype(accumulation_dtype(x2d.dtype)),
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            SINGLE_BLOCK=cfg.SINGLE_BLOCK,
            num_warps=cfg.num_warps,
            **LAUNCH,
        )
    return y


def _backward(dy2d: torch.Tensor, y2d: torch.Tensor) -> torch.Tensor:
    """dx from the saved output p and the upstream gradient, both (M, N) with contiguous
    rows."""
    M, N = y2d.shape
    dx = torch.empty((M, N), dtype=y2d.dtype, device=y2d.device)
    if M == 0 or N == 0:
        return dx
    # Two rows (p and dy) live in registers at once: a single block only where both fit
    # in the forward's budget for one (a half-precision row of 32K spilled on sm_90
    # otherwise).
    cfg = row_config(M, N, 2 * y2d.element_size())
    with device_guard(y2d):
        _softmax_bwd[(triton.cdiv(M, cfg.BLOCK_M),)](
            y2d,
            dy2d,
            dx,
            y2d.stride(0),
            dy2d.stride(0),
            dx.stride(0),
            M,
            N,
            ACC=tl_accumulation_dtype(accumulation_dtype(y2d.dtype)),
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            SINGLE_BLOCK=cfg.SINGLE_BLOCK,
            num_warps=cfg.num_warps,
            **LAUNCH,
        )
    return dx


def _rows_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved last, as (rows, N) with contiguous rows (a copy if it
    must)."""
    return _validate.as_rows(t.movedim(dim, -1))


def _unrows(t2d: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """Inverse of :func:`_rows_along`: (rows, N) back to ``shape`` with ``dim`` in its
    place."""
    moved = list(shape)
    moved.append(moved.pop(dim))
    return t2d.view(moved).movedim(-1, dim)


def _empty_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """An uninitialized tensor of ``t``'s shape in the layout the kernels write: rows
    along ``dim``, each contiguous."""
    moved = list(t.shape)
    moved.append(moved.pop(dim))
    return t.new_empty(moved).movedim(-1, dim)


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::softmax", mutates_args=())
def _op(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.ops.normbook.softmax``: the forward launch on checked inputs."""
    if x.numel() == 0:
        return _empty_along(x, dim)
    return _unrows(_forward(_rows_along(x, dim)), x.shape, dim)


@_op.register_fake
def _(x, dim):
    return _empty_along(x, dim)


@torch.library.custom_op("normbook::softmax_backward", mutates_args=())
def _op_backward(y: torch.Tensor, dy: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.ops.normbook.softmax_backward``: dx from the output p and its
    gradient."""
    if y.numel() == 0:
        return _empty_along(y, dim).zero_()
    dx = _backward(_rows_along(dy, dim), _rows_along(y, dim))
    return _unrows(dx, y.shape, dim)


@_op_backward.register_fake
def _(y, dy, dim):
    return _empty_along(y, dim)


def _setup_context(ctx, inputs, output):
    # the output p, not the input: the backward needs only p
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _autograd_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.normbook.softmax_backward(y, dy, ctx.dim), None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_dim(dim, ndim: int) -> int:
    """``dim`` is an int in [-ndim, ndim); returns it as a non-negative index."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"dim must be in [{-ndim}, {ndim - 1}] for a {ndim}-D x, got {dim}"
        )
    return int(dim) % ndim


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    r"""Softmax of ``x`` along ``dim``: ``p = exp(x - max x) / sum(exp(x - max x))``.

    Args:
        x: float32, float16 or bfloat16 tensor with at least one dimension (float64 is
            accepted and accumulated in float64, for gradient checks). Rows along the
            last dimension may be strided; softmax along another dimension (or a last
            dimension that is not contiguous) copies ``x`` once into rows.
        dim: the dimension to normalize over, as in ``torch.softmax``.

    Returns ``p`` with ``x``'s shape and dtype; exponentials and sums are computed in
    float32 (float64 for float64 input) and ``p`` is rounded once. A row containing NaN
    or +inf, or a row of only -inf, gives NaN in that row only, as ``torch.softmax``
    does.

    Differentiable (Triton backward, the operator ``normbook::softmax_backward``);
    without ``requires_grad`` nothing is saved.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    dim = _check_dim(dim, x.dim())
    return torch.ops.normbook.softmax(x, dim)
