"""The whole book as one PDF, printed from the built HTML by Chromium (the browser the tests
use), offline: every page of _toc.yml in order, with its executed outputs, figures and typeset
math, merged into one file with a bookmark per page.

Each page is served from a local port (the HTML's own assets; every other request is
refused), printed once MathJax has typeset it and every interactive figure is drawn, on A4
with the theme's print styles (no sidebars, no buttons), its title and page numbers in the
footer. `make book` runs it after the HTML build; the intro links the result.

Usage: ``python tools/book_pdf.py [HTML_DIR] [--out PATH]`` (default ``_build/html``, written
to ``HTML_DIR/normbook.pdf``). Needs Chromium (``apt-get install chromium``) or Chrome, and
Playwright; without either browser it says so and builds no PDF.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import http.server
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from chapters import ROOT, toc_files  # noqa: E402

NAME = "normbook.pdf"
#: The browsers that can print it, in order: Debian's Chromium (the tests' browser), then
#: Google Chrome (what GitHub's Ubuntu runners have).
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FOOTER = (
    '<div style="font-size:8px;width:100%;text-align:center;color:#555;">'
    '<span class="title"></span> · <span class="pageNumber"></span></div>'
)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(folder: pathlib.Path):
    """``folder`` on a local port, quietly; yields its URL (also the tests' server)."""
    handler = functools.partial(_Quiet, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def _ready(page) -> None:
    """MathJax done, every interactive figure drawn, fonts loaded."""
    page.evaluate(
        "async () => { const s = window.MathJax && MathJax.startup;"
        " if (s && s.promise) await s.promise; await document.fonts.ready; }"
    )
    page.wait_for_function(
        "() => [...document.querySelectorAll('.plotly-graph-div')]"
        ".every(d => d._fullLayout)",
        timeout=60000,
    )


def print_book(
    html: pathlib.Path,
    out: pathlib.Path,
    chromium: str | None = None,
    browser=None,
    jobs: int = 1,
) -> int:
    """Print every page of the table of contents into ``out``; returns its page count.
    ``browser``: a Playwright browser already running (the tests'), else Chromium at
    ``chromium`` is launched for the job, ``jobs`` of them printing every ``jobs``-th
    page each in processes of their own (Chromium's layout and printing keep a core
    busy: 47 s for the book on one, measured on 2 cores)."""
    pages = toc_files()
    missing = [p for p in pages if not (html / f"{p}.html").exists()]
    if missing:
        raise FileNotFoundError(f"not built: {missing} (in {html})")
    with tempfile.TemporaryDirectory() as tmp:
        if browser is not None:
            parts = _print_parts(browser, html, pages, pathlib.Path(tmp))
        else:
            jobs = max(1, min(jobs, len(pages)))
            shares = [(chromium, html, pages[j::jobs], tmp) for j in range(jobs)]
            if jobs == 1:
                parts = _print_launched(*shares[0])
            else:
                with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
                    parts = [p for got in pool.map(_print_launched, *zip(*shares))
                             for p in got]  # fmt: skip
        order = {name: i for i, name in enumerate(pages)}
        parts.sort(key=lambda part: order[part[0]])
        return _merge(parts, out)


def _print_launched(chromium, html, pages, tmp) -> list[tuple[str, str, str]]:
    """``pages`` printed by a Chromium of this process's own."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=chromium)
        try:
            return _print_parts(launched, html, pages, pathlib.Path(tmp))
        finally:
            launched.close()


def _print_parts(browser, html: pathlib.Path, pages, tmp: pathlib.Path) -> list:
    """Each page into a PDF of its own in ``tmp``: (name, title, path) per page."""
    parts = []
    with serve(html) as server:
        context = browser.new_context(viewport={"width": 1100, "height": 1400})
        context.route(
            "**/*",
            lambda r: r.continue_() if r.request.url.startswith(server) else r.abort(),
        )
        page = context.new_page()
        for name in pages:
            page.goto(f"{server}/{name}.html", wait_until="load")
            _ready(page)
            title = page.evaluate(
                "() => (document.querySelector('main h1') || {}).textContent || ''"
            )
            part = tmp / (name.replace("/", "_") + ".pdf")
            page.pdf(
                path=str(part),
                format="A4",
                # at 0.8 the text column is about as wide as on a laptop: what fits
                # there fits here (paper cannot scroll a wide formula or table)
                scale=0.8,
                margin={
                    "top": "14mm",
                    "bottom": "14mm",
                    "left": "12mm",
                    "right": "12mm",
                },
                print_background=False,
                display_header_footer=True,
                header_template="<div></div>",
                footer_template=FOOTER,
            )
            parts.append((name, title.replace("#", "").strip() or name, str(part)))
        context.close()
    return parts


def _merge(parts, out: pathlib.Path) -> int:
    """The pages' PDFs, in order, into ``out`` with a bookmark per page."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter()
    for _, title, part in parts:
        start = len(writer.pages)
        writer.append(PdfReader(part))
        writer.add_outline_item(title=title, page_number=start)
    writer.add_metadata(
        {"/Title": "The Numerics of an LLM Layer, from Formula to Triton Kernel"}
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        writer.write(f)
    return len(writer.pages)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("html", nargs="?", default=str(ROOT / "_build" / "html"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    html = pathlib.Path(args.html).resolve()
    out = pathlib.Path(args.out) if args.out else html / NAME
    chromium = next(filter(None, map(shutil.which, BROWSERS)), None)
    if chromium is None:
        # The HTML book stands without it; say so loudly rather than fail the build.
        print(
            "book_pdf: no Chromium or Chrome found (apt-get install chromium): the HTML "
            f"book is built, its PDF is not ({out} is missing)"
        )
        return 0
    t0 = time.perf_counter()
    n = print_book(html, out, chromium, jobs=min(2, os.cpu_count() or 1))
    print(f"PDF: {out} ({n} pages, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
