"""normbook.lab.bench: the smoke run exercises the benchmark's whole code path on tiny shapes.

On a CPU the smoke run times with the wall clock in Triton's interpreter; these tests check the
machinery (cases, providers, bytes, checks, files, provenance), never the numbers' size.
"""

import csv
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from normbook import DEVICE
from normbook.lab import bench, kernel_spec, specs, timing
from normbook.lab.specs import BY_NAME

FIELDS = [
    "gpu",
    "device",
    "torch",
    "triton",
    "dtype",
    "date",
    "command",
    "git_commit",
    "timer",
    "smoke",
]


@pytest.fixture(scope="session")  # one xdist group (conftest.ONE_WORKER_FIXTURES)
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    lines = []
    result = bench.main(["--smoke", "--out", str(out)], log=lines.append)
    return result, out, lines


def test_smoke_run_writes_json_and_csv_with_provenance(smoke):
    result, out, lines = smoke
    assert result["json"].parent == out and result["csv"].parent == out
    data = json.loads(result["json"].read_text())
    prov = data["provenance"]
    for key in FIELDS:
        assert key in prov, key
    assert prov["smoke"] is True and prov["torch"] == torch.__version__
    assert prov["command"].startswith("python -m normbook.lab.bench --smoke")
    assert data["copy"]["bytes"] == 2 * 2**20 and data["copy"]["GB/s"] > 0
    with result["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data["results"]) > 0
    assert set(bench.CSV_FIELDS) <= set(rows[0])
    assert all(r["gpu"] == prov["gpu"] and r["date"] == prov["date"] for r in rows)
    assert any("wrote" in line for line in lines)


def test_smoke_run_covers_every_case_and_provider(smoke):
    result, _, _ = smoke
    rows = result["results"]
    for case in bench.CASES:
        mine = [
            r
            for r in rows
            if (r["kernel"], r["direction"]) == (case.kernel, case.direction)
        ]
        assert mine, f"{case.name} missing from the results"
        if mine[0]["provider"] == "all":
            assert mine[0]["status"] == "skipped" and mine[0]["note"]
            continue
        assert {r["provider"] for r in mine} == set(bench.PROVIDERS)
        own = case.shapes(True) if case.shapes else None
        if own is not None:  # a case with its own shapes (decode_attention: M, cache)
            assert {(r["M"], r["N"], r["regime"]) for r in mine} == set(own)
        else:
            assert {r["N"] for r in mine} == (
                set(bench.SMOKE_SWEEP) | {n for _, n in bench.SMOKE_DECODE}
            )
            assert {r["regime"] for r in mine} == {"sweep", "decode"}
            assert {(r["M"], r["N"]) for r in mine if r["regime"] == "decode"} == set(
                bench.SMOKE_DECODE
            )
        for r in mine:
            assert r["status"] in ("ok", "skipped", "error")
            if r["provider"] in ("normbook", "torch eager"):
                assert r["status"] == "ok", r
                assert r["check"] == "ok", r
                assert r["ms"] > 0 and r["GB/s"] > 0 and r["pct_of_copy"] > 0


def test_smoke_run_times_the_existing_kernels(smoke):
    ok = {
        (r["kernel"], r["direction"])
        for r in smoke[0]["results"]
        if r["provider"] == "normbook" and r["status"] == "ok"
    }
    assert ("rms_norm", "forward") in ok and ("fused_add_rms_norm", "forward") in ok


def _problem_of(name, M, N, dt, direction="forward"):
    return bench.problem(BY_NAME[name], direction, M, N, dt, DEVICE)


def test_bytes_are_the_tensor_sizes():
    """The model: every tensor that must be read or written, once. Written out by hand here."""
    M, N, s = 8, 256, 2
    dt = torch.bfloat16
    assert _problem_of("rms_norm", M, N, dt).nbytes == 2 * M * N * s + N * s  # x, y; w
    fused = _problem_of("fused_add_rms_norm", M, N, dt)
    assert fused.nbytes == 4 * M * N * s + N * s  # x, r, y, h; w
    back = _problem_of("rms_norm", M, N, dt, "backward")
    assert back.nbytes == 3 * M * N * s + 2 * N * s  # x, dy, dx; w, dw
    qk = _problem_of("qk_norm_rope", M, 1024, dt)
    hq, hk, d = 8, 2, specs.HEAD_DIM
    # q, k in and out; weights; cos, sin
    assert qk.nbytes == 2 * M * (hq + hk) * d * s + 2 * d * s + 2 * M * d * s


def test_a_case_that_cannot_run_here_is_reported_once_as_skipped():
    def build(M, N, dtype, device):
        raise bench.Skip("needs a package that is not installed")

    cases = [bench.Case("no_such_kernel", "forward", build)]
    rows = bench.run(
        cases,
        [256, 512],
        elements=512,
        dtype=torch.float32,
        providers=bench.PROVIDERS,
        timer=bench.wall_time_ms,
        copy_gbps=1.0,
        compile_ok=False,
        log=lambda *_: None,
    )
    assert [r["status"] for r in rows] == ["skipped"]  # one row per case, not per size
    assert "not installed" in rows[0]["note"]


def _problem(ours):
    x, w = torch.randn(4, 64, device=DEVICE), torch.randn(64, device=DEVICE)
    return bench.Problem(
        (x, w),
        timing.bytes_moved(x, w, x),
        ours,
        bench.torch_rms_norm,
        liger=lambda x, w: 1 / 0,
    )


def test_a_failing_or_wrong_provider_does_not_stop_the_run():
    case = bench.Case("rms_norm", "forward", lambda *a: None)
    wrong = lambda x, w: bench.torch_rms_norm(x, w) * 1.5  # noqa: E731
    rows = bench.run_problem(
        case,
        _problem(wrong),
        4,
        64,
        ["normbook", "torch eager", "liger"],
        bench.wall_time_ms,
        1.0,
        torch.float32,
        compile_ok=False,
    )
    by = {r["provider"]: r for r in rows}
    assert by["normbook"]["check"].startswith("MISMATCH")
    assert by["torch eager"]["check"] == "ok"
    assert (
        by["liger"]["status"] == "error" and "ZeroDivisionError" in by["liger"]["note"]
    )


def test_an_in_place_call_is_checked_on_what_it_alone_wrote(monkeypatch):
    """reshape_and_cache writes its caches in place: the providers share the inputs
    they are timed on, so each is checked on fresh copies of the pristine caches. A
    kernel that forgets a token mismatches; eager PyTorch, run after it on the caches
    it wrote into, is still right."""
    import sys

    module = sys.modules["normbook.reshape_and_cache"]
    real = module._forward

    def forgets_the_last_token(key, value, key_cache, value_cache, slots):
        real(key[:-1], value[:-1], key_cache, value_cache, slots[:-1])

    monkeypatch.setattr(module, "_forward", forgets_the_last_token)
    (case,) = [c for c in bench.CASES if c.kernel == "reshape_and_cache"]
    problem = case.build(16, 256, torch.float32, DEVICE)
    rows = bench.run_problem(
        case, problem, 16, 256, ["normbook", "torch eager"], bench.wall_time_ms,
        1.0, torch.float32, compile_ok=False,
    )  # fmt: skip
    by = {r["provider"]: r for r in rows}
    assert by["normbook"]["check"].startswith("MISMATCH")
    assert by["torch eager"]["check"] == "ok"


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the full run is allowed")
def test_full_run_without_a_gpu_is_refused_and_writes_nothing():
    before = sorted(bench.DATA_DIR.glob("*")) if bench.DATA_DIR.is_dir() else []
    with pytest.raises(SystemExit, match="No CUDA GPU"):
        bench.main([], log=lambda *_: None)
    after = sorted(bench.DATA_DIR.glob("*")) if bench.DATA_DIR.is_dir() else []
    assert before == after


def test_smoke_never_writes_into_the_data_folder():
    with pytest.raises(SystemExit, match="never writes"):
        bench.main(["--smoke", "--out", str(bench.DATA_DIR)], log=lambda *_: None)


def test_bad_options_are_refused(monkeypatch, tmp_path):
    """... before anything is made: a refused smoke run leaves no folder behind."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit, match="unknown case"):
        bench.main(["--smoke", "--cases", "nope.forward"], log=lambda *_: None)
    with pytest.raises(SystemExit, match="unknown provider"):
        bench.main(["--smoke", "--providers", "cublas"], log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_loader_ignores_smoke_runs_and_reads_gpu_runs(smoke, tmp_path):
    """A smoke file is never a result. A file that looks like a GPU run (made here, in a temporary
    folder, from the smoke run's rows) goes through the chapter's loader, summary and plot."""
    result, out, _ = smoke
    assert bench.load_runs(out) == []
    data = json.loads(result["json"].read_text())
    data["provenance"].update(
        smoke=False,
        interpreter=False,
        device="cuda:0",
        timer=bench.DO_BENCH,
        gpu="test double",
    )
    (tmp_path / "run.json").write_text(json.dumps(data))
    runs = bench.load_runs(tmp_path)
    assert len(runs) == 1 and "test double" in bench.label(runs[0])
    table = bench.summary(runs[0])
    assert {(t["kernel"], t["provider"]) for t in table} >= {
        ("rms_norm", "normbook"),
        ("rms_norm", "torch eager"),
    }
    import matplotlib

    matplotlib.use("Agg")
    fig = bench.plot_run(runs[0])
    assert fig.axes and "test double" in fig._suptitle.get_text()


def test_recorded_results_carry_their_provenance():
    """Every file in data/bench/ comes from a full GPU run and says which GPU, versions and date."""
    for path in sorted(bench.DATA_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        prov = data["provenance"]
        assert prov["smoke"] is False and str(prov["device"]).startswith("cuda"), (
            path.name
        )
        for key in FIELDS:
            assert prov.get(key) not in (None, ""), f"{path.name}: {key}"
        assert path.with_suffix(".csv").exists(), f"{path.name} has no CSV twin"
    assert (bench.DATA_DIR / "README.md").exists()


def test_command_line_entry_point(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "normbook.lab.bench",
            "--smoke",
            "--out",
            str(tmp_path),
            "--cases",
            "fused_add_rms_norm.forward",
            "--sizes",
            "256",
            "--providers",
            "normbook,torch eager",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(bench.ROOT),
    )
    assert proc.returncode == 0, proc.stderr
    assert "fused_add_rms_norm.forward" in proc.stdout
    assert (
        len(list(tmp_path.glob("*_smoke.json"))) == 1
        and len(list(tmp_path.glob("*_smoke.csv"))) == 1
    )


def test_smoke_run_records_no_errors(smoke):
    result, _, _ = smoke
    assert result["errors"] == [] and result["failed"] is False
    assert json.loads(result["json"].read_text())["errors"] == []


def test_a_failing_row_is_reported_loudly(monkeypatch, tmp_path, capsys):
    """A provider that raises is not a quiet "error" cell: it is printed on stderr, listed in the
    JSON's "errors" section, and the command's exit status is 1."""

    def broken(x, w):
        raise RuntimeError("kernel exploded")

    def build(M, N, dtype, device):
        x, w = (
            torch.randn(M, N, device=device, dtype=dtype),
            torch.randn(N, device=device, dtype=dtype),
        )
        return bench.Problem(
            (x, w), timing.bytes_moved(x, w, x), broken, bench.torch_rms_norm
        )

    monkeypatch.setattr(bench.runner, "CASES", [bench.Case("broken", "forward", build)])
    argv = [
        "--smoke",
        "--out",
        str(tmp_path),
        "--sizes",
        "256",
        "--no-decode",
        "--providers",
        "normbook,torch eager",
    ]
    result = bench.main(argv, log=lambda *_: None)
    err = capsys.readouterr().err
    assert (
        "normbook.lab.bench ERROR" in err
        and "kernel exploded" in err
        and "1 row(s) failed" in err
    )
    assert result["failed"] is True
    assert [
        r["provider"] for r in json.loads(result["json"].read_text())["errors"]
    ] == ["normbook"]
    monkeypatch.setattr(sys, "argv", ["normbook.lab.bench", *argv])
    assert bench.cli() == 1


def test_only_liger_failing_does_not_fail_the_run():
    rows = [
        {"provider": "liger", "status": "error", "check": ""},
        {"provider": "normbook", "status": "ok", "check": "ok"},
    ]
    assert bench.errors_of(rows) == rows[:1] and bench.failing(rows[:1]) == []
    mismatch = {
        "provider": "normbook",
        "status": "ok",
        "check": "MISMATCH (max error 0.5)",
    }
    assert bench.failing(bench.errors_of([mismatch])) == [mismatch]


def test_compiled_backward_is_timed_again_and_again(monkeypatch):
    """torch.compile's backward is timed on one graph (retain_graph) like every provider: with
    AOTAutograd's donated buffers turned off for it (torch >= 2.6 refuses retain_graph on a graph
    whose saved tensors were donated). "aot_eager": the same AOTAutograd, without a C++ compiler."""
    monkeypatch.setattr(bench.runner, "COMPILE_BACKEND", "aot_eager")
    problem = _problem_of("rms_norm", 4, 256, torch.float32, "backward")
    case = bench.Case("rms_norm", "backward", lambda *a: problem)
    calls = []

    def timer(fn):
        for _ in range(3):  # three backward passes on the same graph
            fn()
        calls.append(torch._functorch.config.donated_buffer)
        return 1.0

    rows = bench.run_problem(
        case,
        problem,
        4,
        256,
        ["torch.compile"],
        timer,
        1.0,
        torch.float32,
        compile_ok=True,
    )
    assert rows[0]["status"] == "ok" and rows[0]["check"] == "ok", rows[0]
    assert calls == [False]
    assert (
        torch._functorch.config.donated_buffer is True
    )  # restored after the provider ran


def test_compile_sizes_limits_where_torch_compile_is_timed(monkeypatch):
    problem_calls = []

    def build(M, N, dtype, device):
        problem_calls.append(N)
        return _problem(lambda x, w: bench.torch_rms_norm(x, w))

    monkeypatch.setattr(
        bench.runner,
        "run_problem",
        lambda case, problem, M, N, providers, timer, copy, dtype, compile_ok: [
            bench.runner._row(
                case,
                "torch.compile",
                M=M,
                N=N,
                ms=1.0,
                **{"GB/s": 1.0},
                status="ok" if compile_ok else "skipped",
            )
        ],
    )
    rows = bench.run(
        [bench.Case("x", "forward", build)],
        [256, 512],
        elements=512,
        dtype=torch.float32,
        providers=["torch.compile"],
        timer=None,
        copy_gbps=1.0,
        compile_ok=True,
        log=lambda *_: None,
        decode=[(1, 256)],
        compile_sizes={512},
    )
    assert [(r["N"], r["regime"], r["status"]) for r in rows] == [
        (256, "sweep", "skipped"),
        (512, "sweep", "ok"),
        (256, "decode", "skipped"),
    ]


# ---------------------------------------------------------------- a recorded run in the book

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "recorded_run"


def test_recorded_run_fixture_reads_like_a_gpu_run():
    """tests/lab/fixtures/recorded_run/ is laid out as `tools/gpu_check.py --record` lays out
    data/bench/: the benchmark's JSON and CSV, and beside them a folder of the same name with
    the measured-against-predicted table. Its GPU is named as a fixture."""
    runs = bench.load_runs(FIXTURE)
    assert len(runs) == 1
    run = runs[0]
    label = bench.label(run)
    for text in (
        "Test double GPU",
        "torch 2.11.0+cu130",
        "triton 3.6.0",
        "CUDA 13.0",
        "2026-01-02",
    ):
        assert text in label, (text, label)
    table = bench.comparison(run)
    assert table is not None and table["meta"]["same_denominator"] is True
    assert {r["case"] for r in table["rows"]} == {
        "rms_norm.forward",
        "rms_norm.backward",
    }


def test_timing_cells_show_a_recorded_run_on_a_cpu(monkeypatch, capsys):
    """Every chapter's timing cell calls normbook.lab.timing.compare: on a CPU it says that nothing
    is timed here, then shows what the recorded GPU run measured for the kernels the cell's
    candidates call, with the GPU, versions, date and the prediction beside each figure."""
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU the cell measures live")
    import normbook

    monkeypatch.setattr(bench.report, "DATA_DIR", FIXTURE)
    x = torch.randn(4, 256, device=DEVICE, requires_grad=True)
    w = torch.randn(256, device=DEVICE)
    assert timing.compare({"ours": lambda: normbook.rms_norm(x, w)}, 1) is None
    out = capsys.readouterr().out
    assert timing.CPU_NOTE in out
    for text in (
        "Test double GPU",
        "2026-01-02",
        "torch 2.11.0+cu130",
        "triton 3.6.0",
        "CUDA 13.0",
        "recorded in tests/lab/fixtures/recorded_run/",
    ):
        assert text in out, (text, out)
    forward = [line for line in out.splitlines() if line.startswith("rms_norm.forward")]
    assert len(forward) == 2 and not any(
        line.startswith("rms_norm.backward") for line in out.splitlines()
    )
    # measured % of copy and predicted %, as recorded (fixture: 91% measured, 97% predicted)
    assert "91.0%" in forward[0] and "97%" in forward[0], forward[0]
    # A cell that differentiates shows the backward too; one that calls no benchmarked kernel,
    # nothing recorded.
    timing.compare(
        {"fwd+bwd": lambda: torch.autograd.grad(normbook.rms_norm(x, w), x, x)}, 1
    )
    assert "rms_norm.backward" in capsys.readouterr().out
    timing.compare({"other": lambda: normbook.row_variance(x.detach())}, 1)
    assert "Measured on" not in capsys.readouterr().out


def test_no_recorded_run_shows_no_gpu_figure(monkeypatch, capsys, tmp_path):
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU the cell measures live")
    import normbook

    monkeypatch.setattr(bench.report, "DATA_DIR", tmp_path)
    x, w = torch.randn(4, 256, device=DEVICE), torch.randn(256, device=DEVICE)
    timing.compare({"ours": lambda: normbook.rms_norm(x, w)}, 1)
    assert capsys.readouterr().out.strip() == timing.CPU_NOTE


def test_plan_run_keeps_its_rows_when_stopped(tmp_path):
    """--plan with a deadline already past measures the copy, then stops before the first
    shape: the JSON and CSV are there, marked incomplete, naming where it stopped."""
    result = bench.main(
        ["--smoke", "--plan", "gpu-day", "--out", str(tmp_path), "--deadline-s", "0"],
        log=lambda *_: None,
    )
    assert result["cut"] and "budget reached before rms_norm.forward" in result["cut"]
    data = json.loads(result["json"].read_text())
    assert (
        data["complete"] is False
        and data["cut"] == result["cut"]
        and data["results"] == []
    )
    assert data["copy"]["GB/s"] > 0 and data["provenance"]["plan"] == "gpu-day"
    assert result["csv"].exists() and not list(tmp_path.glob("*.tmp"))


def test_every_plan_entry_is_a_case_and_the_plan_fits_the_gpu_day():
    from normbook.lab.bench import plan

    names = {c.name for c in bench.CASES}
    assert [e.case for e in plan.PLAN if e.case not in names] == []
    assert plan.PLAN[0].case == "rms_norm.forward"  # the headline first
    for e in plan.PLAN:
        assert e.shapes and e.smoke and all(i < len(e.shapes) for i in e.compile_at), e
    assert all(m * n == specs.ELEMENTS for m, n in specs.ROWS)  # one ELEMENTS for all
    assert specs.ELEMENTS == bench.ELEMENTS


def test_plan_smoke_run_rows_in_plan_order(tmp_path):

    cases = "rms_norm.forward,fused_add_rms_norm.backward"
    result = bench.main(
        [
            "--smoke",
            "--plan",
            "gpu-day",
            "--out",
            str(tmp_path),
            "--cases",
            cases,
            "--providers",
            "normbook,torch eager",
        ],
        log=lambda *_: None,
    )
    assert result["cut"] is None and not result["failed"], result["errors"]
    seen = list(
        dict.fromkeys(f"{r['kernel']}.{r['direction']}" for r in result["results"])
    )
    assert seen == cases.split(",")
    shapes = {(r["M"], r["N"]) for r in result["results"]}
    assert shapes == set(kernel_spec.SMOKE_ROWS)
    assert all(r["check"] == "ok" for r in result["results"]), result["results"]
    data = json.loads(result["json"].read_text())
    assert "complete" not in data and data["provenance"]["shapes"]["rms_norm.forward"]


def _names(tree):
    """(names a cell binds, names it reads) at its top level and in what it defines."""
    import ast

    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, (ast.Store, ast.Del)) else read).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound, read


def cells_for(nb, wanted):
    """The code cells that the cells ``wanted`` (indexes) need, in order: the set-up cell, and,
    transitively, the latest earlier cell binding each name a needed cell reads."""
    import ast

    names = {}
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            names[i] = _names(ast.parse(c.source))
    keep, todo = (
        set(),
        list(wanted) + [i for i, c in enumerate(nb.cells) if c.get("id") == "setup"],
    )
    while todo:
        i = todo.pop()
        if i in keep:
            continue
        keep.add(i)
        bound_here, read = names[i]
        for name in read - bound_here:
            earlier = [j for j in names if j < i and name in names[j][0]]
            if earlier:
                todo.append(earlier[-1])
    return sorted(keep)


@pytest.mark.skipif(
    importlib.util.find_spec("nbclient") is None, reason="needs nbclient"
)
def test_speed_of_light_chapter_renders_a_recorded_run(tmp_path):
    """The chapter's cells that read data/bench/ (and the cells they need: cells_for), executed
    with the fixture as data/bench/ (a cell after the imports points the benchmark's reader
    there), show the run's label, its summary and
    the recorded measured-against-predicted table. The rest of the chapter runs in the book's
    own execution, unchanged; only these cells' output depends on a recorded run."""
    import nbformat
    from nbclient import NotebookClient

    if DEVICE.type == "cuda":
        pytest.skip("the GPU run measures live")
    path = pathlib.Path(bench.ROOT) / "book" / "speed_of_light.ipynb"
    nb = nbformat.read(path, as_version=4)
    readers = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        and any(s in c.source for s in ("load_runs(", "comparison(", "DATA_DIR"))
    ]
    assert len(readers) >= 2, readers  # the summary and the comparison table
    keep = cells_for(nb, readers)
    nb.cells = [c for i, c in enumerate(nb.cells) if i in keep or c.cell_type != "code"]
    imports = next(
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and "from normbook.lab import bench" in c.source
    )
    nb.cells.insert(
        imports + 1,
        nbformat.v4.new_code_cell(
            "import pathlib\n"
            f"bench.DATA_DIR = bench.report.DATA_DIR = pathlib.Path({str(FIXTURE)!r})"
        ),
    )
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    text = "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    assert "Test double GPU" in text and "CUDA 13.0" in text
    assert (
        "| rms_norm.forward | 32768 | 4096 |" in text
    )  # the recorded comparison table
    assert "measured % of copy" in text and "predicted %" in text
