"""The package works whatever was imported before it (issue: transformers imports Triton first).

On a machine without a GPU, ``import normbook`` switches Triton to its interpreter. If Triton was
imported earlier (``import triton.language``, or ``transformers``' modeling modules, which import
it), Triton's own ``@jit`` library functions (``tl.sum``, ...) were built for compiled mode and
every kernel failed with ``InterpreterError: Cannot call @triton.jit'd outside of the scope of a
kernel``. Each case runs in a fresh interpreter, since the state under test is made at import.
The script calls every public kernel, forward and backward, and compares with PyTorch: a kernel
that ran but computed something else would fail too.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per case: left out of --quick

# Every public kernel once, on tiny inputs, against plain PyTorch on the same device. The bounds
# are loose (1e-4 relative in fp32) because this test is about *running*; accuracy has its own tests.
SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    import normbook
    from normbook import DEVICE
    from normbook.qk_norm_rope import qk_norm_rope_torch

    torch.manual_seed(0)
    x = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, device=DEVICE, requires_grad=True)
    y = normbook.rms_norm(x, w)
    y.sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.rms_norm(x2, (8,), w2, eps=1e-6).sum().backward()
    torch.testing.assert_close(y, F.rms_norm(x2, (8,), w2, eps=1e-6), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-5)

    a, r = torch.randn(2, 3, 8, device=DEVICE), torch.randn(2, 3, 8, device=DEVICE)
    yf, h = normbook.fused_add_rms_norm(a, r, w.detach())
    torch.testing.assert_close(h, a + r)
    torch.testing.assert_close(yf, F.rms_norm(a + r, (8,), w.detach(), eps=1e-6),
                               rtol=1e-4, atol=1e-5)

    b = torch.randn(4, 8, device=DEVICE)
    torch.testing.assert_close(normbook.layer_norm(b, w.detach(), None),
                               F.layer_norm(b, (8,), w.detach(), None, eps=1e-5),
                               rtol=1e-4, atol=1e-5)
    mean, var = normbook.row_variance(b)
    torch.testing.assert_close(var, b.var(-1, correction=0), rtol=1e-4, atol=1e-6)

    q, k = torch.randn(1, 2, 2, 8, device=DEVICE), torch.randn(1, 2, 1, 8, device=DEVICE)
    angle = torch.randn(1, 2, 4, device=DEVICE).repeat(1, 1, 2)
    args = (q, k, w.detach(), w.detach(), angle.cos(), angle.sin())
    for got, want in zip(normbook.qk_norm_rope(*args), qk_norm_rope_torch(*args)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    print("ok", normbook.INTERPRET)
""")

PRELUDES = {
    "kernels first": "",
    "triton.language first": "import triton.language\n",
    "triton, then torch, first": "import triton\nimport triton.language as tl\nimport torch\n",
    "transformers' Qwen3 first": "import transformers.models.qwen3.modeling_qwen3\n",
    "normbook.hf first": "import normbook.hf\n",
}


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(
        "TRITON_INTERPRET", None
    )  # as a reader's fresh shell has it: the package decides
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("prelude", list(PRELUDES), ids=list(PRELUDES))
def test_every_kernel_runs_whatever_was_imported_first(prelude):
    if "transformers" in PRELUDES[prelude] or "hf" in PRELUDES[prelude]:
        pytest.importorskip("transformers")
    done = _run(PRELUDES[prelude] + SCRIPT)
    assert done.returncode == 0, f"{prelude}:\n{done.stderr[-3000:]}"
    assert done.stdout.startswith("ok"), done.stdout


def test_the_reproducer_from_the_issue():
    done = _run(
        "import triton.language; import torch, normbook; "
        "print(normbook.rms_norm(torch.randn(2, 8).to(normbook.DEVICE)).shape)"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "torch.Size([2, 8])"


def test_library_functions_are_interpreted_after_a_late_import():
    """White box, on a CPU only: after ``import triton.language; import normbook`` no Triton
    library function is left in compiled mode (the cause of the original error)."""
    done = _run(
        textwrap.dedent("""
        import triton.language as tl
        from triton.runtime.jit import JITFunction
        import normbook
        if normbook.INTERPRET:
            left = [n for n, v in vars(tl).items() if type(v) is JITFunction]
            left += [n for n, v in vars(tl.tensor).items() if type(v) is JITFunction]
            assert not left, left
            assert type(tl.sum).__name__ == "InterpretedFunction"
            assert tl.tensor.sum is tl.sum  # one replacement, shared by every name
        print("ok")
    """)
    )
    assert done.returncode == 0, done.stderr[-3000:]
