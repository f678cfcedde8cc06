"""What the compiler made of each kernel: registers, spills, load widths, occupancy,
without a GPU.

    python -m normbook.lab.inspector                  # sm_90 (H100/H200), the table on stdout
    python -m normbook.lab.inspector --arch 80        # sm_80 (A100); 75: sm_75 (T4)
    python -m normbook.lab.inspector --arch 90 --json table.json

Every public function of the package is called at the benchmark's shapes (normbook.lab.bench:
N = 256 … 262,144, M·N = 2**26) and at decode shapes (M = 1, 8, 64 rows of N = 4096 and
8192), forward and backward, in fp32, fp16 and bf16. Instead of running, each kernel
launch is lowered by Triton's
own pipeline for the target GPU **exactly as the JIT lowers it on a device**: the
launch's arguments go through the JIT's binder (``create_function_from_signature``, the
code ``JITFunction.run`` calls), which specializes pointers aligned to 16 bytes and
integers divisible by 16; then ``triton.compile`` with the options the launch asked for.
``ptxas -v`` (shipped in Triton's wheel, run with the flags Triton's own ``make_cubin``
uses) reports registers and spills; the PTX is read for the width of each global load
and store (per kernel argument) and for the instructions that compute square roots and
divisions.

From those, per launch and for the GPU of that architecture (:data:`GPUS`): CTAs per SM
(limited by registers, threads, shared memory or the CTA cap), the grid against the SM
count, and the bytes of global loads a resident SM keeps in flight against what Little's
law asks for to sustain the GPU's bandwidth: ``bytes in flight = bandwidth × latency``
(per SM: divided by the SM count). :data:`LATENCY_NS` is the latency assumed, with its
source. The last column, ``predicted``, is a *model* (min(1, in-flight / needed) × wave
efficiency), not a measurement.

Faking CUDA changes torch for the whole process, so the work runs in child processes,
at most one per core, which share the (architecture, dtype) units between them
(:func:`run_inspector`; :func:`inspect_variants` and ``python -m normbook.lab.inspector`` call
it). Results of a
compiled variant are cached on disk (``NORMBOOK_INSPECT_CACHE``, default
``~/.cache/normbook-inspect``), keyed by Triton's version, the kernel's source hash, its
specialization, options and target.

What the compiler reported for every variant of the test suite's table (:func:`survey`,
about 2,800 variants for three GPUs) is also recorded in the repository,
``data/inspect/variants.jsonl`` (:data:`RECORDED`), under the same keys, without the
PTX: a new machine reads it instead of compiling them all (half an hour on two cores).
A key names Triton's version and every kernel's source, so an edited kernel or another
Triton misses and is compiled. ``python -m normbook.lab.inspector --record`` writes the table
again; the tests check that it covers the survey, and compile a random sample of it
from nothing on every run (:func:`verify_recorded`): it must still say what the
compiler says.

This module imports neither torch nor ``normbook`` at the top: the child loads it by file
path, fakes CUDA and only then imports ``normbook``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

# As normbook.lab.paths says, spelt here: importing normbook (torch, Triton's mode) must
# wait until the child has faked CUDA.
ROOT = pathlib.Path(__file__).resolve().parents[3]
SOURCE_ROOT = ROOT / "kernels"
DATA = ROOT / "data"

CACHE = pathlib.Path(
    os.environ.get(
        "NORMBOOK_INSPECT_CACHE", pathlib.Path.home() / ".cache" / "normbook-inspect"
    )
)
#: The recorded table (see the module's docstring). ``NORMBOOK_INSPECT_RECORDED`` names
#: another file, or, empty, none: every variant compiled.
RECORDED = DATA / "inspect" / "variants.jsonl"


@dataclass(frozen=True)
class GPU:
    """What the occupancy and Little's-law columns need to know about one GPU of an
    architecture.

    Limits per SM from NVIDIA's CUDA C++ Programming Guide (table "Technical
    Specifications per Compute Capability"); bandwidth and SM count from the product
    datasheets."""

    name: str
    sms: int
    bandwidth: float  # bytes/s, datasheet peak of the memory
    max_threads: int  # resident threads per SM
    max_ctas: int  # resident CTAs per SM
    regs: int = 65536  # 32-bit registers per SM
    smem: int = 228 * 1024  # shared memory per SM, bytes
    # shared memory the system reserves per CTA (sm_80 and newer)
    smem_reserved: int = 1024


GPUS = {
    90: GPU(
        "H100 SXM (132 SMs; an H200 has the same SMs and 4.8 TB/s)",
        132,
        3.35e12,
        2048,
        32,
    ),
    80: GPU("A100 SXM4 80GB (108 SMs)", 108, 2.039e12, 2048, 32, smem=164 * 1024),
    75: GPU("T4 (40 SMs)", 40, 320e9, 1024, 16, smem=64 * 1024, smem_reserved=0),
}

#: DRAM latency assumed for Little's law, in nanoseconds. Pointer-chasing
#: microbenchmarks put the unloaded global-memory latency of A100/H100-class GPUs at
#: several hundred nanoseconds (Chips and Cheese, "Nvidia's H100: Funny L2, and Tons of
#: Bandwidth", 2023; Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
#: Microbenchmarking", 2018, and the Turing T4 sequel, 2019); under load it is higher.
#: We take a round 600 ns for every architecture: an assumption with its source, not a
#: measurement, and a parameter (``--latency-ns``).
LATENCY_NS = 600.0

DTYPES = ("fp32", "fp16", "bf16")
ARCHS = tuple(GPUS)


# ---------------------------------------------------------------- the shapes


def bench_shapes() -> list[tuple[str, int, int]]:
    """(label, M, N): the benchmark's sweep (normbook.lab.specs) and decode shapes."""
    from normbook.lab.specs import DECODE_M, DECODE_N, ELEMENTS, SWEEP

    shapes = [("bench", ELEMENTS // n, n) for n in SWEEP]
    shapes += [("decode", m, n) for n in DECODE_N for m in DECODE_M]
    return shapes


# ---------------------------------------------------------------- reading PTX

_PARAM = re.compile(r"ld\.param\.[bu]64\s+(%rd\d+),\s*\[(\w+)_param_(\d+)\]")
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[a-z0-9:]+)*)")
_ADDR = re.compile(r"\[\s*(%rd\d+)")
_REG = re.compile(r"%rd\d+")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
_MATH = re.compile(r"\b((?:sqrt|rsqrt|div|rcp)\.[a-z0-9.]+)")
_TYPE_BITS = re.compile(r"\.[bufs](8|16|32|64)$")


def _access_bits(suffix: str) -> int:
    """Bits moved by one ld/st.global instruction: vector length × element width."""
    parts = suffix.split(".")
    vec = 1
    for p in parts:
        if p in ("v2", "v4", "v8"):
            vec = int(p[1:])
    m = _TYPE_BITS.search("." + parts[-1])
    return vec * (int(m.group(1)) if m else 32)


