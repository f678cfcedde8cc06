"""The whole-book PDF (tools/book_pdf.py, run by `make book`): printed from this run's build,
it has every page of the table of contents, each with a bookmark and its title in the text, and
at least MIN_PAGES pages; the intro links it."""

import json
import re

import pytest
from book_build import ROOT
from browser_pages import CHROMIUM, PAGES

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed")

MIN_PAGES = 100


@pytest.fixture(scope="module")
def pdf(built_html, browser, tmp_path_factory):  # noqa: F811
    pytest.importorskip("pypdf")
    import book_pdf

    out = tmp_path_factory.mktemp("pdf") / book_pdf.NAME
    # the worker's browser: a second sync Playwright cannot start in its process
    book_pdf.print_book(built_html, out, browser=browser)
    from pypdf import PdfReader

    return PdfReader(str(out))


def title(page_path: str) -> str:
    """A page's first heading, from its source."""
    path = ROOT / f"{page_path}.ipynb"
    if path.exists():
        text = "".join(json.loads(path.read_text())["cells"][0]["source"])
    else:
        text = (ROOT / f"{page_path}.md").read_text()
    return re.search(r"^# (.+)$", text, re.M).group(1).strip()


def test_pdf_has_every_chapter_and_enough_pages(pdf):
    assert len(pdf.pages) >= MIN_PAGES
    marks = list(pdf.outline)
    assert len(marks) == len(PAGES), [m.title for m in marks]
    for page_path, mark in zip(PAGES, marks):
        want = re.sub(r"[`*$\\]", "", title(page_path)).split(":")[0]
        assert want.lower() in mark.title.lower(), (page_path, mark.title)
        first = pdf.get_destination_page_number(mark)
        text = re.sub(r"\s+", " ", pdf.pages[first].extract_text() or "")
        assert want in text, f"{page_path}: title {want!r} not on its first PDF page"


def test_intro_links_the_pdf():
    import book_pdf

    assert book_pdf.NAME in (ROOT / "book" / "intro.md").read_text()
