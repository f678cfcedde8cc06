"""tools/gpu_check.py (`make gpu-check`), the one command a lent GPU machine runs.

On a CPU: it refuses with exit 2, having run nothing; `make -n gpu-check` installs nothing; and
its dry run goes through the same steps, budgets and files, under a Python that lacks the
book's packages (nbformat, nbclient, plotly, playwright, jupyter), as the GPU machine does.
The dry run's budgets are cut so that the benchmark is stopped by its budget: the rows it had
measured and a summary.json naming the cut step must still be there.

What a run on the GPU machine meets is faked below, each on a tiny budget: a tests step
killed mid-test still has its counts; a test past its limit or the step's deadline is cut,
and pytest then ends by itself; a chapter stopped by the budget is cut, not failed; an
unreadable inspector JSON is the step's error, not the run's end; inspector units past
their deadline are cut, the rest kept; a measured row pairs only with a prediction of the
same work.
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
from normbook.lab.specs import BY_NAME, SPECS

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
    selected = {pathlib.Path(f).name for f in gpu_check.kernel_test_files()}
    kernels = {p.name for p in (ROOT / "tests" / "kernels").glob("test_*.py")}
    assert selected == kernels  # the kernel tests, and only they
    # xdist's scheduling here, not the GPU (and failing under pytest >= 9.2)
    assert "test_workers.py" not in selected and "test_rms_norm.py" in selected


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
        assert s["status"] in ("ok", "cut", "failed", "skipped"), s
    assert summary["cut_steps"] == [s["step"] for s in steps if s["cut"]]
    assert summary["failed_steps"] == [
        s["step"] for s in steps if s["status"] == "failed"
    ]
    assert sum(v for k, v in summary["budgets_s"].items() if k != "total") <= 480
    by = {s["step"]: s for s in steps}
    assert "--smoke" in by["bench"]["command"] and "--plan" in by["bench"]["command"]
    # The GPU machine has no nbclient: the chapters are skipped, saying why.
    assert (
        by["chapters"]["returncode"] is None and "nbclient" in by["chapters"]["skipped"]
    )
    assert by["chapters"]["status"] == "skipped"
    counts = by["tests"].get("tests")
    assert (
        counts and counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0
    ), by["tests"]
    assert counts["source"] == "tests.jsonl" and counts["complete"], counts
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
    assert any(n.endswith("tests.jsonl") for n in names)
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
    # Every measured row of ours is either paired with the same work or said unpaired.
    ours = [r for r in measured if r["provider"] == "normbook"]
    assert len(table["rows"]) + len(table["unpaired"]) == len(ours)
    assert all(r["reason"] for r in table["unpaired"])
    inspect = next(s for s in summary["steps"] if s["step"] == "inspect")
    assert inspect["status"] in ("ok", "cut") and inspect["units"], inspect


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

    planned = {e.case for e in plan.PLANS["gpu-day"]}
    assert [c.name for c in bench.CASES if c.name not in planned] == []
    not_inspected = {s.name for s in SPECS if s.bench and not s.inspected}
    assert not_inspected <= {name.split(".")[0] for name in planned}


# ---------------------------------------------------------------- past the budget
# What the GPU machine's run meets, faked on tiny budgets: a tests step killed mid-test,
# a chapter stopped by the budget, an inspector JSON cut mid-write, an inspector call
# past its deadline, and two builders that make different work of the same (M, N).

FAKE_TESTS = """
import os, pathlib, time, pytest

@pytest.mark.parametrize("i", range(3))
def test_quick(i):
    pass

def test_slow():
    pathlib.Path(os.environ["SLOW_STARTED"]).write_text("")
    time.sleep(120)

@pytest.mark.parametrize("i", range(2))
def test_after(i):
    pass
"""


def _fake_tests(gpu_check, tmp_path, deadline, limit_s, workers=None):
    """The tests step's pytest command and environment, over FAKE_TESTS."""
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    report, xml = tmp_path / "tests.jsonl", tmp_path / "tests.xml"
    cmd = gpu_check.pytest_command([str(tmp_path / "test_fake.py")], xml, workers)
    # pytest alone, not this repository's conftest.py and settings
    cmd += ["-c", "/dev/null", "--rootdir", str(tmp_path)]
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    env = gpu_check.budget_env(env, deadline, limit_s, report)
    env["SLOW_STARTED"] = str(tmp_path / "slow-started")
    return cmd, env, report, xml


