"""The split-row path of :func:`normbook.sample`, for rows of at least
:data:`SAMPLE_SPLIT_MIN_N` keys (a vocabulary): :func:`_forward_split`, its kernels and
its plan of launches (:func:`_split_steps`).

At decode (M = 1 ... 64 rows) ``normbook.sampling._sample_kernel`` runs M programs on
a GPU of 132 SMs, each reading its row up to 2 * SEARCH_PASSES + 2 times
(``normbook.sampling.row_reads``). The split path gives each tile of a row its own
program, launch after launch: every launch first merges what the previous one left (the
FANOUT counts or masses of each tile, added in tile order, as the single program's loop
adds them) into the row's search state, then computes its tile's share of the next
step. Same tiles, same sums in the same order: the same
threshold and the same draw as the single program's loop, bit for bit
(tests/kernels/test_sampling.py).

Apart from the single-program path (:mod:`normbook.sampling`, whose ``_forward``
chooses between the two) so that each module stays short; it imports nothing from it.
What both paths compute alike (order keys, the search's constants, the scores) lives in
:mod:`normbook._sampling_search`.
"""

import torch
import triton
import triton.language as tl

from ._config import LAUNCH
from ._runtime import device_guard
from ._sampling_search import (
    _FANOUT,
    _KEY_LO,
    _KEY_PAD,
    _SEARCH_BITS,
    _SEARCH_PASSES,
    FANOUT,
    KEY_LO,
    KEY_PAD,
    SAMPLE_TILE,
    SEARCH_PASSES,
    TOP_P_SLACK,
    _key_to_z,
    _order_key,
    _scores,
    _tile,
)

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
