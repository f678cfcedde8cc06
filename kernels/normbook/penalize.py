r"""Repetition, presence and frequency penalties on a batch of logits, as servers apply
them before sampling.

Row ``b`` of ``logits`` (vocabulary ``V``) has seen the tokens ``token_ids[b]`` (padded
with -1). Let :math:`c_i` be how many times token :math:`i` occurs there. Then

.. math:: r_i = \begin{cases} x_i \cdot \rho & x_i < 0,\ c_i > 0 \\
                               x_i / \rho & x_i \ge 0,\ c_i > 0 \\
                               x_i & c_i = 0 \end{cases}
          \qquad y_i = r_i - \phi\, c_i - \pi\,[c_i > 0]

with the repetition penalty :math:`\rho > 0` (Keskar et al. 2019, as transformers'
``RepetitionPenaltyLogitsProcessor``: a seen token is made less likely whatever the
sign of its logit, once however often it was seen), then the frequency :math:`\phi` and
presence :math:`\pi` penalties of OpenAI's API and vLLM (subtracted in that order, as
vLLM does). Each may be one number or one per row.

Two kernels. The first counts: one program per (row, tile of ``token_ids``) adds 1 at
each id into an int32 ``(B, V)`` table (atomic adds of integers: exact in any order,
so the counts do not depend on the schedule). The second is elementwise over ``(B,
V)`` tiles: it reads a logit and its count and writes y, in fp32, rounded once to the
logits' dtype. Division is correctly rounded (``div_rn``; a plain fp32 ``/`` lowers to
an approximate one on a GPU), the product by ρ is one rounding, and fp contraction is
off (``LAUNCH``): the repetition penalty alone gives transformers' bits in fp32, and in
fp16/bf16 too, where PyTorch also computes in fp32 and rounds once. With φ or π the two
subtractions round twice in fp32 before the last rounding: within
:math:`2u_{32}(|r| + |\phi c| + |\pi|)` of the exact y, then :math:`u` of the output.
"""

import math
import numbers

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH
from ._runtime import device_guard
from ._triton_utils import round_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_T = 1024  # token ids a counting program reads
BLOCK_V = 1024  # logits an applying program reads and writes


