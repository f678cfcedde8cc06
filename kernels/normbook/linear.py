r"""The matrix product of a linear layer, ``y = x Wᵀ + b``, as one tiled Triton GEMM.

Every projection of a decoder layer (q, k, v, o, gate, up, down) and the LM head is

.. math:: y_{ij} = \sum_{k=1}^{K} x_{ik}\, w_{jk} \;+\; b_j ,
          \qquad x \in \mathbb{R}^{M\times K},\; W \in \mathbb{R}^{N\times K},

and its gradients are two more products of the same shape family,

.. math:: \frac{\partial L}{\partial x} = \delta\, W, \qquad
          \frac{\partial L}{\partial W} = \delta^{\mathsf T} x, \qquad
          \frac{\partial L}{\partial b_j} = \sum_i \delta_{ij}
          \quad (\delta = \partial L/\partial y).

**The kernel.** One program per ``BLOCK_M × BLOCK_N`` tile of C = A·B; it walks K in
steps of ``BLOCK_K`` from 0 up, multiplying an A tile by a B tile with ``tl.dot``
(tensor cores on a GPU) into an fp32 accumulator, adds the bias in fp32, and rounds
once to the output dtype. x Wᵀ is A = x, B = Wᵀ (W's strides swapped: no copy); the
backward's δW and δᵀx are the same kernel on other strides, and db = δᵀ·1, a product
with a column of ones of stride 0.

**How it rounds.** With fp32 accumulation (u = 2⁻²⁴) the computed sum s of the K
products obeys the standard inner-product bound (Higham, *Accuracy and Stability of
Numerical Algorithms*, §3.1), whatever the order of the additions:

.. math:: |s - x_i \cdot w_j| \le \gamma_K \sum_k |x_{ik} w_{jk}|,
          \qquad \gamma_K = \frac{K u}{1 - K u}.

The bias is one more term (b_j · 1): γ_{K+1} over Σ|x w| + |b|. For fp16 and bf16
inputs the products are exact in fp32 (11 + 11 and 8 + 8 significant bits fit in 24),
so only the additions round and γ_K is generous. The final rounding to the output
dtype adds u_out·|ŷ|, where |ŷ| ≤ |y| + the accumulation error:

.. math:: |\mathrm{fl}(y_{ij}) - y_{ij}| \le (1 + u_{out})\,\gamma_{K+1}
          \Bigl(\sum_k |x_{ik} w_{jk}| + |b_j|\Bigr) + u_{out}\,|y_{ij}| ,

``normbook.bounds.gemm_error_bound``. fp32 inputs are multiplied in IEEE fp32
(``input_precision="ieee"``), never silently in TF32 (u = 2⁻¹¹), which would break it.

**Batch invariance.** The tile sizes are chosen from N, K, the dtype and the GPU
(:func:`._config.gemm_config`), never from M; K is always walked in the same order
from 0, in one program (no split-K); M is not a specialization key of the forward's
kernel (``do_not_specialize``), so one compiled binary serves every batch size, and a
tensor-core instruction treats each row of its tile alike. A row of y therefore has
the same bits computed alone or in a batch of any size, at any place in it: a served
model's answer does not depend on the other requests of its batch.

**In the interpreter** ``tl.dot`` is numpy's matmul, whose BLAS blocking sums a row in
an order that depends on the row's place in the tile (and which garbles bf16). There
the tile product is written out instead, a product and a sum along K in the
accumulation dtype, in one order for every element: the same bound, the same
invariance, and the tests check both bit for bit.
"""

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import LAUNCH, _capability, gemm_config, tl_accumulation_dtype
from ._runtime import INTERPRET, device_guard
from ._triton_utils import round_to

#: Row tiles of A per group of the launch order (the order changes no result).
GROUP_M = 8
#: What the kernel multiplies (float64 for gradient checks).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _gemm_tile(
    A,
    B,
    Bias,
    C,  # pointers: A (M, K), B (K, N), bias (N,) (unread without HAS_BIAS), C (M, N)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,  # any strides, 0 included (a broadcast column of ones)
    HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Program -> tile: GROUP_M row tiles run down one column of tiles before the next,
    # so the B tiles they share are still in L2. Any order gives the same bits.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge read a real row again (modulo): their results are
    # never stored, and the loads need no mask along M and N.
    a_ptrs = A + (rows % M)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + ks[:, None] * stride_bk + (cols % N)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    # K from 0 up in steps of BLOCK_K, one program per output tile (no split-K): every
    # element is summed in one order, whatever M. The tail of K loads zeros.
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(ks < K - k0)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(ks < K - k0)[:, None], other=0.0)
        if INTERPRETER:
            # numpy's BLAS (the interpreter's tl.dot) sums a row in an order that
            # depends on its place in the tile, and garbles bf16: here every element
            # is a sum along K in one order, in ACC (products of fp16/bf16 exact)
            acc += tl.sum(a.to(ACC)[:, :, None] * b.to(ACC)[None, :, :], axis=1)
        else:
            # tensor cores treat every row alike; IEEE: fp32 is never cut to TF32
            acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    col_ok = cols < N
    if HAS_BIAS:
        # the bias joins the fp32 sum: still one rounding
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    mask = (rows < M)[:, None] & col_ok[None, :]
    tl.store(c_ptrs, round_to(acc, C.dtype.element_ty), mask=mask)


