"""Helpers for the book's chapters: set-up, showing kernel source, and gluing numbers
into prose.

Kept out of the kernels themselves; a chapter calls :func:`setup` in its first (hidden)
cell.
"""

from __future__ import annotations

import inspect

import torch

from normbook._runtime import DEVICE, INTERPRET, default_dtype, device_name


def setup(seed: int = 0):
    """Seed every generator and return ``(device, dtype)`` for this chapter, printing
    one line that says where the kernels run."""
    import warnings

    import numpy as np

    # transformers imports tqdm, which warns (on stderr) that Jupyter widgets are
    # missing: harmless here.
    warnings.filterwarnings("ignore", message="IProgress not found")
    torch.manual_seed(seed)
    np.random.seed(seed)
    _sharp_figures()
    dtype = default_dtype()
    where = (
        "the CPU, in Triton's interpreter" if INTERPRET else f"{device_name()} (CUDA)"
    )
    print(
        f"Kernels run on {where}; low-precision dtype: "
        f"{str(dtype).replace('torch.', '')}"
    )
    return DEVICE, dtype


def _sharp_figures() -> None:
    """Figures as SVG with real text: sharp at any zoom, and legible on a phone.

    The text column is about 358 CSS px wide on a 390 px phone; a figure of width W
    points is shown at 358/W of its size there, so a 12 pt label in a 6.4 in (461 pt)
    figure is about 9.3 px tall (tests/book/test_pages.py asks for 9). Hence: every text
    at least ``font.size`` (titles and legends too), figures at most 6.4 in wide,
    several panels stacked one per row. Text is drawn as paths (``svg.fonttype =
    "path"``): with text kept as text, mathtext's glyphs name fonts a browser does not
    have (``$\\mathcal{N}$`` in STIXNonUnicode, a prime as cmsy10's "0", a square root
    apart from its bar), and a reader sees boxes and wrong symbols.
    """
    try:
        import matplotlib
        import matplotlib.pyplot  # noqa: F401  (activates the inline backend first)
    except ImportError:  # the set-up cell has already said how to install it
        return
    matplotlib.rcParams.update(
        {
            "svg.fonttype": "path",
            "font.size": 12,
            "figure.figsize": (6.0, 4.0),
            "axes.titlesize": "medium",
            "figure.titlesize": "medium",
        }
    )
    try:
        from IPython import get_ipython

        if get_ipython() is not None:
            from matplotlib_inline.backend_inline import set_matplotlib_formats

            set_matplotlib_formats("svg")
    except ImportError:  # pragma: no cover - outside Jupyter
        pass


def show_source(obj) -> None:
    """Display an object's source, read from ``kernels/`` at run time, never pasted."""
    from IPython.display import Markdown, display

    # a @triton.jit kernel wraps its function
    while hasattr(obj, "fn") and not inspect.isfunction(obj):
        obj = obj.fn
    display(Markdown("```python\n" + inspect.getsource(obj).rstrip() + "\n```"))


def glue(name: str, value, display: bool = True) -> None:
    """``myst_nb.glue`` when building the book; plain display elsewhere (e.g. in Colab).

    numpy and torch scalars are stored as Python numbers, so that
    ``{glue:text}`key:.4f``` formats them.
    """
    import numpy as np

    if isinstance(value, np.generic) or (
        isinstance(value, torch.Tensor) and value.numel() == 1
    ):
        value = value.item()
    try:
        from myst_nb import glue as _glue
    except ImportError:  # pragma: no cover - outside the book build
        if display:
            from IPython.display import display as _display

            _display(value)
        return
    _glue(name, value, display=display)


#: Marks, on both sides, the part of a figure's script that loads plotly.js from the
#: network: the book's pages drop it (``_ext/book_pages.py``).
FALLBACK = "plotly-from-network"


class InteractiveFigure:
    """A plotly figure that works in the built book, in Jupyter and in Colab.

    It displays as one HTML output: a ``<div>`` and a script that draws the figure
    with the page's ``Plotly``. The book serves a partial bundle of plotly.js (scatter
    traces, sliders and menus) from its own ``_static``, deferred so that it does not
    hold up the page's first paint (``_ext/book_pages.py``, which also cuts the
    fallback below from the page): the script waits for it, and the page needs no
    network. Where no ``Plotly`` is loaded (Jupyter, Colab), the script loads the
    plotly.js version of the installed plotly package, the one thing that needs the
    network.
    """

    def __init__(self, fig, height: int = 440):
        self.fig = fig
        self.height = height

    def _repr_mimebundle_(self, include=None, exclude=None):
        import hashlib
        import json

        from plotly.offline import get_plotlyjs_version

        spec = self.fig.to_json()
        # stable across builds
        div = "fig-" + hashlib.sha1(spec.encode()).hexdigest()[:12]
        cdn = f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"
        html = f"""<div class="book-interactive">
<div id="{div}" class="plotly-graph-div" style="height:{self.height}px;
width:100%;"></div> <script type="text/javascript"> (function () {{
  var spec = {spec};
  function draw() {{
    Plotly.newPlot("{div}", spec.data, spec.layout,
                   {{responsive: true, displayModeBar: false, scrollZoom: false}});
  }}
  if (window.Plotly) {{ draw(); return; }}
  if (document.getElementById("book-plotly")) {{
    window.addEventListener("DOMContentLoaded", draw); return;
  }}
  /*{FALLBACK}*/var s = document.createElement("script");
  s.src = {json.dumps(cdn)};
  s.onload = draw;
  document.head.appendChild(s);/*{FALLBACK}*/
}})();
</script>
</div>"""
        title = self.fig.layout.title.text or "interactive figure"
        return {"text/html": html, "text/plain": f"<interactive figure: {title}>"}


