"""What the PyTorch operators ``torch.ops.normbook.<name>`` share.

Every public kernel runs as a custom operator (``torch.library.custom_op``): to
``torch.compile`` an operator is one opaque node with a fake implementation that says
what it returns (shapes, dtypes) without running it, so the compiler never traces into
Triton's launcher. A differentiable operator has its backward registered
(``register_autograd``), and that backward calls a second operator,
``<name>_backward``, so that AOTAutograd records the backward graph too.

The pattern, in every op module (``swiglu.py`` is the shortest):

1. ``@torch.library.custom_op("normbook::<name>", mutates_args=())`` on ``_op``: the
   launch, after the checks that read tensor values (they cannot run on fake tensors).
2. ``@_op.register_fake``: empty outputs of the right shape, dtype and strides.
3. The same two for ``_op_backward`` (``normbook::<name>_backward``).
4. ``_setup_context`` saves what the backward needs; ``_autograd_backward`` calls
   ``_op_backward`` and returns one gradient per input (None for the others);
   ``_op.register_autograd(_autograd_backward, setup_context=_setup_context)``.
5. The public function checks its arguments and calls ``torch.ops.normbook.<name>``.

An operator cannot return None, so a gradient the backward was told not to compute is
returned as :func:`not_computed` and turned back into None by ``_autograd_backward``,
which knows what it asked for.
"""

import math

import torch


def fresh(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``x``'s shape, dtype and device: what a kernel writes
    its output into (a fake implementation's usual result)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rows(x: torch.Tensor):
    """How many rows ``x`` has when its last dimension is the row: the length of a
    per-row statistic (a product of symbolic sizes in a fake implementation)."""
    return math.prod(x.shape[:-1])


def not_computed(like: torch.Tensor) -> torch.Tensor:
    """The placeholder for a gradient the backward operator was told to skip."""
    return like.new_empty(0)
