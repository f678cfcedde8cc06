"""A request's sampling parameters, as vLLM's ``SamplingParams`` (the names kept)."""

import numbers
from dataclasses import dataclass

from ..sampling import _real

MAX_SEED = 2**63


def _int(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn and when it stops.

    ``temperature=0`` is greedy (the first argmax). ``top_k``, ``top_p``, ``min_p``:
    as :func:`normbook.sample`. ``repetition_penalty`` applies over the prompt and the
    output (transformers' processor), ``presence_penalty`` and ``frequency_penalty``
    over the output only (vLLM): :func:`normbook.penalize`. ``seed`` (None: one drawn
    from torch's global CPU generator when the request is added) makes the request's
    tokens reproducible: its t-th token is drawn with a key derived from (seed, t)
    alone, whatever runs beside it. ``stop_token_ids``: the request finishes after
    emitting one of them (it is part of the output); ``max_new_tokens`` at most.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_new_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple = ()

    def __post_init__(self):
        set_ = object.__setattr__
        if _real(self.temperature, "temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and _int(self.top_k, "top_k") < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < _real(self.top_p, "top_p") <= 1:
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= _real(self.min_p, "min_p") <= 1:
            raise ValueError(f"min_p must be None or in [0, 1], got {self.min_p}")
        if _real(self.repetition_penalty, "repetition_penalty") <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        _real(self.presence_penalty, "presence_penalty")
        _real(self.frequency_penalty, "frequency_penalty")
        if _int(self.max_new_tokens, "max_new_tokens") < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= _int(self.seed, "seed") < MAX_SEED:
            raise ValueError(f"seed must be None or in [0, 2**63), got {self.seed}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(
            self.stop_token_ids, "__iter__"
        ):
            raise TypeError("stop_token_ids must be a sequence of ints")
        stops = tuple(_int(t, "stop_token_ids") for t in self.stop_token_ids)
        if any(t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be >= 0, got {stops}")
        set_(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def token_seed(seed: int, t: int, salt: int = 0) -> int:
    """The key of a request's t-th draw: a function of (seed, t, salt) only (salt tells
    the draft's draws from the target's). SplitMix64's finalizer, kept below 2**63."""
    z = (seed + 0x9E3779B97F4A7C15 * (2 * t + 1 + 2**20 * salt)) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) % MAX_SEED
