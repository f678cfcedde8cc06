"""Shared test helpers. Importing ``kernels`` first turns on Triton's interpreter where there is no GPU."""

import math
import os
import sys
import uuid

# One compute thread per process (issue 21), set before torch starts its thread pool and
# inherited by everything the run starts: the xdist workers, the chapters' Jupyter kernels,
# the inspector's compilers, the tests' subprocesses. A run already has a process per core
# (`-n auto`) besides its background steps, so a second thread each only oversubscribes the
# cores: measured here on 2 cores, two processes running test_hf's training and generation
# tests took 94 s with torch's default of one thread per core and 63 s with one (two
# running the attention tests: 51 s and 46 s). A run without workers too: the chapters'
# kernels and the inspector's compilers run beside it. An explicit OMP_NUM_THREADS is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
#: The threads each process computes on (OpenMP's "4,2" form: the first level counts).
COMPUTE_THREADS = int(os.environ["OMP_NUM_THREADS"].split(",")[0])

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(COMPUTE_THREADS)  # in case torch was imported first

import normbook  # noqa: F401,E402  (sets TRITON_INTERPRET before any kernel is defined)
from normbook import DEVICE  # noqa: E402

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
def executed_book():
    """Each chapter executed once for the whole run, shared by every worker (see book_build.py)."""
    import book_build

    book_build.require(("nbformat", "nbclient", "ipykernel", "plotly"))
    if os.environ.get(
        "BOOK_REUSE"
    ):  # a developer's shortcut: the previous run's results
        return book_build.reuse()
    return book_build.executed()


@pytest.fixture(scope="session")
def built_html(executed_book):
    import book_build

    book_build.require(("jupyter_book",))
    if (
        os.environ.get("BOOK_REUSE")
        and (book_build.OUT / "_build" / "html" / "index.html").exists()
    ):
        return book_build.OUT / "_build" / "html"
    code, log, html = book_build.html()
    assert code == 0, (
        "jupyter-book build of the executed chapters failed:\n" + log[-6000:]
    )
    return html


@pytest.fixture(scope="session")
def server(built_html):
    """The built HTML served on a local port (test_html.py, test_pages.py)."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(built_html))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium per worker, for every browser test (test_html.py, test_pages.py)."""
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


# ---------------------------------------------------------------- the run's shape (issue 21)
# The slow shared work (the chapters executed, their HTML, the inspector's compile) starts in
# background processes as soon as collection shows a test that needs it (run_once.py), and the
# tests that read it run last, so the kernel tests fill the cores meanwhile. Under pytest-xdist
# (`make test`: -n auto --dist loadgroup) the browser tests of one page share one worker, which
# loads the page once per viewport width (test_html.py).

#: fixture -> (rank in the run's order, the background step that makes it)
SHARED_FIXTURES = {
    "executed_book": (1, "book"),
    "built_html": (2, "html"),
    "inspector_table": (3, "inspector"),
    "inspector_verification": (3, "inspector"),
}


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="the edit loop's subset (make test-quick): kernels at small sizes, prose and "
        "width checks; no chapter executed, no browser, no inspector compile",
    )


#: --quick: an integer parameter above this (a row length, a vocabulary) leaves the test to
#: `make test`; 8192 keeps the one-block and the looped rows (1000, 4097).
QUICK_MAX_SIZE = 8192
#: --quick leaves these to `make test` too: each starts Jupyter kernels, fresh interpreters or
#: `make`, or runs the benchmark (its smoke run alone is minutes of interpreter time).
QUICK_EXCLUDED = (
    "test_setup_cell.py::",
    "test_colab_edition.py::test_colab_edition_runs",
    "test_bench.py::",
    "test_import_order.py::",
    "test_gpu_check.py::",
    # measured at 50-100 s each here (whole models generating; large batches)
    "test_hf.py::test_greedy_generation_identical",
    "test_decode_attention.py::test_row_bits_do_not_depend_on_the_batch",
)


