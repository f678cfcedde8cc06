"""The test suite's table (:func:`survey`), and the check that the recorded table still
says what a compile from nothing says (:func:`verify_recorded`)."""

from __future__ import annotations

import pathlib
import tempfile

from .gpus import ARCHS, DTYPES
from .runner import run_inspector
from .shapes import ODD_SHAPES, bench_shapes


def survey(**kwargs) -> list[dict]:
    """Every variant the test suite checks (tests/lab/test_inspect.py): every call at
    the benchmark's, decode and odd shapes, for sm_90, sm_80 and sm_75, in fp32, fp16
    and bf16, and in fp64 (which the gradient checks launch) at the odd shapes."""
    rows = run_inspector(
        archs=ARCHS, dtypes=DTYPES, shapes=bench_shapes() + ODD_SHAPES, **kwargs
    )["rows"]
    rows += run_inspector(archs=ARCHS, dtypes=("fp64",), shapes=ODD_SHAPES, **kwargs)[
        "rows"
    ]
    return rows


def _unit_of(row: dict) -> tuple:
    return (row["arch"], row["dtype"], row["call"], row["shape"], row["M"], row["N"])


def _from_nothing(folder: pathlib.Path) -> dict:
    """The children's environment for compiling from nothing: the inspector's cache and
    Triton's both new folders under ``folder``, and no recorded table."""
    return {
        "NORMBOOK_INSPECT_CACHE": str(folder / "inspect"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
        "NORMBOOK_INSPECT_RECORDED": "",
    }


def verify_recorded(
    rows: list[dict], seed: int, jobs=None, phases=("forward", "backward")
) -> dict:
    """Compile again, from nothing, one unit (arch, dtype, call, shape) of ``rows`` per
    call, chosen at random by ``seed``: with the inspector's cache and Triton's both
    empty and no recorded table, in child processes. Returns the units, how many rows
    were compiled, and every unit whose rows differ from those of ``rows``
    (``mismatches``: [(unit, field, recorded, compiled)]). ``phases``: those ``rows``
    were inspected with."""
    import random

    rng = random.Random(seed)
    by_call: dict = {}
    for r in rows:
        if "error" not in r:
            by_call.setdefault(r["call"], set()).add(_unit_of(r))
    picks = [rng.choice(sorted(by_call[c])) for c in sorted(by_call)]
    with tempfile.TemporaryDirectory() as tmp:
        fresh = run_inspector(
            units=[(a, d, c, [(lab, m, n)]) for a, d, c, lab, m, n in picks],
            env=_from_nothing(pathlib.Path(tmp)),
            jobs=jobs,
            phases=phases,
        )["rows"]
    mismatches = []
    for unit in picks:
        want = [r for r in rows if _unit_of(r) == unit]
        got = [r for r in fresh if _unit_of(r) == unit]
        if len(want) != len(got):
            mismatches.append((unit, "launches", len(want), len(got)))
            continue
        for w, g in zip(want, got):
            for field in sorted(set(w) | set(g)):
                if w.get(field) != g.get(field):
                    mismatches.append(
                        (unit, f"{w['kernel']}.{field}", w.get(field), g.get(field))
                    )
    return {
        "seed": seed,
        "units": picks,
        "compiled": len(fresh),
        "mismatches": mismatches,
    }
