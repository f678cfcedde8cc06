"""Running the benchmark: timing each (case, shape, provider), checking it, the command
line."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import importlib.util
import math
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from normbook._runtime import DEVICE, INTERPRET, default_dtype, device_name

from .. import timing
from ..paths import REPO as ROOT
from .cases import (
    CASES,
    DATA_DIR,
    DECODE_M,
    DECODE_N,
    DO_BENCH,
    ELEMENTS,
    PROVIDERS,
    SMOKE_DECODE,
    SMOKE_ELEMENTS,
    SMOKE_SWEEP,
    SWEEP,
    WALL_CLOCK,
    Case,
    Problem,
    Skip,
)
from .report import write_results

# ---------------------------------------------------------------- timing one problem


def wall_time_ms(fn: Callable[[], object], warmup: int = 0, rep: int = 2) -> float:
    """Median wall-clock time on the CPU: the smoke run's timer. Not a GPU
    measurement, so it runs ``fn`` as few times as still exercises what a GPU timer
    does to it: twice, as ``do_bench`` calls a backward again and again on one graph
    (its saved tensors must survive the first call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _timed_call(fn: Callable, problem: Problem):
    """(zero-argument callable to time, callable returning the results to check)."""
    if not problem.wrt:
        return (lambda: fn(*problem.inputs)), (lambda: _as_tuple(fn(*problem.inputs)))
    inputs = [
        t.detach().clone().requires_grad_(i in problem.wrt)
        if isinstance(t, torch.Tensor)
        else t
        for i, t in enumerate(problem.inputs)
    ]
    wrt = [inputs[i] for i in problem.wrt]
    outs = [
        o
        for o in _as_tuple(fn(*inputs))
        if isinstance(o, torch.Tensor) and o.grad_fn is not None
    ]
    grads = list(problem.grad_outputs)[: len(outs)]

    # The forward ran once, outside the timing: only the backward (kernel launches and
    # autograd's bookkeeping) is timed, again and again on the same graph.
    def backward():
        return torch.autograd.grad(outs, wrt, grads, retain_graph=True)

    return backward, backward


def _max_rel_err(got, want) -> float:
    """Largest |got - want| relative to the largest |want|, over every output tensor."""
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or w is None:
            continue
        g, w = g.detach().float(), w.detach().float()
        if g.shape != w.shape:
            return math.inf
        scale = max(w.abs().max().item(), 1e-30) if w.numel() else 1.0
        err = (g - w).abs().max().item() / scale if w.numel() else 0.0
        worst = max(worst, err if not math.isnan(err) else math.inf)
    return worst


def check_tolerance(dtype: torch.dtype) -> float:
    """A sanity bound, relative to the largest output: a few roundings of the dtype,
    plus the different summation orders of a weight gradient over many rows. It catches
    garbage, not ulps."""
    return {torch.float16: 2e-2, torch.bfloat16: 4e-2}.get(dtype, 1e-3)


# ---------------------------------------------------------------- the run


def provenance(argv: list[str], smoke: bool, dtype: torch.dtype) -> dict:
    def version(mod):
        try:
            return importlib.import_module(mod).__version__
        except Exception:
            return None

    def git(*args):
        try:
            out = subprocess.run(
                ["git", "-C", str(ROOT), *args],
                capture_output=True,
                text=True,
                timeout=10,
            )
            return out.stdout.strip() if out.returncode == 0 else None
        except Exception:
            return None

    p = {
        "gpu": device_name(),
        "device": str(DEVICE),
        "interpreter": INTERPRET,
        "smoke": smoke,
        "timer": DO_BENCH if DEVICE.type == "cuda" else WALL_CLOCK,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "triton": version("triton"),
        "cuda": torch.version.cuda,
        "liger_kernel": None,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m normbook.lab.bench"
        + ("" if not argv else " " + shlex.join(argv)),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": None,
    }
    status = git("status", "--porcelain", "--untracked-files=no", "--", "kernels")
    # uncommitted changes to the kernels
    p["git_dirty"] = None if status is None else bool(status)
    if importlib.util.find_spec("liger_kernel") is not None:
        try:
            from importlib.metadata import version as dist_version

            p["liger_kernel"] = dist_version("liger-kernel")
        except Exception:
            p["liger_kernel"] = "installed (version unknown)"
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(DEVICE)
        p["capability"] = f"{props.major}.{props.minor}"
        p["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        p["sm_count"] = props.multi_processor_count
    return p


def _row(case: Case, provider: str, M=None, N=None, **kw) -> dict:
    row = {
        "kernel": case.kernel,
        "direction": case.direction,
        "provider": provider,
        "regime": "",
        "M": M,
        "N": N,
        "shape": "",
        "bytes": None,
        "ms": None,
        "GB/s": None,
        "pct_of_copy": None,
        "status": "ok",
        "check": "",
        "note": "",
    }
    row.update(kw)
    return row


#: torch.compile's backend; the tests use "aot_eager" (the same AOTAutograd, no C++
#: compiler).
COMPILE_BACKEND = "inductor"


@contextlib.contextmanager
def _no_donated_buffers():
    """torch.compile's backward is timed as every provider's is: the forward runs once,
    then the backward again and again on the same graph (``retain_graph=True``). Since
    torch 2.6 AOTAutograd may *donate* the activations saved for a compiled backward to
    it (the backward reuses their memory) and then refuses ``retain_graph``; the rows
    became "error". We turn donation off (``torch._functorch.config.donated_buffer =
    False``) rather than recompute the forward in every timed call, which would time
    forward + backward for this provider alone. Donation saves memory, not bytes moved:
    the backward reads and writes the same tensors either way."""
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is not None and hasattr(config, "donated_buffer"):
        with config.patch(donated_buffer=False):
            yield
    else:
        yield


def _compiled(formula):
    # a fresh cache per shape: no recompile limit, no silent fall-back to eager
    torch._dynamo.reset()
    return torch.compile(formula, dynamic=False, backend=COMPILE_BACKEND)


def run_problem(
    case: Case,
    problem: Problem,
    M: int,
    N: int,
    providers: list[str],
    timer,
    copy_gbps,
    dtype,
    compile_ok: bool,
) -> list[dict]:
    rows = []
    base = dict(
        M=M, N=N, shape=problem.shape, bytes=problem.nbytes, params=problem.params
    )
    try:
        _, want_fn = _timed_call(problem.formula, problem)
        # eager PyTorch's results: every provider is checked against them
        want = want_fn()
    except Exception:
        want = None
    for provider in providers:
        if provider == "normbook":
            fn = problem.ours
        elif provider == "torch eager":
            fn = problem.formula
        elif provider == "torch.compile":
            if not compile_ok:
                rows.append(
                    _row(
                        case,
                        provider,
                        **base,
                        status="skipped",
                        note="torch.compile is not timed in the CPU smoke run",
                    )
                )
                continue
            fn = _compiled(problem.formula)
        elif provider == "liger":
            if isinstance(problem.liger, Skip) or problem.liger is None:
                rows.append(
                    _row(
                        case,
                        provider,
                        **base,
                        status="skipped",
                        note=str(problem.liger or "no Liger kernel"),
                    )
                )
                continue
            fn = problem.liger
        else:
            raise ValueError(f"unknown provider {provider!r}")
        try:
            compiled = provider == "torch.compile"
            with _no_donated_buffers() if compiled else contextlib.nullcontext():
                timed, results = _timed_call(fn, problem)
                check = ""
                if want is None:
                    check = "no eager reference"
                else:
                    err = _max_rel_err(results(), want)
                    check = (
                        "ok"
                        if err <= check_tolerance(dtype)
                        else (f"MISMATCH (max error {err:.3g} of the largest value)")
                    )
                ms = float(timer(timed))
        # one provider failing (e.g. Liger beyond 64 KB rows) must not stop the sweep
        except Exception as exc:
            rows.append(
                _row(
                    case,
                    provider,
                    **base,
                    status="error",
                    note=f"{type(exc).__name__}: {str(exc)[:200]}",
                )
            )
            continue
        bw = timing.gbps(problem.nbytes, ms)
        rows.append(
            _row(
                case,
                provider,
                **base,
                ms=ms,
                **{"GB/s": bw},
                pct_of_copy=100.0 * bw / copy_gbps if copy_gbps else None,
                check=check,
            )
        )
    return rows


def run(
    cases: list[Case],
    sizes: list[int],
    *,
    elements: int,
    dtype: torch.dtype,
    providers: list[str],
    timer,
    copy_gbps: float,
    compile_ok: bool,
    log=print,
    decode=(),
    compile_sizes=None,
    smoke=False,
) -> list[dict]:
    """Every case at every shape: (elements // N, N) for N in ``sizes``, then the
    ``decode`` (M, N). ``compile_sizes``: the N at which torch.compile is timed (None:
    all); it compiles once per shape."""
    rows = []
    shapes = [(max(1, elements // N), N, "sweep") for N in sizes] + [
        (M, N, "decode") for M, N in decode
    ]
    for case in cases:
        for M, N, regime in case.shapes(smoke) if case.shapes else shapes:
            try:
                problem = case.build(M, N, dtype, DEVICE)
            # a kernel (or its backward) not written yet
            except (Skip, ImportError, AttributeError) as exc:
                rows.append(
                    _row(
                        case,
                        "all",
                        status="skipped",
                        note=str(exc) or type(exc).__name__,
                    )
                )
                log(f"{case.name:<28} skipped: {exc}")
                break  # the same reason holds for every size
            except Exception as exc:
                rows.append(
                    _row(
                        case,
                        "all",
                        M=M,
                        N=N,
                        regime=regime,
                        status="error",
                        note=f"{type(exc).__name__}: {str(exc)[:200]}",
                    )
                )
                log(
                    f"{case.name:<28} N={N:<7} error: {type(exc).__name__}: "
                    f"{str(exc)[:120]}"
                )
                continue
            allowed = compile_ok and (compile_sizes is None or N in compile_sizes)
            new = run_problem(
                case, problem, M, N, providers, timer, copy_gbps, dtype, allowed
            )
            for r in new:
                r["regime"] = regime
                if r["provider"] == "torch.compile" and compile_ok and not allowed:
                    r["note"] = "torch.compile not timed at this N (--compile-sizes)"
                log(format_row(r))
            rows.extend(new)
            del problem
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def run_plan(
    plan,
    *,
    smoke: bool,
    dtype: torch.dtype,
    providers: list[str],
    timer,
    copy_gbps: float,
    compile_ok: bool,
    log=print,
    on_rows=None,
    deadline: float | None = None,
):
    """The trimmed benchmark (:mod:`normbook.lab.bench.plan`): every entry at its shapes for
    every provider but torch.compile, in the plan's order; then torch.compile at each
    entry's ``compile_at`` shapes. ``on_rows(rows)`` is called after every shape (the
    caller writes the files then: a stop keeps what was measured). ``deadline``
    (``time.monotonic()``): no new shape starts after it. Returns ``(rows, cut)``,
    ``cut`` None or what was left unmeasured.
    """
    from .plan import compile_shapes, shapes_of

    by_name = {c.name: c for c in CASES}
    rows: list[dict] = []
    skipped: set[str] = set()
    first = [p for p in providers if p != "torch.compile"]
    passes = [("normbook and eager", first, False)]
    if "torch.compile" in providers:
        passes.append(("torch.compile", ["torch.compile"], True))
    for pass_name, provs, second in passes:
        for entry in plan:
            case = by_name.get(entry.case)
            if case is None:
                if not second:
                    kernel, _, direction = entry.case.partition(".")
                    rows.append(
                        _row(
                            Case(kernel, direction, None),
                            "all",
                            status="skipped",
                            note=f"no case {entry.case!r} in normbook.lab.bench.cases.CASES",
                        )
                    )
                    log(f"{entry.case:<28} skipped: not a case")
                continue
            if case.name in skipped:
                continue
            for M, N in (
                compile_shapes(entry, smoke) if second else shapes_of(entry, smoke)
            ):
                if deadline is not None and time.monotonic() > deadline:
                    cut = f"budget reached before {case.name} M={M} N={N} ({pass_name})"
                    log(f"normbook.lab.bench: {cut}")
                    return rows, cut
                regime = "decode" if M <= 64 else "sweep"
                try:
                    problem = case.build(M, N, dtype, DEVICE)
                except (Skip, ImportError, AttributeError) as exc:
                    rows.append(
                        _row(
                            case,
                            "all",
                            status="skipped",
                            note=str(exc) or type(exc).__name__,
                        )
                    )
                    log(f"{case.name:<28} skipped: {exc}")
                    skipped.add(case.name)
                    break
                except Exception as exc:
                    rows.append(
                        _row(
                            case,
                            "all",
                            M=M,
                            N=N,
                            regime=regime,
                            status="error",
                            note=f"{type(exc).__name__}: {str(exc)[:200]}",
                        )
                    )
                    log(
                        f"{case.name:<28} N={N:<7} error: {type(exc).__name__}: "
                        f"{str(exc)[:120]}"
                    )
                    continue
                new = run_problem(
                    case, problem, M, N, provs, timer, copy_gbps, dtype, compile_ok
                )
                for r in new:
                    r["regime"] = regime
                    log(format_row(r))
                rows.extend(new)
                del problem
                if DEVICE.type == "cuda":
                    torch.cuda.empty_cache()
                if on_rows is not None:
                    on_rows(rows)
    return rows, None


def errors_of(rows: list[dict]) -> list[dict]:
    """Rows that failed: a provider that raised, or a result that does not match eager
    PyTorch."""
    return [
        r
        for r in rows
        if r["status"] == "error" or str(r.get("check", "")).startswith("MISMATCH")
    ]


def failing(errors: list[dict]) -> list[dict]:
    """The errors that make the run fail. A Liger kernel failing (e.g. beyond its
    row-width limit) is third-party: listed loudly, but not ours to fix."""
    return [r for r in errors if r["provider"] != "liger"]


def format_row(r: dict) -> str:
    head = (
        f"{r['kernel'] + '.' + r['direction']:<28} M={str(r['M']):<6} "
        f"N={str(r['N']):<7} {r['provider']:<14}"
    )
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['note']}"
    pct = f"{r['pct_of_copy']:6.1f}% of copy" if r["pct_of_copy"] is not None else ""
    return f"{head} {r['ms']:10.4f} ms {r['GB/s']:9.1f} GB/s {pct}  check {r['check']}"


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
    if not on_gpu and not args.smoke:
        raise SystemExit(
            "No CUDA GPU here (kernels run in Triton's interpreter): "
            "there is nothing to measure. "
            "Use --smoke to exercise the benchmark's code path."
        )
    out = args.out
    if args.smoke:
        if out is not None and out.resolve() == DATA_DIR.resolve():
            raise SystemExit(
                f"--smoke never writes into {DATA_DIR}: that folder holds "
                "GPU results only."
            )
    elif out is None:
        out = DATA_DIR

    start = time.monotonic()
    names = [c.name for c in CASES]
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
    cases = [c for c in CASES if c.name in wanted]
    providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        raise SystemExit(f"unknown provider(s) {bad}; choose from {PROVIDERS}")
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = SMOKE_SWEEP if args.smoke else SWEEP
    elements = args.elements or (SMOKE_ELEMENTS if args.smoke else ELEMENTS)
    dtype = default_dtype()
    timer = timing.time_ms if on_gpu else wall_time_ms
    copy_bytes = int((args.copy_mb or (1 if args.smoke else 256)) * 2**20)
    if out is None:  # a smoke run's own folder, once the arguments are known good
        out = pathlib.Path(tempfile.mkdtemp(prefix="bench-smoke-"))

    prov = provenance(argv, args.smoke, dtype)
    prov.update(
        {
            "sizes": sizes,
            "elements_per_tensor": elements,
            "providers": providers,
            "cases": [c.name for c in cases],
        }
    )
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
    else:
        decode = (
            SMOKE_DECODE if args.smoke else [(m, n) for n in DECODE_N for m in DECODE_M]
        )
    compile_sizes = None
    if args.compile_sizes:
        compile_sizes = {int(s) for s in args.compile_sizes.split(",")}
    prov.update(
        {
            "decode": decode,
            "compile_sizes": sorted(compile_sizes) if compile_sizes else "all",
        }
    )
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
    )
    errors = errors_of(rows)
    json_path, csv_path = write_results(out, prov, copy, rows, errors)
    log(f"wrote {json_path} and {csv_path.name}")
    # Loudly: every failed row on stderr, and in the JSON's "errors" section.
    for r in errors:
        print(f"normbook.lab.bench ERROR: {format_row(r)}", file=sys.stderr)
    bad = failing(errors)
    if errors:
        print(
            f"normbook.lab.bench: {len(errors)} row(s) failed, {len(bad)} of them ours or "
            "PyTorch's "
            f"(see 'errors' in {json_path})",
            file=sys.stderr,
        )
    return {
        "provenance": prov,
        "copy": copy,
        "results": rows,
        "errors": errors,
        "failed": bool(bad),
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

    def save(rows, complete=False, cut=None):
        return write_results(
            out, prov, copy, rows, errors_of(rows), complete=complete, cut=cut
        )

    json_path, _ = save(
        []
    )  # the copy bandwidth is kept even if nothing else is measured
    log(f"writing {json_path} as rows are measured")
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
    errors = errors_of(rows)
    json_path, csv_path = save(rows, complete=cut is None, cut=cut)
    log(f"wrote {json_path} and {csv_path.name}" + (f" (cut: {cut})" if cut else ""))
    for r in errors:
        print(f"normbook.lab.bench ERROR: {format_row(r)}", file=sys.stderr)
    bad = failing(errors)
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


def cli() -> int:
    """``python -m normbook.lab.bench``: exit status 1 when a row of ours or PyTorch's
    failed."""
    return 1 if main()["failed"] else 0
