"""Chapter code fits the text column: at most 88 columns a line, so no code cell scrolls sideways.

The book's text column holds about 88 characters of code at desktop width (measured in Chromium at
1366 px, see test_pages.py). Every code cell of every chapter in _toc.yml is checked, chapters added
later included (all of them fit since norm_placement and qwen3_block were reformatted).
"""

import json

import pytest

from book_build import chapter_notebooks

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


@pytest.mark.parametrize("path", chapter_notebooks(), ids=lambda p: p.stem)
def test_chapter_code_fits_88_columns(path):
    bad = long_lines(path)
    assert not bad, f"{path.name}: {len(bad)} lines over {MAX_COLUMNS} columns:\n" + "\n".join(bad[:20])


def test_the_width_check_sees_a_long_line(tmp_path):
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["a = 1\n", "b" * 89]},
                                       {"cell_type": "markdown", "source": ["m" * 200]}]}))
    assert long_lines(p) == ["cell 0 line 2: 89 columns"]


def test_kernel_source_fits_88_columns():
    """The chapters show kernels/ source (kernels.notebook.show_source) in the same column as
    their code cells: every line of the package fits 88 columns too."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "kernels"
    bad = [f"{p.relative_to(root.parent)}:{i}: {len(line)} columns"
           for p in sorted(root.rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not bad, f"{len(bad)} lines of kernels/ over {MAX_COLUMNS} columns:\n" + "\n".join(bad[:20])
