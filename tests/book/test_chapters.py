"""Every chapter is executed as a test: a failing cell fails it, naming the chapter and the cell."""

import json
import subprocess
import sys

import chapters
import pytest
from book_build import ROOT

CHAPTERS = [p.stem for p in chapters.notebooks()]


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_executes_without_error(executed_book, name):
    if name not in executed_book:
        pytest.skip("not selected in $CHAPTERS")
    result = executed_book[name]
    assert result.error is None, result.error


@pytest.mark.parametrize("name", CHAPTERS)
def test_chapter_writes_nothing_to_stderr(executed_book, name):
    """Warnings printed by a chapter would show up in the book as red boxes."""
    if name not in executed_book:
        pytest.skip("not selected in $CHAPTERS")
    assert executed_book[name].stderr_cells == [], (
        f"{name}: cells {executed_book[name].stderr_cells} wrote to stderr"
    )


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_chapter_is_stored_clean(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert not cell.get("outputs"), (
                f"{path.name} cell {i} has stored outputs (run tools/clean_notebooks.py)"
            )
            assert cell.get("execution_count") is None, (
                f"{path.name} cell {i} has an execution count"
            )


def test_setup_cells_match_the_configured_repository():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sync_setup_cells.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_executes_every_chapter_and_fails_on_error():
    """`make book` executes every chapter and fails on an error: tools/execute_chapters.py runs
    them (exit 1 on a failing cell) into the cache the build reads, and the build executes what the
    cache lacks, raising on error. The cache is exact: a chapter's code, kernels/, the requirements
    and the versions are its key (test_execution_cache_key_covers_what_chapters_depend_on)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cfg["execute"]["execute_notebooks"] == "cache"
    assert cfg["execute"].get("allow_errors") is False
    assert cfg["sphinx"]["config"]["nb_execution_raise_on_error"] is True
    book = (ROOT / "Makefile").read_text().split("\nbook:", 1)[1].split("\n\n", 1)[0]
    steps = [line.strip() for line in book.splitlines()[1:] if line.startswith("\t")]
    assert steps.index("$(PY) tools/execute_chapters.py") < next(
        i for i, s in enumerate(steps) if "jupyter-book build" in s
    ), steps


def test_execution_cache_key_covers_what_chapters_depend_on(tmp_path, monkeypatch):
    """The stamp changes with any file of kernels/, the requirements or pyproject.toml (and the
    versions): then tools/execute_chapters.py clears the cache and every chapter runs again."""
    import execute_chapters

    for name in (
        "kernels/normbook/__init__.py",
        "kernels/deep/x.py",
        "pyproject.toml",
        "requirements.txt",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("a = 1\n")
    monkeypatch.setattr(execute_chapters, "ROOT", tmp_path)
    before = execute_chapters.stamp()
    for name in ("kernels/deep/x.py", "requirements.txt", "pyproject.toml"):
        (tmp_path / name).write_text("a = 2\n")
        after = execute_chapters.stamp()
        assert after != before, (
            f"a change of {name} must invalidate the chapters' cache"
        )
        before = after
    assert execute_chapters.stamp() == before  # and nothing else moves it


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_chapter_names_its_kernel(path):
    """Colab and Jupyter Book choose the kernel from the notebook's metadata."""
    nb = json.loads(path.read_text())
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: run tools/clean_notebooks.py"
    )


def test_a_kernel_failing_outside_any_cell_is_executed_once_more(tmp_path, monkeypatch):
    """tools/chapters.py: a kernel that fails outside the chapter's cells (nbclient's clean-up
    race under load) gets one more try from the chapter's file; a cell's error or timeout is
    the chapter's, not retried."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    path = tmp_path / "chapter.ipynb"
    nbformat.write(nbformat.v4.new_notebook(metadata={"read": "fresh"}), path)
    stale = nbformat.v4.new_notebook(metadata={"read": "stale"})

    def kernel_failing_with(*errors):
        calls = []

        def run(nb, path, timeout):
            calls.append(nb.metadata["read"])
            return errors[len(calls) - 1] if len(calls) <= len(errors) else None

        monkeypatch.setattr(chapters, "_run", run)
        return calls

    calls = kernel_failing_with(RuntimeError("kernel died"))
    done = chapters.execute(path, nb=stale, root=tmp_path)
    assert done.error is None and calls == ["stale", "fresh"]
    assert done.nb.metadata["read"] == "fresh"
    calls = kernel_failing_with(RuntimeError("died"), RuntimeError("died again"))
    done = chapters.execute(path, nb=stale, root=tmp_path)
    assert len(calls) == 2  # once more, not forever
    assert "chapter.ipynb could not be executed: RuntimeError: died again" in done.error
    for err in (CellExecutionError("x", "NameError", "y"), CellTimeoutError("late")):
        calls = kernel_failing_with(err)
        done = chapters.execute(path, nb=stale, root=tmp_path)
        assert done.exception is err and done.error and calls == ["stale"]
