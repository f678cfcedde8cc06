"""tools/gpu_check.py (`make gpu-check`), the one command a lent GPU machine runs.

On a CPU: it refuses with exit 2, having run nothing; `make -n gpu-check` installs nothing; and
its dry run goes through the same steps, budgets and files, under a Python that lacks the
book's packages (nbformat, nbclient, plotly, playwright, jupyter), as the GPU machine does.
The dry run's budgets are cut so that the benchmark is stopped by its budget: the rows it had
measured and a summary.json naming the cut step must still be there.
"""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from normbook import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "tools" / "gpu_check.py"
BLOCKED = (
    "nbformat",
    "nbclient",
    "plotly",
    "playwright",
    "jupyter",
    "jupyter_client",
    "jupyter_core",
    "ipykernel",
    "myst_nb",
    "jupyter_book",
)

# A Python as the GPU machine's: every process it starts (its steps' children too, through
# PYTHONPATH) fails to import the book's packages.
SITECUSTOMIZE = f"""
import sys
BLOCKED = {set(BLOCKED)!r}
class _GPUMachineHasNoSuchPackage:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)",
                                      name=name)
        return None
sys.meta_path.insert(0, _GPUMachineHasNoSuchPackage())
"""


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def blocker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-machine-python")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("OUT", "PYTHONPATH")
    }
    env["PYTHONPATH"] = str(folder)
    probe = subprocess.run(
        [sys.executable, "-c", "import nbformat"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "not on the GPU machine" in probe.stderr
    return env


@pytest.fixture(scope="session")  # one xdist group (conftest.ONE_WORKER_FIXTURES)
def dry_run(blocker, tmp_path_factory):
    """The dry run into $OUT, with the benchmark's budget too small for its smoke plan."""
    out = tmp_path_factory.mktemp("out")
    env = {**blocker, "OUT": str(out)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(GPU_CHECK),
            "--dry-run",
            "--budget",
            "bench=12",
            "--budget",
            "tests=90",
            "--budget",
            "inspect=90",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    return proc, out, time.monotonic() - t0


@pytest.mark.skipif(
    DEVICE.type == "cuda", reason="on a GPU, make gpu-check runs for real"
)
def test_gpu_check_refuses_without_a_gpu():
    before = sorted((ROOT / "data" / "bench").glob("*"))
    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "nothing was run" in proc.stderr
    assert sorted((ROOT / "data" / "bench").glob("*")) == before


@pytest.mark.skipif(
    DEVICE.type == "cuda" or shutil.which("make") is None,
    reason="needs make, and no GPU",
)
def test_make_gpu_check_installs_nothing_and_refuses_on_a_cpu():
    dry = subprocess.run(
        ["make", "-n", "gpu-check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert dry.returncode == 0 and "tools/gpu_check.py" in dry.stdout
    for word in ("pip", "venv", "apt-get", ".installed", "playwright"):
        assert word not in dry.stdout, dry.stdout
    proc = subprocess.run(
        ["make", "gpu-check", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr


def test_make_gpu_wheels_downloads_into_the_ignored_folder():
    dry = subprocess.run(
        ["make", "-n", "gpu-wheels"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert "--download-wheels" in dry.stdout
    gpu_check = _gpu_check()
    assert gpu_check.WHEELS == ROOT / ".whl"
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()
    assert {"nbformat", "nbclient", "ipykernel", "plotly"} <= set(
        gpu_check.WHEEL_PACKAGES
    )
    # Never a second copy of what the machine has: it would shadow the machine's own.
    assert not {"torch", "triton", "numpy"} & set(gpu_check.WHEEL_PACKAGES)


def test_budgets_fit_one_command_and_the_benchmark_comes_first():
    gpu_check = _gpu_check()
    assert sum(gpu_check.BUDGETS.values()) <= gpu_check.TOTAL_S <= 480
    assert list(gpu_check.BUDGETS) == ["wheels", "bench", "tests", "inspect"]
    assert (
        not {pathlib.Path(f).name for f in gpu_check.kernel_test_files()}
        & gpu_check.NOT_KERNEL_TESTS
    )


def test_a_step_past_its_budget_is_killed_with_its_children(tmp_path):
    """The hard stop: the step's whole process group goes, a grandchild included, and what it
    printed before is in its log."""
    gpu_check = _gpu_check()
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); "
        "print('row 1', flush=True); time.sleep(120)"
    )
    t0 = time.monotonic()
    record = gpu_check.run_step(
        "slow",
        [sys.executable, "-c", code],
        3,
        tmp_path / "slow.log",
        env=None,
        echo=None,
    )
    assert time.monotonic() - t0 < 30
    assert record["cut"] and record["budget_s"] == 3 and record["returncode"] != 0
    assert "row 1" in (tmp_path / "slow.log").read_text()
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    assert (
        not pathlib.Path(f"/proc/{grandchild}").exists()
        or "zombie" in pathlib.Path(f"/proc/{grandchild}/status").read_text().lower()
    )


def test_dry_run_under_the_gpu_machines_packages(dry_run):
    proc, out, seconds = dry_run
    summary = json.loads((out / "summary.json").read_text())
    # Exit 0 unless a step failed; only the tests step may, and only as described below.
    assert summary["failed_steps"] in ([], ["tests"]), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    assert proc.returncode == (1 if summary["failed_steps"] else 0), proc.stderr[-3000:]
    files = sorted(out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in files), files
    assert summary["dry_run"] is True and summary["complete"] is True
    steps = summary["steps"]
    assert [s["step"] for s in steps] == [
        "wheels",
        "bench",
        "tests",
        "inspect",
        "chapters",
    ]
    for s in steps:
        assert {"step", "command", "returncode", "seconds", "budget_s"} <= set(s), s
    assert sum(v for k, v in summary["budgets_s"].items() if k != "total") <= 480
    by = {s["step"]: s for s in steps}
    assert "--smoke" in by["bench"]["command"] and "--plan" in by["bench"]["command"]
    # The GPU machine has no nbclient: the chapters are skipped, saying why.
    assert (
        by["chapters"]["returncode"] is None and "nbclient" in by["chapters"]["skipped"]
    )
    counts = by["tests"].get("tests")
    assert (
        counts and counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0
    ), by["tests"]
    assert by["inspect"]["returncode"] == 0 or by["inspect"]["cut"], by["inspect"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
        tests_log = (
            tar.extractfile(next(n for n in names if n.endswith("_tests.log")))
            .read()
            .decode()
        )
    assert any(n.endswith("_bench.log") for n in names) and any(
        n.endswith("tests.xml") for n in names
    )
    # pytest exits 0 where the tests' set-up (conftest.py, scheduling.py) imports the book's
    # packages lazily; one that imports them eagerly ends even a green run in nbformat's
    # ImportError.
    assert (
        by["tests"]["returncode"] == 0 or "No module named 'nbformat'" in tests_log
    ), tests_log[-2000:]


def test_a_step_stopped_by_its_budget_keeps_its_rows(dry_run):
    proc, out, _ = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cut_steps"][:1] == ["bench"], summary["cut_steps"]
    bench = next(s for s in summary["steps"] if s["step"] == "bench")
    assert bench["cut"] and bench["budget_s"] == 12 and bench["seconds"] <= 12 + 10
    data = json.loads((out / bench["file"]).read_text())
    assert data["complete"] is False and data["cut"]
    assert data["provenance"]["smoke"] is True and data["copy"]["GB/s"] > 0
    measured = [r for r in data["results"] if r["status"] == "ok"]
    assert measured and bench["rows"] == len(data["results"])
    assert (out / bench["file"]).with_suffix(".csv").exists()
    # What was kept is compared with the inspector's prediction for the same shapes.
    table = json.loads((out / "measured_vs_predicted.json").read_text())
    assert table["meta"]["smoke"] is True
    assert {r["case"] for r in table["rows"]} <= {
        f"{r['kernel']}.{r['direction']}" for r in measured
    }


def test_a_dry_run_is_never_recorded(dry_run):
    _, out, _ = dry_run
    before = sorted((ROOT / "data" / "bench").glob("*"))
    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--record", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "dry run" in proc.stderr
    assert sorted((ROOT / "data" / "bench").glob("*")) == before


def test_the_gpu_day_plan_measures_every_benchmark_case():
    """A kernel added to normbook.lab.bench.cases but not to the GPU day's plan would come back from
    the only GPU run unmeasured; and every plan kernel the inspector does not lower is named."""
    from normbook.lab import bench
    from normbook.lab.bench import plan

    gpu_check = _gpu_check()
    planned = {e.case for e in plan.PLANS["gpu-day"]}
    assert [c.name for c in bench.CASES if c.name not in planned] == []
    assert gpu_check.NOT_INSPECTED <= {name.split(".")[0] for name in planned}
