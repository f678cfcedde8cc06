"""`make gpu-check` (or `bash tools/gpu_day.sh`): what a lent CUDA GPU can measure, in one command.

It runs with the machine's own Python (no venv, no pip index, no network), each step under a
wall-clock budget with a hard stop (its process group is killed), in order of value:

0. wheels    install the wheels carried in .whl/ (`make gpu-wheels`) into /tmp/site, no index;
1. bench     `python -m normbook.lab.bench --plan gpu-day`: copy bandwidth, then the headline shapes of
             every kernel against eager PyTorch, then torch.compile (kernels/normbook/lab/bench/plan.py);
2. tests     the kernel tests on the GPU, in parallel (pytest-xdist), not the book's or browser's;
3. inspect   `python -m normbook.lab.inspector` for this GPU's architecture at the measured shapes, and
             the table of measured against predicted fractions of the copy bandwidth;
4. chapters  every chapter executed on the GPU, if the wheels (nbclient, ipykernel, ...) are
             there, in whatever is left of the total budget.

Results are flushed as they are measured: the benchmark rewrites its JSON/CSV after every shape,
and summary.json is rewritten when a step starts and when it ends (naming any step that was cut).
Everything goes to one folder of at most 8 files, no subfolders: `$OUT` when it is set (the
device tool returns that folder), else `--out`, else `_build/gpu-check/<date>/`, which is then
recorded into data/bench/ (see `--record`). The logs of every step are bundled in logs.tar.gz.

    python3 tools/gpu_check.py                 # on the GPU machine (exit 2 without a CUDA GPU)
    python3 tools/gpu_check.py --dry-run       # here: the same orchestration on the CPU
    python3 tools/gpu_check.py --record DIR    # copy a returned folder into data/bench/

The dry run uses Triton's interpreter, the benchmark's smoke shapes and a few kernel tests, with
the same steps, order and budgets, and writes the same files with "dry_run": true.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
DATA = ROOT / "data" / "bench"
WHEELS = ROOT / ".whl"
SITE = pathlib.Path(os.environ.get("GPU_CHECK_SITE", "/tmp/site"))

#: Seconds per step; the chapters get what is left of TOTAL_S (if at least CHAPTERS_MIN_S).
BUDGETS = {"wheels": 20, "bench": 240, "tests": 120, "inspect": 60}
TOTAL_S = 480
CHAPTERS_MIN_S = 30
#: Seconds before its hard stop at which a step is asked to stop starting new work (the
#: benchmark's --deadline-s, the tests' budget plugin), so that it writes its files itself.
SOFT_MARGIN_S = {"bench": 20, "tests": 15, "inspect": 15, "chapters": 10}

#: Test files that are not kernel tests: they build the book, drive a browser or read prose.
NOT_KERNEL_TESTS = {
    "test_chapters.py",
    "test_html.py",
    "test_pages.py",
    "test_prose.py",
    "test_publishing.py",
    "test_colab_edition.py",
    "test_setup_cell.py",
    "test_code_width.py",
    "test_inspect.py",
    "test_gpu_check.py",
    "test_bench.py",
}
#: The most valuable first (pytest-xdist hands out tests roughly in this order).
FIRST_TESTS = [
    "test_rms_norm.py",
    "test_rms_norm_backward.py",
    "test_fused_add_rms_norm.py",
    "test_fused_add_rms_norm_backward.py",
    "test_layer_norm.py",
    "test_layer_norm_backward.py",
    "test_softmax.py",
    "test_cross_entropy.py",
    "test_attention.py",
    "test_sampling.py",
    "test_qk_norm_rope.py",
]
#: The dry run's tests: a few fast ones (the interpreter is no GPU).
DRY_TESTS = ["tests/test_validate.py"]
#: The dry run's inspector: one kernel's variants (the first compile takes seconds each here).
DRY_INSPECT_CALLS = ("rms_norm",)
#: Benchmarked but not a call of the inspector: linear_cross_entropy's own launches are
#: cross_entropy's kernels between cuBLAS products (kernels/normbook/lab/inspector/launches.py's _calls).
NOT_INSPECTED = {"linear_cross_entropy"}
#: What executing the chapters needs beyond the GPU machine's own packages.
CHAPTER_MODULES = ("nbformat", "nbclient", "ipykernel", "plotly")
MAX_OUT_FILES = 8

#: `make gpu-wheels`: what executing the chapters needs (pip adds their dependencies)...
WHEEL_PACKAGES = ["nbformat", "nbclient", "ipykernel", "plotly"]
#: ... less what the GPU machine's image already holds (the device tool's package list for
#: nvidia-h200, 2026-11): carrying a second copy would shadow the machine's own.
GPU_MACHINE_HAS = set(
    """