# Two kernels of one body. y = x Wᵀ and δx = δ W: M counts the batch's rows and is no
# specialization key, so one binary serves every batch size. δW = δᵀ x and db = δᵀ·1:
# M counts features, and knowing it a multiple of 16 lets A = δᵀ, contiguous along M,
# load 128 bits at a time (the batch is their K: they sum over it, always in order).
_gemm = triton.jit(do_not_specialize=["M"])(_gemm_tile)
_gemm_features = triton.jit(_gemm_tile)


def _forward(a, b, bias=None, out_dtype=None, batch_rows=True):
    """C = A·B (+ bias) for a 2-D ``a`` (M, K) and ``b`` (K, N) of one dtype, any
    strides; a new contiguous (M, N) tensor of ``out_dtype`` (default: a's).
    ``batch_rows``: a's rows are a batch's (:data:`_gemm`), else features
    (:data:`_gemm_features`)."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    cfg = gemm_config(N, K, a.dtype, _capability(a))
    grid = (triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),)
    with device_guard(a):
        (_gemm if batch_rows else _gemm_features)[grid](
            a,
            b,
            c if bias is None else bias,  # c: a placeholder, never read
            c,
            M,
            N,
            K,
            *a.stride(),
            *b.stride(),
            *c.stride(),
            HAS_BIAS=bias is not None,
            ACC=tl_accumulation_dtype(a.dtype),
            INTERPRETER=INTERPRET,
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            BLOCK_K=cfg.BLOCK_K,
            GROUP_M=GROUP_M,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **LAUNCH,
        )
    return c


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) as (M, K): a view whenever the leading dimensions fold into one
    stride (any 2-D tensor, a slice of rows or columns); a copy only when they do
    not."""
    return x.reshape(_library.rows(x), x.shape[-1])  # not -1: x may be empty


def _column_sums(dy2d: torch.Tensor, dtype) -> torch.Tensor:
    """db = δᵀ·1, the column sums of δ (M, N), by the same kernel: fp32, fixed order,
    one rounding to ``dtype``. The ones are a broadcast scalar (stride 0)."""
    ones = dy2d.new_ones(1, 1).expand(dy2d.shape[0], 1)
    return _forward(dy2d.t(), ones, out_dtype=dtype, batch_rows=False).view(-1)


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::linear", mutates_args=())
def _op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``torch.ops.normbook.linear``: x Wᵀ + b on checked inputs, one launch."""
    y = _forward(_rows(x), weight.t(), bias)
    return y.view(*x.shape[:-1], weight.shape[0])


@_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("normbook::linear_backward", mutates_args=())
def _op_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    dy: torch.Tensor,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.linear_backward``: (dx, dweight, dbias), each by the
    forward's kernel, :func:`~normbook._library.not_computed` where not asked for."""
    dy2d = _rows(dy.to(x.dtype))
    # dx = δ (M, N) · W (N, K); dW = δᵀ (N, M) · x (M, K), a sum over the batch in one
    # order; db = δᵀ · 1. Each output its own tensor, even when not computed.
    dx = _forward(dy2d, weight).view(x.shape) if need_x else _library.not_computed(x)
    dw = (
        _forward(dy2d.t(), _rows(x), batch_rows=False)
        if need_weight
        else _library.not_computed(x)
    )
    db = _column_sums(dy2d, x.dtype) if need_bias else _library.not_computed(x)
    return dx, dw, db


@_op_backward.register_fake
def _(x, weight, dy, need_x, need_weight, need_bias):
    def grad(t, needed):
        return _library.fresh(t) if needed else _library.not_computed(x)

    db = x.new_empty(weight.shape[0]) if need_bias else _library.not_computed(x)
    return grad(x, need_x), grad(weight, need_weight), db


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)  # both in memory already; the bias is not read


def _autograd_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = torch.ops.normbook.linear_backward(x, weight, dy, *need)
    return tuple(g if n else None for g, n in zip(grads, need))


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


