"""Small, verified Triton kernels for LLM normalization layers.

Importing this package picks where kernels run: a CUDA GPU when one is present,
otherwise Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` is set before any
kernel is defined).

Every kernel is checked against the float64 formulas in :mod:`normbook.reference`.
"""

# noqa: F401  (first: sets the interpreter)
from ._runtime import DEVICE, HAS_CUDA, INTERPRET, default_dtype, device_name
from .rms_norm import rms_norm  # noqa: F401
from .qk_norm_rope import qk_norm_rope  # noqa: F401
from .fused_add_rms_norm import fused_add_rms_norm  # noqa: F401
from .layer_norm import layer_norm  # noqa: F401
from .row_stats import row_variance  # noqa: F401
from .softmax import softmax  # noqa: F401
from .cross_entropy import cross_entropy  # noqa: F401
from .attention import attention  # noqa: F401
from .sampling import sample  # noqa: F401
from .swiglu import swiglu  # noqa: F401
from .linear_cross_entropy import linear_cross_entropy  # noqa: F401
# decoding (issue 19)
from .decode_attention import decode_attention  # noqa: F401
from .speculative import speculative_sample  # noqa: F401

__all__ = [
    "DEVICE", "HAS_CUDA", "INTERPRET", "default_dtype", "device_name",
    "rms_norm", "layer_norm", "fused_add_rms_norm", "qk_norm_rope", "row_variance",
    "softmax", "cross_entropy", "attention", "sample",
    "swiglu", "linear_cross_entropy",
    "decode_attention", "speculative_sample",
]


def __getattr__(name):
    # normbook.hf (the transformers integration) loads on first use, so that
    # ``import normbook; normbook.hf.patch(model)`` works while ``import normbook`` alone
    # imports no transformers (normbook.hf itself imports it only when patching).
    if name == "hf":
        import importlib

        return importlib.import_module(f"{__name__}.hf")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
