"""The test run's shape, a pytest plugin (conftest.py registers it): how many threads each
process computes on, which work runs once in the background, which tests share an xdist
worker and in what order they run, and what ``--quick`` selects.

Threads. Every process of the run computes on $OMP_NUM_THREADS threads, 1 unless the caller
set it: set here before any test runs, it is inherited by everything the run starts (the
xdist workers, the chapters' Jupyter kernels, the inspector's compilers, the tests'
subprocesses). A run already has a process per core (`-n auto`) besides its background
work, so more threads each only oversubscribe the cores: on 2 cores, two processes running
test_hf's training and generation tests took 94 s with torch's default of a thread per core,
63 s with one.

Work done once, in the background. Three steps are slow and shared by many tests: the
chapters executed and their HTML built (book_build.py), and the inspector's survey of every
kernel variant (inspector_step.py). As soon as collection shows a test that needs one (a test
of a fixture in SHARED_FIXTURES), it starts in a background process (run_once.py; the
inspector's niced) and the tests that need it are sorted last, so the other tests fill the
cores meanwhile; every worker then reads the one result.

xdist groups and order (`make test`: -n auto --dist loadgroup). The tests of a costly
session fixture (ONE_WORKER_FIXTURES: the benchmark's smoke run, gpu_check's dry run) share a
group, so one worker computes it once. The browser tests of one page share a group and run
adjacent, so each worker loads the page once per viewport width (browser_pages.py); a test
marked changes_page runs after its page's other tests. Groups are marked as each test is
collected: pytest-xdist's worker reads them in its own pytest_collection_modifyitems, which
runs before this plugin's, tryfirst or not. The order is collection order within each rank:
the tests of no shared work first, then the chapters', the HTML's, the inspector's.

--quick (`make test-quick`, the edit loop: a few minutes). The folders tests/kernels/ and
tests/book/, and the tests of tests/lab/ marked ``quick`` (the specs, the formatter and the
linter: seconds); not the rest of tests/lab/, whose tests start the benchmark, the
inspector's compilers, gpu_check or nested pytest runs. Left out within them: the tests of
the background work and of the browser, a test with an integer parameter above
QUICK_MAX_SIZE (a row length, a vocabulary), and a test marked ``slow`` (Jupyter kernels, a
fresh interpreter per case, whole models generating or training, a row of a real
vocabulary, a small book built). So the quick run checks the kernels at small sizes and the
book's sources (prose, code width, clean notebooks, the Colab conversion), and executes no
chapter, opens no browser and compiles nothing for the inspector.

--reuse-book: the previous run's executed chapters and HTML (_build/test-book/), for
iterating on tests that only read them; nothing is started in the background.

$TEST_WATCH_S (CI sets it): every that many seconds the process that started the run writes
one line to stderr: the time since the run began, the tests done, the load average, the
memory available, and each running test with how long it has run. A run cut off from outside
then leaves in its log where its time went. $TEST_DEADLINE_S (CI sets it too): that many
seconds after the run began, that process interrupts itself as Ctrl-C would (its workers stop,
and pytest prints its summary and slowest tests), after one last watch line.
"""

import os
import pathlib
import sys
import threading
import time
import uuid

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
#: The threads each process computes on (OpenMP's "4,2" form: the first level counts).
COMPUTE_THREADS = int(os.environ["OMP_NUM_THREADS"].split(",")[0])

import torch  # noqa: E402

torch.set_num_threads(COMPUTE_THREADS)  # this process imported torch before the plugin

TESTS = pathlib.Path(__file__).resolve().parent

#: fixture -> (rank in the run's order, the background step that makes it)
SHARED_FIXTURES = {
    "executed_book": (1, "book"),
    "built_html": (2, "html"),
    "inspector_table": (3, "inspector"),
    "inspector_verification": (3, "inspector"),
}

#: Fixtures that cost a minute each: the tests that use one share an xdist group, so that one
#: worker computes it once instead of every worker that happens to run one of its tests.
#: Session-scoped, since a worker need not run a group's tests one after another (a
#: module-scoped fixture would be set up again after another module's test).
ONE_WORKER_FIXTURES = {"smoke": "bench-smoke", "dry_run": "gpu-check-dry-run"}

#: --quick: the folders of tests/ it runs.
QUICK_FOLDERS = ("kernels", "book")
#: --quick: an integer parameter above this (a row length, a vocabulary) leaves the test to
#: `make test`; 8192 keeps the one-block and the looped rows (1000, 4097).
QUICK_MAX_SIZE = 8192


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help="the edit loop's subset (make test-quick): tests/kernels/ at small sizes and "
        "tests/book/'s checks of the sources; no chapter executed, no browser, no "
        "inspector compile (tests/scheduling.py)",
    )
    parser.addoption(
        "--reuse-book",
        action="store_true",
        help="read the previous run's executed chapters and HTML (_build/test-book/) "
        "instead of executing them again",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "xdist_group(name): tests that pytest-xdist keeps on one worker"
    )
    config.addinivalue_line(
        "markers",
        "changes_page: a browser test that changes its shared page "
        "(runs after the page's other tests)",
    )
    config.addinivalue_line("markers", "slow: left out of --quick (make test runs it)")
    config.addinivalue_line(
        "markers", "quick: a test of another folder that --quick runs too (seconds)"
    )
    # The process that starts the run (the controller, or a run without workers) names it for
    # run_once.py; the workers it starts inherit the name. Not the environment's test: a pytest
    # that a test starts inherits $PYTEST_XDIST_WORKER.
    if not hasattr(config, "workerinput"):
        import run_once

        os.environ[run_once.RUN_VAR] = uuid.uuid4().hex


