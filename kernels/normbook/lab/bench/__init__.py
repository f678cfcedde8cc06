"""The benchmark behind the chapter "At the speed of light".

    python -m normbook.lab.bench          # a CUDA GPU: the full sweep, into data/bench/
    python -m normbook.lab.bench --smoke  # anywhere: the same code path, tiny shapes

It measures the device-to-device copy bandwidth (the memory-bound speed of light), then
runs every benchmark case over a sweep of hidden sizes N = 256 … 262,144 with many rows
(M·N = 2**26 elements per row-sized tensor) and at decode shapes (M = 1, 8, 64 rows of N
= 4096 and 8192), in bf16 (fp16 on GPUs without bf16), for each provider: this package's
Triton kernel, the PyTorch formula in eager mode and under ``torch.compile``, and
Liger-Kernel when it is installed. For every (case, N, provider) it records milliseconds
(``triton.testing.do_bench``: warm-up, median, L2 flushed), the bytes the case must move
(from the tensors' sizes), GB/s and the percentage of the measured copy bandwidth, plus
a correctness check against eager PyTorch.

Results go to a JSON and a CSV file named for the date and the GPU, each carrying its
provenance: GPU, compute capability, torch/triton/CUDA/Liger versions, date, the
command, the git commit.

Each case is derived from a kernel's spec (:mod:`normbook.lab.specs`): its inputs, the
formula, Liger's counterpart, the bytes it must move. A provider that cannot run here
(Liger not installed) is reported as skipped.

On a CPU there is no GPU timer. ``--smoke`` then times with the wall clock, in Triton's
interpreter, only to exercise the code path; it writes to a temporary folder (or
``--out``), never to ``data/bench/``, and marks its files ``"smoke": true`` so that no
reader mistakes them for GPU figures. A full run without a GPU is refused.

A row that fails (a provider raising, or a result that does not match eager PyTorch) is
printed on stderr, listed under ``"errors"`` in the JSON, and makes the command exit
with status 1 (unless only Liger failed). Modules: :mod:`.cases` (the cases),
:mod:`.runner` (timing, checks, the loop), :mod:`.cli` (the command line and its
writer), :mod:`.plan` (the GPU day), :mod:`.report` (files, reading runs back).
"""

from .cases import *  # noqa: F401,F403
from .cli import *  # noqa: F401,F403
from .report import *  # noqa: F401,F403
from .report import _slug  # noqa: F401
from .runner import *  # noqa: F401,F403
from .runner import (  # noqa: F401
    _as_tuple,
    _compiled,
    _max_rel_err,
    _row,
    _timed_call,
)
