"""The shape of a spec (:class:`KernelSpec`) and how its inputs are made
(:class:`Make`).

The specs themselves, one per public call, are :data:`normbook.lab.specs.SPECS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

DTYPES = ("fp32", "fp16", "bf16", "fp64")
#: The CPU dry run's row shapes: the interpreter runs one program at a time.
SMOKE_ROWS = ((16, 256), (1, 256))


class Skip(Exception):
    """A provider (or a case) that cannot run here: a package not installed, a kernel
    that is not comparable."""


@dataclass(frozen=True)
class Plan:
    """The GPU day's entry: ``shapes`` for our kernel, eager PyTorch and Liger;
    torch.compile at ``compile_at`` (indices into ``shapes``); ``smoke``: the CPU dry
    run's shapes."""

    shapes: tuple
    compile_at: tuple = (0, 1)
    smoke: tuple = SMOKE_ROWS


@dataclass(frozen=True)
class Variant:
    """An inspector launch beside the spec's own call: the same inputs, other keywords
    (``call`` suffix: ``row_variance.welford``), on some dtypes only."""

    suffix: str
    kwargs: dict
    dtypes: tuple = DTYPES
    inputs: Callable | None = None  # other inputs (a paged cache)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: Callable
    grad: tuple = ()
    kwargs: dict = field(default_factory=dict)
    formula: Callable | None = None
    liger: Callable | str = "Liger has no such kernel"
    nbytes: Callable | None = None
    #: benchmark directions, each with the chapter's target it is held to ("" none)
    bench: dict = field(default_factory=dict)
    #: the benchmark's own (M, N, regime) shapes given smoke, instead of the sweep
    bench_shapes: Callable | None = None
    #: the benchmark's fewest rows per direction (a check needs more than one)
    min_rows: dict = field(default_factory=dict)
    plan: Plan | None = None
    #: inspector: the shape labels it is launched at, or why it is not inspected
    inspect: tuple | str = ("bench", "decode", "odd")
    #: seconds to inspect it at the GPU day's shapes from nothing (measured on a busy
    #: 2-core CPU, Triton 3.9): the GPU day inspects the cheap first
    inspect_s: float = 30.0
    #: at its labels, only these (M, N) shapes (none: every shape of the labels)
    inspect_shapes: tuple = ()
    #: whether the spec's own call is inspected, besides its variants
    base: bool = True
    inspect_dtypes: tuple = DTYPES
    variants: tuple = ()
    #: tiny inputs for the autograd coverage test (default: inputs(3, 8))
    tiny: Callable | None = None
    integer_outputs: bool = False  # token indices: no gradient by nature
    #: the op module (normbook/<module>.py, tests/test_<module>.py), if not the name
    module: str = ""
    #: A call that writes into its arguments and returns nothing (a KV cache written
    #: in place): the arguments it writes, and a function of the call's arguments that
    #: makes the call and returns them. The benchmark, the inspector and the compile
    #: test call that function; each checked call gets fresh copies of ``mutates``.
    mutates: tuple = ()
    returning: Callable | None = None

    @property
    def module_name(self) -> str:
        return self.module or self.name

    @property
    def inspected(self) -> bool:
        return not isinstance(self.inspect, str)

    def fn(self):
        """The call as the benchmark, the inspector and the compile test make it: the
        public function, or for an in-place call its :attr:`returning` wrapper."""
        import normbook

        return self.returning or getattr(normbook, self.name)

    def call(self, **inputs):
        return self.fn()(**inputs, **self.kwargs)


# ---------------------------------------------------------------- making the inputs


class Make:
    """Makes a call's tensors of one dtype on one device: random values (the benchmark,
    the tests) or, with ``empty``, uninitialized memory that nothing ever reads (the
    inspector: a 2**26-element input then costs no time). ``on_input(t)`` is told of
    each
    row-sized input (two dimensions or more) whose loads the inspector checks."""

    def __init__(self, dtype, device=None, empty=False, on_input=None):
        self.dtype, self.device, self.empty, self.on_input = (
            dtype,
            device,
            empty,
            on_input,
        )

    def __call__(self, *shape, checked=True, scale=1.0, read=False, dtype=None):
        """``dtype``: another than the case's (an fp8 cache beside bf16 queries)."""
        import torch

        dtype = dtype or self.dtype
        if self.empty and read:  # values the call reads before any launch: zeros
            t = torch.zeros(shape, dtype=dtype, device=self.device)
        elif self.empty:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        else:  # never zeros: a kernel on zeros is trivially right, and flatters
            t = torch.randn(shape, device=self.device, dtype=torch.float32) * scale
            t = t.to(dtype)
        if checked and len(shape) >= 2 and self.on_input is not None:
            self.on_input(t)
        return t

    def like(self, t):
        """Random values of ``t``'s shape and dtype (a gradient for an output)."""
        return Make(t.dtype, t.device)(*t.shape)

    def index(self, n, high):
        import torch

        if self.empty:
            return torch.zeros(n, dtype=torch.int64, device=self.device)
        return torch.randint(0, high, (n,), device=self.device)

    def slots(self, n, high):
        """``n`` distinct slots of ``high`` (a paged cache's slot mapping): scattered
        at random, or 0 … n-1 for the inspector (distinct: the call refuses a slot
        twice)."""
        import torch

        if self.empty:
            return torch.arange(n, dtype=torch.int64, device=self.device)
        return torch.randperm(high, device=self.device)[:n]

    def lengths(self, n, value):
        import torch

        return torch.full((n,), value, dtype=torch.int32, device=self.device)

    def table(self, rows, cols):
        import torch

        t = torch.arange(rows * cols, dtype=torch.int32, device=self.device)
        return t.view(rows, cols)

    def tokens(self, values):
        import torch

        return torch.tensor(values, device=self.device)

    def probs(self, *shape):
        return self(*shape).float().softmax(-1).to(self.dtype)


def torch_kwargs(kwargs: dict) -> dict:
    """A spec's keywords with dtype names ("bfloat16") as torch dtypes."""
    import torch

    return {
        k: getattr(torch, v) if k.endswith("dtype") else v for k, v in kwargs.items()
    }


def tiny_inputs(spec: KernelSpec, make: Make) -> dict:
    """The autograd coverage test's inputs: small, every tensor argument present."""
    return spec.tiny(make) if spec.tiny else spec.inputs(3, 8, make)


@dataclass(frozen=True)
class Launch:
    """One call of the inspector; ``call`` names it in its rows
    (``row_variance.welford``)."""

    call: str
    spec: KernelSpec
    inputs: Callable
    kwargs: dict
    grad: tuple


@dataclass(frozen=True)
class Entry:
    """One line of the GPU day's plan: a benchmark case (``rms_norm.backward``)."""

    case: str
    shapes: tuple
    compile_at: tuple = (0, 1)
    smoke: tuple = SMOKE_ROWS
