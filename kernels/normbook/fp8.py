r"""fp8 with block scales, as DeepSeek-V3 trains and serves: quantize, dequantize, and
a GEMM on the quantized operands.

**The formats.** e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits, bias 7, largest
value fmax = 448, no infinity, S.1111.111 is NaN) and e5m2 (``torch.float8_e5m2``: 2
mantissa bits, bias 15, fmax = 57,344, IEEE infinities and NaNs). A value of either
has at most 4 significant bits.

**Block scales.** ``x`` (M, K) is cut into blocks of (bm, bk) = (1, 128) (one per token
and 128 channels: DeepSeek-V3's activations) or (128, 128) (its weight tiles). Each
block b gets one fp32 scale and fp8 values

.. math:: s_b = \max\!\Bigl(\frac{\max_{i \in b} |x_i|}{f_{\max}},\ 2^{-126}\Bigr),
          \qquad q_i = \operatorname{fp8}\bigl(\operatorname{fl}(x_i / s_b)\bigr),

both divisions correctly rounded in fp32, the cast rounding to nearest-even exactly as
PyTorch's ``(x.float() / s).to(torch.float8_e4m3fn)`` (bit for bit: the tests check
it). ``q_i · s_b`` gives ``x_i`` back within half an fp8 spacing of ``|q_i|``, times
``s_b``: 2^-4 relative for e4m3, 2^-3 for e5m2, above their subnormal range.

* **Why 2^-126.** fp32's smallest normal number: a block of zeros gets s = 2^-126 and
  q = ±0 (0/s, never 0/0), which dequantizes to exact (signed) zeros. A nonzero amax
  below ``fmax · 2^-126`` would give a subnormal scale with few significant bits, and
  amax/s could then pass fmax (amax = 2^-140: s rounds to 2^-149, amax/s = 512 > 448);
  the floor keeps s normal, so there amax/s < fmax.
* **Saturation.** With s normal, fl(amax/fmax) = (amax/fmax)(1 + δ), |δ| ≤ 2^-24, so
  |x_i|/s ≤ fmax/(1 + δ) and fl(|x_i|/s) ≤ fmax(1 + 2^-23): far below fmax plus half
  the last spacing (448 + 16; 57,344 + 4,096), where rounding would go past fmax.
  The kernel still clamps x/s to ±fmax before rounding, a no-op by this argument.
* **NaN and Inf.** A block holding a NaN or an ±Inf has no meaningful scale: its scale
  is NaN and every q of the block is NaN (0x7F, in both formats), which is PyTorch's
  cast of x/NaN too; it dequantizes to NaN for the whole block (loud, never garbage).

**The cast, by hand.** Triton 3.9's interpreter casts fp32 to fp8 wrongly where the
rounding carries into the exponent (31.6 gives 16, not 32), and the GPU compiler has no
e4m3 type below sm_89. The kernels therefore never cast to or from fp8: they write and
read the bits (uint8 views of the fp8 tensors), rounding with the integer arithmetic of
PyTorch's own conversion (c10's ``fp8e4m3fn_from_fp32_value``), and decoding with a
shift of the exponent and mantissa fields; one code path on every GPU and the CPU.

**The GEMM.** ``linear_fp8`` computes y = x·wᵀ from x_q (M, K) with its (1, 128) or
(128, 128) scales and w_q (N, K) with its (128, 128) or (1, 128) scales. Its K loop
goes in blocks of 128, one scale per operand and block: the block's partial product
p = Σ_k xq_k·wq_k (a ``tl.dot``, fp32 accumulation; every product of two fp8 values is
exact in fp32) is scaled, (p · sx) · sw, and added to an fp32 accumulator: DeepSeek-V3's
promotion of each 128-long partial sum to full fp32. One rounding to ``out_dtype`` at
the end. The operands, by GPU:

* sm_89 and newer: fp8 operands straight into ``tl.dot`` (tensor cores: ``wgmma`` with
  e4m3/e5m2 on sm_90, ``mma`` on sm_89). On sm_90 the tensor core's own fp8
  accumulation keeps fewer than fp32's bits (DeepSeek-V3 measured about 14); the
  promotion every 128 products is what bounds that error.
* sm_80, sm_75 and the interpreter: Triton has no fp8 ``mma`` there (and no e4m3 type
  at all), so each tile's bits are decoded to fp16 and multiplied on fp16 tensor cores
  with fp32 accumulation. Exact: an e4m3 value has 4 significant bits and lies in
  [2^-9, 448], an e5m2 value 3 bits in [2^-16, 57,344]; fp16 holds 11 bits, normals
  from 2^-14 to 65,504 and subnormals down to 2^-24. (bf16 would hold them too, but
  sm_75 has no bf16 ``mma``.) The interpreter takes this path because its own fp8
  decoding turns NaN and Inf into finite numbers.

The tiles are a function of the GPU and the formats only, never of M: a row's bits do
not depend on its batch (batch invariance).
"""