absl-py accelerate aiofiles attrs certifi charset-normalizer click cloudpickle colorama contourpy
cycler filelock fonttools fsspec h11 httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2
joblib kiwisolver markdown markdown-it-py markupsafe matplotlib mdurl mpmath narwhals networkx numpy
packaging pandas pillow pip pluggy protobuf psutil pygments pyparsing pytest pytest-xdist execnet
python-dateutil pytz pyyaml regex requests rich safetensors scipy setuptools six sympy tokenizers
torch tqdm transformers triton typing-extensions tzdata urllib3 wheel zipp typer shellingham
""".split()
)
#: pip matches manylinux tags exactly. Nothing newer than glibc 2.28: the GPU machine's is not
#: known, and one wheel it refuses stops the whole --no-deps install.
WHEEL_PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_26_x86_64",
]
WHEELS_MAX_MIB = 30


def _soft(budget: float, step: str) -> float:
    """Seconds after which ``step`` starts no new work: its margin before the hard stop, or
    a quarter of its budget when the budget is small (the rest leaves room for the step's
    start-up: a dry run's 12-second benchmark spends 3 to 5 of them importing torch, and
    its smoke plan, 6 s of rows at the fastest, must still be cut by its own deadline)."""
    return budget - min(SOFT_MARGIN_S[step], 3 * budget / 4)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: pathlib.Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _git(*args) -> str | None:
    """git's answer, or None where git is missing (the GPU machine may have none) or fails."""
    if shutil.which("git") is None:
        return None
    try:
        r = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def kernel_test_files() -> list[str]:
    names = sorted(
        p.name
        for p in (ROOT / "tests").glob("test_*.py")
        if p.name not in NOT_KERNEL_TESTS
    )
    first = [n for n in FIRST_TESTS if n in names]
    return [f"tests/{n}" for n in first + [n for n in names if n not in first]]


def inspector_arch(capability: tuple[int, int]) -> int:
    """The inspector's architecture (90, 80, 75) closest to, and not above, this GPU's."""
    arch = capability[0] * 10 + capability[1]
    return max((a for a in (90, 80, 75) if a <= arch), default=75)


# ---------------------------------------------------------------- one step, under its budget


