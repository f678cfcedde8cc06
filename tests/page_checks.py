"""Measurements of a rendered page in Chromium, shared by tests/test_pages.py and by hand runs:
text contrast (WCAG 2), figure text size, code blocks that scroll sideways."""

# WCAG 2 contrast of every visible text run in <main> against its effective background: the
# first opaque ancestor background, blending translucent layers on the way (and the page's own
# background behind all). Returns the worst cases first.
CONTRAST_JS = r"""
(limit) => {
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
  const cache = new Map();
  function background(el) {
    if (cache.has(el)) return cache.get(el);
    const bg = background_(el);
    cache.set(el, bg);
    return bg;
  }
  function background_(el) {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let bg = [255, 255, 255, 1];
    const root = rgba(getComputedStyle(document.documentElement).backgroundColor);
    if (root && root[3] >= 1) bg = root;
    for (let i = layers.length - 1; i >= 0; i--) bg = layers[i][3] >= 1 ? layers[i] : over(layers[i], bg);
    return bg;
  }
  function lum(c) {
    const v = c.slice(0, 3).map(x => { x /= 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2];
  }
  const out = [];
  const walker = document.createTreeWalker(document.querySelector("main") || document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!n.textContent.trim() || !el || seen.has(el)) continue;
    seen.add(el);
    if (el.closest("mjx-container, svg, .plotly-graph-div, script, style, [aria-hidden='true']")) continue;
    const r = el.getBoundingClientRect();
    const cs = getComputedStyle(el);
    if (r.width === 0 || r.height === 0 || cs.visibility === "hidden" || Number(cs.opacity) === 0) continue;
    if (el.offsetParent === null && cs.position !== "fixed") continue;  // inside display: none
    const bg = background(el);
    let fg = rgba(cs.color);
    if (fg[3] < 1) fg = over(fg, bg);
    const L1 = lum(fg), L2 = lum(bg);
    const ratio = (Math.max(L1, L2) + 0.05) / (Math.min(L1, L2) + 0.05);
    const where = el.closest("table") ? (el.closest("code") ? "code in table" : "table")
                : el.closest("pre") ? "code" : "text";
    out.push({ratio: Math.round(ratio * 100) / 100, where, tag: el.tagName.toLowerCase(),
              text: n.textContent.trim().slice(0, 40), fg: cs.color, bg: "rgb(" + bg.slice(0, 3).map(Math.round).join(",") + ")"});
  }
  out.sort((a, b) => a.ratio - b.ratio);
  return out.slice(0, limit);
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
    out.push({src: img.src.split("/").pop().slice(0, 12), shown: img.clientWidth, width, texts: n,
              smallest_px: Math.round(smallest * 100) / 100});
  }
  return out;
}
"""

# Code blocks (chapter source and shown kernels) whose content is wider than their box.
SCROLLING_CODE_JS = r"""
() => [...document.querySelectorAll("main div.cell_input pre")]
  .filter(p => p.scrollWidth > p.clientWidth + 1)
  .map(p => ({over: p.scrollWidth - p.clientWidth, first: p.textContent.split("\n")[0].slice(0, 60)}))
"""


def set_theme_script(theme: str) -> str:
    """An init script that makes the pydata/book theme start in ``theme`` ("light" or "dark")."""
    return (f"try {{ localStorage.setItem('mode', '{theme}'); localStorage.setItem('theme', '{theme}'); }}"
            f" catch (e) {{}}; document.documentElement.dataset.theme = '{theme}';"
            f" document.documentElement.dataset.mode = '{theme}';")
