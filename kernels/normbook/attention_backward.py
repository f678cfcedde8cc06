r"""The backward of :func:`normbook.attention`: the kernels behind
the operator ``torch.ops.normbook.attention``, their tiles and launcher.

Apart from the forward (:mod:`normbook.attention`) so that each module stays short; it
imports nothing from it. What both use (``LOG2E``, the forward's ``tile_config``, which
also sizes the preprocessing kernel, and ``_capability``) lives below them, in
:mod:`normbook._config`.

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

With a soft cap c the score is ``c·tanh(S₀/c)`` of the raw ``S₀ = scale·Q Kᵀ``; since
``d/ds c·tanh(s/c) = 1 − tanh²(s/c)``, the kernels recompute ``t = tanh(S₀/c)`` beside
P and use ``dS₀ = dS ∘ (1 − t²)`` in place of dS (``dQ = scale·dS₀ K``,
``dK = scale·dS₀ᵀ Q``; dV does not change). ``1 − t·t`` in fp32 errs by about 2|t| times
t's error, an absolute error: small next to the dS it multiplies. With ``VARLEN``
(packed sequences, :mod:`normbook.attention_varlen`) each program reads its sequence's
rows from the cumulative lengths, as the forward does.
"""

import torch
import triton
import triton.language as tl