def analyze_ptx(ptx: str, pointer_params: dict[int, str]) -> dict:
    """Global loads/stores per kernel argument (which pointer each address derives
    from), loops, and the sqrt/div/rsqrt/rcp instructions of one kernel's PTX.

    ``pointer_params`` maps the index of a PTX parameter to the kernel argument's name.
    Addresses are traced back through 64-bit integer arithmetic to the ``ld.param`` of a
    pointer."""
    lines = [line.strip() for line in ptx.splitlines()]
    taint: dict[str, frozenset] = {}
    for line in lines:
        m = _PARAM.search(line)
        if m and int(m.group(3)) in pointer_params:
            taint[m.group(1)] = frozenset([pointer_params[int(m.group(3))]])
    # Propagate through 64-bit registers until nothing changes (loops carry pointers
    # around).
    for _ in range(8):
        changed = False
        for line in lines:
            if (
                not line
                or line.startswith(("//", ".", "$"))
                or _ACCESS.search(line)
                or "ld.param" in line
            ):
                continue
            # "@%p1 op.type dest, src, ...;": only a 64-bit destination can hold an
            # address.
            body = re.sub(r"^@!?%p\d+\s+", "", line.split("//")[0]).rstrip(";")
            parts = body.split(None, 1)
            if len(parts) < 2 or parts[0].startswith(("st.", "bra", "setp", "ret")):
                continue
            operands = parts[1].split(",")
            dest = operands[0].strip()
            sources = _REG.findall(",".join(operands[1:]))
            if not re.fullmatch(r"%rd\d+", dest) or not sources:
                continue
            t = frozenset().union(*(taint.get(r, frozenset()) for r in sources))
            if t and not t <= taint.get(dest, frozenset()):
                taint[dest] = taint.get(dest, frozenset()) | t
                changed = True
        if not changed:
            break
    # Loops: a branch back to a label defined earlier.
    labels, loops = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
        b = _BRANCH.search(line)
        if b and b.group(1) in labels and labels[b.group(1)] < i:
            loops.append((labels[b.group(1)], i))
    accesses = []
    for i, line in enumerate(lines):
        m = _ACCESS.search(line)
        if not m:
            continue
        a = _ADDR.search(line)
        owners = sorted(taint.get(a.group(1), ())) if a else []
        inner = [lp for lp in loops if lp[0] <= i <= lp[1]]
        loop = min(inner, key=lambda lp: lp[1] - lp[0]) if inner else None
        accesses.append(
            {
                "op": m.group(1),
                "bits": _access_bits(m.group(2)),
                "args": owners,
                "loop": loop,
            }
        )
    math_ops: dict[str, int] = {}
    for line in lines:
        for op in _MATH.findall(line):
            math_ops[op] = math_ops.get(op, 0) + 1
    return {"accesses": accesses, "math": math_ops, "loops": len(loops)}


def _ptxas(ptx: str, arch: int, fp_fusion: bool) -> dict:
    """Registers, spills, stack and shared memory from ``ptxas -v``, run as Triton's
    make_cubin runs it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        fmad = [] if fp_fusion else ["--fmad=false"]
        cmd = [
            get_ptxas(arch).path,
            "-lineinfo",
            *fmad,
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
            str(src),
            "-o",
            str(src) + ".o",
        ]
        return parse_ptxas_log(
            subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        )


def parse_ptxas_log(log: str) -> dict:
    def num(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
        "static_smem": num(r"(\d+) bytes smem"),
    }


_PTXAS_LOGS: list[str] = []


def _keep_ptxas_logs() -> None:
    """Triton's make_cubin already runs ``ptxas -v`` and throws the log away: keep it
    (saves a second ptxas run per variant). Falls back to our own run when Triton's
    cache skipped ptxas."""
    import triton.backends.nvidia.compiler as nv

    real = nv.subprocess

    class Shim:
        def __getattr__(self, name):
            return getattr(real, name)

        def run(self, cmd, *args, **kwargs):
            result = real.run(cmd, *args, **kwargs)
            log = kwargs.get("stderr")
            if "-v" in cmd and hasattr(log, "name"):
                with open(log.name) as f:
                    _PTXAS_LOGS.append(f.read())
            return result

    nv.subprocess = Shim()


# ---------------------------------------------------------------- the model


def occupancy(gpu: GPU, registers: int, num_warps: int, smem: int) -> tuple[int, str]:
    """Resident CTAs per SM and what limits them (CUDA occupancy calculator's rules:
    registers are allocated per warp in units of 256)."""
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    limits = {
        "registers": (gpu.regs // regs_per_warp) // num_warps,
        "threads": gpu.max_threads // (32 * num_warps),
        "CTA cap": gpu.max_ctas,
    }
    if smem:
        limits["shared memory"] = gpu.smem // (smem + gpu.smem_reserved)
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def littles_law_bytes(gpu: GPU, latency_ns: float = LATENCY_NS) -> float:
    """Bytes one SM must keep in flight to sustain the GPU's bandwidth: bandwidth ×
    latency / SMs."""
    return gpu.bandwidth * latency_ns * 1e-9 / gpu.sms


# ---------------------------------------------------------------- the child process


def _fake_cuda(arch: int) -> None:
    """Make torch report a CUDA device of ``arch`` so that ``kernels`` defines compiled
    kernels."""
    import types

    import torch

    gpu = GPUS[arch]
    props = types.SimpleNamespace(
        name=f"compile-only {gpu.name}",
        major=arch // 10,
        minor=arch % 10,
        multi_processor_count=gpu.sms,
        max_threads_per_multi_processor=gpu.max_threads,
        regs_per_multiprocessor=gpu.regs,
        total_memory=80 * 2**30,
        L2_cache_size=50 * 2**20,
        shared_memory_per_block_optin=gpu.smem - gpu.smem_reserved,
        warp_size=32,
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_name = lambda *a, **k: props.name


#: data_ptr of every row-sized tensor the current call was given (x, dy, a residual, q,
#: k, ...)
_INPUTS: set[int] = set()

TORCH_TO_TRITON = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float64": "fp64",
}


class _Capture:
    """Intercepts ``JITFunction.run``: binds the launch's arguments with the JIT's own
    binder and records what would be compiled and the grid, instead of compiling and
    launching."""

    def __init__(self):
        self.launches: list[dict] = []
        self.phase = ""
        self.binders: dict = {}
        self.backend_keys: dict = {}

    def run(self, fn, args, kwargs, grid):
        import torch
        import triton
        from triton import knobs
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        # The same options JITFunction.run adds before it binds.
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        # Knobs that only some Triton versions have (3.6 lacks fpsan_homomorphic_casts):
        # passed when this Triton's JIT passes them, as it does.
        for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, knob):
                kwargs[knob] = getattr(knobs.compilation, knob)
        backend = make_backend(self.target)
        if fn not in self.binders:
            self.binders[fn] = create_function_from_signature(
                fn.signature, fn.params, backend
            )
        bound, specialization, options = self.binders[fn](*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            backend, kwargs, bound, specialization, options
        )
        grid = grid(bound) if callable(grid) else grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        tensors = {
            k: {
                "shape": list(v.shape),
                "input": v.data_ptr() in _INPUTS,
                "dtype": TORCH_TO_TRITON.get(
                    str(v.dtype).replace("torch.", ""), str(v.dtype)
                ),
            }
            for k, v in bound.items()
            if isinstance(v, torch.Tensor)
        }
        ints = {
            k: v
            for k, v in bound.items()
            if isinstance(v, int) and not isinstance(v, bool)
        }
        consts = {
            str(k[0] if isinstance(k, tuple) and len(k) == 1 else k): v
            for k, v in constexprs.items()
        }
        names = [p.name for p in fn.params]
        consts = {names[int(k)] if k.isdigit() else k: v for k, v in consts.items()}
        # Triton's version too: fn.cache_key hashes the source only (and its first
        # line's number), and a new compiler makes new PTX. What else Triton's own cache
        # key names: the options (libdevice by its content, not its path: two clones
        # give a variant the same key), ptxas's version, and the environment variables
        # that change a compile (TRITON_DISABLE_LINE_INFO, DISABLE_PTXAS_OPT, ...).
        if self.target.arch not in self.backend_keys:
            self.backend_keys[self.target.arch] = backend.hash()
        key = json.dumps(
            [
                triton.__version__,
                fn.cache_key,
                {k: str(v) for k, v in signature.items()},
                {k: str(v) for k, v in consts.items()},
                str(sorted(attrs.items())),
                options.hash(),
                self.target.arch,
                self.backend_keys[self.target.arch],
                _compile_env(),
            ],
            sort_keys=True,
        )
        self.launches.append(
            {
                "phase": self.phase,
                "kernel": fn.__name__,
                "key": hashlib.sha256(key.encode()).hexdigest()[:20],
                "grid": list(grid),
                "tensors": tensors,
                "ints": ints,
                "constexprs": {
                    k: str(v)
                    for k, v in consts.items()
                    if not isinstance(v, type(None))
                },
                "_compile": (fn, signature, constexprs, attrs, options),
            }
        )


def _compile_env() -> list:
    """The environment variables that Triton says change a compile, with their values
    (none set: an empty list; an older Triton without the list: the same)."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        return []
    return sorted(get_cache_invalidating_env_vars().items())


