"""Pages that work for every reader, measured in Chromium at 390 px (a phone) and 1366 px (a
laptop), in the light and the dark theme (tests/book/page_checks.py holds the measurements).

- text contrast >= 4.5:1 (WCAG AA) everywhere in <main>, table outputs and code in tables included;
- figures sharp (SVG, or PNG with twice the pixels shown) and, at 390 px, their text >= 9 CSS px;
- tables pad their cells, keep numbers on one line, and say when they scroll sideways;
- no code block scrolls sideways at 1366 px (kernel listings and outputs included); at 390 px no
  page is wider than the screen, and a wide equation scrolls in its own box with a cue;
- no markdown table shown as raw text, no printed output split into several boxes;
- dark mode: every figure (matplotlib's or plotly's) dimmed alike;
- interactive figures: drawn by the book's own plotly.js, no request leaves the page, and moving a
  slider changes the plotted data;
- the .ipynb download button saves the chapter's Colab edition.
"""

import json

import page_checks
import pytest
from book_build import ROOT
from page_checks import (
    CLIPPED_MATH_JS,
    CONTRAST_JS,
    EQUATIONS_JS,
    FIGURE_TEXT_JS,
    FIGURES_LOOK_JS,
    PAGE_WIDTH_JS,
    SCROLLING_CODE_JS,
    set_theme_script,
)
from browser_pages import CHROMIUM, NOTEBOOK_PAGES, PAGES, discard, load_page

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium not installed (apt-get install chromium)"
)

MIN_CONTRAST = 4.5
MIN_FIGURE_TEXT_PX = 9.0
VIEWS = [(390, "light"), (390, "dark"), (1366, "light"), (1366, "dark")]


def open_view(browser, server, page_path, width=1366, theme="light"):  # noqa: F811
    """A page at a viewport width and theme; every non-local request is blocked and recorded.
    Shared with the other tests of that page and width (browser_pages.load_page): the theme
    is switched in place. A test that changes the page is marked ``changes_page`` and discards
    the load when it is done (browser_pages.discard)."""
    page, _, blocked = load_page(browser, server, page_path, width)
    page.evaluate(f"() => {{ {set_theme_script(theme)} }}")
    assert page.evaluate("document.documentElement.dataset.theme") == theme
    return page, blocked


def views():
    return [
        pytest.param(p, w, t, id=f"{p.split('/')[-1]}-{w}-{t}")
        for p in NOTEBOOK_PAGES
        for w, t in VIEWS
    ]