def _quick_excluded(item) -> bool:
    if _rank(item) or "browser" in item.fixturenames:
        return True
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    if any(
        isinstance(v, int) and not isinstance(v, bool) and v > QUICK_MAX_SIZE
        for v in params.values()
    ):
        return True
    return any(part in item.nodeid for part in QUICK_EXCLUDED)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "xdist_group(name): tests that pytest-xdist keeps on one worker"
    )
    config.addinivalue_line(
        "markers",
        "changes_page: a browser test that changes its shared page "
        "(runs after the page's other tests; test_html.py)",
    )
    if not hasattr(
        config, "workerinput"
    ):  # the controller (or a run without workers; a pytest
        # that a test starts inherits $PYTEST_XDIST_WORKER, so the environment cannot tell)
        import run_once

        os.environ[run_once.RUN_VAR] = (
            uuid.uuid4().hex
        )  # inherited by the workers it starts


#: Fixtures that cost a minute each (the benchmark's smoke run, gpu_check's dry run): the tests
#: that use one share an xdist group, so one worker computes it once instead of every worker that
#: happens to run one of its tests; session-scoped, since a worker need not run a group's tests
#: one after another (a module-scoped fixture would be set up again after another module's test).
ONE_WORKER_FIXTURES = {"smoke": "bench-smoke", "dry_run": "gpu-check-dry-run"}


def _rank(item) -> int:
    return max(
        [SHARED_FIXTURES[f][0] for f in item.fixturenames if f in SHARED_FIXTURES],
        default=0,
    )


def pytest_itemcollected(item):
    """Each test's xdist group, as it is collected: pytest-xdist's worker reads the xdist_group
    marks in its own pytest_collection_modifyitems, which (measured) runs before this file's,
    tryfirst or not, so marks added there group nothing."""
    groups = [g for f, g in ONE_WORKER_FIXTURES.items() if f in item.fixturenames]
    if groups and not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(groups[0]))
    pages = sys.modules.get("test_html")
    if pages:
        pages.browser_order(item)  # the browser tests of a page: one group


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests of shared work last (a stable sort: within a rank, collection order); the browser
    tests of a page grouped, viewport by viewport (browser_order in test_html.py)."""
    if config.getoption("--quick"):
        dropped = [item for item in items if _quick_excluded(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not _quick_excluded(item)]
    order = {id(item): i for i, item in enumerate(items)}
    pages = sys.modules.get("test_html")
    key = pages.browser_order if pages else lambda item: ()
    items.sort(key=lambda item: (_rank(item), key(item), order[id(item)]))


def pytest_collection_finish(session):
    if session.config.option.collectonly or os.environ.get("BOOK_REUSE"):
        return
    steps = {
        SHARED_FIXTURES[f][1]
        for item in session.items
        for f in item.fixturenames
        if f in SHARED_FIXTURES
    }
    if steps & {"book", "html"}:
        import book_build

        if not book_build.missing_packages(
            ("nbformat", "nbclient", "ipykernel", "plotly")
        ):
            book_build.start_background(
                with_html="html" in steps
                and not book_build.missing_packages(("jupyter_book",))
            )
    if "inspector" in steps:
        import run_once
        import test_inspect

        # Niced: its tests run last, so it takes the cores the tests leave (the chapters, which
        # the browser tests wait for, keep their priority).
        run_once.start(
            test_inspect.STEP_DIR,
            test_inspect.STEP,
            "test_inspect:inspector_rows",
            nice=10,
        )


def pytest_sessionfinish(session, exitstatus):
    import run_once

    run_once.finish(
        interrupted=bool(session.shouldstop or session.shouldfail) or exitstatus == 2
    )


def pytest_terminal_summary(terminalreporter):
    """Print how long each chapter took to execute (when the chapter tests ran)."""
    book_build = sys.modules.get("book_build")
    if book_build is None and not hasattr(terminalreporter.config, "workerinput"):
        try:
            import book_build
        except ImportError:
            return
    results = book_build.last_run() if book_build else {}
    if results:
        terminalreporter.write_sep("-", "chapter execution times")
        for name, result in results.items():
            status = "ok" if result.error is None else "FAILED"
            terminalreporter.write_line(f"{name:<20} {result.seconds:6.1f} s  {status}")
