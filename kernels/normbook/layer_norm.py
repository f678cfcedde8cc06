r"""LayerNorm forward and backward as Triton kernels, differentiable through
``torch.autograd``.

.. math:: y_i = \gamma_i \, \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta_i,
          \qquad \mu = \tfrac1n \textstyle\sum_k x_k,
          \quad \sigma^2 = \tfrac1n \textstyle\sum_k (x_k - \mu)^2

One program normalizes ``BLOCK_M`` rows. The variance is never formed as
:math:`\overline{x^2} - \mu^2` (which cancels catastrophically when :math:`|\mu| \gg
\sigma`):

- a row that fits in one block (up to 16 KB: ``N`` up to 4K fp32 / 8K half-precision
  elements) is read from memory once and kept in registers; the mean and then the
  squared deviations from it are summed over the registers (two passes, one read);
- a wider row is read block by block; each block is summarized exactly as above by its
  (mean, M2, count), and the summaries are merged with Chan et al.'s formula
  (:func:`normbook._triton_utils.chan_combine`). The row is read a second time to write
  the output, in reverse block order, so that the blocks the first pass read last, the
  likeliest to be still in L2, are read first. (Reading the row only once would need the
  whole row's statistics before its first output: the row held on chip across a cluster
  of CTAs, which Triton does not expose on every GPU this book targets, or a split over
  programs whose second kernel reads x again anyway.)

Tiles are chosen from ``N`` alone, never from the number of rows: a row's output bits do
not depend on the batch it comes in (batch invariance; see :func:`forward_config`).

The per-row mean and ``rstd = 1/sqrt(σ² + ε)`` are stored (fp32; fp64 for fp64 input)
for a backward pass.

Backward: :mod:`normbook.layer_norm_backward` (the vector-Jacobian product, its
kernels and their launch plan), beside this module; the operator
``normbook::layer_norm_backward`` calls it.
"""

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import (
    LAUNCH,
    LOOP_BLOCK_N,
    Config,
    _warps,
    accumulation_dtype,
    tl_accumulation_dtype,
)
from ._runtime import device_guard
from ._triton_utils import chan_combine, round_to
from .layer_norm_backward import _backward

# ---------------------------------------------------------------- launch configurations
#
# Chosen from the row length N alone, never from the number of rows M: the tile a row
# lands in, and so the order in which its sums are taken, is the same for M = 1 as for M
# = 4096 (batch invariance: a row's output bits do not depend on the rest of the batch).

# A forward row up to this many bytes is held in registers and read once. Wider rows
# would need more than 16 values per thread at 16 warps, and ptxas then gives 1 CTA per
# SM (or spills).
FWD_SINGLE_BYTES = 16384
TILE = 4096  # elements per forward program (rows × columns) when rows are short


