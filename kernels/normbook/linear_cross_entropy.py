r"""Cross-entropy of a linear layer's output, without the (M, V) logits ever in memory.

``linear_cross_entropy(h, W, t)`` is ``F.cross_entropy(F.linear(h, W), t)``: the loss
of a language model's head. With M = 8,192 tokens and Qwen3's V = 151,936 words the
logits take 2.49 GB in bf16, their gradient as much again; both are temporaries of one
scalar loss.

The design: **chunks, cuBLAS for the products, this package's cross-entropy kernels
between them** (Liger-Kernel's fused linear cross-entropy chunks the rows too, but
computes dh and dW inside the forward, three products and no recompute, with dW
accumulated across the chunks; Cut Cross-Entropy fuses vocabulary tiles into its own
matmul kernels and adds dh and dW under locks):

- *forward*, over chunks of rows: ``z = h_chunk @ Wᵀ`` (cuBLAS, rounded to h's dtype as
  ``F.linear`` rounds it), then ``normbook.cross_entropy``'s forward kernel gives each
  row's loss and log-sum-exp ``lse`` (fp32). The chunk is dropped; ``lse`` (4 bytes a
  row) is kept.
- *backward*, over blocks of the vocabulary, all rows at once: ``z_b = h @ W_bᵀ``
  recomputed, the cross-entropy backward kernel overwrites it **in place** with ``g ·
  (exp(z_b - lse) - onehot(t))``, then ``dW_b = dz_bᵀ @ h`` (one product over all M
  rows: fp32 accumulation inside cuBLAS, one rounding, written straight into dW) and
  ``dh += dz_b @ W_b`` (into an fp32 accumulator).

What it costs: the logits are computed twice (once forward, once backward): 8·M·V·d
FLOPs for forward and backward instead of 6·M·V·d, a third more matmul work, in exchange
for no (M, V) tensor and no backward precomputed in the forward (which would hold dW in
fp32). What it reuses: the two cross-entropy kernels, tested elsewhere, and cuBLAS's
matmuls, which a hand-written tile loop would have to match first.

Chunk rule: ``CHUNKS = 8`` pieces each way, so a logits chunk is about 1/8 of the logits
(rounded up: ceil(M/8) rows, or a vocabulary block aligned to VOCAB_ALIGN words). Peak
extra memory: the forward's chunk, M·V/8 elements; the backward's block, M·V/8 elements,
plus the fp32 dh accumulator and one (M, d) product, M·d·(4 + e) bytes (e: bytes per
element). That is at most 1/4 of the logits' M·V·e bytes whenever V ≥ 8·d·(4 + e)/e
(bf16: V ≥ 24·d; Qwen3-8B: V = 151,936 ≈ 37·d).
"""

import numbers

import torch
import triton

from . import _library, _validate
from ._config import accumulation_dtype
from .cross_entropy import REDUCTIONS, _reduce, check_target_range
from .cross_entropy import _backward as _ce_backward
from .cross_entropy import _forward as _ce_forward

# Rows per forward chunk: ceil(M / CHUNKS); words per backward block: ceil(V / CHUNKS).
CHUNKS = 8
VOCAB_ALIGN = 16  # a block's width is a multiple of 16: rows start 64-byte aligned


def chunk_rows(M: int) -> int:
    """Rows of the forward's logits chunk (chunk, V)."""
    return max(1, triton.cdiv(M, CHUNKS))


def block_words(V: int) -> int:
    """Words of the backward's vocabulary block (M, block)."""
    return max(1, triton.cdiv(triton.cdiv(V, CHUNKS), VOCAB_ALIGN) * VOCAB_ALIGN)


def _forward(h2d, weight, target, ignore_index):
    """Per-row losses and log-sum-exps (M,), accumulation dtype; one logits chunk at a
    time."""
    M = h2d.shape[0]
    acc = accumulation_dtype(h2d.dtype)
    loss = torch.empty((M,), dtype=acc, device=h2d.device)
    lse = torch.empty((M,), dtype=acc, device=h2d.device)
    step = chunk_rows(M)
    for r0 in range(0, M, step):
        z = h2d[r0 : r0 + step] @ weight.t()  # (chunk, V), rounded as F.linear rounds
        loss[r0 : r0 + step], lse[r0 : r0 + step] = _ce_forward(
            z, target[r0 : r0 + step], ignore_index
        )
        del z
    return loss, lse


def _dlogits_in_place(z, block_target, lse, g, ignore):
    """Overwrite the block of logits z (M, block) with g_row·(exp(z - lse) - onehot):
    cross_entropy's backward kernel, in place."""
    _ce_backward(z, block_target, lse, g, ignore, out=z)


