"""The Colab edition (tools/colab_edition.py, converter in _ext/colab_edition.py): plain Jupyter
Markdown that Colab renders.

Run on every chapter of _toc.yml: no MyST role or directive is left in any cell, every glue
placeholder of an executed chapter is resolved (values from this session's executed notebooks,
tests/book_build.py), every link is absolute. One chapter's Colab edition is then run by a Jupyter
kernel from a folder outside the repository, as far as its first code cells (cheap).
"""

import json
import os
import re
import sys

import chapters
import pytest
from book_build import OUT, ROOT, require

# The converter, _ext/colab_edition.py, first on the path: tools/ (pyproject.toml's pythonpath)
# holds the command of the same name.
sys.path.insert(0, str(ROOT / "_ext"))
import colab_edition  # noqa: E402

MYST_ROLE = re.compile(r"\{[\w:.-]+\}`")
MYST_DIRECTIVE = re.compile(r"^\s*(`{3,}|:{3,})\{[\w:.-]+\}", re.M)
MYST_TARGET = re.compile(r"^\([\w:.-]+\)=\s*$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)|(?:href|src)=\"([^\"]+)\"")


def markdown_cells(nb):
    return [
        (i, "".join(c["source"]))
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "markdown"
    ]


def without_code(md: str) -> str:
    """Markdown with fenced and inline code removed (a role inside code is code, not MyST)."""
    md = re.sub(r"^(\s*)(`{3,}|~{3,})[^\n]*\n.*?^\1\2\s*$", "", md, flags=re.M | re.S)
    return re.sub(r"(`+)(?!\{).+?\1", "", md)


@pytest.fixture(scope="module")
def edition(executed_book, tmp_path_factory):
    out = tmp_path_factory.mktemp("colab")
    colab_edition.build(out, OUT, allow_missing=True)
    return out


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_colab_edition_is_plain_markdown_with_absolute_links(
    edition, executed_book, path
):
    rel = path.relative_to(ROOT)
    nb = json.loads((edition / rel).read_text())
    base = colab_edition.book_url(colab_edition.config())
    for i, md in markdown_cells(nb):
        prose = without_code(md)
        assert not MYST_ROLE.search(prose), (
            f"{rel} cell {i}: MyST role left: {MYST_ROLE.search(prose)}"
        )
        assert not MYST_DIRECTIVE.search(md), f"{rel} cell {i}: MyST directive left"
        assert not MYST_TARGET.search(md), f"{rel} cell {i}: MyST target left"
        for m in LINK.finditer(prose):
            url = m.group(1) or m.group(2)
            assert re.match(r"https?://", url), f"{rel} cell {i}: relative link {url!r}"
    if path.stem in executed_book and executed_book[path.stem].error is None:
        text = "\n".join(md for _, md in markdown_cells(nb))
        assert "is printed when you run the cells" not in text, (
            f"{rel}: a glued value is unresolved"
        )
        # and the note says where the numbers come from
        assert "written in from the run that built the website" in text
    # the book's own pages are linked where the chapter linked them
    src = (ROOT / rel).read_text()
    if "{doc}`" in src:
        assert base in json.dumps(nb)


def test_every_glue_key_resolves_from_an_executed_chapter(executed_book):
    done = [n for n, r in executed_book.items() if r.error is None]
    if not done:
        pytest.skip("no chapter executed in this session")
    for p in chapters.notebooks():
        if p.stem in done:  # raises colab_edition.Unresolved on a missing value
            colab_edition.build(OUT / "_colab_check", OUT, only=[p.stem])


