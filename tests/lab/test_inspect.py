"""What the GPU compiler makes of every kernel variant, checked on a CPU (normbook.lab.inspector).

The interpreter checks what the kernels compute; only the GPU compiler checks that they compile,
how many registers they need and whether they spill. ``normbook.lab.inspector`` lowers every launch the
public functions make, specialized by Triton's own JIT binder exactly as on a device, for sm_90
(H100/H200), sm_80 (A100) and sm_75 (T4), at the benchmark's shapes, the decode shapes and two odd
sizes (N = 1000, not a multiple of 16, and N = 40,000, a looped row), in fp32, fp16 and bf16 (and
fp64, which the gradient checks launch, at the odd sizes).

The first run compiles a few hundred variants per architecture (minutes, in parallel over the
CPU's cores); results are cached by Triton's version, kernel source and specialization, so later
runs take seconds. The table is computed once per test run, in a background process that the
plugin scheduling.py starts at collection (inspector_step.py), and these tests run last: the
kernel tests use the cores meanwhile, and every xdist worker reads the same table.
"""

import json
import os

import inspector_step
import pytest

from normbook.lab import inspector, specs
from normbook.lab.inspector import compiler, runner, table
from normbook.lab.inspector.ptx import _ptx_sha

ARCHS = inspector.ARCHS
DTYPES = inspector.DTYPES
ODD = inspector.ODD_SHAPES

# (call, phase) of every public launch path; a call that launches nothing would be missing rows.
#: (call, phase) of every launch the inspector makes, from the specs
#: (normbook.lab.specs.inspector_paths).
PATHS = specs.inspector_paths()
#: Index loads besides the row loads: the paged cache reads one int32 block number per key.
INDEX_GATHERS = {("decode_attention.paged", "forward"): "Table"}

#: The known failures, one entry per (check, arch, call, phase), measured with Triton 3.9 on
#: sm_90, sm_80 and sm_75. Each is an expected failure that must fail (strict): when a
#: redesign fixes it, the test turns red until its entry is removed.
#: - vector: qk_norm_rope loads q, k, cos and sin 64 bits at a time (each half of a head
#:   separately, for the rotation), not 128.
#: - vector: qk_norm_rope's backward loads cos and sin the same way.
#: - spills: attention's backward in fp32 on sm_90, the dK/dV kernel at one decode shape
#:   (seq 8, whose lengths are not multiples of 16): 32 bytes at 80 registers; its bench
#:   shapes and the other archs and dtypes do not spill.
KNOWN_TO_FAIL = {
    (check, arch, call, phase)
    for arch in ARCHS
    for check, call, phase in [
        ("vector", "qk_norm_rope", "forward"),
        ("vector", "qk_norm_rope", "backward"),
    ]
} | {("spills", 90, "attention", "backward")}
#: - vector: sm_75 reads an e4m3 KV cache as bytes and shifts them into fp16 bits (it has
#:   no fp8 type): decode attention's K and V tiles are then loaded 64 bits at a time.
KNOWN_TO_FAIL |= {("vector", 75, "decode_attention.fp8kv", "forward")}

#: The declared floor, Triton 3.6 (the GPU machine's), where it spills and 3.9 does not
#: (torch 2.11.0, triton 3.6.0, numpy 2.5.2; every variant of this file's table on sm_90,
#: sm_80 and sm_75; none failing to compile): sm_75's attention backward, the dK/dV kernel
#: in fp16 at the decode shapes of one token (M = 1, N = 4096 and 8192; BLOCK_M 16,
#: BLOCK_N 32, 8 warps): 80 registers and 44 B stored / 28 B loaded, where 3.9 spills
#: nothing (89 registers at N = 4096). Every KNOWN_TO_FAIL entry fails under 3.6 as under 3.9 (sm_90's attention backward at
#: more shapes: fp32 at every bench shape, 12 B / 8 B). Not strict: an expected failure
#: under Triton < 3.9 only.
_TRITON = tuple(int(p) for p in __import__("triton").__version__.split(".")[:2])
FLOOR_MAY_FAIL = (
    {("spills", 75, "attention", "backward")} if _TRITON < (3, 9) else set()
)

