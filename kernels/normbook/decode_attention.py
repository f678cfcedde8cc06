r"""Attention of a few new tokens over a KV cache, split over the keys (flash-decoding).

.. math:: O_{b,h,i} = \mathrm{softmax}_j\bigl(\text{scale}\cdot q_{b,h,i}
          \cdot k_{b,j}\bigr)\, v_{b,j}, \qquad j \le n_b - S_q + i
          \quad (\text{and } j > n_b - S_q + i - W)

With a soft cap ``c`` (Gemma 2), each score s = scale·q·k becomes c·tanh(s/c), in
(-c, c), before the mask and the softmax. tanh is built from exp2 and a polynomial
(:func:`._triton_utils.tanh`, about 6u relative, u = 2^-24); with the rounding of s/c
and of the product by c·log2(e), the capped score moves by about 8u relative to itself
(at most |s|), beside the dot product's own (D + 4)·u·scale·Σ|q k|, which the cap only
shrinks (tanh's slope is at most 1).

Row ``b`` of the batch is a request whose cache holds ``n_b = cache_seqlens[b]`` keys
and values; its ``S_q`` newest tokens (``q[b]``, usually ``S_q = 1``; more when
verifying speculative tokens) are the last ``S_q`` of them, causal among themselves
(bottom-right).

Decoding has too few queries to fill a GPU with one program per query tile, so the keys
are split instead (flash-decoding): each row's keys are cut into chunks of
:data:`KV_CHUNK` keys, counted from position 0; one program per (chunk, row, k/v head)
runs the online softmax over its chunk for every query head of the group and writes its
partial state ``(m, ℓ, acc)``; a second kernel merges a row's chunks **in chunk order**,
with the (m, ℓ) merge of the online-softmax chapter, and divides once.

Batch invariance by construction: the chunk boundaries, the tiles inside a chunk and the
merge order depend on the row's own length, the head_dim, dtype and GPU only, never on
the batch size, the other rows or the cache's capacity. So a row's output has the same
bits alone or in any batch, and the same from a paged cache as from a contiguous one.
Every load is masked to the row's keys ``[max(0, n_b - S_q - W + 1), n_b)``: a slot at
or past a row's length is never read.

Caches, in this package's heads-before-sequence layout:

* contiguous: ``(B, H_kv, S_max, D)``, row ``b``'s key ``j`` at ``[b, :, j]``;
* paged: ``(num_blocks, H_kv, block_size, D)`` with ``block_table``,
  ``(B, max_blocks)`` int32: row ``b``'s key ``j`` at
  ``[block_table[b, j // block_size], :, j % block_size]`` (vLLM's block table).
  Entries past a row's last block are never read (they may hold -1).

Either cache may be stored in fp8 (vLLM's convention, :func:`normbook.quantize_kv`):
``k8 = fp8(k / κ_k)`` with κ one number or one per k/v head, read as ``k8 · κ_k``.
The tiles are converted to q's dtype exactly and the scales multiply the scores and the
chunk's accumulator instead (:func:`decode_attention` derives it): half the bytes read,
the arithmetic of a 16-bit cache plus two fp32 roundings.
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, LOG2E, _capability, tile_config
from ._decode_attention_checks import check as _check
from ._decode_attention_checks import check_values as _check_values
from ._runtime import INTERPRET, device_guard
from ._triton_utils import round_to, tanh

# Keys per chunk: one program's share of a row. A constant, so that where a row is cut
# never depends on the batch. 128 keys give a 1K-token row 8 chunks per k/v head (64
# programs for 8 k/v heads) while the partial states stay ~2 % of the bytes read
# (R·(D + 2) fp32 per chunk against 2·128·D cache elements).
KV_CHUNK = 128
# Query rows (group heads × new tokens) per program: at least 16 (tl.dot's minimum).
MAX_ROWS = 64


@triton.jit
def _visible_keys(n, Sq, window, WINDOW: tl.constexpr, pad):
    """[lo, hi): the keys any of the row's Sq queries may see (all in the cache); a
    left-padded row's keys start at ``pad``."""
    lo = pad
    if WINDOW:
        # the first query sees its W - 1 predecessors
        lo = tl.maximum(n - Sq - window + 1, pad)
    return lo, n