def test_converter_handles_every_construct():
    conv = colab_edition.Converter(
        "book/a",
        {"x": "0.000123456", "s": "'text'"},
        {"book/b": "Chapter B"},
        {
            "b-ex-1": ("book/b", "Exercise 1", "b-ex-1"),
            "sec": ("book/b", "A section", "sec"),
        },
        {"k1": "Zhang and Sennrich (2019)", "k2": "Ba et al. (2016)"},
        "https://h.io/r/",
    )
    md = "\n".join(
        [
            "(sec-a)=",
            "## Title",
            "% a MyST comment",
            "Value {glue:text}`x:.2e` and {glue:text}`s`; see {doc}`b`, {doc}`this <b>`, {ref}`sec`,",
            "{ref}`b-ex-1`, {cite}`k1`, {cite:p}`k1,k2`, {math}`a^2`, {eq}`e1`, $x$.",
            ":::{note} Careful",
            "Body with {doc}`b`.",
            ":::",
            "```{warning}",
            "Mind it.",
            "```",
            "````{exercise} Do it",
            ":label: a-ex-1",
            "Question.",
            "```python",
            "x = 1",
            "```",
            "````",
            ":::{solution} a-ex-1",
            ":class: dropdown",
            "Answer.",
            ":::",
            "```{solution-start} a-ex-1",
            ":class: dropdown",
            "```",
            "```{solution-end}",
            "```",
            "```{unknown} Thing",
            "Stuff.",
            "```",
        ]
    )
    out = conv.markdown(md)
    assert "1.23e-04" in out and "and text;" in out
    assert (
        "[Chapter B](https://h.io/r/book/b.html)" in out
        and "[this](https://h.io/r/book/b.html)" in out
    )
    assert "[A section](https://h.io/r/book/b.html#sec)" in out
    assert "[Zhang and Sennrich (2019)](https://h.io/r/book/bibliography.html)" in out
    assert (
        "([Zhang and Sennrich 2019](https://h.io/r/book/bibliography.html); [Ba et al. 2016]"
        in out
    )
    assert "$a^2$" in out and "(e1)" in out
    assert "> **Careful**" in out and "> **Warning**" in out
    assert "### Exercise 1: Do it" in out and "```python\nx = 1\n```" in out
    assert "<details>\n<summary>Solution to exercise 1" in out and "</details>" in out
    assert (
        "<!-- solution-start 1 -->" in out and "<!-- solution-end -->" in out
    )  # for convert()
    assert "**Thing**" in out
    assert not MYST_ROLE.search(without_code(out)) and not MYST_DIRECTIVE.search(out)
    assert "(sec-a)=" not in out and "% a MyST" not in out
    with pytest.raises(colab_edition.Unresolved):
        conv.markdown("{glue:text}`missing:.3g`")


GATED = {
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
    "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# T"},
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": "```{exercise} Q\n:label: t-ex-1\nWhy?\n```",
        },
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": "```{solution-start} t-ex-1\n:class: dropdown\n```\nThe reason, computed:",
        },
        {
            "cell_type": "code",
            "metadata": {},
            "source": "assert 1 + 1 == 2",
            "outputs": [],
            "execution_count": None,
        },
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": "Because.\n```{solution-end}\n```\n\n## Recap",
        },
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": "```{solution-start} t-ex-1\n```\nAgain.",
        },
        {"cell_type": "markdown", "metadata": {}, "source": "```{solution-end}\n```"},
        {
            "cell_type": "code",
            "metadata": {},
            "source": "y = 2",
            "outputs": [],
            "execution_count": None,
        },
    ],
}


def gated():
    conv = colab_edition.Converter("book/t", {}, {}, {}, {}, "https://h.io/r/")
    out = colab_edition.convert(GATED, "book/t", conv, "note")
    return out["cells"], ["".join(c["source"]) for c in out["cells"]]


def test_gated_solution_code_is_kept_and_hidden():
    cells, _ = gated()
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code[0]["metadata"]["jupyter"]["source_hidden"] is True
    assert (
        code[0]["metadata"]["cellView"] == "form"
    )  # Colab folds a form cell to its title
    assert "".join(code[0]["source"]).startswith("# @title Solution to exercise 1")
    assert "assert 1 + 1 == 2" in "".join(code[0]["source"])  # still runs
    assert (
        "jupyter" not in code[1]["metadata"] and "cellView" not in code[1]["metadata"]
    )
    assert "".join(cells[1]["source"]) == "note"


def test_gated_solution_text_is_folded_and_the_rest_is_not():
    _, src = gated()
    start = next(s for s in src if "#### Solution to exercise 1" in s)
    # the instruction is a paragraph of its own, the solution's text folded after it
    head, _, rest = start.partition("\n\n<details>")
    assert "Try the exercise first." in head and "The reason" not in head
    assert (
        rest.startswith("\n<summary>Solution to exercise 1")
        and "The reason, computed:" in rest
    )
    end = next(s for s in src if "Because." in s)
    assert end.startswith("<details>") and "Because.\n\n</details>" in end
    assert end.endswith("</details>\n\n## Recap"), (
        "the text after solution-end is not folded"
    )
    assert any(
        "<summary>Solution to exercise 1 (click" in s and "Again." in s for s in src
    )


