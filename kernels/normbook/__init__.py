"""Small, verified Triton kernels for LLM normalization layers.

Importing this package picks where kernels run: a CUDA GPU when one is present,
otherwise Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` is set before any
kernel is defined).

Every kernel is checked against the float64 formulas in :mod:`normbook.reference`.
"""

# _runtime first: it sets Triton's interpreter before any kernel is defined.
from ._runtime import DEVICE, HAS_CUDA, INTERPRET, default_dtype, device_name
from .attention import attention
from .attention_varlen import attention_varlen
from .cross_entropy import cross_entropy
from .decode_attention import decode_attention
from .fp8 import dequantize_fp8, linear_fp8, quantize_fp8
from .fused_add_rms_norm import fused_add_rms_norm
from .layer_norm import layer_norm
from .linear import linear, matmul
from .linear_cross_entropy import linear_cross_entropy
from .penalize import penalize
from .qk_norm_rope import qk_norm_rope
from .quantize_kv import quantize_kv
from .reshape_and_cache import reshape_and_cache
from .rms_norm import rms_norm
from .row_stats import row_variance
from .sampling import sample
from .softmax import softmax
from .speculative import speculative_sample
from .swiglu import swiglu

__all__ = [
    "DEVICE",
    "HAS_CUDA",
    "INTERPRET",
    "default_dtype",
    "device_name",
    "rms_norm",
    "layer_norm",
    "fused_add_rms_norm",
    "qk_norm_rope",
    "row_variance",
    "softmax",
    "cross_entropy",
    "attention",
    "attention_varlen",
    "sample",
    "penalize",
    "swiglu",
    "linear_cross_entropy",
    "decode_attention",
    "quantize_kv",
    "reshape_and_cache",
    "speculative_sample",
    "linear",
    "matmul",
    "quantize_fp8",
    "dequantize_fp8",
    "linear_fp8",
]


def __getattr__(name):
    # normbook.hf (the transformers integration) loads on first use, so that
    # ``import normbook; normbook.hf.patch(model)`` works while ``import normbook``
    # alone imports no transformers (normbook.hf imports it only when patching).
    if name in ("hf", "serve"):  # serve: the engine, on first use too
        import importlib

        return importlib.import_module(f"{__name__}.hf")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
