r"""Sampling the next token from logits, in one Triton kernel: temperature, top-k,
top-p, min-p.

For one row of logits :math:`x` and a temperature :math:`T > 0`, let :math:`z = (x -
\max x)/T` and :math:`p \propto e^{z}`. The filters keep the tokens whose scaled logit
reaches a threshold, applied in Hugging Face's order (temperature, top-k, top-p, min-p):

- top-k: :math:`z_i \ge` the k-th largest :math:`z` (ties with it are kept: possibly
  more than k);
- top-p: of the top-k set, token :math:`i` is kept iff the probability of the tokens
  strictly more likely than it is below ``top_p`` (ties are kept or dropped together),
  with the boundary decided at ``(1 - TOP_P_SLACK) * top_p`` (see :data:`TOP_P_SLACK`);
- min-p: :math:`p_i \ge \text{min\_p}\cdot p_{\max}`, i.e. :math:`z_i \ge \ln
  \text{min\_p}`.

Every filter is "keep :math:`z_i \ge \tau`", so the kept set is one threshold per row.
The kernel finds it without sorting, by a search over the 2**32 fp32 bit patterns,
ordered like the floats (``_order_key``): each pass over the row counts (top-k) or
sums :math:`e^{z}` (top-p) above FANOUT - 1 candidate keys at once and narrows the
interval that holds the threshold FANOUT-fold (SEARCH_BITS bits a pass), so
SEARCH_PASSES passes pin it exactly (:func:`row_reads`). Then it draws with the
Gumbel-max trick (an exponential race): the sample is :math:`\arg\max_i z_i - \log E_i`
over the kept tokens, :math:`E_i \sim \mathrm{Exp}(1)`, which needs neither the
normalizing sum nor a prefix sum.

Rows of :data:`SAMPLE_SPLIT_MIN_N` keys and more (a vocabulary: Qwen3's has 151,936) are
split over programs, one per tile of SAMPLE_TILE keys, so that a decode batch (M = 1 ...
64 rows) occupies more than M of the GPU's SMs: each search pass is a launch whose
programs count or sum their tile, and the next launch merges the tiles' FANOUT-vectors
in tile order, the order of the single program's loop (:mod:`normbook.sampling_split`).
The choice and the tiles depend on N only, never on M, and the sums are the loop's, so
the split path keeps the same threshold and draws the same token, bit for bit.

The order keys, the search and the race's scores, which both paths compute alike, are
in :mod:`normbook._sampling_search`.

Random numbers come from Triton's counter-based Philox (``tl.randint``): element ``(r,
c)`` of the (M, N) row view uses key ``seed`` (two 32-bit halves, low first) and counter
``(r*N + c) mod 2**32, (r*N + c) >> 32, 0, 0``. A draw therefore depends only on the
seed, the row's index in the call and the token's index, not on the launch configuration
or the strides.
"""

import math
import numbers

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH
from ._runtime import INTERPRET, device_guard
from ._sampling_search import (
    _KEY_PAD,
    SAMPLE_TILE,
    SEARCH_PASSES,
    TOP_P_SLACK,
    _key_to_z,
    _order_key,
    _scores,
    _search,
    _tile,
)
from .sampling_split import SAMPLE_SPLIT_MIN_N, _forward_split


def row_reads(top_k: bool = False, top_p: bool = False) -> int:
    """Passes of ``_sample_kernel`` over a row wider than one tile: each search pass,
    the top-p total and the draw read the row once (a row that fits in one tile is read
    once in all). A split row (:data:`SAMPLE_SPLIT_MIN_N`) takes one launch per pass,
    and one more for the argmax merge."""
    return 1 + top_k * SEARCH_PASSES + top_p * (1 + SEARCH_PASSES)