@pytest.mark.parametrize("page_path,width,theme", views())
def test_text_contrast(browser, server, page_path, width, theme):  # noqa: F811
    page, _ = open_view(browser, server, page_path, width, theme)
    try:
        runs = page.evaluate(CONTRAST_JS, MIN_CONTRAST)
        assert runs["count"], f"{page_path}: no text measured"
        bad = runs["bad"]
        assert not bad, (
            f"{page_path} at {width} px, {theme}: {len(bad)} text runs below {MIN_CONTRAST}:1, "
            f"worst {bad[:5]}"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_figures_are_sharp(browser, server, page_path):  # noqa: F811
    page, _ = open_view(browser, server, page_path)
    try:
        blurry = page.evaluate(
            "() => [...document.querySelectorAll('main .cell_output img')]"
            ".filter(i => !i.src.endsWith('.svg') && i.naturalWidth < 2 * i.clientWidth)"
            ".map(i => i.src)"
        )
        assert not blurry, (
            f"{page_path}: raster figures with fewer than 2 pixels per CSS px: {blurry}"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_figure_text_legible_on_a_phone(browser, server, page_path):  # noqa: F811
    page, _ = open_view(browser, server, page_path, 390)
    try:
        figures = page.evaluate(FIGURE_TEXT_JS)
        small = [
            f for f in figures if f["texts"] and f["smallest_px"] < MIN_FIGURE_TEXT_PX
        ]
        assert not small, (
            f"{page_path} at 390 px: figure text below {MIN_FIGURE_TEXT_PX} px: {small}"
        )
    finally:
        page.context.close()


# kernels/ files with lines over 88 columns, whose listings (show_source) would scroll at
# 1366 px. Empty: kernels/ fits 88 columns (test_code_width.py keeps it so); a file listed
# here must still have a long line (test_long_line_exemptions_are_still_needed).
KERNEL_FILES_WITH_LONG_LINES: list[str] = []
CODE_COLUMNS = 88


def from_exempt_kernel_file(text: str) -> str | None:
    """The exempted kernels/ file that a scrolling listing's long lines were all read from."""
    long = [ln.strip() for ln in text.splitlines() if len(ln) > CODE_COLUMNS]
    for name in KERNEL_FILES_WITH_LONG_LINES:
        source = {ln.strip() for ln in (ROOT / name).read_text().splitlines()}
        if long and all(ln in source for ln in long):
            return name
    return None


def test_long_line_exemptions_are_still_needed():
    done = [
        n
        for n in KERNEL_FILES_WITH_LONG_LINES
        if max(map(len, (ROOT / n).read_text().splitlines())) <= CODE_COLUMNS
    ]
    assert not done, (
        f"{done} fit {CODE_COLUMNS} columns now: remove them from KERNEL_FILES_WITH_LONG_LINES"
    )


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_no_code_block_scrolls_at_desktop_width(browser, server, page_path):  # noqa: F811
    """No code block scrolls sideways at 1366 px: chapter code cells (at most 88 columns), their
    outputs, code in prose, and the kernel listings shown from normbook/ (drawn at the code cells'
    size; the files with longer lines, until reformatted, are listed above)."""
    page, _ = open_view(browser, server, page_path, 1366)
    try:
        wide = [
            w
            for w in page.evaluate(SCROLLING_CODE_JS)
            if not (w["where"] == "output" and from_exempt_kernel_file(w["text"]))
        ]
        for w in wide:
            del w["text"]
        assert not wide, (
            f"{page_path} at 1366 px: {len(wide)} code blocks scroll sideways, e.g. {wide[:3]}"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", PAGES)
def test_no_page_is_wider_than_a_phone(browser, server, page_path):  # noqa: F811
    """At 390 px nothing widens the page past the screen (a reader could not scroll to it):
    long inline code wraps, wide tables and equations scroll inside their own boxes."""
    page, _ = open_view(browser, server, page_path, 390)
    try:
        page.wait_for_timeout(200)
        info = page.evaluate(PAGE_WIDTH_JS)
        assert info["over"] <= 1 and not info["out"], (
            f"{page_path} at 390 px: page {info['over']} px wider than the screen; sticking out: {info['out']}"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", PAGES)
def test_wide_equations_scroll_with_a_cue(browser, server, page_path):  # noqa: F811
    page, _ = open_view(browser, server, page_path, 390)
    try:
        if page.locator("main div.math").count() == 0:
            pytest.skip(f"{page_path}: no display equation")
        page.wait_for_function(
            "() => document.querySelectorAll('main div.math mjx-container').length"
            " === document.querySelectorAll('main div.math').length",
            timeout=30000,
        )
        page.wait_for_timeout(300)  # book.js looks again once MathJax is done
        bad = [
            e
            for e in page.evaluate(EQUATIONS_JS)
            if e["wide"] and not (e["scrolls"] and e["cue"])
        ]
        assert not bad, (
            f"{page_path} at 390 px: equations cut off or scrolling without a cue: {bad[:4]}"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("width", [390, 1366])
@pytest.mark.parametrize("page_path", PAGES)
def test_no_math_is_cut_off(browser, server, page_path, width):  # noqa: F811
    """No formula loses part of its box, inline or display, at 390 or 1366 px: one too wide for
    its line gets a line of its own that scrolls, with a cue (book.js)."""
    page, _ = open_view(browser, server, page_path, width)
    try:
        page.evaluate("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
        page.wait_for_timeout(300)  # book.js looks again once MathJax is done
        cut = page.evaluate(CLIPPED_MATH_JS)
        assert not cut, f"{page_path} at {width} px: {len(cut)} formulas cut off: {cut[:4]}"
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_dark_mode_figures_are_drawn_alike(browser, server, page_path):  # noqa: F811
    """In the dark theme every figure, matplotlib's and plotly's, gets the theme's treatment of
    images (dimmed, on the same background): no figure is the one bright card on the page."""
    # The shared page, switched in place: the theme's treatment of figures is CSS keyed on
    # html[data-theme] (the pydata theme's and _ext/static/book.css), no script on load.
    page, _ = open_view(browser, server, page_path, 1366, "dark")
    try:
        looks = page.evaluate(FIGURES_LOOK_JS)
        if not looks:
            pytest.skip(f"{page_path}: no figure shown")
        kinds = {(f["filter"], f["background"], f["padding"]) for f in looks}
        assert len(kinds) == 1, (
            f"{page_path}, dark: figures drawn differently: {sorted(kinds)}"
        )
        assert next(iter(kinds))[0] != "none", f"{page_path}, dark: figures not dimmed"
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_no_raw_markdown_table(built_html, page_path):
    """A markdown table printed by a cell (normbook.lab.inspector) is rendered as a table, not shown as
    lines of pipes."""
    raw = page_checks.raw_pipe_tables((built_html / f"{page_path}.html").read_text())
    assert not raw, (
        f"{page_path}: {len(raw)} Markdown tables shown as text, e.g. {raw[:2]}"
    )


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_no_output_split_into_boxes_of_one_stream(built_html, page_path):
    """A cell's printed lines sit in one box (per stream), however many messages carried them."""
    split = page_checks.split_streams((built_html / f"{page_path}.html").read_text())
    assert not split, (
        f"{page_path}: {len(split)} printed outputs split into adjacent boxes, at {split[:3]}"
    )


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_tables_pad_cells_keep_numbers_whole_and_cue_scrolling(
    browser, server, page_path
):  # noqa: F811
    page, _ = open_view(browser, server, page_path, 390)
    try:
        info = page.evaluate("""() => [...document.querySelectorAll('main table')].map(t => {
            const cells = [...t.querySelectorAll('td')];
            let box = t.parentElement;
            while (box && box !== document.body && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
            const wide = !!box && box !== document.body && box.scrollWidth > box.clientWidth + 2;
            const cue = wide && box.previousElementSibling && box.previousElementSibling.classList.contains('scroll-cue')
                        && box.previousElementSibling.getBoundingClientRect().height > 0;
            // a number cell whose text lies on more than one line (its text's own boxes)
            // (text nodes only: a cell's <p>, as MyST writes it, is a box of its own)
            const lines = c => { const tops = new Set();
                                 const w = document.createTreeWalker(c, NodeFilter.SHOW_TEXT);
                                 for (let n = w.nextNode(); n; n = w.nextNode()) {
                                   if (!n.textContent.trim()) continue;
                                   const r = document.createRange(); r.selectNodeContents(n);
                                   for (const x of r.getClientRects()) tops.add(Math.round(x.top)); }
                                 return tops.size; };
            return {
              pad: Math.min(...cells.map(c => parseFloat(getComputedStyle(c).paddingLeft) + parseFloat(getComputedStyle(c).paddingRight))),
              broken: cells.filter(c => c.classList.contains('num') && lines(c) > 1).map(c => c.textContent),
              nums: cells.filter(c => c.classList.contains('num')).length,
              wide, cue};
        })""")
        if not info:
            pytest.skip(f"{page_path}: no table")
        for i, t in enumerate(info):
            assert t["pad"] >= 8, (
                f"{page_path} table {i}: cells padded {t['pad']} px in all (< 8)"
            )
            assert not t["broken"], (
                f"{page_path} table {i}: numbers broken across lines: {t['broken']}"
            )
            assert not t["wide"] or t["cue"], (
                f"{page_path} table {i}: scrolls at 390 px without a cue"
            )
    finally:
        page.context.close()


@pytest.mark.parametrize("page_path", NOTEBOOK_PAGES)
def test_download_button_saves_a_notebook(browser, server, page_path):  # noqa: F811
    # The shared page (its context accepts downloads): a click on a download link saves a
    # file and leaves the page as it was.
    page, _ = open_view(browser, server, page_path)
    try:
        link = page.locator("a[href*='_sources/'][href$='.ipynb']")
        assert link.count() == 1, f"{page_path}: no .ipynb download link"
        assert link.get_attribute("download") == page_path.split("/")[-1] + ".ipynb"
        with page.expect_download() as info:
            link.evaluate("a => a.click()")
        download = info.value
        assert download.suggested_filename == page_path.split("/")[-1] + ".ipynb"
        nb = json.loads(open(download.path()).read())
        assert nb["nbformat"] == 4 and nb["cells"], (
            f"{page_path}: the download is not a notebook"
        )
        # the Colab edition (plain Jupyter Markdown), not the MyST source that Jupyter shows raw
        markdown = "\n".join(
            "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"
        )
        assert "**Colab edition**" in markdown, (
            f"{page_path}: the download is not the Colab edition"
        )
        assert "{doc}`" not in markdown and "{glue:text}`" not in markdown, (
            f"{page_path}: MyST left"
        )
    finally:
        page.context.close()


def interactive_pages():
    """Chapters with an interactive figure (a cell calling interactive_figure)."""
    return [
        p
        for p in NOTEBOOK_PAGES
        if "interactive_figure(" in (ROOT / f"{p}.ipynb").read_text()
    ]


@pytest.mark.changes_page  # it moves sliders: after the page's other tests, then discarded
@pytest.mark.parametrize("page_path", interactive_pages())
def test_interactive_figures_work_offline_and_their_sliders_move_the_data(
    browser, server, page_path
):  # noqa: F811
    page, blocked = open_view(browser, server, page_path, 390)
    try:
        figs = page.locator("main .plotly-graph-div")
        if figs.count() == 0:
            pytest.skip(f"{page_path}: not executed in this session (no figure output)")
        page.wait_for_function(
            "() => [...document.querySelectorAll('main .plotly-graph-div')]"
            ".every(d => d.data && d._fullLayout)",
            timeout=30000,
        )
        src = page.evaluate(
            "() => [...document.scripts].map(s => s.src).filter(s => s.includes('plotly'))"
        )
        assert src and all(s.startswith(server) for s in src), (
            f"plotly.js not served by the book: {src}"
        )
        for k in range(figs.count()):
            fig = figs.nth(k)
            fig.scroll_into_view_if_needed()
            data = "d => JSON.stringify(d.data.map(t => [Array.from(t.x || []), Array.from(t.y || [])]))"
            before = fig.evaluate(data)
            rail = fig.locator(".slider-rail-rect").first
            assert rail.count() == 1, f"{page_path} figure {k}: no slider"
            box = rail.bounding_box()
            active = fig.evaluate("d => d.layout.sliders[0].active")
            n = fig.evaluate("d => d.layout.sliders[0].steps.length")
            target = 0 if active > n // 2 else n - 1
            page.mouse.click(
                box["x"] + 4 + (box["width"] - 8) * target / max(1, n - 1),
                box["y"] + box["height"] / 2,
            )
            page.wait_for_function(
                "([d, b]) => JSON.stringify(d.data.map(t => [Array.from(t.x || []), "
                "Array.from(t.y || [])])) !== b",
                arg=[fig.element_handle(), before],
                timeout=5000,
            )
            assert fig.evaluate(data) != before
        page.wait_for_timeout(500)
        assert not blocked, f"{page_path}: requests left the page: {blocked}"
    finally:
        discard(browser, server, page_path, 390)


@pytest.mark.changes_page  # it opens and closes the sidebars: after the page's other tests
@pytest.mark.parametrize("page_path", PAGES)
def test_table_of_contents_opens_on_a_phone(browser, server, page_path):  # noqa: F811
    """At 390 px a tap on the visible ☰ opens the table of contents (every chapter's link
    on screen) and a tap on the list icon opens the page's contents; a tap beside them closes
    them (pydata-sphinx-theme 0.17 binds only hidden toggles: _ext/static/book.js)."""
    page, _ = open_view(browser, server, page_path, 390)
    try:
        for side, link in (("primary", "a.reference"), ("secondary", "a")):
            toggle = page.locator(f".{side}-toggle:visible")
            if side == "secondary" and not page.locator(".bd-toc-nav a").count():
                continue  # a page without sections has no contents to open
            assert toggle.count() == 1, f"{page_path}: {toggle.count()} {side} toggles shown"
            toggle.click()
            dialog = page.locator(f"#pst-{side}-sidebar-modal")
            page.wait_for_function(
                "d => d.open", arg=dialog.element_handle(), timeout=3000
            )
            box = dialog.bounding_box()
            assert box and box["width"] >= 200 and box["x"] >= 0, f"{side}: {box}"
            links = dialog.locator(f"{link}:visible")
            if side == "primary":
                texts = " ".join(links.all_inner_texts())
                missing = [t for t in ("Sampling", "fp8", "LayerNorm") if t not in texts]
                assert not missing, f"{page_path}: table of contents lacks {missing}"
            # the backdrop, beside the drawer (the contents' drawer comes from the right)
            page.mouse.click(385 if box["x"] < 50 else 5, 780)
            page.wait_for_function(
                "d => !d.open", arg=dialog.element_handle(), timeout=3000
            )
    finally:
        discard(browser, server, page_path, 390)


@pytest.mark.changes_page
@pytest.mark.parametrize("page_path", PAGES)
def test_one_search_box_and_a_sidebar_toggle_at_laptop_width(
    browser, server, page_path
):  # noqa: F811
    page, _ = open_view(browser, server, page_path, 1366)
    try:
        shown = page.evaluate(
            "() => [...document.querySelectorAll('.search-button-field, .search-button')]"
            ".filter(e => e.getClientRects().length"
            " && getComputedStyle(e).visibility !== 'hidden').length"
        )
        assert shown == 1, f"{page_path} at 1366 px: {shown} search boxes shown"
        sidebar = page.locator("#pst-primary-sidebar")
        assert sidebar.is_visible()
        page.locator(".primary-toggle:visible").click()
        assert not sidebar.is_visible(), f"{page_path}: ☰ left the sidebar shown"
        page.locator(".primary-toggle:visible").click()
        assert sidebar.is_visible(), f"{page_path}: ☰ did not bring the sidebar back"
    finally:
        discard(browser, server, page_path, 1366)
