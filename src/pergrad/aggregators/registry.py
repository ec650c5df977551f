"""Rules by name: ``register`` a factory under a string, ``get`` an aggregator from a
name, an instance, a class, a saved config or a plain function."""

from __future__ import annotations

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
            raise ValueError(
                f"Unknown aggregator {identifier!r}; known names: {sorted(_REGISTERED)}. "
                "Pass an aggregator object or a function to use another rule."
            )
        return _REGISTERED[identifier]()
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if callable(identifier):
        return FunctionAggregator(identifier)
    raise TypeError(
        f"An aggregator is a name, an Aggregator or a callable; got {identifier!r}."
    )

