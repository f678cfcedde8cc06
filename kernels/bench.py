"""The benchmark behind the chapter "At the speed of light".

    python -m kernels.bench                 # on a CUDA GPU: the full sweep, results into data/bench/
    python -m kernels.bench --smoke         # anywhere: the same code path, tiny shapes, a temp folder

It measures the device-to-device copy bandwidth (the memory-bound speed of light), then runs every
benchmark case over a sweep of hidden sizes N = 256 … 262,144 with many rows (M·N = 2**26 elements
per row-sized tensor), in bf16 (fp16 on GPUs without bf16), for each provider: this package's
Triton kernel, the PyTorch formula in eager mode and under ``torch.compile``, and Liger-Kernel when
it is installed. For every (case, N, provider) it records milliseconds (``triton.testing.do_bench``:
warm-up, median, L2 flushed), the bytes the case must move (from the tensors' sizes), GB/s and the
percentage of the measured copy bandwidth, plus a correctness check against eager PyTorch.

Results go to a JSON and a CSV file named for the date and the GPU, each carrying its provenance:
GPU, compute capability, torch/triton/CUDA/Liger versions, date, the command, the git commit.

Each case is a small function that builds its inputs and its providers. A case whose kernel does
not exist yet (ImportError / AttributeError, or a kernel without a backward) is reported as
skipped, so that new kernels appear in the results as they land.

On a CPU there is no GPU timer. ``--smoke`` then times with the wall clock, in Triton's
interpreter, only to exercise the code path; it writes to a temporary folder (or ``--out``), never
to ``data/bench/``, and marks its files ``"smoke": true`` so that no reader mistakes them for GPU
figures. A full run without a GPU is refused.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib
import importlib.util
import inspect
import json
import math
import pathlib
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import timing
from ._runtime import DEVICE, INTERPRET, default_dtype, device_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data" / "bench"

SWEEP = [256 * 2**i for i in range(11)]  # 256 … 262,144
ELEMENTS = 2**26                         # elements per row-sized tensor: M = ELEMENTS // N rows
SMOKE_SWEEP = [256, 1024]
SMOKE_ELEMENTS = 2**12
HEAD_DIM = 128                           # qk_norm_rope: Qwen3's head_dim; N = heads · HEAD_DIM
GQA_GROUP = 4                            # qk_norm_rope: query heads per key head
PROVIDERS = ["kernels", "torch eager", "torch.compile", "liger"]
DO_BENCH = "triton.testing.do_bench (warm-up, median of many runs, L2 flushed before each)"
WALL_CLOCK = "wall clock in Triton's CPU interpreter (smoke run: exercises the code, not a GPU figure)"

#: The chapter's targets for bf16 and N >= 4096, as fractions of the measured copy bandwidth.
TARGETS = {"forward": 0.90, "fused add": 0.85, "backward": 0.80}
TARGET_MIN_N = 4096


class Skip(Exception):
    """A case (or a provider) that cannot run here: a kernel not written yet, a missing package."""


# ---------------------------------------------------------------- the cases

@dataclass
class Problem:
    """One benchmark instance: inputs, the functions that compute the same thing, and its bytes.

    Every provider is called as ``fn(*inputs)``. For a backward case, the inputs at ``wrt`` get
    ``requires_grad`` and the timed call is the backward of ``fn(*inputs)`` with ``grad_outputs``.
    ``nbytes`` counts each tensor that must be read or written once (timing.bytes_moved).
    """

    inputs: tuple
    nbytes: int
    ours: Callable
    formula: Callable
    liger: Callable | None = None      # None: Liger has no such kernel
    wrt: tuple[int, ...] = ()          # backward cases: positions of the inputs to differentiate
    grad_outputs: tuple = ()
    shape: str = ""                    # how the row-sized tensors are laid out, for the record


@dataclass
class Case:
    kernel: str
    direction: str                     # "forward" | "backward"
    build: Callable[[int, int, torch.dtype, torch.device], Problem]
    target: str = ""                   # key of TARGETS

    @property
    def name(self) -> str:
        return f"{self.kernel}.{self.direction}"


def _kernel(name: str):
    """``kernels.<name>``, or Skip when that kernel has not been written yet."""
    try:
        module = importlib.import_module("kernels")
        return getattr(module, name)
    except (ImportError, AttributeError) as exc:
        raise Skip(f"kernels.{name} does not exist yet ({type(exc).__name__})") from exc


def _liger(module: str, attr: str):
    """A Liger-Kernel autograd Function, or Skip when Liger is not installed (or lacks it)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger-kernel is not installed")
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), attr)
    except Exception as exc:  # an old Liger without the op, or one that fails to import here
        raise Skip(f"liger_kernel.ops.{module}.{attr} unavailable ({type(exc).__name__})") from exc


