"""The user's own function as an aggregator: one class per kind.

:class:`FunctionAggregator` wraps ``function(list[(B, ...)]) -> list[(...)]``
(kind arbitrary: it sees every per-example gradient at once);
:class:`PerVariableFunction` wraps ``function((B, ...)) -> (...)`` applied to
each variable (kind coordinate: the streaming path can run it one variable at a
time). ``pergrad.aggregators.get(function)`` and :func:`per_variable` pick the
class.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import keras

from pergrad.aggregators.base import (
    Aggregator,
    CoordinateAggregator,
    check_structure,
    protocol_form,
    serializable,
)


@serializable
class FunctionAggregator(Aggregator):
    """Wraps a plain function ``list[(B, ...)] -> list[(...)]`` (kind arbitrary).

    To save a model that uses it, register the function with
    ``keras.saving.register_keras_serializable`` (``get_config``, hence
    ``model.save()``, warns when ``load_model`` could not restore it). The
    function's result is type-checked before use: a list or tuple of float
    tensors, one per variable.

    Args:
        function: the rule.
        per_variable: ``False``; kept for configs saved before
            :class:`PerVariableFunction` (``per_variable(function)``) had a class
            of its own, which load as one.
    """

    def __init__(self, function: Callable, per_variable: bool = False, **kwargs):
        if per_variable:
            raise ValueError(
                "FunctionAggregator(function, per_variable=True) is "
                "pergrad.aggregators.per_variable(function): a PerVariableFunction, kind "
                "coordinate."
            )
        super().__init__(**kwargs)
        self.function = function

    def aggregate(self, gradients):
        return self._checked(self.function(gradients), gradients)

    def _checked(self, result, gradients) -> list:
        # Checked before use: iterating over a tensor or a dict fails obscurely. Shapes
        # are left to `check_result`, which knows the variables' names.
        return check_structure(
            result,
            [tuple(g.shape[1:]) for g in gradients],
            [f"#{k} (of {len(gradients)})" for k in range(len(gradients))],
            f"Aggregator function {_function_name(self.function)!r}",
            check_shapes=False,
        )

    def get_config(self):
        function = keras.saving.serialize_keras_object(self.function)
        if not _loadable(function):
            warnings.warn(
                f"The aggregator function {_function_name(self.function)!r} is not registered "
                "with Keras: a model saved with it cannot be loaded by "
                "keras.models.load_model() (unless it is given in custom_objects). Define it "
                "as a named function decorated with "
                "@keras.saving.register_keras_serializable() before saving.",
                UserWarning,
                stacklevel=2,
            )
        return {**super().get_config(), "function": function}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["function"] = keras.saving.deserialize_keras_object(config["function"])
        if cls is FunctionAggregator and config.pop("per_variable", False):
            cls = PerVariableFunction  # saved before it had a class of its own
        return cls(**config)


@serializable
class PerVariableFunction(FunctionAggregator, CoordinateAggregator):
    """Wraps ``function((B, ...)) -> (...)``, applied to each variable (kind coordinate)."""

    def aggregate_variable(self, gradient):
        """The function's (checked) result for one variable: the streaming path's unit."""
        return self._checked([self.function(gradient)], [gradient])[0]

    @protocol_form  # each variable's aggregate_variable, checked together
    def aggregate(self, gradients):
        return self._checked([self.function(g) for g in gradients], gradients)


def _function_name(function) -> str:
    return getattr(function, "__name__", type(function).__name__)


def _loadable(serialized) -> bool:
    """Whether ``load_model`` (safe mode, no custom objects) can restore a serialized function."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keras.saving.deserialize_keras_object(serialized, safe_mode=True)
    except Exception:  # noqa: BLE001 - any failure means the saved model cannot be loaded
        return False
    return True


def per_variable(function: Callable) -> PerVariableFunction:
    """Lifts ``function((B, ...)) -> (...)`` to an aggregator, variable by variable."""
    return PerVariableFunction(function)
