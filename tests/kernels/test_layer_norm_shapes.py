"""normbook.layer_norm shaped for the hardware, checked without a GPU: the byte count of the
backward's partial sums, the number of programs, and batch invariance (a row's bits do not
depend on the other rows of the batch), in the interpreter.

Batch invariance is exact (torch.equal): the launch configuration is chosen from N alone
(forward_config, backward_plan's tiles), so a row is summed in the same order whatever M is;
only G, the number of dγ/dβ partial rows, depends on M, and dγ, dβ are sums over the batch.
"""

import importlib

import pytest
import torch
from conftest import randn

from normbook import layer_norm

ln_mod = importlib.import_module("normbook.layer_norm")
ln_bwd = importlib.import_module("normbook.layer_norm_backward")
ELEMENTS = 2**26  # normbook.lab.bench: M = ELEMENTS // N rows for each hidden size N
H100_SMS = 132
ELEMENT_SIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@pytest.mark.parametrize("dtype", list(ELEMENT_SIZE))
@pytest.mark.parametrize("params", [1, 2])
@pytest.mark.parametrize("n", [4096 * 2**i for i in range(7)])  # 4096 … 262,144
def test_partial_sums_are_at_most_5_percent_of_the_backward_bytes(dtype, params, n):
    """By byte count, at the benchmark's shapes on an H100 (132 SMs): the backward must read x and
    dy and write dx (3·M·N elements); the (G, N) fp32 partial sums of dγ (and dβ) are written once
    and read once by the second stage (8·G·N bytes each)."""
    m = ELEMENTS // n
    elt = ELEMENT_SIZE[dtype]
    plan = ln_bwd.backward_plan(m, n, elt, params, H100_SMS)
    essential = 3 * m * n * elt
    partial = params * plan.G * n * 4 * 2
    assert partial == ln_bwd.partial_traffic(plan, n, params)
    assert partial <= 0.05 * essential, (
        f"G = {plan.G}: {partial / essential:.1%} of {essential} bytes"
    )
    # ... and still enough programs for every SM (two each).
    col_blocks = 1 if plan.single.SINGLE_BLOCK else -(-n // plan.cols.BLOCK_N)
    assert plan.G * col_blocks >= 2 * H100_SMS


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("n", [4096, 8192])
def test_decode_backward_spreads_columns_over_programs(m, n):
    """A decode-sized batch of wide rows still gets column blocks in parallel (bf16)."""
    plan = ln_bwd.backward_plan(m, n, 2, 2, H100_SMS)
    if not plan.single.SINGLE_BLOCK:
        assert plan.G * (-(-n // plan.cols.BLOCK_N)) >= min(m, 2 * H100_SMS)


def test_configs_do_not_depend_on_the_number_of_rows():
    for n in (7, 1000, 4097, 20000, 262144):
        for elt in (2, 4):
            a, b = (
                ln_bwd.backward_plan(1, n, elt, 2, H100_SMS),
                ln_bwd.backward_plan(4096, n, elt, 2, H100_SMS),
            )
            assert (a.single, a.cols) == (b.single, b.cols)


@pytest.mark.parametrize(
    "dtype, n",
    [
        (torch.bfloat16, 7),
        (torch.float32, 1000),
        (torch.float32, 4097),
        (torch.bfloat16, 20000),
    ],
)
def test_batch_invariance_forward_and_backward(dtype, n):
    """The same row alone (M = 1) and inside batches of other sizes: identical bits for y, the
    saved statistics and dx — on every path (one block, looped forward, two-kernel backward)."""
    many = 3 if n > 4000 else 37
    x = (randn(many, n, scale=2.0) + 1.0).to(dtype)
    dy = randn(many, n, dtype=dtype)
    w, b = randn(n, dtype=dtype), randn(n, dtype=dtype)

    def run(rows):
        xr = x[rows].clone().requires_grad_()
        y = layer_norm(xr, w, b)
        y.backward(dy[rows])
        _, mean, rstd = ln_mod._forward(x[rows], w, b, 1e-5)
        return y.detach(), xr.grad, mean, rstd

    full = run(slice(None))
    for i in (0, many // 2, many - 1):
        alone = run(slice(i, i + 1))
        for got, want in zip(alone, full):
            assert torch.equal(got[0], want[i]), (
                f"row {i} of {many} differs from the row alone"
            )
    part = run(slice(1, many))  # another batch size, another position for each row
    for got, want in zip(part, full):
        assert torch.equal(got, want[1:])