def run_step(
    name: str,
    cmd: list[str],
    budget_s: float,
    log_path: pathlib.Path,
    env: dict,
    echo=sys.stdout,
) -> dict:
    """Run ``cmd`` in its own process group, its output to ``log_path`` (and ``echo``), killed
    with its whole group when ``budget_s`` seconds have passed. Returns the step's record."""
    t0 = time.monotonic()
    with log_path.open("w") as log:
        log.write(f"== {name}: {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if echo is not None:
                    echo.write(line)
                    echo.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        cut = False
        try:
            proc.wait(timeout=max(0.1, budget_s))
        except subprocess.TimeoutExpired:
            cut = True
            _kill_group(proc)
        reader.join(timeout=5)
        seconds = round(time.monotonic() - t0, 1)
        if cut:
            log.write(
                f"\n== {name}: stopped by its budget after {seconds} s (budget {budget_s} s)\n"
            )
    return {
        "step": name,
        "command": cmd,
        "returncode": proc.returncode,
        "seconds": seconds,
        "budget_s": budget_s,
        "cut": "stopped by its budget (process group killed)" if cut else None,
        "log": log_path.name,
    }


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _skipped(name: str, reason: str, budget_s: float = 0) -> dict:
    print(f"== gpu-check: {name} skipped: {reason}", flush=True)
    return {
        "step": name,
        "command": None,
        "returncode": None,
        "seconds": 0.0,
        "budget_s": budget_s,
        "cut": None,
        "skipped": reason,
    }


# ---------------------------------------------------------------- the run


class Run:
    def __init__(self, out: pathlib.Path, dry_run: bool, budgets: dict, total_s: float):
        self.out = out
        self.dry_run = dry_run
        self.budgets = budgets
        self.total_s = total_s
        self.logs = pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-logs-"))
        self.t0 = time.monotonic()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.pop("OUT", None)  # no child writes into $OUT behind our back
        # The package is not installed there: every step (the chapters' kernels, which run in
        # book/, too) imports it from the repository.
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [self.env.get("PYTHONPATH"), str(ROOT / "kernels")])
        )
        self.summary: dict = {}

    # -- files
    def save(self) -> None:
        _write_json(self.out / "summary.json", self.summary)

    def bundle_logs(self) -> None:
        tmp = self.out / "logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for p in sorted(self.logs.iterdir()):
                tar.add(p, arcname=f"logs/{p.name}")
        tmp.replace(self.out / "logs.tar.gz")

    def bench_json(self) -> pathlib.Path | None:
        found = sorted(
            p
            for p in self.out.glob("*.json")
            if p.name not in ("summary.json", "measured_vs_predicted.json")
            and not p.name.startswith("inspect_")
        )
        return found[-1] if found else None

    # -- steps
    def step(
        self, name: str, cmd: list[str] | None, budget_s: float, skip: str | None = None
    ) -> dict:
        if skip is not None:
            record = _skipped(name, skip, budget_s)
        else:
            self.summary["running"] = {
                "step": name,
                "since": _now(),
                "budget_s": budget_s,
                "log": "running.log",
            }
            self.save()
            print(
                f"== gpu-check: {name} (budget {budget_s:.0f} s): {' '.join(cmd)}",
                flush=True,
            )
            live = self.out / "running.log"
            record = run_step(name, cmd, budget_s, live, self.env)
            shutil.move(
                str(live), self.logs / f"{len(self.summary['steps'])}_{name}.log"
            )
            for tmp in self.out.glob(
                "*.tmp"
            ):  # a file being rewritten when the step was stopped
                tmp.unlink()
            record["log"] = f"logs.tar.gz:logs/{len(self.summary['steps'])}_{name}.log"
            print(
                f"== gpu-check: {name} exited {record['returncode']} after {record['seconds']} s"
                + (f" ({record['cut']})" if record["cut"] else ""),
                flush=True,
            )
        self.summary["running"] = None
        self.summary["steps"].append(record)
        if record.get("cut"):
            self.summary["cut_steps"].append(name)
        self.bundle_logs()
        self.save()
        return record

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.t0)


def _device_summary(dry_run: bool) -> dict:
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
        )
    else:
        info.update(gpu=None, capability=None, sm_count=None)
    import numpy

    info["numpy"] = numpy.__version__
    return info


def _out_dir(args) -> pathlib.Path:
    if args.out:
        return pathlib.Path(args.out)
    if os.environ.get("OUT"):
        return pathlib.Path(os.environ["OUT"])
    if args.dry_run:
        return pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-dry-"))
    return ROOT / "_build" / "gpu-check" / _now().replace(":", "").replace("-", "")


