"""The layer rules' ``sum_grad_squared`` and ``cross_gram`` against the materialized path.

``sum_i g_i ** 2`` per coordinate (the GSNR's second moments, ``pergrad.insight.diagnostics``)
and the block ``<g_i, g_j>``, ``i < split <= j`` (``pergrad.scores``' influence), from
each call's ``A`` and ``D`` (``engine.layers.Layers``), must equal the same sums over
the materialized per-example gradients (``pergrad.per_example_gradients``, itself
checked against the batch-of-one oracle). One small model, run eagerly (no compile),
covers the formulas: LoRA ``Dense`` on 2-D inputs ((A^2)^T (D^2) for A, B and the
frozen kernel's absence) and on sequences (formed per example), an ``Embedding`` whose
cross block takes token pairs, and an untied ``ReversibleEmbedding`` whose forward call
takes the other side's tables and whose reverse call the 2-D Dense formulas; a second
model has shared variables and a layer without a rule.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import layers

import oracle
import pergrad
import problems
from pergrad.backend import adapter
from pergrad.engine.problem import cached_problem
from pergrad.engine.statistics import layers_of

BATCH, SPLIT, POSITIONS = 5, 3, 4


def _lora(layer, rng, rank):
    layer.enable_lora(rank)  # B starts at zero: A's gradient would be zero
    layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))


def _model():
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    ids = keras.Input((POSITIONS,), dtype="int32")
    # Embedding(50): 16 position pairs x 3 examples <= 50 rows, the cross block from token pairs;
    # the ReversibleEmbedding(11)'s forward call from the test side's tables.
    table = layers.ReversibleEmbedding(11, 6, tie_weights=False)
    h = layers.Add()([layers.Embedding(50, 6)(ids), table(ids)])
    sequence, flat = layers.Dense(5, activation="tanh"), layers.Dense(6, activation="tanh")
    pooled = layers.GlobalAveragePooling1D()(sequence(h))
    logits = table(flat(pooled), reverse=True)
    model = keras.Model(ids, logits)
    _lora(sequence, rng, 2)
    _lora(flat, rng, 3)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.integers(0, 11, size=(BATCH, POSITIONS)).astype("int32")
    x[0, :2] = x[0, 2]  # a repeated token
    y = rng.integers(0, 11, size=(BATCH,)).astype("int32")
    weight = np.array([1.0, 0.5, 2.0, 1.0, 0.0], "float32")
    return model, x, y, weight


def _shared_and_fallback():
    problem = problems.make("shared_and_fallback")
    problem.compile()
    return problem.model, problem.x, problem.y, problem.sample_weight


@pytest.mark.parametrize("make", [_model, _shared_and_fallback], ids=["rules", "shared_and_fallback"])
def test_sum_grad_squared_and_cross_gram_match_the_materialized_path(make):
    """``rules``: the formulas above; ``shared_and_fallback``: a Dense layer called twice and a
    table read by two layers (their per-example gradients summed first), a layer without a rule."""
    model, x, y, weight = make()
    size = len(x)
    problem = cached_problem(model, None, True)
    variables = model.trainable_variables

    def moments(values, states, x, y, weight):  # (compiled: one JAX compile, not eager dispatch)
        batched, batch, non_trainable, _ = problem.batched_inputs(states, x, y, weight)
        shared = {"non_trainable": non_trainable, "loss_scale": None}
        found, _ = layers_of(problem, values, batched, shared, batch, None)
        return found.sum_grad_squared(variables), found.cross_gram(SPLIT)

    tensors = [keras.ops.convert_to_tensor(t) for t in (x, y, weight)]
    squares, cross = adapter().compile(moments)([v.value for v in variables],
                                                [v.value for v in model.non_trainable_variables], *tensors)
    grads = [oracle.to_numpy(g).astype("float64")
             for g in pergrad.per_example_gradients(model, x, y, weight)]
    if make is _model:
        lora = [v for v in model.trainable_variables if "lora" in v.path]
        assert len(lora) == 4 and len(grads) == len(variables) == 9  # (LoRA kernels frozen)
    for v, moment, g in zip(variables, squares, grads):
        assert np.abs(g).max() > 0, v.path  # every variable takes part
        np.testing.assert_allclose(oracle.to_numpy(moment), (g ** 2).sum(axis=0), rtol=1e-5, atol=1e-7,
                                   err_msg=v.path)
    rows = [g.reshape(size, -1) for g in grads]
    expected = sum(r[:SPLIT] @ r[SPLIT:].T for r in rows)
    np.testing.assert_allclose(oracle.to_numpy(cross), expected, rtol=1e-5, atol=1e-7)