@triton.jit
def _count_kernel(Ids, Counts, stride_ids, T, V, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ids = tl.load(Ids + row * stride_ids + offs, mask=offs < T, other=-1)
    # -1 is padding; every other id was checked to lie in [0, V) before the launch
    tl.atomic_add(Counts + row * V + ids, 1, mask=ids >= 0, sem="relaxed")


@triton.jit
def _apply_kernel(
    X,
    Counts,
    Y,
    Rep,
    Presence,
    Frequency,  # (B,) fp32 each
    stride_x,
    stride_y,
    V,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(Counts + row * V + cols, mask=mask, other=0)
    rho = tl.load(Rep + row)
    seen = c > 0
    # A seen token is made less likely on either side of zero.
    r = tl.where(x < 0, x * rho, tl.math.div_rn(x, tl.zeros_like(x) + rho))
    r = tl.where(seen, r, x)
    y = r - tl.load(Frequency + row) * c.to(tl.float32)
    y = y - tl.where(seen, tl.load(Presence + row), 0.0)
    # round_to: to nearest even (the interpreter's own bf16 cast truncates)
    tl.store(Y + row * stride_y + cols, round_to(y, Y.dtype.element_ty), mask=mask)


def _forward(x2d, ids, rep, presence, frequency):
    """Launch on (B, V) logits and (B, T) ids; the penalties are (B,) fp32."""
    B, V = x2d.shape
    out = torch.empty((B, V), dtype=x2d.dtype, device=x2d.device)
    if B == 0 or V == 0:
        return out
    T = ids.shape[1]
    counts = torch.zeros((B, V), dtype=torch.int32, device=x2d.device)
    with device_guard(x2d):
        if T:
            _count_kernel[(B, triton.cdiv(T, BLOCK_T))](
                ids, counts, ids.stride(0), T, V, BLOCK_T=BLOCK_T, **LAUNCH
            )
        _apply_kernel[(B, triton.cdiv(V, BLOCK_V))](
            x2d,
            counts,
            out,
            rep,
            presence,
            frequency,
            x2d.stride(0),
            out.stride(0),
            V,
            BLOCK_V=BLOCK_V,
            num_warps=4,
            **LAUNCH,
        )
    return out


def _per_row(value, name, B, like, positive):
    """A penalty as a (B,) fp32 tensor: a real number for every row, or a (B,) tensor
    (any float dtype, on the logits' device). Values are checked in the operator."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got {value.dtype}"
            )
        if tuple(value.shape) != (B,):
            raise ValueError(
                f"{name} as a tensor must have shape ({B},), one value per row of "
                f"logits, got {tuple(value.shape)}"
            )
        _validate.check_same_device(name, value, "logits", like)
        return value.float().contiguous()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number or a ({B},) tensor, got "
            f"{type(value).__name__}"
        )
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(
            f"{name} must be {'> 0 and ' if positive else ''}finite, got {value}"
        )
    return torch.full((B,), value, dtype=torch.float32, device=like.device)


def penalize(
    logits,
    token_ids,
    *,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
):
    r"""New logits with the penalties of the tokens each row has seen (see the module).

    Args:
        logits: float32, float16 or bfloat16, ``(B, V)`` (rows may be strided).
        token_ids: int64 ``(B, T)``: the tokens row b has seen (prompt and output),
            padded with -1; every other id in ``[0, V)``. ``T = 0`` is allowed.
        repetition_penalty: ρ > 0 (1 changes nothing; > 1 discourages repeats), a
            real number or a ``(B,)`` float tensor.
        presence_penalty: π, subtracted once from every seen token's logit.
        frequency_penalty: φ, subtracted once per occurrence.

    Returns:
        a new ``(B, V)`` tensor of the logits' dtype. Not differentiable: logits that
        require grad are refused (a sampler needs no gradient).

    Raises:
        TypeError / ValueError naming the argument, before any launch (ids out of
        range, a non-positive or non-finite penalty: one host read of each).
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    _validate.check_device(logits, "logits")
    if logits.dtype not in DTYPES:
        raise TypeError(
            f"logits must be float32, float16 or bfloat16, got {logits.dtype}"
        )
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (B, V), got {tuple(logits.shape)}")
    if torch.is_grad_enabled() and logits.requires_grad:
        raise NotImplementedError(
            "normbook.penalize has no backward: logits require grad (detach them)"
        )
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(
            f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}"
        )
    if token_ids.dtype != torch.int64:
        raise TypeError(f"token_ids must be int64, got {token_ids.dtype}")
    B = logits.shape[0]
    if token_ids.dim() != 2 or token_ids.shape[0] != B:
        raise ValueError(
            f"token_ids must have shape ({B}, T), a row per row of logits, got "
            f"{tuple(token_ids.shape)}"
        )
    _validate.check_same_device("token_ids", token_ids, "logits", logits)
    rep = _per_row(repetition_penalty, "repetition_penalty", B, logits, True)
    presence = _per_row(presence_penalty, "presence_penalty", B, logits, False)
    frequency = _per_row(frequency_penalty, "frequency_penalty", B, logits, False)
    return torch.ops.normbook.penalize(logits, token_ids, rep, presence, frequency)


@torch.library.custom_op("normbook::penalize", mutates_args=())
def _op(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    rep: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """``torch.ops.normbook.penalize``: checked shapes; here the values (one host read
    each), before the launch."""
    V = logits.shape[1]
    if token_ids.numel():
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < -1 or hi >= V:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"token_ids must lie in [0, {V}) (or be -1, padding), got {bad}"
            )
    for name, t, positive in (
        ("repetition_penalty", rep, True),
        ("presence_penalty", presence, False),
        ("frequency_penalty", frequency, False),
    ):
        ok = torch.isfinite(t) & (t > 0) if positive else torch.isfinite(t)
        if not bool(ok.all()):
            raise ValueError(
                f"{name} must be {'> 0 and ' if positive else ''}finite in every row"
            )
    ids = token_ids if token_ids.stride(-1) == 1 else token_ids.contiguous()
    return _forward(_validate.as_rows(logits), ids, rep, presence, frequency)


@_op.register_fake
def _(logits, token_ids, rep, presence, frequency):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
