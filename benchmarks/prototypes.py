"""Prototypes of engine changes, measured by ``bench.py --recipes ...,proto``.

Nothing here is used by pergrad itself; each piece is a proposal for
``src/pergrad`` (see the benchmark report).

1. ``TwoPassModel``: for a statistics aggregator (``WeightedAggregator``
   without Gram matrix and with flat weights), never build the ``B x P``
   per-example gradients:

   - pass 1, only if the weights read statistics: per-example squared norms,
     reduced *inside* the vectorized function, so that only ``(B, V)`` leaves
     the vectorized map (XLA then fuses each per-example gradient into its
     reduction; TF/torch build one variable's per-example gradients at a time);
   - pass 2: one ordinary backward pass of ``sum_i w_i L_i`` with ``w`` held
     constant (docs/architecture.md, 'Aggregator kinds': ``sum_i w_i g_i`` is that gradient).

   ``mean`` and ``sum`` need no statistics, so they cost one backward pass:
   what plain Keras does.

2. ``bitonic_median``: coordinate-wise median over the batch axis by a
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
from pergrad.aggregators.base import ExampleStatistics, WeightedAggregator

BACKEND = keras.backend.backend()

# --------------------------------------------------------------------------------------
# backend pieces: a vectorized map returning per-example squared norms, a
# vectorized forward pass, and a gradient with auxiliary outputs

if BACKEND == "jax":
    import jax
    import jax.numpy as jnp

    def vectorized_squared_norms(fn, params, batched, shared):
        single_grad = jax.grad(fn, has_aux=True)

        def single(example):
            grads, aux = single_grad(params, example, shared)
            # Reduce the *transposed* gradient: JAX forms a Dense kernel's
            # cotangent as transpose(dot_general(delta, x)); reducing g.T lets XLA
            # cancel the transpose and fuse the outer product into the reduction
            # instead of materializing it (B x 784 x 256 floats on the MLP).
            return jnp.stack([jnp.sum(jnp.square(jnp.transpose(g))) for g in grads]), aux

        return jax.vmap(single)(batched)

    def vectorized_value(fn, params, batched, shared):
        return jax.vmap(lambda example: fn(params, example, shared))(batched)

    def grad_with_aux(fn, params):
        return jax.grad(fn, has_aux=True)(params)

elif BACKEND == "tensorflow":
    import tensorflow as tf

    def vectorized_squared_norms(fn, params, batched, shared):
        def single(example):
            with tf.GradientTape() as tape:
                tape.watch(params)
                loss, aux = fn(params, example, shared)
            grads = tape.gradient(loss, params)
            squared = [
                tf.zeros((), loss.dtype) if g is None else tf.reduce_sum(tf.square(tf.convert_to_tensor(g)))
                for g in grads
            ]
            return tf.stack(squared), aux

        return tf.vectorized_map(single, batched, fallback_to_while_loop=True)

    def vectorized_value(fn, params, batched, shared):
        return tf.vectorized_map(lambda example: fn(params, example, shared), batched)

    def grad_with_aux(fn, params):
        with tf.GradientTape() as tape:
            tape.watch(params)
            value, aux = fn(params)
        grads = tape.gradient(value, params)
        grads = [tf.zeros_like(p) if g is None else tf.convert_to_tensor(g) for g, p in zip(grads, params)]
        return grads, aux

else:
    import torch

    from pergrad.backend.torch import _IgnoreMemoryLayout

    def vectorized_squared_norms(fn, params, batched, shared):
        single_grad = torch.func.grad(fn, has_aux=True)

        def single(example):
            grads, aux = single_grad(params, example, shared)
            return torch.stack([torch.sum(torch.square(g)) for g in grads]), aux

        with torch.enable_grad(), _IgnoreMemoryLayout():
            return torch.func.vmap(single, randomness="different")(batched)

    def vectorized_value(fn, params, batched, shared):
        with _IgnoreMemoryLayout():
            return torch.func.vmap(lambda example: fn(params, example, shared), randomness="different")(
                batched
            )

    def grad_with_aux(fn, params):
        with torch.enable_grad():
            params = [p.detach().requires_grad_(True) for p in params]
            value, aux = fn(params)
            grads = torch.autograd.grad(value, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
        aux = torch.utils._pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, aux)
        return grads, aux


def _stop_gradient(t):
    return ops.stop_gradient(t)


# --------------------------------------------------------------------------------------
# 1. the two-pass statistics path


def _statistics_free(aggregator) -> bool:
    """Whether the weights ignore the statistics (mean, sum): skip pass 1."""
    return type(aggregator) in (basic.Mean, basic.Sum)


@keras.saving.register_keras_serializable(package="pergrad_bench")
class TwoPassModel(pergrad.PerExampleModel):
    """``PerExampleModel`` whose statistics aggregators never materialize ``B x P``.

    Prototype: handles models without masks, ``sum`` reductions, loss scaling or
    weight regularizers (the benchmark's models); the real change must pass
    the engine's per-example scale (``example_scale``) into ``w`` too.
    """

    def _aggregated_gradients(self, trainable_values, non_trainable_values, x, y, sample_weight):
        aggregator = self.aggregator
        if not (isinstance(aggregator, WeightedAggregator) and not aggregator.needs_gram):
            return super()._aggregated_gradients(
                trainable_values, non_trainable_values, x, y, sample_weight
            )
        problem = self._problem()
        params = list(trainable_values)
        batched = {"x": ops.convert_to_tensor(x), "y": ops.convert_to_tensor(y)}
        if sample_weight is not None:
            batched["sample_weight"] = sample_weight
        shared = {"non_trainable": list(non_trainable_values), "loss_scale": None}
        batch_size = ops.shape(batched["x"])[0]

        if _statistics_free(aggregator):
            stats = ExampleStatistics(ops.zeros((batch_size, len(params))))
            weights = aggregator.example_weights(stats)
            finite = None
        else:
            squared, _ = vectorized_squared_norms(problem._example_loss, params, batched, shared)
            stats = ExampleStatistics(squared)
            weights = aggregator.example_weights(stats)
            finite = ops.all(ops.isfinite(squared))
        self.__dict__["_pending_reports"] = aggregator.pop_reports()
        if len(weights.shape) != 1:  # per-variable weights: V backward passes; not prototyped
            return super()._aggregated_gradients(
                trainable_values, non_trainable_values, x, y, sample_weight
            )
        weights = _stop_gradient(weights)

        def weighted_loss(values):
            losses, aux = vectorized_value(problem._example_loss, values, batched, shared)
            return ops.sum(ops.cast(weights, losses.dtype) * losses), aux

        grads, aux = grad_with_aux(weighted_loss, params)
        result = aggregator.finalize(grads)
        if finite is None:
            finite = ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in result]))
        nan = ops.convert_to_tensor(float("nan"))
        result = [ops.where(finite, g, ops.cast(nan, g.dtype)) for g in result]
        return result, aux["y_pred"], []


# --------------------------------------------------------------------------------------
# 2. a vectorizing median


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
    """The ``proto <aggregation>`` variant of the benchmark."""
    if aggregation == "median":
        return pergrad.PerExampleModel(inner, BitonicMedian())
    aggregator = pergrad.aggregators.clip(1.0) if aggregation == "clip" else aggregation
    return TwoPassModel(inner, aggregator)


# --------------------------------------------------------------------------------------
# 3. the layer-rule ceiling for Dense-only models, by hand
#    (docs/architecture.md, 'The planned layer-rule fast path')


@keras.saving.register_keras_serializable(package="pergrad_bench")
class GhostDenseModel(pergrad.PerExampleModel):
    """Statistics aggregators on a stack of ``Dense`` layers, without ``B x P``.

    One forward pass with a zero probe added to every pre-activation, one
    backward pass to the probes (``delta_i``), then per layer
    ``||g_i||^2 = ||x_i||^2 ||delta_i||^2`` (+ ``||delta_i||^2`` for the bias) and
    ``sum_i w_i g_i = x^T (w * delta)``: no second backward pass. Hand-written for
    the benchmark's MLP (sparse categorical cross-entropy from logits) to
    measure what the layer-rule path can reach; not generic.
    """

    def _aggregated_gradients(self, trainable_values, non_trainable_values, x, y, sample_weight):
        aggregator = self.aggregator
        variables = self.model.trainable_variables
        layers = [layer for layer in self.model.layers if layer.trainable_variables]
        if not all(isinstance(layer, keras.layers.Dense) for layer in layers):
            raise TypeError("GhostDenseModel handles Dense-only models")
        position = {id(v): i for i, v in enumerate(variables)}
        kernels = [trainable_values[position[id(layer.kernel)]] for layer in layers]
        biases = [trainable_values[position[id(layer.bias)]] for layer in layers]
        x = ops.convert_to_tensor(x)
        batch = x.shape[0]
        probes = [ops.zeros((batch, layer.units), dtype=x.dtype) for layer in layers]

        def forward(probes):
            h, inputs = x, []
            for layer, kernel, bias, probe in zip(layers, kernels, biases, probes):
                inputs.append(h)
                h = layer.activation(ops.matmul(h, kernel) + bias + probe)
            losses = keras.losses.sparse_categorical_crossentropy(y, h, from_logits=True)
            return ops.sum(losses), (inputs, h)

        deltas, (inputs, logits) = grad_with_aux(forward, probes)
        squared_inputs = [ops.sum(ops.square(a), axis=1) for a in inputs]
        squared_deltas = [ops.sum(ops.square(d), axis=1) for d in deltas]
        columns = [None] * len(variables)
        for layer, a2, d2 in zip(layers, squared_inputs, squared_deltas):
            columns[position[id(layer.kernel)]] = a2 * d2
            columns[position[id(layer.bias)]] = d2
        squared = ops.stack(columns, axis=1)
        weights = aggregator.example_weights(ExampleStatistics(squared))
        self.__dict__["_pending_reports"] = aggregator.pop_reports()
        weights = _stop_gradient(ops.cast(weights, x.dtype))
        result = [None] * len(variables)
        for layer, a, d in zip(layers, inputs, deltas):
            weighted = d * weights[:, None]
            result[position[id(layer.kernel)]] = ops.matmul(ops.transpose(a), weighted)
            result[position[id(layer.bias)]] = ops.sum(weighted, axis=0)
        result = aggregator.finalize(result)
        finite = ops.all(ops.isfinite(squared))
        nan = ops.convert_to_tensor(float("nan"))
        result = [ops.where(finite, g, ops.cast(nan, g.dtype)) for g in result]
        return result, logits, []


def ghost_model(inner, aggregation: str):
    """The ``ghost <aggregation>`` variant (Dense-only models)."""
    aggregator = pergrad.aggregators.clip(1.0) if aggregation == "clip" else aggregation
    return GhostDenseModel(inner, aggregator)
