"""The built book, checked in a real headless browser (Debian's Chromium driven by Playwright).

Every page loads from a local server with all other network access blocked (so MathJax must be
bundled), math renders without MathJax errors, figures load, no cell shows a traceback or an error,
and each chapter's Colab link points at that chapter's Colab edition in the configured repository.
"""

import collections
import os
import shutil

import pytest
import yaml
from book_build import ROOT, toc_files

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGES = [f for f in toc_files()]
NOTEBOOK_PAGES = [f for f in PAGES if (ROOT / f"{f}.ipynb").exists()]

if CHROMIUM is None and os.environ.get("REQUIRE_BROWSER"):
    raise RuntimeError(
        "REQUIRE_BROWSER is set but Chromium is not installed (apt-get install chromium)"
    )
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium not installed (apt-get install chromium)"
)


# The fixtures `server` (the built HTML on a local port) and `browser` (one Chromium per worker)
# are in conftest.py: session-wide, shared by this module and test_pages.py.


def block_non_local(page, server):
    """Abort every request of ``page`` that does not go to the local ``server``; returns the list
    the aborted URLs are recorded in (the book must work offline)."""
    blocked = []

    def route(r):
        if r.request.url.startswith(server):
            return r.continue_()
        blocked.append(r.request.url)
        return r.abort()

    page.route("**/*", route)
    return blocked


# ---------------------------------------------------------------- one load per page and width
# Loading a page (and MathJax typesetting it) is most of a browser test's time, so the tests of
# one page share its load at each viewport width: conftest.py keeps a page's tests together (one
# xdist worker, adjacent), and the last KEEP loads stay open. The light and dark themes differ
# only in CSS keyed on <html data-theme> (no script reads the theme), so test_pages.py switches
# the theme in place. A test that changes the page (moves a slider) is marked changes_page: it
# runs after every other test of its page (browser_order) and then discards the load.
KEEP = 2  # a page at both widths
_LOADED: collections.OrderedDict = collections.OrderedDict()


class _Kept:
    """A shared page: everything as the page, but ``page.context.close()`` leaves it open for
    the next test of that page (the cache closes it when it falls out)."""

    class _Context:
        def __init__(self, context):
            self._context = context

        def __getattr__(self, name):
            return getattr(self._context, name)

        def close(self):
            pass

    def __init__(self, page):
        self._page = page

    def __getattr__(self, name):
        return getattr(self._page, name)

    @property
    def context(self):
        return self._Context(self._page.context)


def load_page(browser, server, page_path, width=1366):
    """The page at a viewport width, every non-local request blocked: (page, js_errors, blocked),
    the errors and blocked requests recorded since it loaded. Shared (see discard)."""
    key = (id(browser), server, page_path, width)
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    context = browser.new_context(
        viewport={"width": width, "height": 900}, accept_downloads=True
    )
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    blocked = block_non_local(page, server)
    response = page.goto(f"{server}/{page_path}.html", wait_until="load")
    assert response is not None and response.ok, (
        f"{page_path}: HTTP {response and response.status}"
    )
    page.wait_for_timeout(300)  # the page's own scripts (scroll cues, figures) have run
    _LOADED[key] = (_Kept(page), errors, blocked)
    while len(_LOADED) > KEEP:
        _close(_LOADED.popitem(last=False)[1])
    return _LOADED[key]


def _close(loaded) -> None:
    loaded[0]._page.context.close()


def discard(browser, server, page_path, width=1366) -> None:
    """Close a shared load that a test has changed, so that no later test reads it."""
    loaded = _LOADED.pop((id(browser), server, page_path, width), None)
    if loaded is not None:
        _close(loaded)


def browser_order(item):
    """conftest.py's sort key for a browser test: its page (and an xdist group per page)."""
    page = getattr(item, "callspec", None) and item.callspec.params.get("page_path")
    if page is None or "browser" not in item.fixturenames:
        return ("",)
    if not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(f"page-{page}"))
    return (page, item.get_closest_marker("changes_page") is not None)


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
