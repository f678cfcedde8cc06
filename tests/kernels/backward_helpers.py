"""Tolerances for gradients computed by the backward kernels, shared by the *_backward tests.

A gradient such as RMSNorm's dx = (g − x̂·mean(x̂ ⊙ g)) / r is a *difference* of terms that may
cancel, so its error is not relative to the result but to the size of the terms:

- the kernel works in fp32 on the same (already rounded) inputs as the float64 reference; every
  product errs by 2**-24 relatively and a sum of n terms by at most about log2(n)·2**-24 times the
  sum of their absolute values (a tree reduction; the wide-row path adds a sequential sum over
  ≤ 64 blocks). For every size used here that is below 1e-5 times the terms' magnitude ``scale``,
  the same constant as :func:`conftest.norm_tolerance` uses for the statistics;
- the result is rounded once to the output dtype: at most u·|result|, u the dtype's unit roundoff;
- fp16 results below 2**-14 are subnormal and carry an absolute error up to 2**-25.

So every element must satisfy |got − ref| ≤ u·|ref| + 1e-5·scale (+ 2**-24 for fp16).
"""

import pytest
import torch
from conftest import LOW_PRECISION, UNIT_ROUNDOFF

#: The (n, dtype) rows of the normalization backward tests. Every dtype at 1, 7, 1000 and 4097
#: elements: a row in one block, and past the backward's single block (RMSNorm's 4,096
#: elements, LayerNorm's 8 KiB: any dtype at 4097), so every dtype runs the column sweeps.
#: The widest row, 262,147 elements, in fp32 only: what it adds (RMSNorm's forward split in two
#: launches from 512 KiB, 257 column blocks of 1,024) depends on bytes and N, not on the dtype,
#: and fp32 is the widest row in bytes. fp16 and bf16 run the looped forward of both norms at
#: 33,001 instead (LayerNorm's forward holds a 2-byte row in one block up to 8,192 elements, so
#: 4097 does not loop there). Measured here: fp16 and bf16 at 262,147 took 2 to 9 s each in
#: the interpreter, a quarter of these files' time; 33,001 costs an eighth of that. The forward
#: tests keep every dtype at 262,147, the split forward in fp16 and bf16 included.
#: test_rms_norm_backward and test_layer_norm_backward check that these rows reach those paths.
NORM_BACKWARD_CASES = [
    pytest.param(n, dt, id=f"{n}-{str(dt)[6:]}")
    for n in (1, 7, 1000, 4097)
    for dt in LOW_PRECISION
] + [
    pytest.param(262147, torch.float32, id="262147-float32"),
    pytest.param(33001, torch.float16, id="33001-float16"),
    pytest.param(33001, torch.bfloat16, id="33001-bfloat16"),
]

FP32_SUM_RTOL = 1e-5


def grad_bound(
    ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Per-element bound on |got − ref| for a gradient stored in ``dtype`` (see the module docstring)."""
    u = UNIT_ROUNDOFF[dtype]
    fp = 1e-12 if dtype == torch.float64 else FP32_SUM_RTOL
    atol = 2.0**-24 if dtype == torch.float16 else 0.0
    return u * ref.abs() + fp * scale + atol


def assert_grad_close(
    got: torch.Tensor,
    ref: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    what: str,
):
    """Elementwise check of a gradient against the float64 reference, NaN in the same places."""
    assert got is not None, f"{what}: no gradient was computed"
    assert got.shape == ref.shape, (
        f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    )
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    got64 = got.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert torch.equal(torch.isnan(got64), torch.isnan(ref)), (
        f"{what}: NaN where the reference has none (or the reverse)"
    )
    finite = torch.isfinite(ref)
    err = (got64 - ref).abs()[finite]
    bound = grad_bound(ref, scale.to(torch.float64).cpu().expand_as(ref), dtype)[finite]
    if err.numel():
        worst = torch.argmax(err - bound)
        assert bool((err <= bound).all()), (
            f"{what} ({dtype}): error {err[worst].item():.3g} > bound {bound[worst].item():.3g} "
            f"at a reference value of {ref[finite][worst].item():.6g}"
        )
