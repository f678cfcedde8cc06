"""No typed results in the prose: every number a chapter states comes from glue or is a defined
input named, with its reason, in prose_allowlist.yml (see prose_check.py)."""

import collections
import json
import pathlib

import chapters
import pytest
import yaml
from prose_check import typed_numbers

ALLOWLIST = yaml.safe_load(
    (pathlib.Path(__file__).with_name("prose_allowlist.yml")).read_text()
)


def _allowed(chapter: str) -> set[str]:
    entries = (ALLOWLIST.get("all") or []) + (ALLOWLIST.get(chapter) or [])
    return {str(e["number"]) for e in entries}


@pytest.mark.parametrize("path", chapters.notebooks(), ids=lambda p: p.stem)
def test_no_typed_number_in_prose(path):
    allowed = _allowed(path.stem)
    found = collections.defaultdict(list)
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "markdown":
            for n in typed_numbers("".join(cell["source"])):
                if n not in allowed:
                    found[n].append(i)
    assert not found, (
        f"{path.name}: numbers typed in prose (glue them, or list a defined input in "
        f"tests/book/prose_allowlist.yml with its reason): "
        + ", ".join(f"{n} (cell {cells})" for n, cells in found.items())
    )


def test_allowlist_entries_have_reasons_and_are_used():
    """A reviewed list stays small: every entry says why it is an input, and is still needed."""
    texts = {
        p.stem: "\n".join(
            "".join(c["source"])
            for c in json.loads(p.read_text())["cells"]
            if c["cell_type"] == "markdown"
        )
        for p in chapters.notebooks()
    }
    for chapter, entries in ALLOWLIST.items():
        for e in entries or []:
            assert e.get("why"), f"{chapter}: {e['number']} has no reason"
            pool = texts.values() if chapter == "all" else [texts.get(chapter, "")]
            assert any(str(e["number"]) in typed_numbers(t) for t in pool), (
                f"{chapter}: allowlisted {e['number']} no longer appears; remove it"
            )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The error is 3.7e-8, about 12 % of the bound.", ["3.7e-8", "12%"]),
        ("RMS 3.5355 and y = (0.8485, 1.1314).", ["3.5355", "0.8485", "1.1314"]),
        ("inline math $\\epsilon = 1e-6$ and code `0.25`", ["1e-6", "0.25"]),
        (
            "glued {glue:text}`err:.2e` and {doc}`rms_norm`, see [v1.5](http://x/1.5)",
            [],
        ),
        ("```python\nprint(0.5)\n```\nafter", []),
        ("```{exercise} T\n:label: ex-1.5\nfind 2.5\n```", ["2.5"]),
        ("48 blocks of 2 rows", []),
    ],
)
def test_checker_finds_planted_numbers(text, expected):
    assert typed_numbers(text) == expected


def test_a_planted_typed_number_fails_the_chapter_check(tmp_path, monkeypatch):
    """The check is not vacuous: a chapter with a typed result in its prose is caught."""
    nb = {
        "cells": [
            {
                "cell_type": "markdown",
                "metadata": {},
                "source": ["The max error is 2.4e-7."],
            }
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    fake = tmp_path / "planted.ipynb"
    fake.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="2.4e-7"):
        test_no_typed_number_in_prose(fake)
