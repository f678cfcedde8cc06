r"""Scaled dot-product attention as FlashAttention-style Triton kernels, forward and
backward.

.. math:: O = \mathrm{softmax}\bigl(\text{scale}\cdot Q K^\top + \text{mask}\bigr)\, V

Layout as ``F.scaled_dot_product_attention``: ``(batch, heads, seq, head_dim)``. One
program owns ``BLOCK_M`` query rows of one head and streams the keys and values past
them in tiles of ``BLOCK_N``, keeping only the online-softmax state per row: the running
maximum ``m``, the running sum ``l`` of ``exp(s - m)`` and the unnormalized output
``acc`` (all fp32). The ``seq_q × seq_k`` score matrix never exists in memory, only one
``BLOCK_M × BLOCK_N`` tile of it, in registers.

Masks (``causal``, ``window``) are computed from indices, never loaded. Key tiles that
are masked for every row of a query tile are not visited at all; :func:`tiles_visited`
counts the tiles each program visits, straight from the kernel.

Backward (FlashAttention-2, Dao 2023). With ``P = softmax(S)``, ``dP = dO Vᵀ`` and the
softmax Jacobian ``diag(p) − p pᵀ`` applied row by row,

.. math::
    dV = P^\top dO,\quad dS = P \circ (dP - D),\quad
    D_i = \textstyle\sum_d dO_{id} O_{id} = \sum_j P_{ij} dP_{ij},\quad
    dQ = \text{scale}\, dS\, K,\quad dK = \text{scale}\, dS^\top Q.

When a gradient will be needed, the forward also saves the log-sum-exp of each row,
``L = m + log l`` (natural log, fp32; ``+inf`` for a row that sees no key), so that the
backward recomputes ``P = exp(scale·q·k − L)`` tile by tile instead of storing it. Three
kernels: ``_attention_bwd_preprocess`` computes ``D`` once per row;
``_attention_bwd_dkdv``, one program per key tile of a k/v head, visits every query tile
(of every q head of its group, in a fixed order) that sees it and writes ``dK`` and
``dV`` once; ``_attention_bwd_dq``, one program per query tile, visits the key tiles as
the forward does and writes ``dQ`` once. No atomics anywhere: every sum is taken in an
order fixed by the code, so the gradients are bitwise equal from run to run.

Conventions (see the chapter "Causal masks"):

* ``causal=True`` is *bottom-right* aligned, as FlashAttention 2.1+ and decoding with a
  KV cache: query ``i`` sees keys ``j <= i + seq_k - seq_q`` (the last query sees every
  key). ``causal="top_left"`` is ``F.scaled_dot_product_attention(is_causal=True)``:
  ``j <= i``. Both agree when ``seq_q == seq_k``.
* ``window=W`` (with ``causal``), as Mistral: each query also sees at most ``W`` keys,
  itself and the ``W - 1`` before it.
* A query row that sees no key at all (fully masked) outputs **0**, not NaN: the sum
  over no keys is 0, which is what FlashAttention returns and what stops one empty row
  from poisoning everything downstream of it. Its gradients are 0 as well (it depends on
  no q, k or v).
"""

import numbers

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH
from ._runtime import INTERPRET, device_guard
from ._triton_utils import round_to

# exp(x) = exp2(x · log2 e): the GPU's fast exponential is base 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453  # log(x) = log2(x) · ln 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
ALIGNMENTS = {
    True: "bottom_right",
    "bottom_right": "bottom_right",
    "top_left": "top_left",
}


