"""A small serving engine on this package's kernels (see :class:`Engine`):
continuous batching, chunked prefill, a paged KV cache with prefix sharing,
copy-on-write and preemption by recomputation, per-request sampling parameters and
seeds, penalties, stop tokens, and speculative decoding with a draft model."""

from .blocks import BlockManager
from .engine import Engine
from .params import SamplingParams

__all__ = ["Engine", "SamplingParams", "BlockManager"]
