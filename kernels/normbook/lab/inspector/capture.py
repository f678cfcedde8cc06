"""Faking a CUDA device of an architecture, and capturing each kernel launch (what
would be compiled, and the grid) instead of compiling and running it.

Faking CUDA changes torch for the whole process: this runs in the inspector's child
processes only (:mod:`.child`)."""

from __future__ import annotations

import hashlib
import json

from .gpus import GPUS


def _fake_cuda(arch: int) -> None:
    """Make torch report a CUDA device of ``arch`` so that ``normbook`` defines compiled
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
        self.target = None  # the GPUTarget compiled for, set per unit

    def run(self, fn, args, kwargs, grid):
        import triton

        backend, bound, signature, constexprs, attrs, options = self._bind(
            fn, args, kwargs
        )
        grid = grid(bound) if callable(grid) else grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
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
                "tensors": _tensors(bound),
                "ints": {
                    k: v
                    for k, v in bound.items()
                    if isinstance(v, int) and not isinstance(v, bool)
                },
                "constexprs": {
                    k: str(v)
                    for k, v in consts.items()
                    if not isinstance(v, type(None))
                },
                "_compile": (fn, signature, constexprs, attrs, options),
            }
        )

    def _bind(self, fn, args, kwargs):
        """The launch's arguments bound by the JIT's own binder, with the options
        ``JITFunction.run`` adds: (backend, bound arguments, signature, constexprs,
        attributes, options)."""
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
        return backend, bound, signature, constexprs, attrs, options


def _tensors(bound: dict) -> dict:
    """Shape, dtype and whether the call was given it (:data:`_INPUTS`), per tensor
    argument of a launch."""
    import torch

    return {
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


def _compile_env() -> list:
    """The environment variables that Triton says change a compile, with their values
    (none set: an empty list; an older Triton without the list: the same)."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        return []
    return sorted(get_cache_invalidating_env_vars().items())
