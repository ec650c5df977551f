"""Per-example statistics: what a statistics rule's weights are computed from.

:class:`ExampleStatistics` holds each example's squared gradient norm per
variable (and, for rules that ask, the Gram matrix) without the gradients
themselves; the helpers below compute squared norms of gradient rows without
overflowing float32. The engine's statistics path computes the same quantities
from each layer's input and output gradient instead (``pergrad.engine``).
"""

from __future__ import annotations

from keras import ops

from pergrad.backend import adapter, eager, optional_kernel
from pergrad.tensors import as_float32, example_rows


class ExampleStatistics:
    """Per-example statistics of a batch of per-example gradients.

    A squared norm overflows float32 long before the gradient does (entries
    above ~1e19 suffice), so the engine may keep each squared norm divided by
    the square of a ``scale`` (the largest entry of that example's gradient of
    that variable, say): the norms themselves (:attr:`norms`,
    :attr:`flat_norms`) are then right for every finite gradient whose norm is
    below float32's largest value. Rules should read those;
    :attr:`squared_norms` multiplies the scales back in.

    Args:
        squared_norms: ``(B, V)``, squared L2 norm of example i's gradient of
            variable k, divided by ``scale[i, k] ** 2`` when ``scale`` is given.
        gram: ``(B, B)`` Gram matrix ``<g_i, g_j>`` over all variables, or
            ``None`` when the aggregator did not ask for it (not rescaled: an
            example whose squared norm overflows has infinite entries).
        scale: ``(B, V)`` positive factors, or ``None`` (all one).
        units: ``(B,)`` integer ids of each example's privacy unit (its user), for a
            rule that ``reads_units`` (user-level DP); else ``None``.
    """

    def __init__(self, squared_norms, gram=None, *, scale=None, units=None):
        self.scaled_squared_norms = squared_norms
        self.gram = gram
        self.scale = scale
        self.units = units

    def __repr__(self) -> str:
        # Shapes only: the values may be symbolic (inside a traced step).
        shape = tuple(self.scaled_squared_norms.shape)
        gram = "" if self.gram is None else f", gram: {tuple(self.gram.shape)}"
        return (f"ExampleStatistics({shape[0]} examples x {shape[1]} variables; read .norms "
                f"{shape}, .flat_norms ({shape[0]},), .squared_norms{gram})")

    @property
    def batch_size(self):
        return ops.shape(self.scaled_squared_norms)[0]

    @property
    def squared_norms(self):
        """``(B, V)`` squared norms (infinite where one overflows float32)."""
        if self.scale is None:
            return self.scaled_squared_norms
        return self.scaled_squared_norms * ops.square(self.scale)

    @property
    def flat_squared_norms(self):
        """``(B,)`` squared norms of the flat gradients (infinite where one overflows)."""
        return ops.sum(self.squared_norms, axis=1)

    @property
    def norms(self):
        """``(B, V)`` L2 norms of example i's gradient of variable k, without overflow."""
        norms = ops.sqrt(self.scaled_squared_norms)
        return norms if self.scale is None else norms * self.scale

    @property
    def flat_norms(self):
        """``(B,)`` L2 norms of the flat gradients, without overflow."""
        if self.scale is None:
            fast = optional_kernel("flat_norms_2d")
            if fast is not None:
                return fast(self.scaled_squared_norms)
            return ops.sqrt(ops.sum(self.scaled_squared_norms, axis=1))
        largest = ops.max(self.scale, axis=1)
        relative = ops.square(self.scale / largest[:, None])
        return ops.sqrt(ops.sum(self.scaled_squared_norms * relative, axis=1)) * largest

    @property
    def finite(self):
        """``(B,)`` booleans: whether example i's statistics are finite (a gradient with a
        NaN or an infinity has a non-finite norm; an overflowing squared norm alone is not)."""
        finite = ops.all(ops.isfinite(self.scaled_squared_norms), axis=1)
        return finite if self.scale is None else finite & ops.all(ops.isfinite(self.scale), axis=1)

    def rows(self, rows) -> ExampleStatistics:
        """The statistics of the examples ``rows`` (``(J,)`` indices), in that order."""
        gram = self.gram
        if gram is not None:
            gram = ops.take(ops.take(gram, rows, axis=0), rows, axis=1)
        scale = None if self.scale is None else ops.take(self.scale, rows, axis=0)
        units = None if self.units is None else ops.take(self.units, rows, axis=0)
        return ExampleStatistics(ops.take(self.scaled_squared_norms, rows, axis=0), gram, scale=scale,
                                 units=units)

    def scaled_by(self, factors) -> ExampleStatistics:
        """The statistics of ``f_i g_i`` (``(B,)`` factors, Gram matrix kept) or of
        ``f_ik g_ik`` (``(B, V)``: the Gram matrix is not known then)."""
        factors = ops.cast(factors, "float32")
        gram = None
        if len(factors.shape) == 1:
            if self.gram is not None:
                gram = factors[:, None] * self.gram * factors[None, :]
            factors = factors[:, None]
        # Into the scale, not the squared norms: a clip factor of 1e-19 squared underflows.
        scale = ops.ones_like(self.scaled_squared_norms) if self.scale is None else self.scale
        return ExampleStatistics(self.scaled_squared_norms, gram, scale=scale * ops.abs(factors),
                                 units=self.units)

    @classmethod
    def from_gradients(cls, gradients, gram: bool = False, units=None) -> ExampleStatistics:
        flat = [example_rows(g) for g in gradients]
        squared_norms, scale = squared_norms_of_rows(flat)
        gram_matrix = None
        if gram:
            gram_matrix = sum(ops.matmul(f, ops.transpose(f)) for f in flat)
        return cls(squared_norms, gram_matrix, scale=scale, units=units)