@triton.jit
def _e4m3_from_bits(b):
    """fp8 e4m3fn bits (uint8) as fp16 values 2^-8 times theirs, exactly: fp16 has
    e4m3's 3 mantissa bits and more, its exponent bias is 15 against 7, so the 7 bits
    below the sign shift in as they are (subnormals too). For GPUs without fp8 e4m3
    (before sm_89): the caller folds the 2^8 into the scale."""
    b = b.to(tl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    f = h.to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), f)  # e4m3fn's NaN


@triton.jit
def _kv_tile(t, Q, E4M3_BITS: tl.constexpr, UPCAST: tl.constexpr):
    """An fp8 tile in q's dtype, exactly (4 significant bits and e5m2's exponents fit
    fp16 and bf16), or in fp32 where the interpreter's bf16 dot is broken."""
    if E4M3_BITS:
        t = _e4m3_from_bits(t)
        if Q.dtype.element_ty == tl.bfloat16:
            # fp16 → bf16 through fp32: before sm_80 only that cast is emulated
            t = t.to(tl.float32)
    t = t.to(Q.dtype.element_ty)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _decode_split(
    Q,
    K,
    V,
    Lens,
    Table,
    MidAcc,
    MidM,
    MidL,  # inputs; partial states (fp32)
    LeftPad,  # (B,) first key of each row (LEFTPAD)
    KScale,
    VScale,  # an fp8 cache's scales, one per k/v head (fp32)
    sqb,
    sqh,
    sqm,
    sqd,  # strides of Q (batch, head, seq, dim)
    # strides of K (batch or block, head, slot, dim)
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,  # strides of V
    stb,  # stride of the block table's rows
    sks,
    svs,  # strides of the scales (0: one for the tensor)
    # R = GROUP·Sq query rows per (row, k/v head)
    H_kv,
    GROUP,
    Sq,
    D,
    R,
    n_chunks,
    qk_scale,
    window,  # scale·log2(e), or scale/c with a cap; keys each query sees
    softcap,  # c·log2(e); None (a constant) without a cap
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,  # K, V in fp8, dequantized by KScale, VScale
    E4M3_BITS: tl.constexpr,  # K, V as uint8 holding e4m3fn (no fp8 e4m3 type)
    LEFTPAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile_m = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H_kv).to(tl.int64)  # int64: batch · stride can pass 2**31
    h_kv = (bh % H_kv).to(tl.int64)
    n = tl.load(Lens + b).to(tl.int32)
    pad = tl.load(LeftPad + b).to(tl.int32) if LEFTPAD else 0
    lo, hi = _visible_keys(n, Sq, window, WINDOW, pad)
    if chunk < lo // CHUNK or chunk * CHUNK >= hi:
        return  # no visible key in this chunk: the merge never reads its state

    # Query row r of the group: head h_kv·GROUP + r // Sq, new token r % Sq, at
    # position pos.
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    h = h_kv * GROUP + rows // Sq
    i = rows % Sq
    pos = n - Sq + i  # its position in the row; < 0 (sees nothing) only if n < Sq
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q = tl.load(
        Q + b * sqb + h[:, None] * sqh + i[:, None] * sqm + dims[None, :] * sqd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        # the interpreter's bf16 dot is broken; fp32 holds bf16 exactly
        q = q.to(tl.float32)
    if FP8:
        # One k/v head per program: its scales leave the tiles for the scores' and
        # the output's multipliers, s = (q·k8)·(k_scale·scale), o = v_scale·Σ p v8.
        k_scale = tl.load(KScale + h_kv * sks)
        v_scale = tl.load(VScale + h_kv * svs)
        if E4M3_BITS:
            k_scale = k_scale * 256.0  # exact: the tiles hold 2^-8 times the fp8
            v_scale = v_scale * 256.0
        qk_scale = qk_scale * k_scale

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Tiles start on multiples of BLOCK_N counted from key 0, as the chunks do.
    first = tl.maximum(chunk * CHUNK, (lo // BLOCK_N) * BLOCK_N)
    last = tl.minimum(chunk * CHUNK + CHUNK, hi)
    for start in range(first, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        # never a slot past the length (it may be NaN)
        col_ok = (cols >= lo) & (cols < hi)
        if PAGED:
            page = tl.load(Table + b * stb + cols // PAGE, mask=col_ok, other=0)
            page = page.to(tl.int64)
            k_off = page * skb + (cols % PAGE) * skn
            v_off = page * svb + (cols % PAGE) * svn
        else:
            k_off = b * skb + cols.to(tl.int64) * skn
            v_off = b * svb + cols.to(tl.int64) * svn
        kt = tl.load(
            K + h_kv * skh + k_off[None, :] + dims[:, None] * skd,
            mask=col_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # Kᵀ tile
        if FP8:
            kt = _kv_tile(kt, Q, E4M3_BITS, UPCAST)
        elif UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee", out_dtype=tl.float32) * qk_scale
        if SOFTCAP:
            # c·tanh(scale·q·k / c), in base 2: masked keys are set to -inf after it
            s = softcap * tanh(s)
        keep = col_ok[None, :] & row_ok[:, None] & (cols[None, :] <= pos[:, None])
        if WINDOW:
            keep = keep & (cols[None, :] > pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # no key seen yet: shift by 0
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        vt = tl.load(
            V + h_kv * svh + v_off[:, None] + dims[None, :] * svd,
            mask=col_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        # P in q's (the cache's unless fp8) dtype for the product, as FA does
        p_low = round_to(p, Q.dtype.element_ty)
        if FP8:
            vt = _kv_tile(vt, Q, E4M3_BITS, UPCAST)
        elif UPCAST:
            vt = vt.to(tl.float32)
        if UPCAST:
            p_low = p_low.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(
            p_low, vt, input_precision="ieee", out_dtype=tl.float32
        )
        m = m_new

    if FP8:
        acc = acc * v_scale
    # The chunk's partial state, unnormalized: the merge rescales and divides once.
    state = (bh * n_chunks + chunk).to(tl.int64) * R + rows
    tl.store(MidM + state, m, mask=row_ok)
    tl.store(MidL + state, l, mask=row_ok)
    tl.store(
        MidAcc + state[:, None] * D + dims[None, :],
        acc,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _decode_merge(
    MidAcc,
    MidM,
    MidL,
    Lens,
    LeftPad,
    O,
    LSE,  # (B, H, Sq) fp32, natural log (SAVE_LSE)
    sob,
    soh,
    som,  # strides of O (contiguous in dim)
    H_kv,
    GROUP,
    Sq,
    D,
    R,
    n_chunks,
    window,
    WINDOW: tl.constexpr,
    LEFTPAD: tl.constexpr,
    SAVE_LSE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_kv).to(tl.int64)
    h_kv = (bh % H_kv).to(tl.int64)
    n = tl.load(Lens + b).to(tl.int32)
    pad = tl.load(LeftPad + b).to(tl.int32) if LEFTPAD else 0
    lo, hi = _visible_keys(n, Sq, window, WINDOW, pad)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    dims = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dims < D)[None, :]

    # (m, ℓ, acc) merged chunk after chunk, in order: m = max(m_a, m_b),
    # ℓ = ℓ_a 2^(m_a - m) + ℓ_b 2^(m_b - m), acc likewise. Start from the empty state.
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for chunk in range(lo // CHUNK, tl.cdiv(hi, CHUNK)):
        state = (bh * n_chunks + chunk).to(tl.int64) * R + rows
        m_c = tl.load(MidM + state, mask=row_ok, other=float("-inf"))
        l_c = tl.load(MidL + state, mask=row_ok, other=0.0)
        acc_c = tl.load(
            MidAcc + state[:, None] * D + dims[None, :], mask=mask, other=0.0
        )
        m_new = tl.maximum(m, m_c)
        # both empty: stay (-inf, 0, 0)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        beta = tl.exp2(m_c - m_use)
        l = l * alpha + l_c * beta
        acc = acc * alpha[:, None] + acc_c * beta[:, None]
        m = m_new

    # Normalize once. A query that sees no key (n < Sq, or n = 0) has ℓ = 0: output 0.
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    h = h_kv * GROUP + rows // Sq
    i = rows % Sq
    o_ptr = O + b * sob + h[:, None] * soh + i[:, None] * som + dims[None, :]
    tl.store(o_ptr, round_to(out, O.dtype.element_ty), mask=mask)
    if SAVE_LSE:
        # log Σ e^s = ln 2 · (m + log2 ℓ) (m in base 2); +inf for a query that sees no
        # key, as normbook.attention and FlashAttention
        l_pos = tl.where(l > 0.0, l, 1.0)
        lse = tl.where(l > 0.0, (m + tl.log2(l_pos)) * 0.6931471805599453, float("inf"))
        H = H_kv * GROUP
        tl.store(LSE + (b * H + h) * Sq + i, lse, mask=row_ok)


def decode_config(head_dim: int, rows: int, dtype: torch.dtype, capability=None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of the split kernel: attention's key tile
    for this head_dim, dtype and GPU, and a query tile of the group's rows (at least
    16, tl.dot's minimum). A function of head_dim, rows = group · S_q, dtype and GPU:
    never of the batch."""
    block_m, block_n, block_d, num_warps = tile_config(head_dim, dtype, capability)
    block_m = min(max(16, triton.next_power_of_2(rows)), block_m, MAX_ROWS)
    return block_m, block_n, block_d, num_warps


def _forward(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table,
    scale,
    window,
    capacity,
    softcap=None,
    k_scale=None,
    v_scale=None,
    chunk=KV_CHUNK,
    e4m3_bits=None,
    cache_leftpad=None,
    lse=None,
):
    """Launch on checked inputs. ``chunk`` is for tests (more chunks at interpreter
    sizes), and ``e4m3_bits`` (None: where the GPU has no fp8 e4m3, before sm_89) reads
    an e4m3 cache as bytes, as on those GPUs. ``lse``: a (B, H, S_q) fp32 tensor the
    merge writes the log-sum-exp into."""
    B, H, Sq, D = q.shape
    H_kv = k_cache.shape[1]
    group = H // H_kv
    R = group * Sq
    out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    capability = _capability(q)
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps = decode_config(D, R, q.dtype, capability)
    assert chunk % BLOCK_N == 0
    fp8 = k_scale is not None
    if e4m3_bits is None:
        e4m3_bits = capability is not None and tuple(capability) < (8, 9)
    e4m3_bits = fp8 and e4m3_bits and k_cache.dtype == torch.float8_e4m3fn
    if e4m3_bits:  # the same bytes, read as uint8
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # Enough chunk programs for the longest row the cache can hold; those past a row's
    # length return at once. The capacity sizes the grid, never the work a row does.
    n_chunks = max(triton.cdiv(capacity, chunk), 1)
    mid_acc = torch.empty(
        (B * H_kv, n_chunks, R, D), dtype=torch.float32, device=q.device
    )
    mid_m = torch.empty((B * H_kv, n_chunks, R), dtype=torch.float32, device=q.device)
    mid_l = torch.empty_like(mid_m)
    paged = block_table is not None
    table = block_table if paged else cache_seqlens  # a placeholder pointer, never read
    row_tiles = triton.cdiv(R, BLOCK_M)
    with device_guard(q):
        _decode_split[(n_chunks, row_tiles, B * H_kv)](
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            table,
            mid_acc,
            mid_m,
            mid_l,
            cache_leftpad if cache_leftpad is not None else cache_seqlens,
            k_scale if fp8 else mid_m,  # placeholders, never read
            v_scale if fp8 else mid_m,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            block_table.stride(0) if paged else 0,
            k_scale.stride(0) if fp8 else 0,
            v_scale.stride(0) if fp8 else 0,
            H_kv,
            group,
            Sq,
            D,
            R,
            n_chunks,
            scale * LOG2E if softcap is None else scale / softcap,
            window or 0,
            # None binds as a constant: the uncapped kernel has the parameters it had
            None if softcap is None else softcap * LOG2E,
            PAGED=paged,
            PAGE=k_cache.shape[2] if paged else 1,
            WINDOW=window is not None,
            SOFTCAP=softcap is not None,
            UPCAST=INTERPRET,
            FP8=fp8,
            E4M3_BITS=e4m3_bits,
            LEFTPAD=cache_leftpad is not None,
            CHUNK=chunk,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
            num_warps=num_warps,
            **LAUNCH,
        )
        _decode_merge[(row_tiles, B * H_kv)](
            mid_acc,
            mid_m,
            mid_l,
            cache_seqlens,
            cache_leftpad if cache_leftpad is not None else cache_seqlens,
            out,
            lse if lse is not None else mid_m,  # a placeholder, never written
            *out.stride()[:3],
            H_kv,
            group,
            Sq,
            D,
            R,
            n_chunks,
            window or 0,
            WINDOW=window is not None,
            LEFTPAD=cache_leftpad is not None,
            SAVE_LSE=lse is not None,
            CHUNK=chunk,
            BLOCK_M=BLOCK_M,
            BLOCK_D=BLOCK_D,
            num_warps=4,
            **LAUNCH,
        )
    return out


def decode_attention(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    block_table=None,
    scale=None,
    window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    cache_leftpad=None,
    return_lse=False,
):
    r"""Attention of each row's ``S_q`` newest tokens over its KV cache (split-KV).

    Args:
        q: ``(B, H, S_q, D)``, float32, float16 or bfloat16, any strides: the
            ``S_q >= 1`` newest tokens of each row (``S_q > 1``: verifying speculative
            tokens).
        k_cache, v_cache: q's dtype, or both fp8 (``float8_e4m3fn`` or
            ``float8_e5m2``) with ``k_scale`` and ``v_scale``; q's device, any strides;
            contiguous ``(B, H_kv, S_max, D)`` or, with ``block_table``, paged
            ``(num_blocks, H_kv, block_size, D)``. ``H_kv`` divides ``H`` (grouped-query
            attention). The new tokens' keys and values are already in the cache, at
            positions ``cache_seqlens[b] - S_q … cache_seqlens[b] - 1``.
        cache_seqlens: ``(B,)`` int32 or int64, each row's length ``n_b`` in
            ``[0, capacity]``. Query ``i`` (position ``n_b - S_q + i``) sees keys up to
            its own position (causal, bottom-right); a query at a negative position
            (``n_b < S_q``, e.g. an empty row) sees no key and outputs **0**, as
            ``normbook.attention``'s fully masked rows do.
        block_table: ``None`` (contiguous) or ``(B, max_blocks)`` int32: row ``b``'s
            key ``j`` is in block ``block_table[b, j // block_size]``, slot
            ``j % block_size``. Only the entries of a row's first
            ``ceil(n_b / block_size)`` blocks are read.
        scale: multiplies the scores; default ``1/sqrt(D)``.
        window: each query sees at most ``window`` keys, itself and the ``window - 1``
            before (Mistral's sliding window, as ``normbook.attention``).
        softcap: ``None`` or 0 (no cap), or a finite ``c > 0``: each scaled score
            ``s`` becomes ``c·tanh(s/c)`` before the mask and the softmax (Gemma 2's
            attention soft-capping, FlashAttention's ``softcap``).
        k_scale, v_scale: an fp8 cache's scales (vLLM's convention, required with
            one, refused without): the cache holds ``k / k_scale`` rounded to fp8,
            so the key is ``k8 · k_scale``. A float or a 0-d (or ``(1,)``) float32
            tensor (per tensor, vLLM's ``_k_scale``), or ``(H_kv,)`` float32 (one per
            k/v head); finite and > 0. :func:`normbook.quantize_kv` makes them.
        cache_leftpad: ``None`` or ``(B,)`` int32/int64, FlashAttention's
            ``cache_leftpad``: row b's keys start at slot ``cache_leftpad[b]`` (a
            left-padded batch); it holds ``cache_seqlens[b] - cache_leftpad[b]`` keys,
            slots ``[cache_leftpad[b], cache_seqlens[b])``, and the slots before are
            never read. Each value in ``[0, cache_seqlens[b]]``.
        return_lse: also return the softmax's log-sum-exp, ``(B, H, S_q)`` fp32, the
            natural log of ``Σ_j exp(s_j)`` over the keys the query sees, ``s`` the
            scaled (and soft-capped) scores; ``+inf`` for a query that sees no key (as
            FlashAttention). Two calls on two halves of a row's keys merge into the
            whole: ``o = o₁ e^{lse₁ − lse} + o₂ e^{lse₂ − lse}``, ``lse = log(e^{lse₁}
            + e^{lse₂})``.

    With an fp8 cache the scales never touch a tile. An fp8 value (at most 4
    significant bits, e5m2's exponents within fp16's) is exact in fp16 and bf16, so a
    tile is converted to q's dtype without rounding and the products are the fp8
    values'; since a program serves one k/v head, whose scales are two numbers,

    .. math:: s_j = \text{scale}\,q\cdot(k8_j\,\kappa_k) = (q\cdot k8_j)\,
              (\text{scale}\,\kappa_k), \qquad
              o = \frac{\sum_j p_j\,(v8_j\,\kappa_v)}{\ell}
              = \kappa_v\,\frac{\sum_j p_j\,v8_j}{\ell}:

    ``scale·log2(e)·κ_k`` is one fp32 multiplier of the scores (one rounding more
    than a 16-bit cache's), and ``κ_v`` multiplies each chunk's accumulator once
    before the merge. Dequantizing the tile instead (``k8·κ_k`` rounded to bf16) would
    round every key. On GPUs without fp8 e4m3 (before sm_89) an e4m3 cache is read as
    bytes and turned into fp16 by shifting its bits (the value times 2^-8, which the
    scales take back exactly): the same results. P is rounded to q's dtype.

    Returns ``(B, H, S_q, D)`` in q's dtype (and the lse, with ``return_lse``). Scores
    and softmax state in fp32, probabilities rounded to q's dtype before multiplying V
    (as FlashAttention). A row's bits do not depend on the batch, the other rows, the
    capacity, or paged vs contiguous storage.

    Raises:
        TypeError / ValueError naming the bad argument, before any launch. Structural
        checks cost nothing; the value checks (every length in ``[0, capacity]``, every
        block-table entry a row uses in ``[0, num_blocks)``, a scale tensor's values)
        cost one host synchronization. NotImplementedError if an input requires grad.
    """
    scale, window, capacity, softcap, k_scale, v_scale = _check(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        scale,
        window,
        softcap,
        k_scale,
        v_scale,
    )
    if cache_leftpad is not None:
        if not isinstance(cache_leftpad, torch.Tensor):
            raise TypeError(
                "cache_leftpad must be None or a (B,) integer tensor, got "
                f"{type(cache_leftpad).__name__}"
            )
        _validate.check_index_vector(
            cache_leftpad, "cache_leftpad", q.shape[0], "one per row", "q", q
        )
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    out, lse = torch.ops.normbook.decode_attention(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        scale,
        window,
        capacity,
        softcap,
        k_scale,
        v_scale,
        cache_leftpad,
        return_lse,
    )
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- the operator


@torch.library.custom_op("normbook::decode_attention", mutates_args=())
def _op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    scale: float,
    window: int | None,
    capacity: int,
    softcap: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.decode_attention``: checked arguments (``_check``'s). The
    lengths, block-table entries and an fp8 cache's scales are checked here, before the
    launch: they are values (one host read). No autograd: the public function refuses
    inputs that require grad. Returns (out, lse), lse empty without return_lse."""
    B, H, Sq, _ = q.shape
    lse = torch.empty((B, H, Sq) if return_lse else (0,), dtype=torch.float32,
                      device=q.device)  # fmt: skip
    if q.numel() == 0:
        lse.fill_(float("inf"))
        return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse
    num_blocks = k_cache.shape[0]
    _check_values(cache_seqlens, block_table, capacity, num_blocks, k_scale, v_scale)
    if cache_leftpad is not None:
        pad, n = cache_leftpad.to(torch.int64), cache_seqlens.to(torch.int64)
        if bool(((pad < 0) | (pad > n)).any()):
            raise ValueError(
                "cache_leftpad must lie in [0, cache_seqlens[b]] in every row, got "
                f"{pad.tolist()} for lengths {n.tolist()}"
            )
    out = _forward(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        scale,
        window,
        capacity,
        softcap,
        k_scale,
        v_scale,
        cache_leftpad=cache_leftpad,
        lse=lse if return_lse else None,
    )
    return out, lse


@_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    block_table,
    scale,
    window,
    capacity,
    softcap,
    k_scale,
    v_scale,
    cache_leftpad=None,
    return_lse=False,
):
    B, H, Sq, _ = q.shape
    lse = q.new_empty((B, H, Sq) if return_lse else (0,), dtype=torch.float32)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse
