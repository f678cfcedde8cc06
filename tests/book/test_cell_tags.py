"""Verification out of the reader's way, by cell tags (tools/tidy_cells.py states the
convention): no glue call left in a visible cell where it could move, no visible cell made only
of glue calls and asserts, none over 40 lines; and the Colab edition folds what the site folds
or removes. Every cell is still executed (tests/book/test_chapters.py runs them all)."""

import ast
import json
import sys

import pytest
from book_build import ROOT

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "_ext"))
import tidy_cells  # noqa: E402

CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))
KNOWN_TAGS = {"setup", "remove-cell", "remove-input", "hide-input", "hide-output"}


def visible_code_cells(nb):
    for i, cell in enumerate(nb["cells"]):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "code" and not tags & tidy_cells.HIDDEN:
            yield i, "".join(cell["source"])


def only_bookkeeping(stmt: ast.stmt) -> bool:
    """A glue call, an assert, or a loop or test made only of them."""
    if tidy_cells.is_glue(stmt) or isinstance(stmt, ast.Assert):
        return True
    if isinstance(stmt, (ast.For, ast.If, ast.With)):
        return all(only_bookkeeping(s) for s in stmt.body + getattr(stmt, "orelse", []))
    return False


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_glue_calls_are_out_of_sight(path):
    nb = json.loads(path.read_text())
    for i, src in visible_code_cells(nb):
        assert tidy_cells.split(src) is None, (
            f"{path.stem}, cell {i}: glue calls a reader sees; run tools/tidy_cells.py"
        )


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_visible_cells_are_short_and_not_bookkeeping(path):
    nb = json.loads(path.read_text())
    for i, src in visible_code_cells(nb):
        n = len(src.rstrip("\n").split("\n"))
        assert n <= tidy_cells.MAX_VISIBLE_LINES, (
            f"{path.stem}, cell {i}: {n} visible lines (at most "
            f"{tidy_cells.MAX_VISIBLE_LINES}): split it, or fold a helper (hide-input)"
        )
        body = ast.parse(src).body
        assert not body or not all(only_bookkeeping(s) for s in body), (
            f"{path.stem}, cell {i}: only glue calls and asserts; tag it remove-cell "
            "(bookkeeping) or hide-input (a check worth opening)"
        )


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_tags_are_the_books_own(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        unknown = set(cell.get("metadata", {}).get("tags", [])) - KNOWN_TAGS
        assert not unknown, f"{path.stem}, cell {i}: unknown tags {unknown}"


def test_tidy_moves_only_what_cannot_change():
    src = (
        "x = 1.0\nglue('a', x, display=False)\nys = [x]\n"
        "glue('b', len(ys), display=False)\nys.append(2)\n"
        "glue('c', f(x), display=False)\nz = x\nglue('d', z, display=False)\n"
    )
    stay, move = tidy_cells.split(src)
    # 'a' reads x, never assigned again; 'd' is last; 'b' reads ys, appended to later;
    # 'c' calls f, which may draw random numbers
    assert move == "glue('a', x, display=False)\nglue('d', z, display=False)"
    assert "glue('b'" in stay and "glue('c'" in stay
    assert tidy_cells.split("print(1)") is None


def test_colab_edition_folds_what_the_site_hides():
    import colab_edition

    def cell(tags, src):
        return {"cell_type": "code", "metadata": {"tags": tags}, "source": src}

    assert colab_edition._folded_title(cell(["remove-cell"], "glue(1)"), "glue(1)")
    title = colab_edition._folded_title(
        cell(["hide-input"], "# Draw it\nx"), "# Draw it\nx"
    )
    assert title.startswith("Draw it")
    assert colab_edition._folded_title(cell([], "x"), "x") is None
    assert (
        colab_edition._folded_title(cell(["setup", "remove-cell"], "x"), "x") is None
    )
