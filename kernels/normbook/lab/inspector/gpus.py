"""The GPUs of each architecture, and the model the ``predicted`` column is made of:
occupancy (CTAs per SM) and Little's law (bytes in flight to sustain the bandwidth)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Datasheet:
    """One product's published figures, as NVIDIA prints them: peaks of the hardware,
    not measurements (a kernel reaches a fraction of each). ``source`` is the key of the
    document in the book's bibliography; the L2 sizes come from the architecture
    whitepapers (``l2_source``), as the datasheets do not print them."""

    name: str
    arch: int  # compute capability (90: sm_90), the key of GPUS
    sms: int
    memory_gb: float  # device memory, GB as printed (HBM; GDDR6 on the T4)
    bandwidth: float  # bytes/s, peak of that memory
    fp32: float  # flop/s of the CUDA cores (no tensor cores)
    # flop/s of the tensor cores on bf16 (T4: fp16) inputs, dense: the H100 and H200
    # datasheets print twice this, "with sparsity"
    tensor16: float
    l2_mb: float | None  # L2 cache, MB as printed; None where no document gives it
    source: str
    l2_source: str | None = None


# fmt: off
DATASHEETS = {
    d.name: d
    for d in (
        Datasheet(
            "H100 SXM", 90, 132, 80, 3.35e12, 67e12, 1979e12 / 2, 50,
            "nvidia2023h100", "nvidia2022hopper",
        ),
        Datasheet(
            "H200 SXM", 90, 132, 141, 4.8e12, 67e12, 1979e12 / 2, None,
            "nvidia2024h200",
        ),
        Datasheet(
            "A100 SXM4 80GB", 80, 108, 80, 2.039e12, 19.5e12, 312e12, 40,
            "nvidia2021a100", "nvidia2020ampere",
        ),
        Datasheet(
            "T4", 75, 40, 16, 320e9, 8.1e12, 65e12, 4,
            "nvidia2019t4", "nvidia2018turing",
        ),
    )
}
# fmt: on

_H100, _A100, _T4 = (DATASHEETS[k] for k in ("H100 SXM", "A100 SXM4 80GB", "T4"))

GPUS = {
    90: GPU(
        "H100 SXM (132 SMs; an H200 has the same SMs and 4.8 TB/s)",
        _H100.sms,
        _H100.bandwidth,
        2048,
        32,
    ),
    80: GPU(
        "A100 SXM4 80GB (108 SMs)",
        _A100.sms,
        _A100.bandwidth,
        2048,
        32,
        smem=164 * 1024,
    ),
    75: GPU(
        "T4 (40 SMs)", _T4.sms, _T4.bandwidth, 1024, 16, smem=64 * 1024, smem_reserved=0
    ),
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


def measured_gpu(
    gpu: GPU,
    bandwidth_gbps: float | None = None,
    sms: int | None = None,
    name: str | None = None,
) -> GPU:
    """``gpu`` with what was measured on a real one: the copy bandwidth (GB/s) in place
    of the datasheet's, so that ``predicted`` becomes a fraction of the *measured* copy
    bandwidth (the benchmark's ``pct_of_copy``), and the SM count the device reports."""
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
