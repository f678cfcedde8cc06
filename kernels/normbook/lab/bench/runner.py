"""Running the benchmark: timing each (case, shape, provider), checking it, the command
line."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import importlib.util
import math
import platform
import shlex
import statistics
import subprocess
import time
from typing import Callable

import torch

from normbook._runtime import DEVICE, INTERPRET, device_name

from .. import measure as timing
from ..paths import REPO as ROOT
from .cases import (
    CASES,
    DO_BENCH,
    WALL_CLOCK,
    Case,
    Problem,
    Skip,
)

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

        def checked():
            # an in-place call writes into fresh copies of its pristine inputs, so each
            # provider is checked on what it alone wrote
            inputs = [problem.pristine[i].clone() if i in problem.pristine else t
                      for i, t in enumerate(problem.inputs)]  # fmt: skip
            return _as_tuple(fn(*inputs))

        return (lambda: fn(*problem.inputs)), checked
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


def _run_case(
    case,
    shapes,
    rows,
    *,
    dtype,
    providers,
    timer,
    copy_gbps,
    log,
    compile_ok,
    compile_sizes=None,
    on_rows=None,
    deadline=None,
):
    """The one loop of the benchmark: ``case`` at each (M, N, regime) of ``shapes``,
    rows appended to ``rows``. torch.compile is timed where ``compile_ok``, at the N
    of ``compile_sizes`` (None: every N). Returns None, "skipped" (the case cannot run
    here: one row says why), or what a ``deadline`` (``time.monotonic()``) left
    unmeasured."""
    for M, N, regime in shapes:
        if deadline is not None and time.monotonic() > deadline:
            return f"budget reached before {case.name} M={M} N={N}"
        try:
            problem = case.build(M, N, dtype, DEVICE)
        except Skip as exc:  # a case that cannot run here (a package missing)
            note = str(exc) or type(exc).__name__
            rows.append(_row(case, "all", status="skipped", note=note))
            log(f"{case.name:<28} skipped: {exc}")
            return "skipped"  # the same reason holds for every size
        except Exception as exc:
            note = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(
                _row(case, "all", M=M, N=N, regime=regime, status="error", note=note)
            )
            log(f"{case.name:<28} N={N:<7} error: {note[:120]}")
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
        if on_rows is not None:
            on_rows(rows)
    return None


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
    on_rows=None,
) -> list[dict]:
    """Every case at every shape: (elements // N, N) for N in ``sizes``, then the
    ``decode`` (M, N). ``compile_sizes``: the N at which torch.compile is timed (None:
    all); it compiles once per shape."""
    rows: list[dict] = []
    shapes = [(max(1, elements // N), N, "sweep") for N in sizes]
    shapes += [(M, N, "decode") for M, N in decode]
    for case in cases:
        _run_case(
            case,
            (case.shapes(smoke) if case.shapes else None) or shapes,
            rows,
            dtype=dtype,
            providers=providers,
            timer=timer,
            copy_gbps=copy_gbps,
            log=log,
            compile_ok=compile_ok,
            compile_sizes=compile_sizes,
            on_rows=on_rows,
        )
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
    """The trimmed benchmark (:mod:`normbook.lab.bench.plan`): every entry at its
    shapes for every provider but torch.compile, in the plan's order; then torch.compile
    at each entry's ``compile_at`` shapes. ``on_rows(rows)`` is called after every shape
    (the caller writes the files then: a stop keeps what was measured). ``deadline``
    (``time.monotonic()``): no new shape starts after it. Returns ``(rows, cut)``,
    ``cut`` None or what was left unmeasured.
    """
    from .plan import compile_shapes, shapes_of

    by_name = {c.name: c for c in CASES}
    rows: list[dict] = []
    skipped: set[str] = set()
    passes = [("normbook and eager", [p for p in providers if p != "torch.compile"])]
    if "torch.compile" in providers:
        passes.append(("torch.compile", ["torch.compile"]))
    for pass_name, provs in passes:
        for entry in plan:
            case = by_name.get(entry.case)
            if case is None:
                if pass_name != "torch.compile":
                    kernel, _, direction = entry.case.partition(".")
                    note = f"no case {entry.case!r} in the benchmark's cases"
                    rows.append(
                        _row(
                            Case(kernel, direction, None),
                            "all",
                            status="skipped",
                            note=note,
                        )
                    )
                    log(f"{entry.case:<28} skipped: not a case")
                continue
            if case.name in skipped:
                continue
            pick = compile_shapes if pass_name == "torch.compile" else shapes_of
            shapes = [
                (M, N, "decode" if M <= 64 else "sweep") for M, N in pick(entry, smoke)
            ]
            out = _run_case(
                case,
                shapes,
                rows,
                dtype=dtype,
                providers=provs,
                timer=timer,
                copy_gbps=copy_gbps,
                log=log,
                compile_ok=compile_ok,
                on_rows=on_rows,
                deadline=deadline,
            )
            if out == "skipped":
                skipped.add(case.name)
            elif out is not None:
                cut = f"{out} ({pass_name})"
                log(f"normbook.lab.bench: {cut}")
                return rows, cut
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