def _budgets(args) -> tuple[dict, float]:
    budgets = dict(BUDGETS)
    total = TOTAL_S
    for item in args.budget or []:
        name, _, value = item.partition("=")
        if name == "total":
            total = float(value)
        elif name in budgets or name == "chapters":
            budgets[name] = float(value)
        else:
            raise SystemExit(
                f"--budget {item!r}: unknown step (choose from {sorted(budgets)}, chapters, total)"
            )
    fixed = sum(v for k, v in budgets.items() if k != "chapters")
    if fixed > total:
        raise SystemExit(
            f"the step budgets add up to {fixed} s, more than the total of {total} s"
        )
    return budgets, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="the same orchestration on a CPU"
    )
    ap.add_argument(
        "--out", help="the results folder (default $OUT, else a new folder)"
    )
    ap.add_argument(
        "--budget",
        action="append",
        metavar="STEP=SECONDS",
        help=f"override a step's budget (defaults {BUDGETS}, total {TOTAL_S})",
    )
    ap.add_argument(
        "--record",
        metavar="DIR",
        help="copy a returned results folder into data/bench/",
    )
    ap.add_argument(
        "--download-wheels",
        action="store_true",
        help="`make gpu-wheels`: the wheels the GPU machine lacks, into .whl/",
    )
    ap.add_argument("--execute-chapters", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.execute_chapters:
        return execute_chapters(pathlib.Path(args.execute_chapters), args.deadline)
    if args.record:
        return record(pathlib.Path(args.record))
    if args.download_wheels:
        return download_wheels()
    try:
        import torch
    except ImportError:
        print(
            f"make gpu-check needs torch, and {sys.executable} has none: nothing was run. "
            "Run it with the Python that has torch: `make gpu-check PYTHON=<that python>`.",
            file=sys.stderr,
        )
        return 2

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "make gpu-check needs a CUDA GPU, and this machine has none (torch.cuda.is_available() is "
            "False): nothing was run. On a CPU, `make test` runs every check that does not need a GPU, "
            "and `python3 tools/gpu_check.py --dry-run` rehearses this command.",
            file=sys.stderr,
        )
        return 2
    budgets, total = _budgets(args)
    out = _out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.dry_run, budgets, total)
    device = _device_summary(args.dry_run)
    run.summary = {
        "dry_run": args.dry_run,
        "date": _now(),
        **device,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": (lambda s: None if s is None else bool(s))(
            _git("status", "--porcelain", "--untracked-files=no")
        ),
        "budgets_s": {**budgets, "total": total},
        "steps": [],
        "cut_steps": [],
        "running": None,
        "complete": False,
        "files": [],
    }
    run.save()
    print(
        f"gpu-check{' (dry run)' if args.dry_run else ''}: {device.get('gpu') or 'no GPU'} · torch "
        f"{device['torch']} · triton {device['triton']} · results in {out}",
        flush=True,
    )

    _wheels(run)
    bench = _bench(run)
    _tests(run)
    _inspect(run, bench, device)
    _chapters(run)

    # A step stopped by its budget is reported as cut, not as failed: its results so far stand.
    failed = [
        s["step"]
        for s in run.summary["steps"]
        if s.get("returncode") not in (0, None) and not s.get("cut")
    ]
    run.summary["failed_steps"] = failed
    run.summary["complete"] = True
    run.summary["seconds"] = round(time.monotonic() - run.t0, 1)
    run.summary["files"] = sorted(p.name for p in out.iterdir())
    run.save()
    run.bundle_logs()
    shutil.rmtree(run.logs, ignore_errors=True)
    files = sorted(out.iterdir())
    assert len(files) <= MAX_OUT_FILES and all(p.is_file() for p in files), files
    print(
        f"gpu-check: {len(files)} files in {out}; {run.summary['seconds']} s"
        + (
            f"; cut: {', '.join(run.summary['cut_steps'])}"
            if run.summary["cut_steps"]
            else ""
        )
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    if not args.dry_run and not args.out and not os.environ.get("OUT"):
        record(out)
    return 1 if failed else 0


# ---------------------------------------------------------------- the steps


def _wheels(run: Run) -> None:
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    budget = run.budgets["wheels"]
    if not wheels:
        run.step(
            "wheels",
            None,
            budget,
            skip=f"no wheels in {WHEELS.name}/ (run `make gpu-wheels` "
            "beforehand): the chapters need them",
        )
        return
    if run.dry_run:
        cmd = [
            sys.executable,
            "-c",
            f"print('dry run: {len(wheels)} wheels in .whl/ are not installed here')",
        ]
        run.step("wheels", cmd, budget)
        return
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(SITE),
        *wheels,
    ]
    if run.step("wheels", cmd, budget)["returncode"] == 0:
        run.env["PYTHONPATH"] = os.pathsep.join([str(SITE), run.env["PYTHONPATH"]])


