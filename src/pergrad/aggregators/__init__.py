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
    ScaledMean,
    WeightedAggregator,
    get,
    per_variable,
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
    bucketing,
    chain,
)
from pergrad.aggregators.robust import (
    centered_clip,
    geometric_median,
    krum,
    meamed,
    norm_filter,
    sign_majority,
)
from pergrad.privacy.dp_sgd import (
    DPGaussian,
    dp_gaussian,
)

__all__ = [
    "ARBITRARY",
    "COORDINATE",
    "KINDS",
    "STATISTICS",
    "Aggregator",
    "DPGaussian",
    "CoordinateAggregator",
    "ExampleStatistics",
    "FunctionAggregator",
    "ScaledMean",
    "WeightedAggregator",
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
    "weighted_sum",
]
