"""What a page weighs and what it asks of the network: plotly.js as a partial bundle of at most
2 MB of the version the installed plotly writes figures for, deferred, with no fallback to a CDN
left in any page; unique element ids; a favicon; search snippets without raw LaTeX."""

import re
from collections import Counter

import pytest
from book_build import ROOT
from browser_pages import CHROMIUM, PAGES, block_non_local

VENDOR = ROOT / "_ext" / "static" / "vendor" / "plotly-basic.min.js"
MAX_SCRIPT_BYTES = 2_000_000


def test_vendored_plotly_is_small_and_the_installed_version():
    pytest.importorskip("plotly")
    from plotly.offline import get_plotlyjs_version

    head = VENDOR.read_text()[:300]
    found = re.search(r"plotly\.js \(basic - minified\) v(\S+)", head)
    assert found, f"{VENDOR}: not plotly.js's basic bundle"
    assert found.group(1) == get_plotlyjs_version(), (
        f"{VENDOR} is plotly.js {found.group(1)}, the installed plotly writes figures for "
        f"{get_plotlyjs_version()}: fetch that version (npm pack "
        f"plotly.js-basic-dist-min@{get_plotlyjs_version()})"
    )
    assert VENDOR.stat().st_size <= MAX_SCRIPT_BYTES
    assert (VENDOR.parent / "plotly-basic.LICENSE").exists()


@pytest.mark.parametrize("page_path", PAGES)
def test_page_scripts_ids_and_favicon(built_html, page_path):
    html = (built_html / f"{page_path}.html").read_text()
    assert "cdn.plot.ly" not in html, (
        f"{page_path}: a figure still loads plotly from a CDN"
    )
    ids = Counter(re.findall(r'\sid="([^"]+)"', html))
    dup = {k: n for k, n in ids.items() if n > 1}
    assert not dup, f"{page_path}: duplicate element ids {dup}"
    icon = re.search(r'<link rel="icon" href="([^"]+)"', html)
    assert icon, f"{page_path}: no favicon"
    assert (built_html / page_path).parent.joinpath(icon.group(1)).resolve().exists()
    for src in re.findall(r'<script[^>]*\ssrc="([^"?]+)', html):
        if src.startswith(("http:", "https:")):
            pytest.fail(f"{page_path}: a script from the network: {src}")
        path = ((built_html / page_path).parent / src).resolve()
        assert path.stat().st_size <= MAX_SCRIPT_BYTES, f"{page_path}: {src} is too big"
    for tag in re.findall(r"<script[^>]*plotly[^>]*>", html):
        assert "defer" in tag, f"{page_path}: plotly.js holds up the first paint: {tag}"


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed")
def test_search_snippets_show_no_raw_latex(browser, server):  # noqa: F811
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = context.new_page()
    blocked = block_non_local(page, server)
    page.goto(f"{server}/search.html?q=RMSNorm", wait_until="load")
    try:
        page.wait_for_function(
            "() => document.querySelectorAll('#search-results li p.context').length >= 3",
            timeout=60000,
        )
        snippets = page.eval_on_selector_all(
            "#search-results li p.context", "els => els.map(e => e.textContent)"
        )
        raw = [s for s in snippets if re.search(r"\\[A-Za-z]+|\\\(|\$\$", s)]
        assert not raw, f"search snippets with raw LaTeX: {raw[:3]}"
        assert not blocked
    finally:
        context.close()


def _ids(path, cache={}):  # noqa: B006 (a cache across the pages of one run)
    if path not in cache:
        cache[path] = set(re.findall(r'\sid="([^"]+)"', path.read_text()))
    return cache[path]


@pytest.mark.parametrize("page_path", PAGES)
def test_internal_links_resolve(built_html, page_path):
    """Every link and source of the page that stays in the book names a file that exists and,
    with a fragment, an element of that file. The PDF is made after the HTML (`make book`;
    tests/book/test_pdf.py prints its own)."""
    import book_pdf

    page = built_html / f"{page_path}.html"
    html = page.read_text()
    bad = []
    for url in re.findall(r'\s(?:href|src)="([^"]+)"', html):
        if re.match(r"[a-z]+:", url) or url.startswith("//"):
            continue
        path, _, frag = url.partition("#")
        path = path.split("?")[0]
        target = (page.parent / path).resolve() if path else page
        if target.name == book_pdf.NAME and target.parent == built_html.resolve():
            continue
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            bad.append(url)
        elif frag and target.suffix == ".html" and frag not in _ids(target):
            bad.append(url)
    assert not bad, f"{page_path}: links that lead nowhere: {sorted(set(bad))[:8]}"
