"""Deterministic column sums for the backward kernels' parameter gradients.

A parameter gradient such as dγ = Σ_rows dy ⊙ x̂ sums over every row of the batch.
Atomic adds from many programs would make the order of that sum, and so its last bits,
change from run to run. Instead the reduction has two stages, both in a fixed order:

1. the backward kernel runs a fixed number ``G`` of programs (:func:`num_partials`);
   program ``p`` handles row tiles ``p, p + G, p + 2G, ...`` and writes the sum over its
   rows into row ``p`` of a ``(G, N)`` buffer in the accumulation dtype (fp32, fp64 for
   fp64 inputs);
2. :func:`sum_partials` adds the ``G`` rows of that buffer column by column with a small
   kernel.

Same shapes, same device: same ``G``, same order, same bits.
"""

import torch
import triton
import triton.language as tl

from ._config import LAUNCH
from ._runtime import DEVICE, INTERPRET
from ._triton_utils import round_to

# Partial-sum rows per streaming multiprocessor: enough programs to fill a GPU, few
# enough that the (G, N) buffer stays small next to x.
PROGRAMS_PER_SM = 2
# In the interpreter programs run one after another, so their number only sets the
# buffer size.
INTERPRETER_PROGRAMS = 4


def num_partials(num_tiles: int) -> int:
    """How many programs (= rows of the partial-sum buffer) a backward kernel
    launches."""
    if DEVICE.type == "cuda" and not INTERPRET:
        sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        cap = PROGRAMS_PER_SM * sm_count
    else:
        cap = INTERPRETER_PROGRAMS
    return max(1, min(num_tiles, cap))


#: The RMSNorm family bounds G so that the partial sums' traffic (each written once and
#: read once, in the accumulation dtype) is at most this share of the bytes its backward
#: moves anyway.
MAX_PARTIAL_SHARE = 0.05


def partial_traffic_bytes(G: int, N: int, acc_size: int = 4) -> int:
    """Bytes the (G, N) buffer of partial sums costs: written once by the kernel, read
    once by :func:`sum_partials`."""
    return 2 * G * N * acc_size


def num_partials_within(
    num_tiles: int,
    N: int,
    essential_bytes: int,
    acc_size: int = 4,
    col_blocks: int = 1,
    sms: int | None = None,
) -> int:
    """Rows of partial sums for a backward whose essential traffic is
    ``essential_bytes``.

    The largest G with ``partial_traffic_bytes(G) <= MAX_PARTIAL_SHARE *
    essential_bytes``, and no more than the programs that fill the GPU
    (``PROGRAMS_PER_SM`` per SM, counting the ``col_blocks`` programs that share a row
    of partial sums) or the row tiles there are. ``sms`` overrides the device's SM count
    (for byte-count tests of other GPUs)."""
    budget = int(MAX_PARTIAL_SHARE * essential_bytes) // partial_traffic_bytes(
        1, N, acc_size
    )
    if sms is None and DEVICE.type == "cuda" and not INTERPRET:
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    if sms is None:
        cap = INTERPRETER_PROGRAMS
    else:
        cap = max(1, PROGRAMS_PER_SM * sms // col_blocks)
    return max(1, min(num_tiles, cap, budget))


@triton.jit
def _sum_partials(
    P,
    Out,  # pointers: (G, N) partial sums, (N,) result
    G,
    N,  # rows of partial sums, columns
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # Accumulate BLOCK_G rows at a time, in the partials' dtype (fp32 or fp64), always
    # in the same order.
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=P.dtype.element_ty)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_mask[None, :]
        acc += tl.load(
            P + g.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0
        )
    # One fixed reduction tree over the BLOCK_G lanes, one rounding to the parameter's
    # dtype.
    total = tl.sum(acc, axis=0)
    tl.store(Out + cols, round_to(total, Out.dtype.element_ty), mask=col_mask)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of a contiguous ``(G, N)`` buffer, in a fixed order, returned in
    ``dtype``."""
    G, N = partial.shape
    out = torch.empty((N,), dtype=dtype, device=partial.device)
    if N == 0:
        return out
    if G == 0:
        return out.zero_()
    # On a GPU, narrow column blocks give many programs; in the interpreter, wide ones
    # give few.
    block_n = min(triton.next_power_of_2(N), 256 if not INTERPRET else 4096)
    block_g = min(triton.next_power_of_2(G), max(1, 4096 // block_n))
    _sum_partials[(triton.cdiv(N, block_n),)](
        partial, out, G, N, BLOCK_G=block_g, BLOCK_N=block_n, **LAUNCH
    )
    return out
