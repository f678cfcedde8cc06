"""Helpers for the book's chapters: set-up, showing kernel source, and gluing numbers into prose.

Kept out of the kernels themselves; a chapter calls :func:`setup` in its first (hidden) cell.
"""

from __future__ import annotations

import inspect

import torch

from ._runtime import DEVICE, INTERPRET, default_dtype, device_name


def setup(seed: int = 0):
    """Seed every generator and return ``(device, dtype)`` for this chapter, printing one line
    that says where the kernels run."""
    import warnings

    import numpy as np

    # transformers imports tqdm, which warns (on stderr) that Jupyter widgets are missing: harmless here.
    warnings.filterwarnings("ignore", message="IProgress not found")
    torch.manual_seed(seed)
    np.random.seed(seed)
    _sharp_figures()
    dtype = default_dtype()
    where = "the CPU, in Triton's interpreter" if INTERPRET else f"{device_name()} (CUDA)"
    print(f"Kernels run on {where}; low-precision dtype: {str(dtype).replace('torch.', '')}")
    return DEVICE, dtype


def _sharp_figures() -> None:
    """Figures as SVG with real text: sharp at any zoom, and legible on a phone.

    The text column is about 358 CSS px wide on a 390 px phone; a figure of width W points is shown
    at 358/W of its size there, so an 11 pt label in a 6 in (432 pt) figure is about 9 px tall.
    Text stays text (``svg.fonttype = "none"``), which the page tests can measure.
    """
    try:
        import matplotlib
        import matplotlib.pyplot as plt  # noqa: F401  (activates the inline backend first)
    except ImportError:  # the set-up cell has already said how to install it
        return
    matplotlib.rcParams.update({"svg.fonttype": "none", "font.size": 11, "figure.figsize": (6.0, 4.0)})
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

    while hasattr(obj, "fn") and not inspect.isfunction(obj):  # a @triton.jit kernel wraps its function
        obj = obj.fn
    display(Markdown("```python\n" + inspect.getsource(obj).rstrip() + "\n```"))


def glue(name: str, value, display: bool = True) -> None:
    """``myst_nb.glue`` when building the book; plain display elsewhere (e.g. in Colab).

    numpy and torch scalars are stored as Python numbers, so that ``{glue:text}`key:.4f``` formats them.
    """
    import numpy as np

    if isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        value = value.item()
    try:
        from myst_nb import glue as _glue
    except ImportError:  # pragma: no cover - outside the book build
        if display:
            from IPython.display import display as _display

            _display(value)
        return
    _glue(name, value, display=display)