def interactive_figure(
    frames,
    *,
    slider: str,
    x_title: str,
    y_title: str,
    title: str,
    log_x: bool = False,
    log_y: bool = False,
    options: str | None = None,
    active: int = 0,
    height: int = 600,
    hover: str | None = None,
):
    """A figure with a slider over precomputed frames (and, optionally, a menu of
    options).

    ``frames`` is a list of ``(label, traces)``; each trace is a dict with ``x``, ``y``,
    ``name`` and optionally ``option`` (the menu entry it belongs to), ``mode``
    (``"lines"``, ``"markers"``, …), ``text`` (per-point hover text) and ``dash``. Every
    frame has the same
    traces in the same order: the slider swaps their data, the menu shows one option's
    traces. The data are whatever the chapter computed; nothing here computes or types
    numbers.
    """
    import textwrap

    import plotly.graph_objects as go

    first = frames[active][1]
    opts = list(
        dict.fromkeys(t.get("option") for t in first if t.get("option") is not None)
    )
    fig = go.Figure()
    for t in first:
        visible = t.get("option") in (None, opts[0] if opts else None)
        fig.add_trace(
            go.Scatter(
                x=list(t["x"]),
                y=list(t["y"]),
                name=t["name"],
                mode=t.get("mode", "lines"),
                text=t.get("text"),
                visible=visible,
                hovertemplate=hover if t.get("text") is not None else None,
                line={"dash": t.get("dash", "solid")},
            )
        )

    def column(key, traces):
        return [list(t[key]) if t.get(key) is not None else None for t in traces]

    steps = [
        {
            "label": label,
            "method": "restyle",
            "args": [
                {
                    "x": column("x", traces),
                    "y": column("y", traces),
                    "text": column("text", traces),
                }
            ],
        }
        for label, traces in frames
    ]
    # Laid out in pixels so that it reads at 390 px as at 1366 px: the title on the
    # first line, the menu under it, the plot, and under the x axis the slider, then the
    # legend.
    top, bottom = 84, 230
    plot_h = height - top - bottom
    layout = dict(
        title={
            "text": "<br>".join(textwrap.wrap(title, 44)),
            "font": {"size": 14},
            "x": 0,
            "xanchor": "left",
            "pad": {"l": 12},
            "y": 1 - 10 / height,
            "yanchor": "top",
        },
        template="plotly_white",
        paper_bgcolor="#ffffff",
        plot_bgcolor="#ffffff",
        font={"size": 13, "color": "#222222"},
        height=height,
        margin={"l": 64, "r": 16, "t": top, "b": bottom},
        xaxis={
            "title": {"text": x_title},
            "type": "log" if log_x else "linear",
            "exponentformat": "power",
            "nticks": 7,
        },
        yaxis={
            "title": {"text": y_title},
            "type": "log" if log_y else "linear",
            "exponentformat": "power",
            "nticks": 8,
        },
        showlegend=True,
        legend={
            "orientation": "h",
            "x": 0,
            "xanchor": "left",
            "y": -(72 + 92) / plot_h,
            "yanchor": "top",
        },
        sliders=[
            {
                "active": active,
                "steps": steps,
                "x": 0,
                "len": 1.0,
                "y": -72 / plot_h,
                "yanchor": "top",
                "pad": {"t": 0, "b": 0},
                "currentvalue": {"prefix": f"{slider}: "},
            }
        ],
    )
    if opts:
        layout["updatemenus"] = [
            {
                "type": "dropdown",
                "x": 1.0,
                "xanchor": "right",
                "y": 1 + 6 / plot_h,
                "yanchor": "bottom",
                "bgcolor": "#ffffff",
                "buttons": [
                    {
                        "label": str(o),
                        "method": "restyle",
                        "args": [
                            {"visible": [t.get("option") in (None, o) for t in first]}
                        ],
                    }
                    for o in opts
                ],
            }
        ]
    fig.update_layout(**layout)
    return InteractiveFigure(fig, height=height)