from ._config import LAUNCH, LOG2E, _capability, tile_config
from ._runtime import INTERPRET, device_guard
from ._triton_utils import round_to, tanh


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
    CuSeqQ,
    CuSeqK,  # VARLEN: cumulative sequence lengths of the packed q and k rows
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
    D,  # q heads, q heads per k/v head, lengths (VARLEN: packed rows), head_dim
    qk_scale,
    scale,
    offset,
    window,
    softcap,  # scale·log2(e) (SOFTCAP: scale/c), scale; causal offset; window; c·log2 e
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
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
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    dk_base = DK + b * sdkb + h_kv * sdkh
    dv_base = DV + b * sdkb + h_kv * sdkh
    if VARLEN:
        # Packed sequences (batch strides 0): b is a sequence, rows cu[b] to cu[b + 1];
        # L and D are (heads, packed rows); seq_q, seq_k become the sequence's lengths.
        row0 = tl.load(CuSeqQ + b).to(tl.int64)
        col0 = tl.load(CuSeqK + b).to(tl.int64)
        packed_q = seq_q
        seq_q = (tl.load(CuSeqQ + b + 1) - row0).to(tl.int32)
        seq_k = (tl.load(CuSeqK + b + 1) - col0).to(tl.int32)
        offset = offset * (seq_k - seq_q)  # bottom-right within the sequence
        k_base += col0 * skn
        v_base += col0 * svn
        dk_base += col0 * sdkn
        dv_base += col0 * sdkn

    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = cols < seq_k
    dim_ok = dims < D
    kv_ok = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(
        k_base + cols[:, None] * skn + dims[None, :] * skd,
        mask=kv_ok,
        other=0.0,
    )
    v = tl.load(
        v_base + cols[:, None] * svn + dims[None, :] * svd,
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
    if VARLEN:
        # the grid covers the longest sequence: a tile past this one's end has no key
        hi = tl.where(tile_n * BLOCK_N < seq_k, hi, lo)
    # GQA: the GROUP q heads that share this k/v head, in a fixed order (0, 1, …): dK
    # and dV are sums over them, taken in registers and in the same order every run.
    for g in range(0, GROUP):
        bh = b * H + h_kv * GROUP + g  # the q head's index among batch · heads
        h = h_kv * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        l_off = bh * seq_q  # L and D: (batch, heads, seq_q)
        if VARLEN:
            q_base += row0 * sqm
            do_base += row0 * sdom
            l_off = h * packed_q + row0  # (heads, packed rows)
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
            lse2 = tl.load(LSE + l_off + rows, mask=row_ok, other=float("inf"))
            lse2 = lse2 * 1.4426950408889634  # log2(e)
            delta = tl.load(Delta + l_off + rows, mask=row_ok, other=0.0)
            # Pᵀ recomputed from L: p_ij = exp(s_ij − L_i), transposed (keys × queries).
            st = tl.dot(k, qt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
            st = st * qk_scale
            if SOFTCAP:
                tt = tanh(st)  # the capped score c·tanh(s/c), as the forward
                st = tt * softcap
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
            if SOFTCAP:
                # through the cap: d(c·tanh(s/c))/ds = 1 − tanh²(s/c)
                dst = dst * (1.0 - tt * tt)
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
    out = dk_base + cols[:, None] * sdkn + dims[None, :]
    tl.store(out, round_to(dk, DK.dtype.element_ty), mask=kv_ok)
    out = dv_base + cols[:, None] * sdkn + dims[None, :]
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
    CuSeqQ,
    CuSeqK,  # VARLEN: cumulative sequence lengths of the packed q and k rows
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
    D,  # q heads, q heads per k/v head, lengths (VARLEN: packed rows), head_dim
    qk_scale,
    scale,
    offset,
    window,
    softcap,  # scale·log2(e) (SOFTCAP: scale/c), scale; causal offset; window; c·log2 e
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
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
    q_base = Q + b * sqb + h * sqh
    do_base = DO + b * sdob + h * sdoh
    dq_base = DQ + b * sdqb + h * sdqh
    k_base = K + b * skb + h_kv * skh
    v_base = V + b * svb + h_kv * svh
    l_off = bh.to(tl.int64) * seq_q  # L and D: (batch, heads, seq_q)
    if VARLEN:
        # Packed sequences (batch strides 0), as the forward
        row0 = tl.load(CuSeqQ + b).to(tl.int64)
        col0 = tl.load(CuSeqK + b).to(tl.int64)
        l_off = h * seq_q + row0  # (heads, packed rows)
        seq_q = (tl.load(CuSeqQ + b + 1) - row0).to(tl.int32)
        seq_k = (tl.load(CuSeqK + b + 1) - col0).to(tl.int32)
        offset = offset * (seq_k - seq_q)  # bottom-right within the sequence
        q_base += row0 * sqm
        do_base += row0 * sdom
        dq_base += row0 * sdqm
        k_base += col0 * skn
        v_base += col0 * svn

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_q
    dim_ok = dims < D
    q_ok = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_base + rows[:, None] * sqm + dims[None, :] * sqd,
        mask=q_ok,
        other=0.0,
    )
    do = tl.load(
        do_base + rows[:, None] * sdom + dims[None, :] * sdod,
        mask=q_ok,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE + l_off + rows, mask=row_ok, other=float("inf"))
    lse2 = lse2 * 1.4426950408889634  # L in base 2; padding rows +inf: p = 0
    delta = tl.load(Delta + l_off + rows, mask=row_ok, other=0.0)
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
    if VARLEN:
        hi = tl.where(tile_m * BLOCK_M < seq_q, hi, lo)  # past the sequence's end
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
        if SOFTCAP:
            t = tanh(s)  # the capped score c·tanh(s/c), as the forward
            s = t * softcap
        keep = col_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
            if WINDOW:
                keep = keep & (cols[None, :] > rows[:, None] + offset - window)
        p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # through the cap: 1 − tanh²(s/c)
        ds_low = round_to(ds, Q.dtype.element_ty)
        if UPCAST:
            ds_low = ds_low.to(tl.float32)
        dq += tl.dot(
            ds_low, tl.trans(kt), input_precision=DOT_PRECISION, out_dtype=tl.float32
        )
    dq = dq * scale  # S = scale · Q Kᵀ, so dQ = scale · dS K
    out = dq_base + rows[:, None] * sdqm + dims[None, :]
    tl.store(out, round_to(dq, DQ.dtype.element_ty), mask=q_ok)


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


def _score_scales(scale, softcap):
    """(qk_scale, softcap) as the forward and backward kernels take them: the score in
    base 2 is q·k · scale·log2 e; with a cap c, c·tanh(q·k · scale/c)·log2 e, so then
    qk_scale is scale/c and the kernels' softcap is c·log2 e."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return scale / softcap, softcap * LOG2E


def _backward(do, q, k, v, out, lse, alignment, scale, window, softcap=None,
              needs=(True,) * 3):  # fmt: skip
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
    _launch_backward(
        do, q, k, v, out, lse, dq, dk, dv, alignment, scale, window, softcap
    )
    return dq, dk, dv


def _launch_backward(do, q, k, v, out, lse, dq, dk, dv, alignment, scale, window,
                     softcap, varlen=None):  # fmt: skip
    """Run the three backward kernels on ``(batch, heads, seq, head_dim)`` tensors,
    writing ``dq`` and ``dk``, ``dv`` where they are not None.

    ``varlen = (cu_q, cu_k, max_seqlen_q, max_seqlen_k)``: packed sequences, as
    :mod:`normbook.attention_varlen` passes them: every tensor but ``lse`` is a view of
    the packed rows with batch stride 0 (batch = sequences, seq = all packed rows),
    ``lse`` is (heads, packed rows), and the grids cover the longest sequence."""
    B, H, seq_q, D = q.shape
    H_kv, seq_k = k.shape[1], k.shape[2]
    if varlen is None:
        offset = seq_k - seq_q if alignment == "bottom_right" else 0
        cu_q = cu_k = lse  # placeholders, never read
        longest_q, longest_k, B_pre = seq_q, seq_k, B
    else:  # the kernels take each sequence's own offset: 1 says bottom-right
        offset = 1 if alignment == "bottom_right" else 0
        cu_q, cu_k, longest_q, longest_k = varlen
        B_pre = 1  # D of each packed row once: one batch of them all
    cap = _capability(q)
    # sm_75 has no bf16 tensor cores and these tiles use none: multiply in fp32 there
    # (products of fp16/bf16 numbers are exact in fp32, so nothing changes but the
    # registers: the half-precision FMA path needed 255 registers and spilled).
    upcast = INTERPRET or (cap is not None and cap < (8, 0))
    common = dict(
        CAUSAL=alignment is not None,
        WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        VARLEN=varlen is not None,
        UPCAST=upcast,
        DOT_PRECISION="ieee",
        **LAUNCH,
    )
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    qk_scale, softcap2 = _score_scales(scale, softcap)
    sizes = (H, H // H_kv, seq_q, seq_k, D, qk_scale, scale, offset, window or 0)
    sizes = (*sizes, softcap2)
    delta = torch.empty((B_pre, H, seq_q), dtype=torch.float32, device=q.device)
    BLOCK_M, _, BLOCK_D, num_warps = tile_config(D, q.dtype, cap)
    with device_guard(q):
        _attention_bwd_preprocess[(triton.cdiv(seq_q, BLOCK_M), B_pre * H)](
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
        if dk is not None:
            BLOCK_M, BLOCK_N, BLOCK_D, num_warps = bwd_tile_config(
                D, q.dtype, cap, "dkdv"
            )
            _attention_bwd_dkdv[(triton.cdiv(longest_k, BLOCK_N), B * H_kv)](
                q,
                k,
                v,
                do,
                lse,
                delta,
                dk,
                dv,
                cu_q,
                cu_k,
                *strides,
                *dk.stride()[:3],
                *sizes,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D,
                num_warps=num_warps,
                **common,
            )
        if dq is not None:
            BLOCK_M, BLOCK_N, BLOCK_D, num_warps = bwd_tile_config(
                D, q.dtype, cap, "dq"
            )
            _attention_bwd_dq[(triton.cdiv(longest_q, BLOCK_M), B * H)](
                q,
                k,
                v,
                do,
                lse,
                delta,
                dq,
                cu_q,
                cu_k,
                *strides,
                *dq.stride()[:3],
                *sizes,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D,
                num_warps=num_warps,
                **common,
            )
