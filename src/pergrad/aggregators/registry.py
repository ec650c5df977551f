"""Rules by name: ``register`` a factory under a string, ``get`` an aggregator from a
name, an instance, a class, a saved config or a plain function."""

from __future__ import annotations

import difflib
from collections.abc import Callable

import keras

from pergrad.aggregators.base import Aggregator
from pergrad.aggregators.function import FunctionAggregator

_REGISTERED: dict[str, Callable[[], Aggregator]] = {}


def register(name: str):
    """Registers a factory under a string name (``"median"``) and for saving."""

    def decorate(factory):
        _REGISTERED[name] = factory
        return factory

    return decorate


#: The built-ins that take an argument without a default, hence have no string name.
NEEDS_ARGUMENTS = {
    "clip": "clip(l2_norm)",
    "centered_clip": "centered_clip(tau)",
    "bucketing": "bucketing(size, rule)",
    "chain": "chain(*steps)",
    "two_level": "two_level(groups, local, across)",
    "per_variable": "per_variable(fn)",
    "dp_gaussian": "pergrad.privacy.dp_gaussian(l2_norm_clip, noise_multiplier, ...)",
}


def _unknown_name(name: str) -> str:
    """The error message for an unknown rule name: a built-in that needs its arguments, the
    names that come close, and every name."""
    if name in NEEDS_ARGUMENTS:
        return (f"Aggregator {name!r} needs arguments: pass pergrad.aggregators."
                f"{NEEDS_ARGUMENTS[name]} (an object), not its name.")
    close = difflib.get_close_matches(name, [*_REGISTERED, *NEEDS_ARGUMENTS], n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    calls = ", ".join(value for value in NEEDS_ARGUMENTS.values())
    return (f"Unknown aggregator {name!r}.{hint} Names: {', '.join(sorted(_REGISTERED))}; rules that "
            f"take arguments are objects: {calls}; or pass any function of the per-example "
            "gradients.")


def get(identifier) -> Aggregator:
    """An aggregator from a name (``"median"``), an instance, or a callable."""
    if identifier is None:
        identifier = "mean"
    if isinstance(identifier, Aggregator):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Aggregator):
        return identifier()  # the class itself (`Median`), not a function of gradients
    if isinstance(identifier, str):
        if identifier not in _REGISTERED:
            raise ValueError(_unknown_name(identifier))
        return _REGISTERED[identifier]()
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if callable(identifier):
        return FunctionAggregator(identifier)
    raise TypeError(
        f"An aggregator is a name, an Aggregator or a callable; got {identifier!r}."
    )