def test_no_empty_markdown_cell():
    cells, src = gated()
    assert all(s.strip() for c, s in zip(cells, src) if c["cell_type"] == "markdown")
    assert not any("solution-" in s for s in src)  # no marker left


def solution_parts(nb) -> tuple[list[str], set[str]]:
    """A chapter's gated solutions: their markdown text and the ids of their code cells."""
    text, code, inside = [], set(), False
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] == "code":
            if inside:
                code.add(c["id"])
            continue
        for piece in re.split(r"(\{solution-start\}|\{solution-end\})", src):
            if piece in ("{solution-start}", "{solution-end}"):
                inside = piece == "{solution-start}"
            elif inside:
                text.append(piece)
    return text, code


PLAIN_LINE = re.compile(
    r"^[A-Z][A-Za-z ,.;:'()-]{30,}$"
)  # prose the conversion leaves as it is


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_every_solution_in_the_book_is_folded(edition, path):
    """Each gated solution of the chapter: its code cells hidden, its prose inside <details>."""
    text, code = solution_parts(json.loads(path.read_text()))
    nb = json.loads((edition / path.relative_to(ROOT)).read_text())
    for c in nb["cells"]:
        if c.get("id") in code:
            assert c["metadata"]["jupyter"]["source_hidden"], (
                f"{path.stem}: solution code shown"
            )
            assert c["metadata"]["cellView"] == "form"
    folded = "\n".join(
        re.findall(
            r"<details>.*?</details>",
            "\n".join(
                "".join(c["source"])
                for c in nb["cells"]
                if c["cell_type"] == "markdown"
            ),
            re.S,
        )
    )
    lines = [
        ln.strip()
        for t in text
        for ln in t.splitlines()
        if PLAIN_LINE.match(ln.strip())
    ]
    shown = [ln for ln in lines if ln not in folded]
    assert not shown, f"{path.stem}: solution text in plain view: {shown[:3]}"


@pytest.mark.slow  # a Jupyter kernel: left out of --quick
def test_colab_edition_runs_from_outside_the_repository(edition, tmp_path):
    """The set-up cell and the first code cells of one chapter's Colab edition, in a kernel whose
    working folder is outside the repository."""
    require(("nbformat", "nbclient", "ipykernel"))
    import nbformat
    from nbclient import NotebookClient

    only = [c for c in os.environ.get("CHAPTERS", "").split(",") if c]
    path = next((p for p in chapters.notebooks() if not only or p.stem in only), None)
    if path is None:
        pytest.skip("no chapter selected")
    nb = nbformat.read(edition / path.relative_to(ROOT), as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    nb.cells = nb.cells[: code[min(2, len(code) - 1)] + 1]
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    assert "Kernels run on" in json.dumps(nb.cells[code[0]].outputs)


def test_glue_values_read_both_display_forms(tmp_path):
    """glue(display=True) stores text/plain; glue(display=False) stores it under a mime prefix."""

    def out(name, prefix, v):
        return {
            "output_type": "display_data",
            "data": {prefix + "text/plain": v},
            "metadata": {"scrapbook": {"name": name, "mime_prefix": prefix}},
        }

    nb = {
        "cells": [
            {
                "cell_type": "code",
                "source": "",
                "outputs": [
                    out("a", "", "1.5"),
                    out("b", "application/papermill.record/", "2.5"),
                ],
            }
        ]
    }
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps(nb))
    assert colab_edition.glue_values(p) == {"a": "1.5", "b": "2.5"}


def test_glue_values_read_myst_nbs_glue_json(tmp_path):
    """When myst-nb executes a chapter (make book) it moves the glued values out of the notebook
    into <chapter>.glue.json, prefix removed: both are read, the file taking precedence."""
    p = tmp_path / "x.ipynb"
    p.write_text(
        json.dumps({"cells": [{"cell_type": "code", "source": "", "outputs": []}]})
    )
    (tmp_path / "x.glue.json").write_text(
        json.dumps(
            {
                "f": {
                    "output_type": "display_data",
                    "data": {"text/plain": "0.25"},
                    "metadata": {
                        "scrapbook": {
                            "name": "f",
                            "mime_prefix": "application/papermill.record/",
                        }
                    },
                },
                "g": {
                    "output_type": "display_data",
                    "data": {"text/plain": ["'a", "b'"]},
                    "metadata": {"scrapbook": {"name": "g", "mime_prefix": ""}},
                },
            }
        )
    )
    assert colab_edition.glue_values(p) == {"f": "0.25", "g": "'ab'"}
