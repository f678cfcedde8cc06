r"""RMSNorm forward and backward as Triton kernels, differentiable through
``torch.autograd``.

.. math:: y_i = \gamma_i \, \frac{x_i}{\sqrt{\tfrac1n \sum_k x_k^2 + \epsilon}}

Forward: one program normalizes ``BLOCK_M`` rows when a row fits in one block (``N`` up
to 8192 elements, :func:`normbook._config.rms_config`): the row is read from memory once
and kept in registers. A wider row is split over programs, one per block of 4096
elements, in two launches (:func:`split_launches`): the first stores each block's sum
of squares, the second adds a row's sums, forms 1/rms and normalizes its block. The
choice and the tiles depend on N and the dtype only, never on the number of rows M, so
a row's bits do not depend on its batch (batch invariance).

Why split: at decode (M = 1 ... 64 rows) one program per row leaves most of a GPU's
132 SMs idle; split, a row of N elements occupies N / 4096 of them. The cost: the second
launch reads x again after the first has streamed every row, so when the tensor is
larger than L2 (the benchmark's 2**26 elements) that read comes from memory, where the
single-program loop (kept, ``split=False``) re-read its row's blocks while they were
still in L2. So only rows of at least 512 KiB are split (normbook._config.rms_split:
past that, the loop's re-read misses L2 too); narrower wide rows keep the loop, which
we expect to be up to a third faster at large M and slower at decode. Not measured (no
GPU was at hand). Reading the row
exactly once would need the programs of a row to share their sums on chip
(thread-block clusters, sm_90 only), which Triton does not expose. Rows that fit one
block are not split, even at decode: 1-64 rows of 4096-8192 move at most 1 MiB, less
than a GPU streams during one launch's latency, so we expect a second launch to cost
more than the programs it adds would gain.

Backward: :mod:`normbook.rms_norm_backward` (the vector-Jacobian product, its
kernels and their launch plan), beside this module; the operator
``normbook::rms_norm_backward`` calls it.


Conventions (``casting_mode``, ``offset``; the names are Liger-Kernel's). The scale is
:math:`\gamma' = \text{offset} + \gamma` (Gemma stores γ around 0 and uses offset 1):

- ``"llama"`` (Llama, Qwen: ``Qwen3RMSNorm``): statistics and x̂ in fp32, x̂ rounded to
  the input dtype, then multiplied by γ' (formed in fp32, the product rounded once);
- ``"gemma"`` (``Gemma3RMSNorm``): x̂ · γ' entirely in fp32, one rounding at the end;
- ``"none"``: every step rounded to the input dtype, as the naive PyTorch code ``x *
  torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w`` computes it on a bf16/fp16
  tensor (x² rounded, so fp16 squares overflow past 256; the mean, ε-sum, rsqrt, x·rstd
  and the product each rounded). A cautionary mode the book measures; the sum itself is
  accumulated in fp32, as torch's ``mean`` does.

The backward is the gradient of the formula for every convention, computed in fp32 from
the saved 1/rms (for ``"none"`` that rstd is the rounded one the forward used).

The reciprocal square root is ``div_rn(1, sqrt_rn(v))``: IEEE square root and division,
each correctly rounded. ``tl.rsqrt`` would lower to ``rsqrt.approx.f32``, the
instruction behind torch's CUDA ``rsqrt`` (and so Hugging Face's norms on a GPU), but an
approximation whose last bits the CPU interpreter cannot reproduce; the correctly
rounded pair gives the same bits in the interpreter, on every GPU and in float64
references, and costs a few instructions per *row* of a memory-bound kernel.
"""

import numbers

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import (
    LAUNCH,
    RMS_LOOP_BLOCK_N,
    accumulation_dtype,
    rms_config,
    rms_split,
    tl_accumulation_dtype,
)
from ._runtime import device_guard
from ._triton_utils import _mean, round_to
from .rms_norm_backward import _backward

# casting_mode -> the MODE constexpr of the kernels
CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}
LLAMA, GEMMA, NONE = 0, 1, 2


