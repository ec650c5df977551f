"""``microbatch_size`` with mean/sum and statistics rules: accumulated chunk by chunk.

The chunked path (``pergrad.engine.chunked``) must give what the unchunked one gives: the
aggregate of the whole batch's per-example gradients, with the whole batch's
normalization (sum reduction, masks), its dropout seeds and its aux outputs.

Run once per backend: ``KERAS_BACKEND=torch pytest tests/engine/test_microbatch.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import oracle
import pergrad
import problems
from pergrad.aggregators import chain, clip, krum, mean
from pergrad.aggregators import sum as sum_rule
from pergrad.aggregators.base import zero_non_finite_examples
from pergrad.engine import PerExampleProblem, chunked
from pergrad.privacy import dp_gaussian

BATCH = 10  # one batch shape for the file; chunks of 4 leave a last chunk of 2
CHUNK = 4


def _rules():
    return {
        "mean": mean,
        "sum": sum_rule,
        "clip": lambda: clip(0.3),
        "clip_per_layer": lambda: clip(0.3, per_layer=True),
        "krum": lambda: krum(0.2, select=3),  # reads the Gram matrix
        "dp_no_noise": lambda: dp_gaussian(0.3, 0.0),
        "dp_noise": lambda: dp_gaussian(0.3, 1.0, seed=7),  # the same noise draw
        "chain": lambda: chain(clip(0.5), krum(0.2, select=2)),  # scaled Gram matrix
    }


def _both(problem, rule, sample_weight, training=True, loss_scale=None):
    """(unchunked result, aux), (chunked result, aux) from the same variable values."""
    model = problem.model
    engine = PerExampleProblem(model, problem.loss, training=training)
    engine.check_once(problem.x, problem.y)
    values = [v.value for v in model.trainable_variables]
    states = [v.value for v in model.non_trainable_variables]
    whole_rule, chunked_rule = rule(), rule()
    for r in (whole_rule, chunked_rule):
        r.build([(None,) + tuple(v.shape) for v in model.trainable_variables])
    keras.utils.set_random_seed(1)  # torch's unseeded dropout draws from its global RNG
    grads, aux = engine.compute(
        values, states, problem.x, problem.y, sample_weight, loss_scale=loss_scale
    )
    if whole_rule.differentially_private:  # as PerExampleModel does before a DP rule
        grads = zero_non_finite_examples(grads)
    whole = whole_rule(grads)
    keras.utils.set_random_seed(1)
    result, chunked_aux = chunked.aggregate(
        engine, chunked_rule, values, states, problem.x, problem.y, sample_weight, CHUNK,
        loss_scale=loss_scale,
    )
    result = result.finish()[0]  # DP noise: the train step adds it (once over replicas)
    return (whole, aux), (result, chunked_aux)


def _assert_same(whole, chunked_pair, what):
    (result, aux), (chunked_result, chunked_aux) = whole, chunked_pair
    oracle.assert_gradients_close(
        [oracle.to_numpy(r) for r in chunked_result],
        [oracle.to_numpy(r) for r in result],
        rtol=1e-6, atol=1e-6, what=what,
    )
    for key in ("loss", "y_pred", "seeds", "mask"):
        assert (key in aux) == (key in chunked_aux), key
        if key in aux:
            for a, b in zip(keras.tree.flatten(chunked_aux[key]), keras.tree.flatten(aux[key])):
                np.testing.assert_allclose(
                    oracle.to_numpy(a), oracle.to_numpy(b), rtol=1e-6, atol=1e-6,
                    err_msg=f"{what}: aux {key}",
                )


@pytest.fixture(scope="module")
def dropout_problem():
    # Dropout: each example's mask must come from its index in the whole batch.
    return problems.dense_mlp(batch=BATCH, dropout=0.3)


@pytest.mark.parametrize("name", ["mean", "sum", "clip_per_layer", "dp_noise", "chain"])
def test_chunked_aggregate_equals_unchunked(dropout_problem, name):
    problem = dropout_problem
    _assert_same(*_both(problem, _rules()[name], problem.sample_weight), what=name)


@pytest.mark.parametrize("name", ["mean", "clip"])
def test_chunked_sum_reduction_and_loss_scale(name):
    """A sum reduction scales each example by the whole B; a LossScaleOptimizer's
    scale is divided by the whole B and removed again."""
    problem = problems.dense_mlp(batch=BATCH)
    problem.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    _assert_same(*_both(problem, _rules()[name], problem.sample_weight), what=name)
    problem = problems.dense_mlp(batch=BATCH)
    scale = keras.ops.convert_to_tensor(1024.0)
    _assert_same(*_both(problem, _rules()[name], None, loss_scale=scale), what=f"{name} scaled")


@pytest.mark.parametrize("name", ["mean", "clip"])
def test_chunked_masks_normalize_by_the_whole_batch(name):
    problem = problems.masked_dense(batch=BATCH)
    _assert_same(*_both(problem, _rules()[name], problem.sample_weight), what=name)


def test_dp_zeroes_a_nonfinite_example_per_chunk(dropout_problem):
    problem = dropout_problem
    x = np.array(problem.x)
    x[5, 0] = np.inf  # one example in the second chunk
    broken = problems.Problem("inf", problem.model, x, problem.y, problem.loss)
    (whole, _), (result, _) = _both(broken, _rules()["dp_no_noise"], None)
    for a, b in zip(result, whole):
        assert np.all(np.isfinite(oracle.to_numpy(a)))
        np.testing.assert_allclose(oracle.to_numpy(a), oracle.to_numpy(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["mean", "dp_noise", "krum"])
def test_fit_with_microbatches_equals_fit_without(name):
    """13 examples in batches of 5 (5, 5, 3: a smaller last batch, retraced with an
    unknown batch size on TF), chunks of 4, dropout, sample weights, 1 epoch."""
    results = []
    for microbatch_size in (None, CHUNK):
        problem = problems.dense_mlp(batch=13, dropout=0.3)
        wrapper = pergrad.PerExampleModel(
            problem.model, _rules()[name](), microbatch_size=microbatch_size
        )
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.5))
        history = wrapper.fit(
            problem.x, problem.y, sample_weight=problem.sample_weight,
            batch_size=5, epochs=1, shuffle=False, verbose=0,
        )
        results.append((wrapper.model, history.history))
    (whole, whole_history), (chunked_model, chunked_history) = results
    oracle.assert_weights_close(chunked_model, whole, atol=1e-6, rtol=1e-6)
    for key, values in whole_history.items():
        np.testing.assert_allclose(chunked_history[key], values, rtol=1e-6, atol=1e-6, err_msg=key)
    start = problems.dense_mlp(batch=13, dropout=0.3).model.get_weights()
    assert max(float(np.abs(a - b).max()) for a, b in zip(whole.get_weights(), start)) > 1e-3


def test_fit_never_materializes_every_per_example_gradient(monkeypatch):
    """With microbatch_size, mean and statistics rules never ask for the (B, ...) tensors."""

    def refuse(*args, **kwargs):
        raise AssertionError("PerExampleProblem.compute materializes all B per-example gradients")

    monkeypatch.setattr(PerExampleProblem, "compute", refuse)
    problem = problems.dense_mlp(batch=BATCH)
    wrapper = pergrad.PerExampleModel(problem.model, clip(0.3), microbatch_size=CHUNK)
    problem.compile(wrapper)
    wrapper.fit(problem.x, problem.y, batch_size=BATCH, epochs=1, verbose=0)


def test_rules_that_override_aggregate_keep_the_unchunked_path():
    class Custom(pergrad.aggregators.WeightedAggregator):
        def aggregate(self, gradients):
            return [keras.ops.max(g, axis=0) for g in gradients]

    assert chunked.supports(clip(1.0)) and chunked.supports(dp_gaussian(1.0, 1.0))
    assert chunked.supports(chain(clip(1.0), krum(0.2)))
    assert not chunked.supports(Custom())
    assert not chunked.supports(pergrad.aggregators.median())
    assert not chunked.supports(chain(pergrad.aggregators.bucketing(2), krum(0.2)))
