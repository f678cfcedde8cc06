"""The run's shape (the plugin scheduling.py) under pytest-xdist (`make test`: -n auto --dist
loadgroup): tests that share an xdist group run on one worker, which is what makes a costly
shared fixture (ONE_WORKER_FIXTURES) or a browser page (browser_order) load once. A pytest that
stores node ids where pytest-xdist does not look (pytest 9.2 with xdist 3.8) runs every test
still, and green, but groups nothing: only a check like this one notices."""

import importlib.util
import subprocess
import sys

import pytest

GROUPED = """
import os, pathlib, pytest

OUT = pathlib.Path(OUT_DIR)

@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    (OUT / f"grouped-{i}").write_text(os.environ.get("PYTEST_XDIST_WORKER", "main"))

@pytest.mark.parametrize("i", range(6))
def test_free(i):
    (OUT / f"free-{i}").write_text(os.environ.get("PYTEST_XDIST_WORKER", "main"))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist"
)
def test_an_xdist_group_runs_on_one_worker(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "test_grouped.py").write_text(
        GROUPED.replace("OUT_DIR", repr(str(out)))
    )
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-c",
            "/dev/null",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_grouped.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    grouped = {(out / f"grouped-{i}").read_text() for i in range(6)}
    assert len(grouped) == 1, (
        f"one xdist group ran on {sorted(grouped)}: groups are ignored"
    )
    assert all((out / f"free-{i}").exists() for i in range(6))


def test_one_compute_thread_per_process_unless_asked():
    """scheduling.py: this worker, and a process it starts (a chapter's kernel, the
    inspector's compiler), compute on OMP_NUM_THREADS threads, 1 unless the caller set it."""
    import os

    import torch
    from scheduling import COMPUTE_THREADS

    want = int(os.environ["OMP_NUM_THREADS"].split(",")[0])
    assert torch.get_num_threads() == want == COMPUTE_THREADS
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0 and int(child.stdout) == want


def test_a_test_that_changes_its_page_runs_after_the_pages_other_tests():
    """The browser tests' sort key (scheduling.browser_order): a changes_page test, collected
    first, runs after the other tests of its page, before the next page. Its shared load is
    discarded afterwards; run earlier, it would hand the next test of its page moved sliders
    (or cost it a fresh load)."""
    import types

    import scheduling

    def item(page, changes=False):
        marks = {"changes_page": pytest.mark.changes_page.mark} if changes else {}
        it = types.SimpleNamespace(
            callspec=types.SimpleNamespace(params={"page_path": page}),
            fixturenames=["browser", "page_path"],
            name=page,
        )
        it.get_closest_marker = lambda name: marks.get(name)
        it.add_marker = lambda mark: marks.setdefault(mark.name, mark)
        return it

    moves, other, next_page = item("book/a", True), item("book/a"), item("book/b")
    order = sorted([moves, other, next_page], key=scheduling.browser_order)
    assert order == [other, moves, next_page]
    assert moves.get_closest_marker("xdist_group").args == ("page-book/a",)