def _compile_and_read(
    fn, signature, constexprs, attrs, options, target, key: str, need_ptx: bool = False
) -> dict:
    """Lower one specialized variant to PTX (Triton's pipeline), run ptxas -v, read the
    PTX; cached. Unless the PTX itself is asked for, a variant of the recorded table is
    read from there."""
    import triton

    # The recorded table first: it is what the tests check (verify_recorded compares it
    # with a fresh compile), and a local entry of the same key says the same.
    if not need_ptx and key in recorded():
        return dict(recorded()[key])
    path = CACHE / f"{key}.json"
    cached = _cached(path, triton.__version__)
    if cached is not None:
        return cached
    # Two processes that need the same variant at once (a chapter's inspector cell and
    # the test suite's, both cold) compile it once: the second waits for the first's
    # entry. (A variant that fails to compile is not cached: each compiles it again.)
    # One lock per first two hex digits of the key: 256 small files, and two different
    # variants rarely wait for each other with a few compilers running.
    with _compile_lock(key):
        cached = _cached(path, triton.__version__)
        return (
            cached
            if cached is not None
            else _compile(fn, signature, constexprs, attrs, options, target, path)
        )


def _cached(path: pathlib.Path, version: str) -> dict | None:
    if not path.exists():
        return None
    try:
        cached = json.loads(path.read_text())
    except ValueError:
        return None
    # Another Triton compiles the same source differently: its entry does not count
    # (entries written before the version was recorded are taken as they are).
    if cached.get("triton", version) != version:
        return None
    try:  # read now: a cache kept between CI runs drops what no run reads any more
        os.utime(path)
    except OSError:
        pass
    if "ptx" in cached:  # the hash as _ptx_sha computes it now, whenever it was written
        cached["ptx_sha"] = _ptx_sha(cached["ptx"])
    return cached


def _ptx_sha(ptx: str) -> str:
    """The PTX's hash, less what names the checkout's and the virtual environment's
    paths, which differ between two clones of the same source: the ``.file`` lines and
    the DWARF sections after the code (``.section .debug_info`` spells the path in
    bytes)."""
    code = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    lines = [ln for ln in code.splitlines() if not ln.lstrip().startswith(".file")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


#: What the recorded table holds of an entry: everything the rows are made from. Not the
#: PTX (90 KB a variant), nor the compile's duration (differs run to run).
_NOT_RECORDED = ("ptx", "compile_s", "triton")
_RECORDED_CACHE: dict = {}


def recorded_path() -> pathlib.Path | None:
    env = os.environ.get("NORMBOOK_INSPECT_RECORDED")
    if env is None:
        return RECORDED
    return pathlib.Path(env) if env else None


#: What analysis_version hashes: the functions and patterns that make an entry.
_ANALYSIS = {
    "_access_bits",
    "analyze_ptx",
    "_ptxas",
    "parse_ptxas_log",
    "_ptx_sha",
    "_compile",
    "_PARAM",
    "_ACCESS",
    "_ADDR",
    "_REG",
    "_LABEL",
    "_BRANCH",
    "_MATH",
    "_TYPE_BITS",
}


_ANALYSIS_VERSION: list = []
# The recorded table is loaded, and the reader's version computed, once per process,
# under this lock: CPython 3.11's ast.parse fails when two threads run it at once ("AST
# constructor recursion depth mismatch"), and the inspector's compiles can be threads.
_RECORDED_LOCK = threading.RLock()


def analysis_version() -> str:
    """A hash of the code that turns the compiler's output into an entry (the PTX
    reader, the ptxas log's parser, the PTX's hash), as code (its syntax tree, wherever
    in the inspector's files it lives, comments and docstrings aside): an entry
    keeps its variant's key when this code changes, so the recorded table names the
    version it was read with, and another version's table is not read."""
    with _RECORDED_LOCK:
        if not _ANALYSIS_VERSION:
            _ANALYSIS_VERSION.append(_analysis_version())
        return _ANALYSIS_VERSION[0]


def _analysis_version() -> str:
    import ast

    parts = []
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = getattr(node, "targets", [])
            names = (
                {node.name}
                if isinstance(node, ast.FunctionDef)
                else {t.id for t in targets if isinstance(t, ast.Name)}
            )
            if names & _ANALYSIS:
                parts.append(ast.dump(_without_docstring(node)))
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()[:16]


def _without_docstring(node):
    """The node as code, not as text: a docstring, a comment, a line break or the
    module the function lives in do not change what it computes."""
    import ast
    import copy

    body = getattr(node, "body", None)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node = copy.copy(node)
        node.body = body[1:]
    return node


def recorded_header(path: pathlib.Path | None = None) -> dict:
    """The recorded table's first line (``{"triton": ..., "analysis": ...,
    "variants": ...}``), or ``{}`` where there is none."""
    path = path or recorded_path()
    if path is None or not path.exists():
        return {}
    with open(path) as f:
        return json.loads(f.readline() or "{}")


def recorded(path: pathlib.Path | None = None) -> dict:
    """{variant key: what the compiler reported} from the recorded table, or ``{}``
    where there is none, or it was recorded by another Triton (whose keys would not
    match anyway: a key names Triton's version) or read by another version of this
    module's reader (:func:`analysis_version`). A line that is not an entry (a merge's
    conflict marker) is an error naming the file and the line."""
    path = path or recorded_path()
    if path is None:
        return {}
    with _RECORDED_LOCK:
        if path in _RECORDED_CACHE:
            return _RECORDED_CACHE[path]
        return _load_recorded(path)


def _load_recorded(path: pathlib.Path) -> dict:
    import triton

    table = {}
    header = recorded_header(path)
    if (
        header.get("triton") == triton.__version__
        and header.get("analysis") == analysis_version()
    ):
        with open(path) as f:
            next(f)
            for n, line in enumerate(f, start=2):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    table[entry.pop("key")] = entry
                except (ValueError, KeyError, AttributeError) as exc:
                    raise ValueError(
                        f"{path}, line {n}: not an entry of the recorded "
                        f"table ({exc}): record it again "
                        f"(make inspect-record)"
                    ) from None
    _RECORDED_CACHE[path] = table
    return table


def write_recorded(
    rows: list[dict], path: pathlib.Path | None = None, use_recorded: bool = True
) -> int:
    """Record what the compiler reported for every variant of ``rows`` (from the
    inspector's cache, or, with ``use_recorded``, the table already recorded): one
    JSON line per variant, sorted by key, after a header naming Triton's version and
    the reader's (:func:`analysis_version`). Returns the count."""
    import triton

    path = path or RECORDED
    entries, missing = {}, []
    for r in rows:
        key = r["variant"]
        if "error" in r or key in entries:
            continue
        info = _cached(CACHE / f"{key}.json", triton.__version__) or (
            recorded(path).get(key) if use_recorded else None
        )
        if info is None:
            missing.append(key)
            continue
        entries[key] = {k: v for k, v in info.items() if k not in _NOT_RECORDED}
    if missing:
        raise RuntimeError(
            f"{len(missing)} variants neither cached nor recorded "
            f"(first: {missing[0]}): inspect them first"
        )
    header = {
        "triton": triton.__version__,
        "analysis": analysis_version(),
        "variants": len(entries),
        "note": "what Triton's compiler and ptxas reported for every variant "
        "of the test suite's table (normbook.lab.inspector.survey), by variant "
        "key; written by python -m normbook.lab.inspector --record",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(header) + "\n")
        for key in sorted(entries):
            f.write(
                json.dumps(
                    {"key": key, **entries[key]}, sort_keys=True, separators=(",", ":")
                )
                + "\n"
            )
    tmp.replace(path)
    _RECORDED_CACHE.pop(path, None)
    return len(entries)


@contextlib.contextmanager
def _compile_lock(key: str):
    import fcntl

    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"compile-{key[:2]}.lock", "a") as f:
        try:  # released when the holder exits, however it does
            fcntl.flock(f, fcntl.LOCK_EX)
            locked = True
        except OSError:  # a file system without flock (a network one): compile anyway
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _compile(fn, signature, constexprs, attrs, options, target, path) -> dict:
    import triton
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    _PTXAS_LOGS.clear()
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=target,
            options=options.__dict__,
        )
    # a variant that does not compile is a result, reported per row
    except Exception as exc:
        last = " | ".join(str(exc).strip().splitlines()[-4:])
        return {"error": f"{type(exc).__name__}: " + last}
    ptx = compiled.asm["ptx"]
    names = [p.name for p in fn.params]
    # PTX parameters are the kernel's non-constexpr arguments, in order.
    runtime = [n for n in names if signature[n] != "constexpr"]
    pointers = {
        i: n for i, n in enumerate(runtime) if str(signature[n]).startswith("*")
    }
    info = {
        "ptx_sha": _ptx_sha(ptx),
        "num_warps": compiled.metadata.num_warps,
        "shared": compiled.metadata.shared,
        **(
            parse_ptxas_log(_PTXAS_LOGS[-1])
            if _PTXAS_LOGS
            else _ptxas(ptx, target.arch, options.enable_fp_fusion)
        ),
        **analyze_ptx(ptx, pointers),
        "compile_s": round(time.perf_counter() - t0, 3),
        "triton": triton.__version__,
    }
    info["ptx"] = ptx
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)
    return info