def _run_into(gpu_check, out: pathlib.Path, record: dict):
    """A gpu_check Run writing into ``out``, whose last step is ``record``."""
    run = gpu_check.Run(out, True, dict(gpu_check.BUDGETS), gpu_check.TOTAL_S)
    run.summary = {"steps": [record], "cut_steps": [], "failed_steps": []}
    return run


def test_a_tests_step_killed_mid_test_still_has_its_counts(tmp_path):
    """The hard stop lands while a test runs, before pytest writes its JUnit XML: the
    report written as the tests end still counts those that ran."""
    gpu_check = _gpu_check()
    cmd, env, report, xml = _fake_tests(gpu_check, tmp_path, time.time() + 600, 600)
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL
    )
    try:
        t0 = time.monotonic()
        while not (tmp_path / "slow-started").exists():
            assert proc.poll() is None and time.monotonic() - t0 < 120
            time.sleep(0.1)
    finally:
        gpu_check._kill_group(proc)  # the step's hard stop
    assert not xml.exists()
    counts = gpu_check.count_tests(report, xml)
    assert counts["passed"] == counts["tests"] == 3, counts
    assert counts["collected"] == 6 and counts["not_run"] == 3
    assert counts["complete"] is False and counts["failures"] == counts["errors"] == 0
    record = {"step": "tests", "returncode": proc.returncode, "killed": True}
    record["cut"] = "stopped by its budget (process group killed)"
    assert gpu_check.settle(record)["status"] == "cut"


@pytest.mark.parametrize(
    "workers",
    [None, 2] if importlib.util.find_spec("xdist") else [None],
    ids=lambda w: f"xdist-{w}" if w else "no-xdist",
)
def test_a_tests_step_stops_at_its_deadline_and_writes_its_report(tmp_path, workers):
    """Past the deadline the running test is stopped (cut, not failed), no other starts,
    and pytest ends by itself: its JUnit XML is written, and the step is cut."""
    gpu_check = _gpu_check()
    deadline = time.time() + 8
    cmd, env, report, xml = _fake_tests(gpu_check, tmp_path, deadline, 600, workers)
    proc = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert time.time() < deadline + 30
    assert proc.returncode == 2 and xml.exists(), proc.stdout[-2000:]
    counts = gpu_check.count_tests(report, xml)
    assert counts["complete"] and counts["past_deadline"], counts
    assert counts["cut"] >= 1 and counts["failures"] == counts["errors"] == 0
    assert counts["passed"] + counts["cut"] + counts["not_run"] == 6, counts
    record = {"step": "tests", "returncode": 2, "killed": False, "cut": "the budget"}
    assert gpu_check.settle(record, stopped_rc=(2,))["status"] == "cut"
    assert gpu_check.settle(dict(record, cut=None))["status"] == "failed"


def test_a_test_past_its_limit_is_cut_and_the_others_run(tmp_path):
    gpu_check = _gpu_check()
    cmd, env, report, xml = _fake_tests(gpu_check, tmp_path, time.time() + 600, 2)
    proc = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    counts = gpu_check.count_tests(report, xml)
    assert (counts["passed"], counts["cut"], counts["not_run"]) == (5, 1, 0), counts
    # The JUnit XML, where no report was written, says the same.
    report.unlink()
    junit = gpu_check.count_tests(report, xml)
    assert (junit["tests"], junit["cut"], junit["failures"]) == (6, 1, 0), junit


def test_a_truncated_report_line_is_dropped(tmp_path):
    gpu_check = _gpu_check()
    report = tmp_path / "tests.jsonl"
    line = {"test": "t::a", "when": "call", "outcome": "passed", "cut": False}
    report.write_text(json.dumps(line) + '\n{"test": "t::b", "when": "ca')
    counts = gpu_check.count_tests(report)
    assert counts["passed"] == counts["tests"] == 1 and not counts["complete"]


CHAPTER_CHILD = """
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("gpu_check_child", sys.argv[1])
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
folder = pathlib.Path(sys.argv[2])

def execute(path, deadline):  # a chapter that outlasts the budget: b
    if path.stem == "b":
        (folder / "b-started").write_text("")
        time.sleep(120)

sys.exit(gpu_check.execute_chapters(folder, None, sorted(folder.glob("*.ipynb")), execute))
"""


