"""Running the inspector: units of (architecture, dtype, calls, shapes) shared by child
processes, at most one per core (compiling is the cost), and their rows gathered in
the units' order."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from .gpus import DTYPES, GPUS
from .options import InspectOptions
from .paths import ROOT, SOURCE_ROOT
from .shapes import spell


def run_inspector(
    archs=(90,),
    dtypes=DTYPES,
    shapes="all",
    calls=None,
    *,
    call_shapes=None,
    units=None,
    options: InspectOptions | None = None,
    **settings,
) -> dict:
    """Run the inspector in child processes; returns ``{"meta": ..., "rows": [...]}``.

    ``shapes``: "all", "bench", "decode", or a list of (label, M, N). ``calls``: names
    such as "rms_norm", "layer_norm", "fused_add_rms_norm", "qk_norm_rope",
    "row_variance.welford". ``call_shapes``: instead of calls × shapes, {call: [(label,
    M, N), ...]}, one unit each (the GPU day inspects each kernel at the shapes it
    measured). ``units``: instead of archs × dtypes × calls × shapes, the units
    themselves, [(arch, dtype, call, shapes), ...]. ``options``: how
    (:class:`InspectOptions`); ``settings``: fields of it, in place of those of
    ``options`` (``phases=("forward",)``, ``jobs=2``, ``ptx=True``, ...)."""
    options = dataclasses.replace(options or InspectOptions(), **settings)
    todo = _units(archs, dtypes, shapes, calls, call_shapes, units)
    if not todo:  # no architecture or no dtype asked for: nothing to compile
        return {"meta": {}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        listing = pathlib.Path(tmp) / "units.json"
        listing.write_text(json.dumps(todo))
        cmd = [sys.executable, "-c", _boot(), "--units", str(listing)]
        cmd += ["--out-dir", tmp, *options.child_args()]
        jobs = max(1, min(len(todo), options.jobs or os.cpu_count() or 1))
        _run_children(cmd, pathlib.Path(tmp), jobs, options)
        return _collect(pathlib.Path(tmp), todo)


def inspect_variants(arch: int = 90, **kwargs) -> list[dict]:
    """One row per (call, phase, kernel launch, shape, dtype) for ``arch`` (90, 80 or
    75); ``kwargs`` as :func:`run_inspector` takes them."""
    return run_inspector(archs=(arch,), **kwargs)["rows"]


def _units(archs, dtypes, shapes, calls, call_shapes, units) -> list[tuple]:
    """The units as the children read them, numbered: [(index, arch, dtype, calls,
    shapes)], ``calls`` and ``shapes`` each spelt as one string."""
    archs = [archs] if isinstance(archs, int) else list(archs)
    if units is not None:  # they name their own archs, dtypes, calls and shapes
        archs = sorted({u[0] for u in units})
    unknown = [a for a in archs if a not in GPUS]
    if unknown:
        raise ValueError(f"archs: {unknown} unknown; choose from {sorted(GPUS)}")
    if units is not None:
        todo = [(arch, dt, [c], spell(sh)) for arch, dt, c, sh in units]
    else:
        if call_shapes:
            work = [([call], spell(sh)) for call, sh in call_shapes.items()]
        else:
            work = [(calls or [], spell(shapes))]
        todo = [(arch, dt, c, sh) for arch in archs for dt in dtypes for c, sh in work]
    return [(i, arch, dt, ",".join(c), sh) for i, (arch, dt, c, sh) in enumerate(todo)]


def _boot() -> str:
    """The child's program: this package loaded as the child's own (:func:`_loader`),
    then :func:`child.main` on the command line's arguments."""
    return _loader("_normbook_inspector_child") + (
        "sys.exit(importlib.import_module(s.name + '.child').main(sys.argv[1:]))"
    )


def _loader(name: str) -> str:
    """Python that loads this package from its folder under ``name``, so that
    ``normbook`` (torch, Triton's interpreter flag) is imported only once the child has
    faked CUDA (:mod:`.child`); none of the package's modules imports it at the top."""
    folder = pathlib.Path(__file__).resolve().parent
    return (
        "import importlib, importlib.util, sys; "
        f"s = importlib.util.spec_from_file_location({name!r}, "
        f"{str(folder / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(folder)!r}]); "
        "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; "
        "s.loader.exec_module(m); "
    )


def _child_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(SOURCE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_children(cmd: list, folder: pathlib.Path, jobs: int, options) -> None:
    """``jobs`` children of ``cmd``, each logging into ``folder``: each imports torch
    and normbook once (seconds) and then takes units until none is left. None is left
    running on return."""
    children = []
    try:
        for j in range(jobs):
            with open(folder / f"child{j}.log", "w") as log:
                children.append(
                    subprocess.Popen(
                        cmd,
                        stdout=subprocess.DEVNULL,
                        stderr=log,
                        env={**_child_env(), **(options.env or {})},
                        cwd=ROOT,
                    )
                )
        _wait(children, folder, cmd, options)
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait(children: list, folder: pathlib.Path, cmd: list, options) -> None:
    """Until every child is done, or the first fails (its log raised), or the
    deadline (raised unless ``options.partial``)."""
    deadline = time.monotonic() + max(1.0, options.timeout)
    while True:  # every child watched at once: the first to fail stops the run
        codes = [proc.poll() for proc in children]
        for j, code in enumerate(codes):
            if code not in (None, 0):
                err = (folder / f"child{j}.log").read_text()
                raise RuntimeError(
                    f"normbook.lab.inspector child failed ({code}):\n{err[-4000:]}"
                )
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            if not options.partial:
                raise subprocess.TimeoutExpired(cmd[:3], options.timeout)
            return  # out of time (the GPU day's budget): keep the finished units
        time.sleep(0.1)


def _collect(folder: pathlib.Path, units: list) -> dict:
    """The units' rows in the units' order, whichever child did each, and their meta
    merged; the count of units not finished, if any."""
    parts = [folder / f"unit{i}.json" for i, *_ in units]
    dropped = sum(not part.exists() for part in parts)
    result = {"meta": {"units_not_finished": dropped} if dropped else {}, "rows": []}
    for part in parts:
        if not part.exists():
            continue
        part = json.loads(part.read_text())
        for k, v in part["meta"].items():
            if isinstance(v, dict):
                result["meta"].setdefault(k, {}).update(v)
            else:
                result["meta"][k] = v
        result["rows"] += part["rows"]
    return result
