"""The RMSNorm family's kernels shaped for a GPU, checked without one.

* Batch invariance: a row's outputs (y, and dx in the backward) have the same bits whatever
  the number of rows around it. The launch configuration is a function of N and the dtype only
  (``normbook._config.rms_config`` takes no M), so on a GPU every row is reduced by the same
  threads in the same order; here the interpreter checks the bits.
* Partial-sum traffic of dγ, by byte count: at most 5 % of the bytes the backward must move
  anyway, for every benchmark shape N = 4096 … 262,144 (M = 2**26 / N, normbook.lab.bench) on the
  SM counts of an H100 (132), A100 (108) and T4 (40).
"""

import importlib
import inspect

import pytest
import torch
from conftest import randn

from normbook import fused_add_rms_norm, rms_norm
from normbook._config import rms_config
from normbook._reduce import MAX_PARTIAL_SHARE

rms_bwd = importlib.import_module("normbook.rms_norm_backward")


def test_configuration_does_not_depend_on_the_number_of_rows():
    assert "M" not in inspect.signature(rms_config).parameters


@pytest.mark.parametrize(
    "dtype, n", [(torch.bfloat16, 1000), (torch.float32, 20000), (torch.float16, 256)]
)
def test_a_row_has_the_same_bits_in_any_batch(dtype, n):
    """Row 0 alone, and as row 13 of 24 (tiles of several rows for N = 256; the looped forward
    and the two-step backward for 20000 fp32 values), forward and backward, both functions."""
    batch = randn(24, n, dtype=dtype, scale=2.0)
    dy = randn(24, n, dtype=dtype)
    w = randn(n, dtype=dtype)
    one, dy_one = batch[13:14].clone(), dy[13:14].clone()
    for mode in ("llama", "gemma"):
        outs = []
        for x, g in ((batch, dy), (one, dy_one)):
            xg = x.clone().requires_grad_()
            y = rms_norm(xg, w, 1e-6, casting_mode=mode)
            y.backward(g)
            outs.append((y.detach(), xg.grad))
        (y_b, dx_b), (y_1, dx_1) = outs
        assert torch.equal(y_b[13:14], y_1) and torch.equal(dx_b[13:14], dx_1)
    r = randn(24, n, dtype=dtype)
    y_b, h_b = fused_add_rms_norm(batch, r, w)
    y_1, h_1 = fused_add_rms_norm(one, r[13:14].clone(), w)
    assert torch.equal(y_b[13:14], y_1) and torch.equal(h_b[13:14], h_1)


BENCH_N = [4096 * 2**k for k in range(7)]  # 4096 … 262,144


@pytest.mark.parametrize("sms", [132, 108, 40])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("n", BENCH_N)
def test_partial_sum_traffic_is_at_most_five_percent(n, element_size, sms):
    """Essential bytes: x and dy read, dx written (M·N each), γ read and dγ written (N each).
    The (G, N) fp32 partial sums are written once and read once (no read-modify-write)."""
    m = 2**26 // n
    cfg, G, col_blocks, essential, partial = rms_bwd.backward_plan(
        m, n, element_size, element_size, 4, sms=sms
    )
    assert essential == 3 * m * n * element_size + 2 * n * element_size
    assert partial == 2 * G * n * 4
    assert partial <= MAX_PARTIAL_SHARE * essential, (G, partial / essential)
    # and enough programs to fill every SM at least once
    assert G * col_blocks >= sms


def test_the_wide_backward_writes_each_partial_once(monkeypatch, poison_empty):
    """The partial buffer is allocated uninitialised (poisoned here): a kernel that read it
    before writing, or skipped an element, would put NaN into dγ."""
    x, w, dy = randn(9, 20000), randn(20000), randn(9, 20000)
    assert not rms_config(20000, 4, backward=True).SINGLE_BLOCK
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(xg, wg).backward(dy)
    assert torch.isfinite(wg.grad).all() and torch.isfinite(xg.grad).all()