def _backward(h2d, weight, target, lse, g, ignore_index, want_h, want_w):
    """(dh, dW) for per-row upstream gradients g (one element: broadcast), one
    vocabulary block at a time."""
    M, d = h2d.shape
    V = weight.shape[0]
    dh = torch.zeros((M, d), dtype=lse.dtype, device=h2d.device) if want_h else None
    dw = None
    if want_w:
        dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    # The kernel compares a block's targets with its columns 0 … block-1; targets of
    # other blocks fall outside, ignored rows get a value no shifted target can take
    # (< -V).
    ignored = target == ignore_index
    sentinel = -V - 1
    step = block_words(V)
    for v0 in range(0, V, step):
        w_b = weight[v0 : v0 + step]
        z = h2d @ w_b.t()  # (M, block), the same rounding as the forward's chunks
        if M:
            block_target = torch.where(ignored, sentinel, target - v0)
            _dlogits_in_place(z, block_target, lse, g, sentinel)
        if want_w:
            torch.mm(z.t(), h2d, out=dw[v0 : v0 + step])
        if want_h:
            dh += z @ w_b  # in place, converted element by element: no fp32 copy
        del z
    return (dh.to(h2d.dtype) if want_h else None), dw


# ---------------------------------------------------------------- the operators


@torch.library.custom_op("normbook::linear_cross_entropy", mutates_args=())
def _op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    loss_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.linear_cross_entropy``: (loss, lse, count), one log-sum-exp
    per row and the number of rows not ignored (what the backward reads). The targets'
    range is checked here, before any product: it reads their values."""
    check_target_range(target, weight.shape[0], ignore_index)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1).contiguous().to(torch.int64)
    loss, lse = _forward(h2d, weight, t, ignore_index)
    count = (t != ignore_index).sum()
    out_shape = target.shape if reduction == "none" else ()
    return _reduce(loss, count, reduction, loss_dtype).reshape(out_shape), lse, count


@_op.register_fake
def _(hidden, weight, target, ignore_index, reduction, loss_dtype):
    out_shape = target.shape if reduction == "none" else ()
    loss = hidden.new_empty(out_shape, dtype=loss_dtype)
    lse = hidden.new_empty(
        _library.rows(hidden), dtype=accumulation_dtype(hidden.dtype)
    )
    return loss, lse, target.new_empty((), dtype=torch.int64)


@torch.library.custom_op("normbook::linear_cross_entropy_backward", mutates_args=())
def _op_backward(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    ignore_index: int,
    reduction: str,
    want_h: bool,
    want_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.linear_cross_entropy_backward``: (dh, dW), each
    :func:`~normbook._library.not_computed` unless wanted."""
    g = dloss.reshape(-1).to(lse.dtype)
    if reduction == "mean":
        # inf when every row is ignored: then no row uses it
        g = g / count.to(lse.dtype)
    h2d = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1).contiguous().to(torch.int64)
    dh, dw = _backward(
        h2d, weight, t, lse, g.contiguous(), ignore_index, want_h, want_w
    )
    return (
        dh.view(hidden.shape) if want_h else _library.not_computed(hidden),
        dw if want_w else _library.not_computed(hidden),
    )


@_op_backward.register_fake
def _(
    dloss, hidden, weight, target, lse, count, ignore_index, reduction, want_h, want_w
):
    return (
        _library.fresh(hidden) if want_h else _library.not_computed(hidden),
        _library.fresh(weight) if want_w else _library.not_computed(hidden),
    )


def _setup_context(ctx, inputs, output):
    # h, W, the targets and one log-sum-exp per row: the backward recomputes the logits
    # block by block
    hidden, weight, target, ctx.ignore_index, ctx.reduction, _ = inputs
    _, lse, count = output
    ctx.mark_non_differentiable(lse, count)
    ctx.save_for_backward(hidden, weight, target, lse, count)


