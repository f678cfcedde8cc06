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
"""

import numbers

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, LOG2E, _capability, tile_config
from ._runtime import INTERPRET, device_guard
from ._triton_utils import round_to, tanh
from .attention import DTYPES, MAX_HEAD_DIM

# Keys per chunk: one program's share of a row. A constant, so that where a row is cut
# never depends on the batch. 128 keys give a 1K-token row 8 chunks per k/v head (64
# programs for 8 k/v heads) while the partial states stay ~2 % of the bytes read
# (R·(D + 2) fp32 per chunk against 2·128·D cache elements).
KV_CHUNK = 128
# Query rows (group heads × new tokens) per program: at least 16 (tl.dot's minimum).
MAX_ROWS = 64


@triton.jit
def _visible_keys(n, Sq, window, WINDOW: tl.constexpr):
    """[lo, hi): the keys any of the row's Sq queries may see (all in the cache)."""
    lo = 0
    if WINDOW:
        # the first query sees its W - 1 predecessors
        lo = tl.maximum(n - Sq - window + 1, 0)
    return lo, n


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
    lo, hi = _visible_keys(n, Sq, window, WINDOW)
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
        if UPCAST:
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
        # P in V's dtype for the product, as FA does
        p_low = round_to(p, V.dtype.element_ty)
        if UPCAST:
            p_low = p_low.to(tl.float32)
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(
            p_low, vt, input_precision="ieee", out_dtype=tl.float32
        )
        m = m_new

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
    O,
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
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_kv).to(tl.int64)
    h_kv = (bh % H_kv).to(tl.int64)
    n = tl.load(Lens + b).to(tl.int32)
    lo, hi = _visible_keys(n, Sq, window, WINDOW)
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


