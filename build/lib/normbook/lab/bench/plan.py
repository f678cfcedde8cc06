"""The GPU day's trimmed benchmark: ``python -m normbook.lab.bench --plan gpu-day``.

A GPU machine is lent for minutes at a time, so ``tools/gpu_check.py`` cannot afford the
full sweep (every case at 13 shapes, torch.compile at each). This plan measures, in
order of value:

1. the device-to-device copy bandwidth (the speed of light every row is divided by);
2. every benchmarked direction of every spec with a ``plan``
   (:mod:`normbook.lab.specs`), at the plan's shapes, for our Triton kernel and eager
   PyTorch (and Liger-Kernel where installed), in the specs' order;
3. then torch.compile, at the plan's ``compile_at`` shapes (it compiles once per shape).

Rows are written as they are measured, so a run stopped by its budget keeps everything
before the stop (see :func:`normbook.lab.bench.runner.run_plan`).
"""

from __future__ import annotations

from ..kernel_spec import Entry
from ..specs import gpu_day_plan

__all__ = ["Entry", "PLAN", "PLANS", "shapes_of", "compile_shapes"]

#: In order of value: what a stop at any moment should already have measured.
PLAN = gpu_day_plan()
PLANS = {"gpu-day": PLAN}


def shapes_of(entry: Entry, smoke: bool) -> tuple:
    return entry.smoke if smoke else entry.shapes


def compile_shapes(entry: Entry, smoke: bool) -> tuple:
    shapes = shapes_of(entry, smoke)
    return tuple(shapes[i] for i in entry.compile_at if i < len(shapes))