#: Loads of a single element that a call makes besides its 128-bit row loads: cross_entropy's
#: forward gathers the target's logit, one element per row (argument X, the element's width).
SINGLE_ELEMENT_GATHERS = {("cross_entropy", "forward"): "X"}
_ELEMENT_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp64": 64}


@pytest.fixture(scope="session")
def inspector_table():
    return inspector_step.rows()["rows"]


@pytest.fixture(scope="session")
def inspector_verification():
    return inspector_step.rows()["verified"]


def _params(check):
    out = []
    for arch in ARCHS:
        for call, phase in PATHS:
            marks = ()
            if (check, arch, call, phase) in KNOWN_TO_FAIL:
                marks = pytest.mark.xfail(
                    strict=True,
                    reason="known today; remove from KNOWN_TO_FAIL once fixed",
                )
            elif (check, arch, call, phase) in FLOOR_MAY_FAIL:
                marks = pytest.mark.xfail(
                    strict=False, reason="spills under the floor's Triton"
                )
            out.append(
                pytest.param(
                    arch, call, phase, marks=marks, id=f"sm_{arch}-{call}-{phase}"
                )
            )
    return out


OPTIONAL: set = set()  # (call, phase) that may launch nothing here


def _rows(table, arch, call, phase):
    rows = [
        r for r in table if (r["arch"], r["call"], r["phase"]) == (arch, call, phase)
    ]
    if not rows and (call, phase) in OPTIONAL:
        pytest.skip(f"{call} has no Triton backward here")
    assert rows, f"no launch recorded for {call} {phase} on sm_{arch}"
    return rows


def _where(r):
    return f"{r['kernel']} {r['dtype']} M={r['M']} N={r['N']} ({r['shape']}) {r['constexprs']}"


@pytest.mark.parametrize("arch,call,phase", _params("compiles"))
def test_every_variant_compiles(inspector_table, arch, call, phase):
    rows = _rows(inspector_table, arch, call, phase)
    failed = [f"{_where(r)}: {r['error']}" for r in rows if "error" in r]
    assert not failed, "\n".join(failed)
    # Every dtype and every shape the specs launch this call at launched something.
    want = _launched_at(call)
    assert {r["dtype"] for r in rows} == {dt for dt, _, _ in want}
    assert {(r["M"], r["N"]) for r in rows} >= {(m, n) for _, m, n in want}


def _launched_at(call: str) -> set:
    """(dtype, M, N) of the survey's shapes where the specs launch ``call``."""
    shapes = [(s, dts) for s in inspector.bench_shapes() for dts in [DTYPES]]
    shapes += [(s, (*DTYPES, "fp64")) for s in inspector.ODD_SHAPES]
    return {
        (dt, m, n)
        for (label, m, n), dts in shapes
        for dt in dts
        if any(x.call == call for x in specs.inspector_launches(label, m, n, dt))
    }


@pytest.mark.parametrize("arch,call,phase", _params("spills"))
def test_no_variant_spills_registers(inspector_table, arch, call, phase):
    """ptxas -v: 0 bytes spill stores and loads for every variant at every benchmark and decode
    shape. A spill moves registers through local memory (DRAM behind L1/L2): traffic the byte
    count of a memory-bound kernel does not include."""
    spilled = [
        f"{_where(r)}: {r['spill_stores']} B stores / {r['spill_loads']} B loads, "
        f"{r['registers']} registers"
        for r in _rows(inspector_table, arch, call, phase)
        if r["shape"] in ("bench", "decode")
        and (r.get("spill_stores") or r.get("spill_loads"))
    ]
    assert not spilled, "\n".join(spilled)


@pytest.mark.parametrize("arch,call,phase", _params("vector"))
def test_row_loads_are_128_bit(inspector_table, arch, call, phase):
    """Where N is a multiple of 16 (so rows start on 16-byte boundaries in every dtype), every global
    load of a row-sized input of the call (x, dy, a residual, q, k, cos, sin) is one 128-bit access
    per thread (``ld.global.v4.b32``), as the JIT's specialization allows."""
    narrow = []
    for r in _rows(inspector_table, arch, call, phase):
        if r["N"] % 16 or "error" in r:
            continue
        for arg in r["row_args"]:
            if INDEX_GATHERS.get((call, phase)) == arg:
                continue
            widths = r["loads"].get(arg, [])
            if SINGLE_ELEMENT_GATHERS.get((call, phase)) == arg:
                widths = [w for w in widths if w != _ELEMENT_BITS[r["dtype"]]] or [
                    0
                ]  # rows too
            if any(w < 128 for w in widths):
                narrow.append(f"{_where(r)}: {arg} loaded {widths} bits at a time")
    assert not narrow, "\n".join(narrow)