import torch
import triton
import triton.language as tl

from . import _validate
from ._config import LAUNCH, _capability
from ._fp8_bits import fp8_bits, fp8_value, store_rounded, to_f32
from ._runtime import device_guard

#: The K extent of a scale block: the GEMM's K loop steps by it.
BLOCK_K = 128
BLOCKS = ((1, 128), (128, 128))
#: quantize's and dequantize's tiles: at most ROWS rows, at most TILE elements
ROWS, TILE = 32, 4096


#: fmt -> (its torch dtype, its largest value fmax); the kernels' E5M2 constexpr
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
BY_DTYPE = {dtype: name for name, (dtype, _) in FORMATS.items()}
IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _scale(amax, bad, FMAX: tl.constexpr):
    """max(amax / FMAX, 2^-126) correctly rounded; NaN where the block is not
    finite."""
    s = tl.math.div_rn(amax, tl.zeros_like(amax) + FMAX)
    s = tl.maximum(s, 1.1754943508222875e-38)  # 2^-126
    return tl.where(bad, float("nan"), s)


@triton.jit
def _quantized(x, s, bad, FMAX: tl.constexpr, E5M2: tl.constexpr):
    """The fp8 bits of x / s (correctly rounded division, then the cast); 0x7F (NaN)
    where the block is not finite."""
    v = tl.math.div_rn(x, s)
    v = tl.minimum(tl.maximum(v, -FMAX), FMAX)  # a no-op: see the docstring
    return tl.where(bad, 0x7F, fp8_bits(v, E5M2)).to(tl.uint8)


# ---------------------------------------------------------------- the kernels


@triton.jit
def _quantize_fp8_kernel(
    X,
    Q,
    S,  # pointers: x (M, K), q's bits (M, K) uint8, scales (M / BM, K / BK) fp32
    stride_x,
    stride_q,
    stride_s,  # row strides in elements (columns contiguous)
    M,
    NB,  # blocks of BK columns in a row: K / BK
    FMAX: tl.constexpr,
    E5M2: tl.constexpr,  # e5m2, else e4m3
    BM: tl.constexpr,  # block rows: 1 or 128
    BK: tl.constexpr,  # block columns: 128
    ROWS: tl.constexpr,  # rows a program holds at once
    CB: tl.constexpr,  # column blocks a program holds at once (BM = 1)
):
    if BM == 1:
        # ROWS × CB blocks of one row each, as a (ROWS, CB, BK) tile: one load, a
        # maximum per block along the last axis
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        blocks = tl.program_id(1) * CB + tl.arange(0, CB)
        r, b = rows[:, None, None], blocks[None, :, None]
        c = b * BK + tl.arange(0, BK)[None, None, :]
        mask = (r < M) & (b < NB)
        x = to_f32(tl.load(X + r * stride_x + c, mask=mask, other=0.0))
        finite = tl.abs(x) < float("inf")  # False for NaN too
        amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=2)
        bad = tl.max(tl.where(finite, 0, 1), axis=2) > 0
        s = _scale(amax, bad, FMAX)
        q = _quantized(x, s[:, :, None], bad[:, :, None], FMAX, E5M2)
        tl.store(Q + r * stride_q + c, q, mask=mask)
        s_mask = (rows < M)[:, None] & (blocks < NB)[None, :]
        tl.store(S + rows[:, None] * stride_s + blocks[None, :], s, mask=s_mask)
    else:
        # one BM × BK block, ROWS rows at a time: its maximum, then its values (the
        # second pass reads the block again, from L2)
        kb = tl.program_id(1)
        c = (kb * BK + tl.arange(0, BK))[None, :]
        first = tl.program_id(0).to(tl.int64) * BM
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        for i in range(0, BM, ROWS):
            r = (first + i + tl.arange(0, ROWS))[:, None]
            x = to_f32(tl.load(X + r * stride_x + c))
            finite = tl.abs(x) < float("inf")
            amax = tl.maximum(amax, tl.max(tl.where(finite, tl.abs(x), 0.0)))
            bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1)))
        s = _scale(amax, bad > 0, FMAX)
        for i in range(0, BM, ROWS):
            r = (first + i + tl.arange(0, ROWS))[:, None]
            x = to_f32(tl.load(X + r * stride_x + c))
            tl.store(Q + r * stride_q + c, _quantized(x, s, bad > 0, FMAX, E5M2))
        tl.store(S + tl.program_id(0) * stride_s + kb, s)


