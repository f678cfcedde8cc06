"""What each public call of ``normbook`` launches, per phase, at one shape and dtype:
the calls the inspector makes on uninitialized CPU tensors (nothing runs; the captured
launches are compiled, not run)."""

from __future__ import annotations

from .capture import _INPUTS


def _calls(label: str, M: int, N: int, dtype: str, which: set[str] | None):
    """(call, (forward, backward)) for every launch the specs ask for at one shape
    (:func:`normbook.lab.specs.inspector_launches`): the forward without gradients,
    and, for a spec with arguments to differentiate, the call with those requiring
    grad followed by its backward (a generator: the forward's launches, ``yield``, the
    backward's launches)."""
    import torch

    from normbook.lab.specs import Make, inspector_launches, torch_kwargs

    dt = {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp64": torch.float64,
    }[dtype]
    # Uninitialized and never touched: nothing runs, so a 2**26-element input costs no
    # time. Row-sized inputs are remembered: their loads are the ones checked.
    make = Make(dt, empty=True, on_input=lambda t: _INPUTS.add(t.data_ptr()))

    def pair(launch):
        fn, kwargs = launch.spec.fn(), torch_kwargs(launch.kwargs)

        def inputs(grad):
            args = launch.inputs(M, N, make)
            for name in grad:
                args[name].requires_grad_()
            return args

        def forward():
            fn(**inputs(()), **kwargs)

        def backward():
            outs = fn(**inputs(launch.grad), **kwargs)
            outs = [
                o
                for o in (outs if isinstance(outs, tuple) else (outs,))
                if o.grad_fn is not None
            ]
            yield
            grads = [torch.empty_like(o) for o in outs]  # dy: an input of the backward
            _INPUTS.update(g.data_ptr() for g in grads)
            torch.autograd.backward(outs, grads)

        return forward, backward if launch.grad else None

    return [
        (launch.call, pair(launch))
        for launch in inspector_launches(label, M, N, dtype)
        if which is None or launch.call in which
    ]