def check_convention(offset, casting_mode, weight) -> tuple[float, int]:
    """Validate ``offset`` and ``casting_mode`` (before any launch); returns (offset,
    MODE)."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"offset must be a real number, got {type(offset).__name__}")
    offset = float(offset)
    if not abs(offset) < float("inf"):  # NaN too; a Python test, no tensor to trace
        raise ValueError(f"offset must be finite, got {offset}")
    if not isinstance(casting_mode, str) or casting_mode not in CASTING_MODES:
        raise ValueError(
            f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}"
        )
    if offset != 0.0 and weight is None:
        raise ValueError(
            f"offset={offset} scales the weight (offset + weight): pass a weight"
        )
    return offset, CASTING_MODES[casting_mode]


@triton.jit
def _round_if(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    """``x`` rounded to ``dtype`` and back when ROUND (arithmetic in the input's
    precision)."""
    if ROUND:
        return round_to(x, dtype).to(x.dtype)
    else:
        return x


@triton.jit
def _square(x, DT: tl.constexpr, MODE: tl.constexpr):
    # "none" rounds each square to the input dtype (where fp16 overflows past 256).
    return _round_if(x * x, DT, MODE == 2)


@triton.jit
def _rstd(sum_sq, N, eps, row_mask, DT: tl.constexpr, MODE: tl.constexpr):
    """1 / sqrt(sum_sq / N + eps), IEEE (sqrt_rn, div_rn): the same bits on a GPU and
    here."""
    ms = _round_if(_mean(sum_sq, N), DT, MODE == 2)
    # Padding rows of the last tile read as zeros: give them 1, not 1/0, when eps = 0.
    v = tl.where(row_mask, _round_if(ms + eps, DT, MODE == 2), 1.0)
    if v.dtype == tl.float64:
        # fp64 sqrt and division are IEEE already (sqrt.rn.f64, div.rn.f64)
        r = 1.0 / tl.sqrt(v)
    else:
        r = tl.math.div_rn(tl.full(v.shape, 1.0, v.dtype), tl.sqrt_rn(v))
    return _round_if(r, DT, MODE == 2)


@triton.jit
def _normalize(
    x, rstd, w, offset, HAS_WEIGHT: tl.constexpr, DT: tl.constexpr, MODE: tl.constexpr
):
    """y = x·rstd·(offset + w) with the roundings of ``MODE``, returned in ``DT``."""
    y = x * rstd[:, None]
    if MODE != 1:
        # llama/none: round the normalized value to the input dtype before the scale.
        y = round_to(y, DT).to(x.dtype)
    if HAS_WEIGHT:
        # γ' formed in fp32; the product formed in fp32 and rounded once below: exactly
        # a correctly rounded half-precision multiply for llama (and no reliance on the
        # interpreter's broken bf16 arithmetic). gemma keeps the fp32 product.
        scale = _round_if(offset + w, DT, MODE == 2)
        y = y * scale[None, :]
    return round_to(y, DT)


@triton.jit
def _rms_norm_fwd(
    X,
    Y,
    W,
    Rstd,  # pointers: input, output, weight, per-row 1/rms (fp32)
    stride_x,
    stride_y,  # distance between rows, in elements
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
    DT: tl.constexpr = Y.dtype.element_ty
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
        # fp32: fp16 squares overflow past 256
        sum_sq = tl.sum(_square(x, DT, MODE), axis=1)
    else:
        # Wider than a block: accumulate the sum of squares block by block, in fp32.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            acc += _square(x, DT, MODE)
        sum_sq = tl.sum(acc, axis=1)
    rstd = _rstd(sum_sq, N, eps, row_mask, DT, MODE)
    tl.store(Rstd + rows, rstd, mask=row_mask)

    n_blocks = tl.cdiv(N, BLOCK_N)
    for i in range(0, n_blocks):
        # Backwards: the blocks read last are the likeliest to be still in L2.
        cols = (n_blocks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        if not SINGLE_BLOCK:
            # Second read of the row, last block first (see the module docstring).
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
        w = x  # placeholder when there is no weight (never read)
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
        y = _normalize(x, rstd, w, offset, HAS_WEIGHT, DT, MODE)
        tl.store(y_rows + cols[None, :], y, mask=mask)


# ---------------------------------------------------------------- split rows
#
# A row wider than one block (N > the single-block limit of rms_config) is split over
# programs, one per block of RMS_LOOP_BLOCK_N elements, in two launches: the first
# stores each block's sum of squares in an (M, blocks) buffer of the accumulation dtype,
# the second adds a row's sums (one tree over the blocks, fixed by N), forms 1/rms and
# normalizes its block. The grid is (M, blocks): a decode batch of a few rows occupies
# M times N / 4096 programs rather than M, and a row's sums are formed the same way in
# every batch.


@triton.jit
def _rms_norm_fwd_sums(
    X,
    stride_x,  # input, distance between its rows
    Sums,
    N,  # (M, N_BLOCKS) sums of squares (flat), row length
    ACC: tl.constexpr,
    DT: tl.constexpr,
    MODE: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(ACC)
    tl.store(Sums + row * N_BLOCKS + block, tl.sum(_square(x, DT, MODE), axis=0))


@triton.jit
def _rms_norm_fwd_apply(
    X,
    Y,
    W,
    Rstd,
    Sums,  # input (or h), output, weight, 1/rms, the sums above
    stride_x,
    stride_y,
    N,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
    MODE: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    BLOCKS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    DT: tl.constexpr = Y.dtype.element_ty
    rows = tl.program_id(0) + tl.arange(0, 1)
    block = tl.program_id(1)
    rows = rows.to(tl.int64)
    # Every program of a row adds the same sums the same way: the same 1/rms.
    b = tl.arange(0, BLOCKS_P2)
    sums = tl.load(
        Sums + rows[:, None] * N_BLOCKS + b[None, :],
        mask=(b < N_BLOCKS)[None, :],
        other=0.0,
    )
    rstd = _rstd(tl.sum(sums, axis=1), N, eps, rows >= 0, DT, MODE)
    if block == 0:
        tl.store(Rstd + rows, rstd)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(
        ACC
    )
    w = x  # placeholder when there is no weight (never read)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
    y = _normalize(x, rstd, w, offset, HAS_WEIGHT, DT, MODE)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)


def split_launches(x2d, y, weight, rstd, eps, offset, mode, sums_kernel, sums_args):
    """The split forward's two launches (rms_norm's, or fused_add_rms_norm's with its
    own first kernel, which also writes h: then ``x2d`` is h). ``sums_args``: the first
    kernel's arguments before the sums buffer (and N)."""
    M, N = x2d.shape
    block_n = RMS_LOOP_BLOCK_N
    n_blocks = triton.cdiv(N, block_n)
    acc = rstd.dtype
    sums = torch.empty((M * n_blocks,), dtype=acc, device=x2d.device)
    w = weight.contiguous() if weight is not None else x2d
    consts = dict(
        ACC=tl_accumulation_dtype(acc),
        MODE=mode,
        N_BLOCKS=n_blocks,
        BLOCK_N=block_n,
        num_warps=block_n // 256,
        **LAUNCH,
    )
    dt = {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
    }[y.dtype]
    with device_guard(x2d):
        sums_kernel[(M, n_blocks)](*sums_args, sums, N, DT=dt, **consts)
        _rms_norm_fwd_apply[(M, n_blocks)](
            x2d,
            y,
            w,
            rstd,
            sums,
            x2d.stride(0),
            y.stride(0),
            N,
            eps,
            offset,
            HAS_WEIGHT=weight is not None,
            BLOCKS_P2=triton.next_power_of_2(n_blocks),
            **consts,
        )