@torch.library.custom_op("normbook::matmul", mutates_args=())
def _op_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.ops.normbook.matmul``: a·b on checked inputs, one launch."""
    return _forward(_rows(a), b).view(*a.shape[:-1], b.shape[1])


@_op_matmul.register_fake
def _(a, b):
    return a.new_empty((*a.shape[:-1], b.shape[1]))


@torch.library.custom_op("normbook::matmul_backward", mutates_args=())
def _op_matmul_backward(
    a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, need_a: bool, need_b: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.matmul_backward``: (da, db) = (δ bᵀ, aᵀ δ)."""
    dy2d = _rows(dy.to(a.dtype))
    da = _forward(dy2d, b.t()).view(a.shape) if need_a else _library.not_computed(a)
    if need_b:  # aᵀ δ: a sum over the batch, as δW's
        db = _forward(_rows(a).t(), dy2d, batch_rows=False)
    else:
        db = _library.not_computed(a)
    return da, db


@_op_matmul_backward.register_fake
def _(a, b, dy, need_a, need_b):
    def grad(t, needed):
        return _library.fresh(t) if needed else _library.not_computed(a)

    return grad(a, need_a), grad(b, need_b)


def _setup_matmul(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _autograd_matmul(ctx, dy):
    a, b = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = torch.ops.normbook.matmul_backward(a, b, dy, *need)
    return tuple(g if n else None for g, n in zip(grads, need))


_op_matmul.register_autograd(_autograd_matmul, setup_context=_setup_matmul)


# ---------------------------------------------------------------- the public calls


def _check_operand(t, name: str, like=None, like_name: str = "x") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16 (float64 for gradient "
            f"checks), got {t.dtype}"
        )
    _validate.check_device(t, name)
    if like is not None:
        if t.dtype != like.dtype:
            raise TypeError(
                f"{name} must have {like_name}'s dtype, {like.dtype}, got {t.dtype}"
            )
        _validate.check_same_device(name, t, like_name, like)


def _check_linear(x, weight, bias) -> None:
    _check_operand(x, "x")
    if x.dim() == 0:
        raise ValueError(
            "x must have at least one dimension (in_features), got a scalar"
        )
    _check_operand(weight, "weight", x)
    if weight.dim() != 2:
        raise ValueError(
            "weight must be 2-D (out_features, in_features), got shape "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight's in_features, {weight.shape[1]}, must equal x's last dimension, "
            f"{x.shape[-1]} (x {tuple(x.shape)}, weight {tuple(weight.shape)})"
        )
    if bias is not None:
        _check_operand(bias, "bias", x)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},), weight's out_features, "
                f"got {tuple(bias.shape)}"
            )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    r"""``x Wᵀ + b``, as ``torch.nn.functional.linear``: one tiled GEMM, fp32
    accumulation, one rounding, batch-invariant.

    Args:
        x: ``(..., in_features)``, float32, float16 or bfloat16 (float64 for gradient
            checks), any strides (the leading dimensions are folded into rows without a
            copy whenever their strides allow).
        weight: ``(out_features, in_features)``, x's dtype and device, any strides (a
            transposed view is read in place).
        bias: ``(out_features,)`` or None, x's dtype and device.

    Returns ``(..., out_features)`` in x's dtype. The products and their sum are fp32
    (fp32 inputs are multiplied in IEEE fp32: ``input_precision="ieee"``, never TF32);
    the bias is added in fp32 and the result is rounded once. A row of the result has
    the same bits whatever the other rows of x (the tiles follow N, K, the dtype and
    the GPU, never the number of rows; no split-K). ``in_features = 0`` gives the bias
    (or zeros).

    Differentiable in x, weight and bias (the operator
    ``normbook::linear_backward``): δW and δx by the same kernel, db = δᵀ·1 likewise,
    all without atomics: the same bits from run to run.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _check_linear(x, weight, bias)
    return torch.ops.normbook.linear(x, weight, bias)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r"""``a @ b`` for ``a (..., K)`` and a matrix ``b (K, N)``: :func:`linear`'s kernel
    with b read as it is stored (no transpose, no copy).

    Args:
        a: ``(..., K)``, float32, float16 or bfloat16 (float64 for gradient checks), any
            strides; its leading dimensions are rows, as in ``torch.matmul``.
        b: ``(K, N)``, a's dtype and device, any strides.

    Returns ``(..., N)`` in a's dtype, rounded once from an fp32 sum, batch-invariant
    as :func:`linear`. Differentiable in a and b (``normbook::matmul_backward``).

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _check_operand(a, "a")
    if a.dim() == 0:
        raise ValueError("a must have at least one dimension, got a scalar")
    _check_operand(b, "b", a, "a")
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D (K, N), got shape {tuple(b.shape)}")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(
            f"b's first dimension, {b.shape[0]}, must equal a's last dimension, "
            f"{a.shape[-1]} (a {tuple(a.shape)}, b {tuple(b.shape)})"
        )
    return torch.ops.normbook.matmul(a, b)


__all__ = ["linear", "matmul"]
