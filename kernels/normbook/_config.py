"""Launch configurations (one place, so that every kernel tunes alike): the row-wise
kernels', the RMSNorm family's, LayerNorm's, qk_norm_rope's and attention's tiles.

Each op's forward and backward modules both read their tiles from here, so neither
imports the other."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._runtime import INTERPRET

# A row up to this many bytes is held in registers and read once.
MAX_FUSED_BYTES = 65536
# Block width used when a row is wider than that and is processed in a loop (also
# LayerNorm's: the column block of its looped forward and of its backward's row dot
# products).
LOOP_BLOCK_N = 4096
# Aim for at least this many elements per program when rows are short (e.g. head_dim =
# 128).
MIN_TILE = 4096


@dataclass(frozen=True)
class RowConfig:
    BLOCK_M: int
    BLOCK_N: int
    SINGLE_BLOCK: bool
    num_warps: int


def row_config(M: int, N: int, element_size: int) -> RowConfig:
    block_n = triton.next_power_of_2(N)
    single = block_n * element_size <= MAX_FUSED_BYTES
    if not single:
        block_n = LOOP_BLOCK_N
    block_m = 1
    if single:
        block_m = min(max(MIN_TILE // block_n, 1), triton.next_power_of_2(max(M, 1)))
    num_warps = min(max(block_m * block_n // 256, 1), 16)
    return RowConfig(block_m, block_n, single, num_warps)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where statistics are accumulated: fp64 for fp64 inputs (gradient checks), else
    fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_accumulation_dtype(dtype: torch.dtype):
    """:func:`accumulation_dtype` as the Triton dtype a kernel's ``ACC`` constexpr
    takes."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# Passed to every kernel launch (``kernel[grid](..., **LAUNCH)``). FP fusion off: a GPU
# then rounds every product and sum separately, as Triton's interpreter and PyTorch's
# eager ops do, so the bits the tests check on a CPU are the bits a GPU computes. These
# kernels are memory-bound, so the FMAs given up cost no time we expect to measure.
# Saying it explicitly also silences Triton 3.9's "TRITON_DEFAULT_FP_FUSION is unset"
# warning.
LAUNCH = {"enable_fp_fusion": False}


# ---------------------------------------------------------------- the RMSNorm family
#
# rms_norm and fused_add_rms_norm choose their tiles from N and the dtype only, never
# from M: the shape of a tile decides how the GPU splits a row's sum over threads, so a
# configuration that followed M would give a row different bits in a batch of 1 and a
# batch of 4096 (batch invariance). The limits keep every variant free of register
# spills and above one CTA per SM (python -m normbook.lab.inspector): a single-block
# row tile holds at most RMS_FWD_MAX_BLOCK elements in the forward (x only) and
# RMS_BWD_MAX_BLOCK in the backward (x, dy, γ and the dγ partial sums at once), spread
# over 16 warps: at most 16 (forward) or 8 (backward) fp32 values per thread and per
# array.
RMS_FWD_MAX_BLOCK = 8192
RMS_BWD_MAX_BLOCK = 4096
# Wider rows: the forward loops over blocks of RMS_LOOP_BLOCK_N; the backward sweeps
# column blocks of RMS_BWD_COL_BLOCK, RMS_BWD_COL_ROWS rows at a time
# (normbook.rms_norm, normbook.rms_norm_backward).
RMS_LOOP_BLOCK_N = 4096
RMS_BWD_COL_BLOCK = 1024
RMS_BWD_COL_ROWS = 4


