"""The one timing helper every chapter uses (:func:`compare`).

On a GPU it times each candidate with ``triton.testing.do_bench`` (warm-up, then the
median of many runs, L2 flushed between runs) and reports milliseconds and effective
bandwidth: the bytes a kernel *must* move (read its inputs once, write its outputs once)
divided by the time.

On a CPU the kernels run in Triton's interpreter, one program at a time in Python: a
timing there measures the interpreter, not the kernel, so this helper says so and
reports nothing.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from normbook._runtime import DEVICE, device_name

from .measure import (  # noqa: F401  (the chapters import them from here)
    CPU_NOTE,
    bytes_moved,
    compile_or_none,
    copy_bandwidth,
    gbps,
    time_ms,
)


def compare(
    candidates: dict[str, Callable[[], object]],
    nbytes: int,
    torch_formula: Callable[[], object] | None = None,
    *,
    show: bool = True,
):
    """Time each candidate (name -> zero-argument callable) and, if given, the torch
    formula in eager mode and under ``torch.compile``. Returns a list of rows (dicts) or
    None on a CPU.

    Every row has: name, ms (median), GB/s for ``nbytes`` bytes, and the device's name.
    """
    if DEVICE.type != "cuda":
        if show:
            print(CPU_NOTE)
            recorded = recorded_figures(candidates)
            if recorded:
                print()
                print("\n".join(recorded))
        return None
    fns = dict(candidates)
    if torch_formula is not None:
        fns["torch eager"] = torch_formula
        compiled = compile_or_none(torch_formula)
        if compiled is not None:
            fns["torch.compile"] = compiled
    rows = []
    for name, fn in fns.items():
        try:
            ms = time_ms(fn)
        except Exception as exc:  # a failed compile should not hide the other figures
            rows.append(
                {
                    "name": name,
                    "ms": math.nan,
                    "GB/s": math.nan,
                    "note": type(exc).__name__,
                }
            )
            continue
        rows.append({"name": name, "ms": ms, "GB/s": gbps(nbytes, ms)})
    if show:
        print(
            format_table(
                rows,
                title=f"{device_name()}, torch {torch.__version__}, "
                f"{nbytes / 1e6:.1f} MB moved",
            )
        )
    return rows


def kernels_called(fn: Callable) -> set[str]:
    """Names a callable (a chapter's timing lambda) calls, read from its code and the
    code of the functions it closes over: ``lambda: normbook.rms_norm(x, w)`` calls
    ``rms_norm``.
    """
    names: set[str] = set()
    seen = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        names.update(code.co_names)
        todo.extend(
            c.cell_contents
            for c in (getattr(f, "__closure__", None) or ())
            if callable(getattr(c, "cell_contents", None))
        )
    return names


def recorded_figures(candidates: dict[str, Callable[[], object]]) -> list[str]:
    """On a CPU: what a recorded GPU run (data/bench/) measured for the kernels these
    candidates call (their forward, and their backward when a candidate differentiates).
    Empty when there is no such run."""
    try:
        from .bench import report
        from .bench.cases import CASES
    except Exception:  # pragma: no cover - the benchmark needs nothing more than torch
        return []
    names: set[str] = set()
    for fn in candidates.values():
        names |= kernels_called(fn)
    kernels = {c.kernel for c in CASES} & names
    directions = {"forward"} | ({"backward"} if names & {"grad", "backward"} else set())
    return report.recorded_lines(kernels, directions) if kernels else []


def format_table(rows: list[dict], title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'':<24}{'ms':>10}{'GB/s':>10}")
    for r in rows:
        lines.append(f"{r['name']:<24}{r['ms']:>10.4f}{r['GB/s']:>10.1f}")
    return "\n".join(lines)
