"""`make gpu-check` (or `bash tools/gpu_day.sh`): what a lent CUDA GPU can measure, in one command.

It runs with the machine's own Python (no venv, no pip index, no network), each step under a
wall-clock budget with a hard stop (its process group is killed), in order of value:

0. wheels    install the wheels carried in .whl/ (`make gpu-wheels`) into /tmp/site, no index;
1. bench     `python -m normbook.lab.bench --plan gpu-day`: copy bandwidth, then the headline shapes of
             every kernel against eager PyTorch, then torch.compile (kernels/normbook/lab/bench/plan.py);
2. tests     the kernel tests on the GPU, in parallel (pytest-xdist where installed), not the
             book's or browser's, each under a per-test limit (tools/pytest_budget.py);
3. inspect   `python -m normbook.lab.pairing`: the inspector, for this GPU's architecture, on
             exactly the work the benchmark measured, cheap calls first, and the table of
             measured against predicted fractions of the copy bandwidth (a measured row is
             paired only with a prediction of the same work; the others are listed unpaired);
4. chapters  every chapter executed on the GPU, if the wheels (nbclient, ipykernel, ...) are
             there, in whatever is left of the total budget.

Results are flushed as they are measured: the benchmark rewrites its JSON/CSV after every shape,
the tests append a line per test to their report, each chapter's result is written as it ends,
and summary.json is rewritten when a step starts and when it ends. Every step's record has a
"status": "ok", "failed", "cut" (stopped by its budget: what it had done stands, and "cut" says
what was left) or "skipped"; a result file that cannot be read is an "error" of its step.
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
SOFT_MARGIN_S = {"bench": 20, "tests": 20, "inspect": 15, "chapters": 10}
#: The most seconds one kernel test may take on the GPU (tools/pytest_budget.py stops it
#: there, as cut): a test that long is stuck, and must not take the others' time.
TEST_LIMIT_S = 60

#: The dry run's tests: a few fast ones (the interpreter is no GPU).
DRY_TESTS = ["tests/kernels/test_validate.py"]
#: normbook.lab, whose specs and pairing import only the standard library.
LAB = ROOT / "kernels" / "normbook" / "lab"
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


def _write_text(path: pathlib.Path, text: str) -> None:
    """Replace ``path`` whole (written beside, then renamed): a stop mid-write leaves the
    previous file, or none, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: pathlib.Path, data) -> None:
    _write_text(path, json.dumps(data, indent=1) + "\n")


def _read_json(path: pathlib.Path | None):
    """(data, None), or (None, why) where the file is missing, truncated or not JSON: a
    step's result that cannot be read is that step's error, never the run's end."""
    if path is None:
        return None, "no file"
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"{path.name}: missing"
    except (OSError, ValueError) as exc:
        return None, f"{path.name}: unreadable ({type(exc).__name__}: {str(exc)[:200]})"


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
    names = sorted(p.name for p in (ROOT / "tests" / "kernels").glob("test_*.py"))
    # the most valuable first (pytest-xdist hands out tests roughly in this order): the
    # specs' order
    first = [n for n in _lab("specs").test_files() if n in names]
    return [f"tests/kernels/{n}" for n in first + [n for n in names if n not in first]]


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
        "killed": cut,
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
        "status": "skipped",
    }