@triton.jit
def _sample_kernel(
    # logits, per-row max, sampled index (int64), threshold key (int32)
    X,
    Rowmax,
    Out,
    Tau,
    stride_x,  # distance between rows, in elements
    M,
    N,
    seed,  # rows, vocabulary size, Philox key
    inv_temp,
    top_k,
    top_p,
    log_min_p,
    GREEDY: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = rows.to(tl.int64)  # rows * stride and rows * N can pass 2**31
    x_rows = X + rows[:, None] * stride_x
    rowmax = tl.load(Rowmax + rows, mask=row_mask, other=0.0).to(tl.float32)
    if SINGLE_BLOCK:
        # The row fits in registers: read it once; every pass below reuses it.
        cols = tl.arange(0, BLOCK_N)
        key_row = _tile(X, x_rows, row_mask, cols, N, rowmax, inv_temp)
    else:
        key_row = rows  # unused: every pass reloads its tiles

    # Threshold as an order key: keep z with key >= tau. Start: keep everything.
    tau = tl.full([BLOCK_M], _KEY_PAD + 1, tl.int32)
    if HAS_TOP_K:
        # Largest t with #{key >= t} >= k: the key of the k-th largest z (ties kept).
        k = tl.full([BLOCK_M], top_k, tl.int32)
        tau = _search(
            X,
            x_rows,
            row_mask,
            N,
            rowmax,
            inv_temp,
            key_row,
            tau,
            k,
            False,
            BLOCK_M,
            BLOCK_N,
            SINGLE_BLOCK,
        )
    if HAS_TOP_P:
        # Mass of the top-k set (unnormalized: e^z <= 1, and the max contributes exactly
        # 1).
        total = tl.zeros([BLOCK_M], tl.float32)
        for off in range(0, N, BLOCK_N):
            if SINGLE_BLOCK:
                key = key_row
            else:
                key = _tile(
                    X,
                    x_rows,
                    row_mask,
                    off + tl.arange(0, BLOCK_N),
                    N,
                    rowmax,
                    inv_temp,
                )
            e = tl.where(key >= tau[:, None], tl.exp(_key_to_z(key)), 0.0)
            total += tl.sum(e, axis=1)
        # Largest t with S(t) = sum_{key >= t} e^z >= top_p' * total (top_p' = top_p
        # less the slack): the tokens at or above it are those whose
        # strictly-more-likely mass is below top_p'.
        tau = _search(
            X,
            x_rows,
            row_mask,
            N,
            rowmax,
            inv_temp,
            key_row,
            tau,
            top_p * total,
            True,
            BLOCK_M,
            BLOCK_N,
            SINGLE_BLOCK,
        )
    if HAS_MIN_P:
        # p_i >= min_p * p_max  <=>  z_i >= log(min_p): a fixed threshold, intersected.
        tau = tl.maximum(tau, _order_key(tl.full([BLOCK_M], log_min_p, tl.float32)))
    tl.store(Tau + rows, tau, mask=row_mask)

    # The draw: argmax over kept tokens of z - log E (greedy: of z), first index on a
    # tie.
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_M], tl.int64)
    for off in range(0, N, BLOCK_N):
        if SINGLE_BLOCK:
            key = key_row
        else:
            cols = off + tl.arange(0, BLOCK_N)
            key = _tile(X, x_rows, row_mask, cols, N, rowmax, inv_temp)
        score = _scores(key, tau, rows, cols, N, seed, GREEDY)
        blk_best = tl.max(score, axis=1)
        blk_idx = tl.argmax(score, axis=1, tie_break_left=True).to(tl.int64) + off
        # Strictly greater: on a tie the earlier block (smaller index) keeps the win.
        better = blk_best > best
        best_idx = tl.where(better, blk_idx, best_idx)
        best = tl.where(better, blk_best, best)
    tl.store(Out + rows, best_idx, mask=row_mask)


