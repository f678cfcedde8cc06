"""The kernels under ``torch.compile``: every public kernel is a PyTorch operator.

Each kernel is registered as ``torch.ops.normbook.<name>`` (``torch.library.custom_op``)
with a fake implementation (shapes and dtypes, no launch) and, where it is
differentiable, a registered autograd whose backward is the operator
``normbook.<name>_backward``. The compiler sees one opaque node per kernel and never
traces into Triton's launcher (which, in the interpreter, failed with
``KeyError(torch.uint64)``).

What is checked, for every spec of ``normbook.lab.specs`` at its tiny inputs:

* ``torch.library.opcheck`` on every operator the call runs, forward and backward, with
  the arguments the call passed it (recorded by a ``TorchDispatchMode``): the schema
  (no input mutated, no output aliasing an input), the fake implementation against the
  real one (shapes, dtypes, strides), the autograd registration, and AOTAutograd with
  static and dynamic shapes. Tiny inputs: opcheck runs each operator about ten times,
  and the interpreter runs one program at a time; three rows of eight (a head of 128
  where the kernel needs one) fill one program of every kernel.
* ``torch.compile(fullgraph=True)`` with the ``eager`` and ``aot_eager`` backends (and
  ``inductor`` on a GPU) gives
  the eager call's outputs and gradients bit for bit (the same kernels on the same
  inputs), and ``torch._dynamo.explain`` counts no graph break.

Every kernel is an operator (:data:`NOT_YET` would name one that is not).
"""

import inspect

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

import normbook
from normbook import DEVICE
from normbook.lab.kernel_spec import Make, tiny_inputs
from normbook.lab.specs import SPECS

#: Kernels not registered as operators yet. Strict: once one is, remove it from here.
NOT_YET: set[str] = set()

#: torch.compile's backends checked: inductor on a GPU only (on the CPU it compiles C++
#: for every graph: a minute a call here), so it runs on the GPU day's kernel tests.
BACKENDS = ["eager", "aot_eager"] + (["inductor"] if normbook.HAS_CUDA else [])

#: Keywords that make a random kernel draw (and draw reproducibly: an int seed).
DRAWS = {
    "sample": {"temperature": 1.0, "top_k": 5, "generator": 7},
    "speculative_sample": {"generator": 7},
}

CASES = [s for s in SPECS if s.name not in NOT_YET]


def _call(spec):
    """(the public function, its tensor inputs, its other keywords): the spec's tiny
    inputs; the tensors it differentiates require grad."""
    inputs = tiny_inputs(spec, Make(torch.float32, DEVICE))
    for name in spec.grad:
        inputs[name].requires_grad_()
    return (
        spec.fn(),
        inputs,
        {**spec.kwargs, **DRAWS.get(spec.name, {})},
    )


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _loss(outs):
    """A scalar that weighs every element of every float output differently: each
    gradient element is then its own number."""
    total = 0
    for o in outs:
        if o.is_floating_point():
            w = torch.linspace(-1.0, 1.0, o.numel(), device=o.device).view(o.shape)
            total = total + (o.float() * w).sum()
    return total


def _run(fn, inputs, kwargs, differentiable):
    """Outputs and, for a differentiable call, the inputs' gradients, both detached."""
    leaves = {
        k: v.detach().clone().requires_grad_(v.requires_grad)
        if torch.is_tensor(v)
        else v
        for k, v in inputs.items()
    }
    outs = _outputs(fn(**leaves, **kwargs))
    grads = []
    if differentiable:
        _loss(outs).backward()
        grads = [
            leaves[k].grad
            for k in sorted(leaves)
            if torch.is_tensor(leaves[k]) and leaves[k].requires_grad
        ]
    return [o.detach() for o in outs], grads


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------- the operators


def test_every_kernel_is_an_operator():
    kernels = {s.name for s in SPECS}
    assert kernels <= set(normbook.__all__)
    registered = {n for n in kernels if hasattr(torch.ops.normbook, n)}
    assert registered == kernels - NOT_YET, (
        f"not operators: {sorted(kernels - NOT_YET - registered)}; registered but "
        f"still in NOT_YET: {sorted(registered & NOT_YET)}"
    )
    for s in CASES:
        if s.grad:
            assert hasattr(torch.ops.normbook, f"{s.name}_backward"), s.name