def rms_config(N: int, element_size: int, backward: bool = False) -> RowConfig:
    """Launch configuration of the RMSNorm family's forward (or backward) for rows of N
    elements.

    A function of N and the element size only (see above). fp64 (gradient checks) halves
    the single-block limit: its values take two registers each."""
    block_n = triton.next_power_of_2(max(N, 1))
    limit = (RMS_BWD_MAX_BLOCK if backward else RMS_FWD_MAX_BLOCK) // max(
        1, element_size // 4
    )
    single = block_n <= limit
    if not single:
        block_n = RMS_BWD_COL_BLOCK if backward else RMS_LOOP_BLOCK_N
    block_m = (
        max(MIN_TILE // block_n, 1) if single else (RMS_BWD_COL_ROWS if backward else 1)
    )
    # The single-block backward holds x, dy, γ and the dγ partials: at 16 warps triton
    # 3.6's ptxas spilled 8 B at N = 2048 (fp16/bf16); 8 warps spill on neither 3.6 nor
    # 3.9.
    warps_cap = 8 if backward and single else 16
    num_warps = min(max(block_m * block_n // 256, 1), warps_cap)
    return RowConfig(block_m, block_n, single, num_warps)


# Rows of at least RMS_SPLIT_MIN_BYTES are split over programs. The split's second
# launch reads x again after every row has streamed through, from memory once the
# tensor passes L2; the single-program loop re-reads its row while it is still in L2,
# as long as the rows in flight fit there: an H100's 50 MiB L2 over its 132 SMs is
# about 390 KiB per SM, so a row of 512 KiB (262,144 bf16, 131,072 fp32) misses L2 on
# its re-read even at one program per SM. From there we expect the split to cost
# nothing at large M and to gain at decode, where one program per row leaves most SMs
# idle; below it, the loop (8,192 < N < the limit) spares large batches a third more
# traffic. Not measured on a GPU.
RMS_SPLIT_MIN_BYTES = 512 * 1024


def rms_split(N: int, element_size: int) -> bool:
    """Whether the RMSNorm family's forward splits a row over programs (two launches,
    normbook.rms_norm.split_launches): rows too wide for one block and of at least
    RMS_SPLIT_MIN_BYTES. A function of N and the element size only, never of M (see
    above)."""
    return (
        N > 0
        and not rms_config(N, element_size).SINGLE_BLOCK
        and N * element_size >= RMS_SPLIT_MIN_BYTES
    )


# ---------------------------------------------------------------- LayerNorm
#
# The tiles of normbook.layer_norm's forward (forward_config) and of its backward
# (normbook.layer_norm_backward.backward_plan), chosen from the row length N alone.


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    SINGLE_BLOCK: bool
    num_warps: int


def _warps(elements: int) -> int:
    # 8 values per thread per tensor at most 16 warps
    return min(max(elements // 256, 1), 16)


# ---------------------------------------------------------------- qk_norm_rope
#
# The tiles of normbook.qk_norm_rope's forward, and at half the tile of its backward
# (normbook.qk_norm_rope_backward._backward_config).


def _forward_config(D: int, tile: int = MIN_TILE) -> RowConfig:
    """Rows of ``tile`` elements per program, from head_dim alone: never from the number
    of rows, so a head is reduced in the same order whatever the batch and sequence
    length (batch invariance: its output bits do not depend on the other tokens of the
    batch)."""
    block_n = triton.next_power_of_2(D)
    block_m = max(1, tile // block_n)
    return RowConfig(block_m, block_n, True, min(max(block_m * block_n // 256, 1), 16))


# ---------------------------------------------------------------- attention
#
# The tiles of normbook.attention's forward (and its backward's preprocessing,
# normbook.attention_backward) and of normbook.decode_attention's split kernel, for the
# GPU they are launched on.

# exp(x) = exp2(x · log2 e): the GPU's fast exponential is base 2
LOG2E = 1.4426950408889634


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


def _capability(t: torch.Tensor):
    """The GPU's compute capability the tiles are chosen for; None in the interpreter"""
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device)
    # Compiled mode with CPU tensors: normbook.lab.inspector lowering for a chosen arch
    return None if INTERPRET else torch.cuda.get_device_capability()


# ---------------------------------------------------------------- GEMM
#
# The tiles of normbook.linear's matrix product, for the GPU it is launched on.


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def gemm_config(N: int, K: int, dtype: torch.dtype, capability=None) -> GemmConfig:
    """The tile of ``C (M, N) = A (M, K) · B (K, N)`` for a dtype and GPU (None: the
    interpreter, which takes sm_80's tiles).

    A function of N, K, the dtype and the GPU, never of M: the tile fixes the order in
    which K is summed, so a row of C has the same bits in a batch of 1 and of 4096
    (batch invariance). fp16/bf16 from sm_80 on run on tensor cores (mma.sync on sm_80,
    wgmma on sm_90): 128 × 128 tiles, K in steps of 64, 8 warps, 3 stages in flight on
    sm_80 and 4 on sm_90. The rest multiply with FMAs, the tile's products in
    registers, 64 × 64 × 32: fp16/bf16 on sm_75 (where this Triton emits no tensor-core
    code) over 8 warps, 2 stages (4 warps spilled 0.5 KB); fp32 (IEEE, no TF32) over 4
    warps, 1 stage (with 2, or 8 warps, ptxas spilled 4-20 B on sm_90 or sm_80). fp64
    (gradient checks): 32 × 32 × 16. A narrow N or a short K shrinks its side of the
    tile (to 16, tl.dot's least; K to 32 in fp16/bf16). ``ptxas -v``: no spill on
    sm_90a, sm_80 or sm_75 at Qwen3-8B's shapes and N = 1,000 (Triton 3.9), and every
    row load 128 bits wide where it is not an asynchronous copy."""
    cap = (8, 0) if capability is None else tuple(capability)
    if dtype in (torch.float16, torch.bfloat16):
        if cap >= (8, 0):
            bm, bn, bk, warps, stages = 128, 128, 64, 8, 4 if cap >= (9, 0) else 3
        else:
            bm, bn, bk, warps, stages = 64, 64, 32, 8, 2
    elif dtype == torch.float32:
        bm, bn, bk, warps, stages = 64, 64, 32, 4, 1
    else:
        bm, bn, bk, warps, stages = 32, 32, 16, 4, 2
    bn = min(bn, max(16, triton.next_power_of_2(max(N, 1))))
    # fp16/bf16 steps of K at least 32: a 64 × 16 tile over 8 warps would give each
    # thread 64 bits to load
    least_k = 32 if dtype in (torch.float16, torch.bfloat16) else 16
    bk = min(bk, max(least_k, triton.next_power_of_2(max(K, 1))))
    return GemmConfig(bm, bn, bk, warps, stages)
