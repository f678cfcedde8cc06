"""``python -m normbook.lab.bench``: the command line, and the one writer of its
files."""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

from normbook._runtime import DEVICE, default_dtype

from .. import measure as timing
from . import runner
from .cases import (
    DATA_DIR,
    DECODE_M,
    DECODE_N,
    ELEMENTS,
    PROVIDERS,
    SMOKE_DECODE,
    SMOKE_ELEMENTS,
    SMOKE_SWEEP,
    SWEEP,
)
from .report import write_results
from .runner import (
    errors_of,
    failing,
    format_row,
    provenance,
    run,
    run_plan,
    wall_time_ms,
)

# ---------------------------------------------------------------- command line


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m normbook.lab.bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, any device, results to a temporary folder",
    )
    ap.add_argument(
        "--out",
        type=pathlib.Path,
        help=f"folder for the results (default {DATA_DIR}; smoke: a temp folder)",
    )
    ap.add_argument(
        "--cases",
        help="comma-separated case names, e.g. "
        "rms_norm.forward,fused_add_rms_norm.forward",
    )
    ap.add_argument(
        "--sizes",
        help="comma-separated hidden sizes N (default 256 … 262144, powers of two)",
    )
    ap.add_argument(
        "--elements",
        type=int,
        help="elements per row-sized tensor, M = elements // N (default 2**26)",
    )
    ap.add_argument(
        "--providers", help=f"comma-separated subset of {','.join(PROVIDERS)}"
    )
    ap.add_argument(
        "--no-decode",
        action="store_true",
        help="skip the decode shapes (M = 1, 8, 64 rows)",
    )
    ap.add_argument(
        "--compile-sizes",
        help="comma-separated N at which torch.compile is timed (default: every N)",
    )
    ap.add_argument(
        "--copy-mb",
        type=float,
        help="size of the copy that measures the bandwidth, MiB (default 256)",
    )
    ap.add_argument(
        "--plan",
        help="a trimmed plan of kernels/normbook/lab/bench/plan.py instead of the "
        "sweep, e.g. gpu-day",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        help="start no new shape after this many seconds (the files say "
        "where it stopped)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, log=print) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    on_gpu = DEVICE.type == "cuda"
    out = _out_folder(args, on_gpu)
    start = time.monotonic()
    cases, providers = _selection(args)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    sizes = sizes or (SMOKE_SWEEP if args.smoke else SWEEP)
    elements = args.elements or (SMOKE_ELEMENTS if args.smoke else ELEMENTS)
    dtype = default_dtype()
    timer = timing.time_ms if on_gpu else wall_time_ms
    copy_bytes = int((args.copy_mb or (1 if args.smoke else 256)) * 2**20)
    if out is None:  # a smoke run's own folder, once the arguments are known good
        out = pathlib.Path(tempfile.mkdtemp(prefix="bench-smoke-"))

    prov = provenance(argv, args.smoke, dtype)
    prov.update(sizes=sizes, elements_per_tensor=elements, providers=providers)
    prov.update(cases=[c.name for c in cases])
    log(
        f"{prov['gpu']} · torch {prov['torch']} · triton {prov['triton']} · "
        f"{prov['dtype']} · {prov['timer']}"
    )
    copy = timing.copy_bandwidth(copy_bytes, timer=timer)
    log(
        f"device-to-device copy of {copy_bytes / 2**20:.0f} MiB: {copy['ms']:.4f} ms, "
        f"{copy['GB/s']:.1f} GB/s"
    )
    if args.plan:
        return _main_plan(
            args, argv, prov, copy, dtype, providers, timer, on_gpu, out, start, log
        )
    if args.no_decode:
        decode = []
    elif args.smoke:
        decode = SMOKE_DECODE
    else:
        decode = [(m, n) for n in DECODE_N for m in DECODE_M]
    compile_sizes = None
    if args.compile_sizes:
        compile_sizes = {int(s) for s in args.compile_sizes.split(",")}
    prov.update(
        decode=decode, compile_sizes=sorted(compile_sizes) if compile_sizes else "all"
    )
    save = _writer(out, prov, copy)
    log(f"writing {save([])[0]} as rows are measured")
    rows = run(
        cases,
        sizes,
        elements=elements,
        dtype=dtype,
        providers=providers,
        timer=timer,
        copy_gbps=copy["GB/s"],
        compile_ok=on_gpu,
        log=log,
        decode=decode,
        compile_sizes=compile_sizes,
        smoke=args.smoke,
        on_rows=save,
    )
    return _finish(save, prov, copy, rows, None, log)


def _out_folder(args, on_gpu: bool):
    """Where the files go (None: a smoke run's own temporary folder), or a refusal:
    nothing to measure without a GPU, and a smoke run never writes into data/bench/."""
    if not on_gpu and not args.smoke:
        raise SystemExit(
            "No CUDA GPU here (kernels run in Triton's interpreter): "
            "there is nothing to measure. "
            "Use --smoke to exercise the benchmark's code path."
        )
    if args.smoke:
        if args.out is not None and args.out.resolve() == DATA_DIR.resolve():
            raise SystemExit(
                f"--smoke never writes into {DATA_DIR}: that folder holds "
                "GPU results only."
            )
        return args.out
    return args.out or DATA_DIR


def _selection(args):
    """The cases and the providers asked for, each name checked."""
    names = [c.name for c in runner.CASES]
    if args.plan:
        from .plan import PLANS

        if args.plan not in PLANS:
            raise SystemExit(f"unknown plan {args.plan!r}; choose from {sorted(PLANS)}")
        if args.sizes or args.elements or args.no_decode or args.compile_sizes:
            raise SystemExit(
                "--plan sets its own shapes: drop "
                "--sizes/--elements/--no-decode/--compile-sizes"
            )
    wanted = args.cases.split(",") if args.cases else names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {names}")
    providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        raise SystemExit(f"unknown provider(s) {bad}; choose from {PROVIDERS}")
    return [c for c in runner.CASES if c.name in wanted], providers


def _writer(out, prov, copy):
    """The one writer: the run's JSON and CSV, rewritten whole after every shape, so
    that a stop at any moment keeps every row measured (and the copy bandwidth)."""

    def save(rows, complete=True, cut=None):
        errors = errors_of(rows)
        return write_results(out, prov, copy, rows, errors, complete=complete, cut=cut)

    return save


def _finish(save, prov, copy, rows, cut, log) -> dict:
    """The last write, and every failed row said loudly: on stderr, and in the JSON's
    "errors" section."""
    errors = errors_of(rows)
    json_path, csv_path = save(rows, complete=cut is None, cut=cut)
    log(f"wrote {json_path} and {csv_path.name}" + (f" (cut: {cut})" if cut else ""))
    for r in errors:
        print(f"normbook.lab.bench ERROR: {format_row(r)}", file=sys.stderr)
    bad = failing(errors)
    if errors:
        print(
            f"normbook.lab.bench: {len(errors)} row(s) failed, {len(bad)} of them "
            f"ours or PyTorch's (see 'errors' in {json_path})",
            file=sys.stderr,
        )
    return {
        "provenance": prov,
        "copy": copy,
        "results": rows,
        "errors": errors,
        "failed": bool(bad),
        "cut": cut,
        "json": json_path,
        "csv": csv_path,
    }


def _main_plan(
    args, argv, prov, copy, dtype, providers, timer, on_gpu, out, start, log
) -> dict:
    """``--plan``: the trimmed benchmark, its files rewritten after every shape."""
    from .plan import PLANS, compile_shapes, shapes_of

    plan = [
        e for e in PLANS[args.plan] if not args.cases or e.case in args.cases.split(",")
    ]
    prov.update(
        {
            "plan": args.plan,
            "cases": [e.case for e in plan],
            "shapes": {
                e.case: [list(s) for s in shapes_of(e, args.smoke)] for e in plan
            },
            "compile_shapes": {
                e.case: [list(s) for s in compile_shapes(e, args.smoke)] for e in plan
            },
        }
    )
    for key in ("sizes", "elements_per_tensor"):
        prov.pop(key, None)
    deadline = None if args.deadline_s is None else start + args.deadline_s

    save = _writer(out, prov, copy)
    log(f"writing {save([], complete=False)[0]} as rows are measured")
    rows, cut = run_plan(
        plan,
        smoke=args.smoke,
        dtype=dtype,
        providers=providers,
        timer=timer,
        copy_gbps=copy["GB/s"],
        compile_ok=on_gpu,
        log=log,
        on_rows=save,
        deadline=deadline,
    )
    return _finish(save, prov, copy, rows, cut, log)


def cli() -> int:
    """``python -m normbook.lab.bench``: exit status 1 when a row of ours or PyTorch's
    failed."""
    return 1 if main()["failed"] else 0