@triton.jit
def _dequantize_fp8_kernel(
    Q,
    S,
    Y,  # pointers: q's bits (M, K) uint8, scales (M / BM, K / BK), y (M, K)
    stride_q,
    stride_s,
    stride_y,
    M,
    NB,
    E5M2: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    CB: tl.constexpr,
):
    # a (ROWS, CB, BK) tile of q, and the (ROWS, CB) scales of its blocks
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    blocks = tl.program_id(1) * CB + tl.arange(0, CB)
    r, b = rows[:, None, None], blocks[None, :, None]
    c = b * BK + tl.arange(0, BK)[None, None, :]
    mask = (r < M) & (b < NB)
    bits = tl.load(Q + r * stride_q + c, mask=mask, other=0).to(tl.int32)
    s_mask = (rows < M)[:, None] & (blocks < NB)[None, :]
    s_ptrs = S + (rows // BM)[:, None] * stride_s + blocks[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=1.0)
    # q·s: q has 4 significant bits, s 24: one fp32 rounding, then one to Y's dtype
    y = fp8_value(bits, E5M2) * s[:, :, None]
    store_rounded(Y + r * stride_y + c, y, mask)


@triton.jit
def _linear_fp8_kernel(
    X,
    W,
    SX,
    SW,
    Y,  # pointers: x_q (M, K), w_q (N, K), their scales, y (M, N)
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_sx,
    stride_sw,
    stride_y,  # row strides in elements (columns contiguous)
    BMX: tl.constexpr,  # rows of an x scale block: 1 or 128
    BNW: tl.constexpr,  # rows of a w scale block: 128 or 1
    NATIVE: tl.constexpr,  # fp8 operands into tl.dot; else decoded to fp16
    X_E5M2: tl.constexpr,  # the operands' formats (the decoded path)
    W_E5M2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # one scale block: 128
    SUB_K: tl.constexpr,  # columns per tl.dot (BLOCK_K on the fp8 path)
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, SUB_K)
    in_m, in_n = rm < M, rn < N
    xs = X + rm[:, None] * stride_x + rk[None, :]
    ws = W + rn[None, :] * stride_w + rk[:, None]  # wᵀ's tile: (SUB_K, BLOCK_N)
    sxs = SX + (rm // BMX) * stride_sx
    sws = SW + (rn // BNW) * stride_sw
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):
        if NATIVE:
            a = tl.load(xs, mask=in_m[:, None], other=0.0)
            b = tl.load(ws, mask=in_n[None, :], other=0.0)
            p = tl.dot(a, b, out_dtype=tl.float32)
        else:
            # the bits, decoded exactly to fp16 (see the docstring), SUB_K columns
            # at a time (sm_75 multiplies with FMAs, which hold whole operands)
            p = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.static_range(0, BLOCK_K, SUB_K):
                a = tl.load(xs + kk, mask=in_m[:, None], other=0).to(tl.int32)
                b = tl.load(ws + kk, mask=in_n[None, :], other=0).to(tl.int32)
                a = fp8_value(a, X_E5M2).to(tl.float16)
                b = fp8_value(b, W_E5M2).to(tl.float16)
                p = tl.dot(a, b, p, out_dtype=tl.float32)
        sx = tl.load(sxs + kb, mask=in_m, other=0.0)
        sw = tl.load(sws + kb, mask=in_n, other=0.0)
        # the block's partial sum, scaled, promoted into the fp32 accumulator
        acc += (p * sx[:, None]) * sw[None, :]
        xs += BLOCK_K
        ws += BLOCK_K
    store_rounded(
        Y + rm[:, None] * stride_y + rn[None, :], acc, in_m[:, None] & in_n[None, :]
    )


# ---------------------------------------------------------------- launch plans


def native_fp8_dot(t: torch.Tensor) -> bool:
    """Whether ``linear_fp8`` gives ``tl.dot`` fp8 operands on ``t``'s device: on GPUs
    with fp8 tensor cores (sm_89 and newer). Elsewhere, and in the interpreter, the
    operands are decoded to fp16 first."""
    capability = _capability(t)
    return capability is not None and capability >= (8, 9)


def linear_config(native: bool, capability) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SUB_K, num_warps, num_stages) of ``linear_fp8``: from the
    GPU only, never from M (batch invariance). BLOCK_K is a scale block, 128.

    64 rows: a decode batch wastes less of a tile than with 128, a prefill still fills
    a Hopper warpgroup's 64-row ``wgmma``. The decoded path holds each tile in
    registers as fp32 then fp16 before the product: 64 × 64 on sm_80. sm_75 gets no
    ``mma`` from Triton 3.9 (FMAs): 32 × 32 tiles, 32 columns of K per product, 2
    warps (128-bit loads).
    Checked free of spills by ``python -m normbook.lab.inspector``."""
    if native:
        return 64, 128, BLOCK_K, 4, 4
    if capability is None:  # the interpreter: fewer, larger programs
        return 64, 128, BLOCK_K, 4, 1
    if capability >= (8, 0):
        return 64, 64, BLOCK_K, 4, 3
    return 32, 32, 32, 2, 1


def _tile(M: int, K: int) -> tuple[int, int, int]:
    """(ROWS, CB, num_warps) of quantize's and dequantize's (ROWS, CB, 128) tiles: up
    to TILE elements, few rows when M is small (decode) and more column blocks then,
    so that each thread still loads 16 contiguous bytes. Nothing is summed across a
    tile, so following M changes no bit."""
    rows = min(ROWS, triton.next_power_of_2(max(M, 1)))
    cb = min(TILE // (rows * BLOCK_K), triton.next_power_of_2(max(K // BLOCK_K, 1)))
    return rows, cb, min(max(rows * cb * BLOCK_K // 512, 1), 8)


# ---------------------------------------------------------------- launchers


def _forward(x2d: torch.Tensor, bm: int, bk: int, fmt: str):
    """(q, scale) of ``x2d`` (M, K), blocks (bm, bk), in format ``fmt``."""
    M, K = x2d.shape
    dtype, fmax = FORMATS[fmt]
    q = torch.empty((M, K), dtype=dtype, device=x2d.device)
    s = torch.empty((M // bm, K // bk), dtype=torch.float32, device=x2d.device)
    if q.numel() == 0:
        return q, s
    bits = q.view(torch.uint8)
    rows, cb, warps = _tile(M, K) if bm == 1 else (ROWS, 1, 4)
    grid = (triton.cdiv(M, rows), triton.cdiv(K // bk, cb))
    with device_guard(x2d):
        _quantize_fp8_kernel[grid if bm == 1 else (M // bm, K // bk)](
            x2d,
            bits,
            s,
            x2d.stride(0),
            bits.stride(0),
            s.stride(0),
            M,
            K // bk,
            FMAX=fmax,
            E5M2=fmt == "e5m2",
            BM=bm,
            BK=bk,
            ROWS=rows,
            CB=cb,
            num_warps=warps,
            **LAUNCH,
        )
    return q, s


def _dequantize(q: torch.Tensor, s: torch.Tensor, bm: int, bk: int, out_dtype):
    M, K = q.shape
    y = torch.empty((M, K), dtype=out_dtype, device=q.device)
    if y.numel() == 0:
        return y
    bits = q.view(torch.uint8)
    rows, cb, warps = _tile(M, K)
    with device_guard(q):
        _dequantize_fp8_kernel[(triton.cdiv(M, rows), triton.cdiv(K // bk, cb))](
            bits,
            s,
            y,
            bits.stride(0),
            s.stride(0),
            y.stride(0),
            M,
            K // bk,
            E5M2=q.dtype == torch.float8_e5m2,
            BM=bm,
            BK=bk,
            ROWS=rows,
            CB=cb,
            num_warps=warps,
            **LAUNCH,
        )
    return y


def _linear(x_q, x_s, w_q, w_s, out_dtype, bmx: int, bnw: int):
    (M, K), N = x_q.shape, w_q.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if y.numel() == 0:
        return y
    if K == 0:
        return y.zero_()
    native = native_fp8_dot(x_q)
    block_m, block_n, sub_k, warps, stages = linear_config(native, _capability(x_q))
    # the decoded path reads the bits: no fp8 type reaches the compiler
    a, b = (x_q, w_q) if native else (x_q.view(torch.uint8), w_q.view(torch.uint8))
    with device_guard(x_q):
        _linear_fp8_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
            a,
            b,
            x_s,
            w_s,
            y,
            M,
            N,
            K,
            a.stride(0),
            b.stride(0),
            x_s.stride(0),
            w_s.stride(0),
            y.stride(0),
            BMX=bmx,
            BNW=bnw,
            NATIVE=native,
            X_E5M2=x_q.dtype == torch.float8_e5m2,
            W_E5M2=w_q.dtype == torch.float8_e5m2,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=BLOCK_K,
            SUB_K=sub_k,
            num_warps=warps,
            num_stages=stages,
            **LAUNCH,
        )
    return y


# ---------------------------------------------------------------- the operators
#
# fp8 inputs cross the schemas as their bytes (uint8) and a flag for the format:
# opcheck's schema check compares every input before and after the call with
# torch.allclose, which has no fp8 kernel on the CPU.


def _fp8(bits: torch.Tensor, e5m2: bool) -> torch.Tensor:
    bits = _validate.as_rows(bits)
    return bits.view(torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn)


@torch.library.custom_op("normbook::quantize_fp8", mutates_args=())
def _quantize_op(
    x: torch.Tensor, block_m: int, block_k: int, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.normbook.quantize_fp8``: (q, scale) of checked inputs."""
    return _forward(_validate.as_rows(x), block_m, block_k, fmt)


@_quantize_op.register_fake
def _(x, block_m, block_k, fmt):
    M, K = x.shape
    q = x.new_empty((M, K), dtype=FORMATS[fmt][0])
    return q, x.new_empty((M // block_m, K // block_k), dtype=torch.float32)


@torch.library.custom_op("normbook::dequantize_fp8", mutates_args=())
def _dequantize_op(
    q_bits: torch.Tensor,
    scale: torch.Tensor,
    block_m: int,
    block_k: int,
    e5m2: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch.ops.normbook.dequantize_fp8``: q · scale, rounded once to out_dtype."""
    q, s2d = _fp8(q_bits, e5m2), _validate.as_rows(scale)
    return _dequantize(q, s2d, block_m, block_k, out_dtype)


@_dequantize_op.register_fake
def _(q_bits, scale, block_m, block_k, e5m2, out_dtype):
    return q_bits.new_empty(q_bits.shape, dtype=out_dtype)


@torch.library.custom_op("normbook::linear_fp8", mutates_args=())
def _linear_op(
    x_bits: torch.Tensor,
    x_scale: torch.Tensor,
    w_bits: torch.Tensor,
    w_scale: torch.Tensor,
    x_e5m2: bool,
    w_e5m2: bool,
    out_dtype: torch.dtype,
    block_xm: int,
    block_wn: int,
) -> torch.Tensor:
    """``torch.ops.normbook.linear_fp8``: x·wᵀ from the quantized operands."""
    x_q, w_q = _fp8(x_bits, x_e5m2), _fp8(w_bits, w_e5m2)
    sx, sw = _validate.as_rows(x_scale), _validate.as_rows(w_scale)
    return _linear(x_q, sx, w_q, sw, out_dtype, block_xm, block_wn)


@_linear_op.register_fake
def _(x_bits, x_scale, w_bits, w_scale, x_e5m2, w_e5m2, out_dtype, *blocks):
    return x_bits.new_empty((x_bits.shape[0], w_bits.shape[0]), dtype=out_dtype)


# ---------------------------------------------------------------- argument checks


def _check_tensor(t, name: str, dtypes, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {what}, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    _validate.check_device(t, name)
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, but the fp8 calls have no backward: pass "
            f"{name}.detach() (or call under torch.no_grad())"
        )


def _check_block(block, name: str) -> tuple[int, int]:
    try:
        b = tuple(int(v) for v in block)
        ok = b in BLOCKS and all(not isinstance(v, bool) for v in block)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be (1, 128) or (128, 128), got {block!r}")
    return b


def _check_divisible(t, name: str, block, block_name: str) -> None:
    (M, K), (bm, bk) = t.shape, block
    if M % bm or K % bk:
        raise ValueError(
            f"{name}'s shape {tuple(t.shape)} is not a whole number of {block_name} "
            f"{tuple(block)}: rows must divide by {bm} and columns by {bk}"
        )


def _check_scale(s, name: str, shape: tuple, like, like_name: str) -> None:
    _check_tensor(s, name, (torch.float32,), "float32")
    if tuple(s.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} (one scale per block of {like_name}), "
            f"got {tuple(s.shape)}"
        )
    _validate.check_same_device(name, s, like_name, like)


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in IN_DTYPES:
        raise TypeError(
            f"out_dtype must be torch.float32, torch.float16 or torch.bfloat16, got "
            f"{out_dtype!r}"
        )


_FP8 = "torch.float8_e4m3fn or torch.float8_e5m2"


# ---------------------------------------------------------------- the public calls


def quantize_fp8(x: torch.Tensor, *, block=(1, 128), fmt: str = "e4m3"):
    r"""``x`` in fp8 with one fp32 scale per block: ``(q, scale)``.

    Args:
        x: (M, K), float32, float16 or bfloat16, on the kernels' device; rows may be
            strided (the last dimension contiguous, else copied once).
        block: (1, 128), one scale per token and 128 channels (DeepSeek-V3's
            activations), or (128, 128) (its weights); M and K must divide by it.
        fmt: "e4m3" (``torch.float8_e4m3fn``, fmax 448) or "e5m2"
            (``torch.float8_e5m2``, fmax 57,344).

    Returns ``q`` (M, K) in the fp8 dtype and ``scale`` (M / bm, K / bn) float32, with
    ``scale = max(amax / fmax, 2^-126)`` per block (an all-zero block: 2^-126, and q
    exact zeros) and ``q`` equal, bit for bit, to PyTorch's
    ``(x.float() / scale).to(fp8)`` with the scale broadcast over its block. A block
    holding NaN or ±Inf gets scale NaN and NaN values. Forward only: an ``x`` that
    requires grad is refused.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _check_tensor(x, "x", IN_DTYPES, "float32, float16 or bfloat16")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    bm, bk = _check_block(block, "block")
    _check_divisible(x, "x", (bm, bk), "block")
    return torch.ops.normbook.quantize_fp8(x, bm, bk, fmt)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block=(1, 128),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    r"""``q · scale``, the scale broadcast over its block, rounded once to
    ``out_dtype``: PyTorch's ``(q.float() * scale).to(out_dtype)`` bit for bit.

    Args:
        q: (M, K), ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: (M / bm, K / bn) float32, on q's device.
        block: (1, 128) or (128, 128), as q was quantized.
        out_dtype: torch.float32, torch.float16 or torch.bfloat16.

    Forward only. Raises TypeError / ValueError naming the bad argument, before any
    kernel is launched.
    """
    _check_tensor(q, "q", tuple(BY_DTYPE), _FP8)
    bm, bk = _check_block(block, "block")
    _check_divisible(q, "q", (bm, bk), "block")
    shape = (q.shape[0] // bm, q.shape[1] // bk)
    _check_scale(scale, "scale", shape, q, "q")
    _check_out_dtype(out_dtype)
    e5m2 = q.dtype == torch.float8_e5m2
    bits = q.view(torch.uint8)
    return torch.ops.normbook.dequantize_fp8(bits, scale, bm, bk, e5m2, out_dtype)


def linear_fp8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    block_x=(1, 128),
    block_w=(128, 128),
) -> torch.Tensor:
    r"""y = x·wᵀ from block-quantized operands (``quantize_fp8``'s outputs), fp32
    inside, one rounding to ``out_dtype``.

    Args:
        x_q: (M, K), ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; K divides by
            128.
        x_scale: float32, one per block of ``block_x``: (M, K / 128) for (1, 128),
            (M / 128, K / 128) for (128, 128).
        w_q: (N, K), fp8 (either format); ``w_scale`` float32 per block of
            ``block_w``: (N / 128, K / 128) for (128, 128), (N, K / 128) for (1, 128).
        out_dtype: torch.bfloat16 (default), torch.float16 or torch.float32.

    Each 128-long block of K is multiplied on tensor cores, in fp8 on sm_89 and newer
    and in fp16 (exact) below, scaled by its two scales and added to an fp32
    accumulator (the module's docstring). The tiles do not depend on M: a row's
    result is the same bits in any batch. ``torch._scaled_mm`` computes the same on a
    GPU with fp8 tensor cores; this is the kernel to read. Forward only.

    Raises:
        TypeError / ValueError naming the bad argument, before any kernel is launched.
    """
    _check_tensor(x_q, "x_q", tuple(BY_DTYPE), _FP8)
    _check_tensor(w_q, "w_q", tuple(BY_DTYPE), _FP8)
    _validate.check_same_device("w_q", w_q, "x_q", x_q)
    if w_q.shape[1] != x_q.shape[1]:
        raise ValueError(
            f"w_q must have x_q's K = {x_q.shape[1]} columns, got shape "
            f"{tuple(w_q.shape)}"
        )
    bx = _check_block(block_x, "block_x")
    bw = _check_block(block_w, "block_w")
    _check_divisible(x_q, "x_q", bx, "block_x")
    _check_divisible(w_q, "w_q", bw, "block_w")
    (M, K), N = x_q.shape, w_q.shape[0]
    _check_scale(x_scale, "x_scale", (M // bx[0], K // BLOCK_K), x_q, "x_q")
    _check_scale(w_scale, "w_scale", (N // bw[0], K // BLOCK_K), x_q, "x_q")
    _check_out_dtype(out_dtype)
    x_e5m2, w_e5m2 = (t.dtype == torch.float8_e5m2 for t in (x_q, w_q))
    x_bits, w_bits = x_q.view(torch.uint8), w_q.view(torch.uint8)
    return torch.ops.normbook.linear_fp8(
        x_bits, x_scale, w_bits, w_scale, x_e5m2, w_e5m2, out_dtype, bx[0], bw[0]
    )


__all__ = ["quantize_fp8", "dequantize_fp8", "linear_fp8"]
