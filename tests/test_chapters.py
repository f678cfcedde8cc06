"""Every chapter is executed as a test: a failing cell fails it, naming the chapter and the cell."""

import json
import subprocess
import sys

import pytest

from book_build import ROOT, chapter_notebooks

CHAPTERS = [p.stem for p in chapter_notebooks()]


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
    assert executed_book[name].stderr_cells == [], f"{name}: cells {executed_book[name].stderr_cells} wrote to stderr"


@pytest.mark.parametrize("path", chapter_notebooks(), ids=lambda p: p.stem)
def test_chapter_is_stored_clean(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert not cell.get("outputs"), f"{path.name} cell {i} has stored outputs (run tools/clean_notebooks.py)"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


def test_setup_cells_match_the_configured_repository():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sync_setup_cells.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_config_executes_every_chapter_and_fails_on_error():
    import yaml

    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cfg["execute"]["execute_notebooks"] == "force"
    assert cfg["sphinx"]["config"]["nb_execution_raise_on_error"] is True


@pytest.mark.parametrize("path", chapter_notebooks(), ids=lambda p: p.stem)
def test_chapter_names_its_kernel(path):
    """Colab and Jupyter Book choose the kernel from the notebook's metadata."""
    nb = json.loads(path.read_text())
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", f"{path.name}: run tools/clean_notebooks.py"