def _calls(label: str, M: int, N: int, dtype: str, which: set[str] | None):
    """(call, (forward, backward)) for every launch the specs ask for at one shape
    (:func:`normbook.lab.specs.inspector_launches`): the forward without gradients,
    and, for a spec with arguments to differentiate, the call with those requiring
    grad followed by its backward (a generator: the forward's launches, ``yield``, the
    backward's launches)."""
    import torch

    from normbook.lab.specs import Make, inspector_launches, torch_kwargs

    dt = {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp64": torch.float64,
    }[dtype]
    # Uninitialized and never touched: nothing runs, so a 2**26-element input costs no
    # time. Row-sized inputs are remembered: their loads are the ones checked.
    make = Make(dt, empty=True, on_input=lambda t: _INPUTS.add(t.data_ptr()))

    def pair(launch):
        fn, kwargs = launch.spec.fn(), torch_kwargs(launch.kwargs)

        def inputs(grad):
            args = launch.inputs(M, N, make)
            for name in grad:
                args[name].requires_grad_()
            return args

        def forward():
            fn(**inputs(()), **kwargs)

        def backward():
            outs = fn(**inputs(launch.grad), **kwargs)
            outs = [
                o
                for o in (outs if isinstance(outs, tuple) else (outs,))
                if o.grad_fn is not None
            ]
            yield
            grads = [torch.empty_like(o) for o in outs]  # dy: an input of the backward
            _INPUTS.update(g.data_ptr() for g in grads)
            torch.autograd.backward(outs, grads)

        return forward, backward if launch.grad else None

    return [
        (launch.call, pair(launch))
        for launch in inspector_launches(label, M, N, dtype)
        if which is None or launch.call in which
    ]


def _row(
    launch: dict,
    info: dict,
    gpu: GPU,
    arch: int,
    label: str,
    M: int,
    N: int,
    dtype: str,
    call: str,
    latency_ns: float,
) -> dict:
    row = {
        "arch": arch,
        "call": call,
        "phase": launch["phase"],
        "kernel": launch["kernel"],
        "shape": label,
        "M": M,
        "N": N,
        "dtype": dtype,
        "grid": int(math.prod(launch["grid"])),
        "constexprs": launch["constexprs"],
        "variant": launch["key"],
    }
    if "error" in info:
        row["error"] = info["error"]
        return row
    warps = info["num_warps"]
    smem = info["shared"] + info["static_smem"]
    ctas, limiter = occupancy(gpu, info["registers"], warps, smem)
    tensors = launch["tensors"]
    rows_like = {k for k, t in tensors.items() if len(t["shape"]) >= 2}
    loads, stores = {}, {}
    for a in info["accesses"]:
        for arg in a["args"] or ["?"]:
            d = loads if a["op"] == "ld" else stores
            d.setdefault(arg, set()).add(a["bits"])
    # Bytes a CTA can have in flight: the row-sized loads issued together (same
    # innermost loop, or the straight-line code), per thread, times the threads.
    groups: dict = {}
    for a in info["accesses"]:
        if a["op"] == "ld" and set(a["args"]) & rows_like:
            key = tuple(a["loop"]) if a["loop"] else None
            groups[key] = groups.get(key, 0) + a["bits"] // 8
    per_cta = max(groups.values(), default=0) * 32 * warps
    # CTAs per SM, on average, at once
    resident = min(ctas, row["grid"] / gpu.sms)
    in_flight = resident * per_cta
    need = littles_law_bytes(gpu, latency_ns)
    waves = row["grid"] / (gpu.sms * max(ctas, 1))
    # The last wave's idle SMs (tail effect); under one wave ``resident`` already counts
    # them.
    wave_eff = waves / math.ceil(waves) if waves > 1 else 1.0
    row.update(
        {
            "num_warps": warps,
            "registers": info["registers"],
            "spill_stores": info["spill_stores"],
            "spill_loads": info["spill_loads"],
            "smem": smem,
            "loads": {k: sorted(v) for k, v in sorted(loads.items())},
            "stores": {k: sorted(v) for k, v in sorted(stores.items())},
            # The row-sized inputs of the public call (x, dy, a residual, q, k, cos, sin),
            # as passed: the tensors whose load width the tests check (not the kernels' own
            # buffers).
            "row_args": sorted(k for k in rows_like if tensors[k].get("input")),
            "math": info["math"],
            "ctas_per_sm": ctas,
            "occupancy_limit": limiter,
            "waves": round(waves, 3),
            "in_flight_per_sm": round(in_flight),
            "littles_per_sm": round(need),
            "predicted": round(min(1.0, in_flight / need) * wave_eff, 3)
            if need
            else None,
            "ptx_sha": info["ptx_sha"],
        }
    )
    return row


