"""The benchmark's cases, derived from the specs (:mod:`normbook.lab.specs`): each
benchmarked direction of each spec is a :class:`Case` whose :class:`Problem` holds the
inputs, the bytes the case must move, and the functions compared (this package's
kernel, the PyTorch formula as Hugging Face writes it, Liger-Kernel when installed, or
why not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernel_spec import Make, Skip, torch_kwargs
from ..paths import DATA
from ..specs import (  # noqa: F401  (the benchmark's shapes, for its users)
    DECODE_M,
    DECODE_N,
    ELEMENTS,
    HEAD_DIM,
    LCE_SHAPE,
    SMOKE_DECODE,
    SMOKE_ELEMENTS,
    SMOKE_SWEEP,
    SPECS,
    SWEEP,
    torch_fused_add_rms_norm,
    torch_rms_norm,
)

#: The recorded runs (a test points it at its fixture).
DATA_DIR = DATA / "bench"

PROVIDERS = ["normbook", "torch eager", "torch.compile", "liger"]
DO_BENCH = (
    "triton.testing.do_bench (warm-up, median of many runs, L2 flushed before each)"
)
WALL_CLOCK = (
    "wall clock in Triton's CPU interpreter "
    "(smoke run: exercises the code, not a GPU figure)"
)

#: The chapter's targets for bf16 and N >= 4096, as fractions of the measured copy
#: bandwidth.
TARGETS = {"forward": 0.90, "fused add": 0.85, "backward": 0.80}
TARGET_MIN_N = 4096


# ---------------------------------------------------------------- the cases


@dataclass
class Problem:
    """One benchmark instance: inputs, the functions that compute the same thing, and
    its bytes.

    Every provider is called as ``fn(*inputs)``. For a backward case, the inputs at
    ``wrt`` get ``requires_grad`` and the timed call is the backward of ``fn(*inputs)``
    with ``grad_outputs``. ``nbytes`` counts each tensor that must be read or written
    once (normbook.lab.measure.bytes_moved).
    """

    inputs: tuple
    nbytes: int
    ours: Callable
    formula: Callable
    liger: Callable | None = None  # None: Liger has no such kernel
    # backward cases: positions of the inputs to differentiate
    wrt: tuple[int, ...] = ()
    grad_outputs: tuple = ()
    # how the row-sized tensors are laid out, for the record
    shape: str = ""
    # the call's arguments beyond its tensors (sampling's temperature, attention's
    # mask), for the record: the inspector's prediction pairs with a row only where its
    # own call passes the same (normbook.lab.pairing)
    params: dict = field(default_factory=dict)
    # an in-place call's written inputs (KV caches): position -> its values before any
    # call. Each checked call writes into fresh copies of these; the timed calls write
    # into the inputs themselves.
    pristine: dict = field(default_factory=dict)


@dataclass
class Case:
    kernel: str
    direction: str  # "forward" | "backward"
    build: Callable[[int, int, torch.dtype, torch.device], Problem]
    target: str = ""  # key of TARGETS
    # Its own (M, N, regime) shapes, given smoke: True/False, instead of the sweep and
    # the decode shapes (decode_attention: M requests, N cached tokens each). None, or
    # a function that returns None: the default.
    shapes: Callable[[bool], list] | None = None
    #: (M, N, dtype) -> the bytes the case must move (problem_nbytes)
    count: Callable[[int, int, torch.dtype], int] | None = None

    @property
    def name(self) -> str:
        return f"{self.kernel}.{self.direction}"

    def nbytes(self, M: int, N: int, dtype) -> int:
        """The bytes the case must move at (M, N): what ``build(...).nbytes`` says,
        without building or running anything."""
        return self.count(M, N, dtype)


def problem_nbytes(spec, direction: str, M: int, N: int, dtype) -> int:
    """A case's byte count at (M, N), from its inputs made on PyTorch's meta device:
    shapes, no memory, and no forward run (a backward case's ``problem`` runs one to
    shape its gradients, minutes in the interpreter at a real model's sizes)."""
    make = Make(dtype, torch.device("meta"))
    args = spec.inputs(max(M, spec.min_rows.get(direction, 1)), N, make)
    return spec.nbytes(args, direction == "backward")


def problem(spec, direction: str, M: int, N: int, dtype, device) -> Problem:
    """One instance of a spec's case: its inputs at (M, N), random (never zeros: a
    kernel on zeros is trivially right, and flatters); for a backward case, the
    arguments the spec differentiates, and gradients shaped like our kernel's
    outputs."""
    make = Make(dtype, device)
    args = spec.inputs(max(M, spec.min_rows.get(direction, 1)), N, make)
    names, kwargs = list(args), torch_kwargs(spec.kwargs)
    fn = spec.fn()

    def positional(f, extra):
        return lambda *a: f(**dict(zip(names, a)), **extra)

    if isinstance(spec.liger, str):  # why there is none
        liger = Skip(spec.liger)
    else:
        try:
            liger = spec.liger(direction == "backward")
        except Skip as exc:
            liger = exc
    wrt, grads = (), ()
    if direction == "backward":
        wrt = tuple(names.index(n) for n in spec.grad)
        probe = {k: v.detach().requires_grad_(k in spec.grad)
                 if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in args.items()}  # fmt: skip
        outs = fn(**probe, **kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = tuple(make.like(o) for o in outs if o.grad_fn is not None)
        args = {k: v.detach() if isinstance(v, torch.Tensor) else v
                for k, v in args.items()}  # fmt: skip
    shape = ", ".join(
        f"{k} {tuple(v.shape)}"
        for k, v in args.items()
        if isinstance(v, torch.Tensor) and v.dim() > 1
    )
    return Problem(
        tuple(args.values()),
        spec.nbytes(args, direction == "backward"),
        positional(fn, kwargs),
        positional(spec.formula, {}),
        positional(liger, {}) if callable(liger) else liger,
        wrt=wrt,
        grad_outputs=grads,
        shape=shape,
        params=dict(spec.kwargs),
        pristine={names.index(n): args[n].clone() for n in spec.mutates},
    )


def _case(spec, direction: str) -> Case:
    return Case(
        spec.name,
        direction,
        lambda M, N, dt, dev: problem(spec, direction, M, N, dt, dev),
        spec.bench[direction],
        spec.bench_shapes,
        lambda M, N, dt: problem_nbytes(spec, direction, M, N, dt),
    )


def cases_of() -> list[Case]:
    """A case per benchmarked direction of every spec, in the specs' order."""
    from .. import specs

    return [_case(s, d) for s in specs.SPECS for d in s.bench]


CASES = cases_of()


def measure_linear_cross_entropy(timer, device, dtype=torch.bfloat16, shape=LCE_SHAPE):
    """Forward + backward of the LM-head loss at ``shape`` = (M, V, d), three ways: this
    package's ``linear_cross_entropy``, the materialized ``F.linear`` +
    ``normbook.cross_entropy``, and Liger's fused linear cross-entropy when installed.
    One row each: time (``timer`` of a zero-argument callable, ms), the peak memory
    beyond inputs and gradients (on a GPU ``torch.cuda.max_memory_allocated``; on the
    CPU the largest storage an op allocated, labelled so), both against the logits'
    size, and the loss against the materialized one."""
    import normbook
    from normbook.linear_cross_entropy import largest_intermediate

    M, V, d = shape
    make = Make(dtype, device)
    h = make(M, d).requires_grad_()
    w = make(V, d, scale=d**-0.5).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    e = torch.empty((), dtype=dtype).element_size()
    logits_bytes = M * V * e
    grads_bytes = (M + V) * d * e

    def materialized(h, w, t):
        return normbook.cross_entropy(torch.nn.functional.linear(h, w), t)

    providers = {
        "normbook": normbook.linear_cross_entropy,
        "F.linear + normbook.cross_entropy": materialized,
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        providers["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as exc:  # not installed, or an API this code does not know
        providers["liger"] = Skip(f"liger-kernel unavailable ({type(exc).__name__})")
    want = None
    rows = []
    for name, fn in providers.items():
        row = {
            "kernel": "linear_cross_entropy",
            "provider": name,
            "M": M,
            "V": V,
            "d": d,
            "dtype": str(dtype).replace("torch.", ""),
            "logits_bytes": logits_bytes,
        }
        if isinstance(fn, Skip):
            rows.append({**row, "status": "skipped", "note": str(fn)})
            continue

        def step(fn=fn):
            loss = fn(h, w, t)
            torch.autograd.grad(loss, (h, w))
            return loss

        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                loss = step()
                torch.cuda.synchronize(device)
                extra = torch.cuda.max_memory_allocated(device) - base - grads_bytes
                how = "torch.cuda.max_memory_allocated - inputs - gradients"
            else:
                loss, extra = largest_intermediate(step)
                how = "CPU: largest storage one op allocated (not a peak of the sum)"
            ms = float(timer(step))
        except Exception as exc:  # e.g. out of memory for the materialized logits
            rows.append(
                {**row, "status": "error", "note": f"{type(exc).__name__}: {exc}"[:200]}
            )
            continue
        loss = float(loss.detach())
        want = loss if want is None else want
        rows.append(
            {
                **row,
                "status": "ok",
                "ms": ms,
                "extra_bytes": int(extra),
                "extra_over_logits": extra / logits_bytes,
                "memory": how,
                "loss": loss,
                "loss_diff": abs(loss - want),
            }
        )
    return rows