def decode_config(head_dim: int, rows: int, dtype: torch.dtype, capability=None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of the split kernel: attention's key tile
    for this head_dim, dtype and GPU, and a query tile of the group's rows (at least
    16, tl.dot's minimum). A function of head_dim, rows = group · S_q, dtype and GPU:
    never of the batch."""
    block_m, block_n, block_d, num_warps = tile_config(head_dim, dtype, capability)
    block_m = min(max(16, triton.next_power_of_2(rows)), block_m, MAX_ROWS)
    return block_m, block_n, block_d, num_warps


# ---------------------------------------------------------------- arguments


def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _validate.check_device(t, name)


def _check_softcap(softcap, scale):
    """The cap c as a float, or None for none (None or 0)."""
    if isinstance(softcap, bool) or not (
        softcap is None or isinstance(softcap, numbers.Real)
    ):
        raise TypeError(
            f"softcap must be a real number or None, got {type(softcap).__name__}"
        )
    if softcap is None or softcap == 0:
        return None
    softcap = float(softcap)
    if not 0.0 < softcap < float("inf"):
        raise ValueError(
            f"softcap must be a finite number > 0 (None or 0: no cap), got {softcap}"
        )
    # The kernel multiplies by scale/c and c·log2(e), which must be normal fp32
    # numbers: c in about [1e-38, 1e36] at scale 1/√128, where models use tens.
    fp32 = torch.finfo(torch.float32)
    if not all(
        fp32.tiny <= x <= fp32.max
        for x in (softcap * LOG2E, abs(scale) / softcap or 1.0)
    ):
        raise ValueError(
            f"softcap = {softcap} with scale = {scale} leaves fp32's range: "
            "scale/softcap and softcap·log2(e) must be normal fp32 numbers"
        )
    return softcap


def _check(
    q, k_cache, v_cache, cache_seqlens, block_table, scale, window, softcap=None
):
    """Every structural check, before any launch. Returns (scale, window, capacity,
    softcap), softcap None when off."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(t, name)
        if t.dtype not in DTYPES:
            raise TypeError(
                f"{name} must be float32, float16 or bfloat16, got {t.dtype}"
            )
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions, got shape {tuple(t.shape)}"
            )
    B, H, Sq, D = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype, {q.dtype}, got {t.dtype}")
        _validate.check_same_device(name, t, "q", q)
        if t.shape[3] != D:
            raise ValueError(f"{name} must have q's head_dim, {D}, got {t.shape[3]}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache must have k_cache's shape, {tuple(k_cache.shape)}, "
            f"got {tuple(v_cache.shape)}"
        )
    H_kv = k_cache.shape[1]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"k_cache's heads ({H_kv}) must divide q's heads ({H}): "
            "grouped-query attention shares each k/v head among a "
            "group of q heads"
        )
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {D}")
    if Sq < 1:
        raise ValueError(
            f"q must hold at least one new token per row (dimension 2), got {Sq}"
        )
    _check_tensor(cache_seqlens, "cache_seqlens")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype}"
        )
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(
            f"cache_seqlens must have shape ({B},), one length per row of "
            f"q, got {tuple(cache_seqlens.shape)}"
        )
    _validate.check_same_device("cache_seqlens", cache_seqlens, "q", q)
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(
                f"a contiguous k_cache must have q's batch size, {B}, "
                f"got {k_cache.shape[0]} (pass block_table for a paged "
                "cache)"
            )
        capacity = k_cache.shape[2]
    else:
        _check_tensor(block_table, "block_table")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(
                f"block_table must have shape ({B}, max_blocks), got "
                f"{tuple(block_table.shape)}"
            )
        _validate.check_same_device("block_table", block_table, "q", q)
        page = k_cache.shape[2]
        if page < 1:
            raise ValueError(f"block_size (k_cache.shape[2]) must be >= 1, got {page}")
        capacity = block_table.shape[1] * page
    if scale is None:
        scale = D**-0.5
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
        window = int(window)
    softcap = _check_softcap(softcap, scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError(
            "normbook.decode_attention has no backward: q, "
            "k_cache or v_cache requires grad (decoding needs "
            "none; detach them)"
        )
    return scale, window, capacity, softcap


def _check_values(cache_seqlens, block_table, capacity, num_blocks):
    """The lengths (and the block-table entries a row uses) are in range: reading past
    them would touch memory that is not the row's. One host synchronization."""
    n = cache_seqlens.to(torch.int64)
    bad = [(n < 0).any(), (n > capacity).any()]
    if block_table is not None and block_table.numel():
        page = capacity // block_table.shape[1]
        used = (
            torch.arange(block_table.shape[1], device=n.device)[None, :]
            < ((n + page - 1) // page)[:, None]
        )
        bad.append((used & ((block_table < 0) | (block_table >= num_blocks))).any())
    flags = torch.stack(bad).tolist()  # the one synchronization
    if flags[0]:
        raise ValueError(f"cache_seqlens must be >= 0, got {n.tolist()}")
    if flags[1]:
        where = (
            "max_blocks · block_size" if block_table is not None else "k_cache.shape[2]"
        )
        raise ValueError(
            f"cache_seqlens must be <= the cache's capacity, {where} = "
            f"{capacity}, got a length of {int(n.max())}"
        )
    if len(flags) > 2 and flags[2]:
        raise ValueError(
            f"block_table entries a row uses must be in [0, {num_blocks}) "
            "(k_cache.shape[0] blocks)"
        )


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
    chunk=KV_CHUNK,
):
    """Launch on checked inputs. ``chunk`` is for tests (more chunks at interpreter
    sizes)."""
    B, H, Sq, D = q.shape
    H_kv = k_cache.shape[1]
    group = H // H_kv
    R = group * Sq
    out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps = decode_config(D, R, q.dtype, _capability(q))
    assert chunk % BLOCK_N == 0
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
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            block_table.stride(0) if paged else 0,
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
            out,
            *out.stride()[:3],
            H_kv,
            group,
            Sq,
            D,
            R,
            n_chunks,
            window or 0,
            WINDOW=window is not None,
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
):
    r"""Attention of each row's ``S_q`` newest tokens over its KV cache (split-KV).

    Args:
        q: ``(B, H, S_q, D)``, float32, float16 or bfloat16, any strides: the
            ``S_q >= 1`` newest tokens of each row (``S_q > 1``: verifying speculative
            tokens).
        k_cache, v_cache: q's dtype and device, any strides; contiguous
            ``(B, H_kv, S_max, D)`` or, with ``block_table``, paged
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

    Returns ``(B, H, S_q, D)`` in q's dtype. Scores and softmax state in fp32,
    probabilities rounded to the cache's dtype before multiplying V (as FlashAttention).
    A row's bits do not depend on the batch, the other rows, the capacity, or paged vs
    contiguous storage.

    Raises:
        TypeError / ValueError naming the bad argument, before any launch. Structural
        checks cost nothing; the value checks (every length in ``[0, capacity]``, every
        block-table entry a row uses in ``[0, num_blocks)``) cost one host
        synchronization. NotImplementedError if an input requires grad.
    """
    scale, window, capacity, softcap = _check(
        q, k_cache, v_cache, cache_seqlens, block_table, scale, window, softcap
    )
    return torch.ops.normbook.decode_attention(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        scale,
        window,
        capacity,
        softcap,
    )


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
) -> torch.Tensor:
    """``torch.ops.normbook.decode_attention``: checked arguments (``_check``'s). The
    lengths and block-table entries are checked here, before the launch: they are
    values (one host read). No autograd: the public function refuses inputs that
    require grad."""
    if q.numel() == 0:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check_values(cache_seqlens, block_table, capacity, k_cache.shape[0])
    return _forward(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        scale,
        window,
        capacity,
        softcap,
    )


@_op.register_fake
def _(
    q, k_cache, v_cache, cache_seqlens, block_table, scale, window, capacity, softcap
):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
