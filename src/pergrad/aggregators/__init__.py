"""Aggregators: per-example gradients in, one gradient out (``keras.ops`` only).

``dp_gaussian`` and ``DPGaussian`` live in ``pergrad.privacy`` (which builds on
``pergrad.aggregators.base``) and are imported from there on first use, so that
importing this package does not import ``pergrad.privacy``.
"""

import importlib

from pergrad.aggregators.base import (
    ARBITRARY,
    COORDINATE,
    KINDS,
    STATISTICS,
    Aggregation,
    Aggregator,
    BatchTotals,
    CoordinateAggregator,
    ExampleStatistics,
    MeanOf,
    RowMapStep,
    ScaledMean,
    WeightedAggregator,
    scale_examples,
    weighted_sum,
)
from pergrad.aggregators.basic import (
    clip,
    mean,
    median,
    sum,  # noqa: A004
    trimmed_mean,
)
from pergrad.aggregators.clipping import automatic_clip
from pergrad.aggregators.compose import (
    Chain,
    CoordinateChain,
    WeightedChain,
    bucketing,
    chain,
    two_level,
)
from pergrad.aggregators.function import FunctionAggregator, PerVariableFunction, per_variable
from pergrad.aggregators.registry import get
from pergrad.aggregators.robust import (
    centered_clip,
    geometric_median,
    krum,
    meamed,
    norm_filter,
    sign_majority,
)

_FROM_PRIVACY = ("DPGaussian", "dp_gaussian")


def __getattr__(name):
    # PEP 562: resolved on first access, by when pergrad.aggregators is fully imported.
    if name in _FROM_PRIVACY:
        return getattr(importlib.import_module("pergrad.privacy.dp_sgd"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ARBITRARY",
    "COORDINATE",
    "KINDS",
    "STATISTICS",
    "Aggregation",
    "Aggregator",
    "BatchTotals",
    "Chain",
    "CoordinateAggregator",
    "CoordinateChain",
    "DPGaussian",
    "ExampleStatistics",
    "FunctionAggregator",
    "MeanOf",
    "PerVariableFunction",
    "RowMapStep",
    "ScaledMean",
    "WeightedAggregator",
    "WeightedChain",
    "automatic_clip",
    "bucketing",
    "centered_clip",
    "chain",
    "clip",
    "dp_gaussian",
    "geometric_median",
    "get",
    "krum",
    "meamed",
    "mean",
    "median",
    "norm_filter",
    "per_variable",
    "scale_examples",
    "sign_majority",
    "sum",
    "trimmed_mean",
    "two_level",
    "weighted_sum",
]
