"""What every patched forward of :mod:`normbook.hf` shares: recognizing transformers'
classes, the KV cache's name and update across transformers versions, installing a
forward."""

from __future__ import annotations

import functools
import inspect
import types

from torch import nn


def _is_transformers_class(module: nn.Module, names) -> bool:
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith("transformers.models.")


def _norm_eps(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _pop_cache(cache, kwargs):
    # transformers 5.x calls the KV cache ``cache`` (renaming ``past_key_values`` in a
    # decorator around the original forward); 4.5x calls it ``past_key_values`` (or
    # ``past_key_value``).
    for old_name in ("past_key_values", "past_key_value"):
        if old_name in kwargs:
            cache = kwargs.pop(old_name)
    return cache


@functools.cache
def _cache_name(fn) -> str:
    """The name under which ``fn`` (a transformers forward) takes the KV cache."""
    params = inspect.signature(fn).parameters
    return next(
        (n for n in ("cache", "past_key_values", "past_key_value") if n in params),
        "cache",
    )


def _cache_update(cache, key_states, value_states, layer_idx, cos, sin, kwargs):
    if "kwargs" in inspect.signature(cache.update).parameters:  # transformers 5.x
        return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    # transformers 4.5x: the cache kwargs are a dict argument.
    cache_kwargs = {
        "sin": sin,
        "cos": cos,
        "cache_position": kwargs.get("cache_position"),
    }
    return cache.update(key_states, value_states, layer_idx, cache_kwargs)


def _set_forward(module: nn.Module, fn) -> None:
    # A bound method stored as an instance attribute: not a parameter, buffer or
    # submodule, so the state dict is unchanged; and copy.deepcopy rebinds a bound
    # method to the *copied* module (a closure over ``module`` would keep running the
    # original's weights).
    module.forward = types.MethodType(fn, module)
