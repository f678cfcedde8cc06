"""Where the lab finds the repository it runs from.

The library never reads files of its own; the lab reads what the repository records
(the GPU runs in ``data/bench/``, the compiler's table in ``data/inspect/``). Installed
from a wheel, without a checkout around it, those folders do not exist, and the lab says
so where it needs them (a chapter shows no recorded run; the inspector compiles
instead of reading the table).
"""

import pathlib

#: kernels/normbook/lab/paths.py -> the repository's root.
REPO = pathlib.Path(__file__).resolve().parents[3]
#: The folder that holds the package (on PYTHONPATH for a child process).
SOURCE_ROOT = REPO / "kernels"
DATA = REPO / "data"
