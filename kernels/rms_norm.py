r"""RMSNorm forward as a Triton kernel.

.. math:: y_i = \gamma_i \, \frac{x_i}{\sqrt{\tfrac1n \sum_k x_k^2 + \epsilon}}

One program normalizes ``BLOCK_M`` rows. A row that fits in one block (``N`` up to 16K fp32 /
32K half-precision elements) is read from memory once and kept in registers; a wider row is
reduced in a loop over blocks and read a second time to write the output.
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import row_config
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
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)  # fp32: fp16 squares overflow past 256
    else:
        # Wider than a block: accumulate the sum of squares block by block, in fp32.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
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
    acc = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        return y, rstd.fill_(float("nan") if N == 0 else 0.0)
    cfg = row_config(M, N, x2d.element_size())
    w = weight.contiguous() if weight is not None else x2d  # dummy pointer when HAS_WEIGHT is False
    _rms_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
        x2d, y, w, rstd, x2d.stride(0), y.stride(0), M, N, eps,
        HAS_WEIGHT=weight is not None, ACC=tl.float64 if acc == torch.float64 else tl.float32,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SINGLE_BLOCK=cfg.SINGLE_BLOCK,
        num_warps=cfg.num_warps,
    )
    return y, rstd


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

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    eps = _validate.check_eps(eps)
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    y, _ = _forward(_validate.as_rows(x), weight, eps)
    return y.view(x.shape)