def _rand(*shape, dtype, device, scale=1.0):
    """Random normal values: never zeros (a kernel on zeros is trivially 'right', and flatters)."""
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _needs_backward(fn, *inputs):
    """Raise Skip if ``fn`` is not differentiable through autograd (its backward not written yet)."""
    probe = [(t.detach()[:1] if t.dim() > 1 else t.detach()).clone().requires_grad_(True)
             if isinstance(t, torch.Tensor) else t for t in inputs]  # one row is enough to ask
    out = fn(*probe)
    out = out if isinstance(out, tuple) else (out,)
    if not any(isinstance(o, torch.Tensor) and o.grad_fn is not None for o in out):
        raise Skip("no backward yet (the output has no grad_fn)")


# The PyTorch formulas, written as the Hugging Face modules write them.

def torch_rms_norm(x, weight, eps=1e-6):
    xf = x.to(torch.float32)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_layer_norm(x, weight, bias, eps=1e-5):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def torch_fused_add_rms_norm(x, residual, weight, eps=1e-6):
    h = x + residual
    return torch_rms_norm(h, weight, eps), h


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    qn, kn = torch_rms_norm(q, q_weight, eps), torch_rms_norm(k, k_weight, eps)
    return qn * c + _rotate_half(qn) * s, kn * c + _rotate_half(kn) * s


def _liger_rms_norm():
    fn = _liger("rms_norm", "LigerRMSNormFunction")
    if "in_place" in inspect.signature(fn.forward).parameters:
        # in_place=False: the default overwrites dy with dx, which would change the timed data.
        return lambda x, w: fn.apply(x, w, 1e-6, 0.0, "llama", False)
    return lambda x, w: fn.apply(x, w, 1e-6)


def build_rms_norm(M, N, dtype, device, backward=False):
    ours = _kernel("rms_norm")
    x, w = _rand(M, N, dtype=dtype, device=device), _rand(N, dtype=dtype, device=device)
    try:
        liger = _liger_rms_norm()
    except Skip as exc:
        liger = exc
    if not backward:
        y = torch.empty_like(x)
        return Problem((x, w), timing.bytes_moved(x, w, y), lambda x, w: ours(x, w, 1e-6),
                       torch_rms_norm, liger, shape=f"x ({M}, {N})")
    _needs_backward(lambda x, w: ours(x, w, 1e-6), x, w)
    dy = _rand(M, N, dtype=dtype, device=device)
    # Must move: read x, w, dy; write dx and dw.
    nbytes = timing.bytes_moved(x, w, dy, torch.empty_like(x), torch.empty_like(w))
    return Problem((x, w), nbytes, lambda x, w: ours(x, w, 1e-6), torch_rms_norm, liger,
                   wrt=(0, 1), grad_outputs=(dy,), shape=f"x ({M}, {N})")


def build_layer_norm(M, N, dtype, device, backward=False):
    ours = _kernel("layer_norm")
    x = _rand(M, N, dtype=dtype, device=device)
    w, b = _rand(N, dtype=dtype, device=device), _rand(N, dtype=dtype, device=device)
    try:
        fn = _liger("layer_norm", "LigerLayerNormFunction")
        liger = lambda x, w, b: fn.apply(x, w, b, 1e-5)  # noqa: E731
    except Skip as exc:
        liger = exc
    call = lambda x, w, b: ours(x, w, b, 1e-5)  # noqa: E731
    if not backward:
        return Problem((x, w, b), timing.bytes_moved(x, w, b, torch.empty_like(x)), call,
                       torch_layer_norm, liger, shape=f"x ({M}, {N})")
    _needs_backward(call, x, w, b)
    dy = _rand(M, N, dtype=dtype, device=device)
    # Must move: read x, w, dy (b is not needed); write dx, dw and db.
    nbytes = timing.bytes_moved(x, w, dy, torch.empty_like(x), torch.empty_like(w), torch.empty_like(b))
    return Problem((x, w, b), nbytes, call, torch_layer_norm, liger,
                   wrt=(0, 1, 2), grad_outputs=(dy,), shape=f"x ({M}, {N})")


