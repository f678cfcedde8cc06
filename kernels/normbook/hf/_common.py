"""What every patched forward of :mod:`normbook.hf` shares: recognizing transformers'
classes, the KV cache's name and update across transformers versions, installing a
forward."""

from __future__ import annotations

import functools
import inspect

import torch
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


# Signatures are read once per function (or cache class), and under torch.compile at
# trace time only: assume_constant_result makes each answer a constant of the graph.
_PARAMETERS: dict = {}


def _parameters(fn) -> tuple:
    if fn not in _PARAMETERS:
        _PARAMETERS[fn] = tuple(inspect.signature(fn).parameters)
    return _PARAMETERS[fn]


@torch.compiler.assume_constant_result
def _cache_name(fn) -> str:
    """The name under which ``fn`` (a transformers forward) takes the KV cache."""
    params = _parameters(fn)
    return next(
        (n for n in ("cache", "past_key_values", "past_key_value") if n in params),
        "cache",
    )


@torch.compiler.assume_constant_result
def _update_takes_kwargs(cache_cls) -> bool:
    """Whether the cache class's ``update`` takes ``kwargs`` (transformers 5.x)."""
    return "kwargs" in _parameters(cache_cls.update)


def _cache_update(cache, key_states, value_states, layer_idx, cos, sin, kwargs):
    if _update_takes_kwargs(type(cache)):  # transformers 5.x
        return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    # transformers 4.5x: the cache kwargs are a dict argument.
    cache_kwargs = {
        "sin": sin,
        "cos": cos,
        "cache_position": kwargs.get("cache_position"),
    }
    return cache.update(key_states, value_states, layer_idx, cache_kwargs)


def _set_forward(module: nn.Module, fn) -> None:
    # ``functools.partial(fn, module)`` stored as an instance attribute: not a
    # parameter, buffer or submodule, so the state dict is unchanged. copy.deepcopy and
    # pickle (torch.save) copy it with the module, bound to the *copy*: pickle names
    # ``fn`` by its qualified name (a bound method would be pickled as
    # ``getattr(module, fn.__name__)``, which fails on load). torch.compile traces it.
    module.forward = functools.partial(fn, module)


def _patched_fn(module: nn.Module):
    """The function :func:`_set_forward` installed on ``module``, or None."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.args == (module,):
        return forward.func
    return None


def _checkpointed(body):
    """A decoder layer's patched forward that honours gradient checkpointing as
    transformers 5.x's ``GradientCheckpointingLayer`` does: its class's ``forward`` is
    wrapped to run the layer under ``self._gradient_checkpointing_func`` when
    ``gradient_checkpointing`` is on, in training, with gradients enabled (the KV cache
    then off). A forward installed on the instance replaces that wrapper, so this one
    does the same around ``body``. (transformers 4.5x checkpointed in the layer's
    ``__call__``, which still runs: there ``body`` runs as is.)"""

    @functools.wraps(body)
    def forward(self, *args, **kwargs):
        wrapped_by_class = hasattr(type(self).forward, "__wrapped__")
        if (
            wrapped_by_class
            and getattr(self, "gradient_checkpointing", False)
            and self.training
            and torch.is_grad_enabled()
        ):
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if not getattr(self, "_can_checkpoint_with_cache", False):
                for name in ("cache", "past_key_values", "past_key_value"):
                    if kwargs.get(name) is not None:
                        kwargs[name] = None
            run = functools.partial(body, self, **kwargs)
            return self._gradient_checkpointing_func(run, *args)
        return body(self, *args, **kwargs)

    return forward


def _autocast_dtype(t: torch.Tensor):
    """The dtype autocast casts a matmul's (or SDPA's) inputs to on ``t``'s device, or
    None outside autocast."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None
