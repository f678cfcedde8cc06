"""What the compiler made of each kernel: registers, spills, load widths, occupancy,
without a GPU.

    python -m normbook.lab.inspector            # sm_90 (H100/H200): the table, stdout
    python -m normbook.lab.inspector --arch 80  # sm_80 (A100); 75: sm_75 (T4)
    python -m normbook.lab.inspector --arch 90 --json table.json

Every public function of the package is called at the benchmark's shapes
(normbook.lab.bench: N = 256 … 262,144, M·N = 2**26) and at decode shapes (M = 1, 8, 64
rows of N = 4096 and 8192), forward and backward, in fp32, fp16 and bf16. Instead of
running, each kernel launch is lowered by Triton's own pipeline for the target GPU
**exactly as the JIT lowers it on a device**: the launch's arguments go through the
JIT's binder (``create_function_from_signature``, the code ``JITFunction.run`` calls),
which specializes pointers aligned to 16 bytes and integers divisible by 16; then
``triton.compile`` with the options the launch asked for. ``ptxas -v`` (shipped in
Triton's wheel, run with the flags Triton's own ``make_cubin`` uses) reports registers
and spills; the PTX is read for the width of each global load and store (per kernel
argument) and for the instructions that compute square roots and divisions.

From those, per launch and for the GPU of that architecture (:data:`GPUS`): CTAs per SM
(limited by registers, threads, shared memory or the CTA cap), the grid against the SM
count, and the bytes of global loads a resident SM keeps in flight against what Little's
law asks for to sustain the GPU's bandwidth: ``bytes in flight = bandwidth × latency``
(per SM: divided by the SM count). :data:`LATENCY_NS` is the latency assumed, with its
source. The last column, ``predicted``, is a *model* (min(1, in-flight / needed) × wave
efficiency), not a measurement.

Faking CUDA changes torch for the whole process, so the work runs in child processes,
at most one per core, which share the (architecture, dtype) units between them
(:func:`run_inspector`; :func:`inspect_variants` and ``python -m
normbook.lab.inspector`` call it). Results of a compiled variant are cached on disk
(``NORMBOOK_INSPECT_CACHE``, default ``~/.cache/normbook-inspect``), keyed by Triton's
version, the kernel's source hash, its specialization, options and target.

What the compiler reported for every variant of the test suite's table (:func:`survey`,
about 2,800 variants for three GPUs) is also recorded in the repository,
``data/inspect/variants.jsonl`` (:data:`RECORDED`), under the same keys, without the
PTX: a new machine reads it instead of compiling them all (half an hour on two cores).
A key names Triton's version and every kernel's source, so an edited kernel or another
Triton misses and is compiled. ``python -m normbook.lab.inspector --record`` writes the
table again; the tests check that it covers the survey, and compile a random sample of
it from nothing on every run (:func:`verify_recorded`): it must still say what the
compiler says.

No module of this package imports torch, Triton or ``normbook`` at its top: the child
loads the package from its folder under a name of its own, fakes CUDA and only then
imports ``normbook`` (:mod:`.child`). Its modules, by concern: :mod:`.gpus` (the GPUs
and the model), :mod:`.ptx` and :mod:`.ptxas` (reading the compiler's output),
:mod:`.capture` (faking CUDA, capturing launches), :mod:`.launches` (what each call
launches), :mod:`.shapes`, :mod:`.compiler` (lowering a variant, the on-disk cache),
:mod:`.table` and :mod:`.record` (reading and writing the recorded table),
:mod:`.rows` (a unit's rows), :mod:`.options`, :mod:`.runner` (the children),
:mod:`.suite` (the test suite's table), :mod:`.report` (tables and comparisons) and
:mod:`.cli`.
"""

from . import compiler as _compiler
from .cli import main
from .gpus import (
    ARCHS,
    DATASHEETS,
    DTYPES,
    GPU,
    GPUS,
    LATENCY_NS,
    Datasheet,
    littles_law_bytes,
    measured_gpu,
    occupancy,
)
from .options import InspectOptions
from .paths import DATA, RECORDED, ROOT, SOURCE_ROOT
from .ptx import analyze_ptx
from .ptxas import parse_ptxas_log
from .record import write_recorded
from .report import (
    COLUMNS,
    format_table,
    markdown_table,
    ptx_excerpt,
)
from .runner import inspect_variants, run_inspector
from .shapes import ODD_SHAPES, bench_shapes
from .suite import survey, verify_recorded
from .table import analysis_version, recorded, recorded_header, recorded_path

__all__ = [
    "ARCHS",
    "COLUMNS",
    "DATA",
    "DATASHEETS",
    "DTYPES",
    "Datasheet",
    "GPU",
    "GPUS",
    "LATENCY_NS",
    "ODD_SHAPES",
    "RECORDED",
    "ROOT",
    "SOURCE_ROOT",
    "InspectOptions",
    "analysis_version",
    "analyze_ptx",
    "bench_shapes",
    "format_table",
    "inspect_variants",
    "littles_law_bytes",
    "main",
    "markdown_table",
    "measured_gpu",
    "occupancy",
    "parse_ptxas_log",
    "ptx_excerpt",
    "recorded",
    "recorded_header",
    "recorded_path",
    "run_inspector",
    "survey",
    "verify_recorded",
    "write_recorded",
]


def __getattr__(name: str):
    # CACHE is the compiler module's, which --record --from-scratch and the tests
    # repoint: read it there at each use, never a copy taken at import.
    if name == "CACHE":
        return _compiler.CACHE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
