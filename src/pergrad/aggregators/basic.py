"""The basic rules: mean, sum, median, trimmed mean, per-example clipping."""

from __future__ import annotations

import math

from keras import ops

from pergrad.aggregators import selection
from pergrad.aggregators.base import (
    LOCAL_MEAN,
    LOCAL_SUM,
    CoordinateAggregator,
    ExampleStatistics,
    MeanOf,
    ScaledMean,
    WeightedAggregator,
    protocol_form,
    serializable,
    takes_outer_rows,
)
from pergrad.aggregators.registry import register
from pergrad.arguments import check_number
from pergrad.backend import optional_kernel
from pergrad.tensors import as_float32


@serializable
class Mean(WeightedAggregator):
    """The batch mean: what plain Keras ``fit()`` uses."""

    reads_statistics = False
    distribution = LOCAL_MEAN

    def example_weights(self, stats: ExampleStatistics):
        size = stats.batch_size
        return ops.full((size,), 1.0, dtype="float32") / ops.cast(size, "float32")

    @protocol_form
    def aggregate(self, gradients):
        # Needs no statistics: a plain reduction lets XLA fuse it into the
        # backward pass instead of materializing every per-example gradient.
        return [ops.mean(g, axis=0) for g in gradients]


@serializable
class Sum(WeightedAggregator):
    """The sum over the batch."""

    reads_statistics = False
    distribution = LOCAL_SUM

    def example_weights(self, stats: ExampleStatistics):
        return ops.ones((stats.batch_size,), dtype="float32")

    @protocol_form
    def aggregate(self, gradients):
        return [ops.sum(g, axis=0) for g in gradients]


@serializable
class Median(CoordinateAggregator):
    """Coordinate-wise median (Yin et al., 2018, "Byzantine-robust distributed
    learning: towards optimal statistical rates"). For an even batch, the mean
    of the two middle values, as ``numpy.median``."""

    coordinatewise = True

    @takes_outer_rows
    def aggregate_variable(self, gradient):
        return selection.median(gradient)


@serializable
class TrimmedMean(CoordinateAggregator):
    """Coordinate-wise trimmed mean (Yin et al., 2018).

    Per coordinate, sorts the B values, drops ``floor(trim * B)`` at each end
    and averages the rest.

    Args:
        trim: fraction dropped at each end, in ``[0, 0.5)``.
    """

    coordinatewise = True

    def __init__(self, trim: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.trim = check_number("trimmed_mean", "trim", trim, low=0.0, high=0.5, high_open=True)

    def _dropped(self, batch_size):
        if isinstance(batch_size, int):
            dropped = math.floor(self.trim * batch_size)
            if 2 * dropped >= batch_size:
                raise ValueError(
                    f"trimmed_mean(trim={self.trim}) drops {dropped} values at each end "
                    f"of a batch of {batch_size}, leaving nothing to average."
                )
            return dropped
        return ops.cast(ops.floor(self.trim * ops.cast(batch_size, "float32")), "int32")

    @takes_outer_rows
    def aggregate_variable(self, gradient):
        batch_size = ops.shape(gradient)[0]
        return selection.trimmed_mean(gradient, self._dropped(batch_size))

    def get_config(self):
        return {**super().get_config(), "trim": self.trim}


def clip_factors(stats: ExampleStatistics, threshold: float, per_layer: bool = False):
    """``(factors, norms)``: the factors ``min(1, threshold / norm)`` that clip each
    example's gradient to norm ``threshold``, flat (``(B,)``) or each variable's
    separately (``per_layer``: ``(B, V)``), and the norms they come from. A factor is 0
    for an infinite norm, NaN for a NaN one. Clipping (``clip``), DP-SGD
    (``dp_gaussian``) and centered clipping clip with it.

    From the norms, not their squares (:attr:`ExampleStatistics.norms`): a squared norm
    overflows float32 for a gradient that is still finite, and would give factor 0
    instead of clipping that gradient to ``threshold``.
    """
    norms = as_float32(stats.norms if per_layer else stats.flat_norms)
    return _factors_and_count(norms, threshold)[0], norms


def _size(tensor):
    """The number of entries: a Python int where the shape is static."""
    shape = tuple(tensor.shape)
    return math.prod(shape) if all(isinstance(d, int) for d in shape) else ops.size(tensor)


def _factors_and_count(norms, threshold):
    """``(factors, count)``: :func:`clip_factors`'s factors of ``norms`` and how many of them
    exceed ``threshold`` (float32), by the adapter's own where it has one (torch: two
    ops where Keras's dispatch takes five)."""
    fast = optional_kernel("clip_factors")
    if fast is not None:
        return fast(norms, threshold)
    return threshold / ops.maximum(norms, threshold), ops.sum(ops.cast(norms > threshold, "float32"))


@serializable
class Clip(ScaledMean):
    """Per-example L2 clipping, then the mean (Abadi et al., 2016, DP-SGD
    without noise).

    Each example's gradient is scaled by ``min(1, l2_norm / ||g_i||)``, its norm
    taken over all variables at once (flat) or over each variable separately
    (``per_layer=True``), and the clipped gradients are averaged.

    Reports ``clipped_fraction``: the fraction of examples (per-variable norms
    counted separately with ``per_layer``) whose norm exceeded ``l2_norm``.

    In :func:`~pergrad.aggregators.chain`, a pre-processing step that clips each
    example and passes it on.

    Args:
        l2_norm: the clipping threshold ``C > 0``.
        per_layer: clip each variable's gradient to ``l2_norm`` separately.

    References:
        Abadi et al., 2016, "Deep learning with differential privacy", CCS.
    """

    diagnostics = ("clipped_fraction",)

    def __init__(self, l2_norm: float, per_layer: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.l2_norm = check_number("clip", "l2_norm", l2_norm, low=0.0, low_open=True)
        self.per_layer = per_layer

    def _norms(self, stats: ExampleStatistics):
        return as_float32(stats.norms if self.per_layer else stats.flat_norms)

    def clip_factors(self, stats: ExampleStatistics):
        """``min(1, l2_norm / norm)`` of each example (of each variable's, ``per_layer``)."""
        return _factors_and_count(self._norms(stats), self.l2_norm)[0]

    def example_scales(self, stats: ExampleStatistics):
        return self.clip_factors(stats)

    def map_reports(self, stats, batch_size):
        norms = self._norms(stats)
        # A sum and a count: on several replicas the train step sums both (the whole batch's).
        return {"clipped_fraction": MeanOf(_factors_and_count(norms, self.l2_norm)[1], _size(norms))}

    def get_config(self):
        return {**super().get_config(), "l2_norm": self.l2_norm, "per_layer": self.per_layer}


register("mean")(Mean)
register("sum")(Sum)
register("median")(Median)
register("trimmed_mean")(TrimmedMean)


def mean() -> Mean:
    """The batch mean; trains exactly like plain Keras ``fit()``."""
    return Mean()


def sum() -> Sum:  # noqa: A001 - the public name mirrors the rule
    """The sum of the per-example gradients."""
    return Sum()


def median() -> Median:
    """Coordinate-wise median."""
    return Median()


def trimmed_mean(trim: float = 0.1) -> TrimmedMean:
    """Coordinate-wise mean after dropping ``floor(trim * B)`` values at each end."""
    return TrimmedMean(trim)


def clip(l2_norm: float, per_layer: bool = False) -> Clip:
    """Each example's gradient clipped to ``l2_norm`` (flat or per variable), then averaged."""
    return Clip(l2_norm, per_layer=per_layer)