def test_a_chapter_stopped_by_the_hard_stop_is_cut_not_failed(tmp_path):
    gpu_check = _gpu_check()
    for name in "abc":
        (tmp_path / f"{name}.ipynb").write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHAPTER_CHILD, str(GPU_CHECK), str(tmp_path)],
        start_new_session=True,
    )
    try:
        t0 = time.monotonic()
        while not (tmp_path / "b-started").exists():
            assert proc.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.1)
    finally:
        gpu_check._kill_group(proc)  # the step's hard stop: SIGTERM to the group
    record = {"step": "chapters", "returncode": proc.returncode, "killed": True}
    record["cut"] = "stopped by its budget (process group killed)"
    run = _run_into(gpu_check, tmp_path / "out", record)
    (tmp_path / "out").mkdir()
    gpu_check.chapters_results(run, record, tmp_path / "chapters.json")
    assert [(c["chapter"], c["status"], c.get("cut")) for c in record["chapters"]] == [
        ("a", "ok", None),
        ("b", "cut", True),
        ("c", "not run", True),
    ]
    assert record["status"] == "cut" and run.summary["failed_steps"] == []


def test_a_chapter_past_the_deadline_is_cut_and_a_failing_one_failed(tmp_path):
    gpu_check = _gpu_check()
    deadline = time.time() + 1

    def execute(path, deadline_):
        if path.stem == "broken":
            raise RuntimeError("a cell raised")
        time.sleep(max(0.0, deadline_ - time.time()))
        raise TimeoutError("a cell timed out at the deadline")

    books = [tmp_path / "broken.ipynb", tmp_path / "slow.ipynb", tmp_path / "z.ipynb"]
    for p in books:
        p.write_text("{}")
    code = gpu_check.execute_chapters(tmp_path, deadline, books, execute)
    results = json.loads((tmp_path / "chapters.json").read_text())
    assert [(r["chapter"], r["status"][:6]) for r in results] == [
        ("broken", "failed"),
        ("slow", "cut"),
        ("z", "not ru"),
    ]
    assert code == 1
    record = {"step": "chapters", "returncode": 1, "killed": False, "cut": None}
    (tmp_path / "out").mkdir()
    run = _run_into(gpu_check, tmp_path / "out", record)
    gpu_check.chapters_results(run, record, tmp_path / "chapters.json")
    assert record["status"] == "failed" and "broken" in record["failed"]
    assert record["cut"]


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("nbclient", "ipykernel")),
    reason="needs nbclient and ipykernel",
)
def test_a_real_chapter_running_at_the_deadline_is_cut(tmp_path):
    """nbclient and a Jupyter kernel: the cell running at the deadline times out, and
    the chapter is recorded as cut."""
    import nbformat

    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x = 1"),
            nbformat.v4.new_code_cell("import time\ntime.sleep(120)"),
        ]
    )
    path = tmp_path / "slow.ipynb"
    nbformat.write(nb, path)
    proc = subprocess.run(
        [
            sys.executable,
            str(GPU_CHECK),
            "--execute-chapters",
            str(tmp_path),
            "--deadline",
            str(time.time() + 5),
            "--notebooks",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    results = json.loads((tmp_path / "chapters.json").read_text())
    assert [(r["status"], r.get("cut")) for r in results] == [("cut", True)], (
        proc.stdout + proc.stderr
    )
    assert proc.returncode == 0


def _bench_file(rows, smoke=False) -> dict:
    return {
        "provenance": {"dtype": "bfloat16", "gpu": "fake", "smoke": smoke},
        "copy": {"GB/s": 1000.0},
        "results": [
            {
                "provider": "normbook",
                "status": "ok",
                "pct_of_copy": 50.0,
                "ms": 1.0,
                "GB/s": 500.0,
                "regime": "",
                # what the benchmark records: the keywords its spec's call passed
                "params": dict(BY_NAME[r["kernel"]].kwargs),
                **r,
            }
            for r in rows
        ],
    }


def _inspector_row(call, phase, M, N, predicted=0.8):
    return {
        "call": call,
        "phase": phase,
        "M": M,
        "N": N,
        "dtype": "bf16",
        "kernel": f"_{call}_kernel",
        "predicted": predicted,
        "grid": 132,
        "ctas_per_sm": 1,
        "registers": 32,
        "spill_stores": 0,
        "spill_loads": 0,
    }


def test_an_unreadable_inspector_json_is_the_steps_error(tmp_path):
    gpu_check = _gpu_check()
    pairing = gpu_check._lab("pairing")
    bench = _bench_file([dict(kernel="rms_norm", direction="forward", M=1, N=4096)])
    target = tmp_path / "inspect_sm90.json"
    target.write_text(json.dumps({"meta": {}, "rows": [{"call": "rms"}]})[:20])
    record = {"step": "inspect", "returncode": 0, "killed": False, "cut": None}
    run = _run_into(gpu_check, tmp_path, record)
    todo = pairing.units(bench)
    gpu_check.inspect_results(run, record, pairing, bench, target, todo)
    assert record["status"] == "failed" and "unreadable" in record["error"]
    table = json.loads((tmp_path / "measured_vs_predicted.json").read_text())
    assert table["rows"] == [] and len(table["unpaired"]) == 1
    # Killed before it wrote: cut, every unit with it, and still no crash.
    target.unlink()
    record = {"step": "inspect", "returncode": -15, "killed": True, "cut": "killed"}
    gpu_check.inspect_results(run, record, pairing, bench, target, todo)
    assert record["status"] == "cut" and record["units"][0]["status"] == "cut"


def test_inspector_calls_cut_by_the_deadline_are_cut_and_the_rest_kept(tmp_path):
    gpu_check = _gpu_check()
    pairing = gpu_check._lab("pairing")
    bench = _bench_file(
        [
            dict(kernel="attention", direction="forward", M=1024, N=4096),
            dict(kernel="rms_norm", direction="forward", M=1, N=4096),
            dict(kernel="rms_norm", direction="backward", M=1, N=4096),
            dict(kernel="softmax", direction="forward", M=8, N=4096),
        ]
    )
    todo = pairing.units(bench)
    assert todo == [
        ("softmax", 8, 4096),
        ("rms_norm", 1, 4096),
        ("attention", 1024, 4096),
    ]
    units = [
        {"call": c, "M": M, "N": N, "status": "cut" if c == "attention" else "ok"}
        for c, M, N in todo
    ]
    inspected = {
        "meta": {"units": units, "units_not_finished": 1},
        "rows": [
            _inspector_row("softmax", "forward", 8, 4096),
            _inspector_row("rms_norm", "forward", 1, 4096),
            _inspector_row("rms_norm", "backward", 1, 4096),
        ],
    }
    target = tmp_path / "inspect_sm90.json"
    target.write_text(json.dumps(inspected))
    record = {"step": "inspect", "returncode": 0, "killed": False, "cut": None}
    run = _run_into(gpu_check, tmp_path, record)
    gpu_check.inspect_results(run, record, pairing, bench, target, todo)
    assert record["status"] == "cut" and "attention 1024x4096" in record["cut"]
    table = json.loads((tmp_path / "measured_vs_predicted.json").read_text())
    assert sorted(r["case"] for r in table["rows"]) == [
        "rms_norm.backward",
        "rms_norm.forward",
        "softmax.forward",
    ]
    assert [r["case"] for r in table["unpaired"]] == ["attention.forward"]
    assert (
        "Measured, with no prediction"
        in (tmp_path / "measured_vs_predicted.md").read_text()
    )


def test_the_inspector_past_its_deadline_writes_what_it_has(tmp_path):
    """The inspector step's command, with a deadline too short for any compile: its JSON
    is written whole, and names every unit as cut."""
    bench = _bench_file([dict(kernel="rms_norm", direction="forward", M=1, N=256)])
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "kernels")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "normbook.lab.pairing",
            str(tmp_path / "bench.json"),
            "--json",
            str(tmp_path / "inspect.json"),
            "--timeout-s",
            "0.1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "inspect.json").read_text())
    assert result["meta"]["units"] == [
        {"call": "rms_norm", "M": 1, "N": 256, "status": "cut", "rows": 0}
    ]
    assert not list(tmp_path.glob("*.tmp"))


# The public calls both the benchmark and the inspector make, recorded instead of
# launched: every inspected spec with a place on the GPU day.
RECORDED_CALLS = tuple(s.name for s in SPECS if s.inspected and s.plan)


def _recorder(monkeypatch):
    """Replace each of RECORDED_CALLS in normbook by one that records its arguments
    (tensors as shape, dtype and whether they require grad; the rest as given, bound to
    the real signature with its defaults) and returns a differentiable scalar."""
    import inspect as pyinspect

    import torch

    import normbook

    calls = []

    def recorder(real):
        signature = pyinspect.signature(real)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            calls.append(
                {
                    k: (tuple(v.shape), str(v.dtype), v.requires_grad)
                    if isinstance(v, torch.Tensor)
                    else v
                    for k, v in bound.arguments.items()
                    if k != "generator"  # a seed: other draws, the same work
                }
            )
            x = next(
                a
                for a in bound.arguments.values()
                if isinstance(a, torch.Tensor) and a.is_floating_point()
            )
            return x.float().sum()  # (fp8 has no sum on the CPU)

        return call

    for name in RECORDED_CALLS:
        monkeypatch.setattr(normbook, name, recorder(getattr(normbook, name)))
    return calls


def test_a_measured_row_pairs_only_with_the_inspectors_same_work(monkeypatch):
    """normbook.lab.pairing.inspector_work, against both the benchmark's and the
    inspector's calls at every shape of the GPU day's plan (and its smoke shapes):
    where it pairs a benchmark case with an inspector call, the two call the kernel with
    the same tensors (shapes, dtypes, gradients) and arguments. The parameters a row
    records are the ones its call passed."""
    import torch

    from normbook.lab.bench import cases, plan
    from normbook.lab.inspector import launches

    pairing = _gpu_check()._lab("pairing")
    calls = _recorder(monkeypatch)
    by_name = {c.name: c for c in cases.CASES}

    def inspected(call, phase, M, N):
        calls.clear()
        ((_, (forward, backward)),) = launches._calls("plan", M, N, "bf16", {call})
        if phase == "forward":
            forward()
        else:
            next(backward())
        return calls[-1]

    checked = 0
    for entry in plan.PLAN:
        kernel, direction = entry.case.split(".")
        case = by_name[entry.case]
        for M, N in dict.fromkeys(entry.shapes + entry.smoke):
            if kernel not in RECORDED_CALLS:
                work = pairing.inspector_work(kernel, direction, M, N, {})
                assert isinstance(work, str) and "not inspected" in work, work
                continue
            problem = case.build(M, N, torch.bfloat16, torch.device("meta"))
            work = pairing.inspector_work(kernel, direction, M, N, problem.params)
            inputs = [
                t.detach().requires_grad_(i in problem.wrt)
                if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t
                for i, t in enumerate(problem.inputs)
            ]
            calls.clear()
            problem.ours(*inputs)
            measured = calls[-1]
            assert {k: measured[k] for k in problem.params} == problem.params
            where = f"{entry.case} at ({M}, {N})"
            assert work[:2] == (kernel, direction), where
            assert inspected(*work) == measured, f"{where}: {work}"
            checked += 1
    assert checked > 40


def test_measured_vs_predicted_never_pairs_other_work():
    """A row whose call passed other parameters than its spec's (sampling with a
    temperature), or at another shape, or of a kernel the inspector does not lower,
    stays unpaired, even with inspector rows of the same call."""
    pairing = _gpu_check()._lab("pairing")
    V = 151_936
    bench = _bench_file(
        [
            dict(kernel="decode_attention", direction="forward", M=8, N=32768),
            dict(kernel="sample", direction="forward", M=64, N=V),
            dict(kernel="sample", direction="forward", M=1, N=V),
            dict(kernel="rms_norm", direction="forward", M=1, N=4096),
            dict(kernel="rms_norm", direction="forward", M=8, N=4096),
            dict(kernel="linear_cross_entropy", direction="backward", M=8192, N=4096),
        ]
    )
    bench["results"][2]["params"] = {"temperature": 0.8}
    inspected = {
        "meta": {},
        "rows": [
            _inspector_row("decode_attention", "forward", 8, 32768, 0.5),
            _inspector_row("sample", "forward", 64, V, 0.7),
            _inspector_row("sample", "forward", 1, V, 0.7),
            _inspector_row("rms_norm", "forward", 1, 4096, 0.9),
            _inspector_row("rms_norm", "forward", 1, 4096, 0.8),  # a second launch
        ],
    }
    table = pairing.measured_vs_predicted(bench, inspected)
    assert [(r["case"], r["M"], r["N"], r["predicted"]) for r in table["rows"]] == [
        ("decode_attention.forward", 8, 32768, 0.5),
        ("sample.forward", 64, V, 0.7),
        ("rms_norm.forward", 1, 4096, 0.8),
    ]
    unpaired = {(r["case"], r["M"]): r["reason"] for r in table["unpaired"]}
    assert set(unpaired) == {
        ("sample.forward", 1),
        ("rms_norm.forward", 8),
        ("linear_cross_entropy.backward", 8192),
    }
    assert "temperature" in unpaired["sample.forward", 1]
    assert "not inspected" in unpaired["linear_cross_entropy.backward", 8192]
    markdown = pairing.comparison_markdown(table)
    assert "| sample.forward | 1 | 151936 | 50 |" in markdown