def _bench(run: Run) -> dict:
    budget = run.budgets["bench"]
    cmd = [
        sys.executable,
        "-m",
        "normbook.lab.bench",
        "--plan",
        "gpu-day",
        "--out",
        str(run.out),
        "--deadline-s",
        str(_soft(budget, "bench")),
    ]
    if run.dry_run:
        cmd.append("--smoke")
    record = run.step("bench", cmd, budget)
    path = run.bench_json()
    data = {}
    if path is not None:
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = {}
    if data and record.get("cut") and not data.get("cut"):
        # Killed between two shapes: the file holds every row so far; say why it stops there.
        data.update(complete=False, cut=record["cut"])
        _write_json(path, data)
    if data:
        record.update(
            rows=len(data.get("results", [])),
            file=path.name,
            complete=data.get("complete", True),
        )
        if data.get("cut") and not record.get("cut"):
            record["cut"] = f"stopped by its budget: {data['cut']}"
            run.summary["cut_steps"].append("bench")
        run.summary["copy_GB/s"] = data.get("copy", {}).get("GB/s")
        run.save()
    return data


def _tests(run: Run) -> None:
    budget = run.budgets["tests"]
    files = DRY_TESTS if run.dry_run else kernel_test_files()
    xml = run.logs / "tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_budget",
        "-rfE",
        f"--junitxml={xml}",
    ]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(2 if run.dry_run else min(12, os.cpu_count() or 1))]
    run.env["GPU_CHECK_DEADLINE"] = str(time.time() + _soft(budget, "tests"))
    env_path = run.env["PYTHONPATH"]
    run.env["PYTHONPATH"] = os.pathsep.join([str(TOOLS), env_path])  # the budget plugin
    record = run.step("tests", cmd + files, budget)
    run.env["PYTHONPATH"] = env_path
    run.env.pop("GPU_CHECK_DEADLINE", None)
    counts = _junit_counts(xml)
    if counts:
        record["tests"] = counts
        run.save()


def _junit_counts(xml: pathlib.Path) -> dict | None:
    if not xml.exists():
        return None
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {
        k: sum(int(s.get(k, 0)) for s in suites)
        for k in ("tests", "failures", "errors", "skipped")
    }
    out["budget_skipped"] = sum(
        1
        for case in root.iter("testcase")
        for sk in case.findall("skipped")
        if "gpu-check budget" in (sk.get("message") or "")
    )
    return out


