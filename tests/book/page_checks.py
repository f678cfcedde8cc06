"""Measurements of a rendered page in Chromium, shared by tests/book/test_pages.py and by hand runs:
text contrast (WCAG 2), figure text size, code blocks that scroll sideways."""

# WCAG 2 contrast of every visible text run in <main> against its effective background: the
# first opaque ancestor background, blending translucent layers on the way (and the page's own
# background behind all). Called with a minimum ratio, it returns {count: runs measured, bad:
# the runs below the minimum, worst first}. Each element's computed style is read once and each
# ancestor's effective background computed once (memoized down the tree): a chapter has about
# 9,000 text runs, most of them syntax-highlighted spans under the same few ancestors.
CONTRAST_JS = r"""
(minimum) => {
  function rgba(s) {
    const m = s.match(/rgba?\(([^)]+)\)/);
    if (!m) return null;
    const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  }
  function over(top, bottom) {  // top (with alpha) over an opaque bottom
    const a = top[3];
    return [0, 1, 2].map(i => top[i] * a + bottom[i] * (1 - a)).concat([1]);
  }
  const styles = new Map();
  function style(el) {
    let cs = styles.get(el);
    if (cs === undefined) { cs = getComputedStyle(el); styles.set(el, cs); }
    return cs;
  }
  let page = [255, 255, 255, 1];
  const root = rgba(style(document.documentElement).backgroundColor);
  if (root && root[3] >= 1) page = root;
  const backgrounds = new Map();
  function background(el) {  // el's own layer over its parent's effective background
    if (!el) return page;
    let bg = backgrounds.get(el);
    if (bg !== undefined) return bg;
    const c = rgba(style(el).backgroundColor);
    if (c && c[3] >= 1) bg = c;
    else {
      const below = el === document.documentElement ? page : background(el.parentElement);
      bg = c && c[3] > 0 ? over(c, below) : below;
    }
    backgrounds.set(el, bg);
    return bg;
  }
  function lum(c) {
    const v = c.slice(0, 3).map(x => { x /= 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2];
  }
  const bad = [];
  let count = 0;
  const walker = document.createTreeWalker(document.querySelector("main") || document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!el || seen.has(el) || !n.textContent.trim()) continue;
    seen.add(el);
    if (el.closest("mjx-container, svg, .plotly-graph-div, script, style, [aria-hidden='true']")) continue;
    const cs = style(el);
    if (cs.visibility === "hidden" || Number(cs.opacity) === 0) continue;
    if (el.offsetParent === null && cs.position !== "fixed") continue;  // inside display: none
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    const bg = background(el);
    let fg = rgba(cs.color);
    if (fg[3] < 1) fg = over(fg, bg);
    const L1 = lum(fg), L2 = lum(bg);
    const ratio = (Math.max(L1, L2) + 0.05) / (Math.min(L1, L2) + 0.05);
    count++;
    if (ratio >= minimum) continue;
    const where = el.closest("table") ? (el.closest("code") ? "code in table" : "table")
                : el.closest("pre") ? "code" : "text";
    bad.push({ratio: Math.round(ratio * 100) / 100, where, tag: el.tagName.toLowerCase(),
              text: n.textContent.trim().slice(0, 40), fg: cs.color, bg: "rgb(" + bg.slice(0, 3).map(Math.round).join(",") + ")"});
  }
  bad.sort((a, b) => a.ratio - b.ratio);
  return {count, bad};
}
"""