def settle(record: dict, stopped_rc: tuple = ()) -> dict:
    """Set the step's "status" from what it reported, and "why" where it is not "ok":
    "skipped"; "failed" (a failure the step reported, in "failed", or an exit status
    other than 0, or an "error": a result file that cannot be read); "cut" (stopped by
    its budget, said in "cut": what it did before stands); else "ok". A failure outranks
    a cut. An exit status is no failure when the step was killed by its hard stop, or
    exited with one of ``stopped_rc`` (how it says that it stopped at its own deadline);
    an error is none when the step was cut (killed before it wrote). Called again as
    the step's results are read, it decides afresh."""
    rc = record.get("returncode")
    exit_failed = (
        rc not in (0, None) and not record.get("killed") and rc not in stopped_rc
    )
    error = record.get("error") if not record.get("cut") else None
    if record.get("skipped"):
        status, why = "skipped", record["skipped"]
    elif record.get("failed") or exit_failed or error:
        status = "failed"
        why = record.get("failed") or error or f"exit status {rc}"
    elif record.get("cut"):
        status, why = "cut", record["cut"]
    else:
        status, why = "ok", None
    record.update(status=status, why=why)
    return record


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
        self.settle(record)
        self.bundle_logs()
        return record

    def settle(self, record: dict, stopped_rc: tuple = ()) -> None:
        """The step's status (:func:`settle`), again once its results are read; the
        summary's lists of cut and failed steps follow, and it is saved."""
        settle(record, stopped_rc)
        steps = self.summary["steps"]
        self.summary["cut_steps"] = [s["step"] for s in steps if s.get("cut")]
        self.summary["failed_steps"] = [
            s["step"] for s in steps if s.get("status") == "failed"
        ]
        self.save()

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
    ap.add_argument("--notebooks", help=argparse.SUPPRESS)  # instead of _toc.yml's
    args = ap.parse_args(argv)
    if args.execute_chapters:
        return execute_chapters(
            pathlib.Path(args.execute_chapters),
            args.deadline,
            args.notebooks.split(",") if args.notebooks else None,
        )
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
        "failed_steps": [],
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

    _guarded(run, "wheels", _wheels, run)
    bench = _guarded(run, "bench", _bench, run) or {}
    _guarded(run, "tests", _tests, run)
    _guarded(run, "inspect", _inspect, run, bench, device)
    _guarded(run, "chapters", _chapters, run)

    # A step stopped by its budget is reported as cut, not as failed: its results so far stand.
    failed = run.summary["failed_steps"]
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


def _guarded(run: Run, name: str, step, *args):
    """``step(*args)``; a fault of gpu_check's own in running step ``name`` or reading its
    results is that step's error, and the run goes on to the next step."""
    try:
        return step(*args)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        steps = run.summary["steps"]
        if not steps or steps[-1]["step"] != name:
            steps.append(_skipped(name, "not run: gpu_check failed before it started"))
            steps[-1]["skipped"] = None
        steps[-1]["error"] = f"gpu_check: {type(exc).__name__}: {str(exc)[:300]}"
        run.summary["running"] = None
        run.settle(steps[-1])
        return None


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
    data, error = _read_json(path)
    if error:
        record["error"] = f"the benchmark's JSON: {error}"
        run.settle(record)
        return {}
    if record.get("cut") and not data.get("cut"):
        # Killed between two shapes: the file holds every row so far; say why it stops there.
        data.update(complete=False, cut=record["cut"])
        _write_json(path, data)
    record.update(
        rows=len(data.get("results", [])),
        file=path.name,
        complete=data.get("complete", True),
    )
    if data.get("cut") and not record.get("cut"):
        record["cut"] = f"stopped by its budget: {data['cut']}"
    run.summary["copy_GB/s"] = data.get("copy", {}).get("GB/s")
    run.settle(record)
    data["file"] = path.name
    return data


