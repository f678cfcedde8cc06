"""The child process: fake CUDA, import normbook, capture, compile, write JSON rows.

It is started by :func:`run_inspector` with this package loaded from its folder under a
name of its own (:func:`runner._boot`): importing ``normbook.lab.inspector`` would
import ``normbook`` (torch, Triton's interpreter flag) before CUDA is faked."""

from __future__ import annotations

import json
import os
import pathlib
import sys
from dataclasses import asdict

from .capture import _Capture, _fake_cuda
from .gpus import GPUS, littles_law_bytes, measured_gpu
from .options import from_child_args
from .paths import SOURCE_ROOT
from .ptxas import _keep_ptxas_logs
from .rows import unit_rows


def main(argv: list[str]) -> int:
    """``--units``: a JSON file listing [index, arch, dtype, calls, shapes]; each
    unit's rows go to ``<out-dir>/unit<index>.json`` as soon as it is done (a child
    stopped at a deadline keeps the units it finished)."""
    options, listing, out_dir = from_child_args(argv)
    out_dir = pathlib.Path(out_dir)
    units = json.loads(pathlib.Path(listing).read_text())
    capture = _prepare(units[0][1])
    from triton.backends.compiler import GPUTarget

    binders = {}  # per architecture: the JIT's binders depend on the back end
    for index, arch, *unit in units:
        if not _claim(out_dir, index):
            continue
        if arch not in binders:
            GPUS[arch] = measured_gpu(
                GPUS[arch], options.bandwidth_gbps, options.sms, options.gpu_name
            )
        # normbook reads the device's capability and SM count at each call, not at
        # import
        _fake_cuda(arch)
        capture.target = GPUTarget("cuda", arch, 32)
        capture.binders = binders.setdefault(arch, {})
        rows = unit_rows(capture, GPUS[arch], (arch, *unit), options)
        out = out_dir / f"unit{index}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": _meta(arch, options), "rows": rows}))
        tmp.replace(out)
    return 0


def _prepare(arch: int) -> _Capture:
    """Fake a CUDA device of ``arch``, import normbook (its kernels defined for the GPU
    compiler), and capture every launch instead of running it."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(SOURCE_ROOT))
    _fake_cuda(arch)
    import torch
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
    return capture


def _claim(out_dir: pathlib.Path, index: int) -> bool:
    """Whether this child takes unit ``index``: every child is given every unit and
    takes the next one nobody has claimed, so the children share the work however long
    each unit takes."""
    try:
        os.close(
            os.open(
                out_dir / f"unit{index}.claim",
                os.O_CREAT | os.O_EXCL | os.O_WRONLY,
            )
        )
    except FileExistsError:
        return False
    return True


def _meta(arch: int, options) -> dict:
    """What a unit's rows were made with: the versions, the date, the GPU."""
    import datetime

    import torch
    import triton

    return {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "latency_ns": options.latency_ns,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "note": "compiled on a CPU for the target GPU; every column but "
        "'predicted' is the compiler's output, 'predicted' is a model, "
        "not a measurement",
        "gpus": {str(arch): asdict(GPUS[arch])},
        "littles_per_sm": {
            str(arch): littles_law_bytes(GPUS[arch], options.latency_ns)
        },
    }
