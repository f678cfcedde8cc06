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
    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)
    dtype = default_dtype()
    where = "Triton interpreter on the CPU" if INTERPRET else "GPU"
    print(f"Kernels run on: {device_name()} ({where}); low-precision dtype: {str(dtype).replace('torch.', '')}")
    return DEVICE, dtype


def show_source(obj) -> None:
    """Display an object's source, read from ``kernels/`` at run time, never pasted."""
    from IPython.display import Markdown, display

    display(Markdown("```python\n" + inspect.getsource(obj).rstrip() + "\n```"))


def glue(name: str, value, display: bool = True):
    """``myst_nb.glue`` when building the book; plain display elsewhere (e.g. in Colab)."""
    try:
        from myst_nb import glue as _glue
    except ImportError:  # pragma: no cover - outside the book build
        if display:
            from IPython.display import display as _display

            _display(value)
        return value
    _glue(name, value, display=display)
    return value