def _tests(run: Run) -> None:
    budget = run.budgets["tests"]
    files = DRY_TESTS if run.dry_run else kernel_test_files()
    xml, report = run.logs / "tests.xml", run.logs / "tests.jsonl"
    workers = None
    if importlib.util.find_spec("xdist") is not None:
        workers = 2 if run.dry_run else min(12, os.cpu_count() or 1)
    env = run.env
    run.env = budget_env(
        env, time.time() + _soft(budget, "tests"), TEST_LIMIT_S, report
    )
    try:
        record = run.step("tests", pytest_command(files, xml, workers), budget)
    finally:
        run.env = env
    counts = count_tests(report, xml)
    stopped_rc = ()
    if counts:
        record["tests"] = counts
        if counts["failures"] or counts["errors"]:
            record["failed"] = (
                f"{counts['failures']} tests failed, {counts['errors']} errors"
            )
        left = counts["cut"] + counts.get("not_run", 0)
        if left and not record.get("cut"):
            record["cut"] = (
                f"stopped by its budget: {counts['cut']} tests cut, "
                f"{counts.get('not_run', 0)} not run"
            )
        if counts.get("past_deadline"):
            stopped_rc = (2,)  # pytest's "interrupted": the plugin stopped the session
    run.settle(record, stopped_rc)


def pytest_command(files: list[str], xml: pathlib.Path, workers: int | None) -> list:
    """The tests step's pytest: quiet, no cache, tools/pytest_budget.py loaded, failures
    and errors listed, JUnit XML to ``xml``; ``workers`` pytest-xdist workers (None: no
    xdist)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "pytest_budget", "-rfE", f"--junitxml={xml}"]
    if workers:
        cmd += ["-n", str(workers)]
    return cmd + list(files)


def budget_env(
    env: dict, deadline: float, limit_s: float, report: pathlib.Path
) -> dict:
    """``env`` with what tools/pytest_budget.py reads, and tools/ on PYTHONPATH (the
    plugin's home)."""
    return {
        **env,
        "GPU_CHECK_DEADLINE": str(deadline),
        "GPU_CHECK_TEST_LIMIT_S": str(limit_s),
        "GPU_CHECK_TESTS_JSONL": str(report),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(TOOLS), env.get("PYTHONPATH")])
        ),
    }


def count_tests(report: pathlib.Path, xml: pathlib.Path | None = None) -> dict | None:
    """The tests step's counts: from the report tools/pytest_budget.py writes as it goes
    (whatever a kill left of it), else from pytest's JUnit XML (written at the end), else
    None. ``cut``: tests stopped by the per-test limit or the deadline (reported skipped,
    they did not fail); ``not_run``: collected, never reported; ``complete``: pytest
    ended by itself."""
    if report.exists():
        lines = []
        for text in report.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(text))
            except ValueError:  # the line being written when the step was killed
                continue
        collected = [x["tests"] for x in lines if x.get("event") == "collected"]
        finished = [x for x in lines if x.get("event") == "finished"]
        results = [x for x in lines if "test" in x]
        counts = {
            "tests": len({x["test"] for x in results}),
            "passed": sum(
                x["when"] == "call" and x["outcome"] == "passed" for x in results
            ),
            "failures": sum(
                x["when"] == "call" and x["outcome"] == "failed" for x in results
            ),
            "errors": sum(
                x["when"] != "call" and x["outcome"] == "failed" for x in results
            ),
            "skipped": sum(x["outcome"] == "skipped" and not x["cut"] for x in results),
            "cut": sum(bool(x["cut"]) for x in results),
            "complete": bool(finished),
            "source": report.name,
        }
        if collected:
            counts["collected"] = collected[-1]
            counts["not_run"] = max(0, collected[-1] - counts["tests"])
        if finished:
            counts["exitstatus"] = finished[-1].get("exitstatus")
            counts["past_deadline"] = bool(finished[-1].get("past_deadline"))
        return counts
    if xml is None or not xml.exists():
        return None
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {
        k: sum(int(s.get(k, 0)) for s in suites)
        for k in ("tests", "failures", "errors", "skipped")
    }
    counts["cut"] = sum(
        1
        for case in root.iter("testcase")
        for sk in case.findall("skipped")
        if "gpu-check budget" in (sk.get("message") or "")
    )
    counts["skipped"] -= counts["cut"]
    counts.update(complete=True, source=xml.name)
    return counts


