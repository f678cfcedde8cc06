r"""LayerNorm forward as a Triton kernel.

.. math:: y_i = \gamma_i \, \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta_i, \qquad
          \mu = \tfrac1n \textstyle\sum_k x_k, \quad \sigma^2 = \tfrac1n \textstyle\sum_k (x_k - \mu)^2

One program normalizes ``BLOCK_M`` rows. The variance is never formed as
:math:`\overline{x^2} - \mu^2` (which cancels catastrophically when :math:`|\mu| \gg \sigma`):

- a row that fits in one block (``N`` up to 16K fp32 / 32K half-precision elements) is read from
  memory once and kept in registers; the mean and then the squared deviations from it are summed
  over the registers (two passes, one read);
- a wider row is read block by block; each block is summarized exactly as above by its
  (mean, M2, count), and the summaries are merged with Chan et al.'s formula
  (:func:`kernels._triton_utils.chan_combine`). The row is read a second time to write the output.

The per-row mean and ``rstd = 1/sqrt(σ² + ε)`` are stored (fp32; fp64 for fp64 input) for a
backward pass.
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import row_config
from ._triton_utils import chan_combine, round_to


@triton.jit
def _layer_norm_fwd(
    X, Y, W, B, Mean, Rstd,     # pointers: input, output, weight, bias, per-row mean and 1/std (fp32)
    stride_x, stride_y,         # distance between rows, in elements
    M, N, eps,                  # rows, row length, epsilon
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,          # accumulation dtype: fp32 (fp64 for fp64 input)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * stride_y

    if SINGLE_BLOCK:
        # The whole row fits in registers: read it once, then make both passes over the registers.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        mean = tl.sum(x, axis=1) / N
        # Deviations from the mean are O(σ): squaring them cancels nothing, unlike E[x²] − E[x]².
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1) / N
    else:
        # Wider than a block: summarize each block by (mean, M2, count), two passes in registers,
        # and merge the summaries (Chan et al.) into the row's running one.
        mean = tl.zeros([BLOCK_M], dtype=ACC)
        m2 = tl.zeros([BLOCK_M], dtype=ACC)
        count = tl.zeros([BLOCK_M], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            count_b = tl.where(row_mask, tl.minimum(N - off, BLOCK_N), 0).to(ACC)  # the last block may be partial
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

    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        if not SINGLE_BLOCK:
            # Second read of the row; on a GPU it mostly hits L2.
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        y = (x - mean[:, None]) * rstd[:, None]
        # The affine part is done in fp32 and rounded once, as torch.nn.functional.layer_norm does
        # (and it avoids the interpreter's broken bf16 arithmetic).
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        tl.store(y_rows + cols[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


def _forward(x2d: torch.Tensor, weight, bias, eps: float):
    """Launch the kernel on a (M, N) view; returns (y2d, mean, rstd), mean and rstd of shape (M,)
    in the accumulation dtype (fp32; fp64 for fp64 input)."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    acc = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    mean = torch.empty((M,), dtype=acc, device=x2d.device)
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        fill = float("nan") if N == 0 else 0.0  # the mean of an empty row is 0/0
        return y, mean.fill_(fill), rstd.fill_(fill)
    cfg = row_config(M, N, x2d.element_size())
    w = weight.contiguous() if weight is not None else x2d  # dummy pointer when HAS_WEIGHT is False
    b = bias.contiguous() if bias is not None else x2d      # dummy pointer when HAS_BIAS is False
    _layer_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
        x2d, y, w, b, mean, rstd, x2d.stride(0), y.stride(0), M, N, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SINGLE_BLOCK=cfg.SINGLE_BLOCK,
        num_warps=cfg.num_warps,
    )
    return y, mean, rstd


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    r"""LayerNorm over the last dimension of ``x``: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

    ``var`` is the population variance (divide by ``N``), as in ``torch.nn.functional.layer_norm``.
    Statistics in fp32 (numerically sound: never ``E[x²] − E[x]²``); the affine part in fp32 and
    the result rounded once to ``x``'s dtype, as PyTorch does. The output has ``x``'s dtype and shape.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape ``(..., N)`` (float64 is accepted and
            accumulated in float64, for gradient checks). Rows may be strided (last dimension
            contiguous); other layouts are copied once.
        weight: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device (γ).
        bias: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device (β).
        eps: finite, >= 0, added to the variance inside the square root.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    _validate.check_param(bias, "bias", n, x)
    eps = _validate.check_eps(eps)
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    y, _, _ = _forward(_validate.as_rows(x), weight, bias, eps)
    return y.view(x.shape)