def build_fused_add_rms_norm(M, N, dtype, device):
    ours = _kernel("fused_add_rms_norm")
    x, r = _rand(M, N, dtype=dtype, device=device), _rand(M, N, dtype=dtype, device=device)
    w = _rand(N, dtype=dtype, device=device)
    try:
        fn = _liger("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
        liger = lambda x, r, w: fn.apply(x, r, w, 1e-6)  # noqa: E731
    except Skip as exc:
        liger = exc
    # Must move: read x, residual, w; write y and residual_out.
    nbytes = timing.bytes_moved(x, r, w, torch.empty_like(x), torch.empty_like(x))
    return Problem((x, r, w), nbytes, lambda x, r, w: ours(x, r, w, 1e-6), torch_fused_add_rms_norm,
                   liger, shape=f"x, residual ({M}, {N})")


def build_qk_norm_rope(M, N, dtype, device):
    """M tokens; N = n_heads · head_dim for the queries, a quarter as many key heads (GQA)."""
    ours = _kernel("qk_norm_rope")
    hq = max(1, N // HEAD_DIM)
    hk = max(1, hq // GQA_GROUP)
    q = _rand(1, M, hq, HEAD_DIM, dtype=dtype, device=device)
    k = _rand(1, M, hk, HEAD_DIM, dtype=dtype, device=device)
    qw, kw = _rand(HEAD_DIM, dtype=dtype, device=device), _rand(HEAD_DIM, dtype=dtype, device=device)
    angles = torch.arange(M, device=device, dtype=torch.float32)[:, None] * torch.rand(HEAD_DIM // 2, device=device)
    angles = torch.cat([angles, angles], dim=-1)[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # Must move: read q, k, both weights, cos, sin; write q_out and k_out.
    nbytes = timing.bytes_moved(q, k, qw, kw, cos, sin, torch.empty_like(q), torch.empty_like(k))
    return Problem((q, k, qw, kw, cos, sin), nbytes,
                   lambda q, k, qw, kw, c, s: ours(q, k, qw, kw, c, s, 1e-6), torch_qk_norm_rope,
                   Skip("Liger has no fused QK-Norm + RoPE"),
                   shape=f"q (1, {M}, {hq}, {HEAD_DIM}), k (1, {M}, {hk}, {HEAD_DIM})")


CASES = [
    Case("rms_norm", "forward", lambda M, N, dt, dev: build_rms_norm(M, N, dt, dev), "forward"),
    Case("rms_norm", "backward", lambda M, N, dt, dev: build_rms_norm(M, N, dt, dev, True), "backward"),
    Case("layer_norm", "forward", lambda M, N, dt, dev: build_layer_norm(M, N, dt, dev), "forward"),
    Case("layer_norm", "backward", lambda M, N, dt, dev: build_layer_norm(M, N, dt, dev, True), "backward"),
    Case("fused_add_rms_norm", "forward", build_fused_add_rms_norm, "fused add"),
    Case("qk_norm_rope", "forward", build_qk_norm_rope, "forward"),
]


# ---------------------------------------------------------------- timing one problem

def wall_time_ms(fn: Callable[[], object], warmup: int = 1, rep: int = 3) -> float:
    """Median wall-clock time on the CPU: the smoke run's timer. Not a GPU measurement."""
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
    inputs = [t.detach().clone().requires_grad_(i in problem.wrt) if isinstance(t, torch.Tensor) else t
              for i, t in enumerate(problem.inputs)]
    wrt = [inputs[i] for i in problem.wrt]
    outs = [o for o in _as_tuple(fn(*inputs)) if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    grads = list(problem.grad_outputs)[: len(outs)]
    # The forward ran once, outside the timing: only the backward (kernel launches and autograd's
    # bookkeeping) is timed, again and again on the same graph.
    backward = lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)  # noqa: E731
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
    """A sanity bound, relative to the largest output: a few roundings of the dtype, plus the
    different summation orders of a weight gradient over many rows. It catches garbage, not ulps."""
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
            out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
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
        "command": "python -m kernels.bench" + ("" if not argv else " " + shlex.join(argv)),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": None,
    }
    status = git("status", "--porcelain", "--untracked-files=no", "--", "kernels")
    p["git_dirty"] = None if status is None else bool(status)  # uncommitted changes to the kernels
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
    row = {"kernel": case.kernel, "direction": case.direction, "provider": provider, "M": M, "N": N,
           "shape": "", "bytes": None, "ms": None, "GB/s": None, "pct_of_copy": None,
           "status": "ok", "check": "", "note": ""}
    row.update(kw)
    return row


def _compiled(formula):
    torch._dynamo.reset()  # a fresh cache per shape: no recompile limit, no silent fall-back to eager
    return torch.compile(formula, dynamic=False)


def run_problem(case: Case, problem: Problem, M: int, N: int, providers: list[str], timer, copy_gbps,
                dtype, compile_ok: bool) -> list[dict]:
    rows = []
    base = dict(M=M, N=N, shape=problem.shape, bytes=problem.nbytes)
    try:
        _, want_fn = _timed_call(problem.formula, problem)
        want = want_fn()  # eager PyTorch's results: every provider is checked against them
    except Exception:
        want = None
    for provider in providers:
        if provider == "kernels":
            fn = problem.ours
        elif provider == "torch eager":
            fn = problem.formula
        elif provider == "torch.compile":
            if not compile_ok:
                rows.append(_row(case, provider, **base, status="skipped",
                                 note="torch.compile is not timed in the CPU smoke run"))
                continue
            fn = _compiled(problem.formula)
        elif provider == "liger":
            if isinstance(problem.liger, Skip) or problem.liger is None:
                rows.append(_row(case, provider, **base, status="skipped", note=str(problem.liger or "no Liger kernel")))
                continue
            fn = problem.liger
        else:
            raise ValueError(f"unknown provider {provider!r}")
        try:
            timed, results = _timed_call(fn, problem)
            check = ""
            if want is None:
                check = "no eager reference"
            else:
                err = _max_rel_err(results(), want)
                check = "ok" if err <= check_tolerance(dtype) else f"MISMATCH (max error {err:.3g} of the largest value)"
            ms = float(timer(timed))
        except Exception as exc:  # one provider failing (e.g. Liger beyond 64 KB rows) must not stop the sweep
            rows.append(_row(case, provider, **base, status="error", note=f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        bw = timing.gbps(problem.nbytes, ms)
        rows.append(_row(case, provider, **base, ms=ms, **{"GB/s": bw},
                         pct_of_copy=100.0 * bw / copy_gbps if copy_gbps else None, check=check))
    return rows


def run(cases: list[Case], sizes: list[int], *, elements: int, dtype: torch.dtype, providers: list[str],
        timer, copy_gbps: float, compile_ok: bool, log=print) -> list[dict]:
    rows = []
    for case in cases:
        for N in sizes:
            M = max(1, elements // N)
            try:
                problem = case.build(M, N, dtype, DEVICE)
            except (Skip, ImportError, AttributeError) as exc:  # a kernel (or its backward) not written yet
                rows.append(_row(case, "all", status="skipped", note=str(exc) or type(exc).__name__))
                log(f"{case.name:<28} skipped: {exc}")
                break  # the same reason holds for every size
            except Exception as exc:
                rows.append(_row(case, "all", M=M, N=N, status="error", note=f"{type(exc).__name__}: {str(exc)[:200]}"))
                log(f"{case.name:<28} N={N:<7} error: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            new = run_problem(case, problem, M, N, providers, timer, copy_gbps, dtype, compile_ok)
            rows.extend(new)
            for r in new:
                log(format_row(r))
            del problem
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_row(r: dict) -> str:
    head = f"{r['kernel'] + '.' + r['direction']:<28} N={str(r['N']):<7} {r['provider']:<14}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['note']}"
    pct = f"{r['pct_of_copy']:6.1f}% of copy" if r["pct_of_copy"] is not None else ""
    return f"{head} {r['ms']:10.4f} ms {r['GB/s']:9.1f} GB/s {pct}  check {r['check']}"


# ---------------------------------------------------------------- files

CSV_FIELDS = ["kernel", "direction", "provider", "M", "N", "shape", "dtype", "bytes", "ms", "GB/s", "pct_of_copy",
              "status", "check", "note", "gpu", "torch", "triton", "date", "copy_GB/s", "smoke"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"


def write_results(out_dir: pathlib.Path, prov: dict, copy: dict, rows: list[dict]) -> tuple[pathlib.Path, pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = prov["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
    stem = f"{stamp}_{_slug(prov['gpu'])}" + ("_smoke" if prov["smoke"] else "")
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    json_path.write_text(json.dumps({"provenance": prov, "copy": copy, "results": rows}, indent=1) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "dtype": prov["dtype"], "gpu": prov["gpu"], "torch": prov["torch"],
                             "triton": prov["triton"], "date": prov["date"], "copy_GB/s": copy["GB/s"],
                             "smoke": prov["smoke"]})
    return json_path, csv_path


def load_runs(folder: pathlib.Path | str | None = None) -> list[dict]:
    """Every recorded GPU run in ``folder`` (default data/bench/), oldest first.

    Only files written by a full run on a CUDA GPU count: smoke runs, interpreter runs and files
    without provenance are ignored, so that no figure can come from anything but a GPU.
    """
    folder = DATA_DIR if folder is None else pathlib.Path(folder)
    runs = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            run_ = json.loads(path.read_text())
            prov = run_["provenance"]
        except (ValueError, KeyError, TypeError):
            continue
        if prov.get("smoke") or prov.get("interpreter") or not str(prov.get("device", "")).startswith("cuda"):
            continue
        if prov.get("timer") != DO_BENCH or not run_.get("results"):
            continue
        run_["path"] = str(path)
        runs.append(run_)
    return sorted(runs, key=lambda r: r["provenance"]["date"])


def label(run_: dict) -> str:
    """One line naming where and when a run was measured."""
    p = run_["provenance"]
    return (f"{p['gpu']} · torch {p['torch']} · triton {p['triton']} · {p['dtype']} · "
            f"{p['date'][:10]} · copy {run_['copy']['GB/s']:.0f} GB/s")


def summary(run_: dict) -> list[dict]:
    """Per case and provider: the lowest % of copy bandwidth for N >= TARGET_MIN_N, and whether
    the Triton kernel is at least as fast as torch.compile on every shape."""
    ok = [r for r in run_["results"] if r["status"] == "ok"]
    out = []
    for kernel, direction in dict.fromkeys((r["kernel"], r["direction"]) for r in ok):
        case = next((c for c in CASES if c.kernel == kernel and c.direction == direction), None)
        target = TARGETS.get(case.target) if case else None
        rows = [r for r in ok if (r["kernel"], r["direction"]) == (kernel, direction)]
        compiled = {r["N"]: r["ms"] for r in rows if r["provider"] == "torch.compile"}
        for provider in dict.fromkeys(r["provider"] for r in rows):
            mine = [r for r in rows if r["provider"] == provider]
            big = [r["pct_of_copy"] for r in mine if r["N"] >= TARGET_MIN_N and r["pct_of_copy"] is not None]
            entry = {"kernel": kernel, "direction": direction, "provider": provider,
                     "min % of copy (N >= 4096)": min(big) if big else None,
                     "target %": 100 * target if target and provider == "kernels" else None}
            if provider == "kernels" and compiled:
                entry["as fast as torch.compile on every N"] = all(
                    r["ms"] <= compiled[r["N"]] for r in mine if r["N"] in compiled)
            out.append(entry)
    return out


def plot_run(run_: dict):
    """One panel per case: GB/s against N for every provider, the copy bandwidth as a line."""
    import matplotlib.pyplot as plt

    ok = [r for r in run_["results"] if r["status"] == "ok"]
    cases = list(dict.fromkeys((r["kernel"], r["direction"]) for r in ok))
    cols = min(3, max(1, len(cases)))
    rows_ = math.ceil(len(cases) / cols) if cases else 1
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.3 * rows_), squeeze=False)
    copy = run_["copy"]["GB/s"]
    for ax, (kernel, direction) in zip(axes.flat, cases):
        for provider in PROVIDERS:
            pts = sorted((r["N"], r["GB/s"]) for r in ok
                         if (r["kernel"], r["direction"], r["provider"]) == (kernel, direction, provider))
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=provider)
        ax.axhline(copy, color="k", ls="--", lw=1, label="copy (measured)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{kernel} {direction}", fontsize=10)
        ax.set_xlabel("hidden size N")
        ax.set_ylabel("GB/s")
        ax.set_ylim(0, copy * 1.15)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    if cases:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(label(run_), fontsize=9)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- command line

def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device, results to a temporary folder")
    ap.add_argument("--out", type=pathlib.Path, help=f"folder for the results (default {DATA_DIR}; smoke: a temp folder)")
    ap.add_argument("--cases", help="comma-separated case names, e.g. rms_norm.forward,fused_add_rms_norm.forward")
    ap.add_argument("--sizes", help="comma-separated hidden sizes N (default 256 … 262144, powers of two)")
    ap.add_argument("--elements", type=int, help="elements per row-sized tensor, M = elements // N (default 2**26)")
    ap.add_argument("--providers", help=f"comma-separated subset of {','.join(PROVIDERS)}")
    ap.add_argument("--copy-mb", type=float, help="size of the copy that measures the bandwidth, MiB (default 256)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, log=print) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    on_gpu = DEVICE.type == "cuda"
    if not on_gpu and not args.smoke:
        raise SystemExit("No CUDA GPU here (kernels run in Triton's interpreter): there is nothing to measure. "
                         "Use --smoke to exercise the benchmark's code path.")
    out = args.out
    if args.smoke:
        if out is not None and out.resolve() == DATA_DIR.resolve():
            raise SystemExit(f"--smoke never writes into {DATA_DIR}: that folder holds GPU results only.")
        out = out or pathlib.Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    out = out or DATA_DIR

    names = [c.name for c in CASES]
    wanted = args.cases.split(",") if args.cases else names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {names}")
    cases = [c for c in CASES if c.name in wanted]
    providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    bad = [p for p in providers if p not in PROVIDERS]
    if bad:
        raise SystemExit(f"unknown provider(s) {bad}; choose from {PROVIDERS}")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (SMOKE_SWEEP if args.smoke else SWEEP)
    elements = args.elements or (SMOKE_ELEMENTS if args.smoke else ELEMENTS)
    dtype = default_dtype()
    timer = timing.time_ms if on_gpu else wall_time_ms
    copy_bytes = int((args.copy_mb or (1 if args.smoke else 256)) * 2**20)

    prov = provenance(argv, args.smoke, dtype)
    prov.update({"sizes": sizes, "elements_per_tensor": elements, "providers": providers,
                 "cases": [c.name for c in cases]})
    log(f"{prov['gpu']} · torch {prov['torch']} · triton {prov['triton']} · {prov['dtype']} · {prov['timer']}")
    copy = timing.copy_bandwidth(copy_bytes, timer=timer)
    log(f"device-to-device copy of {copy_bytes / 2**20:.0f} MiB: {copy['ms']:.4f} ms, {copy['GB/s']:.1f} GB/s")
    rows = run(cases, sizes, elements=elements, dtype=dtype, providers=providers, timer=timer,
               copy_gbps=copy["GB/s"], compile_ok=on_gpu, log=log)
    json_path, csv_path = write_results(out, prov, copy, rows)
    log(f"wrote {json_path} and {csv_path.name}")
    return {"provenance": prov, "copy": copy, "results": rows, "json": json_path, "csv": csv_path}


if __name__ == "__main__":
    main()