def measured_gpu(
    gpu: GPU,
    bandwidth_gbps: float | None = None,
    sms: int | None = None,
    name: str | None = None,
) -> GPU:
    """``gpu`` with what was measured on a real one: the copy bandwidth (GB/s) in place
    of the datasheet's, so that ``predicted`` becomes a fraction of the *measured* copy
    bandwidth (the benchmark's ``pct_of_copy``), and the SM count the device reports."""
    import dataclasses

    changes = {}
    if bandwidth_gbps:
        changes["bandwidth"] = bandwidth_gbps * 1e9
    if sms:
        changes["sms"] = sms
    if name:
        changes["name"] = (
            f"{name} ({sms or gpu.sms} SMs, measured copy {bandwidth_gbps or 0:.0f} "
            "GB/s)"
        )
    return dataclasses.replace(gpu, **changes) if changes else gpu


def _child(argv: list[str]) -> int:
    """Runs in its own process: fake CUDA, import normbook, capture, compile, write JSON
    rows. ``--units``: a JSON file listing [index, arch, dtype, calls, shapes]; each
    unit's rows go to ``<out-dir>/unit<index>.json`` as soon as it is done (a child
    stopped at a deadline keeps the units it finished)."""
    p = argparse.ArgumentParser()
    p.add_argument("--units", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--phases", default="forward,backward")
    p.add_argument("--latency-ns", type=float, default=LATENCY_NS)
    p.add_argument("--ptx", action="store_true")
    p.add_argument("--bandwidth-gbps", type=float, default=None)
    p.add_argument("--sms", type=int, default=None)
    p.add_argument("--gpu-name", default=None)
    a = p.parse_args(argv)
    units = json.loads(pathlib.Path(a.units).read_text())
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(SOURCE_ROOT))
    _fake_cuda(units[0][1])
    import datetime

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    import normbook
    import normbook._validate

    assert not normbook.INTERPRET, (
        "the kernels must be defined for the GPU compiler, not interpreted"
    )
    # The tensors stay on the CPU (nothing runs): let the argument checks accept them.
    normbook._validate.DEVICE = torch.device("cpu")
    _keep_ptxas_logs()
    capture = _Capture()
    JITFunction.run = lambda self, *args, grid, warmup=False, **kw: capture.run(
        self, args, kw, grid
    )
    binders = {}  # per architecture: the JIT's binders depend on the back end
    for index, arch, dtype, calls, unit_shapes in units:
        # Every child is given every unit and takes the next one nobody has claimed: the
        # children share the work however long each unit takes.
        try:
            os.close(
                os.open(
                    pathlib.Path(a.out_dir) / f"unit{index}.claim",
                    os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                )
            )
        except FileExistsError:
            continue
        if arch not in binders:
            GPUS[arch] = measured_gpu(GPUS[arch], a.bandwidth_gbps, a.sms, a.gpu_name)
        # kernels reads the device's capability and SM count at each call, not at import
        _fake_cuda(arch)
        capture.target = GPUTarget("cuda", arch, 32)
        capture.binders = binders.setdefault(arch, {})
        rows = _unit_rows(
            capture,
            GPUS[arch],
            arch,
            dtype,
            calls,
            unit_shapes,
            a.phases.split(","),
            a.latency_ns,
            a.ptx,
            torch,
        )
        meta = {
            "triton": triton.__version__,
            "torch": torch.__version__,
            "latency_ns": a.latency_ns,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "note": "compiled on a CPU for the target GPU; every column but "
            "'predicted' is the compiler's output, 'predicted' is a model, "
            "not a measurement",
            "gpus": {str(arch): asdict(GPUS[arch])},
            "littles_per_sm": {str(arch): littles_law_bytes(GPUS[arch], a.latency_ns)},
        }
        out = pathlib.Path(a.out_dir) / f"unit{index}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}))
        tmp.replace(out)
    return 0


def _unit_rows(
    capture, gpu, arch, dtype, calls, unit_shapes, phases, latency_ns, ptx, torch
) -> list[dict]:
    """One unit's rows: every launch of ``calls`` (all when empty) at each shape."""
    if unit_shapes in ("all", "bench", "decode"):
        shapes = [s for s in bench_shapes() if unit_shapes in ("all", s[0])]
    else:
        shapes = [
            (s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2]))
            for s in unit_shapes.split(",")
        ]
    which = set(calls.split(",")) if calls else None
    rows = []
    for label, M, N in shapes:
        for call, (forward, backward) in _calls(label, M, N, dtype, which):
            seen = set()
            for phase, fn in (("forward", forward), ("backward", backward)):
                if fn is None or phase not in phases:
                    continue
                _INPUTS.clear()
                capture.launches, capture.phase = [], "forward"
                grad_mode = torch.no_grad if phase == "forward" else torch.enable_grad
                with grad_mode():
                    gen = fn()
                    # A backward is a generator: forward launches, then backward ones
                    # (it stops at once when the function refuses inputs requiring
                    # grad).
                    started = phase == "backward" and (
                        next(gen, StopIteration) is not StopIteration
                    )
                    if started:
                        capture.phase = "backward"
                        next(gen, None)
                for launch in capture.launches:
                    ident = (launch["phase"], launch["key"], tuple(launch["grid"]))
                    if ident in seen:  # the forward of a backward case: already listed
                        continue
                    seen.add(ident)
                    info = _compile_and_read(
                        *launch["_compile"], capture.target, launch["key"], need_ptx=ptx
                    )
                    row = _row(
                        launch, info, gpu, arch, label, M, N, dtype, call, latency_ns
                    )
                    if ptx and "ptx" in info:
                        row["ptx"] = info["ptx"]
                    rows.append(row)
    return rows


# ---------------------------------------------------------------- the parent's API


