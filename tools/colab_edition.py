"""The Colab edition of the book: every chapter as a plain-Jupyter-Markdown notebook.

Usage: ``python tools/colab_edition.py --executed _build/jupyter_execute --out _build/colab``
(the pages workflow's step). The converter itself is ``_ext/colab_edition.py``, which the book's
build also runs, for each page's download button.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "_ext"))
import colab_edition  # noqa: E402  (_ext/colab_edition.py)

if __name__ == "__main__":
    sys.exit(colab_edition.main())
