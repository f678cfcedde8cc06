"""normbook._runtime's repairs of Triton's interpreter (the CPU path only).

The import-order repair has its own tests (test_import_order.py, in fresh interpreters).
Here: the interpreter patches ``triton.language`` once per launch, not once per call of a
``@triton.jit`` helper, and what it patched is restored when the launch ends.
"""

import pytest
import torch
import triton
import triton.language as tl

import normbook
from normbook import DEVICE

pytestmark = pytest.mark.skipif(
    not normbook.INTERPRET, reason="the interpreter's repair"
)


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _calls_helper(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(CALLS):
        x = _twice(x)
    tl.store(out_ptr, tl.sum(x, axis=0))  # tl.sum: Triton's own helper, in standard.py


def _launch(calls):
    x = torch.arange(8, dtype=torch.float32, device=DEVICE)
    out = torch.full((1,), float("nan"), device=DEVICE)
    _calls_helper[(1,)](x, out, N=8, CALLS=calls)
    return out.item(), float(x.sum()) * 2**calls


def _count_patches(monkeypatch, calls):
    import triton.runtime.interpreter as interpreter

    counted = []
    original = interpreter._patch_builtin

    def counting(pkg, builder, scope):
        counted.append(pkg)
        return original(pkg, builder, scope)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    got, want = _launch(calls)
    monkeypatch.setattr(interpreter, "_patch_builtin", original)
    assert got == want  # exact: integers in fp32
    return len(counted)


def test_the_fix_is_installed():
    import triton.runtime.interpreter as interpreter

    assert getattr(interpreter._patch_lang, "normbook_fix", False)


def test_a_helper_called_in_a_launch_does_not_patch_the_language_again(monkeypatch):
    # Triton alone patches the language once per launch and once more per helper call:
    # 1 call and 9 calls would differ by 8 patches of each module.
    _launch(1)  # whatever a first launch in this process patches for good
    assert _count_patches(monkeypatch, calls=9) == _count_patches(monkeypatch, calls=1)


def test_a_launch_restores_the_language_it_patched():
    names = [n for n in dir(tl) if tl.core.is_builtin(getattr(tl, n))]
    before = {n: getattr(tl, n) for n in names}
    methods = {n: getattr(tl.tensor, n) for n in ("__add__", "__mul__", "sum")}
    got, want = _launch(3)
    assert got == want
    assert {n: getattr(tl, n) for n in names} == before
    assert {n: getattr(tl.tensor, n) for n in methods} == methods


def test_each_launch_patches_the_language_afresh(monkeypatch):
    # Nothing is skipped across launches: the second launch patches as the first did.
    first = _count_patches(monkeypatch, calls=2)
    assert first > 0
    assert _count_patches(monkeypatch, calls=2) == first
