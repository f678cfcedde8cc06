"""Measuring on a GPU: the bytes a kernel must move, the time it takes
(``triton.testing.do_bench``: warm-up, the median of many runs, L2 flushed between
runs),
the effective bandwidth, and the copy bandwidth every figure is divided by. Used by the
benchmark and by the chapters' timing cells (:mod:`normbook.lab.timing`).
"""

from __future__ import annotations

from typing import Callable

import torch

from normbook._runtime import DEVICE

#: What a timing cell prints without a GPU: one line. The introduction says once why
#: (the interpreter runs one program at a time in Python: its times say nothing about a
#: GPU).
CPU_NOTE = "Not timed: no GPU here (the introduction says why); a GPU run times it."


def bytes_moved(*tensors: torch.Tensor | None) -> int:
    """Bytes that must cross memory: the sum of the sizes of every tensor read or
    written once."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gbps(nbytes: int, ms: float) -> float:
    """Effective bandwidth in GB/s (1 GB = 1e9 bytes)."""
    return nbytes / (ms * 1e-3) / 1e9


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds on the GPU (``do_bench``, L2 flushed per
    run)."""
    if DEVICE.type != "cuda":
        raise RuntimeError(CPU_NOTE)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def compile_or_none(fn: Callable):
    """``torch.compile(fn)``, or None where compilation is unavailable."""
    try:
        return torch.compile(fn)
    except Exception:  # pragma: no cover - depends on the platform
        return None


def copy_bandwidth(
    nbytes: int = 2**28,
    timer: Callable[[Callable[[], object]], float] | None = None,
    device: torch.device | None = None,
) -> dict:
    """The memory-bound speed of light, measured: a device-to-device copy of ``nbytes``
    bytes.

    A copy reads every byte once and writes it once, so it moves ``2 * nbytes`` bytes
    and does no arithmetic. A kernel that must read its inputs and write its outputs, in
    a similar mix of reads and writes, is not expected to beat its GB/s (one with
    another mix, e.g. two reads per
    write, can land a little above: see the speed-of-light chapter's pitfalls). The
    source holds random bytes (not zeros) and is larger than any L2 cache for the
    default size. ``timer`` defaults to :func:`time_ms` (GPU only). Returns bytes, ms
    and GB/s.
    """
    timer = time_ms if timer is None else timer
    device = DEVICE if device is None else device
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    moved = 2 * nbytes
    return {"bytes": moved, "ms": ms, "GB/s": gbps(moved, ms)}
