"""``python -m normbook.lab.inspector``: the table on stdout (and as JSON), or, with
``--record``, the recorded table written again."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

from . import compiler
from .gpus import DTYPES, GPUS, LATENCY_NS, littles_law_bytes, measured_gpu
from .options import InspectOptions
from .paths import RECORDED, ROOT
from .record import write_recorded
from .report import format_table
from .runner import run_inspector
from .shapes import parse
from .suite import _from_nothing, survey

DESCRIPTION = (
    "What the compiler made of each kernel: registers, spills, load widths, "
    "occupancy, without a GPU."
)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.record:
        return _record(p, a)
    archs = [int(s) for s in a.arch.split(",")]
    for arch in archs:
        if arch not in GPUS:
            p.error(f"--arch must be one of {', '.join(map(str, GPUS))}, got {arch}")
    t0 = time.perf_counter()
    for arch in archs:
        GPUS[arch] = measured_gpu(GPUS[arch], a.bandwidth_gbps, a.sms, a.gpu_name)
    options = InspectOptions(
        latency_ns=a.latency_ns,
        bandwidth_gbps=a.bandwidth_gbps,
        sms=a.sms,
        gpu_name=a.gpu_name,
        jobs=a.jobs,
        **({"timeout": a.timeout_s, "partial": True} if a.timeout_s else {}),
    )
    result = run_inspector(
        archs,
        a.dtypes.split(","),
        a.shapes,
        [c for c in a.calls.split(",") if c],
        call_shapes=_call_shapes(a.call_shapes) or None,
        options=options,
    )
    rows = result["rows"]
    _print_tables(rows, result["meta"], archs, a.latency_ns)
    spills = [r for r in rows if r.get("spill_stores", 0) or r.get("spill_loads", 0)]
    errors = [r for r in rows if "error" in r]
    print(
        f"{len(rows)} launches, {len({r['variant'] for r in rows})} variants, "
        f"{len(spills)} spilling, "
        f"{len(errors)} failing to compile ({time.perf_counter() - t0:.0f} s)"
    )
    if a.json:
        # Written beside, then renamed: a stop mid-write leaves no half file.
        out = pathlib.Path(a.json)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out)
    return 1 if errors else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m normbook.lab.inspector", description=DESCRIPTION
    )
    p.add_argument(
        "--arch",
        default="90",
        help="90 (H100/H200), 80 (A100), 75 (T4); comma-separated for several",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write the table (with provenance) as JSON to FILE",
    )
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--shapes", default="all", choices=["all", "bench", "decode"])
    p.add_argument(
        "--calls", default="", help="comma-separated subset, e.g. rms_norm,layer_norm"
    )
    p.add_argument("--latency-ns", type=float, default=LATENCY_NS)
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="child processes at once (default: the CPU count)",
    )
    p.add_argument(
        "--call-shapes",
        default="",
        help="per call, its own shapes: "
        "'rms_norm=plan:1024:131072,plan:1:4096;softmax=...' "
        "(instead of --calls × --shapes)",
    )
    _add_measured_and_record(p)
    return p


def _add_measured_and_record(p: argparse.ArgumentParser) -> None:
    """The flags of a GPU day (what was measured, the time left) and of ``--record``."""
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        help="a measured copy bandwidth in place of the datasheet's",
    )
    p.add_argument("--sms", type=int, help="the SM count of the GPU measured")
    p.add_argument("--gpu-name", help="the name of the GPU measured")
    p.add_argument(
        "--timeout-s",
        type=float,
        help="after this many seconds, keep what finished (the GPU day's budget)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="inspect the test suite's whole table (every arch and dtype) "
        "and write it to data/inspect/variants.jsonl (what is recorded or "
        "cached already is read, the rest is compiled)",
    )
    p.add_argument(
        "--from-scratch",
        action="store_true",
        help="with --record: read nothing, compile every variant (no "
        "table, no cache of the inspector's or Triton's)",
    )


def _call_shapes(spec: str) -> dict:
    """``--call-shapes``: {call: [(label, M, N), ...]}."""
    call_shapes = {}
    for part in filter(None, spec.split(";")):
        call, _, shapes = part.partition("=")
        call_shapes[call] = parse(shapes)
    return call_shapes


def _record(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--record``: the survey inspected, and written to the recorded table."""
    if not (ROOT / "pyproject.toml").exists():
        p.error(f"--record writes into the repository; {ROOT} is not one")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if a.from_scratch:
            env = _from_nothing(pathlib.Path(scratch))
            # write_recorded reads the children's entries from this process's cache
            compiler.CACHE = pathlib.Path(env["NORMBOOK_INSPECT_CACHE"])
        else:  # the table this writes is the one read
            env = {"NORMBOOK_INSPECT_RECORDED": str(RECORDED)}
        rows = survey(jobs=a.jobs, env=env)
        errors = [r for r in rows if "error" in r]
        n = write_recorded(rows, RECORDED, use_recorded=not a.from_scratch)
    print(
        f"{n} variants recorded in {RECORDED.relative_to(ROOT)} "
        f"({len(errors)} failing to compile, not recorded; "
        f"{time.perf_counter() - t0:.0f} s)"
    )
    return 1 if errors else 0


def _print_tables(rows: list[dict], meta: dict, archs: list[int], latency_ns: float):
    """Per architecture: the GPU and Little's law, then its rows."""
    for arch in archs:
        gpu = GPUS[arch]
        print(
            f"sm_{arch}: {gpu.name}, {gpu.bandwidth / 1e12:.3g} TB/s; Little's law "
            f"at {latency_ns:.0f} ns "
            f"(assumed, see normbook.lab.inspector.LATENCY_NS): "
            f"{littles_law_bytes(gpu, latency_ns) / 1024:.1f} KiB "
            f"in flight per SM. triton {meta.get('triton')}, torch "
            f"{meta.get('torch')}."
        )
        print(
            "'inflight': bytes of row loads a SM has in flight (model); 'pred': "
            "predicted fraction of "
            "bandwidth (a model, not a measurement)"
        )
        print(format_table([r for r in rows if r["arch"] == arch]))