# For each SVG figure shown as an <img>: the rendered height (CSS px) of its smallest text, from
# the SVG's own font sizes (matplotlib writes text as <text> with svg.fonttype = "none") scaled by
# the displayed width over the SVG's width.
FIGURE_TEXT_JS = r"""
async () => {
  const out = [];
  for (const img of document.querySelectorAll("main .cell_output img")) {
    if (!img.src.endsWith(".svg") || img.clientWidth === 0) continue;
    const svg = new DOMParser().parseFromString(await (await fetch(img.src)).text(), "image/svg+xml").documentElement;
    const width = parseFloat(svg.getAttribute("width"));
    const scale = img.clientWidth / width;
    let smallest = Infinity, n = 0;
    for (const t of svg.querySelectorAll("text")) {
      const style = t.getAttribute("style") || "";
      const m = style.match(/font(?:-size)?:\s*(?:[a-z]+\s+)*([\d.]+)px/) || [null, t.getAttribute("font-size")];
      let size = parseFloat(m[1]);
      if (!size) continue;
      const tr = (t.getAttribute("transform") || "").match(/scale\(([\d.]+)/);
      if (tr) size *= parseFloat(tr[1]);
      smallest = Math.min(smallest, size * scale); n++;
    }
    // Text drawn as paths (svg.fonttype "path"): each text is a group of glyphs at
    // scale(size / 100), matplotlib's glyph units, under a group named text_N.
    for (const g of svg.querySelectorAll("g[id^='text_'] > g[transform*='scale(']")) {
      const size = 100 * parseFloat(g.getAttribute("transform").match(/scale\(([\d.]+)/)[1]);
      if (!size) continue;
      smallest = Math.min(smallest, size * scale); n++;
    }
    out.push({src: img.src.split("/").pop().slice(0, 12), shown: img.clientWidth, width, texts: n,
              smallest_px: Math.round(smallest * 100) / 100});
  }
  return out;
}
"""

# Code blocks whose content is wider than their box: chapter code cells, outputs (printed text,
# kernel listings shown by normbook.lab.notebook.show_source) and code in prose; each with its text, so
# that a test can tell a kernel listing from the file it was read from.
SCROLLING_CODE_JS = r"""
() => [...document.querySelectorAll("main pre")]
  .filter(p => p.clientWidth > 0 && p.scrollWidth > p.clientWidth + 1)
  .map(p => ({over: p.scrollWidth - p.clientWidth, first: p.textContent.split("\n")[0].slice(0, 60),
              where: p.closest(".cell_input") ? "code cell" : p.closest(".cell_output") ? "output" : "prose",
              text: p.textContent}))
"""

# At a phone's width: how much wider than the screen the page is, and which elements stick out
# past its right edge (the deepest ones, not their ancestors).
PAGE_WIDTH_JS = r"""
() => {
  const W = document.documentElement.clientWidth;
  const over = Math.max(document.documentElement.scrollWidth, document.body.scrollWidth) - W;
  const out = [];
  for (const el of document.querySelectorAll("main *")) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= W + 1) continue;
    let clipped = false;  // inside a box that scrolls or clips: not the page's width
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if (o !== "visible") { clipped = true; break; }
    }
    if (!clipped && ![...el.children].some(c => c.getBoundingClientRect().right > W + 1))
      out.push({tag: el.tagName.toLowerCase(), cls: el.className && String(el.className).slice(0, 40),
                right: Math.round(r.right), text: el.textContent.trim().slice(0, 60)});
  }
  return {width: W, over, out: out.slice(0, 10)};
}
"""

# Display equations: wider than their box means cut off unless the box scrolls and a visible
# cue above the equation says so.
EQUATIONS_JS = r"""
() => [...document.querySelectorAll("main div.math")].map(m => {
  const c = m.querySelector("mjx-container");
  if (!c) return null;
  const content = c.querySelector("mjx-math") || c;
  const need = Math.max(content.getBoundingClientRect().width, c.scrollWidth);
  const shown = Math.min(c.clientWidth, m.clientWidth);
  const scrolls = ["auto", "scroll"].includes(getComputedStyle(c).overflowX)
                  && c.getBoundingClientRect().width <= m.clientWidth + 1;
  const prev = m.previousElementSibling;
  const cue = !!prev && prev.classList.contains("scroll-cue") && prev.getBoundingClientRect().height > 0;
  return {tex: (m.textContent || "").trim().slice(0, 50), need: Math.round(need),
          shown: Math.round(shown), wide: need > shown + 2, scrolls, cue};
}).filter(Boolean)
"""

