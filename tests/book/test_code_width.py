"""Chapter code and what it prints fit the text column: at most 88 columns a line, so no code
cell scrolls sideways and no printed table wraps in the page.

The book's text column holds about 88 characters of code at desktop width (measured in Chromium at
1366 px, see test_pages.py). Every code cell of every chapter in _toc.yml is checked, chapters added
later included, and so is every line the executed chapters print (a wider one wraps in the page,
which breaks a printed table's columns).
"""

import json

import book_build
import chapters
import pytest

MAX_COLUMNS = 88


def long_lines(path):
    nb = json.loads(path.read_text())
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        for j, line in enumerate("".join(cell["source"]).splitlines(), 1):
            if len(line) > MAX_COLUMNS:
                out.append(f"cell {i} line {j}: {len(line)} columns")
    return out


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_chapter_code_fits_88_columns(path):
    bad = long_lines(path)
    assert not bad, (
        f"{path.name}: {len(bad)} lines over {MAX_COLUMNS} columns:\n"
        + "\n".join(bad[:20])
    )


def test_the_width_check_sees_a_long_line(tmp_path):
    p = tmp_path / "x.ipynb"
    p.write_text(
        json.dumps(
            {
                "cells": [
                    {"cell_type": "code", "source": ["a = 1\n", "b" * 89]},
                    {"cell_type": "markdown", "source": ["m" * 200]},
                ]
            }
        )
    )
    assert long_lines(p) == ["cell 0 line 2: 89 columns"]


def test_kernel_source_fits_88_columns():
    """The chapters show kernels/ source (normbook.lab.notebook.show_source) in the same column as
    their code cells: every line of the package fits 88 columns too."""
    root = book_build.ROOT / "kernels"
    bad = [
        f"{p.relative_to(root.parent)}:{i}: {len(line)} columns"
        for p in sorted(root.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > MAX_COLUMNS
    ]
    assert not bad, (
        f"{len(bad)} lines of kernels/ over {MAX_COLUMNS} columns:\n"
        + "\n".join(bad[:20])
    )


#: What the page shows of an output: the richest form myst-nb renders. A plain-text result with
#: one of these beside it is not shown as text, so its width does not matter.
RICH = {
    "text/html",
    "text/markdown",
    "text/latex",
    "image/png",
    "image/jpeg",
    "image/svg+xml",
    "application/vnd.plotly.v1+json",
}


def long_printed_lines(nb: dict) -> list[str]:
    """Lines over MAX_COLUMNS that a page shows as text: printed (stream) output, and results
    whose only form is plain text."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if o.get("output_type") == "stream":
                text = o["text"]
            elif o.get("output_type") in (
                "execute_result",
                "display_data",
            ) and not RICH & set(o["data"]):
                text = o["data"].get("text/plain", "")
            else:
                continue
            text = "".join(text) if isinstance(text, list) else text
            out += [
                f"cell {i}: {len(line)} columns: {line[:60]}..."
                for line in text.splitlines()
                if len(line) > MAX_COLUMNS
            ]
    return out


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_printed_output_fits_88_columns(executed_book, path):
    if path.stem not in executed_book:
        pytest.skip("not selected in $CHAPTERS")
    done = book_build.OUT / path.relative_to(book_build.ROOT)
    bad = long_printed_lines(json.loads(done.read_text()))
    assert not bad, (
        f"{path.name}: {len(bad)} printed lines over {MAX_COLUMNS} columns (they wrap "
        "in the page):\n" + "\n".join(bad[:20])
    )


def test_the_output_check_sees_a_long_printed_line():
    def code(*outputs):
        return {"cell_type": "code", "source": "", "outputs": list(outputs)}

    nb = {
        "cells": [
            code(
                {
                    "output_type": "stream",
                    "name": "stdout",
                    "text": ["short\n", "x" * 89 + "\n"],
                }
            ),
            code({"output_type": "execute_result", "data": {"text/plain": "y" * 100}}),
            code(
                {
                    "output_type": "display_data",
                    "data": {"text/plain": "z" * 100, "text/html": "<b/>"},
                }
            ),
            {"cell_type": "markdown", "source": "m" * 200},
        ]
    }
    found = long_printed_lines(nb)
    assert [line.split(":")[0:2] for line in found] == [
        ["cell 0", " 89 columns"],
        ["cell 1", " 100 columns"],
    ], found
