r"""SwiGLU's gate, ``silu(gate) · up``, forward and backward as one-pass kernels.

The MLP of Llama and Qwen3 is ``down_proj(silu(gate_proj(x)) * up_proj(x))``. Between
the two matrix products sits an elementwise map of two tensors,

.. math:: y = \operatorname{silu}(g)\, u = \frac{g}{1 + e^{-g}}\, u = g\,\sigma(g)\, u,

with the derivatives

.. math:: \frac{\partial y}{\partial u} = g\,\sigma(g), \qquad
          \frac{\partial y}{\partial g}
          = u\,\sigma(g)\bigl(1 + g\,(1 - \sigma(g))\bigr).

Eager PyTorch runs it as two kernels (``silu``, then the product: five tensor passes,
two roundings); the forward here reads g and u once and writes y once, rounding once.
The backward reads g, u and dy once and writes dg and du: σ is recomputed, never saved.
"""

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import LAUNCH, tl_accumulation_dtype
from ._runtime import device_guard
from ._triton_utils import round_to

# Elements per program: 4096 (16 per thread with 8 warps, four 128-bit loads per tensor
# in fp32, two in fp16/bf16); rows narrower than a block share a program.
TILE = 4096
MAX_BLOCK_N = 4096


@triton.jit
def _sigmoid(g):
    # 1 / (1 + e^-g): for g -> -inf, e^-g = inf and σ = 0 (never inf/inf).
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _swiglu_fwd(
    G,
    U,
    Y,  # pointers: gate, up, output
    stride_g,
    stride_u,
    stride_y,  # row strides in elements (columns contiguous)
    M,
    N,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r, c = rows[:, None], cols[None, :]
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
    # silu(g)·u in fp32, one rounding at the store (eager PyTorch rounds silu(g) first).
    y = g * _sigmoid(g) * u
    tl.store(Y + r * stride_y + c, round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    G,
    U,
    DY,
    DG,
    DU,  # pointers: gate, up, dy, and dgate, dup
    stride_g,
    stride_u,
    stride_dy,
    stride_dg,
    stride_du,
    M,
    N,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r, c = rows[:, None], cols[None, :]
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
    dy = tl.load(DY + r * stride_dy + c, mask=mask, other=0.0).to(ACC)
    e = tl.exp(-g)
    sig = 1.0 / (1.0 + e)
    # 1 - σ(g) = e^-g·σ(g) without the cancellation of 1 - σ when g is large (σ near 1);
    # for g < 0, 1 - σ >= 1/2 is exact enough and e^-g·σ would be inf·0 far out.
    one_minus = tl.where(g >= 0, e * sig, 1.0 - sig)
    du = dy * (g * sig)
    dg = dy * u * (sig * (1.0 + g * one_minus))
    tl.store(DG + r * stride_dg + c, round_to(dg, DG.dtype.element_ty), mask=mask)
    tl.store(DU + r * stride_du + c, round_to(du, DU.dtype.element_ty), mask=mask)


def _config(M: int, N: int):
    """(BLOCK_M, BLOCK_N, num_warps): a tile of at most TILE elements, several rows of
    it when N is short; a function of N only (plus M's bound on tiny inputs)."""
    block_n = min(triton.next_power_of_2(max(N, 1)), MAX_BLOCK_N)
    block_m = min(max(TILE // block_n, 1), triton.next_power_of_2(max(M, 1)))
    num_warps = min(max(block_m * block_n // 512, 1), 8)
    return block_m, block_n, num_warps


def _grid(M, N, block_m, block_n):
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n))


def _forward(g2d: torch.Tensor, u2d: torch.Tensor) -> torch.Tensor:
    M, N = g2d.shape
    y = torch.empty((M, N), dtype=g2d.dtype, device=g2d.device)
    if y.numel() == 0:
        return y
    block_m, block_n, num_warps = _config(M, N)
    with device_guard(g2d):
        _swiglu_fwd[_grid(M, N, block_m, block_n)](
            g2d,
            u2d,
            y,
            g2d.stride(0),
            u2d.stride(0),
            y.stride(0),
            M,
            N,
            ACC=tl_accumulation_dtype(g2d.dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **LAUNCH,
        )
    return y


def _backward(g2d, u2d, dy2d):
    M, N = g2d.shape
    dg = torch.empty((M, N), dtype=g2d.dtype, device=g2d.device)
    du = torch.empty((M, N), dtype=g2d.dtype, device=g2d.device)
    if dg.numel() == 0:
        return dg, du
    block_m, block_n, num_warps = _config(M, N)
    with device_guard(g2d):
        _swiglu_bwd[_grid(M, N, block_m, block_n)](
            g2d,
            u2d,
            dy2d,
            dg,
            du,
            g2d.stride(0),
            u2d.stride(0),
            dy2d.stride(0),
            dg.stride(0),
            du.stride(0),
            M,
            N,
            ACC=tl_accumulation_dtype(g2d.dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **LAUNCH,
        )
    return dg, du


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::swiglu", mutates_args=())
def _op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``torch.ops.normbook.swiglu``: the forward launch on checked inputs."""
    return _forward(_validate.as_rows(gate), _validate.as_rows(up)).view(gate.shape)


@_op.register_fake
def _(gate, up):
    return _library.fresh(gate)


@torch.library.custom_op("normbook::swiglu_backward", mutates_args=())
def _op_backward(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.swiglu_backward``: (dgate, dup), one pass."""
    dy2d = _validate.as_rows(dy.to(gate.dtype))
    dg, du = _backward(_validate.as_rows(gate), _validate.as_rows(up), dy2d)
    return dg.view(gate.shape), du.view(gate.shape)


@_op_backward.register_fake
def _(gate, up, dy):
    return _library.fresh(gate), _library.fresh(gate)


def _setup_context(ctx, inputs, output):
    # gate and up are already in memory: nothing else is kept
    ctx.save_for_backward(*inputs)


def _autograd_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.normbook.swiglu_backward(gate, up, dy)


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    r"""``silu(gate) · up``, the gate of a SwiGLU MLP, in one pass (fp32 inside, one
    rounding).

    Args:
        gate, up: tensors of one shape (any leading dimensions), float32, float16 or
            bfloat16 (float64 for gradient checks), one dtype, on the kernels' device;
            rows may be strided (the last dimension contiguous, else copied once).

    Returns a tensor of that shape and dtype. Differentiable in ``gate`` and ``up``
    (one-pass Triton backward, the operator ``normbook::swiglu_backward``).

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(gate, "gate")
    _validate.check_input(up, "up")
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have one shape, got gate "
            f"{tuple(gate.shape)} and up {tuple(up.shape)}"
        )
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have gate's dtype, {gate.dtype}, got {up.dtype}")
    _validate.check_same_device("up", up, "gate", gate)
    return torch.ops.normbook.swiglu(gate, up)


__all__ = ["swiglu"]
