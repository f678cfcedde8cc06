r"""Residual add fused with RMSNorm, as a Triton kernel.

.. math:: h = x + r,
          \qquad y_i = \gamma_i \, \frac{h_i}{\sqrt{\tfrac1n \sum_k h_k^2 + \epsilon}}

In a pre-norm transformer every block ends with ``h = h + f(h)`` and the next block
starts with ``rms_norm(h)``. Done as two kernels that is five passes over a row-sized
tensor (the add reads two and writes one, the norm reads one and writes one); fused it
is four: read ``x`` and ``r``, write ``h`` and ``y``. The normalization reads ``h`` as
stored (rounded to the input dtype), exactly as the unfused Hugging Face code does, so
the two agree bit for bit up to the fp32 sum's order. The conventions (``offset``,
``casting_mode``) are :func:`normbook.rms_norm`'s.

Backward. With ``ḡ_y`` and ``ḡ_h`` the gradients reaching the two outputs, the gradient
of ``h`` is the RMSNorm vector-Jacobian product of ``ḡ_y`` plus ``ḡ_h``, and ``h = x +
r`` passes it unchanged to both inputs (the rounding of h is treated as the identity, as
autograd of the unfused code does): ``dx = dr = vjp(ḡ_y) + ḡ_h``. It runs in
:func:`normbook.rms_norm`'s backward kernels (:mod:`normbook.rms_norm_backward`, which
adds ``ḡ_h`` in the same pass) on the saved ``h`` and 1/rms: one machinery, not a copy.
"""

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import (
    LAUNCH,
    accumulation_dtype,
    rms_config,
    rms_split,
    tl_accumulation_dtype,
)
from ._runtime import device_guard
from ._triton_utils import round_to
from .rms_norm import (
    LLAMA,
    _normalize,
    _rstd,
    _square,
    check_convention,
    split_launches,
)
from .rms_norm_backward import _backward