def _child_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(SOURCE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_inspector(
    archs=(90,),
    dtypes=DTYPES,
    shapes="all",
    calls=None,
    latency_ns=LATENCY_NS,
    ptx=False,
    timeout=4 * 3600,
    jobs=None,
    call_shapes=None,
    gpu_args=(),
    partial=False,
    phases=("forward", "backward"),
    units=None,
    env=None,
) -> dict:
    """Run the inspector in child processes; returns ``{"meta": ..., "rows": [...]}``.

    ``shapes``: "all", "bench", "decode", or a list of (label, M, N). ``calls``: names
    such as "rms_norm", "layer_norm", "fused_add_rms_norm", "qk_norm_rope",
    "row_variance.welford". ``call_shapes``: instead of calls × shapes, {call: [(label,
    M, N), ...]}, one unit each (the GPU day inspects each kernel at the shapes it
    measured). ``phases``: "forward", "backward" or both (a backward case lists the
    forward's launches too, once). ``jobs``: children at once (default: one per core).
    ``gpu_args``: extra child arguments (--bandwidth-gbps, --sms, --gpu-name: see
    :func:`measured_gpu`). ``partial``: past ``timeout`` seconds, return the units that
    finished (``meta.units_not_finished``) instead of raising. ``units``: instead of
    archs × dtypes × calls × shapes, the units themselves, [(arch, dtype, call,
    shapes), ...]. ``env``: set in the children's environment."""

    def spec(sh):
        return (
            sh
            if isinstance(sh, str)
            else ",".join(f"{lab}:{m}:{n}" for lab, m, n in sh)
        )

    archs = [archs] if isinstance(archs, int) else list(archs)
    if units is not None:  # they name their own archs, dtypes, calls and shapes
        archs = sorted({u[0] for u in units})
    unknown = [a for a in archs if a not in GPUS]
    if unknown:
        raise ValueError(f"archs: {unknown} unknown; choose from {sorted(GPUS)}")
    phases = [phases] if isinstance(phases, str) else list(phases)
    if not phases or not set(phases) <= {"forward", "backward"}:
        raise ValueError(
            f"phases must be 'forward', 'backward' or both, not {phases!r}"
        )
    if call_shapes:
        work = [([call], spec(sh)) for call, sh in call_shapes.items()]
    else:
        work = [(calls or [], spec(shapes))]
    boot = (
        "import importlib.util, sys; "
        f"s = importlib.util.spec_from_file_location('_kernels_inspect_child', "
        f"{str(__file__)!r}); "
        "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; "
        "s.loader.exec_module(m); "
        "sys.exit(m._child(sys.argv[1:]))"
    )
    with tempfile.TemporaryDirectory() as tmp:
        # Units of (architecture, dtype, calls, shapes), shared by as many children as
        # there are cores (compiling is the cost): each child imports torch and kernels
        # once (seconds) and then takes units until none is left.
        todo = (
            [(arch, dt, [c], spec(sh)) for arch, dt, c, sh in units]
            if units is not None
            else [
                (arch, dt, c, sh) for arch in archs for dt in dtypes for c, sh in work
            ]
        )
        units = [
            (i, arch, dt, ",".join(c), sh) for i, (arch, dt, c, sh) in enumerate(todo)
        ]  # numbered: the children's listing
        if not units:  # no architecture or no dtype asked for: nothing to compile
            return {"meta": {}, "rows": []}
        jobs = max(1, min(len(units), jobs or os.cpu_count() or 1))
        listing = pathlib.Path(tmp) / "units.json"
        listing.write_text(json.dumps(units))
        cmd = [
            sys.executable,
            "-c",
            boot,
            "--units",
            str(listing),
            "--out-dir",
            tmp,
            "--phases",
            ",".join(phases),
            "--latency-ns",
            str(latency_ns),
            *gpu_args,
        ] + (["--ptx"] if ptx else [])
        children = []
        try:
            for j in range(jobs):
                with open(pathlib.Path(tmp) / f"child{j}.log", "w") as log:
                    children.append(
                        subprocess.Popen(
                            cmd,
                            stdout=subprocess.DEVNULL,
                            stderr=log,
                            env={**_child_env(), **(env or {})},
                            cwd=ROOT,
                        )
                    )
            deadline = time.monotonic() + max(1.0, timeout)
            while True:  # every child watched at once: the first to fail stops the run
                codes = [proc.poll() for proc in children]
                for j, code in enumerate(codes):
                    if code not in (None, 0):
                        err = (pathlib.Path(tmp) / f"child{j}.log").read_text()
                        raise RuntimeError(
                            f"normbook.lab.inspector child failed ({code}):\n"
                            f"{err[-4000:]}"
                        )
                if all(code == 0 for code in codes):
                    break
                if time.monotonic() > deadline:
                    if not partial:
                        raise subprocess.TimeoutExpired(cmd[:3], timeout)
                    break  # out of time (the GPU day's budget): keep the finished units
                time.sleep(0.1)
        finally:
            for proc in children:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        parts = [pathlib.Path(tmp) / f"unit{i}.json" for i, *_ in units]
        dropped = sum(not part.exists() for part in parts)
        result = {
            "meta": {"units_not_finished": dropped} if dropped else {},
            "rows": [],
        }
        for part in parts:  # in the units' order, whichever child did each
            if not part.exists():
                continue
            part = json.loads(part.read_text())
            for k, v in part["meta"].items():
                if isinstance(v, dict):
                    result["meta"].setdefault(k, {}).update(v)
                else:
                    result["meta"][k] = v
            result["rows"] += part["rows"]
        return result


#: The odd sizes of the test suite's table: N = 1000 is not a multiple of 16 (no 128-bit
#: specialization), N = 40,000 a row that the kernels loop over.
ODD_SHAPES = [("odd", 6, 1000), ("odd", 6, 40000)]


def survey(**kwargs) -> list[dict]:
    """Every variant the test suite checks (tests/lab/test_inspect.py): every call at
    the benchmark's, decode and odd shapes, for sm_90, sm_80 and sm_75, in fp32, fp16
    and bf16, and in fp64 (which the gradient checks launch) at the odd shapes."""
    rows = run_inspector(
        archs=ARCHS, dtypes=DTYPES, shapes=bench_shapes() + ODD_SHAPES, **kwargs
    )["rows"]
    rows += run_inspector(archs=ARCHS, dtypes=("fp64",), shapes=ODD_SHAPES, **kwargs)[
        "rows"
    ]
    return rows


def _unit_of(row: dict) -> tuple:
    return (row["arch"], row["dtype"], row["call"], row["shape"], row["M"], row["N"])


def _from_nothing(folder: pathlib.Path) -> dict:
    """The children's environment for compiling from nothing: the inspector's cache and
    Triton's both new folders under ``folder``, and no recorded table."""
    return {
        "NORMBOOK_INSPECT_CACHE": str(folder / "inspect"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
        "NORMBOOK_INSPECT_RECORDED": "",
    }


def verify_recorded(
    rows: list[dict], seed: int, jobs=None, phases=("forward", "backward")
) -> dict:
    """Compile again, from nothing, one unit (arch, dtype, call, shape) of ``rows`` per
    call, chosen at random by ``seed``: with the inspector's cache and Triton's both
    empty and no recorded table, in child processes. Returns the units, how many rows
    were compiled, and every unit whose rows differ from those of ``rows``
    (``mismatches``: [(unit, field, recorded, compiled)]). ``phases``: those ``rows``
    were inspected with."""
    import random

    rng = random.Random(seed)
    by_call: dict = {}
    for r in rows:
        if "error" not in r:
            by_call.setdefault(r["call"], set()).add(_unit_of(r))
    picks = [rng.choice(sorted(by_call[c])) for c in sorted(by_call)]
    with tempfile.TemporaryDirectory() as tmp:
        fresh = run_inspector(
            units=[(a, d, c, [(lab, m, n)]) for a, d, c, lab, m, n in picks],
            env=_from_nothing(pathlib.Path(tmp)),
            jobs=jobs,
            phases=phases,
        )["rows"]
    mismatches = []
    for unit in picks:
        want = [r for r in rows if _unit_of(r) == unit]
        got = [r for r in fresh if _unit_of(r) == unit]
        if len(want) != len(got):
            mismatches.append((unit, "launches", len(want), len(got)))
            continue
        for w, g in zip(want, got):
            for field in sorted(set(w) | set(g)):
                if w.get(field) != g.get(field):
                    mismatches.append(
                        (unit, f"{w['kernel']}.{field}", w.get(field), g.get(field))
                    )
    return {
        "seed": seed,
        "units": picks,
        "compiled": len(fresh),
        "mismatches": mismatches,
    }


def inspect_variants(arch: int = 90, **kwargs) -> list[dict]:
    """One row per (call, phase, kernel launch, shape, dtype) for ``arch`` (90, 80 or
    75)."""
    return run_inspector(archs=(arch,), **kwargs)["rows"]


def _widths(d: dict, rows_like: list) -> str:
    return (
        " ".join(f"{k}:{'/'.join(map(str, v))}" for k, v in d.items() if k in rows_like)
        or "-"
    )


def _math(m: dict) -> str:
    keep = {
        k: v
        for k, v in m.items()
        if k.startswith(("sqrt", "rsqrt", "div.full", "div.rn", "rcp"))
    }
    return " ".join(f"{k}" for k in sorted(keep)) or "-"


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'call':<22}{'phase':<9}{'kernel':<24}{'dtype':<5}{'shape':<7}"
        f"{'M':>8}{'N':>8} "
        f"{'warps':>5}{'regs':>5}{'spill':>6}{'smem':>7}{'CTA/SM':>7} "
        f"{'limit':<10}{'grid':>7}"
        f"{'waves':>7}{'inflight':>9}{'need':>7}{'pred':>6}  loads(bits)  math"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(
                f"{r['call']:<22}{r['phase']:<9}{r['kernel']:<24}{r['dtype']:<5}"
                f"{r['shape']:<7}{r['M']:>8}{r['N']:>8}  "
                f"COMPILE ERROR: {r['error']}"
            )
            continue
        out.append(
            f"{r['call']:<22}{r['phase']:<9}{r['kernel']:<24}{r['dtype']:<5}"
            f"{r['shape']:<7}{r['M']:>8}{r['N']:>8} "
            f"{r['num_warps']:>5}{r['registers']:>5}{r['spill_stores']:>6}"
            f"{r['smem']:>7}"
            f"{r['ctas_per_sm']:>7} "
            f"{r['occupancy_limit']:<10}{r['grid']:>7}{r['waves']:>7.2f}"
            f"{r['in_flight_per_sm'] / 1024:>8.1f}K"
            f"{r['littles_per_sm'] / 1024:>6.1f}K{r['predicted']:>6.2f}  "
            f"{_widths(r['loads'], r['row_args'])}  {_math(r['math'])}"
        )
    return "\n".join(out)


COLUMNS = {  # column title: how to read it from a row (for markdown_table)
    "kernel": lambda r: r["kernel"],
    "phase": lambda r: r["phase"],
    "M": lambda r: r["M"],
    "N": lambda r: r["N"],
    "warps": lambda r: r["num_warps"],
    "regs": lambda r: r["registers"],
    "spill B": lambda r: r["spill_stores"] + r["spill_loads"],
    "CTA/SM": lambda r: r["ctas_per_sm"],
    "limit": lambda r: r["occupancy_limit"],
    "grid": lambda r: r["grid"],
    "waves": lambda r: f"{r['waves']:.2f}",
    "in flight KiB": lambda r: f"{r['in_flight_per_sm'] / 1024:.1f}",
    "needed KiB": lambda r: f"{r['littles_per_sm'] / 1024:.1f}",
    "predicted": lambda r: f"{r['predicted']:.2f}",
    "row loads": lambda r: _widths(r["loads"], r["row_args"]),
    "sqrt/div": lambda r: _math(r["math"]),
}


def markdown_table(rows: list[dict], columns=tuple(COLUMNS)) -> str:
    """The rows as a Markdown table (a chapter displays it with IPython's Markdown)."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['kernel']} | compile error: {r['error']} |")
            continue
        out.append(
            "| "
            + " | ".join(str(COLUMNS[c](r)).replace("|", "/") for c in columns)
            + " |"
        )
    return "\n".join(out)


_SHORT_DTYPE = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "float64": "fp64",
}


def measured_vs_predicted(bench: dict, inspected: dict) -> dict:
    """Per benchmark row of our kernels: the measured fraction of the copy bandwidth
    (the benchmark's ``pct_of_copy`` / 100) beside the inspector's ``predicted`` for the
    same call, phase, shape and dtype (the smallest over the phase's launches; each
    launch listed).

    ``bench`` is a benchmark JSON (``python -m normbook.lab.bench``), ``inspected`` the
    inspector's JSON for the same GPU, ideally run with ``--bandwidth-gbps`` set to the
    measured copy bandwidth so that both fractions have the same denominator
    (``meta.same_denominator``).
    """
    prov = bench.get("provenance", {})
    dtype = _SHORT_DTYPE.get(prov.get("dtype", ""), prov.get("dtype"))
    copy = bench.get("copy", {}).get("GB/s")
    launches: dict = {}
    for r in inspected.get("rows", []):
        if "error" in r:
            continue
        launches.setdefault(
            (r["call"], r["phase"], r["M"], r["N"], r["dtype"]), []
        ).append(r)
    rows = []
    for b in bench.get("results", []):
        if (
            b.get("provider") != "normbook"
            or b.get("status") != "ok"
            or b.get("pct_of_copy") is None
        ):
            continue
        found = launches.get((b["kernel"], b["direction"], b["M"], b["N"], dtype), [])
        preds = [r["predicted"] for r in found if r.get("predicted") is not None]
        measured = b["pct_of_copy"] / 100
        predicted = min(preds) if preds else None
        rows.append(
            {
                "case": f"{b['kernel']}.{b['direction']}",
                "regime": b.get("regime", ""),
                "M": b["M"],
                "N": b["N"],
                "dtype": dtype,
                "ms": b["ms"],
                "GB/s": b["GB/s"],
                "measured": round(measured, 4),
                "predicted": predicted,
                "measured / predicted": (
                    round(measured / predicted, 3) if predicted else None
                ),
                "launches": [
                    {
                        "kernel": r["kernel"],
                        "predicted": r["predicted"],
                        "grid": r["grid"],
                        "ctas_per_sm": r["ctas_per_sm"],
                        "registers": r["registers"],
                        "spill_bytes": r["spill_stores"] + r["spill_loads"],
                    }
                    for r in found
                ],
            }
        )
    meta = inspected.get("meta", {})
    bandwidths = {k: v.get("bandwidth") for k, v in meta.get("gpus", {}).items()}
    same = bool(copy) and any(
        bw and abs(bw / 1e9 - copy) <= 0.5 for bw in bandwidths.values()
    )
    return {
        "meta": {
            "gpu": prov.get("gpu"),
            "date": prov.get("date"),
            "torch": prov.get("torch"),
            "triton": prov.get("triton"),
            "cuda": prov.get("cuda"),
            "dtype": dtype,
            "copy_GB/s": copy,
            "smoke": prov.get("smoke"),
            "latency_ns": meta.get("latency_ns"),
            "inspector_triton": meta.get("triton"),
            "same_denominator": same,
            "note": "measured: GB/s over the measured copy GB/s; predicted: the "
            "inspector's "
            "model (Little's law and waves), not a measurement",
        },
        "rows": rows,
    }


def comparison_markdown(table: dict) -> str:
    """:func:`measured_vs_predicted` as a Markdown table."""
    m = table["meta"]
    copy = f"{m['copy_GB/s']:.0f} GB/s" if m.get("copy_GB/s") else "unknown"
    head = [
        f"Measured on {m['gpu']} ({m['date']}; torch {m['torch']}, triton "
        f"{m['triton']}, "
        f"CUDA {m['cuda']}; {m['dtype']}; copy {copy}) against the inspector's "
        "prediction "
        f"(triton {m['inspector_triton']}, {m['latency_ns']} ns assumed latency).",
        "",
        "| case | M | N | ms | measured % of copy | predicted % | measured / predicted "
        "| launches |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}"

    for r in table["rows"]:
        each = (
            ", ".join(f"{x['kernel']} {pct(x['predicted'])}" for x in r["launches"])
            or "not inspected"
        )
        ratio = (
            "-"
            if r["measured / predicted"] is None
            else f"{r['measured / predicted']:.2f}"
        )
        head.append(
            f"| {r['case']} | {r['M']} | {r['N']} | {r['ms']:.4f} | "
            f"{pct(r['measured'])} | "
            f"{pct(r['predicted'])} | {ratio} | {each} |"
        )
    return "\n".join(head)


def ptx_excerpt(ptx: str, max_lines: int = 14) -> str:
    """The lines of a kernel's PTX that the chapter reads: global loads and stores, the
    square root / division / reciprocal instructions, and the branches that close
    loops."""
    keep = re.compile(r"\b(ld|st)\.global|\b(sqrt|rsqrt|div|rcp)\.|\bbra\b|^\$L__BB")
    lines = [line.strip() for line in ptx.splitlines() if keep.search(line.strip())]
    return "\n".join(lines[:max_lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m normbook.lab.inspector", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--arch",
        default="90",
        help="90 (H100/H200), 80 (A100), 75 (T4); comma-separated for several",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write the table (with provenance) as JSON to FILE",
    )
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--shapes", default="all", choices=["all", "bench", "decode"])
    p.add_argument(
        "--calls", default="", help="comma-separated subset, e.g. rms_norm,layer_norm"
    )
    p.add_argument("--latency-ns", type=float, default=LATENCY_NS)
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="child processes at once (default: the CPU count)",
    )
    p.add_argument(
        "--call-shapes",
        default="",
        help="per call, its own shapes: "
        "'rms_norm=plan:1024:131072,plan:1:4096;softmax=...' "
        "(instead of --calls × --shapes)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        help="a measured copy bandwidth in place of the datasheet's",
    )
    p.add_argument("--sms", type=int, help="the SM count of the GPU measured")
    p.add_argument("--gpu-name", help="the name of the GPU measured")
    p.add_argument(
        "--timeout-s",
        type=float,
        help="after this many seconds, keep what finished (the GPU day's budget)",
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="inspect the test suite's whole table (every arch and dtype) "
        "and write it to data/inspect/variants.jsonl (what is recorded or "
        "cached already is read, the rest is compiled)",
    )
    p.add_argument(
        "--from-scratch",
        action="store_true",
        help="with --record: read nothing, compile every variant (no "
        "table, no cache of the inspector's or Triton's)",
    )
    a = p.parse_args(argv)
    if a.record:
        global CACHE
        if not (ROOT / "pyproject.toml").exists():
            p.error(f"--record writes into the repository; {ROOT} is not one")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            if a.from_scratch:
                env = _from_nothing(pathlib.Path(scratch))
                CACHE = pathlib.Path(env["NORMBOOK_INSPECT_CACHE"])
            else:  # the table this writes is the one read
                env = {"NORMBOOK_INSPECT_RECORDED": str(RECORDED)}
            rows = survey(jobs=a.jobs, env=env)
            errors = [r for r in rows if "error" in r]
            n = write_recorded(rows, RECORDED, use_recorded=not a.from_scratch)
        print(
            f"{n} variants recorded in {RECORDED.relative_to(ROOT)} "
            f"({len(errors)} failing to compile, not recorded; "
            f"{time.perf_counter() - t0:.0f} s)"
        )
        return 1 if errors else 0
    archs = [int(s) for s in a.arch.split(",")]
    for arch in archs:
        if arch not in GPUS:
            p.error(f"--arch must be one of {', '.join(map(str, GPUS))}, got {arch}")
    t0 = time.perf_counter()
    call_shapes = {}
    for part in filter(None, a.call_shapes.split(";")):
        call, _, spec = part.partition("=")
        call_shapes[call] = [
            (s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2]))
            for s in spec.split(",")
        ]
    gpu_args = []
    for flag, value in (
        ("--bandwidth-gbps", a.bandwidth_gbps),
        ("--sms", a.sms),
        ("--gpu-name", a.gpu_name),
    ):
        if value:
            gpu_args += [flag, str(value)]
    for arch in archs:
        GPUS[arch] = measured_gpu(GPUS[arch], a.bandwidth_gbps, a.sms, a.gpu_name)
    result = run_inspector(
        archs,
        a.dtypes.split(","),
        a.shapes,
        [c for c in a.calls.split(",") if c],
        a.latency_ns,
        jobs=a.jobs,
        call_shapes=call_shapes or None,
        gpu_args=gpu_args,
        **({"timeout": a.timeout_s, "partial": True} if a.timeout_s else {}),
    )
    rows = result["rows"]
    meta = result["meta"]
    for arch in archs:
        gpu = GPUS[arch]
        print(
            f"sm_{arch}: {gpu.name}, {gpu.bandwidth / 1e12:.3g} TB/s; Little's law "
            f"at {a.latency_ns:.0f} ns "
            f"(assumed, see normbook.lab.inspector.LATENCY_NS): "
            f"{littles_law_bytes(gpu, a.latency_ns) / 1024:.1f} KiB "
            f"in flight per SM. triton {meta.get('triton')}, torch "
            f"{meta.get('torch')}."
        )
        print(
            "'inflight': bytes of row loads a SM has in flight (model); 'pred': "
            "predicted fraction of "
            "bandwidth (a model, not a measurement)"
        )
        print(format_table([r for r in rows if r["arch"] == arch]))
    spills = [r for r in rows if r.get("spill_stores", 0) or r.get("spill_loads", 0)]
    errors = [r for r in rows if "error" in r]
    print(
        f"{len(rows)} launches, {len({r['variant'] for r in rows})} variants, "
        f"{len(spills)} spilling, "
        f"{len(errors)} failing to compile ({time.perf_counter() - t0:.0f} s)"
    )
    if a.json:
        # Written beside, then renamed: a stop mid-write leaves no half file.
        out = pathlib.Path(a.json)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
