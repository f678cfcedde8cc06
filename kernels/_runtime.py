"""Where the kernels run: a CUDA GPU if there is one, else Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so this module
must be imported before any kernel is defined. ``kernels/__init__.py`` imports it first.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # No GPU: run every kernel in Triton's interpreter, on CPU tensors.
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cuda" if HAS_CUDA and not INTERPRET else "cpu")


def default_dtype() -> torch.dtype:
    """The low-precision dtype a chapter should use on this device.

    bf16 where the GPU supports it (Ampere and newer), fp16 on older GPUs such as a T4,
    and bf16 on the CPU interpreter (it emulates every dtype).
    """
    # Not torch.cuda.is_bf16_supported(): since torch 2.3 it also counts emulated bf16 and says
    # yes on a T4. Native bf16 arrived with compute capability 8.0 (Ampere).
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) < (8, 0):
        return torch.float16
    return torch.bfloat16


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name(DEVICE)
    return "CPU (Triton interpreter)"


def device_guard(t: torch.Tensor):
    """Context for a launch on ``t``'s device: Triton launches on the *current* CUDA device, so a
    tensor on ``cuda:1`` must make ``cuda:1`` current while its kernel is launched. A no-op on the
    CPU (the interpreter)."""
    import contextlib

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
