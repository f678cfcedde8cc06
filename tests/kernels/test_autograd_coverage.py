"""No public function of the package silently drops a gradient.

Walks every callable in ``normbook.__all__``. For each tensor argument in turn, that argument (and
only it) requires grad; the function must then either

* return float tensors that carry a ``grad_fn``, and after ``backward`` give the argument a
  ``.grad`` of its own shape (finite on these finite inputs), or
* (only for an argument its docstring declares a constant, such as RoPE's cos/sin) return
  outputs with a ``grad_fn`` and give that argument no gradient, or
* raise a clear ``TypeError`` / ``ValueError`` / ``RuntimeError`` whose message names the argument.

A result without ``grad_fn`` — a silent detach, the worst kind of wrong answer in training — fails.
So does a new public function without a spec (``normbook.lab.specs``), or, if it takes no
tensor, missing from ``NO_TENSOR_INPUTS``. The correctness of the gradients is each kernel's own test
(gradcheck in float64 against the reference); this file only guarantees they exist.

Known gaps are marked ``xfail(strict=True)``: when the fix lands the test passes, strict mode
turns that into a failure, and the marker must be removed.
"""

import inspect

import pytest
import torch

import normbook
from normbook import DEVICE
from normbook.lab.specs import SPECS, autograd_calls

#: name -> a function returning fresh tensor arguments by name (on DEVICE), passed as
#: keywords: each spec's small inputs (normbook.lab.specs). Every tensor argument of the
#: signature appears; each float one is tried (an integer argument, such as
#: cross_entropy's target, cannot require grad).
CALLS = autograd_calls(DEVICE)

#: Public functions whose output is integer-valued by nature (token indices, as
#: torch.argmax): there is no gradient to keep, so they must return integer tensors.
INTEGER_OUTPUTS = {s.name for s in SPECS if s.integer_outputs}

#: Public callables that take no tensor: nothing to differentiate.
NO_TENSOR_INPUTS = {"default_dtype", "device_name"}

#: Public functions that write into their arguments and return nothing (a KV cache
#: written in place): no output to carry a gradient, so each tensor argument that
#: requires grad must be refused by name (test_in_place_writers_refuse_grad).
IN_PLACE = {"reshape_and_cache"}

#: Known gaps: (function, argument) -> why. Strict xfail: remove the entry when it is fixed.
KNOWN_GAPS: dict[tuple[str, str], str] = {}

#: Keyword variants that take another code path (the RMSNorm conventions), tried for every tensor
#: argument as well; a keyword the function does not take is skipped.
CONVENTIONS = [{}, {"casting_mode": "gemma", "offset": 1.0}, {"casting_mode": "none"}]
VARIANTS = {"rms_norm": CONVENTIONS, "fused_add_rms_norm": CONVENTIONS}


def _public_callables():
    return sorted(
        n
        for n in normbook.__all__
        if callable(getattr(normbook, n)) and not isinstance(getattr(normbook, n), type)
    )


def test_every_public_function_is_walked():
    unknown = set(_public_callables()) - set(CALLS) - NO_TENSOR_INPUTS - IN_PLACE
    assert not unknown, (
        f"public functions {sorted(unknown)} are not walked by this test: give "
        "them a spec in normbook.lab.specs (or list them in NO_TENSOR_INPUTS if they "
        "take no tensor)"
    )
    for name in CALLS:
        params = inspect.signature(getattr(normbook, name)).parameters
        missing = set(CALLS[name]()) - set(params)
        assert not missing, f"{name}: CALLS names {missing}, not in its signature"


def _cases():
    for name in sorted(CALLS):
        params = inspect.signature(getattr(normbook, name)).parameters
        variants = [v for v in VARIANTS.get(name, [{}]) if set(v) <= set(params)]
        for arg, value in CALLS[name]().items():
            # an int (attention_varlen's max_seqlen) or an integer tensor: no gradient
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            for extra in variants:
                marks = ()
                if (name, arg) in KNOWN_GAPS:
                    marks = pytest.mark.xfail(
                        strict=True, reason=KNOWN_GAPS[(name, arg)]
                    )
                tag = "-".join(f"{k}={v}" for k, v in extra.items())
                yield pytest.param(
                    name,
                    arg,
                    extra,
                    marks=marks,
                    id=f"{name}-{arg}" + (f"-{tag}" if tag else ""),
                )


def _documented_constant(fn, arg: str) -> bool:
    """The docstring says, in one sentence, that ``arg`` is treated as a constant (no gradient)."""
    doc = " ".join((fn.__doc__ or "").split())
    return any(
        arg in sentence and "constant" in sentence for sentence in doc.split(". ")
    )


def _float_tensors(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]


@pytest.mark.parametrize("name, arg, extra", list(_cases()))
def test_gradient_is_kept_or_refused(name, arg, extra):
    fn = getattr(normbook, name)
    kwargs = {**CALLS[name](), **extra}
    kwargs[arg] = kwargs[arg].detach().requires_grad_()
    try:
        out = fn(**kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        # Refusing is allowed, but the message must say which argument is the problem.
        assert arg in str(e), (
            f"{name} refused a gradient for {arg!r} without naming it: {e}"
        )
        return
    if name in INTEGER_OUTPUTS:
        for t in out if isinstance(out, tuple) else (out,):
            assert not t.is_floating_point() and t.grad_fn is None, (
                f"{name}: expected integer output"
            )
        return
    outs = _float_tensors(out)
    assert outs, f"{name} returned no float tensor"
    detached = [i for i, t in enumerate(outs) if t.grad_fn is None]
    assert not detached, (
        f"{name}: output(s) {detached} have no grad_fn although {arg!r} "
        "requires grad: the gradient is silently dropped"
    )
    # Random upstream gradients, so that no output's contribution can vanish by symmetry.
    grads = [torch.randn_like(t) for t in outs]
    torch.autograd.backward(outs, grads)
    g = kwargs[arg].grad
    if g is None and _documented_constant(fn, arg):
        return  # e.g. RoPE's cos/sin: the docstring says they are treated as constants
    assert g is not None, f"{name}: backward gave {arg!r} no gradient"
    assert g.shape == kwargs[arg].shape, (
        f"{name}: grad of {arg!r} has shape {tuple(g.shape)}"
    )
    assert bool(torch.isfinite(g).all()), f"{name}: non-finite gradient for {arg!r}"


@pytest.mark.parametrize("arg", ["key", "value", "key_cache", "value_cache"])
def test_in_place_writers_refuse_grad(arg):
    """reshape_and_cache: an argument that requires grad is refused by name (writing
    it into a cache would drop its gradient silently)."""
    kc, vc = (torch.zeros(2, 1, 4, 8, device=DEVICE) for _ in range(2))
    args = {
        "key": torch.ones(3, 1, 8, device=DEVICE),
        "value": torch.ones(3, 1, 8, device=DEVICE),
        "key_cache": kc,
        "value_cache": vc,
    }
    args[arg].requires_grad_(True)
    slots = torch.tensor([0, 5, -1], device=DEVICE)
    with pytest.raises(RuntimeError, match=arg):
        normbook.reshape_and_cache(**args, slot_mapping=slots)
