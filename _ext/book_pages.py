"""Pages that work for every reader: the book's CSS and JS, interactive figures served locally,
the Colab button opening the Colab edition, and a download button that saves a .ipynb.

- ``_ext/static/book.css`` (dark-mode tables, padding, numbers on one line, a scroll cue on
  phones) and ``book.js`` (the download attribute; the scroll cue) are added to every page.
- plotly.js is served from ``_ext/static/vendor/plotly-basic.min.js``: plotly.js's "basic"
  partial bundle (scatter traces, sliders and menus: what the book's figures use; 1.2 MB
  against 4.8 MB for the whole library), of the version the installed plotly package writes
  its figures for (tests/book/test_html.py checks both). Only pages that contain an
  interactive figure load it, deferred: the text paints first, the figures draw once it has
  run. Each figure's fallback to the network (for Jupyter and Colab) is cut from the page:
  no request leaves it, and it works offline.
- The Colab launch button opens the chapter in the branch ``colab_edition_branch`` (default
  ``colab``), where the pages workflow publishes the Colab edition (tools/colab_edition.py).
- The download button gives the same Colab edition (``_ext/colab_edition.py``, glued values from
  this build's executed chapters), written over the page's ``_sources/…ipynb`` once the build is
  done: the chapter's own source is MyST, which plain Jupyter shows raw.
"""

import pathlib
import sys

from docutils import nodes

HERE = pathlib.Path(__file__).resolve().parent
PLOTLY_MARK = "plotly-graph-div"


PLOTLY_JS = "vendor/plotly-basic.min.js"


def _static_dir(app):
    """_ext/static (book.css, book.js, the vendored plotly.js, the favicon) in the build."""
    static = str(HERE / "static")
    if static not in app.config.html_static_path:
        app.config.html_static_path.append(static)


def _without_fallback(body: str) -> str:
    """The figures' scripts without their network fallback (between two FALLBACK marks)."""
    from normbook.lab.notebook import FALLBACK

    mark = f"/*{FALLBACK}*/"
    parts = body.split(mark)
    if len(parts) % 2 == 0:
        raise ValueError(f"unpaired {mark} in a page's body")
    return "".join(parts[0::2])


def _unique_ids(app, doctree, docname):
    """sphinx-exercise gives every exercise's body the id ``exercise-content`` and every
    solution's ``solution-content``: several on one page, which HTML forbids (a link or a
    script finds only the first). Numbered instead, in page order; nothing refers to them."""
    seen: dict[str, int] = {}
    for node in doctree.findall(nodes.Element):
        ids = node.get("ids") or []
        for i, name in enumerate(ids):
            if name in ("exercise-content", "solution-content"):
                seen[name] = seen.get(name, 0) + 1
                ids[i] = f"{name}-{seen[name]}"


def _buttons(buttons):
    for b in buttons or []:
        yield b
        yield from _buttons(b.get("buttons"))


def _page(app, pagename, templatename, context, doctree):
    branch = app.config.colab_edition_branch
    repo_branch = app.config.html_theme_options.get("repository_branch") or "main"
    for b in _buttons(context.get("header_buttons")):
        url = b.get("url") or ""
        if "colab.research.google.com" in url and branch:
            b["url"] = url.replace(f"/blob/{repo_branch}/", f"/blob/{branch}/", 1)
    if PLOTLY_MARK in (context.get("body") or ""):
        context["body"] = _without_fallback(context["body"])
        # this page only; deferred: it runs after parsing, and the figures wait for it
        app.add_js_file(
            PLOTLY_JS, priority=100, loading_method="defer", id="book-plotly"
        )


def _downloads(app, exception):
    """Each chapter's download (``_sources/<page>.ipynb``) becomes its Colab edition."""
    if exception is not None or app.builder.format != "html":
        return
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import colab_edition

    executed = pathlib.Path(app.env.mystnb_config.output_folder)
    # A glued value missing here is missing from the page too, and myst-nb warns about it there.
    colab_edition.build(
        pathlib.Path(app.outdir) / "_sources",
        executed,
        allow_missing=True,
        root=pathlib.Path(app.srcdir),
    )


def setup(app):
    app.add_config_value("colab_edition_branch", "colab", "html")
    app.connect("builder-inited", _static_dir)
    app.add_css_file("book.css")
    app.add_js_file("book.js", loading_method="defer")
    app.connect("html-page-context", _page, priority=900)
    app.connect("doctree-resolved", _unique_ids)
    app.connect("build-finished", _downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