def _inspect(run: Run, bench: dict, device: dict) -> None:
    budget = run.budgets["inspect"]
    pairing = _lab("pairing")
    # the dry run: one kernel's variants (the first compile takes seconds each here)
    calls = (_lab("specs").SPECS[0].name,) if run.dry_run else None
    todo = pairing.units(bench, calls)
    if not todo:
        run.step(
            "inspect",
            None,
            budget,
            skip="no measured row pairs with an inspector call"
            if bench.get("results")
            else "the benchmark measured nothing",
        )
        _compare(run, pairing, bench, {})
        return
    if run.dry_run:
        arch = 90
    else:
        arch = inspector_arch(tuple(int(x) for x in device["capability"].split(".")))
    target = run.out / f"inspect_sm{arch}.json"
    # The exact work the benchmark measured: its own JSON, rows and parameters.
    cmd = [
        sys.executable,
        "-m",
        "normbook.lab.pairing",
        str(run.out / bench["file"]),
        "--arch",
        str(arch),
        "--json",
        str(target),
        "--timeout-s",
        str(_soft(budget, "inspect")),
    ]
    if calls:
        cmd += ["--calls", ",".join(calls)]
    if bench.get("copy", {}).get("GB/s") and not run.dry_run:
        cmd += ["--bandwidth-gbps", f"{bench['copy']['GB/s']:.1f}"]
    if device.get("sm_count") and not run.dry_run:
        cmd += ["--sms", str(device["sm_count"]), "--gpu-name", str(device["gpu"])]
    record = run.step("inspect", cmd, budget)
    inspect_results(run, record, pairing, bench, target, todo)


def inspect_results(run: Run, record: dict, pairing, bench: dict, target, todo) -> None:
    """Read the inspector's JSON (an unreadable one is the step's error), say which of
    the units ``todo`` ran and which were cut, and write the table of measured against
    predicted."""
    inspected, error = _read_json(target)
    if error:
        record["error"] = f"the inspector's JSON: {error}"
        inspected = {}
    units = inspected.get("meta", {}).get("units")
    if units is None:  # killed before it wrote (every unit cut), or a broken file
        status = "cut" if record.get("cut") else "unknown"
        units = [{"call": c, "M": M, "N": N, "status": status} for c, M, N in todo]
    record["units"] = units
    cut = [u for u in units if u["status"] == "cut"]
    if cut and not record.get("cut"):
        record["cut"] = (
            f"stopped by its budget: {len(cut)} of {len(units)} units not inspected ("
            + ", ".join(f"{u['call']} {u['M']}x{u['N']}" for u in cut)
            + ")"
        )
    _compare(run, pairing, bench, inspected, record)
    run.settle(record)


def _compare(run: Run, pairing, bench: dict, inspected: dict, record=None) -> None:
    """measured_vs_predicted.json and .md: every measured row, paired or not."""
    if not any(True for _ in pairing.measured_rows(bench)):
        return
    table = pairing.measured_vs_predicted(bench, inspected)
    _write_json(run.out / "measured_vs_predicted.json", table)
    _write_text(
        run.out / "measured_vs_predicted.md", pairing.comparison_markdown(table) + "\n"
    )
    if record is not None:
        record.update(compared_rows=len(table["rows"]), unpaired=len(table["unpaired"]))


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
    chapters_results(run, record, run.logs / "chapters.json")


def chapters_results(run: Run, record: dict, path: pathlib.Path) -> None:
    """Each chapter's result (chapters.json, written by the child as each ends): a chapter
    that failed makes the step failed; one cut or not run (the budget) makes it cut."""
    results, error = _read_json(path)
    if error:
        if not record.get("cut"):
            record["error"] = f"the chapters' results: {error}"
        run.settle(record)
        return
    record["chapters"] = results
    failed = [r["chapter"] for r in results if r.get("status", "").startswith("failed")]
    cut = [r["chapter"] for r in results if r.get("cut")]
    if failed:
        record["failed"] = f"{len(failed)} chapters failed: {', '.join(failed)}"
    if cut and not record.get("cut"):
        record["cut"] = f"stopped by its budget: {len(cut)} chapters cut or not run"
    run.bundle_logs()
    run.settle(record)


