"""The book's pages in a headless Chromium, shared by the browser tests (test_html.py,
test_pages.py): which pages there are, and each page loaded once per viewport width.

Loading a page (and MathJax typesetting it) is most of a browser test's time, so the tests of
one page share its load at each viewport width: the plugin tests/scheduling.py keeps a page's
tests together (one xdist worker, adjacent), and the last KEEP loads stay open. The light and
dark themes differ only in CSS keyed on <html data-theme> (no script reads the theme), so
test_pages.py switches the theme in place. A test that changes the page (moves a slider) is
marked changes_page: it runs after every other test of its page and then discards the load.

The fixtures ``server`` (the built HTML on a local port) and ``browser`` (one Chromium per
worker) are conftest.py's.
"""

import collections
import os
import shutil

from chapters import ROOT, toc_files

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGES = toc_files()
NOTEBOOK_PAGES = [f for f in PAGES if (ROOT / f"{f}.ipynb").exists()]

if CHROMIUM is None and os.environ.get("REQUIRE_BROWSER"):
    raise RuntimeError(
        "REQUIRE_BROWSER is set but Chromium is not installed (apt-get install chromium)"
    )


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
