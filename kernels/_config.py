"""Launch configurations for row-wise kernels (one place, so that every kernel tunes alike)."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# A row up to this many bytes is held in registers and read once.
MAX_FUSED_BYTES = 65536
# Block width used when a row is wider than that and is processed in a loop.
LOOP_BLOCK_N = 4096
# Aim for at least this many elements per program when rows are short (e.g. head_dim = 128).
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
    """Where statistics are accumulated: fp64 for fp64 inputs (gradient checks), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_accumulation_dtype(dtype: torch.dtype):
    """:func:`accumulation_dtype` as the Triton dtype a kernel's ``ACC`` constexpr takes."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# Passed to every kernel launch (``kernel[grid](..., **LAUNCH)``). FP fusion off: a GPU then
# rounds every product and sum separately, as Triton's interpreter and PyTorch's eager ops do,
# so the bits the tests check on a CPU are the bits a GPU computes. These kernels are
# memory-bound, so the FMAs given up cost no time we expect to measure. Saying it explicitly
# also silences Triton 3.9's "TRITON_DEFAULT_FP_FUSION is unset" warning.
LAUNCH = {"enable_fp_fusion": False}