@triton.jit
def _attention_fwd(
    Q,
    K,
    V,
    O,
    Tiles,
    LSE,  # pointers: inputs, output, tiles visited, L
    sqb,
    sqh,
    sqm,
    sqd,  # strides of Q (batch, head, seq, dim), in elements
    skb,
    skh,
    skn,
    skd,  # strides of K
    svb,
    svh,
    svn,
    svd,  # strides of V
    sob,
    soh,
    som,  # strides of O (contiguous in dim)
    H,
    GROUP,
    seq_q,
    seq_k,
    D,  # q heads, q heads per k/v head, lengths, head_dim
    # scale·log2(e); causal diagonal offset; window (keys per query)
    qk_scale,
    offset,
    window,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SAVE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64: batch · stride can pass 2**31
    h = bh % H
    # grouped-query attention: GROUP q heads share a k/v head
    h_kv = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < D  # head_dim padded up to a power of two >= 16 (tl.dot's minimum)
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        # the interpreter's bf16 dot is broken; fp32 holds bf16 exactly
        q = q.to(tl.float32)
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh

    # The online-softmax state of each row: max m, sum l of exp(s - m), output acc = Σ
    # exp(s-m) v.
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Which keys can any row of this tile see? Tiles outside [lo, hi) are masked for
    # every row: skip them (about half of all tiles for a causal mask, most of them for
    # a short window).
    lo = 0
    hi = seq_k
    if CAUSAL:
        last_row = tl.minimum(tile_m * BLOCK_M + BLOCK_M, seq_q) - 1
        hi = tl.maximum(tl.minimum(hi, last_row + offset + 1), 0)
        if WINDOW:
            first_row = tile_m * BLOCK_M
            lo = tl.maximum(first_row + offset - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N  # start on a tile boundary
    visited = 0
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        kt = tl.load(
            k_base + cols[None, :] * skn + dims[:, None] * skd,
            # K tile, transposed
            mask=col_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        # Scores in base 2: s·log2(e), so that exp2 gives exp(s).
        s = (
            tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            * qk_scale
        )
        keep = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
            if WINDOW:
                keep = keep & (cols[None, :] > rows[:, None] + offset - window)
        # where, not +(-inf): a NaN key stays masked
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row with no visible key yet has m_new = -inf; shift by 0 instead, so that
        # exp2(-inf - (-inf)) = NaN never appears and its p and l stay exactly 0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        # rescales the old state to the new maximum (0 if m = -inf)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        vt = tl.load(
            v_base + cols[:, None] * svn + dims[None, :] * svd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        # P is rounded to V's dtype for the tensor-core product, as FlashAttention does.
        p_low = round_to(p, V.dtype.element_ty)
        if UPCAST:
            p_low = p_low.to(tl.float32)
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(
            p_low, vt, input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
        m = m_new
        visited += 1

    # A fully masked row has l = 0 and acc = 0: divide by 1, output 0, not 0/0.
    l_pos = tl.where(l > 0.0, l, 1.0)
    if SAVE_LSE:
        # For the backward: L = log Σ_j exp(s_j) = (m + log2 l)·ln 2 (m is in base 2).
        # A row that sees no key gets +inf, so that exp(s - L) = 0 there: 0 gradients.
        lse = tl.where(l > 0.0, (m + tl.log2(l_pos)) * 0.6931471805599453, float("inf"))
        tl.store(LSE + bh.to(tl.int64) * seq_q + rows, lse, mask=row_ok)
    # Normalize once at the end.
    out = acc / l_pos[:, None]
    o_ptr = O + b * sob + h * soh + rows[:, None] * som + dims[None, :]
    tl.store(
        o_ptr, round_to(out, O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
    )
    tl.store(Tiles + bh.to(tl.int64) * tl.num_programs(0) + tile_m, visited)


@triton.jit
def _attention_bwd_preprocess(
    O,
    DO,
    Delta,  # pointers: saved output, its gradient, D (fp32)
    sob,
    soh,
    som,  # strides of O (contiguous in dim)
    sdob,
    sdoh,
    sdom,
    sdod,  # strides of dO
    H,
    seq_q,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    ok = row_ok[:, None] & (dims < D)[None, :]
    o = tl.load(
        O + b * sob + h * soh + rows[:, None] * som + dims[None, :], mask=ok, other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + rows[:, None] * sdom + dims[None, :] * sdod,
        mask=ok,
        other=0.0,
    )
    # D_i = Σ_d dO_id O_id = Σ_j P_ij dP_ij: the ⟨dy, p⟩ of the softmax backward, one a
    # row, from O (head_dim numbers) instead of from P (seq_k numbers).
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh.to(tl.int64) * seq_q + rows, delta, mask=row_ok)


@triton.jit
def _attention_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    Delta,
    DK,
    DV,  # pointers: inputs, dO, the forward's L, D; dK, dV
    sqb,
    sqh,
    sqm,
    sqd,  # strides of Q (batch, head, seq, dim), in elements
    skb,
    skh,
    skn,
    skd,  # strides of K
    svb,
    svh,
    svn,
    svd,  # strides of V
    sdob,
    sdoh,
    sdom,
    sdod,  # strides of dO
    sdkb,
    sdkh,
    sdkn,  # strides of dK and dV (one layout, dim contiguous)
    H,
    GROUP,
    seq_q,
    seq_k,
    D,  # q heads, q heads per k/v head, lengths, head_dim
    qk_scale,
    scale,
    offset,
    window,  # scale·log2(e), scale; causal offset; window
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program owns BLOCK_N keys of one k/v head and every query that sees them.
    tile_n = tl.program_id(0)
    bh_kv = tl.program_id(1)
    H_kv = H // GROUP
    b = (bh_kv // H_kv).to(tl.int64)
    h_kv = (bh_kv % H_kv).to(tl.int64)

    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < seq_k
    dim_ok = dims < D
    kv_ok = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(
        K + b * skb + h_kv * skh + cols[:, None] * skn + dims[None, :] * skd,
        mask=kv_ok,
        other=0.0,
    )
    v = tl.load(
        V + b * svb + h_kv * svh + cols[:, None] * svn + dims[None, :] * svd,
        mask=kv_ok,
        other=0.0,
    )
    if UPCAST:
        # the interpreter's bf16 dot is broken; fp32 holds bf16 exactly (and on sm_75
        # it takes fewer registers than the half-precision FMA path)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Which queries see any key of this tile? Key j is seen by rows i >= j - offset
    # (causal) and i < j - offset + window (window): skip query tiles outside [lo, hi).
    lo = 0
    hi = seq_q
    if CAUSAL:
        lo = tl.maximum(tile_n * BLOCK_N - offset, 0)
        lo = (lo // BLOCK_M) * BLOCK_M  # start on a query-tile boundary
        if WINDOW:
            last_col = tl.minimum(tile_n * BLOCK_N + BLOCK_N, seq_k) - 1
            hi = tl.maximum(tl.minimum(hi, last_col - offset + window), 0)
    # GQA: the GROUP q heads that share this k/v head, in a fixed order (0, 1, …): dK
    # and dV are sums over them, taken in registers and in the same order every run.
    for g in range(0, GROUP):
        bh = b * H + h_kv * GROUP + g  # the q head's index among batch · heads
        h = h_kv * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < seq_q
            qt = tl.load(
                q_base + rows[None, :] * sqm + dims[:, None] * sqd,  # Qᵀ tile
                mask=row_ok[None, :] & dim_ok[:, None],
                other=0.0,
            )
            do = tl.load(
                do_base + rows[:, None] * sdom + dims[None, :] * sdod,
                mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                qt = qt.to(tl.float32)
                do = do.to(tl.float32)
            # L in base 2; a padding row reads +inf: its p is 0, as a fully masked row's
            lse2 = tl.load(LSE + bh * seq_q + rows, mask=row_ok, other=float("inf"))
            lse2 = lse2 * 1.4426950408889634  # log2(e)
            delta = tl.load(Delta + bh * seq_q + rows, mask=row_ok, other=0.0)
            # Pᵀ recomputed from L: p_ij = exp(s_ij − L_i), transposed (keys × queries).
            st = tl.dot(k, qt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            st = st * qk_scale
            keep = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :] + offset)
                if WINDOW:
                    keep = keep & (cols[:, None] > rows[None, :] + offset - window)
            pt = tl.where(keep, tl.exp2(st - lse2[None, :]), 0.0)
            # dV += Pᵀ dO, P rounded to the input dtype for tensor cores, as forward
            pt_low = round_to(pt, V.dtype.element_ty)
            if UPCAST:
                pt_low = pt_low.to(tl.float32)
            dv += tl.dot(
                pt_low, do, input_precision=DOT_PRECISION, out_dtype=tl.float32
            )
            # dPᵀ = V dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ − D): the softmax backward p ∘ (dy − ⟨dy,p⟩)
            dpt = tl.dot(
                v, tl.trans(do), input_precision=DOT_PRECISION, out_dtype=tl.float32
            )
            dst = pt * (dpt - delta[None, :])
            dst_low = round_to(dst, Q.dtype.element_ty)
            if UPCAST:
                dst_low = dst_low.to(tl.float32)
            dk += tl.dot(
                dst_low,
                tl.trans(qt),
                input_precision=DOT_PRECISION,
                out_dtype=tl.float32,
            )
    # S = scale · Q Kᵀ, so dK = scale · dSᵀ Q (the scale once, at the end).
    dk = dk * scale
    out = DK + b * sdkb + h_kv * sdkh + cols[:, None] * sdkn + dims[None, :]
    tl.store(out, round_to(dk, DK.dtype.element_ty), mask=kv_ok)
    out = DV + b * sdkb + h_kv * sdkh + cols[:, None] * sdkn + dims[None, :]
    tl.store(out, round_to(dv, DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _attention_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    Delta,
    DQ,  # pointers: inputs, dO, the forward's L, D; output
    sqb,
    sqh,
    sqm,
    sqd,  # strides of Q (batch, head, seq, dim), in elements
    skb,
    skh,
    skn,
    skd,  # strides of K
    svb,
    svh,
    svn,
    svd,  # strides of V
    sdob,
    sdoh,
    sdom,
    sdod,  # strides of dO
    sdqb,
    sdqh,
    sdqm,  # strides of dQ (contiguous in dim)
    H,
    GROUP,
    seq_q,
    seq_k,
    D,  # q heads, q heads per k/v head, lengths, head_dim
    qk_scale,
    scale,
    offset,
    window,  # scale·log2(e), scale; causal offset; window
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program owns BLOCK_M queries of one head and sums dQ over the keys they see,
    # in registers: no other program writes these rows, so no atomics and a fixed order.
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    h_kv = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < D
    q_ok = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
        mask=q_ok,
        other=0.0,
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + rows[:, None] * sdom + dims[None, :] * sdod,
        mask=q_ok,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    bh = bh.to(tl.int64)
    lse2 = tl.load(LSE + bh * seq_q + rows, mask=row_ok, other=float("inf"))
    lse2 = lse2 * 1.4426950408889634  # L in base 2; padding rows +inf: p = 0
    delta = tl.load(Delta + bh * seq_q + rows, mask=row_ok, other=0.0)
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The key tiles the forward visited, and no others.
    lo = 0
    hi = seq_k
    if CAUSAL:
        last_row = tl.minimum(tile_m * BLOCK_M + BLOCK_M, seq_q) - 1
        hi = tl.maximum(tl.minimum(hi, last_row + offset + 1), 0)
        if WINDOW:
            lo = tl.maximum(tile_m * BLOCK_M + offset - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_k
        kv_ok = col_ok[None, :] & dim_ok[:, None]
        kt = tl.load(
            k_base + cols[None, :] * skn + dims[:, None] * skd, mask=kv_ok, other=0.0
        )
        vt = tl.load(
            v_base + cols[None, :] * svn + dims[:, None] * svd, mask=kv_ok, other=0.0
        )
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = (
            tl.dot(q, kt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            * qk_scale
        )
        keep = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
            if WINDOW:
                keep = keep & (cols[None, :] > rows[:, None] + offset - window)
        p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        ds = p * (dp - delta[:, None])
        ds_low = round_to(ds, Q.dtype.element_ty)
        if UPCAST:
            ds_low = ds_low.to(tl.float32)
        dq += tl.dot(
            ds_low, tl.trans(kt), input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
    dq = dq * scale  # S = scale · Q Kᵀ, so dQ = scale · dS K
    out = DQ + b * sdqb + h * sdqh + rows[:, None] * sdqm + dims[None, :]
    tl.store(out, round_to(dq, DQ.dtype.element_ty), mask=q_ok)


def tile_config(head_dim: int, dtype: torch.dtype, capability=None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for a head_dim, dtype and GPU (None:
    interpreter).

    Chosen so that ``ptxas -v`` reports no register spills on sm_90a, sm_80 and sm_75
    (checked with Triton 3.9 for head_dim 16, 64 and 128, causal with window). fp16/bf16
    on sm_80+ use tensor cores: 64 queries × 64 keys (32 keys above head_dim 64), 8
    warps for BLOCK_D 64, 4 otherwise (at head_dim 128, 8 warps were held to 128
    registers on sm_80 and spilled once the forward also wrote L). fp32 (IEEE, no TF32)
    and every dtype on sm_75 (where this Triton emits no tensor-core code for these
    tiles)
    multiply with FMAs and hold whole tiles per thread: smaller tiles.
    """
    # tl.dot needs every dimension >= 16
    block_d = max(16, triton.next_power_of_2(head_dim))
    tensor_cores = dtype != torch.float32 and (
        capability is None or capability >= (8, 0)
    )
    if tensor_cores:
        if block_d > 64:
            return 64, 32, block_d, 4  # 8 warps: held to 128 registers on sm_80: spills
        return 64, 64, block_d, 4 if block_d <= 32 else 8
    if block_d > 64:
        # 8 warps: sm_90's 128-register cap would spill with 4
        return 16, 16, block_d, 8
    return 32, 32 if block_d <= 32 else 16, block_d, 4


def bwd_tile_config(head_dim: int, dtype: torch.dtype, capability=None, kernel="dkdv"):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for the backward's ``kernel`` (dkdv, dq).

    The dK/dV program holds four key-side tiles (k, v, dk, dv: BLOCK_N × BLOCK_D) for
    its whole life and two query-side tiles per step; the dQ program the reverse. Each
    keeps its long-lived side the larger one. Chosen for 0 spills on sm_90, sm_80 and
    sm_75 in ``python -m normbook.lab.inspector`` (tests/lab/test_inspect.py; head_dim
    128, Triton 3.9). On sm_75 the tiles are multiplied in fp32 (see ``_backward``).
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    tensor_cores = dtype != torch.float32 and (
        capability is None or capability >= (8, 0)
    )
    if tensor_cores:
        owned, step, warps = (64, 32, 4) if block_d <= 64 else (64, 16, 8)
    elif block_d > 64:
        # fp16/bf16 here is sm_75, multiplied in fp32: 16 owned keys spilled 8 bytes in
        # dK/dV, 32 none; fp32 the reverse (32 hit sm_80's 128 registers at 8 warps)
        wide = kernel == "dkdv" and dtype != torch.float32
        owned, step, warps = (32 if wide else 16), 16, 8
    else:
        owned, step, warps = 32, 16, 4
    if kernel == "dkdv":
        return step, owned, block_d, warps  # BLOCK_M queries a step, BLOCK_N keys owned
    return owned, step, block_d, warps  # BLOCK_M queries owned, BLOCK_N keys per step


def _capability(t: torch.Tensor):
    """The GPU's compute capability the tiles are chosen for; None in the interpreter"""
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device)
    # Compiled mode with CPU tensors: normbook.lab.inspector lowering for a chosen arch
    return None if INTERPRET else torch.cuda.get_device_capability()


def _check(q, k, v, causal, scale, window):
    """Every argument check, before any launch; returns (alignment or None, scale,
    window)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(
                f"{name} must be float32, float16 or bfloat16, got {t.dtype}"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, seq, "
                "head_dim), "
                f"got shape {tuple(t.shape)}"
            )
        _validate.check_device(t, name)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype, {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; put "
                "them on one device"
            )
        if t.shape[0] != q.shape[0]:
            raise ValueError(
                f"{name} must have q's batch size, {q.shape[0]}, got {t.shape[0]}"
            )
        if t.shape[3] != q.shape[3]:
            raise ValueError(
                f"{name} must have q's head_dim, {q.shape[3]}, got {t.shape[3]}"
            )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"v must have k's heads and seq_k, {tuple(k.shape[1:3])}, "
            f"got {tuple(v.shape[1:3])}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"k and v heads ({k.shape[1]}) must divide q's heads "
            f"({q.shape[1]}): "
            "grouped-query attention shares each k/v head among a group "
            "of q heads"
        )
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {q.shape[3]}"
        )
    if isinstance(causal, bool):
        alignment = ALIGNMENTS[True] if causal else None
    elif isinstance(causal, str) and causal in ALIGNMENTS:
        alignment = ALIGNMENTS[causal]
    else:
        raise ValueError(
            f"causal must be False, True, 'bottom_right' or 'top_left', got {causal!r}"
        )
    if scale is None:
        scale = q.shape[3] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a real number or None, got {type(scale).__name__}"
        )
    scale = float(scale)
    if not abs(scale) < float("inf"):
        raise ValueError(f"scale must be finite, got {scale}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(
                f"window must be an int or None, got {type(window).__name__}"
            )
        if window < 1:
            raise ValueError(
                f"window must be >= 1 (keys each query sees), got {window}"
            )
        if alignment is None:
            raise ValueError(
                "window needs causal: a sliding window limits how far "
                "back a "
                "causal query looks (window=W: itself and the W - 1 keys "
                "before)"
            )
        window = int(window)
    return alignment, scale, window


def _forward(q, k, v, alignment, scale, window, save_lse=False):
    """Launch on checked inputs; returns (output, visited, L). visited: key tiles per
    program; L: the log-sum-exp per row (fp32, (batch, heads, seq_q)) when ``save_lse``,
    else None."""
    B, H, seq_q, D = q.shape
    H_kv, seq_k = k.shape[1], k.shape[2]
    out = torch.empty((B, H, seq_q, D), dtype=q.dtype, device=q.device)
    lse = None
    if save_lse:
        lse = torch.empty((B, H, seq_q), dtype=torch.float32, device=q.device)
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps = tile_config(D, q.dtype, _capability(q))
    grid = (triton.cdiv(seq_q, BLOCK_M), B * H)
    visited = torch.empty(grid[::-1], dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out, visited, lse
    if seq_k == 0:  # no key at all: every row is fully masked: 0, and L = +inf
        if save_lse:
            lse.fill_(float("inf"))
        return out.zero_(), visited.zero_(), lse
    # Bottom-right: the diagonal ends at the last key (offset seq_k - seq_q); top-left:
    # at 0.
    offset = seq_k - seq_q if alignment == "bottom_right" else 0
    with device_guard(q):
        _attention_fwd[grid](
            q,
            k,
            v,
            out,
            visited,
            lse if save_lse else out,  # out: a placeholder
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride()[:3],
            H,
            H // H_kv,
            seq_q,
            seq_k,
            D,
            scale * LOG2E,
            offset,
            window or 0,
            CAUSAL=alignment is not None,
            WINDOW=window is not None,
            UPCAST=INTERPRET,
            DOT_PRECISION="ieee",  # fp32 products, not TF32
            SAVE_LSE=save_lse,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            num_warps=num_warps,
            **LAUNCH,
        )
    return out, visited, lse


def _backward(do, q, k, v, out, lse, alignment, scale, window, needs=(True,) * 3):
    """(dq, dk, dv) from dO and the forward's saved q, k, v, O and L; None where
    ``needs`` (q, k, v) says no gradient is wanted."""
    B, H, seq_q, D = q.shape
    H_kv, seq_k = k.shape[1], k.shape[2]
    want_q, want_kv = needs[0], needs[1] or needs[2]
    dq = dk = dv = None
    if want_q:
        dq = torch.empty((B, H, seq_q, D), dtype=q.dtype, device=q.device)
    if want_kv:
        dk = torch.empty((B, H_kv, seq_k, D), dtype=k.dtype, device=k.device)
        dv = torch.empty_like(dk)
    if B * H * seq_q == 0 or seq_k == 0:
        # No query, or no key: nothing depends on anything, every gradient is 0.
        return tuple(None if g is None else g.zero_() for g in (dq, dk, dv))
    offset = seq_k - seq_q if alignment == "bottom_right" else 0
    cap = _capability(q)
    # sm_75 has no bf16 tensor cores and these tiles use none: multiply in fp32 there
    # (products of fp16/bf16 numbers are exact in fp32, so nothing changes but the
    # registers: the half-precision FMA path needed 255 registers and spilled).
    upcast = INTERPRET or (cap is not None and cap < (8, 0))
    common = dict(
        CAUSAL=alignment is not None,
        WINDOW=window is not None,
        UPCAST=upcast,
        DOT_PRECISION="ieee",
        **LAUNCH,
    )
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    sizes = (H, H // H_kv, seq_q, seq_k, D, scale * LOG2E, scale, offset, window or 0)
    delta = torch.empty((B, H, seq_q), dtype=torch.float32, device=q.device)
    BLOCK_M, _, BLOCK_D, num_warps = tile_config(D, q.dtype, cap)
    with device_guard(q):
        _attention_bwd_preprocess[(triton.cdiv(seq_q, BLOCK_M), B * H)](
            out,
            do,
            delta,
            *out.stride()[:3],
            *do.stride(),
            H,
            seq_q,
            D,
            BLOCK_M=BLOCK_M,
            BLOCK_D=BLOCK_D,
            num_warps=num_warps,
            **LAUNCH,
        )
        if want_kv:
            BLOCK_M, BLOCK_N, BLOCK_D, num_warps = bwd_tile_config(
                D, q.dtype, cap, "dkdv"
            )
            _attention_bwd_dkdv[(triton.cdiv(seq_k, BLOCK_N), B * H_kv)](
                q,
                k,
                v,
                do,
                lse,
                delta,
                dk,
                dv,
                *strides,
                *dk.stride()[:3],
                *sizes,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D,
                num_warps=num_warps,
                **common,
            )
        if want_q:
            BLOCK_M, BLOCK_N, BLOCK_D, num_warps = bwd_tile_config(
                D, q.dtype, cap, "dq"
            )
            _attention_bwd_dq[(triton.cdiv(seq_q, BLOCK_M), B * H)](
                q,
                k,
                v,
                do,
                lse,
                delta,
                dq,
                *strides,
                *dq.stride()[:3],
                *sizes,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D,
                num_warps=num_warps,
                **common,
            )
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    """``attention`` with its Triton backward: saves q, k, v, the output O and the
    per-row log-sum-exp L (fp32), never the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, alignment, scale, window):
        out, _, lse = _forward(q, k, v, alignment, scale, window, save_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (alignment, scale, window)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(
            do, q, k, v, out, lse, *ctx.args, needs=ctx.needs_input_grad[:3]
        )
        return (*grads, None, None, None)


def attention(q, k, v, *, causal=False, scale=None, window=None):
    r"""``softmax(scale · q kᵀ + mask) v``, never holding the ``seq_q × seq_k`` scores
    in memory.

    Args:
        q: ``(batch, heads, seq_q, head_dim)``, float32, float16 or bfloat16; any
        strides.
        k, v: ``(batch, kv_heads, seq_k, head_dim)``, q's dtype and device; ``kv_heads``
            divides ``heads`` (grouped-query attention: q head ``h`` uses k/v head ``h
            // (heads // kv_heads)``, as SDPA's ``enable_gqa=True``).
        causal: ``False``; ``True`` or ``"bottom_right"`` (query ``i`` sees keys ``j <=
            i + seq_k - seq_q``: decoding with a KV cache, FlashAttention 2.1+); or
            ``"top_left"`` (``j <= i``: SDPA's ``is_causal=True``). Equal when seq_q ==
            seq_k.
        scale: multiplies the scores; default ``1/sqrt(head_dim)``.
        window: with ``causal``, each query sees at most ``window`` keys: itself and the
            ``window - 1`` before it (Mistral's sliding window).

    Returns a tensor of q's shape and dtype. Scores, softmax state and output are
    accumulated in fp32; the probabilities are rounded to the input dtype before
    multiplying ``v`` (as FlashAttention does). A query row that sees no key returns
    zeros.

    Differentiable in q, k and v (FlashAttention-2 backward, see
    :class:`AttentionFunction`): the forward then also saves the per-row log-sum-exp (4
    bytes a query row); the gradients are computed without atomics and are bitwise
    reproducible from run to run. dk and dv sum the group's q heads in a fixed order; a
    fully masked row contributes zero gradients.

    Raises:
        TypeError / ValueError naming the bad argument, before any launch.
    """
    alignment, scale, window = _check(q, k, v, causal, scale, window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return AttentionFunction.apply(q, k, v, alignment, scale, window)
    return _forward(q, k, v, alignment, scale, window)[0]


def tiles_visited(q, k, v, *, causal=False, scale=None, window=None):
    """(visited, total): key tiles the kernel visited, summed over its programs, and the
    tiles a kernel without skipping would visit. Runs the kernel; the count comes from
    the kernel."""
    alignment, scale, window = _check(q, k, v, causal, scale, window)
    out, visited, _ = _forward(q, k, v, alignment, scale, window)
    BLOCK_N = tile_config(q.shape[3], q.dtype, _capability(q))[1]
    total = visited.numel() * triton.cdiv(k.shape[2], BLOCK_N)
    return int(visited.sum()), total
