"""What the two paths of :func:`normbook.sample` share: the order keys, the threshold
search and the Gumbel scores.

The single-program kernel (:mod:`normbook.sampling`) and the split-row path
(:mod:`normbook.sampling_split`) must compute the same keys, sums and scores, bit for
bit, so both take them from here, and neither imports the other's module for them: the
constants of the search (as Python values, and as the constexprs a kernel reads), the
order key of a float and its inverse, a tile's scaled logits and keys, the search for a
threshold key over a row (:func:`_search`), and the race's scores (:func:`_scores`,
with :func:`_exponential`).
"""

import triton
import triton.language as tl

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
# Elements per program's tile on a GPU (see normbook.sampling._forward).
SAMPLE_TILE = 4096
# The same, as the constexprs a kernel may read.
_KEY_PAD = tl.constexpr(KEY_PAD)
_KEY_LO = tl.constexpr(KEY_LO)
_SEARCH_BITS = tl.constexpr(SEARCH_BITS)
_FANOUT = tl.constexpr(FANOUT)
_SEARCH_PASSES = tl.constexpr(SEARCH_PASSES)
_ONE_MINUS_ULP = tl.constexpr(ONE_MINUS_ULP)


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