# Every figure of the page (matplotlib's <img>, plotly's card) with the filter and background the
# page draws it with.
# Math cut off: a formula (inline or display) in the article with part of its box hidden by
# an ancestor that clips without scrolling (or past the screen's edge). A formula inside a box
# that scrolls is not cut off. Returns [{display, hidden px, text}].
CLIPPED_MATH_JS = r"""
() => {
  const out = [];
  document.querySelectorAll("main article mjx-container").forEach(m => {
    const r = m.getBoundingClientRect();
    if (!r.width) return;
    let hidden = Math.max(0, r.right - window.innerWidth, -r.left);
    let scrolled = false;
    for (let p = m.parentElement; p && p !== document.body; p = p.parentElement) {
      const ps = getComputedStyle(p);
      const ox = ps.overflowX;
      if (ox === "visible" || ps.display === "inline") continue;  // an inline box clips nothing
      const c = p.getBoundingClientRect();
      const cut = Math.max(0, r.right - c.right, c.left - r.left);
      if (cut <= 1) continue;
      if (ox === "auto" || ox === "scroll") { scrolled = true; break; }
      hidden = Math.max(hidden, cut);
      break;
    }
    // the formula's own box, where it clips (a wide one scrolls inside it: book.css)
    const own = getComputedStyle(m).overflowX;
    const inner = m.scrollWidth - m.clientWidth;
    if (m.clientWidth && inner > 2 && (own === "hidden" || own === "clip")) {
      hidden = Math.max(hidden, inner);
    }
    if (!scrolled && hidden > 1) {
      const where = m.closest("p, li, td, th, div.math, h1, h2, h3, h4, dd, dt");
      out.push({display: m.getAttribute("display") === "true", hidden: Math.round(hidden),
                text: where ? where.textContent.trim().slice(0, 70) : ""});
    }
  });
  return out;
}
"""

FIGURES_LOOK_JS = r"""
() => [...document.querySelectorAll("main .cell_output img, main .cell_output .book-interactive")]
  .filter(e => e.getBoundingClientRect().width > 0)
  .map(e => ({kind: e.tagName === "IMG" ? "image" : "interactive",
              filter: getComputedStyle(e).filter, background: getComputedStyle(e).backgroundColor,
              padding: getComputedStyle(e).padding}))
"""


def set_theme_script(theme: str) -> str:
    """An init script that makes the pydata/book theme start in ``theme`` ("light" or "dark")."""
    return (
        f"try {{ localStorage.setItem('mode', '{theme}'); localStorage.setItem('theme', '{theme}'); }}"
        f" catch (e) {{}}; document.documentElement.dataset.theme = '{theme}';"
        f" document.documentElement.dataset.mode = '{theme}';"
    )


# ------------------------------------------------------------------ checks of a page's HTML
# (no browser needed: what the build wrote)
# A table's delimiter row on a line of its own (|---|:--:|), its dashes possibly turned into en
# or em dashes by Sphinx's smart quotes (which is what a raw table looks like on the page).
PIPE_DELIMITER_ROW = __import__("re").compile(
    r"^[ \t]*\|?(?:[ \t]*:?[-\u2013\u2014]+:?[ \t]*\|){1,}(?:[ \t]*:?[-\u2013\u2014]+:?)?[ \t]*$",
    8,
)  # 8: re.M


def _main(html: str):
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    return soup.find("main") or soup


def raw_pipe_tables(html: str) -> list[str]:
    """Markdown pipe tables left as text in the page (a markdown output rendered as CommonMark,
    which has no tables): a delimiter row (``|---|:--:|``) in the text of <main>, code blocks
    and inline code left out. Returns a snippet of each."""
    main = _main(html)
    for el in main.find_all(["pre", "code", "script", "style"]):
        el.decompose()
    text = main.get_text(" ")
    return [
        text[max(0, m.start() - 80) : m.end() + 40].replace("\n", " ")
        for m in PIPE_DELIMITER_ROW.finditer(text)
        if m.group(0).count("|") >= 2
    ]


def split_streams(html: str) -> list[str]:
    """Printed output of one cell split into adjacent boxes of one stream (myst-nb renders each
    stream message as its own box unless nb_merge_streams is on). Returns the start of each."""
    out = []
    for cell_output in _main(html).select("div.cell_output"):
        boxes = [c for c in cell_output.children if getattr(c, "name", None)]
        for a, b in zip(boxes, boxes[1:]):
            for stream in (
                "stream",
                "stderr",
            ):  # myst-nb's classes for stdout and stderr
                if stream in a.get("class", []) and stream in b.get("class", []):
                    out.append(b.get_text()[:60])
    return out
