"""Pages that work for every reader: the book's CSS and JS, interactive figures served locally,
the Colab button opening the Colab edition, and a download button that saves a .ipynb.

- ``_ext/static/book.css`` (dark-mode tables, padding, numbers on one line, a scroll cue on
  phones) and ``book.js`` (the download attribute; the scroll cue) are added to every page.
- ``plotly.min.js`` is copied from the installed plotly package into the build's ``_static`` and
  loaded (synchronously, in the head) only by pages that contain an interactive figure: no CDN,
  the page works offline.
- The Colab launch button opens the chapter in the branch ``colab_edition_branch`` (default
  ``colab``), where the pages workflow publishes the Colab edition (tools/colab_edition.py).
- The download button gives the same Colab edition (``_ext/colab_edition.py``, glued values from
  this build's executed chapters), written over the page's ``_sources/…ipynb`` once the build is
  done: the chapter's own source is MyST, which plain Jupyter shows raw.
"""

import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
PLOTLY_MARK = "plotly-graph-div"


def _plotly_js() -> pathlib.Path | None:
    try:
        import plotly
    except ImportError:
        return None
    path = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.exists() else None


def _static_dir(app):
    """A folder of generated static files (plotly.min.js), added to html_static_path."""
    out = pathlib.Path(app.outdir).parent / "book_pages_static"
    out.mkdir(parents=True, exist_ok=True)
    js = _plotly_js()
    if js is not None:
        shutil.copyfile(js, out / "plotly.min.js")
    for extra in (str(HERE / "static"), str(out)):
        if extra not in app.config.html_static_path:
            app.config.html_static_path.append(extra)


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
        app.add_js_file(
            "plotly.min.js", priority=100
        )  # this page only, before the figures


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
    app.connect("build-finished", _downloads)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
