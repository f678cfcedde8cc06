r"""An fp8 KV cache for :func:`normbook.decode_attention`: the cache and its scales.

vLLM's convention: the cache holds ``x8 = fp8(x / κ)`` and the attention reads
``x = x8 · κ``. The scale maps the largest magnitude onto the format's largest finite
value, ``κ = amax / F`` with ``F = 448`` (e4m3fn) or ``57344`` (e5m2), over the whole
tensor or over each k/v head (dimension 1 of ``(B, H_kv, S, D)`` or of a paged cache's
``(num_blocks, H_kv, block_size, D)``): one channel 20 times the others in one head
then costs that head its resolution, not every head.

Rounding to fp8 is relative: a value in e4m3's normal range ``[2^-6, 448]`` (after the
division by κ) moves by at most ``2^-4`` of itself (3 mantissa bits), in e5m2's by
``2^-3``; below it (``|x| < 2^-6 κ``, e5m2 ``2^-14 κ``) by at most half a subnormal
step, ``2^-10 κ`` (e5m2 ``2^-17 κ``), absolutely. PyTorch's cast rounds to nearest,
ties to even (Triton 3.9's interpreter rounds some values wrongly where the rounding
carries into the exponent, so no kernel casts here: this is PyTorch, a calibration
step).
"""

import torch

from . import _validate
from .attention import DTYPES

#: fmt → (torch dtype, largest finite value)
FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}


def _check(x, fmt, per_head):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _validate.check_device(x, "x")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(
            "x must have 4 dimensions, (B, H_kv, S, D) or (num_blocks, H_kv, "
            f"block_size, D), got shape {tuple(x.shape)}"
        )
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if not isinstance(per_head, bool):
        raise TypeError(f"per_head must be a bool, got {type(per_head).__name__}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise NotImplementedError(
            "normbook.quantize_kv has no backward: x requires grad (a cache needs "
            "none; detach it)"
        )


def quantize_kv(x, *, fmt="e4m3", per_head=True):
    r"""``(x8, scale)``: ``x`` rounded to fp8 after dividing by its scale, for
    :func:`normbook.decode_attention`'s ``k_cache``/``v_cache`` and
    ``k_scale``/``v_scale``.

    Args:
        x: keys or values, float32, float16 or bfloat16, ``(B, H_kv, S, D)`` (a
            contiguous cache) or ``(num_blocks, H_kv, block_size, D)`` (a paged one).
        fmt: ``"e4m3"`` (``torch.float8_e4m3fn``, largest value 448: vLLM's default)
            or ``"e5m2"`` (``torch.float8_e5m2``, 57344: two more octaves, one
            mantissa bit fewer).
        per_head: one scale per k/v head (dimension 1), shape ``(H_kv,)``; False: one
            for the tensor, a 0-d tensor.

    ``scale = amax / F`` in float32 (1 where a head is all zeros), and
    ``x8 = fp8(clamp(x / scale, ±F))``, PyTorch's round to nearest even; ``x8`` is
    contiguous. A non-finite ``x`` gives a non-finite scale, which
    ``decode_attention`` refuses. The slots of a cache past every row's length are
    quantized too, so they must be finite (zeros), or excluded by the caller.
    """
    _check(x, fmt, per_head)
    return torch.ops.normbook.quantize_kv(x, fmt, per_head)


@torch.library.custom_op("normbook::quantize_kv", mutates_args=())
def _op(x: torch.Tensor, fmt: str, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.quantize_kv``: checked arguments (``_check``'s)."""
    dtype, largest = FORMATS[fmt]
    dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
    xf = x.float()
    if x.numel():
        amax = xf.abs().amax(dim=dims)
    else:
        amax = xf.new_zeros((x.shape[1],) if per_head else ())
    scale = torch.where(amax == 0, 1.0, amax / largest)  # NaN, inf stay
    s = scale.reshape(-1, 1, 1) if per_head else scale
    x8 = (xf / s).clamp(-largest, largest).to(dtype).contiguous()
    return x8, scale


@_op.register_fake
def _(x, fmt, per_head):
    dtype, _ = FORMATS[fmt]
    scale = x.new_empty((x.shape[1],) if per_head else (), dtype=torch.float32)
    x8 = x.new_empty(x.shape, dtype=dtype)
    return x8, scale
