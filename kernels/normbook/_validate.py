"""Argument checks shared by every kernel wrapper.

Each check runs in Python before any launch and raises a ``TypeError`` or ``ValueError``
that
names the argument and says what was expected: a bad argument must never reach a kernel.
"""

import math
import numbers

import torch

from ._runtime import DEVICE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NAMES = "float32, float16, bfloat16 or float64"


def check_input(x, name: str = "x") -> None:
    """``x`` is a floating-point tensor (float32/float16/bfloat16, or float64 for
    gradient checks) with at least one dimension, on the kernels' device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {_NAMES}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(
            f"{name} must have at least one dimension (the one to "
            "normalize), got a scalar"
        )
    check_device(x, name)


def check_device(t: torch.Tensor, name: str) -> None:
    """``t`` is on the kernels' kind of device (any CUDA device on a GPU machine: a
    tensor on ``cuda:1`` is launched on ``cuda:1``, see ``_runtime.device_guard``; the
    CPU in the interpreter)."""
    if t.device.type != DEVICE.type:
        hint = (
            "move it with .cuda()"
            if DEVICE.type == "cuda"
            else "no GPU is available here; use a CPU tensor"
        )
        raise ValueError(
            f"{name} is on {t.device}, but the kernels run on {DEVICE.type}: {hint}"
        )


def check_same_device(name: str, t, like_name: str, like) -> None:
    """``t`` and ``like`` are on one device, index included (``cuda:0`` and ``cuda:1``
    differ): a kernel reads every pointer on the device it is launched on."""
    if t.device != like.device:
        raise ValueError(
            f"{name} is on {t.device} but {like_name} is on "
            f"{like.device}; put them on one device"
        )


def check_index_vector(t, name: str, n: int, per: str, like_name=None, like=None):
    """An integer tensor of one index per row, ``(n,)`` int32 or int64 (lengths, slots,
    counts); on ``like``'s device when ``like`` is given. ``per`` says what one entry
    is for, in the shape's message."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), {per}, got {tuple(t.shape)}")
    if like is not None:
        check_same_device(name, t, like_name, like)


def check_param(p, name: str, n: int, like: torch.Tensor) -> None:
    """An optional per-feature parameter (weight or bias): None, or a float tensor of
    shape (n,) on x's device."""
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor or None, got {type(p).__name__}"
        )
    if p.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {_NAMES}, got {p.dtype}")
    if tuple(p.shape) != (n,):
        raise ValueError(
            f"{name} must have shape ({n},) to match the last dimension "
            f"of x, got {tuple(p.shape)}"
        )
    check_same_device(name, p, "x", like)


def check_eps(eps) -> float:
    """``eps`` is a finite real number >= 0; returns it as a float."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as a 2-D (rows, N) tensor whose last dimension is contiguous.

    Rows may have any stride (a slice of a wider buffer is used in place); a layout that
    cannot be viewed so (e.g. a transposed tensor) is copied once into a contiguous one.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def check_like(
    t: torch.Tensor, name: str, like: torch.Tensor, like_name: str = "x"
) -> None:
    """A second input that must match ``like`` exactly: same shape, dtype and device
    (e.g. a residual)."""
    check_input(t, name)
    if t.shape != like.shape:
        raise ValueError(
            f"{name} must have the same shape as {like_name}, "
            f"{tuple(like.shape)}, got {tuple(t.shape)}"
        )
    if t.dtype != like.dtype:
        raise TypeError(
            f"{name} must have the same dtype as {like_name}, "
            f"{like.dtype}, got {t.dtype}"
        )
    check_same_device(name, t, like_name, like)


# The layout normbook.qk_norm_rope and its backward read q, k, cos, sin and the upstream
# gradients in.
def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Any strides for the leading dimensions are followed in place; only the head
    # dimension itself must be contiguous (a transposed view is copied once).
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
