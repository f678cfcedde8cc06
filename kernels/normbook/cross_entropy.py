r"""Cross-entropy of logits against class indices, forward and backward as Triton
kernels.

For a row of logits :math:`x \in \mathbb{R}^V` and a target class :math:`t`,

.. math:: \ell = -\log p_t = \operatorname{lse}(x) - x_t, \qquad
          \operatorname{lse}(x) = m + \log \textstyle\sum_k e^{x_k - m},\quad m = \max_k
          x_k,

and its gradient is :math:`\partial \ell / \partial x = p - e_t` (softmax minus the
one-hot target). Neither needs the probabilities :math:`p` in memory:

- the forward sweeps each row **once** with an online log-sum-exp (a running maximum
  ``m`` and a running sum ``s`` of ``exp(x - m)``; a new maximum ``m'`` rescales ``s``
  by ``exp(m - m')``) and keeps one float per row, ``lse``, for the backward;
- the backward reads each row once more and writes ``dx = g · (exp(x - lse) - e_t)``,
  with ``g`` the upstream gradient of that row's loss (``1/count`` for
  ``reduction="mean"``).

So a vocabulary of 151,936 (Qwen3) costs one read of the logits forward, one read and
one write
backward, and 4 bytes per row in between: never an (M, V) tensor of probabilities.
"""

import numbers

import torch
import triton
import triton.language as tl

from . import _library, _validate
from ._config import (
    LAUNCH,
    LOOP_BLOCK_N,
    MIN_TILE,
    accumulation_dtype,
    tl_accumulation_dtype,
)
from ._runtime import device_guard
from ._triton_utils import round_to

REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _cross_entropy_fwd(
    # pointers: logits, targets, per-row loss and log-sum-exp (ACC)
    X,
    T,
    Loss,
    Lse,
    stride_x,  # distance between rows of logits, in elements
    # rows, vocabulary size, the target value that means "skip"
    M,
    V,
    ignore_index,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # rows * stride passes 2**31 at 151,936 columns and 14,000 rows
    rows = rows.to(tl.int64)
    x_rows = X + rows[:, None] * stride_x
    # One sweep over the row: running max m and running sum s of exp(x - m).
    m = tl.full([BLOCK_M], -float("inf"), dtype=ACC)
    s = tl.zeros([BLOCK_M], dtype=ACC)
    for off in range(0, V, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < V)[None, :]
        # Padding reads as -inf: exp(-inf) = 0 adds nothing and never wins the max.
        x = tl.load(x_rows + cols[None, :], mask=mask, other=-float("inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # While the row is all -inf, shift by 0, not by -inf (exp(-inf + inf) would be
        # NaN).
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = m_new
    # Padding rows take log(1), not log(0); a real row of -inf gets lse = -inf and a NaN
    # loss.
    lse = m + tl.log(tl.where(row_mask, s, 1.0))
    # The target logit: one more load per row, skipped for ignored rows (their target,
    # e.g. -100, is no column at all).
    t = tl.load(T + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    keep = row_mask & (t != ignore_index)
    x_t = tl.load(X + rows * stride_x + t, mask=keep, other=0.0).to(ACC)
    tl.store(Loss + rows, tl.where(keep, lse - x_t, 0.0), mask=row_mask)
    tl.store(Lse + rows, lse, mask=row_mask)


@triton.jit
def _cross_entropy_bwd(
    # pointers: logits, targets, saved lse, per-row upstream grad, dx
    X,
    T,
    Lse,
    G,
    DX,
    # row strides; stride_g = 0 broadcasts one value to every row
    stride_x,
    stride_g,
    stride_dx,
    M,
    V,
    ignore_index,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    t = tl.load(T + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    keep = row_mask & (t != ignore_index)
    lse = tl.load(Lse + rows, mask=row_mask, other=0.0)
    g = tl.load(G + rows * stride_g, mask=keep, other=0.0).to(ACC)
    for off in range(0, V, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < V)[None, :]
        x = tl.load(
            X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(ACC)
        # p recomputed from the saved lse: exp(x - lse) = softmax(x), never stored.
        p = tl.exp(x - lse[:, None])
        onehot = tl.where(cols[None, :] == t[:, None], 1.0, 0.0)
        # An ignored row has gradient 0, even if its logits hold NaN or Inf.
        dx = tl.where(keep[:, None], g[:, None] * (p - onehot), 0.0)
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :],
            round_to(dx, DX.dtype.element_ty),
            mask=mask,
        )


def _config(M: int, V: int):
    """(BLOCK_M, BLOCK_N, num_warps): blocks of at most LOOP_BLOCK_N columns, looped
    over wide rows; several rows per program when a row is short."""
    block_n = min(triton.next_power_of_2(V), LOOP_BLOCK_N)
    block_m = min(max(MIN_TILE // block_n, 1), triton.next_power_of_2(max(M, 1)))
    num_warps = min(max(block_m * block_n // 256, 1), 16)
    return block_m, block_n, num_warps


def _forward(x2d: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """Per-row losses and log-sum-exps, both (M,) in the accumulation dtype."""
    M, V = x2d.shape
    acc = accumulation_dtype(x2d.dtype)
    loss = torch.empty((M,), dtype=acc, device=x2d.device)
    lse = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0:
        return loss, lse
    block_m, block_n, num_warps = _config(M, V)
    with device_guard(x2d):
        _cross_entropy_fwd[(triton.cdiv(M, block_m),)](
            x2d,
            target,
            loss,
            lse,
            x2d.stride(0),
            M,
            V,
            ignore_index,
            ACC=tl_accumulation_dtype(acc),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **LAUNCH,
        )
    return loss, lse


def _backward(
    x2d,
    target,
    lse,
    g: torch.Tensor,
    ignore_index: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx = g_row · (softmax(x) - onehot(t)) for kept rows, 0 for ignored ones; ``g``
    has one element (broadcast to every row) or M. ``out=x2d`` overwrites the logits in
    place (each element is read, then written, by the same program in the same loop
    step), as normbook.linear_cross_entropy does with its blocks of logits."""
    M, V = x2d.shape
    dx = torch.empty((M, V), dtype=x2d.dtype, device=x2d.device) if out is None else out
    if M == 0:
        return dx
    block_m, block_n, num_warps = _config(M, V)
    stride_g = 0 if g.numel() == 1 else g.stride(0)
    with device_guard(x2d):
        _cross_entropy_bwd[(triton.cdiv(M, block_m),)](
            x2d,
            target,
            lse,
            g,
            dx,
            x2d.stride(0),
            stride_g,
            dx.stride(0),
            M,
            V,
            ignore_index,
            ACC=tl_accumulation_dtype(lse.dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **LAUNCH,
        )
    return dx


def _reduce(
    loss: torch.Tensor, count: torch.Tensor, reduction: str, dtype: torch.dtype
):
    """The per-row losses (accumulation dtype) reduced as asked, rounded once to
    ``dtype``."""
    if reduction == "none":
        return loss.to(dtype)
    total = loss.sum()  # a fixed reduction order for a given shape: deterministic
    if reduction == "sum":
        return total.to(dtype)
    # mean over the rows that count; 0/0 = NaN when every row is ignored, as
    # F.cross_entropy.
    return (total / count.to(total.dtype)).to(dtype)


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::cross_entropy", mutates_args=())
def _op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.cross_entropy``: (loss, lse, count), one log-sum-exp per row
    and the number of rows not ignored (what the backward reads). The targets' range is
    checked here, before the launch: it reads their values."""
    check_target_range(target, logits.shape[-1], ignore_index)
    x2d = _validate.as_rows(logits)  # after every check: a bad call copies nothing
    t = target.reshape(-1).contiguous()  # the kernels read target[row] at T + row
    loss, lse = _forward(x2d, t, ignore_index)
    count = (t != ignore_index).sum()
    out_shape = target.shape if reduction == "none" else ()
    return _reduce(loss, count, reduction, logits.dtype).reshape(out_shape), lse, count


@_op.register_fake
def _(logits, target, ignore_index, reduction):
    loss = logits.new_empty(target.shape if reduction == "none" else ())
    lse = logits.new_empty(
        _library.rows(logits), dtype=accumulation_dtype(logits.dtype)
    )
    return loss, lse, target.new_empty((), dtype=torch.int64)


@torch.library.custom_op("normbook::cross_entropy_backward", mutates_args=())
def _op_backward(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    ignore_index: int,
    reduction: str,
) -> torch.Tensor:
    """``torch.ops.normbook.cross_entropy_backward``: the logits' gradient."""
    g = dloss.reshape(-1).to(lse.dtype)
    if reduction == "mean":
        # inf when every row is ignored: then no row uses it
        g = g / count.to(lse.dtype)
    x2d, t = _validate.as_rows(logits), target.reshape(-1).contiguous()
    return _backward(x2d, t, lse, g.contiguous(), ignore_index).view(logits.shape)


@_op_backward.register_fake
def _(dloss, logits, target, lse, count, ignore_index, reduction):
    return _library.fresh(logits)


def _setup_context(ctx, inputs, output):
    # the logits (already in memory), the targets and one log-sum-exp per row
    logits, target, ctx.ignore_index, ctx.reduction = inputs
    _, lse, count = output
    ctx.mark_non_differentiable(lse, count)
    ctx.save_for_backward(logits, target, lse, count)


def _autograd_backward(ctx, dloss, _dlse, _dcount):
    logits, target, lse, count = ctx.saved_tensors
    dx = torch.ops.normbook.cross_entropy_backward(
        dloss, logits, target, lse, count, ctx.ignore_index, ctx.reduction
    )
    return dx, None, None, None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_target(target, logits: torch.Tensor) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"target must be a torch.Tensor of class indices, got "
            f"{type(target).__name__}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices as int64 (or int32), got "
            f"{target.dtype}; "
            "class probabilities are not supported"
        )
    batch_shape = tuple(logits.shape[:-1])
    if tuple(target.shape) != batch_shape:
        raise ValueError(
            f"target must have shape {batch_shape} (logits' shape without "
            "its "
            f"last dimension), got {tuple(target.shape)}"
        )
    if target.device != logits.device:
        raise ValueError(
            f"target is on {target.device} but logits is on "
            f"{logits.device}; "
            "put them on one device"
        )


def check_target_range(target: torch.Tensor, V: int, ignore_index: int) -> None:
    """Every target is a class in [0, V) or ``ignore_index``. One host sync, so that a
    bad index is an error and never an out-of-bounds read (linear_cross_entropy too).
    It reads the targets' values: the operators run it, never on fake tensors."""
    bad = ((target < 0) | (target >= V)) & (target != ignore_index)
    if target.numel() and bool(bad.any()):
        first = target[bad].reshape(-1)[0].item()
        raise ValueError(
            f"target must hold class indices in [0, {V - 1}] or "
            f"ignore_index ({ignore_index}), got {first}"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Cross-entropy of ``logits`` against class indices ``target``, as
    ``F.cross_entropy``.

    ``loss_row = logsumexp(logits_row) - logits_row[target_row]``, computed in float32
    (float64 for float64 logits) with one pass over each row; rows whose target equals
    ``ignore_index`` contribute nothing and get a zero gradient.

    Args:
        logits: (M, V) or (V,) float32, float16 or bfloat16 tensor (float64 for gradient
            checks); rows may be strided (last dimension contiguous, else copied once).
            For (batch, seq, V) logits flatten first: ``logits.view(-1, V)``, as Hugging
            Face does.
        target: int64 (or int32) class indices of shape (M,) (or () for 1-D logits),
            each in [0, V) or equal to ``ignore_index``.
        ignore_index: the target value to skip (default -100, as PyTorch).
        reduction: ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"``
            (shape of ``target``).

    Returns the loss in ``logits``' dtype. As ``F.cross_entropy``: ``"mean"`` is NaN
    (0/0) when every row is ignored, or when there are no rows; ``"sum"`` is then 0.

    Differentiable with respect to ``logits`` (Triton backward, the operator
    ``normbook::cross_entropy_backward``).

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
        Checking the target's range reads it on the host (one synchronisation on a GPU).
    """
    _validate.check_input(logits, "logits")
    if logits.dim() > 2:
        raise ValueError(
            f"logits must be (M, V) or (V,), got {logits.dim()} "
            "dimensions; "
            "flatten the leading ones first: logits.view(-1, V)"
        )
    if logits.shape[-1] == 0:
        raise ValueError(
            "logits must have at least one class (its last dimension is 0)"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(
            f"ignore_index must be an int, got {type(ignore_index).__name__}"
        )
    ignore_index = int(ignore_index)
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check_target(target, logits)
    loss, _, _ = torch.ops.normbook.cross_entropy(
        logits, target, ignore_index, reduction
    )
    return loss