def _forward(
    x2d,
    rowmax,
    seed,
    inv_temp,
    top_k,
    top_p,
    log_min_p,
    *,
    greedy,
    block_n=None,
    split=None,
):
    """Launch on an (M, N) view; returns (indices int64 (M,), threshold keys int32
    (M,)). ``split``: None chooses from N (:data:`SAMPLE_SPLIT_MIN_N`); tests force it
    either way (with ``block_n``, at a small N)."""
    M, N = x2d.shape
    out = torch.empty((M,), dtype=torch.int64, device=x2d.device)
    tau = torch.empty((M,), dtype=torch.int32, device=x2d.device)
    if M == 0:
        return out, tau
    # A tile holds an int32 key (and, in the top-p search, an fp32 mass) per element,
    # then the Philox state: at most SAMPLE_TILE elements, so that ptxas reports no
    # spills.
    block_n_cfg = triton.next_power_of_2(N)
    single = block_n_cfg <= SAMPLE_TILE
    # A function of N only, never of M: the tile's shape decides how a GPU splits a
    # row's masses over threads, so a row's bits (and kept set) do not depend on its
    # batch.
    block_m = SAMPLE_TILE // block_n_cfg if single else 1
    block_n_cfg = block_n_cfg if single else SAMPLE_TILE
    # 8 elements per thread: ptxas keeps the keys, masses and Philox state of a
    # 4096-element tile in registers at 16 warps; at 8 warps it capped itself at 128 and
    # spilled (sm_90, fp16/bf16).
    num_warps = SAMPLE_TILE // 256
    if INTERPRET:
        # The interpreter pays per operation, not per element: give it 64K-element
        # tiles. The draws do not depend on the tiling (the Philox counter is the
        # element's index).
        if single:
            block_m = min(triton.next_power_of_2(M), max(65536 // block_n_cfg, 1))
        else:
            block_n_cfg = 65536
    if split is None:
        split = N >= SAMPLE_SPLIT_MIN_N
    if block_n is None:
        block_n = block_n_cfg
    else:  # tests: force the looped path on a small row
        block_m, single = 1, block_n >= N
    if split:
        # One program per tile of the looped path (the same tiles, so the same sums).
        return _forward_split(
            x2d,
            rowmax,
            seed,
            inv_temp,
            top_k,
            top_p,
            log_min_p,
            greedy=greedy,
            block_n=block_n,
            num_warps=num_warps,
        )
    with device_guard(x2d):
        _sample_kernel[(triton.cdiv(M, block_m),)](
            x2d,
            rowmax,
            out,
            tau,
            x2d.stride(0),
            M,
            N,
            seed,
            inv_temp,
            top_k or 0,
            1.0 if top_p is None else top_p * (1.0 - TOP_P_SLACK),
            log_min_p or 0.0,
            GREEDY=greedy,
            HAS_TOP_K=top_k is not None,
            HAS_TOP_P=top_p is not None,
            HAS_MIN_P=log_min_p is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            SINGLE_BLOCK=single,
            num_warps=num_warps,
            **LAUNCH,
        )
    return out, tau


# ---------------------------------------------------------------- arguments


def _real(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_args(temperature, top_k, top_p, min_p, generator):
    temperature = _real(temperature, "temperature")
    if temperature < 0:
        raise ValueError(
            f"temperature must be >= 0 (0 means greedy), got {temperature}"
        )
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None:
        top_p = _real(top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_p is not None:
        min_p = _real(min_p, "min_p")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if generator is not None and not isinstance(generator, torch.Generator):
        if isinstance(generator, bool) or not isinstance(generator, numbers.Integral):
            raise TypeError(
                f"generator must be a torch.Generator, an int seed or None, got "
                f"{type(generator).__name__}"
            )
        if not 0 <= generator < 2**63:
            raise ValueError(
                f"generator as an int seed must be in [0, 2**63), got {generator}"
            )
    return temperature, top_k, top_p, min_p


def philox_seed(generator=None) -> int:
    """The 64-bit Philox key of one call: an int is used as it is; a ``torch.Generator``
    (or torch's global CPU generator, for None) gives one draw of ``torch.randint(0,
    2**63 - 1)``, which advances it: consecutive calls differ, and ``manual_seed``
    replays them."""
    if generator is None or isinstance(generator, torch.Generator):
        device = generator.device if generator is not None else "cpu"
        return int(torch.randint(0, 2**63 - 1, (), generator=generator, device=device))
    return int(generator)


def _check_values(rowmax: torch.Tensor) -> None:
    """One reduction tells all three bad rows apart: NaN propagates through max, +inf is
    the max, and a row of -inf has max -inf. One host synchronization, before any
    launch."""
    bad = ~torch.isfinite(rowmax)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        value = float(rowmax[row])
        if math.isnan(value):
            raise ValueError(f"logits contain NaN (row {row} of the flattened rows)")
        if value > 0:
            raise ValueError(
                f"logits contain +inf (row {row}): a certain token is not "
                "a distribution"
            )
        raise ValueError(f"logits row {row} is all -inf: there is no token to sample")


def sample(
    logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None, generator=None
):
    r"""Draw one token index per row of ``logits`` (last dimension = vocabulary).

    The distribution is softmax(logits / temperature) restricted to the tokens that
    survive top-k, then top-p (renormalized over the top-k set), then min-p, as Hugging
    Face applies them; ties at a threshold are kept together. ``temperature=0`` is
    greedy: the first index of the row's maximum. Sampling uses the Gumbel-max trick
    with Philox random numbers.

    Args:
        logits: float32, float16 or bfloat16 (float64 is accepted and read as fp32)
            tensor of shape ``(..., N)``, on the kernels' device. Rows may be strided.
            No NaN, no +inf, and at least one finite logit per row.
        temperature: >= 0. Below about 3e-39, 1/T is clamped to the largest fp32: the
            draw is then uniform over the row's maxima, the limit T -> 0+.
        top_k: None or an int >= 1 (>= N keeps everything).
        top_p: None or a real in (0, 1] (1 keeps everything).
        min_p: None or a real in [0, 1] (0 keeps everything).
        generator: None (a seed drawn from torch's global CPU generator), a
            ``torch.Generator`` (one seed drawn from it), or an int seed in [0, 2**63).
            See :func:`philox_seed`.

        Each of the five may instead be a ``(B,)`` tensor, one value per row (B rows
        of ``logits``; ``top_k`` and ``generator`` int64, the others floating point):
        vLLM's per-request ``SamplingParams``. Then row b is drawn as a call on that row
        alone with its own values, and its token depends only on its logits, its
        parameters and its seed, never on its place in the batch or on the other rows
        (one launch per row for now).

    Returns:
        int64 tensor of shape ``logits.shape[:-1]``. Indices are not differentiable: the
        output never requires grad, even when ``logits`` does (there is no gradient to
        drop).

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(logits, "logits")
    per_row = _per_row_args(logits, temperature, top_k, top_p, min_p, generator)
    if per_row is not None:
        return _sample_rows(logits, per_row)
    temperature, top_k, top_p, min_p = _check_args(
        temperature, top_k, top_p, min_p, generator
    )
    n = logits.shape[-1]
    out_shape = logits.shape[:-1]
    if math.prod(out_shape) == 0:
        return torch.empty(out_shape, dtype=torch.int64, device=logits.device)
    if n == 0:
        raise ValueError(
            "logits must have at least one entry in its last dimension (the vocabulary)"
        )
    # A torch.Generator cannot cross an operator's schema: its one draw is made here.
    seed = philox_seed(generator) if temperature != 0.0 else 0
    return torch.ops.normbook.sample(
        logits.detach(), temperature, top_k, top_p, min_p, seed
    )


_ROW_ARGS = ("temperature", "top_k", "top_p", "min_p", "generator")


def _per_row_args(logits, *values):
    """None when every argument is a number (one launch for the batch); else one tuple
    of checked numbers per row (B = the rows of ``logits``): a tensor argument has shape
    (B,), top_k and the seeds (``generator``) int64, the others floating point. One host
    read of each tensor."""
    if not any(isinstance(v, torch.Tensor) for v in values):
        return None
    B = math.prod(logits.shape[:-1])
    columns = []
    for name, v in zip(_ROW_ARGS, values):
        if not isinstance(v, torch.Tensor):
            columns.append([v] * B)
            continue
        integral = name in ("top_k", "generator")
        if integral and v.dtype != torch.int64:
            raise TypeError(f"{name} as a tensor must be int64, got {v.dtype}")
        if not integral and not v.is_floating_point():
            raise TypeError(f"{name} as a tensor must be floating point, got {v.dtype}")
        if tuple(v.shape) != (B,):
            raise ValueError(
                f"{name} as a tensor must have shape ({B},), one value per row of "
                f"logits, got {tuple(v.shape)}"
            )
        _validate.check_same_device(name, v, "logits", logits)
        columns.append(v.tolist())
    rows = []
    for b, row in enumerate(zip(*columns)):
        try:
            checked = _check_args(*row)
        except (TypeError, ValueError) as e:
            raise type(e)(f"row {b}: {e}") from None
        rows.append((*checked, row[-1]))
    return rows


def _sample_rows(logits, rows):
    """Row b drawn alone, with its own parameters and seed: a launch per row, so that
    its token depends on nothing else (not on its place in the batch, nor on the other
    rows). A kernel that reads the parameters per row in one launch is not written
    yet."""
    x2d = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty((x2d.shape[0],), dtype=torch.int64, device=logits.device)
    if x2d.shape[0] == 0:
        return out.view(logits.shape[:-1])
    if x2d.shape[1] == 0:
        raise ValueError(
            "logits must have at least one entry in its last dimension (the vocabulary)"
        )
    for b, (temperature, top_k, top_p, min_p, generator) in enumerate(rows):
        seed = philox_seed(generator) if temperature != 0.0 else 0
        out[b] = torch.ops.normbook.sample(
            x2d[b : b + 1], temperature, top_k, top_p, min_p, seed
        )[0]
    return out.view(logits.shape[:-1])


@torch.library.custom_op("normbook::sample", mutates_args=())
def _op(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    seed: int,
) -> torch.Tensor:
    """``torch.ops.normbook.sample``: checked arguments, an int ``seed`` (the Philox
    key). The logits' values are checked here, before the launch: one host read."""
    x2d = _validate.as_rows(logits)
    rowmax = x2d.amax(dim=-1)
    _check_values(rowmax)
    idx, _ = _launch(x2d, rowmax, temperature, top_k, top_p, min_p, seed)
    return idx.view(logits.shape[:-1])


@_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


def _launch(
    x2d, rowmax, temperature, top_k, top_p, min_p, generator, block_n=None, split=None
):
    """Map the validated arguments onto the kernel's: constexpr flags for filters that
    act."""
    n = x2d.shape[1]
    if temperature == 0.0:
        # Greedy: the maximum is kept by every filter, so filters change nothing.
        seed, inv_temp, top_k, top_p, log_min_p = None, 1.0, None, None, None
    else:
        seed = philox_seed(generator)
        inv_temp = min(1.0 / temperature, torch.finfo(torch.float32).max)
        top_k = top_k if top_k is not None and top_k < n else None
        top_p = top_p if top_p is not None and top_p < 1.0 else None
        log_min_p = math.log(min_p) if min_p is not None and min_p > 0.0 else None
        if log_min_p is not None:
            log_min_p = max(log_min_p, float(torch.finfo(torch.float32).min))
    return _forward(
        x2d,
        rowmax,
        0 if seed is None else seed,
        inv_temp,
        top_k,
        top_p,
        log_min_p,
        greedy=seed is None,
        block_n=block_n,
        split=split,
    )
