"""Compile every kernel launch of the package for real NVIDIA GPUs, without a GPU.

Run as a script (tests/test_gpu_compile.py does, in a subprocess, because it patches torch):
CUDA is reported available so that the kernels are defined as compiled, not interpreted, Triton
functions; every launch the public functions make is then intercepted and, instead of running,
lowered through Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX and, with ptxas, a cubin) for
the target architectures. This catches what the CPU interpreter cannot: code that only the GPU
compiler rejects (types of loop-carried values, constexpr misuse, unsupported operations).

Prints one line per distinct kernel variant and exits non-zero if any failed.
"""

import os
import sys
import types

import torch

torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=132)
torch.cuda.get_device_name = lambda *a, **k: "compile-only target"
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import kernels  # noqa: E402
import kernels._validate  # noqa: E402

assert not kernels.INTERPRET, "the kernels must be defined for the GPU compiler"
kernels._validate.DEVICE = torch.device("cpu")  # the tensors stay on the CPU; nothing runs

# sm_90: H100/H200 (every dtype); sm_80: A100; sm_75: T4 (no bf16: the book uses fp16 there).
TARGETS = [("sm_90", GPUTarget("cuda", 90, 32)), ("sm_80", GPUTarget("cuda", 80, 32)),
           ("sm_75", GPUTarget("cuda", 75, 32))]
TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
        torch.int32: "i32", torch.int64: "i64"}
seen, failures = {}, []


def _signature(fn, args, kwargs):
    names = [p.name for p in fn.params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    sig, consts = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPE[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {p.name}={v!r}")
    return sig, consts


def compile_instead_of_running(self, *args, grid=None, warmup=False, **kwargs):
    sig, consts = _signature(self, args, kwargs)
    uses_bf16 = any(t == "*bf16" for t in sig.values()) or any(str(v) == "bf16" for v in consts.values())
    key = (self.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())))
    for name, target in TARGETS:
        if (key, name) in seen:
            continue
        options = {"num_warps": kwargs.get("num_warps", 4)}
        try:
            compiled = triton.compile(ASTSource(self, signature=sig, constexprs=consts), target=target,
                                      options=options)
            seen[(key, name)] = "ok (" + ", ".join(sorted(compiled.asm)) + ")"
        except Exception as exc:  # report every failure, then fail at the end
            msg = " | ".join(str(exc).strip().splitlines()[-6:])
            seen[(key, name)] = "FAILED"
            failures.append(f"{self.__name__} {name} {consts}: {type(exc).__name__}: {msg}")


JITFunction.run = compile_instead_of_running


def exercise():
    """Call every public function with the shapes and dtypes that select each kernel variant."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in (1000, 40000):  # one block per row, and rows wide enough to loop
            x = torch.randn(6, n, dtype=dtype, requires_grad=True)
            w = torch.randn(n, dtype=dtype, requires_grad=True)
            b = torch.randn(n, dtype=dtype, requires_grad=True)
            kernels.rms_norm(x, w).sum().backward()
            kernels.rms_norm(x.detach())
            kernels.layer_norm(x, w, b).sum().backward()
            kernels.layer_norm(x.detach())
            kernels.fused_add_rms_norm(x.detach(), x.detach(), w.detach())
            for method in ("two_pass", "one_pass", "welford"):
                kernels.row_variance(x.detach(), method=method)
                if dtype == torch.float32:
                    kernels.row_variance(x.detach(), method=method, acc_dtype=torch.bfloat16)
        for head_dim in (64, 128):
            q = torch.randn(1, 3, 4, head_dim, dtype=dtype)
            k = torch.randn(1, 3, 2, head_dim, dtype=dtype)
            cos, sin = torch.randn(1, 3, head_dim, dtype=dtype), torch.randn(1, 3, head_dim, dtype=dtype)
            kernels.qk_norm_rope(q, k, torch.randn(head_dim, dtype=dtype), torch.randn(head_dim, dtype=dtype), cos, sin)


if __name__ == "__main__":
    exercise()
    for (key, target), status in sorted(seen.items()):
        consts = ", ".join(f"{k}={v}" for k, v in key[2] if k in ("ACC", "SINGLE_BLOCK", "HAS_WEIGHT", "LOW"))
        print(f"{target}  {key[0]:<28} {consts:<60} {status}")
    print(f"{len(seen)} kernel variants compiled, {len(failures)} failed (triton {triton.__version__})")
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures or not seen else 0)