def test_the_table_reads_the_compilers_output(inspector_table):
    """Sanity of the reading itself: registers and warps are set; every global access of a row
    tensor was traced back to its argument; the fp32 reciprocal square root is one of the forms
    the chapter discusses (sqrt then a division, or rsqrt)."""
    for r in inspector_table:
        if "error" in r:
            continue
        assert 0 < r["registers"] <= 255 and r["num_warps"] in (1, 2, 4, 8, 16, 32), (
            _where(r)
        )
        assert "?" not in r["loads"], (
            f"{_where(r)}: a load whose address was not traced: {r['loads']}"
        )
        assert r["ctas_per_sm"] >= 1, _where(r)
    fwd = [
        r
        for r in inspector_table
        if r["kernel"] == "_rms_norm_fwd" and "error" not in r
    ]
    assert fwd and all(
        any(k.startswith(("sqrt", "rsqrt")) for k in r["math"]) for r in fwd
    )


def test_occupancy_and_littles_law():
    """The model's arithmetic on hand-checkable cases."""
    h100 = inspector.GPUS[90]
    # 32 registers × 32 threads = 1024 per warp; 16 warps: 16,384 per CTA; 65,536 / 16,384 = 4 CTAs,
    # which is also the thread limit (2048 / 512).
    assert inspector.occupancy(h100, 32, 16, 0) == (4, "registers")
    # 128 registers: 4096 per warp, 16 warps per CTA → 65,536 / 65,536 = 1 CTA per SM.
    assert inspector.occupancy(h100, 128, 16, 0)[0] == 1
    # Shared memory: 100 KiB + 1 KiB reserved per CTA in 228 KiB → 2.
    assert inspector.occupancy(h100, 16, 1, 100 * 1024) == (2, "shared memory")
    assert inspector.littles_law_bytes(h100, 600) == pytest.approx(
        3.35e12 * 600e-9 / 132
    )


def test_datasheets_are_the_inspectors_gpus_and_cited():
    """One source for the published figures: the inspector's GPU of each architecture
    is its datasheet's, and every datasheet names a bibliography entry."""
    bib = (inspector.ROOT / "references.bib").read_text()
    for d in inspector.DATASHEETS.values():
        gpu = inspector.GPUS[d.arch]
        assert gpu.sms == d.sms
        assert d.name.startswith("H200") or gpu.bandwidth == d.bandwidth
        for key in (d.source, d.l2_source):
            assert key is None or f"{{{key}," in bib, key
        # the tensor cores' peak is above the CUDA cores' on every product listed
        assert d.tensor16 > d.fp32 > 0


def test_ptx_reader_traces_addresses_to_arguments():
    ptx = """
    ld.param.b64 %rd1, [k_param_0];
    ld.param.b64 %rd2, [k_param_1];
    ld.param.b32 %r1, [k_param_2];
    mul.wide.s32 %rd3, %r1, 2;
    add.s64 %rd4, %rd1, %rd3;
    setp.lt.s64 %p1, %rd4, %rd2;
    $L__BB0_1:
    @%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd4 + 0 ];
    ld.global.b16 %rs1, [ %rd2 + 0 ];
    add.s64 %rd4, %rd4, 16;
    @%p1 bra $L__BB0_1;
    st.global.v2.b32 [ %rd2 + 0 ], { %r2, %r3 };
    sqrt.approx.ftz.f32 %f1, %f2;
    div.full.f32 %f3, %f4, %f1;
    """
    got = inspector.analyze_ptx(ptx, {0: "X", 1: "Y"})
    acc = [
        (a["op"], a["bits"], a["args"], a["loop"] is not None) for a in got["accesses"]
    ]
    assert acc == [
        ("ld", 128, ["X"], True),
        ("ld", 16, ["Y"], True),
        ("st", 64, ["Y"], False),
    ]
    assert (
        got["math"] == {"sqrt.approx.ftz.f32": 1, "div.full.f32": 1}
        and got["loops"] == 1
    )


