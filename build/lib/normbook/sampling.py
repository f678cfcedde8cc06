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
ordered like the floats (:func:`_order_key`): each pass over the row counts (top-k) or
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
in tile order, the order of the single program's loop (:func:`_sample_split_kernel`).
The choice and the tiles depend on N only, never on M, and the sums are the loop's, so
the split path keeps the same threshold and draws the same token, bit for bit.

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

# The order key of -inf (see _order_key): the smallest key any logit can have.
KEY_NEG_INF = -2139095041
# Padding lanes get a key below every logit's, so that no candidate threshold counts
# them.
KEY_PAD = -(2**31)
# The search starts on [KEY_LO, 1): 2**31 keys, holding every key of z in [-inf, 0].
KEY_LO = -(2**31) + 1
# Bits of the threshold pinned per pass: FANOUT - 1 candidates are tested at once.
SEARCH_BITS = 4
FANOUT = 2**SEARCH_BITS
# Passes that shrink the 2**31-key interval to one key: ceil(31 / SEARCH_BITS).
SEARCH_PASSES = -(-31 // SEARCH_BITS)
# Top-p decides "the mass above reaches top_p" at (1 - TOP_P_SLACK) * top_p.
# Probabilities given as logits (log 0.3, log 0.5, ...) whose mass is meant to be
# exactly top_p come out a few ulp either side of it after rounding; the slack, far
# above the kernel's summation and exp errors (a few times 1e-7 relative,
# test_sampling.py), decides such rows one way, as an exact calculation (and Hugging
# Face's TopPLogitsWarper) does: the mass reached top_p.
TOP_P_SLACK = 2.0**-16
# The largest fp32 below 1: V is clamped to it so that E = -log(1 - V) stays finite.
ONE_MINUS_ULP = 1.0 - 2.0**-24
# Elements per program's tile on a GPU (see _forward).
SAMPLE_TILE = 4096
# The same, as the constexprs a kernel may read.
_KEY_PAD = tl.constexpr(KEY_PAD)
_KEY_LO = tl.constexpr(KEY_LO)
_SEARCH_BITS = tl.constexpr(SEARCH_BITS)
_FANOUT = tl.constexpr(FANOUT)
_SEARCH_PASSES = tl.constexpr(SEARCH_PASSES)
_ONE_MINUS_ULP = tl.constexpr(ONE_MINUS_ULP)


def row_reads(top_k: bool = False, top_p: bool = False) -> int:
    """Passes of ``_sample_kernel`` over a row wider than one tile: each search pass,
    the top-p total and the draw read the row once (a row that fits in one tile is read
    once in all). A split row (:data:`SAMPLE_SPLIT_MIN_N`) takes one launch per pass,
    and one more for the argmax merge."""
    return 1 + top_k * SEARCH_PASSES + top_p * (1 + SEARCH_PASSES)


@triton.jit
def _order_key(z):
    """An int32 that orders like the fp32 ``z``: the bits of a non-negative float
    already order like it; a negative float's low 31 bits are flipped. (-0.0 would sort
    below +0.0, so callers map it to +0.0 first.)"""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _scaled_logits(X, x_rows, row_mask, cols, N, rowmax, inv_temp):
    """z = (x - max x) / T in fp32 for one tile; -inf on padding, so it is never counted
    or drawn."""
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    # Shift first: z <= 0 can never overflow, however small T is.
    z = (x - rowmax[:, None]) * inv_temp
    # -0.0 (an underflowed product) becomes +0.0, so that key order and float order
    # agree.
    z = tl.where(z == 0.0, 0.0, z)
    return tl.where(mask, z, float("-inf")), mask


@triton.jit
def _tile(X, x_rows, row_mask, cols, N, rowmax, inv_temp):
    """The order keys of one tile's z (KEY_PAD on padding: below every candidate). The
    key is all a pass keeps per element: z comes back from it exactly
    (:func:`_key_to_z`)."""
    z, mask = _scaled_logits(X, x_rows, row_mask, cols, N, rowmax, inv_temp)
    return tl.where(mask, _order_key(z), _KEY_PAD)


@triton.jit
def _key_to_z(key):
    """The inverse of :func:`_order_key` (NaN for KEY_PAD, which no filter keeps)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _search(
    X,
    x_rows,
    row_mask,
    N,
    rowmax,
    inv_temp,
    key_row,
    floor,
    target,
    MASS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    """Largest key t with F(t) >= target, where F(t) = #{key >= t} (MASS False) or the
    sum of e^z over key >= max(t, floor) (MASS True); F(KEY_LO) >= target is the
    caller's.

    Invariant: the answer is in [lo, lo + 2**w), F(lo) passes, F(lo + 2**w) fails (w =
    31 at the start). A pass tests the FANOUT - 1 keys lo + j * 2**(w - SEARCH_BITS) and
    keeps the largest that passes: F is monotone (counts exactly; masses because every
    F(t) is summed by the same tiles and tree of non-negative terms, and rounding is
    monotone), so the passing candidates are a prefix. key_row: the row's keys
    (SINGLE_BLOCK only)."""
    fan = tl.arange(0, _FANOUT)
    lo = tl.full([BLOCK_M], _KEY_LO, tl.int32)
    for p in range(_SEARCH_PASSES):
        # The last pass may have fewer than FANOUT keys left: step 1 then tests them
        # all.
        step = tl.full([], 1, tl.int32) << tl.maximum(31 - _SEARCH_BITS * (p + 1), 0)
        if MASS:
            acc = tl.zeros([BLOCK_M, _FANOUT], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, _FANOUT], tl.int32)
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
            if MASS:
                e = tl.where(key >= floor[:, None], tl.exp(_key_to_z(key)), 0.0)
            for j in tl.static_range(1, _FANOUT):
                t = lo + j * step
                if MASS:
                    part = tl.sum(tl.where(key >= t[:, None], e, 0.0), axis=1)
                else:
                    part = tl.sum((key >= t[:, None]).to(tl.int32), axis=1)
                acc = tl.where(fan[None, :] == j, acc + part[:, None], acc)
        cand = lo[:, None] + fan[None, :] * step
        ok = (acc >= target[:, None]) | (fan[None, :] == 0)  # F(lo) passes (invariant)
        lo = tl.max(tl.where(ok, cand, _KEY_PAD), axis=1)
    return lo


@triton.jit
def _exponential(V):
    """E = -log(1 - V) ~ Exp(1) for V uniform in (0, 1), accurate where it matters: the
    smallest E win the race, and for small V the series V + V²/2 + ... keeps full
    relative precision (1 - V would round V's low bits away). Truncation after V⁶/6 errs
    by < V⁶/7 relatively."""
    series = V * (
        1.0 + V * (0.5 + V * (1.0 / 3.0 + V * (0.25 + V * (0.2 + V * (1.0 / 6.0)))))
    )
    return tl.where(V < 0.0625, series, -tl.log(1.0 - V))


@triton.jit
def _scores(key, tau, rows, cols, N, seed, GREEDY: tl.constexpr):
    """The race's score of each token of a tile: z - log E where kept (greedy: z),
    -inf elsewhere (padding's key is below every tau)."""
    keep = key >= tau[:, None]
    z = _key_to_z(key)
    if GREEDY:
        score = z
    else:
        # Philox counter = the element's index in the (M, N) view: independent of
        # tiling.
        r = tl.randint(seed, rows[:, None] * N + cols[None, :]).to(
            tl.uint32, bitcast=True
        )
        # V in (0, 1) with 2**-32 steps near 0, where the winners' E live. (r + 0.5) has
        # 33 significant bits: the fp32 V is exact only for r < 2**23 (V < 2**-9);
        # above, the conversion rounds r to 24 bits (steps of up to 2**-24 near 1), and
        # r >= 2**32 - 128 rounds V up to 1, clamped to keep E finite.
        V = tl.minimum(
            (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10, _ONE_MINUS_ULP
        )
        score = z - tl.log(_exponential(V))
    return tl.where(keep, score, float("-inf"))


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


# ---------------------------------------------------------------- split rows
#
# At decode (M = 1 ... 64 rows) _sample_kernel runs M programs on a GPU of 132 SMs, each
# reading its row up to 2 * SEARCH_PASSES + 2 times (row_reads). The split path gives
# each tile of a row its own program, launch after launch: every launch first merges
# what the previous one left (the FANOUT counts or masses of each tile, added in tile
# order, as the loop above adds them) into the row's search state, then computes its
# tile's share of the next step. Same tiles, same sums in the same order: the same
# threshold and the same draw as the single program's loop, bit for bit
# (tests/kernels/test_sampling.py).

# What a launch merges (MERGE) and produces (PRODUCE): the FANOUT counts or masses of
# one search pass, the top-p total, or (PRODUCE only) the draw's best score per tile.
NOTHING, COUNTS, TOTAL, MASSES, DRAW = range(5)
# The same, as the constexprs a kernel may read.
_COUNTS, _TOTAL, _MASSES, _DRAW = (
    tl.constexpr(v) for v in (COUNTS, TOTAL, MASSES, DRAW)
)
# Rows at least this wide are split (a function of N only, never of M). Below, the
# extra launches (2 to 19 instead of 1) should cost more than the single program's
# sweeps: we expect a launch to cost a few microseconds, and a 4096-element tile a pass
# about one microsecond of one SM (15 compare-and-sum candidates an element). Not
# measured: no GPU was at hand.
SAMPLE_SPLIT_MIN_N = 8 * SAMPLE_TILE


# A launch's programs merge the tiles' partials MERGE_GROUP at a time: the group's
# loads issue together, and the tile count is an argument, not a constexpr. Unrolled
# over every tile (as it was), a row of 64 tiles took 2.0 s to compile per variant,
# most of it in Triton's GPU-IR passes over the 64 loads (measured on a CPU, triton
# 3.9), against 0.5 s at 8 tiles, and every vocabulary size compiled variants of its
# own. We expect the cost on a GPU to be one L2 round trip per group (3 for Qwen3's 38
# tiles, instead of 1), not measured: no GPU was at hand.
MERGE_GROUP = 16
_MERGE_GROUP = tl.constexpr(MERGE_GROUP)


@triton.jit
def _merged(Part, rows, fan, n_chunks, DT: tl.constexpr):
    """Sum of a row's n_chunks partial vectors (FANOUT each), in tile order: the order
    in which _search's loop adds its tiles. Past the last tile the loads give 0, and
    x + 0 is x (the partials are counts, and masses >= 0): the same sum, bit for bit."""
    acc = tl.zeros([1, _FANOUT], DT)
    row_part = Part + rows[:, None] * n_chunks * _FANOUT + fan[None, :]
    for g in range(0, n_chunks, _MERGE_GROUP):
        for u in tl.static_range(_MERGE_GROUP):
            c = g + u
            inside = tl.full([1, _FANOUT], c, tl.int32) < n_chunks
            acc = acc + tl.load(row_part + c * _FANOUT, mask=inside, other=0)
    return acc


@triton.jit
def _sample_split_kernel(
    X,
    Rowmax,
    PartIn,
    PartOut,  # (M, n_chunks, FANOUT) int32 counts or fp32 masses
    LoIn,
    LoOut,
    TauIn,
    TauOut,
    TargetIn,
    TargetOut,  # each row's state, (M,)
    Best,
    BestIdx,  # (M, n_chunks): each tile's best score and index
    # (the buffers are flat: only X is a row of the call's)
    stride_x,
    M,
    N,
    seed,
    inv_temp,
    top_k,
    top_p,
    log_min_p,
    n_chunks,  # tiles per row
    merge_pass,
    produce_pass,  # the search passes merged and produced
    MERGE: tl.constexpr,
    PRODUCE: tl.constexpr,
    GREEDY: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) + tl.arange(0, 1)
    chunk = tl.program_id(1)
    row_mask = rows < M
    rows = rows.to(tl.int64)
    fan = tl.arange(0, _FANOUT)
    lo = tl.load(LoIn + rows)
    tau = tl.load(TauIn + rows)
    target = tl.load(TargetIn + rows)
    # Every program of a row merges the same values in the same order: the same state.
    if MERGE == _COUNTS or MERGE == _MASSES:
        if MERGE == _COUNTS:
            acc = _merged(PartIn, rows, fan, n_chunks, tl.int32)
            ok = acc >= top_k
        else:
            acc = _merged(PartIn, rows, fan, n_chunks, tl.float32)
            ok = acc >= target[:, None]
        step = tl.full([], 1, tl.int32) << tl.maximum(
            31 - _SEARCH_BITS * (merge_pass + 1), 0
        )
        cand = lo[:, None] + fan[None, :] * step
        ok = ok | (fan[None, :] == 0)
        lo = tl.max(tl.where(ok, cand, _KEY_PAD), axis=1)
        # The last pass pins the threshold; the next search starts afresh.
        done = merge_pass == _SEARCH_PASSES - 1
        tau = tl.where(done, lo, tau)
        lo = tl.where(done, _KEY_LO, lo)
    if MERGE == _TOTAL:
        total = _merged(PartIn, rows, fan, n_chunks, tl.float32)
        target = top_p * tl.sum(tl.where(fan[None, :] == 0, total, 0.0), axis=1)
    if PRODUCE == _DRAW and HAS_MIN_P:
        tau = tl.maximum(tau, _order_key(tl.full([1], log_min_p, tl.float32)))
    if chunk == 0:
        tl.store(LoOut + rows, lo)
        tl.store(TauOut + rows, tau)
        tl.store(TargetOut + rows, target)

    rowmax = tl.load(Rowmax + rows).to(tl.float32)
    x_rows = X + rows[:, None] * stride_x
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    key = _tile(X, x_rows, row_mask, cols, N, rowmax, inv_temp)
    part_at = PartOut + (rows[:, None] * n_chunks + chunk) * _FANOUT + fan[None, :]
    if PRODUCE == _COUNTS or PRODUCE == _MASSES:
        # One tile's share of _search's pass: the same sums, from zero.
        step = tl.full([], 1, tl.int32) << tl.maximum(
            31 - _SEARCH_BITS * (produce_pass + 1), 0
        )
        if PRODUCE == _MASSES:
            acc = tl.zeros([1, _FANOUT], tl.float32)
            e = tl.where(key >= tau[:, None], tl.exp(_key_to_z(key)), 0.0)
        else:
            acc = tl.zeros([1, _FANOUT], tl.int32)
        for j in tl.static_range(1, _FANOUT):
            t = lo + j * step
            if PRODUCE == _MASSES:
                part = tl.sum(tl.where(key >= t[:, None], e, 0.0), axis=1)
            else:
                part = tl.sum((key >= t[:, None]).to(tl.int32), axis=1)
            acc = tl.where(fan[None, :] == j, acc + part[:, None], acc)
        tl.store(part_at, acc)
    if PRODUCE == _TOTAL:
        e = tl.where(key >= tau[:, None], tl.exp(_key_to_z(key)), 0.0)
        total = tl.zeros([1], tl.float32) + tl.sum(e, axis=1)
        tl.store(part_at, tl.where(fan[None, :] == 0, total[:, None], 0.0))
    if PRODUCE == _DRAW:
        score = _scores(key, tau, rows, cols, N, seed, GREEDY)
        tl.store(Best + rows * n_chunks + chunk, tl.max(score, axis=1))
        blk_idx = tl.argmax(score, axis=1, tie_break_left=True).to(tl.int64)
        tl.store(BestIdx + rows * n_chunks + chunk, blk_idx + chunk * BLOCK_N)


@triton.jit
def _sample_split_argmax_kernel(Best, BestIdx, TauIn, Out, Tau, n_chunks):
    """The draw's merge, per row: the best tile in tile order, the earlier on a tie
    (strictly greater wins, as in _sample_kernel's loop; past the last tile the loads
    give -inf, which never wins)."""
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int64)
    for g in range(0, n_chunks, _MERGE_GROUP):
        for u in tl.static_range(_MERGE_GROUP):
            c = g + u
            inside = tl.full([], c, tl.int32) < n_chunks
            score = tl.load(Best + row * n_chunks + c, mask=inside, other=float("-inf"))
            idx = tl.load(BestIdx + row * n_chunks + c, mask=inside, other=0)
            better = score > best
            best_idx = tl.where(better, idx, best_idx)
            best = tl.where(better, score, best)
    tl.store(Out + row, best_idx)
    tl.store(Tau + row, tl.load(TauIn + row))


def _split_steps(has_top_k, has_top_p):
    """(MERGE, merge_pass, PRODUCE, produce_pass) of each launch, in order."""
    steps, prev = [], (NOTHING, 0)
    if has_top_k:
        for p in range(SEARCH_PASSES):
            steps.append(prev + (COUNTS, p))
            prev = (COUNTS, p)
    if has_top_p:
        steps.append(prev + (TOTAL, 0))
        prev = (TOTAL, 0)
        for p in range(SEARCH_PASSES):
            steps.append(prev + (MASSES, p))
            prev = (MASSES, p)
    return steps + [prev + (DRAW, 0)]


def _forward_split(
    x2d, rowmax, seed, inv_temp, top_k, top_p, log_min_p, *, greedy, block_n, num_warps
):
    """The split path of :func:`_forward`: len(_split_steps) launches of (M, tiles)
    programs, then one of M programs."""
    M, N = x2d.shape
    dev = x2d.device
    chunks = triton.cdiv(N, block_n)
    # Two of each buffer: a launch reads what the previous one wrote and writes the
    # other (programs of one launch never read what another of it writes).
    # Flat buffers, indexed as (M, chunks, FANOUT) and (M, chunks).
    counts = [
        torch.empty((M * chunks * FANOUT,), dtype=torch.int32, device=dev)
        for _ in range(2)
    ]
    masses = [
        torch.empty((M * chunks * FANOUT,), dtype=torch.float32, device=dev)
        for _ in range(2)
    ]
    lo = [torch.full((M,), KEY_LO, dtype=torch.int32, device=dev) for _ in range(2)]
    tau = [
        torch.full((M,), KEY_PAD + 1, dtype=torch.int32, device=dev) for _ in range(2)
    ]
    target = [torch.zeros((M,), dtype=torch.float32, device=dev) for _ in range(2)]
    best = torch.empty((M * chunks,), dtype=torch.float32, device=dev)
    best_idx = torch.empty((M * chunks,), dtype=torch.int64, device=dev)
    out = torch.empty((M,), dtype=torch.int64, device=dev)
    tau_out = torch.empty((M,), dtype=torch.int32, device=dev)
    scalars = (
        x2d.stride(0),
        M,
        N,
        seed,
        inv_temp,
        top_k or 0,
        1.0 if top_p is None else top_p * (1.0 - TOP_P_SLACK),
        log_min_p or 0.0,
    )
    steps = _split_steps(top_k is not None, top_p is not None)
    with device_guard(x2d):
        for i, (merge, merge_pass, produce, produce_pass) in enumerate(steps):
            a, b = i % 2, (i + 1) % 2
            part_in = counts[a] if merge == COUNTS else masses[a]
            part_out = counts[b] if produce == COUNTS else masses[b]
            _sample_split_kernel[(M, chunks)](
                x2d,
                rowmax,
                part_in,
                part_out,
                lo[a],
                lo[b],
                tau[a],
                tau[b],
                target[a],
                target[b],
                best,
                best_idx,
                *scalars,
                chunks,
                merge_pass,
                produce_pass,
                MERGE=merge,
                PRODUCE=produce,
                GREEDY=greedy,
                HAS_MIN_P=log_min_p is not None,
                BLOCK_N=block_n,
                num_warps=num_warps,
                **LAUNCH,
            )
        _sample_split_argmax_kernel[(M,)](
            best,
            best_idx,
            tau[len(steps) % 2],
            out,
            tau_out,
            chunks,
            num_warps=1,
            **LAUNCH,
        )
    return out, tau_out


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

    Returns:
        int64 tensor of shape ``logits.shape[:-1]``. Indices are not differentiable: the
        output never requires grad, even when ``logits`` does (there is no gradient to
        drop).

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _validate.check_input(logits, "logits")
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
    x2d = _validate.as_rows(logits.detach())
    rowmax = x2d.amax(dim=-1)
    _check_values(rowmax)
    idx, _ = _launch(x2d, rowmax, temperature, top_k, top_p, min_p, generator)
    return idx.view(out_shape)


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
