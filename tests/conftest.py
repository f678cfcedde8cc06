"""Shared test helpers: the kernel tests' numerical helpers (tolerances from the unit
roundoff, comparisons with references computed on the CPU, outputs poisoned to catch unwritten
elements) and the book tests' session fixtures (the executed chapters, their HTML, a local
server, a browser). How the run is scheduled is the plugin scheduling.py's.

Importing ``normbook`` first turns on Triton's interpreter where there is no GPU.
"""

import math

import pytest
import torch

import normbook  # noqa: F401  (sets TRITON_INTERPRET before any kernel is defined)
from normbook import DEVICE

pytest_plugins = ["scheduling"]  # the run's shape: tests/scheduling.py

# Unit roundoff u = 2**-(p) of each storage dtype: one correct rounding errs by at most u, relatively.
UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float64: 2.0**-53,
}
LOW_PRECISION = [torch.float32, torch.float16, torch.bfloat16]


def norm_tolerance(dtype, weight_max: float = 1.0):
    """(rtol, atol) for a normalization output stored in ``dtype``.

    The kernel rounds twice (x̂ to the dtype, then γ·x̂ to the dtype): at most 2u relative error.
    The fp32 statistics add a relative error of about (log2 N + N/4096)·2**-24 ≤ 1e-5 for
    N ≤ 262,144. fp16 results below 2**-14 are subnormal, where the error is absolute: half a
    subnormal spacing (2**-25) per rounding, scaled by |γ|.
    """
    u = UNIT_ROUNDOFF[dtype]
    rtol = 2 * u + (1e-5 if dtype != torch.float64 else 1e-12)
    atol = 2.0**-24 * max(1.0, weight_max) if dtype == torch.float16 else 1e-30
    return rtol, atol


def assert_close_to_reference(out, ref, dtype, weight_max=1.0, what="output"):
    """Elementwise |out - ref| <= rtol·|ref| + atol, with NaN/Inf required in the same places."""
    rtol, atol = norm_tolerance(dtype, weight_max)
    out64 = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert out64.shape == ref.shape, (
        f"{what}: shape {tuple(out64.shape)} != reference {tuple(ref.shape)}"
    )
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isnan(out64), torch.isnan(ref)), (
        f"{what}: NaN where the reference has none (or the reverse)"
    )
    assert torch.equal(
        out64[~finite & ~torch.isnan(ref)], ref[~finite & ~torch.isnan(ref)]
    ), f"{what}: Inf mismatch"
    err = (out64 - ref).abs()[finite]
    bound = (rtol * ref.abs() + atol)[finite]
    if err.numel():
        worst = torch.argmax(err - bound)
        assert bool((err <= bound).all()), (
            f"{what} ({dtype}): error {err[worst].item():.3g} > bound {bound[worst].item():.3g} "
            f"(rtol={rtol:.3g}, atol={atol:.3g}) at a reference value of {ref[finite][worst].item():.6g}"
        )


def on_cpu(*tensors):
    """The one "compare on the CPU" helper: kernel results (on normbook.DEVICE) moved next to
    references built on the CPU in float64, detached. One tensor in, one out; several, a tuple.
    ``None`` stays ``None`` (e.g. a gradient that was not asked for)."""
    out = tuple(t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in tensors)
    return out[0] if len(out) == 1 else out


def randn(*shape, dtype=torch.float32, scale=1.0, generator=None):
    return (
        (torch.randn(*shape, dtype=torch.float32, generator=generator) * scale)
        .to(dtype)
        .to(DEVICE)
    )


@pytest.fixture
def poison_empty(monkeypatch):
    """Make ``torch.empty`` return NaN-filled (float) or -1-filled (int) tensors, so that any output
    element a kernel forgets to write is caught by the comparison with the reference."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(math.nan)
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)
    yield


@pytest.fixture(scope="session")
def executed_book(pytestconfig):
    """Each chapter executed once for the whole run, shared by every worker (book_build.py)."""
    import book_build

    book_build.require(("nbformat", "nbclient", "ipykernel", "plotly"))
    if pytestconfig.getoption("--reuse-book"):
        return book_build.reuse()
    return book_build.executed()


@pytest.fixture(scope="session")
def built_html(executed_book, pytestconfig):
    import book_build

    book_build.require(("jupyter_book",))
    html = book_build.OUT / "_build" / "html"
    if pytestconfig.getoption("--reuse-book") and (html / "index.html").exists():
        return html
    code, log, html = book_build.html()
    assert code == 0, (
        "jupyter-book build of the executed chapters failed:\n" + log[-6000:]
    )
    return html


@pytest.fixture(scope="session")
def server(built_html):
    """The built HTML served on a local port (the browser tests: browser_pages.py), by the
    server the book's PDF is printed from (tools/book_pdf.py)."""
    import book_pdf

    with book_pdf.serve(built_html) as url:
        yield url


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium per worker, for every browser test (browser_pages.py)."""
    import shutil

    import book_build

    book_build.require(("playwright",))
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=chromium,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b
        b.close()


def assert_rejected_before_launch(
    monkeypatch, module: str, call, exc, words: str
) -> None:
    """``call()`` raises ``exc`` with ``words`` in its message, and never reaches the launcher
    ``_forward`` of ``normbook.<module>`` (the module, not the function of the same name)."""
    import importlib

    mod = importlib.import_module(f"normbook.{module}")

    def no_launch(*a, **k):
        raise AssertionError("the kernel was launched with a bad argument")

    monkeypatch.setattr(mod, "_forward", no_launch)
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def nothing_saved():
    """A context in which saving a tensor for a backward pass fails: a call that wants no
    gradient must keep nothing alive (autograd's pack hook sees every saved tensor)."""

    def refuse(t):
        raise AssertionError(
            "a tensor was saved for backward although no gradient is needed"
        )

    return torch.autograd.graph.saved_tensors_hooks(refuse, lambda t: t)
