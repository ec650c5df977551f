"""The linear map of the batch that a pre-processing step is (:class:`RowMap`).

The streaming path (``pergrad.engine.streaming``) and the layer rules
(``pergrad.layer_rules``) apply it to a layer's input and output gradient; steps
(``aggregators.base.RowMapStep``) return it from ``row_map``.
"""

from __future__ import annotations

from keras import ops

from pergrad.aggregators.example_statistics import ExampleStatistics
from pergrad.tensors import scale_rows


class RowMap:
    """A linear map of the batch of per-example gradients: what pre-processing steps do.

    Output row ``j`` of variable ``k`` is ``sum_t weights[j, t, k] g_{order[j, t]}``:
    clipping scales each row (``order`` the identity), ``norm_filter`` keeps some
    rows, ``bucketing`` averages groups of rows. Because the map is linear, the
    streaming path (``pergrad.engine.streaming``) can apply it to a layer's
    input and output gradient before any per-example gradient is formed, and
    the maps of consecutive steps compose into one.

    Attributes:
        order: ``(J, s)`` int32 row indices, or ``None``: the identity (``s = 1``).
        weights: ``(J, s, 1)`` (the same for every variable) or ``(J, s, V)``
            float32, or ``None`` (all one).
    """

    def __init__(self, order=None, weights=None):
        self.order, self.weights = order, weights

    @classmethod
    def scaling(cls, scales) -> RowMap:
        """Row i times ``scales[i]`` (``(B,)``) or ``scales[i, k]`` (``(B, V)``)."""
        scales = ops.cast(scales, "float32")
        return cls(None, scales[:, None, None] if len(scales.shape) == 1 else scales[:, None, :])

    @property
    def per_variable(self) -> bool:
        """Whether the weights differ between variables."""
        return self.weights is not None and self.weights.shape[2] != 1

    def variable_weights(self, k):
        """``(J, s)`` weights of variable ``k``, or ``None`` (all one)."""
        if self.weights is None:
            return None
        return self.weights[:, :, k if self.per_variable else 0]

    def then(self, second: RowMap) -> RowMap:
        """The map applying ``self``, then ``second`` to ``self``'s output rows."""
        if second.order is None:
            if self.weights is None or second.weights is None:
                return RowMap(self.order, second.weights if self.weights is None else self.weights)
            return RowMap(self.order, self.weights * second.weights)
        if self.order is None:  # s = 1: the second map's rows, reweighted
            weights = second.weights
            if self.weights is not None:
                first = ops.take(self.weights[:, 0], second.order, axis=0)  # (J2, s2, V)
                weights = first if weights is None else first * weights
            return RowMap(second.order, weights)
        order = ops.take(self.order, second.order, axis=0)  # (J2, s2, s1)
        size = ops.shape(order)
        weights = None
        if self.weights is not None:
            weights = ops.take(self.weights, second.order, axis=0)  # (J2, s2, s1, V)
        if second.weights is not None:
            outer = second.weights[:, :, None, :]
            weights = ops.repeat(outer, size[2], axis=2) if weights is None else weights * outer
        if weights is not None:
            weights = ops.reshape(weights, (size[0], size[1] * size[2], weights.shape[3]))
        return RowMap(ops.reshape(order, (size[0], size[1] * size[2])), weights)

    def statistics(self, stats: ExampleStatistics) -> ExampleStatistics | None:
        """The statistics of the output rows, where they follow from ``stats``: with one
        input row per output row (``s = 1``); the Gram matrix only with flat weights.
        ``None`` otherwise (a bucket mean's norm needs the Gram matrix of its rows)."""
        if self.order is not None and self.order.shape[1] != 1:
            return None
        if self.order is not None:
            stats = stats.rows(self.order[:, 0])
        if self.weights is None:
            return stats
        weights = self.weights[:, 0]  # (J, 1) or (J, V)
        return stats.scaled_by(weights if self.per_variable else weights[:, 0])

    def apply(self, gradient, k=0):
        """The map applied to variable ``k``'s per-example gradients ``(B, ...)``: ``(J, ...)``."""
        weights = self.variable_weights(k)
        if self.order is None:
            if weights is None:
                return gradient
            return scale_rows(gradient, weights[:, 0])
        rows = ops.take(gradient, ops.reshape(self.order, (-1,)), axis=0)
        if weights is not None:
            rows = scale_rows(rows, ops.reshape(weights, (-1,)))
        size = ops.shape(self.order)
        return ops.sum(ops.reshape(rows, (size[0], size[1]) + tuple(gradient.shape[1:])), axis=1)

