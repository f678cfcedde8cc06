r"""Residual add fused with RMSNorm, as a Triton kernel.

.. math:: h = x + r, \qquad y_i = \gamma_i \, \frac{h_i}{\sqrt{\tfrac1n \sum_k h_k^2 + \epsilon}}

In a pre-norm transformer every block ends with ``h = h + f(h)`` and the next block starts with
``rms_norm(h)``. Done as two kernels that is five passes over a row-sized tensor (the add reads two
and writes one, the norm reads one and writes one); fused it is four: read ``x`` and ``r``, write
``h`` and ``y``. The normalization reads ``h`` as stored (rounded to the input dtype), exactly as
the unfused Hugging Face code does, so the two agree bit for bit up to the fp32 sum's order.
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, accumulation_dtype, row_config, tl_accumulation_dtype
from ._triton_utils import round_to


@triton.jit
def _fused_add_rms_norm_fwd(
    X, R, Y, H, W, Rstd,        # pointers: input, residual, output, residual out (x + r), weight, 1/rms
    stride_x, stride_r, stride_y, stride_h,  # distance between rows, in elements
    M, N, eps,                  # rows, row length, epsilon
    HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr,  # ACC: accumulation dtype, fp32 (fp64 for fp64 input)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
    x_rows = X + rows[:, None] * stride_x
    r_rows = R + rows[:, None] * stride_r
    y_rows = Y + rows[:, None] * stride_y
    h_rows = H + rows[:, None] * stride_h

    if SINGLE_BLOCK:
        # The whole row fits in registers: read x and r once, keep h for the normalization.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        # Round h to the storage dtype first: the norm must see the residual stream as stored.
        h_low = round_to(x + r, H.dtype.element_ty)
        tl.store(h_rows + cols[None, :], h_low, mask=mask)
        h = h_low.to(ACC)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / N + eps)  # fp32: fp16 squares overflow past 256
    else:
        # Wider than a block: write h block by block and accumulate its sum of squares in fp32.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            h_low = round_to(x + r, H.dtype.element_ty)
            tl.store(h_rows + cols[None, :], h_low, mask=mask)
            h = h_low.to(ACC)
            acc += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
        # The second pass reads back h written above (one tensor instead of x and r, mostly from
        # L2); the barrier makes every thread's stores visible to the threads that reload them.
        tl.debug_barrier()
    tl.store(Rstd + rows, rstd, mask=row_mask)

    n_blocks = tl.cdiv(N, BLOCK_N)
    for i in range(0, n_blocks):
        # Backwards: the blocks of h written last are the likeliest to be still in L2.
        cols = (n_blocks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        if not SINGLE_BLOCK:
            h = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        # Hugging Face convention: normalize in fp32, round to the input dtype, then scale.
        y = round_to(h * rstd[:, None], Y.dtype.element_ty)
        if HAS_WEIGHT:
            # Product formed in fp32 and rounded once: a correctly rounded half-precision multiply.
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
            y = round_to(y.to(ACC) * w[None, :], Y.dtype.element_ty)
        tl.store(y_rows + cols[None, :], y, mask=mask)


def _forward(x2d: torch.Tensor, r2d: torch.Tensor, weight, eps: float):
    """Launch the kernel on (M, N) views; returns (y2d, h2d, rstd), rstd in the accumulation dtype."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    h = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    acc = accumulation_dtype(x2d.dtype)
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        return y, h, rstd.fill_(float("nan") if N == 0 else 0.0)
    cfg = row_config(M, N, x2d.element_size())
    w = weight.contiguous() if weight is not None else x2d  # dummy pointer when HAS_WEIGHT is False
    _fused_add_rms_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
        x2d, r2d, y, h, w, rstd,
        x2d.stride(0), r2d.stride(0), y.stride(0), h.stride(0), M, N, eps,
        HAS_WEIGHT=weight is not None, ACC=tl_accumulation_dtype(acc),
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, SINGLE_BLOCK=cfg.SINGLE_BLOCK,
        num_warps=cfg.num_warps, **LAUNCH,
    )
    return y, h, rstd


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Add the residual and RMS-normalize the sum, in one pass: returns ``(y, residual_out)``.

    ``residual_out = x + residual`` (rounded to ``x``'s dtype: the residual stream as the next
    block receives it) and ``y = rms_norm(residual_out, weight, eps)`` with the Hugging Face
    convention of :func:`kernels.rms_norm` (fp32 statistics, normalized value rounded to the input
    dtype, then multiplied by ``weight``). Equal to the unfused
    ``h = x + residual; y = rms_norm(h, weight, eps)`` while moving four row-sized tensors
    instead of five. Inputs are not modified; both outputs are new contiguous tensors.

    Args:
        x: float32, float16 or bfloat16 tensor ``(..., N)`` (float64 accepted, accumulated in
            float64). Rows may be strided (last dimension contiguous).
        residual: same shape, dtype and device as ``x``.
        weight: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device.
        eps: finite, >= 0, added to the mean square inside the square root.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    _validate.check_like(residual, "residual", x)
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    eps = _validate.check_eps(eps)
    if x.numel() == 0:
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))
    y, h, _ = _forward(_validate.as_rows(x), _validate.as_rows(residual), weight, eps)
    return y.view(x.shape), h.view(x.shape)