def test_command_line_prints_the_table(inspector_table, tmp_path):
    """``python -m normbook.lab.inspector`` end to end on one small call (cached by the table's run)."""
    import subprocess
    import sys

    out = tmp_path / "t.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "normbook.lab.inspector",
            "--arch",
            "90",
            "--dtypes",
            "bf16",
            "--shapes",
            "decode",
            "--calls",
            "rms_norm",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=inspector.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Little's law" in proc.stdout and "_rms_norm_fwd" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["latency_ns"] == inspector.LATENCY_NS and data["rows"]
    assert {r["M"] for r in data["rows"]} == {1, 8, 64}


def test_phases_choose_what_is_compiled(inspector_table):
    """``phases=("forward",)`` inspects no backward launch; both phases give the backward's
    kernels too; a misspelt phase or an unknown architecture is refused before any child
    starts. Cached by the table's run."""
    small = dict(
        archs=(90,), dtypes=("fp32",), shapes=[("odd", 6, 1000)], calls=["rms_norm"]
    )
    forward = inspector.run_inspector(**small, phases=("forward",))["rows"]
    both = inspector.run_inspector(**small)["rows"]
    assert forward and {r["phase"] for r in forward} == {"forward"}
    assert {r["phase"] for r in both} == {"forward", "backward"}
    assert [r for r in both if r["phase"] == "forward"] == forward
    with pytest.raises(ValueError, match="phases"):
        inspector.run_inspector(**small, phases=("fwd",))
    with pytest.raises(ValueError, match="archs"):
        inspector.run_inspector(**{**small, "archs": (90, 86)})


def test_units_come_back_in_order_whichever_child_ran_them(inspector_table):
    """Two children share four units (each takes the next unclaimed one): the rows come
    back in the units' order (architecture, then dtype), as one child gives them. An
    empty request starts no child."""
    small = dict(
        archs=(90, 75),
        dtypes=("fp32", "bf16"),
        shapes=[("odd", 6, 1000)],
        calls=["softmax"],
        phases=("forward",),
    )
    shared = inspector.run_inspector(**small, jobs=2)["rows"]
    alone = inspector.run_inspector(**small, jobs=1)["rows"]
    assert [(r["arch"], r["dtype"]) for r in shared] == [
        (a, d) for a in (90, 75) for d in ("fp32", "bf16")
    ]
    assert shared == alone
    assert inspector.run_inspector(archs=(), dtypes=("fp32",)) == {
        "meta": {},
        "rows": [],
    }


def test_a_deadline_keeps_what_finished(monkeypatch):
    """``partial=True`` past the timeout returns the finished units (none here: the
    children are still importing torch after a second) and stops the children, instead
    of raising; without ``partial`` the timeout raises."""
    import subprocess

    small = dict(
        archs=(90, 80),
        dtypes=("fp32",),
        shapes=[("odd", 6, 1000)],
        calls=["rms_norm"],
        timeout=0,
    )
    started = []
    real = subprocess.Popen
    monkeypatch.setattr(
        subprocess,
        "Popen",
        lambda *a, **k: started.append(real(*a, **k)) or started[-1],
    )
    out = inspector.run_inspector(**small, partial=True)
    # a unit that finished within the second (a warm cache, a fast machine) comes back whole
    finished = {r["arch"] for r in out["rows"]}
    assert out["meta"].get("units_not_finished", 0) + len(finished) == 2
    assert started and all(p.poll() is not None for p in started)  # none left running
    with pytest.raises(subprocess.TimeoutExpired):
        inspector.run_inspector(**small)