class _Record(TorchDispatchMode):
    """Every call of a normbook operator, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "normbook":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _recorded_calls(spec):
    fn, inputs, kwargs = _call(spec)
    with _Record() as record:
        outs = _outputs(fn(**inputs, **kwargs))
        if spec.grad:
            _loss(outs).backward()
    return record.calls


def _copy(a, requires_grad):
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().clone().requires_grad_(requires_grad and a.is_floating_point())


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_opcheck(spec):
    calls = _recorded_calls(spec)
    names = [func.__name__.split(".")[0] for func, _, _ in calls]
    # one forward operator, and its backward when there is a gradient
    assert names == [spec.name] + ([f"{spec.name}_backward"] if spec.grad else [])
    for func, args, kwargs in calls:
        # the forward's differentiable inputs require grad: opcheck then checks its
        # autograd too (the backward operator is differentiable once, not twice)
        forward = func.__name__.split(".")[0] == spec.name
        params = [a.name for a in func._schema.arguments]
        args = tuple(_copy(a, forward and p in spec.grad) for a, p in zip(args, params))
        torch.library.opcheck(
            func, args, {k: _copy(v, False) for k, v in kwargs.items()}
        )


# ---------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_compiled_equals_eager(spec, backend):
    fn, inputs, kwargs = _call(spec)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    want = _run(fn, inputs, kwargs, bool(spec.grad))
    got = _run(compiled, inputs, kwargs, bool(spec.grad))
    _assert_bitwise(got[0], want[0])
    _assert_bitwise(got[1], want[1])
    if spec.grad:
        assert got[1], "no gradient reached the inputs"


@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.name)
def test_no_graph_break(spec):
    fn, inputs, kwargs = _call(spec)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(**inputs, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# ---------------------------------------------------------------- variants

#: A spec's variants with inputs of their own (decode attention's paged and fp8
#: caches), without gradients: opcheck, compiled against eager, no graph break, at a
#: size that fills one page of a paged cache.
VARIANTS = [(s, v) for s in CASES for v in s.variants if v.inputs and not s.grad]


@pytest.mark.parametrize(
    "spec, variant", VARIANTS, ids=[f"{s.name}.{v.suffix}" for s, v in VARIANTS]
)
def test_variant_opcheck_and_compile(spec, variant):
    fn = getattr(normbook, spec.name)
    # a page of a paged cache; fp8 quantization: a whole 128-wide block
    n = 128 if spec.name == "quantize_fp8" else 16
    inputs = variant.inputs(3, n, Make(torch.float32, DEVICE))
    kwargs = {**spec.kwargs, **variant.kwargs}
    with _Record() as record:
        fn(**inputs, **kwargs)
    ((func, args, kw),) = record.calls
    fp8 = [a for a in args if torch.is_tensor(a) and a.element_size() == 1]
    if not fp8:
        torch.library.opcheck(func, args, kw)
    else:
        # opcheck's schema test compares inputs with torch.allclose, which PyTorch
        # has no fp8 CPU kernel for: the bytes are compared here instead.
        before = [a.view(torch.uint8).clone() for a in fp8]
        utils = (
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        )
        torch.library.opcheck(func, args, kw, test_utils=utils)
        assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8, before))
    want = _run(fn, inputs, kwargs, False)
    for backend in BACKENDS:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        _assert_bitwise(_run(compiled, inputs, kwargs, False)[0], want[0])
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(**inputs, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_public_signatures_unchanged():
    """The operators sit behind the public functions: their signatures are the
    functional API's, not the schemas'."""
    params = inspect.signature(normbook.sample).parameters
    assert "generator" in params and "seed" not in params
    assert list(inspect.signature(normbook.rms_norm).parameters) == [
        "x",
        "weight",
        "eps",
        "offset",
        "casting_mode",
    ]