def _inspect(run: Run, bench: dict, device: dict) -> None:
    budget = run.budgets["inspect"]
    plan = _load_by_path(
        "normbook_bench_plan_for_gpu_check",
        ROOT / "kernels" / "normbook" / "lab" / "bench" / "plan.py",
    )
    per_call: dict[str, list] = {}
    for entry in plan.PLANS["gpu-day"]:
        kernel = entry.case.split(".")[0]
        if (run.dry_run and kernel not in DRY_INSPECT_CALLS) or kernel in NOT_INSPECTED:
            continue
        have = per_call.setdefault(kernel, [])
        have += [s for s in plan.shapes_of(entry, run.dry_run) if s not in have]
    spec = ";".join(
        f"{call}=" + ",".join(f"plan:{m}:{n}" for m, n in sh)
        for call, sh in per_call.items()
    )
    if run.dry_run:
        arch = 90
    else:
        arch = inspector_arch(tuple(int(x) for x in device["capability"].split(".")))
    target = run.out / f"inspect_sm{arch}.json"
    prov = bench.get("provenance", {})
    dtype = prov.get("dtype") or (
        "bfloat16" if run.dry_run or arch >= 80 else "float16"
    )
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    cmd = [
        sys.executable,
        "-m",
        "normbook.lab.inspector",
        "--arch",
        str(arch),
        "--dtypes",
        dtype,
        "--call-shapes",
        spec,
        "--json",
        str(target),
        "--timeout-s",
        str(_soft(budget, "inspect")),
    ]
    if bench.get("copy", {}).get("GB/s") and not run.dry_run:
        cmd += ["--bandwidth-gbps", f"{bench['copy']['GB/s']:.1f}"]
    if device.get("sm_count") and not run.dry_run:
        cmd += ["--sms", str(device["sm_count"]), "--gpu-name", str(device["gpu"])]
    record = run.step("inspect", cmd, budget)
    if target.exists() and run.bench_json() is not None:
        # The inspector's tables, which import nothing of the package's (nor torch)
        inspect = _load_by_path(
            "normbook_inspector_report_for_gpu_check",
            ROOT / "kernels" / "normbook" / "lab" / "inspector" / "report.py",
        )
        table = inspect.measured_vs_predicted(
            json.loads(run.bench_json().read_text()), json.loads(target.read_text())
        )
        _write_json(run.out / "measured_vs_predicted.json", table)
        (run.out / "measured_vs_predicted.md").write_text(
            inspect.comparison_markdown(table) + "\n"
        )
        record["compared_rows"] = len(table["rows"])
        run.save()


def _chapters(run: Run) -> None:
    budget = run.budgets.get("chapters", max(0.0, run.left()))
    missing = [m for m in CHAPTER_MODULES if not _importable(m, run.env)]
    if missing:
        run.step(
            "chapters",
            None,
            budget,
            skip=f"{', '.join(missing)} not importable (carry the wheels: "
            "`make gpu-wheels`)",
        )
        return
    if budget < CHAPTERS_MIN_S:
        run.step(
            "chapters",
            None,
            budget,
            skip=f"only {budget:.0f} s left of the {run.total_s:.0f} s",
        )
        return
    if run.dry_run:
        cmd = [
            sys.executable,
            "-c",
            "print('dry run: the chapters are executed on the GPU only')",
        ]
        run.step("chapters", cmd, budget)
        return
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--execute-chapters",
        str(run.logs),
        "--deadline",
        str(time.time() + _soft(budget, "chapters")),
    ]
    record = run.step("chapters", cmd, budget)
    result = run.logs / "chapters.json"
    if result.exists():
        record["chapters"] = json.loads(result.read_text())
        run.bundle_logs()
        run.save()


