"""Prototypes of engine changes, measured by ``bench.py --recipes ...,proto``.

Nothing here is used by pergrad itself; each piece is a proposal for
``src/pergrad`` (see the benchmark report). The
statistics-path prototypes that were here are now ``pergrad.engine.statistics``.

``bitonic_median`` (for the coordinate-rule issue): coordinate-wise median over the batch axis by a
   bitonic sorting network (``minimum``/``maximum`` only, ``keras.ops``), in
   column blocks under ``jax.lax.map`` on JAX (sorting networks vectorize over
   the ``P`` coordinates, XLA:CPU's comparator sort does not).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

import pergrad
from pergrad.aggregators import basic

BACKEND = keras.backend.backend()

if BACKEND == "jax":
    import jax
    import jax.numpy as jnp

# --------------------------------------------------------------------------------------
# a vectorizing median


def _bitonic_median_2d(x):
    """Median over axis 0 of a ``(B, N)`` tensor; ``B`` static."""
    b = x.shape[0]
    n = 1 << (b - 1).bit_length()
    if n > b:  # +inf padding sorts last and leaves the first B sorted values alone
        x = ops.concatenate([x, ops.full((n - b, x.shape[1]), float("inf"), dtype=x.dtype)], 0)
    k = 2
    while k <= n:
        j = k // 2
        while j >= 1:
            y = ops.reshape(x, (n // (2 * j), 2, j, -1))
            a, c = y[:, 0], y[:, 1]
            lo, hi = ops.minimum(a, c), ops.maximum(a, c)
            if k == n:
                first, second = lo, hi
            else:
                ascending = np.arange(n // (2 * j)) // (k // (2 * j)) % 2 == 0
                ascending = ops.convert_to_tensor(ascending[:, None, None])
                first, second = ops.where(ascending, lo, hi), ops.where(ascending, hi, lo)
            x = ops.reshape(ops.stack([first, second], 1), (n, -1))
            j //= 2
        k *= 2
    return (x[(b - 1) // 2] + x[b // 2]) / 2


def bitonic_median(gradient, block: int = 512):
    """Coordinate-wise median of ``(B, ...)`` over the batch axis."""
    b = gradient.shape[0]
    flat = ops.reshape(gradient, (b, -1))
    if BACKEND != "jax":
        return ops.reshape(_bitonic_median_2d(flat), gradient.shape[1:])
    size = flat.shape[1]
    chunks = -(-size // block)
    flat = jnp.pad(flat, ((0, 0), (0, chunks * block - size)))
    blocks = jnp.transpose(jnp.reshape(flat, (b, chunks, block)), (1, 0, 2))
    medians = jax.lax.map(_bitonic_median_2d, blocks)
    return jnp.reshape(jnp.reshape(medians, (-1,))[:size], gradient.shape[1:])


@keras.saving.register_keras_serializable(package="pergrad_bench")
class BitonicMedian(basic.Median):
    def aggregate_variable(self, gradient):
        if gradient.shape[0] is None:
            return super().aggregate_variable(gradient)
        return bitonic_median(gradient)


def prototype_model(inner, aggregation: str):
    """The ``proto median`` variant of the benchmark."""
    if aggregation != "median":
        raise ValueError("benchmarks/prototypes.py only prototypes the median now")
    return pergrad.PerExampleModel(inner, BitonicMedian())