def row_scales(tensor):
    """``(B,)``: the largest absolute entry of each example's part of ``tensor`` (batch
    first), 1 where that is zero or not finite. Divided by it, no square overflows."""
    tensor = ops.cast(tensor, "float32")
    largest = ops.max(ops.abs(tensor), axis=tuple(range(1, len(tensor.shape))))
    return ops.where(ops.isfinite(largest) & (largest > 0), largest, ops.ones_like(largest))


def overflow_safe(plain, rescaled):
    """``(squared norms, scale)``: ``(plain, ones)`` (on torch ``(plain, None)``) when every
    entry of ``plain`` (``(B, V)`` squared norms) is finite, else ``rescaled()``, which
    computes them divided by the square of a ``(B, V)`` scale. One branch runs
    (``keras.ops.cond``): the rescaling costs nothing unless a squared norm overflowed (or a
    gradient is not finite)."""
    plain = as_float32(plain)
    if eager():
        # torch: the branch is chosen in Python anyway; the plain values' scale is None
        # (all one: ExampleStatistics then skips the scale's arithmetic, a few ops
        # whose dispatch costs more than their work).
        return (plain, None) if adapter().all_finite(plain) else rescaled()
    finite = ops.all(ops.isfinite(plain))

    def unscaled():
        return plain, ops.ones_like(plain)

    return ops.cond(finite, unscaled, rescaled)


def stack_columns(columns):
    """``(B, V)``: ``V`` tensors of shape ``(B,)`` as columns (``ops.stack(columns, axis=1)``,
    by the adapter's own where it has one: torch)."""
    fast = optional_kernel("stack_columns")
    return ops.stack(columns, axis=1) if fast is None else fast(columns)


def row_squared_norms(rows):
    """``(B,)``: each row's squared norm of a ``(B, n)`` tensor (torch: one pass over it,
    where ``sum(r * r)`` makes three)."""
    fast = optional_kernel("row_squared_norms_2d")
    return ops.sum(rows * rows, axis=1) if fast is None else fast(rows)


def example_squared_norms(gradients):
    """``(B,)``: each example's squared norm of a ``(B, ...)`` tensor (torch: one pass, no
    reshape op)."""
    fast = optional_kernel("example_squared_norms")
    return row_squared_norms(example_rows(gradients)) if fast is None else fast(gradients)


def example_weighted_sum(gradients, weights):
    """``sum_i w_i g_i`` of ``(B, ...)`` gradients and ``(B,)`` weights, in the shape of one
    example's (torch: one contraction, no reshape op)."""
    fast = optional_kernel("example_weighted_sum")
    if fast is not None:
        return fast(gradients, weights)
    return ops.reshape(ops.matmul(weights[None, :], example_rows(gradients))[0], ops.shape(gradients)[1:])


def squared_norms_of_rows(rows: list):
    """``((B, V), (B, V))``: the squared norms of ``(B, n_k)`` gradient rows of ``V`` variables,
    without overflow (:func:`overflow_safe`; scaled by each row's largest entry)."""
    rows = [ops.cast(r, "float32") for r in rows]
    plain = stack_columns([row_squared_norms(r) for r in rows])

    def rescaled():
        norms, scales = scaled_squared_norms_of_rows(rows)
        return stack_columns(norms), stack_columns(scales)

    return overflow_safe(plain, rescaled)


def scaled_squared_norms_of_rows(rows: list):
    """``(norms, scales)``: for each ``(B, n)`` rows tensor, the ``(B,)`` squared norms of its
    rows divided by their largest entry, and those entries (:func:`row_scales`)."""
    scales = [row_scales(r) for r in rows]
    return [ops.sum(ops.square(r / s[:, None]), axis=1) for r, s in zip(rows, scales)], scales