def test_a_variant_two_processes_need_is_compiled_once(monkeypatch, tmp_path):
    """Two compilers asking for the same variant at once (a chapter's cell and the test
    suite's table, both on a cold cache) compile it once: the second waits on the
    variant's lock and reads the first's entry. Two threads stand for the two processes:
    an flock belongs to an open file, so two opens exclude each other in one process too."""
    import threading
    import time

    monkeypatch.setattr(compiler, "CACHE", tmp_path)
    # and both threads the first to read the recorded table in this process (two threads
    # parsing at once can fail: CPython's ast.parse is not thread-safe)
    monkeypatch.setattr(table, "_RECORDED_CACHE", {})
    monkeypatch.setattr(table, "_ANALYSIS_VERSION", [])
    compiled = []

    def slow_compile(*args):
        compiled.append(args)
        time.sleep(0.5)  # long enough for the other thread to arrive meanwhile
        entry = {"registers": 40, "triton": __import__("triton").__version__}
        (tmp_path / "0123.json").write_text(__import__("json").dumps(entry))
        return entry

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    got = []
    threads = [
        threading.Thread(
            target=lambda: got.append(
                compiler._compile_and_read(None, None, None, None, None, None, "0123")
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiled) == 1 and got[0] == got[1] and got[0]["registers"] == 40


def test_a_failing_child_fails_the_run(monkeypatch, tmp_path):
    """A child that dies (here: its cache folder is a file, so its first compile fails, the
    recorded table being off) fails the run with the child's error, with ``partial`` too: a
    deadline keeps unfinished units, never a crash counted as one."""
    blocker = tmp_path / "cache"
    blocker.write_text("")
    real = runner._child_env
    monkeypatch.setattr(
        runner,
        "_child_env",
        lambda: {
            **real(),
            "NORMBOOK_INSPECT_CACHE": str(blocker),
            "NORMBOOK_INSPECT_RECORDED": "",
        },
    )
    for partial in (False, True):
        with pytest.raises(RuntimeError, match="child failed"):
            inspector.run_inspector(
                archs=(90,),
                dtypes=("fp32",),
                shapes=[("odd", 6, 1000)],
                calls=["rms_norm"],
                timeout=600,
                partial=partial,
            )


def test_a_cache_hit_refreshes_the_entrys_time(tmp_path):
    """The test workflow keeps the cache between CI runs and drops the entries that a run
    did not read (.github/workflows/test.yml): a hit must mark its entry as read."""
    entry = tmp_path / "k.json"
    entry.write_text(json.dumps({"triton": "3.0", "registers": 7}))
    os.utime(entry, (1_000_000, 1_000_000))
    assert compiler._cached(entry, "3.0") == {"triton": "3.0", "registers": 7}
    assert entry.stat().st_mtime > 1_000_000
    os.utime(entry, (1_000_000, 1_000_000))
    assert compiler._cached(entry, "3.1") is None  # another Triton's: not a hit
    assert entry.stat().st_mtime == 1_000_000


def test_the_recorded_table_covers_the_survey(inspector_table):
    """data/inspect/variants.jsonl holds exactly the variants of this table, so that a new
    machine compiles none of them (an edited kernel's variants have new keys: record again
    with ``make inspect-record``). Skipped under another Triton, whose keys all differ."""
    header = inspector.recorded_header()
    installed = __import__("triton").__version__
    if not header:
        pytest.skip("no recorded table here (a package installed without data/)")
    if header.get("triton") != installed:
        pytest.skip(
            f"the table was recorded with triton {header.get('triton')}, this is "
            f"{installed} (requirements.txt pins the table's): every variant was "
            f"compiled"
        )
    assert header.get("analysis") == inspector.analysis_version(), (
        "normbook.lab.inspector reads the compiler's output differently from when the table was "
        "recorded: record it again from nothing (make inspect-record FROM_SCRATCH=1)"
    )
    variants = {r["variant"] for r in inspector_table if "error" not in r}
    table = set(inspector.recorded())
    missing, stale = variants - table, table - variants
    kernels_missing = sorted(
        {r["kernel"] for r in inspector_table if r["variant"] in missing}
    )
    assert not missing and not stale, (
        f"{len(missing)} variants not recorded (kernels {kernels_missing}), {len(stale)} "
        f"recorded that no test compiles: run `make inspect-record` and commit "
        f"{inspector.RECORDED.relative_to(inspector.ROOT)}"
    )
    assert header["variants"] == len(table)


def test_the_recorded_table_says_what_a_fresh_compile_says(inspector_verification):
    """One random unit (architecture, dtype, shape) of every call, compiled from nothing (no
    cache of Triton's or the inspector's, no recorded table), gives the same rows as the table
    read from the record: registers, spills, load widths, square roots, the PTX's hash. A key
    that missed something that changes the compile (a knob, another ptxas) fails here."""
    if inspector_verification is None:
        pytest.skip("no recorded table for this Triton: every variant was compiled")
    v = inspector_verification
    calls = {c for c, _ in PATHS}
    assert {u[2] for u in v["units"]} == calls and v["compiled"] >= len(calls)
    assert not v["mismatches"], (
        f"seed {v['seed']} (INSPECT_VERIFY_SEED repeats it); if the compiler is right, record "
        f"the table again from nothing (make inspect-record FROM_SCRATCH=1):\n"
        + "\n".join(map(str, v["mismatches"][:20]))
    )


def test_a_wrong_recorded_entry_is_caught(inspector_table, tmp_path):
    """The check above can fail: a table whose entries for one unit say one register more (as a
    table edited by hand, or recorded by another compiler, would), read as the tests read it
    (before any cache), gives rows that differ from a fresh compile, register for register."""
    small = dict(
        archs=(75,),
        dtypes=("fp16",),
        shapes=[("odd", 6, 1000)],
        calls=["softmax"],
        phases=("forward",),
    )
    right = inspector.run_inspector(**small)["rows"]
    assert right
    entries = {}
    for r in right:
        info = inspector.recorded().get(r["variant"])
        if info is None:  # not recorded here (another Triton): the cache's entry
            info = compiler._cached(
                compiler.CACHE / f"{r['variant']}.json",
                __import__("triton").__version__,
            )
        entries[r["variant"]] = dict(info, registers=info["registers"] + 1)
    table = tmp_path / "variants.jsonl"
    table.write_text(
        json.dumps(
            {
                "triton": __import__("triton").__version__,
                "analysis": inspector.analysis_version(),
            }
        )
        + "\n"
        + "".join(json.dumps({"key": k, **v}) + "\n" for k, v in entries.items())
    )
    wrong = inspector.run_inspector(
        **small, env={"NORMBOOK_INSPECT_RECORDED": str(table)}
    )["rows"]
    assert [r["registers"] for r in wrong] == [r["registers"] + 1 for r in right]
    check = dict(seed=1, jobs=1, phases=small["phases"])
    got = inspector.verify_recorded(wrong, **check)["mismatches"]
    assert [(m[1], m[2] - m[3]) for m in got] == [
        (f"{r['kernel']}.registers", 1) for r in right
    ]
    assert inspector.verify_recorded(right, **check)["mismatches"] == []


def test_the_recorded_table_is_read_and_written(monkeypatch, tmp_path):
    """A recorded variant is read without compiling unless its PTX is asked for; an entry of
    another Triton is not read; write_recorded keeps what the rows need, not the PTX."""
    import triton

    monkeypatch.setattr(compiler, "CACHE", tmp_path / "cache")
    entry = {
        "registers": 40,
        "num_warps": 4,
        "ptx": '.file 1 "/a/k.py"\nld.global.b32',
        "compile_s": 1.5,
        "triton": triton.__version__,
    }
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "k1.json").write_text(json.dumps(entry))
    table = tmp_path / "variants.jsonl"
    assert (
        inspector.write_recorded(
            [{"variant": "k1"}, {"variant": "k1"}, {"variant": "bad", "error": "x"}],
            table,
        )
        == 1
    )
    lines = table.read_text().splitlines()
    assert json.loads(lines[0])["triton"] == triton.__version__ and len(lines) == 2
    assert set(json.loads(lines[1])) == {"key", "registers", "num_warps", "ptx_sha"}
    (tmp_path / "cache" / "k1.json").unlink()
    monkeypatch.setenv("NORMBOOK_INSPECT_RECORDED", str(table))
    compiled = []
    monkeypatch.setattr(
        compiler, "_compile", lambda *a: compiled.append(a) or {"ptx": "p"}
    )
    got = compiler._compile_and_read(None, None, None, None, None, None, "k1")
    assert got["registers"] == 40 and not compiled
    assert (
        compiler._compile_and_read(
            None, None, None, None, None, None, "k1", need_ptx=True
        )
        == {"ptx": "p"}
        and len(compiled) == 1
    )
    with pytest.raises(RuntimeError, match="neither cached nor recorded"):
        inspector.write_recorded([{"variant": "k2"}], tmp_path / "other.jsonl")
    header = json.loads(lines[0])
    for name, changed in (("triton", "0.1"), ("analysis", "another reader")):
        old = tmp_path / f"old-{name}.jsonl"
        old.write_text(json.dumps({**header, name: changed}) + "\n" + lines[1] + "\n")
        assert inspector.recorded(old) == {}, name
    broken = tmp_path / "conflict.jsonl"
    broken.write_text(lines[0] + "\n\n" + lines[1] + "\n<<<<<<< HEAD\n")
    with pytest.raises(ValueError, match="conflict.jsonl, line 4"):
        inspector.recorded(broken)


def test_two_threads_load_the_recorded_table_once(monkeypatch, tmp_path):
    """The table is read, and the reader's version computed (ast.parse, which CPython 3.11 does
    not run safely in two threads at once), by one thread while the other
    waits for it: both get the same table, loaded once."""
    import threading
    import time

    loads = []

    def slow_load(path):
        loads.append(path)
        time.sleep(0.3)  # the other thread arrives meanwhile
        table._RECORDED_CACHE[path] = {"k": {"registers": 1}}
        return table._RECORDED_CACHE[path]

    monkeypatch.setattr(table, "_RECORDED_CACHE", {})
    monkeypatch.setattr(table, "_load_recorded", slow_load)
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(inspector.recorded(tmp_path / "t")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and got[0] is got[1]


def test_the_ptx_hash_leaves_out_the_paths():
    """Two clones at different paths compile the same PTX but for its .file lines and its
    DWARF sections (the path spelt in bytes): the hash leaves out both, and nothing else."""

    def ptx(root, load="v4"):
        path = " ".join(f".b8 {b}" for b in root.encode())
        return (
            f'\t.file\t1 "{root}/kernels/normbook/rms_norm.py"\nld.global.{load}.b32 {{%r1}}, [%rd1];'
            f"\n}}\n\t.section\t.debug_info\n\t{{\n{path}\n\t}}\n"
        )

    a, b = ptx("/work/main"), ptx("/tmp/clone")
    assert a != b and _ptx_sha(a) == _ptx_sha(b)
    assert _ptx_sha(a) != _ptx_sha(ptx("/work/main", "v2"))


def test_the_child_loads_the_package_without_normbook():
    """The child fakes CUDA before anything imports normbook (torch, Triton's interpreter
    flag): loaded from its folder as the child loads it, the package imports none of
    them, nor does report.py, which tools/gpu_check.py loads alone by path."""
    import subprocess
    import sys

    report = inspector.ROOT / "kernels/normbook/lab/inspector/report.py"
    code = runner._loader("_inspector_alone") + (
        "import importlib.util as u; "
        f"r = u.spec_from_file_location('_report_alone', {str(report)!r}); "
        "r.loader.exec_module(u.module_from_spec(r)); "
        "importlib.import_module(s.name + '.child'); "
        "print(sorted({k.split('.')[0] for k in sys.modules} "
        "& {'torch', 'triton', 'normbook'}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_a_variants_key_does_not_name_the_checkouts_path(tmp_path):
    """The libdevice path in the compile options is the virtual environment's: the key hashes
    the options as Triton's own cache does, the library by its content, so a fresh clone
    elsewhere finds the recorded variants, and another library's content does not."""
    import shutil

    from triton.backends.nvidia.compiler import CUDAOptions

    lib = CUDAOptions().extern_libs[0][1]
    copies = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        copies.append(shutil.copy(lib, tmp_path / name / "libdevice.10.bc"))
    other = tmp_path / "c.bc"
    other.write_bytes(b"not libdevice")
    a, b, c = (
        CUDAOptions(extern_libs=(("libdevice", str(f)),)).hash()
        for f in (*copies, other)
    )
    assert a == b != c
