"""Aggregators: per-example gradients in, one gradient out (``keras.ops`` only)."""

from pergrad.aggregators.base import (
    ARBITRARY,
    COORDINATE,
    KINDS,
    STATISTICS,
    Aggregator,
    CoordinateAggregator,
    ExampleStatistics,
    FunctionAggregator,
    WeightedAggregator,
    get,
    per_variable,
    weighted_sum,
)
from pergrad.aggregators.basic import (
    clip,
    mean,
    median,
    sum,  # noqa: A004
    trimmed_mean,
)

__all__ = [
    "ARBITRARY",
    "COORDINATE",
    "KINDS",
    "STATISTICS",
    "Aggregator",
    "CoordinateAggregator",
    "ExampleStatistics",
    "FunctionAggregator",
    "WeightedAggregator",
    "clip",
    "get",
    "mean",
    "median",
    "per_variable",
    "sum",
    "trimmed_mean",
    "weighted_sum",
]
