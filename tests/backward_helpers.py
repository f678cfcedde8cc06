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

import torch

from conftest import UNIT_ROUNDOFF

FP32_SUM_RTOL = 1e-5


def grad_bound(ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |got − ref| for a gradient stored in ``dtype`` (see the module docstring)."""
    u = UNIT_ROUNDOFF[dtype]
    fp = 1e-12 if dtype == torch.float64 else FP32_SUM_RTOL
    atol = 2.0**-24 if dtype == torch.float16 else 0.0
    return u * ref.abs() + fp * scale + atol


def assert_grad_close(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, what: str):
    """Elementwise check of a gradient against the float64 reference, NaN in the same places."""
    assert got is not None, f"{what}: no gradient was computed"
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    got64 = got.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert torch.equal(torch.isnan(got64), torch.isnan(ref)), f"{what}: NaN where the reference has none (or the reverse)"
    finite = torch.isfinite(ref)
    err = (got64 - ref).abs()[finite]
    bound = grad_bound(ref, scale.to(torch.float64).cpu().expand_as(ref), dtype)[finite]
    if err.numel():
        worst = torch.argmax(err - bound)
        assert bool((err <= bound).all()), (
            f"{what} ({dtype}): error {err[worst].item():.3g} > bound {bound[worst].item():.3g} "
            f"at a reference value of {ref[finite][worst].item():.6g}"
        )
