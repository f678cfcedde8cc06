"""The one timing helper every chapter uses.

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

CPU_NOTE = (
    "No GPU here: the kernels ran in Triton's CPU interpreter, which executes one "
    "program\n"
    "at a time in Python. Its timings say nothing about GPU speed, so none are shown.\n"
    "Run this chapter on a GPU (for example in Colab) to see live figures."
)


def bytes_moved(*tensors: torch.Tensor | None) -> int:
    """Bytes that must cross memory: the sum of the sizes of every tensor read or
    written once."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gbps(nbytes: int, ms: float) -> float:
    """Effective bandwidth in GB/s (1 GB = 1e9 bytes)."""
    return nbytes / (ms * 1e-3) / 1e9


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds on the GPU (``do_bench``, L2 flushed per
    run)."""
    if DEVICE.type != "cuda":
        raise RuntimeError(CPU_NOTE)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def compile_or_none(fn: Callable):
    """``torch.compile(fn)``, or None where compilation is unavailable."""
    try:
        return torch.compile(fn)
    except Exception:  # pragma: no cover - depends on the platform
        return None


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


def copy_bandwidth(
    nbytes: int = 2**28,
    timer: Callable[[Callable[[], object]], float] | None = None,
    device: torch.device | None = None,
) -> dict:
    """The memory-bound speed of light, measured: a device-to-device copy of ``nbytes``
    bytes.

    A copy reads every byte once and writes it once, so it moves ``2 * nbytes`` bytes
    and does no arithmetic. A kernel that must read its inputs and write its outputs, in
    a similar mix of reads and writes, is not expected to beat its GB/s (one with
    another mix, e.g. two reads per
    write, can land a little above: see the speed-of-light chapter's pitfalls). The
    source holds random bytes (not zeros) and is larger than any L2 cache for the
    default size. ``timer`` defaults to :func:`time_ms` (GPU only). Returns bytes, ms
    and GB/s.
    """
    timer = time_ms if timer is None else timer
    device = DEVICE if device is None else device
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    moved = 2 * nbytes
    return {"bytes": moved, "ms": ms, "GB/s": gbps(moved, ms)}
