r"""Per-row mean and population variance, three ways, as Triton kernels.

.. math:: \mu = \tfrac1n \textstyle\sum_i x_i,
          \qquad \sigma^2 = \tfrac1n \textstyle\sum_i (x_i - \mu)^2

``row_variance(x, method=...)`` computes both statistics of every row with one of three
methods:

- ``"two_pass"``: the definition. First the mean, then the mean of the squared
  deviations. A row that fits in one block is read once and kept in registers; a wider
  row is read twice.
- ``"one_pass"``: the identity :math:`\sigma^2 = \overline{x^2} - \mu^2`, both sums in
  one read. Fast and fragile: when :math:`|\mu| \gg \sigma` the subtraction cancels
  catastrophically.
- ``"welford"``: one read, and as accurate as two passes. Each lane of the tile keeps a
  (mean, M2, count) summary of the elements it has seen (Welford's update, one block of
  the row at a time); the lanes' summaries are then merged pairwise with Chan et al.'s
  formula (:func:`normbook._triton_utils.chan_combine`), the combine step of a block
  reduction.

Arithmetic is fp32 (fp64 for fp64 input). For the book's demonstration,
``acc_dtype=float16`` or ``bfloat16`` *emulates* a kernel that accumulates in that
format: every intermediate result (each sum, product, difference, quotient, each merge's
mean and M2) is rounded to ``acc_dtype`` and carried on in fp32. The row's counts stay
exact integers (held in fp32), as a real kernel's integer counters would.
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, RowConfig, accumulation_dtype, row_config
from ._runtime import device_guard
from ._triton_utils import chan_combine, round_to

METHODS = ("two_pass", "one_pass", "welford")
ACC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TL = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


# ------------------------------------------------------------------ rounding helpers
# ("accumulate in LOW")


@triton.jit
def _rnd(x, LOW: tl.constexpr):
    """Round fp32 ``x`` to ``LOW`` and back: the result a ``LOW`` accumulator would
    hold."""
    if LOW == tl.float16 or LOW == tl.bfloat16:
        return round_to(x, LOW).to(tl.float32)
    else:
        return x


@triton.jit
def _halves(t, BLOCK_M: tl.constexpr, H: tl.constexpr):
    """Split a [BLOCK_M, 2H] tile into two [BLOCK_M, H] tiles; column j pairs with
    column j + H."""
    t = tl.reshape(t, [BLOCK_M, 2, H])
    half = tl.arange(0, 2)[None, :, None]
    # A sum over one real element and one zero is exact: this only selects.
    return tl.sum(tl.where(half == 0, t, 0.0), axis=1), tl.sum(
        tl.where(half == 1, t, 0.0), axis=1
    )


@triton.jit
def _row_sum(
    x,
    LOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG_BLOCK_N: tl.constexpr,
):
    """Sum each row of a [BLOCK_M, BLOCK_N] tile; in LOW, as a pairwise tree with every
    partial sum rounded."""
    if LOW == tl.float16 or LOW == tl.bfloat16:
        # Halve the tile log2(BLOCK_N) times, as a GPU's reduction tree does (lane j +
        # lane j + H).
        for i in tl.static_range(LOG_BLOCK_N):
            a, b = _halves(x, BLOCK_M, BLOCK_N >> (i + 1))
            x = _rnd(a + b, LOW)
        return tl.sum(x, axis=1)
    else:
        return tl.sum(x, axis=1)


@triton.jit
def _row_merge(
    mean,
    m2,
    count,
    LOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG_BLOCK_N: tl.constexpr,
):
    """Merge the lanes' (mean, M2, count) summaries of each row into one, as a pairwise
    tree of Chan merges."""
    for i in tl.static_range(LOG_BLOCK_N):
        mean_a, mean_b = _halves(mean, BLOCK_M, BLOCK_N >> (i + 1))
        m2_a, m2_b = _halves(m2, BLOCK_M, BLOCK_N >> (i + 1))
        n_a, n_b = _halves(count, BLOCK_M, BLOCK_N >> (i + 1))
        mean, m2, count = chan_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b)
        mean = _rnd(mean, LOW)
        m2 = _rnd(m2, LOW)
    # One lane left per row.
    return tl.sum(mean, axis=1), tl.sum(m2, axis=1), tl.sum(count, axis=1)


# ------------------------------------------------------------------ the three kernels


@triton.jit
def _two_pass_kernel(
    X,
    Mean,
    Var,  # pointers: input rows, per-row mean and variance (ACC)
    stride_x,
    M,
    N,  # distance between rows, rows, row length
    # arithmetic dtype; dtype every intermediate is rounded to
    ACC: tl.constexpr,
    LOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG_BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x  # rows * stride can pass 2**31
    if SINGLE_BLOCK:
        # The row fits in registers: read it once, then make both passes over the
        # registers.
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _rnd(tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC), LOW)
        mean = _rnd(_row_sum(x, LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N) / N, LOW)
        # Deviations from the mean are small numbers: squaring them cancels nothing.
        d = tl.where(mask, _rnd(x - mean[:, None], LOW), 0.0)
        var = _rnd(
            _row_sum(_rnd(d * d, LOW), LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N) / N, LOW
        )
    else:
        # Pass 1: per-lane partial sums over the blocks of a wide row, then one
        # reduction.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            acc = _rnd(
                acc
                + _rnd(
                    tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC), LOW
                ),
                LOW,
            )
        mean = _rnd(_row_sum(acc, LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N) / N, LOW)
        # Pass 2: read the row again (mostly from L2 on a GPU) and sum the squared
        # deviations.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = _rnd(tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC), LOW)
            d = tl.where(mask, _rnd(x - mean[:, None], LOW), 0.0)
            acc = _rnd(acc + _rnd(d * d, LOW), LOW)
        var = _rnd(_row_sum(acc, LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N) / N, LOW)
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Var + rows, var, mask=row_mask)


@triton.jit
def _one_pass_kernel(
    X,
    Mean,
    Var,  # pointers: input rows, per-row mean and variance (ACC)
    stride_x,
    M,
    N,  # distance between rows, rows, row length
    # arithmetic dtype; dtype every intermediate is rounded to
    ACC: tl.constexpr,
    LOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG_BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x  # rows * stride can pass 2**31
    # One read: accumulate sum(x) and sum(x*x) side by side, block by block.
    s1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    s2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _rnd(tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC), LOW)
        s1 = _rnd(s1 + x, LOW)
        s2 = _rnd(s2 + _rnd(x * x, LOW), LOW)
    mean = _rnd(_row_sum(s1, LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N) / N, LOW)
    mean_sq = _rnd(_row_sum(s2, LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N) / N, LOW)
    # E[x^2] - E[x]^2: two nearly equal numbers when |mean| >> std; their difference is
    # mostly rounding error.
    var = _rnd(mean_sq - _rnd(mean * mean, LOW), LOW)
    tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Var + rows, var, mask=row_mask)


@triton.jit
def _welford_kernel(
    X,
    Mean,
    Var,  # pointers: input rows, per-row mean and variance (ACC)
    stride_x,
    M,
    N,  # distance between rows, rows, row length
    # arithmetic dtype; dtype every intermediate is rounded to
    ACC: tl.constexpr,
    LOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG_BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x  # rows * stride can pass 2**31
    # Each lane summarizes the elements it sees as (mean, M2, count); empty lanes stay
    # (0, 0, 0).
    mean = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    m2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    count = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for off in range(0, N, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _rnd(tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC), LOW)
        # Welford's update, one element per lane: the deviation is taken from the
        # running mean.
        count = count + mask.to(ACC)
        delta = _rnd(x - mean, LOW)
        mean = tl.where(
            mask, _rnd(mean + _rnd(delta / tl.maximum(count, 1.0), LOW), LOW), mean
        )
        m2 = tl.where(mask, _rnd(m2 + _rnd(delta * _rnd(x - mean, LOW), LOW), LOW), m2)
    # The lanes' summaries merged pairwise (Chan et al.): the combine step of a block
    # reduction.
    mean_row, m2_row, _ = _row_merge(
        mean, m2, count, LOW, BLOCK_M, BLOCK_N, LOG_BLOCK_N
    )
    # the merged count is N for every real row (and 0 for padding rows: no 0/0)
    var = _rnd(m2_row / N, LOW)
    tl.store(Mean + rows, mean_row, mask=row_mask)
    tl.store(Var + rows, var, mask=row_mask)


# ------------------------------------------------------------------ launch
# Elements per program for the one-pass and Welford kernels (see _forward).
STATE_TILE = 2048


def _forward(x2d: torch.Tensor, method: str, acc_dtype: torch.dtype):
    """Launch one kernel on a (M, N) view; returns (mean, var), each of shape (M,), fp32
    (fp64 for fp64 arithmetic)."""
    M, N = x2d.shape
    acc = accumulation_dtype(acc_dtype)
    mean = torch.empty((M,), dtype=acc, device=x2d.device)
    var = torch.empty((M,), dtype=acc, device=x2d.device)
    if M == 0:
        return mean, var
    cfg = row_config(M, N, x2d.element_size())
    if method != "two_pass" and cfg.BLOCK_M * cfg.BLOCK_N > STATE_TILE:
        # One-pass keeps two running sums and Welford three summaries per element of the
        # tile: larger tiles spill registers (ptxas, sm_75/80/90). Both loop over blocks
        # of the row.
        block_n = min(cfg.BLOCK_N, STATE_TILE)
        block_m = (
            max(STATE_TILE // block_n, 1)
            if cfg.SINGLE_BLOCK and block_n == cfg.BLOCK_N
            else 1
        )
        cfg = RowConfig(
            block_m,
            block_n,
            cfg.SINGLE_BLOCK and block_n == cfg.BLOCK_N,
            min(max(block_m * block_n // 256, 1), 8),
        )
    grid = (triton.cdiv(M, cfg.BLOCK_M),)
    args = (x2d, mean, var, x2d.stride(0), M, N)
    consts = dict(
        ACC=_TL[acc],
        LOW=_TL[acc_dtype],
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        LOG_BLOCK_N=cfg.BLOCK_N.bit_length() - 1,
        num_warps=cfg.num_warps,
        **LAUNCH,
    )
    with device_guard(x2d):
        if method == "two_pass":
            _two_pass_kernel[grid](*args, SINGLE_BLOCK=cfg.SINGLE_BLOCK, **consts)
        elif method == "one_pass":
            _one_pass_kernel[grid](*args, SINGLE_BLOCK=cfg.SINGLE_BLOCK, **consts)
        else:
            _welford_kernel[grid](*args, **consts)
    return mean, var


def _check_method(method) -> str:
    if not isinstance(method, str):
        raise TypeError(
            f"method must be a string, one of {', '.join(METHODS)}; got "
            f"{type(method).__name__}"
        )
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def _check_acc_dtype(acc_dtype, x: torch.Tensor) -> torch.dtype:
    if acc_dtype is None:
        return accumulation_dtype(x.dtype)
    if not isinstance(acc_dtype, torch.dtype):
        raise TypeError(
            f"acc_dtype must be a torch.dtype or None, got {type(acc_dtype).__name__}"
        )
    if acc_dtype not in ACC_DTYPES:
        raise ValueError(
            f"acc_dtype must be float16, bfloat16, float32 or float64, got {acc_dtype}"
        )
    if x.dtype == torch.float64 and acc_dtype != torch.float64:
        raise ValueError(
            f"acc_dtype {acc_dtype} is narrower than x's float64; use float64 (or None)"
        )
    return acc_dtype


def row_variance(
    x: torch.Tensor, method: str = "welford", acc_dtype: torch.dtype | None = None
):
    r"""Mean and population variance of every row (last dimension) of ``x``.

    ``var = (1/n) Σ (x_i − mean)²`` — the population variance that LayerNorm uses
    (``torch.var`` with ``correction=0``), not the sample variance with ``n − 1``.

    Args:
        x: float32, float16, bfloat16 (or float64) tensor of shape ``(..., n)``. Rows
            may be strided (last dimension contiguous); other layouts are copied once.
        method: ``"two_pass"`` (the definition), ``"one_pass"`` (``E[x²] − E[x]²``,
            fragile) or ``"welford"`` (Welford's update per lane, Chan's merge across
            lanes; the default).
        acc_dtype: ``None`` for fp32 arithmetic (fp64 for fp64 input), or
            ``torch.float16`` / ``torch.bfloat16`` to *emulate* accumulating in that
            format (every intermediate result rounded to it), or ``torch.float32`` /
            ``torch.float64``.

    Returns:
        ``(mean, var)``, each of shape ``x.shape[:-1]``, float32 (float64 for float64
        arithmetic). With a low ``acc_dtype`` the values are exactly representable in
        it. An empty row (n = 0) gives NaN for both.

    Not differentiable, on purpose: a ``ValueError`` is raised when ``x`` requires grad
    (with grad mode on), rather than returning statistics cut off from the graph. The
    function shows how the statistics are accumulated (and how an emulated low-precision
    accumulator fails); the gradient of an emulated rounding is not a quantity anyone
    should train with, and the layers that need these statistics differentiate through
    them in their own backward (:func:`normbook.layer_norm`). Pass ``x.detach()``, or
    use ``torch.var_mean`` to differentiate.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(x, "x")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            "x requires grad, but row_variance is not differentiable (it "
            "demonstrates "
            "accumulation methods); pass x.detach(), or use "
            "torch.var_mean(x, dim=-1, "
            "correction=0) to differentiate the statistics"
        )
    method = _check_method(method)
    acc_dtype = _check_acc_dtype(acc_dtype, x)
    return torch.ops.normbook.row_variance(x, method, acc_dtype)


# ---------------------------------------------------------------- the operator


@torch.library.custom_op("normbook::row_variance", mutates_args=())
def _op(
    x: torch.Tensor, method: str, acc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.row_variance``: (mean, var) of checked inputs. No autograd:
    the public function refuses an ``x`` that requires grad."""
    lead = x.shape[:-1]
    # no kernel to launch: empty rows, or rows with no elements (mean 0/0 = NaN)
    if x.numel() == 0:
        acc = accumulation_dtype(acc_dtype)
        # two tensors
        return tuple(
            torch.full(lead, float("nan"), dtype=acc, device=x.device) for _ in range(2)
        )
    mean, var = _forward(_validate.as_rows(x), method, acc_dtype)
    return mean.view(lead), var.view(lead)


@_op.register_fake
def _(x, method, acc_dtype):
    acc = accumulation_dtype(acc_dtype)
    return x.new_empty(x.shape[:-1], dtype=acc), x.new_empty(x.shape[:-1], dtype=acc)