def _load_by_path(name: str, path: pathlib.Path):
    """A module of this repository without importing the ``normbook`` package (and torch)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _importable(module: str, env: dict) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    try:
        return (
            subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                cwd=ROOT,
                timeout=60,
                capture_output=True,
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def execute_chapters(folder: pathlib.Path, deadline: float | None) -> int:
    """Child of the chapters step: execute each chapter of _toc.yml in order, until the deadline."""
    import nbformat
    import yaml
    from nbclient import NotebookClient

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [
        c["file"]
        for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}])
        for c in part.get("chapters", [])
    ]
    results = []
    failed = 0
    for f in files:
        path = ROOT / f"{f}.ipynb"
        if not path.exists():
            continue
        if deadline is not None and time.time() > deadline:
            results.append({"chapter": f, "status": "not run: budget"})
            continue
        t0 = time.time()
        nb = nbformat.read(path, as_version=4)
        try:
            NotebookClient(
                nb,
                timeout=300,
                kernel_name="python3",
                resources={"metadata": {"path": str(path.parent)}},
            ).execute()
            status = "ok"
        except Exception as exc:
            plain = re.sub(
                r"\x1b\[[0-9;]*m", "", str(exc)
            )  # the traceback's terminal colours
            status = f"failed: {type(exc).__name__}: {plain[-600:]}"
            failed += 1
        seconds = round(time.time() - t0, 1)
        results.append({"chapter": f, "status": status, "seconds": seconds})
        print(f"chapter {f}: {status.splitlines()[0]} ({seconds} s)", flush=True)
        _write_json(folder / "chapters.json", results)
    _write_json(folder / "chapters.json", results)
    return 1 if failed else 0


# ---------------------------------------------------------------- recording a returned run


def download_wheels() -> int:
    """`make gpu-wheels`: download WHEEL_PACKAGES and their dependencies for CPython 3.12 on
    manylinux x86_64 (the GPU machine), drop what that machine has, keep the rest in .whl/."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--dest",
            tmp,
        ]
        for plat in WHEEL_PLATFORMS:
            cmd += ["--platform", plat]
        print(" ".join(cmd + WHEEL_PACKAGES), flush=True)
        if subprocess.run(cmd + WHEEL_PACKAGES).returncode != 0:
            print("pip download failed: .whl/ left as it was", file=sys.stderr)
            return 1
        WHEELS.mkdir(exist_ok=True)
        for old in WHEELS.glob("*.whl"):
            old.unlink()
        kept, dropped = [], []
        for whl in sorted(pathlib.Path(tmp).glob("*.whl")):
            name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
            if name in GPU_MACHINE_HAS:
                dropped.append(name)
                continue
            shutil.move(str(whl), WHEELS / whl.name)
            kept.append(whl.name)
    mib = sum(p.stat().st_size for p in WHEELS.glob("*.whl")) / 2**20
    print(
        f"{len(kept)} wheels, {mib:.1f} MiB, in {WHEELS.relative_to(ROOT)}/ "
        f"(left out, the GPU machine has them: {', '.join(dropped) or 'none'})"
    )
    for name in kept:
        print(f"  {name}")
    if mib > WHEELS_MAX_MIB:
        print(
            f"warning: more than {WHEELS_MAX_MIB} MiB: the device tool carries 64 MiB per call, "
            "the repository included",
            file=sys.stderr,
        )
    return 0


def record(folder: pathlib.Path) -> int:
    """Copy a GPU run's files into data/bench/: the benchmark's JSON and CSV beside the others
    (where the book reads them), the rest into data/bench/<their stem>/. Refuses dry runs."""
    summary_path = folder / "summary.json"
    if not summary_path.exists():
        print(
            f"{folder} holds no summary.json: not a gpu-check folder", file=sys.stderr
        )
        return 2
    summary = json.loads(summary_path.read_text())
    if summary.get("dry_run") or not summary.get("gpu"):
        print(
            "a dry run measures nothing: data/bench/ holds GPU measurements only",
            file=sys.stderr,
        )
        return 2
    bench = sorted(
        p
        for p in folder.glob("*.json")
        if p.name not in ("summary.json", "measured_vs_predicted.json")
        and not p.name.startswith("inspect_")
    )
    if not bench:
        print(f"{folder} holds no benchmark file", file=sys.stderr)
        return 2
    stem = bench[-1].stem
    side = DATA / stem
    side.mkdir(parents=True, exist_ok=True)
    for p in sorted(folder.iterdir()):
        if p.name.endswith(".tmp") or not p.is_file():
            continue
        dest = DATA if p.stem == stem and p.suffix in (".json", ".csv") else side
        shutil.copy2(p, dest / p.name)
    print(
        f"recorded {stem} into {DATA.relative_to(ROOT)}/ (and {side.relative_to(ROOT)}/)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