def _lab(module: str):
    """A module of normbook.lab that imports only the standard library (``specs``,
    ``pairing``), without the ``normbook`` package (and torch): the lab's folder loaded
    as a package of its own."""
    name = "normbook_lab_for_gpu_check"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, LAB / "__init__.py", submodule_search_locations=[str(LAB)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.{module}")


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


def execute_chapters(
    folder: pathlib.Path, deadline: float | None, notebooks=None, execute=None
) -> int:
    """Child of the chapters step: execute each chapter of _toc.yml (or ``notebooks``) in
    order, until the deadline. folder/chapters.json is rewritten as each chapter ends,
    one entry each: status "ok", "failed: <error>", "cut" (stopped by the deadline or by
    the step's hard stop: not a failure of the chapter) or "not run" (no time left);
    cut and not run say "cut": true. ``execute(path, deadline)``: runs one notebook
    (default: nbclient, no cell past the deadline)."""
    if notebooks is None:
        import chapters  # tools/chapters.py: the book's one table-of-contents reader

        notebooks = chapters.notebooks(ROOT)
    notebooks = [pathlib.Path(p) for p in notebooks if pathlib.Path(p).exists()]
    execute = execute or _execute_notebook
    results: list[dict] = []
    running: dict = {}

    def name(path: pathlib.Path) -> str:
        try:
            return str(path.relative_to(ROOT).with_suffix(""))
        except ValueError:
            return path.stem

    def on_term(signum, frame):
        # The step's hard stop signals the whole group: the chapter's kernel dies of it
        # too, and nbclient would report that as the chapter's error. It is a cut.
        done = list(results)
        if running:
            seconds = round(time.time() - running["t0"], 1)
            done.append(
                {
                    "chapter": running["chapter"],
                    "status": "cut",
                    "cut": True,
                    "why": "the step's hard stop",
                    "seconds": seconds,
                }
            )
        done += [
            {"chapter": name(p), "status": "not run", "cut": True}
            for p in notebooks[len(done) :]
        ]
        _write_json(folder / "chapters.json", done)
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    failed = 0
    try:
        for path in notebooks:
            entry = {"chapter": name(path)}
            if deadline is not None and time.time() > deadline:
                results.append({**entry, "status": "not run", "cut": True})
                _write_json(folder / "chapters.json", results)
                continue
            t0 = time.time()
            running.update(chapter=entry["chapter"], t0=t0)
            try:
                execute(path, deadline)
                entry["status"] = "ok"
            except Exception as exc:
                if deadline is not None and time.time() >= deadline:
                    entry.update(status="cut", cut=True, why="the deadline")
                else:
                    plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # terminal colours
                    entry["status"] = f"failed: {type(exc).__name__}: {plain[-600:]}"
                    failed += 1
            running.clear()
            entry["seconds"] = round(time.time() - t0, 1)
            results.append(entry)
            print(
                f"chapter {entry['chapter']}: {entry['status'].splitlines()[0]} "
                f"({entry['seconds']} s)",
                flush=True,
            )
            _write_json(folder / "chapters.json", results)
        _write_json(folder / "chapters.json", results)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if failed else 0


def _execute_notebook(path: pathlib.Path, deadline: float | None) -> None:
    import nbformat
    from nbclient import NotebookClient

    def timeout(cell) -> float:
        # 300 s a cell, and no later than the deadline: a cell running then times out,
        # and the chapter is recorded as cut.
        left = 300.0 if deadline is None else min(300.0, deadline - time.time())
        return max(1.0, left)

    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        timeout=300,
        timeout_func=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()


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
    summary, error = _read_json(summary_path)
    if error:
        print(f"{folder}: {error}", file=sys.stderr)
        return 2
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