def _autograd_backward(ctx, dloss, _dlse, _dcount):
    hidden, weight, target, lse, count = ctx.saved_tensors
    want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dh, dw = torch.ops.normbook.linear_cross_entropy_backward(
        dloss,
        hidden,
        weight,
        target,
        lse,
        count,
        ctx.ignore_index,
        ctx.reduction,
        want_h,
        want_w,
    )
    return dh if want_h else None, dw if want_w else None, None, None, None, None


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check(hidden, weight, target, ignore_index, reduction):
    _validate.check_input(hidden, "hidden")
    if hidden.dim() > 2:
        raise ValueError(
            f"hidden must be (M, d) or (d,), got {hidden.dim()} "
            "dimensions; "
            "flatten the leading ones first: hidden.view(-1, d)"
        )
    _validate.check_input(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(
            f"weight must be (V, d), as nn.Linear(d, V).weight, got shape "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have hidden's last dimension d = "
            f"{hidden.shape[-1]} as "
            f"its second, got weight {tuple(weight.shape)} for hidden "
            f"{tuple(hidden.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (one class); it has 0")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight must have hidden's dtype, {hidden.dtype}, got {weight.dtype}"
        )
    _validate.check_same_device("weight", weight, "hidden", hidden)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(
            f"ignore_index must be an int, got {type(ignore_index).__name__}"
        )
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(
            f"target must be a torch.Tensor of class indices, got "
            f"{type(target).__name__}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target must hold class indices as int64 (or int32), got {target.dtype}"
        )
    rows = tuple(hidden.shape[:-1])
    if tuple(target.shape) != rows:
        raise ValueError(
            f"target must have shape {rows} (hidden's shape without its "
            "last "
            f"dimension), got {tuple(target.shape)}"
        )
    _validate.check_same_device("target", target, "hidden", hidden)


def _linear_cross_entropy(hidden, weight, target, ignore_index, reduction, loss_dtype):
    """The checked call; ``loss_dtype`` is where the reduced loss is rounded
    (normbook.hf asks for fp32, as transformers upcasts the logits before its loss)."""
    _check(hidden, weight, target, ignore_index, reduction)
    loss, _, _ = torch.ops.normbook.linear_cross_entropy(
        hidden, weight, target, int(ignore_index), reduction, loss_dtype
    )
    return loss


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""``F.cross_entropy(F.linear(hidden, weight), target, ...)`` without the logits in
    memory.

    Args:
        hidden: (M, d) or (d,) float32, float16 or bfloat16 (float64 for gradient
            checks).
        weight: (V, d), hidden's dtype and device (an ``nn.Linear(d, V, bias=False)``
            weight, e.g. a language model's ``lm_head``).
        target: int64 (or int32) class indices of shape (M,) (or () for 1-D hidden),
            each in [0, V) or equal to ``ignore_index``.
        ignore_index: the target value to skip (default -100, as PyTorch).
        reduction: ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"``.

    Returns the loss in hidden's dtype, computed in fp32 from logits rounded to hidden's
    dtype (what ``F.linear`` gives). As ``F.cross_entropy``: ``"mean"`` over no counted
    row is NaN and its gradients are 0. Differentiable in ``hidden`` and ``weight``;
    no intermediate holds more than about 1/8 of the (M, V) logits, rounded up to whole
    rows and aligned vocabulary blocks (see the module's docstring for the chunk rule).
    Deterministic: a fixed order of products and sums for a given shape.

    Raises:
        TypeError / ValueError naming the bad argument, before any product or launch.
    """
    loss_dtype = hidden.dtype if isinstance(hidden, torch.Tensor) else None
    return _linear_cross_entropy(
        hidden, weight, target, ignore_index, reduction, loss_dtype
    )


def largest_intermediate(fn, *args, **kwargs):
    """(result, nbytes): ``fn(*args, **kwargs)`` and the size in bytes of the largest
    storage any PyTorch op *allocated* while it ran (forward and, if ``fn`` runs it,
    backward), recorded by a ``TorchDispatchMode``. An output that shares a storage with
    an input (a view, an in-place op, the interpreter's byte views of a kernel's
    arguments) allocates nothing and is not counted. Triton kernels write into tensors
    allocated through PyTorch, so their buffers are seen too, inside this package's
    operators as well."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def storages(tree):
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                yield leaf.untyped_storage()
            elif isinstance(leaf, torch.UntypedStorage):
                yield leaf

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            seen = {s.data_ptr() for s in storages((args, kwargs))}
            if func.namespace == "normbook":
                # One of this package's operators (torch.ops.normbook) is one call to
                # the mode: run its kernel for the device (CPU or CUDA) with the mode
                # pushed again, so that what it allocates inside is seen too.
                device = next(storages(args)).device.type
                key = getattr(torch._C.DispatchKey, device.upper())
                with Largest():
                    out = func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
            else:
                out = func(*args, **kwargs)
            for s in storages(out):
                if s.data_ptr() not in seen:
                    Largest.nbytes = max(Largest.nbytes, s.nbytes())
            return out

    with Largest():
        result = fn(*args, **kwargs)
    return result, Largest.nbytes