def _rank(item) -> int:
    return max(
        [SHARED_FIXTURES[f][0] for f in item.fixturenames if f in SHARED_FIXTURES],
        default=0,
    )


def browser_order(item):
    """A browser test's sort key: its page, then whether it changes the page (last); it also
    puts the page's tests in one xdist group."""
    page = getattr(item, "callspec", None) and item.callspec.params.get("page_path")
    if page is None or "browser" not in item.fixturenames:
        return ("",)
    if not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(f"page-{page}"))
    return (page, item.get_closest_marker("changes_page") is not None)


def _folder(item) -> str | None:
    """The folder of tests/ that holds the test (kernels, lab, book)."""
    try:
        return pathlib.Path(item.path).resolve().relative_to(TESTS).parts[0]
    except ValueError:
        return None


def _quick_leaves(item) -> bool:
    if item.get_closest_marker("slow"):
        return True
    if _folder(item) not in QUICK_FOLDERS and not item.get_closest_marker("quick"):
        return True
    if _rank(item) or "browser" in item.fixturenames:
        return True
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    return any(
        isinstance(v, int) and not isinstance(v, bool) and v > QUICK_MAX_SIZE
        for v in params.values()
    )


def pytest_itemcollected(item):
    """Each test's xdist group, marked as it is collected (see the module's docstring)."""
    groups = [g for f, g in ONE_WORKER_FIXTURES.items() if f in item.fixturenames]
    if groups and not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(groups[0]))
    browser_order(item)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """--quick's selection; then the tests of shared work last, and each page's browser tests
    together (a stable sort: otherwise collection order)."""
    if config.getoption("--quick"):
        dropped = [item for item in items if _quick_leaves(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not _quick_leaves(item)]
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (_rank(item), browser_order(item), order[id(item)]))


def pytest_collection_finish(session):
    """Start the background steps the collected tests need."""
    config = session.config
    if config.option.collectonly or config.getoption("--reuse-book"):
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
        import inspector_step

        inspector_step.start()


def pytest_sessionfinish(session, exitstatus):
    import run_once

    run_once.finish(
        interrupted=bool(session.shouldstop or session.shouldfail) or exitstatus == 2
    )


def pytest_terminal_summary(terminalreporter):
    """How long each chapter took to execute (when the chapter tests ran)."""
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


#: $TEST_WATCH_S: the running tests, by node id, and when each started (the watch's).
_RUNNING: dict[str, float] = {}
_DONE = [0]


def pytest_runtest_logstart(nodeid, location):
    _RUNNING[nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid, location):
    _RUNNING.pop(nodeid, None)
    _DONE[0] += 1


def _machine() -> str:
    try:
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        mem = next(
            int(line.split()[1]) // 1024
            for line in open("/proc/meminfo")
            if line.startswith("MemAvailable")
        )
        return f"load {load}, {mem} MiB available"
    except (OSError, StopIteration):
        return "load and memory unknown"


def watch_line(start: float, now: float) -> str:
    """The watch's report: the run so far and what is running now."""
    running = sorted(_RUNNING.items(), key=lambda kv: kv[1])
    tests = "; ".join(f"{n} ({now - t:.0f} s)" for n, t in running) or "none"
    return (
        f"[watch] {(now - start) / 60:.1f} min: {_DONE[0]} tests done, "
        f"{_machine()}; running: {tests}"
    )


def _watch(every: float, deadline: float, start: float) -> None:
    import signal

    while True:
        wait = every or float("inf")
        if deadline:
            wait = min(wait, start + deadline - time.monotonic())
        time.sleep(max(0.0, wait))
        now = time.monotonic()
        print(watch_line(start, now), file=sys.stderr, flush=True)
        if deadline and now >= start + deadline:
            print(
                f"[watch] the run's deadline ($TEST_DEADLINE_S = {deadline:.0f} s) is "
                "reached: interrupting it",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGINT)
            return


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    every = float(os.environ.get("TEST_WATCH_S") or 0)
    deadline = float(os.environ.get("TEST_DEADLINE_S") or 0)
    if (every > 0 or deadline > 0) and not hasattr(session.config, "workerinput"):
        threading.Thread(
            target=_watch, args=(every, deadline, time.monotonic()), daemon=True
        ).start()