def _forward(
    x2d: torch.Tensor,
    weight,
    eps: float,
    offset: float = 0.0,
    mode: int = LLAMA,
    split=None,
):
    """Launch the kernel on a (M, N) view; returns (y2d, rstd), rstd of shape (M,) in
    the accumulation dtype. ``split``: None chooses from N and the dtype
    (:func:`normbook._config.rms_split`); tests force it."""
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    acc = accumulation_dtype(x2d.dtype)
    rstd = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0 or N == 0:
        return y, rstd.fill_(float("nan") if N == 0 else 0.0)
    cfg = rms_config(N, x2d.element_size())
    if split is None:
        split = rms_split(N, x2d.element_size())
    if split:
        split_launches(
            x2d,
            y,
            weight,
            rstd,
            eps,
            offset,
            mode,
            _rms_norm_fwd_sums,
            (x2d, x2d.stride(0)),
        )
        return y, rstd
    # dummy pointer when HAS_WEIGHT is False
    w = weight.contiguous() if weight is not None else x2d
    with device_guard(x2d):
        _rms_norm_fwd[(triton.cdiv(M, cfg.BLOCK_M),)](
            x2d,
            y,
            w,
            rstd,
            x2d.stride(0),
            y.stride(0),
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
    return y, rstd


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::rms_norm", mutates_args=())
def _op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, mode: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.rms_norm``: (y, rstd), rstd one per row in the accumulation
    dtype (what the backward reads)."""
    if x.numel() == 0:
        # Nothing to normalize: no launch.
        return _library.fresh(x), x.new_empty(
            _library.rows(x), dtype=accumulation_dtype(x.dtype)
        )
    y2d, rstd = _forward(_validate.as_rows(x), weight, eps, offset, mode)
    return y2d.view(x.shape), rstd


@_op.register_fake
def _(x, weight, eps, offset, mode):
    return _library.fresh(x), x.new_empty(
        _library.rows(x), dtype=accumulation_dtype(x.dtype)
    )


@torch.library.custom_op("normbook::rms_norm_backward", mutates_args=())
def _op_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.rms_norm_backward``: (dx, dγ); dγ is
    :func:`~normbook._library.not_computed` unless ``need_dw`` and there is a weight."""
    need_dw = need_dw and weight is not None
    if x.numel() == 0:
        # dx is empty and dγ an empty sum: zero
        dw = torch.zeros_like(weight) if need_dw else _library.not_computed(x)
        return torch.zeros_like(dy), dw
    dx, dw = _backward(
        _validate.as_rows(dy), _validate.as_rows(x), weight, rstd, need_dw, offset
    )
    return dx.view(x.shape), dw if need_dw else _library.not_computed(x)


@_op_backward.register_fake
def _(dy, x, weight, rstd, offset, need_dw):
    need_dw = need_dw and weight is not None
    dw = _library.fresh(weight) if need_dw else _library.not_computed(x)
    return _library.fresh(x), dw


def _setup_context(ctx, inputs, output):
    x, weight, _, offset, _ = inputs
    _, rstd = output
    ctx.offset = offset
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _autograd_backward(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[1]
    dx, dw = torch.ops.normbook.rms_norm_backward(
        dy, x, weight, rstd, ctx.offset, need_dw
    )
    return dx, dw if need_dw else None, None, None, None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> torch.Tensor:
    r"""RMSNorm over the last dimension of ``x``: ``y = x / sqrt(mean(x**2) + eps) *
    (offset + weight)``.

    The default follows the Hugging Face Qwen3/Llama convention: statistics and
    normalization in fp32, the normalized value rounded to ``x``'s dtype, then
    multiplied by ``weight``. With ``weight`` in ``x``'s dtype the result equals
    ``Qwen3RMSNorm`` bit for bit up to the fp32 sum's order; the output always has
    ``x``'s dtype and shape. ``casting_mode="gemma", offset=1.0`` is ``Gemma3RMSNorm``;
    see the module docstring for the three conventions.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape ``(..., N)`` (float64 is
            accepted and accumulated in float64, for gradient checks). Rows may be
            strided (last dimension contiguous); other layouts are copied once.
        weight: ``None`` or a float tensor of shape ``(N,)`` on ``x``'s device.
        eps: finite, >= 0, added to the mean square inside the square root.
        offset: finite real; the scale is ``offset + weight`` (Gemma: 1.0). Needs a
        weight.
        casting_mode: ``"llama"`` (default), ``"gemma"`` or ``"none"``.

    Differentiable with respect to ``x`` and ``weight`` (Triton backward kernels, the
    operator ``normbook::rms_norm_backward``); without ``requires_grad`` nothing is
    saved for a backward pass.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    n = x.shape[-1]
    _validate.check_param(weight, "weight", n, x)
    eps = _validate.check_eps(eps)
    offset, mode = check_convention(offset, casting_mode, weight)
    y, _ = torch.ops.normbook.rms_norm(x, weight, eps, offset, mode)
    return y
