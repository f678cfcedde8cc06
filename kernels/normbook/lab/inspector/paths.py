"""Where the repository, its source root and the recorded table are.

As normbook.lab.paths says, spelt here: importing normbook (torch, Triton's mode) must
wait until the child has faked CUDA, so no module of this package imports it at the top.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[4]
SOURCE_ROOT = ROOT / "kernels"
DATA = ROOT / "data"

#: The recorded table (see the package's docstring). ``NORMBOOK_INSPECT_RECORDED`` names
#: another file, or, empty, none: every variant compiled.
RECORDED = DATA / "inspect" / "variants.jsonl"