@triton.jit
def _fused_add_rms_norm_fwd(
    # pointers: input, residual, output, residual out (x + r), weight, 1/rms
    X,
    R,
    Y,
    H,
    W,
    Rstd,
    stride_x,
    stride_r,
    stride_y,
    stride_h,  # distance between rows, in elements
    M,
    N,
    eps,
    offset,  # rows, row length, epsilon, γ' = offset + γ
    # ACC: accumulation dtype, fp32 (fp64 for fp64 input)
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
    MODE: tl.constexpr,  # casting mode: 0 llama, 1 gemma, 2 none
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    DT: tl.constexpr = H.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride can pass 2**31 on a large tensor
    x_rows = X + rows[:, None] * stride_x
    r_rows = R + rows[:, None] * stride_r
    y_rows = Y + rows[:, None] * stride_y
    h_rows = H + rows[:, None] * stride_h

    if SINGLE_BLOCK:
        # The whole row fits in registers: read x and r once, keep h for the
        # normalization.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        # Round h to the storage dtype first: the norm must see the residual stream as
        # stored.
        h_low = round_to(x + r, DT)
        tl.store(h_rows + cols[None, :], h_low, mask=mask)
        h = h_low.to(ACC)
        # fp32: fp16 squares overflow past 256
        sum_sq = tl.sum(_square(h, DT, MODE), axis=1)
    else:
        # Wider than a block: write h block by block and accumulate its sum of squares
        # in fp32.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            h_low = round_to(x + r, DT)
            tl.store(h_rows + cols[None, :], h_low, mask=mask)
            h = h_low.to(ACC)
            acc += _square(h, DT, MODE)
        sum_sq = tl.sum(acc, axis=1)
        # The second pass reads back h written above (one tensor instead of x and r,
        # mostly from L2); the barrier makes every thread's stores visible to the
        # threads that reload them.
        tl.debug_barrier()
    rstd = _rstd(sum_sq, N, eps, row_mask, DT, MODE)
    tl.store(Rstd + rows, rstd, mask=row_mask)

    n_blocks = tl.cdiv(N, BLOCK_N)
    for i in range(0, n_blocks):
        # Backwards: the blocks of h written last are the likeliest to be still in L2.
        cols = (n_blocks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        if not SINGLE_BLOCK:
            h = tl.load(h_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        w = h  # placeholder when there is no weight (never read)
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        tl.store(
            y_rows + cols[None, :],
            _normalize(h, rstd, w, offset, HAS_WEIGHT, DT, MODE),
            mask=mask,
        )


@triton.jit
def _fused_add_rms_norm_fwd_sums(
    X,
    R,
    H,  # input, residual, residual out (x + r)
    stride_x,
    stride_r,
    stride_h,
    Sums,
    N,  # (M, N_BLOCKS) sums of squares of h (flat), row length
    ACC: tl.constexpr,
    DT: tl.constexpr,
    MODE: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The split forward's first launch (normbook.rms_norm.split_launches): h for one
    block of a row, stored, and its sum of squares; the second launch normalizes h."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC)
    r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(ACC)
    h_low = round_to(x + r, DT)  # the norm sees the residual stream as stored
    tl.store(H + row * stride_h + cols, h_low, mask=mask)
    tl.store(
        Sums + row * N_BLOCKS + block, tl.sum(_square(h_low.to(ACC), DT, MODE), axis=0)
    )


def _forward(
    x2d: torch.Tensor,
    r2d: torch.Tensor,
    weight,
    eps: float,
    offset: float = 0.0,
    mode: int = LLAMA,
    split=None,
):
    """Launch the kernel on (M, N) views; returns (y2d, h2d, rstd), rstd in the
    accumulation dtype. ``split``: None chooses from N and the dtype (rms_norm's
    rule); tests force it."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    h = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    acc = accumulation_dtype(x2d.dtype)
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        return y, h, rstd.fill_(float("nan") if N == 0 else 0.0)
    cfg = rms_config(N, x2d.element_size())
    if split is None:
        split = rms_split(N, x2d.element_size())
    if split:
        split_launches(
            h,
            y,
            weight,
            rstd,
            eps,
            offset,
            mode,
            _fused_add_rms_norm_fwd_sums,
            (x2d, r2d, h, x2d.stride(0), r2d.stride(0), h.stride(0)),
        )
        return y, h, rstd
    # dummy pointer when HAS_WEIGHT is False
    w = weight.contiguous() if weight is not None else x2d
    with device_guard(x2d):
        _fused_add_rms_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
            x2d,
            r2d,
            y,
            h,
            w,
            rstd,
            x2d.stride(0),
            r2d.stride(0),
            y.stride(0),
            h.stride(0),
            M,
            N,
            eps,
            offset,
            HAS_WEIGHT=weight is not None,
            ACC=tl_accumulation_dtype(acc),
            MODE=mode,
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            SINGLE_BLOCK=cfg.SINGLE_BLOCK,
            num_warps=cfg.num_warps,
            **LAUNCH,
        )
    return y, h, rstd


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::fused_add_rms_norm", mutates_args=())
def _op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.fused_add_rms_norm``: (y, h, rstd), rstd one per row in the
    accumulation dtype (what the backward reads, with h)."""
    if x.numel() == 0:
        # Nothing to add or normalize: no launch.
        rstd = x.new_empty(_library.rows(x), dtype=accumulation_dtype(x.dtype))
        return _library.fresh(x), _library.fresh(x), rstd
    x2d, r2d = _validate.as_rows(x), _validate.as_rows(residual)
    y, h, rstd = _forward(x2d, r2d, weight, eps, offset, mode)
    return y.view(x.shape), h.view(x.shape), rstd


@_op.register_fake
def _(x, residual, weight, eps, offset, mode):
    rstd = x.new_empty(_library.rows(x), dtype=accumulation_dtype(x.dtype))
    return _library.fresh(x), _library.fresh(x), rstd


@torch.library.custom_op("normbook::fused_add_rms_norm_backward", mutates_args=())
def _op_backward(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.fused_add_rms_norm_backward``: (dx, dγ) from the gradients
    of y and (if it was used) h; dx is also the residual's gradient. dγ is
    :func:`~normbook._library.not_computed` unless ``need_dw`` and there is a
    weight."""
    need_dw = need_dw and weight is not None
    if h.numel() == 0:
        # dx is empty and dγ an empty sum: zero
        dw = torch.zeros_like(weight) if need_dw else _library.not_computed(h)
        return torch.zeros_like(h), dw
    dh2d = None if dh is None else _validate.as_rows(dh)
    dx, dw = _backward(
        _validate.as_rows(dy), _validate.as_rows(h), weight, rstd, need_dw, offset, dh2d
    )
    return dx.view(h.shape), dw if need_dw else _library.not_computed(h)


@_op_backward.register_fake
def _(dy, dh, h, weight, rstd, offset, need_dw):
    need_dw = need_dw and weight is not None
    dw = _library.fresh(weight) if need_dw else _library.not_computed(h)
    return _library.fresh(h), dw


def _setup_context(ctx, inputs, output):
    _, _, weight, _, offset, _ = inputs
    _, h, rstd = output
    ctx.offset = offset
    # an unused output's gradient stays None: nothing to read
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(h, weight, rstd)


def _autograd_backward(ctx, dy, dh, _):
    h, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[2]
    if dy is None:
        # only h was used: its gradient passes straight to x and residual
        dw = torch.zeros_like(weight) if need_dw else None
        return dh, dh, dw, None, None, None
    dx, dw = torch.ops.normbook.fused_add_rms_norm_backward(
        dy, dh, h, weight, rstd, ctx.offset, need_dw
    )
    # h = x + residual: the same gradient for both (autograd's AddBackward does the
    # same).
    return dx, dx, dw if need_dw else None, None, None, None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Add the residual and RMS-normalize the sum, in one pass: returns ``(y,
    residual_out)``.

    ``residual_out = x + residual`` (rounded to ``x``'s dtype: the residual stream as
    the next block receives it) and ``y = rms_norm(residual_out, weight, eps,
    offset=offset, casting_mode=casting_mode)`` with the conventions of
    :func:`normbook.rms_norm` (default: fp32 statistics, normalized value rounded to the
    input dtype, then multiplied by ``weight``). Equal to the unfused ``h = x +
    residual; y = rms_norm(h, weight, eps)`` while moving four row-sized tensors instead
    of five. Inputs are not modified; both outputs are new contiguous tensors.

    Args:
        x: float32, float16 or bfloat16 tensor ``(..., N)`` (float64 accepted,
            accumulated in float64). Rows may be strided (last dimension contiguous).
        residual: same shape, dtype and device as ``x``.
        weight: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device.
        eps: finite, >= 0, added to the mean square inside the square root.
        offset: finite real; the scale is ``offset + weight`` (Gemma: 1.0). Needs a
        weight.
        casting_mode: ``"llama"`` (default), ``"gemma"`` or ``"none"``.

    Differentiable with respect to ``x``, ``residual`` and ``weight``, through both
    outputs (Triton backward, the operator ``normbook::fused_add_rms_norm_backward``).

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    _validate.check_like(residual, "residual", x)
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    eps = _validate.check_eps(eps)
    offset, mode = check_convention(offset, casting_mode, weight)
    y, h, _ = torch.ops.normbook.fused_add_rms_norm(
        x, residual, weight, eps, offset, mode
    )
    return y, h