def forward_config(N: int, element_size: int) -> Config:
    """The forward's tiling for rows of N elements (independent of M, see above)."""
    block_n = triton.next_power_of_2(N)
    if block_n * element_size <= FWD_SINGLE_BYTES:
        block_m = max(1, TILE // block_n)
        return Config(block_m, block_n, True, _warps(block_m * block_n))
    return Config(1, LOOP_BLOCK_N, False, _warps(LOOP_BLOCK_N))


# ---------------------------------------------------------------- forward


@triton.jit
def _layer_norm_fwd(
    # pointers: input, output, weight, bias, per-row mean and 1/std (fp32)
    X,
    Y,
    W,
    B,
    Mean,
    Rstd,
    stride_x,
    stride_y,  # distance between rows, in elements
    M,
    N,
    eps,  # rows, row length, epsilon
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
        # The whole row fits in registers: read it once, then make both passes over the
        # registers.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        mean = tl.sum(x, axis=1) / N
        # Deviations from the mean are O(σ): squaring them cancels nothing, unlike E[x²]
        # − E[x]².
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1) / N
    else:
        # Wider than a block: summarize each block by (mean, M2, count), two passes in
        # registers, and merge the summaries (Chan et al.) into the row's running one.
        mean = tl.zeros([BLOCK_M], dtype=ACC)
        m2 = tl.zeros([BLOCK_M], dtype=ACC)
        count = tl.zeros([BLOCK_M], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            # the last block may be partial
            count_b = tl.where(row_mask, tl.minimum(N - off, BLOCK_N), 0).to(ACC)
            mean_b = tl.sum(x, axis=1) / tl.maximum(count_b, 1.0)
            d = tl.where(mask, x - mean_b[:, None], 0.0)
            m2_b = tl.sum(d * d, axis=1)
            mean, m2, count = chan_combine(mean, m2, count, mean_b, m2_b, count_b)
        var = m2 / N
    # Padding rows of the last tile read as zeros: give them 1, not 1/0, when eps = 0.
    rstd = 1.0 / tl.sqrt(tl.where(row_mask, var + eps, 1.0))
    # Saved for a backward pass: it then needs no second reduction over x.
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)

    num_blocks = tl.cdiv(N, BLOCK_N)
    for i in range(0, num_blocks):
        # Second read of a wide row in reverse order: the blocks read last by the first
        # pass come first, while they are most likely still in L2.
        off = (num_blocks - 1 - i) * BLOCK_N
        cols = off + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        if not SINGLE_BLOCK:
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        y = (x - mean[:, None]) * rstd[:, None]
        # The affine part is done in fp32 and rounded once, as
        # torch.nn.functional.layer_norm does (and it avoids the interpreter's broken
        # bf16 arithmetic).
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        tl.store(y_rows + cols[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


def _forward(x2d: torch.Tensor, weight, bias, eps: float):
    """Launch the kernel on a (M, N) view; returns (y2d, mean, rstd), mean and rstd of
    shape (M,) in the accumulation dtype (fp32; fp64 for fp64 input)."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    acc = accumulation_dtype(x2d.dtype)
    mean = torch.empty((M,), dtype=acc, device=x2d.device)
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        fill = float("nan") if N == 0 else 0.0  # the mean of an empty row is 0/0
        return y, mean.fill_(fill), rstd.fill_(fill)
    cfg = forward_config(N, x2d.element_size())
    # dummy pointer when HAS_WEIGHT is False
    w = weight.contiguous() if weight is not None else x2d
    # dummy pointer when HAS_BIAS is False
    b = bias.contiguous() if bias is not None else x2d
    with device_guard(x2d):
        _layer_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
            x2d,
            y,
            w,
            b,
            mean,
            rstd,
            x2d.stride(0),
            y.stride(0),
            M,
            N,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            ACC=tl_accumulation_dtype(acc),
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            SINGLE_BLOCK=cfg.SINGLE_BLOCK,
            num_warps=cfg.num_warps,
            **LAUNCH,
        )
    return y, mean, rstd


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::layer_norm", mutates_args=())
def _op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.layer_norm``: (y, mean, rstd), mean and rstd one per row in
    the accumulation dtype (what the backward reads)."""
    if x.numel() == 0:
        # Nothing to normalize: no launch.
        stat = x.new_empty(_library.rows(x), dtype=accumulation_dtype(x.dtype))
        return _library.fresh(x), stat, stat.clone()
    y2d, mean, rstd = _forward(_validate.as_rows(x), weight, bias, eps)
    return y2d.view(x.shape), mean, rstd


@_op.register_fake
def _(x, weight, bias, eps):
    stat = x.new_empty(_library.rows(x), dtype=accumulation_dtype(x.dtype))
    return _library.fresh(x), stat, _library.fresh(stat)


@torch.library.custom_op("normbook::layer_norm_backward", mutates_args=())
def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.layer_norm_backward``: (dx, dγ, dβ); dγ (dβ) is
    :func:`~normbook._library.not_computed` unless asked for and there is a weight
    (bias)."""
    need_dw = need_dw and weight is not None
    need_db = need_db and bias is not None
    if x.numel() == 0:
        # dx is empty, dγ and dβ empty sums: zero
        dx = torch.zeros_like(dy)
        dw = torch.zeros_like(weight) if need_dw else None
        db = torch.zeros_like(bias) if need_db else None
    else:
        x2d = _validate.as_rows(x)
        dy2d = _validate.as_rows(dy)
        dx, dw, db = _backward(dy2d, x2d, weight, bias, mean, rstd, need_dw, need_db)
        dx = dx.view(x.shape)
    return (
        dx,
        dw if need_dw else _library.not_computed(x),
        db if need_db else _library.not_computed(x),
    )


@_op_backward.register_fake
def _(dy, x, weight, bias, mean, rstd, need_dw, need_db):
    need_dw = need_dw and weight is not None
    need_db = need_db and bias is not None
    return (
        _library.fresh(x),
        _library.fresh(weight) if need_dw else _library.not_computed(x),
        _library.fresh(bias) if need_db else _library.not_computed(x),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _autograd_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    _, need_dw, need_db, _ = ctx.needs_input_grad
    need_dw, need_db = need_dw and weight is not None, need_db and bias is not None
    dx, dw, db = torch.ops.normbook.layer_norm_backward(
        dy, x, weight, bias, mean, rstd, need_dw, need_db
    )
    return dx, dw if need_dw else None, db if need_db else None, None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    r"""LayerNorm over the last dimension of ``x``: ``y = (x - mean) / sqrt(var + eps) *
    weight + bias``.

    ``var`` is the population variance (divide by ``N``), as in
    ``torch.nn.functional.layer_norm``. Statistics in fp32 (numerically sound: never
    ``E[x²] − E[x]²``); the affine part in fp32 and the result rounded once to ``x``'s
    dtype, as PyTorch does. The output has ``x``'s dtype and shape.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape ``(..., N)`` (float64 is
            accepted and accumulated in float64, for gradient checks). Rows may be
            strided (last dimension contiguous); other layouts are copied once.
        weight: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device (γ).
        bias: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device (β).
        eps: finite, >= 0, added to the variance inside the square root.

    Differentiable with respect to ``x``, ``weight`` and ``bias`` (Triton backward
    kernels, the operator ``normbook::layer_norm_backward``); without
    ``requires_grad`` nothing is saved for a backward pass.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    _validate.check_param(bias, "bias", n, x)
    eps = _validate.check_eps(eps)
    y, _, _ = torch.ops.normbook.layer_norm(x, weight, bias, eps)
    return y
