"""The built book, checked in a real headless browser (Debian's Chromium driven by Playwright).

Every page loads from a local server with all other network access blocked (so MathJax must be
bundled), math renders without MathJax errors, figures load, no cell shows a traceback or an error,
and each chapter's Colab link points at that chapter's Colab edition in the configured repository.
"""

import pytest
import yaml
from book_build import ROOT
from browser_pages import CHROMIUM, NOTEBOOK_PAGES, PAGES, load_page

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium not installed (apt-get install chromium)"
)


def open_page(browser, server, page_path):
    """A page at 1366 px with every non-local request blocked; returns (page, js_errors, blocked)."""
    return load_page(browser, server, page_path, 1366)


@pytest.mark.parametrize("page_path", PAGES)
def test_page_loads_and_math_renders(browser, server, page_path):
    page, errors, blocked = open_page(browser, server, page_path)
    try:
        assert page.title().strip(), f"{page_path}: empty title"
        has_math = page.locator("div.math, span.math").count() > 0
        if has_math:
            page.wait_for_function(
                "() => document.querySelectorAll('mjx-container').length > 0",
                timeout=30000,
            )
            assert page.locator("mjx-merror").count() == 0, (
                f"{page_path}: MathJax reported an error"
            )
            assert "Math input error" not in page.inner_text("main")
        assert not errors, f"{page_path}: JavaScript errors: {errors}"
        local_scripts = [u for u in blocked if "mathjax" in u.lower()]
        assert not local_scripts, (
            f"{page_path}: MathJax was requested from the network: {local_scripts}"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_chapter_outputs_are_clean_and_figures_load(browser, server, page_path):
    page, errors, _ = open_page(browser, server, page_path)
    try:
        main = page.inner_text("main")
        assert "Traceback (most recent call last)" not in main, (
            f"{page_path}: a traceback is shown"
        )
        assert (
            page.locator(".output.error, .output.traceback, .output.stderr").count()
            == 0
        ), f"{page_path}: an error or stderr output is shown"
        images = page.locator(
            "main .cell_output img"
        )  # figures produced by the chapter's code
        assert images.count() > 0, f"{page_path}: the chapter has no figure"
        broken = page.evaluate(
            "() => [...document.querySelectorAll('main img')]"  # every image, logos too
            ".filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
        )
        assert not broken, f"{page_path}: figures that did not load: {broken}"
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_colab_link_points_at_the_chapter_notebook(browser, server, page_path):
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = cfg["repository"]["url"].rstrip("/").removeprefix("https://github.com/")
    page, _, _ = open_page(browser, server, page_path)
    try:
        hrefs = page.eval_on_selector_all(
            "a[href*='colab.research.google.com']", "els => els.map(e => e.href)"
        )
        # the Colab edition (tools/colab_edition.py), published to its own branch by pages.yml
        branch = (
            cfg["sphinx"]["config"].get("colab_edition_branch")
            or cfg["repository"]["branch"]
        )
        expected = f"https://colab.research.google.com/github/{repo}/blob/{branch}/{page_path}.ipynb"
        assert expected in hrefs, (
            f"{page_path}: Colab links {hrefs}, expected {expected}"
        )
        assert (ROOT / f"{page_path}.ipynb").exists()
    finally:
        page.context.close()
