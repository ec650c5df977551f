"""The statistics path (``pergrad.engine.statistics``) against the materialized path.

The materialized path is the reference (itself checked against the batch-of-one
oracle in test_per_example_gradients.py). For every layer rule, on 2-D and
sequence/spatial inputs, the per-example squared norms, the Gram matrix and
weighted sums (flat and per-variable weights) must match it to 1e-5; every
statistics rule must train through ``fit()`` as on the materialized path.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
from keras import layers, ops

import oracle
import pergrad
import problems
from pergrad.aggregators import (
    automatic_clip,
    chain,
    clip,
    geometric_median,
    krum,
    mean,
    norm_filter,
)
from pergrad.aggregators import sum as sum_rule
from pergrad.aggregators.base import ExampleStatistics, WeightedAggregator
from pergrad.engine import PerExampleProblem, statistics
from pergrad.privacy import dp_gaussian

B = problems.BATCH
RTOL, ATOL = 1e-5, 1e-5


NAMES = problems.LAYER_RULE_PROBLEMS


def _problem(name):
    problem = problems.make(name)
    problem.compile()
    return problem


class _FixedWeights(WeightedAggregator):
    """Weights that read the statistics (so the statistics path computes them) but are fixed."""

    def __init__(self, per_variable=False, gram=False, **kwargs):
        super().__init__(**kwargs)
        self.per_variable, self.needs_gram = per_variable, gram

    def example_weights(self, stats):
        count = stats.squared_norms.shape[1]
        shape = (B, count) if self.per_variable else (B,)
        fixed = np.random.default_rng(4).uniform(-1.0, 2.0, shape).astype("float32")
        touch = 0.0 * stats.squared_norms if self.per_variable else 0.0 * stats.flat_squared_norms
        if stats.gram is not None:
            touch = touch + 0.0 * ops.sum(stats.gram)
        return ops.convert_to_tensor(fixed) + touch


def _values(model):
    return [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]


@pytest.mark.parametrize("name", NAMES)
def test_norms_gram_and_weighted_sums_match_the_materialized_path(name, caplog):
    problem = _problem(name)
    model = problem.model
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        stats = pergrad.per_example_statistics(model, problem.x, problem.y, problem.sample_weight, gram=True)
    assert "materialized path" not in caplog.text, caplog.text  # the statistics path ran
    if name != "shared_and_fallback":
        assert "no layer rule" not in caplog.text, caplog.text  # every layer has its rule
    grads = pergrad.per_example_gradients(model, problem.x, problem.y, problem.sample_weight)
    expected = ExampleStatistics.from_gradients(grads, gram=True)
    for actual, reference in ((stats.squared_norms, expected.squared_norms), (stats.gram, expected.gram)):
        reference = oracle.to_numpy(reference)
        # float32 sums round relative to their largest terms: an entry next to much
        # larger ones is compared at the matrix's scale.
        scale = max(1.0, float(np.max(np.abs(reference))))
        np.testing.assert_allclose(oracle.to_numpy(actual), reference, rtol=RTOL, atol=ATOL * scale)

    engine = PerExampleProblem(model, training=True)
    trainable, states = _values(model)
    for rule in (_FixedWeights(), _FixedWeights(per_variable=True), _FixedWeights(gram=True)):
        result, _ = statistics.aggregate(engine, rule, trainable, states, problem.x, problem.y,
                                         problem.sample_weight)
        reference = rule.aggregate([ops.convert_to_tensor(g) for g in grads])
        oracle.assert_gradients_close([oracle.to_numpy(r) for r in result.gradients],
                                      [oracle.to_numpy(r) for r in reference], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("formed", [False, True])
def test_embedding_statistics_from_token_pairs_or_the_formed_tables(formed, monkeypatch):
    # A table smaller than the token pairs' T x T matrices is formed (a position table);
    # the problems' tables are small: both branches, against the materialized path.
    from pergrad.layer_rules.embedding import EmbeddingRule

    monkeypatch.setattr(EmbeddingRule, "materializes", lambda self, layer, inputs, delta: formed)
    problem = _problem("embedding")
    model = problem.model
    stats = pergrad.per_example_statistics(model, problem.x, problem.y, problem.sample_weight, gram=True)
    grads = pergrad.per_example_gradients(model, problem.x, problem.y, problem.sample_weight)
    expected = ExampleStatistics.from_gradients(grads, gram=True)
    for actual, reference in ((stats.squared_norms, expected.squared_norms), (stats.gram, expected.gram)):
        np.testing.assert_allclose(oracle.to_numpy(actual), oracle.to_numpy(reference), rtol=RTOL, atol=ATOL)
    rule = _FixedWeights()
    trainable, states = _values(model)
    result, _ = statistics.aggregate(PerExampleProblem(model, training=True), rule, trainable, states,
                                     problem.x, problem.y, problem.sample_weight)
    reference = rule.aggregate([ops.convert_to_tensor(g) for g in grads])
    oracle.assert_gradients_close([oracle.to_numpy(r) for r in result.gradients],
                                  [oracle.to_numpy(r) for r in reference], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("positions, d_in, d_out, formed", [
    (3, 4, 8, False), (3, 8, 8, False), (3, 8, 3, True), (3, 8, 2, True),  # dense_sequence's layers
    (64, 64, 128, True), (64, 128, 64, True),  # the benchmark transformer's FFN (2T^2 = d_in d_out)
    (128, 64, 8192, False),  # a tiny LM head
    (2048, 4096, 4096, False), (2048, 4096, 11008, False),  # a 7B decoder's projections
    (1, 64, 64, False), (None, 2, 2, True),
])
def test_dense_statistics_form_the_gradients_when_they_hold_no_more_than_the_ghost_formula(
        positions, d_in, d_out, formed):
    from pergrad.layer_rules.dense import outer_materializes

    assert outer_materializes(positions, d_in, d_out) is formed


@pytest.mark.parametrize("sizes, blocks", [
    ((3, 3, 4, 8), True), ((3, 3, 8, 8), False),  # squared norms: n p q < n^2 (p + q) or not
    ((5, 5, 11, 8), True), ((6, 6, 40, 3), True),  # blocks of the wider side, either side
    ((6, 4, 3, 40), False), ((40, 40, 3, 50), True),  # inner products: (n + n') p q against n n' (p + q)
])
def test_outer_inner_products_from_gram_matrices_or_blocks_of_formed_gradients(sizes, blocks):
    from pergrad.layer_rules.base import _formed_is_cheaper, outer_inner_products

    n, m, p, q = sizes
    rng = np.random.default_rng(5)
    a, d = rng.normal(size=(2, n, p)), rng.normal(size=(2, n, q))
    other_a, other_d = rng.normal(size=(2, m, p)), rng.normal(size=(2, m, q))
    g = np.einsum("bnp,bnq->bpq", a, d)
    other = np.einsum("bnp,bnq->bpq", other_a, other_d)
    tensors = [ops.convert_to_tensor(t.astype("float32")) for t in (a, d, other_a, other_d)]
    same = n == m
    if same:
        assert _formed_is_cheaper(*tensors[:2]) is blocks
        np.testing.assert_allclose(oracle.to_numpy(outer_inner_products(*tensors[:2])),
                                   (g * g).sum(axis=(1, 2)), rtol=1e-5)
    else:
        assert _formed_is_cheaper(*tensors) is blocks
    np.testing.assert_allclose(oracle.to_numpy(outer_inner_products(*tensors)),
                               (g * other).sum(axis=(1, 2)), rtol=1e-4, atol=1e-4)


class RegisteredScale(problems.Scale):
    pass


@pergrad.layer_rules.register_rule(RegisteredScale)
class RegisteredScaleRule(pergrad.layer_rules.OutputRule):
    """A user's rule: the probe on the output, per-example gradients by the layer's vjp."""


def test_layers_without_a_rule_are_logged_once_and_a_registered_rule_replaces_the_fallback(caplog):
    problem = _problem("shared_and_fallback")
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        for _ in range(2):
            pergrad.per_example_statistics(problem.model, problem.x, problem.y)
    assert caplog.text.count("no layer rule for") == 1
    assert "'scale" in caplog.text and "'tied_output" in caplog.text
    caplog.clear()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    layer = RegisteredScale()
    hidden = layer(layers.Dense(3)(inputs))
    problem = problems.classifier("registered", inputs, hidden, problems.seeded_floats(B, 3))
    problem.compile()
    assert pergrad.layer_rules.rule_for(layer).__class__ is RegisteredScaleRule
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        stats = pergrad.per_example_statistics(problem.model, problem.x, problem.y, problem.sample_weight)
    assert "no layer rule" not in caplog.text
    grads = pergrad.per_example_gradients(problem.model, problem.x, problem.y, problem.sample_weight)
    np.testing.assert_allclose(oracle.to_numpy(stats.squared_norms),
                               oracle.to_numpy(ExampleStatistics.from_gradients(grads).squared_norms),
                               rtol=RTOL, atol=ATOL)


RULES = {
    "mean": mean,
    "sum": sum_rule,
    "clip": lambda: clip(0.05),
    "clip_per_layer": lambda: clip(0.05, per_layer=True),
    "automatic_clip": automatic_clip,
    "dp_noise_0": lambda: dp_gaussian(0.05, 0.0, expected_batch_size=B),
    "norm_filter": lambda: norm_filter(drop_fraction=0.34),
    "krum": lambda: krum(0.2),
    "multi_krum": lambda: krum(0.2, select=3),
    "geometric_median": geometric_median,
    "chain_clip_krum": lambda: chain(clip(0.05), krum(0.2)),
}


# constant_inputs: `arange` positions, ids made in `build()`, a Dense layer on a weight,
# broadcast over the batch through fit() (the per-example pass, not one batched pass).
@pytest.mark.parametrize("name, rule", [("dense_mlp", rule) for rule in sorted(RULES)]
                         + [("constant_inputs", "clip"), ("constant_inputs", "dp_noise_0")])
def test_every_statistics_rule_trains_as_on_the_materialized_path(name, rule, monkeypatch):
    results = []
    for path in ("materialized", "statistics"):
        problem = problems.make(name)
        wrapper = pergrad.PerExampleModel(problem.model, RULES[rule](), path=path)
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.3))
        if path == "statistics":
            # Never the materialized per-example gradients of the model.
            monkeypatch.setattr(PerExampleProblem, "compute", _refuse)
        wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B,
                    epochs=2, shuffle=False, verbose=0)
        results.append(wrapper.model)
    oracle.assert_weights_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def _refuse(*args, **kwargs):
    raise AssertionError("the statistics path built the materialized per-example gradients")


def test_a_transformer_trains_with_clipping_as_on_the_materialized_path():
    results = []
    for path in ("materialized", "auto"):
        problem = problems.transformer()
        wrapper = pergrad.PerExampleModel(problem.model, clip(0.1), path=path)
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.3))
        wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B,
                    epochs=2, shuffle=False, verbose=0)
        results.append(wrapper.model)
    oracle.assert_weights_close(results[1], results[0], atol=1e-5, rtol=1e-5)


class WithOwnWeight(keras.Model):
    """Reads a variable of its own outside any layer call: not for the statistics path."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(2)
        self.bias2 = self.add_weight(shape=(2,), initializer="zeros", name="bias2")

    def call(self, x):
        return self.dense(x) + self.bias2


def test_the_path_can_be_forced_and_a_model_the_statistics_path_cannot_train_is_refused_or_logged(caplog):
    with pytest.raises(ValueError, match="not a statistics rule"):
        pergrad.PerExampleModel(problems.make("dense_mlp").model, pergrad.aggregators.centered_clip(1.0),
                               path="statistics")
    with pytest.raises(ValueError, match="path must be one of"):
        pergrad.PerExampleModel(problems.make("dense_mlp").model, "mean", path="fast")
    x, y = problems.seeded_floats(B, 3), problems.seeded_floats(B, 2)
    for path in ("statistics", "auto"):
        model = WithOwnWeight()
        model(x)
        wrapper = pergrad.PerExampleModel(model, clip(1.0), path=path)
        wrapper.compile(optimizer="sgd", loss="mse")
        if path == "statistics":
            with pytest.raises(ValueError, match="outside any layer call"):
                wrapper.fit(x, y, batch_size=B, epochs=1, verbose=0)
        else:
            with caplog.at_level(logging.WARNING, logger="pergrad"):
                wrapper.fit(x, y, batch_size=B, epochs=1, verbose=0)
            assert "takes the materialized path" in caplog.text
            assert "bias2" in caplog.text
    restored = pergrad.PerExampleModel.from_config(
        pergrad.PerExampleModel(problems.make("dense_mlp").model, "mean", path="materialized").get_config()
    )
    assert restored.engine_path == "materialized"


@pytest.mark.parametrize("rule", ["clip", "krum"])
def test_mixed_precision_with_loss_scaling_trains_as_on_the_materialized_path(rule):
    """float16 probes and layer inputs; statistics in float32, the loss scale removed from D.
    (conftest restores the float32 policy afterwards.)"""
    keras.config.set_dtype_policy("mixed_float16")
    results = []
    for path in ("materialized", "statistics"):
        problem = problems.make("dense_mlp")
        wrapper = pergrad.PerExampleModel(problem.model, RULES[rule](), path=path)
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.3))
        problem.compile(wrapper, optimizer=optimizer)
        wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B,
                    epochs=2, shuffle=False, verbose=0)
        results.append(wrapper)
    assert results[1].model.layers[-1].compute_dtype == "float16"
    for attribute in ("dynamic_scale", "iterations"):
        values = [ops.convert_to_numpy(getattr(m.optimizer, attribute)) for m in results]
        np.testing.assert_array_equal(*values, err_msg=attribute)
    oracle.assert_weights_close(results[1].model, results[0].model, atol=2e-3, rtol=2e-3)


class BuiltPositions(layers.Layer):
    """Adds a position embedding read with ids made in ``build()`` (as keras-hub's ViT
    does): outside any trace, so on TensorFlow they are an eager tensor."""

    def build(self, shape):
        self.embedding = layers.Embedding(shape[1], shape[2])
        self.embedding.build((1, shape[1]))
        self.ids = ops.expand_dims(ops.arange(shape[1]), 0)

    def call(self, x):
        return x + self.embedding(self.ids)


class LinearScale(layers.Layer):
    """A layer with a weight and no rule: its call is vectorized (the fallback)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale


def test_inputs_made_in_build_on_the_vectorized_forward_pass():
    """The vectorized forward pass captures the ids made in ``build()``: TensorFlow's pfor
    raised "Tensor.op is undefined when eager execution is enabled" for them."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 4))
    hidden = BuiltPositions()(LinearScale()(layers.Dense(4)(inputs)))
    model = keras.Model(inputs, layers.Dense(2)(layers.Flatten()(hidden)))
    model.compile(loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(5, 3, 4)).astype("float32"), rng.normal(size=(5, 2)).astype("float32")
    expected = ExampleStatistics.from_gradients(oracle.batch_of_one_gradients(model, x, y))
    stats = pergrad.per_example_statistics(model, x, y)
    np.testing.assert_allclose(ops.convert_to_numpy(stats.squared_norms),
                               ops.convert_to_numpy(expected.squared_norms), rtol=1e-5, atol=1e-6)


def test_a_tied_table_whose_squared_norm_overflows_has_its_norm():
    """One example's embedding and LM-head pieces of a tied table are ~1e19 (finite, their
    squares not): the norm of their sum from the rescaled factors, as from the formed
    gradients in float64."""
    keras.utils.set_random_seed(0)
    ids, scale = keras.Input((5,), dtype="int32"), keras.Input((1, 1))
    table = layers.ReversibleEmbedding(11, 8)
    logits = table(layers.Multiply()([table(ids), scale]), reverse=True)
    model = keras.Model([ids, scale], logits)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = [problems.seeded_ids(11, B, 5), np.ones((B, 1, 1), "float32")]
    x[1][2] = 1e21
    y = problems.seeded_ids(11, B, 5)[::-1].copy()
    with pytest.MonkeyPatch.context() as patch:  # the norms come from the factors, not the table
        patch.setattr(pergrad.layer_rules.embedding.ReversibleEmbeddingRule, "per_example", _refuse)
        stats = pergrad.per_example_statistics(model, x, y)
    rows = np.concatenate([oracle.to_numpy(g).reshape(B, -1).astype("float64")
                           for g in pergrad.per_example_gradients(model, x, y)], axis=1)
    assert np.all(np.isfinite(rows)) and (rows[2] ** 2).sum() > np.finfo(np.float32).max
    np.testing.assert_allclose(oracle.to_numpy(stats.flat_norms), np.sqrt((rows ** 2).sum(axis=1)), rtol=1e-5)


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
@pytest.mark.parametrize("options, shape", [
    ({}, (3, 4, 6)), ({"epsilon": 0.5}, (3, 6)), ({"axis": [1, 2]}, (3, 4, 6)),
    ({"rms_scaling": True}, (3, 4, 6)), ({"center": False}, (3, 6)), ({"scale": False}, (3, 4, 6)),
])
def test_layer_normalization_rule_normalizes_as_the_layer_call_does(options, shape):
    """``n(x)``, without the layer call, is the layer's output at gamma one and beta zero."""
    from pergrad.layer_rules.normalization import LayerNormalizationRule, NormalizationRule

    layer = layers.LayerNormalization(**options)
    layer.build(shape)
    rng = np.random.default_rng(1)
    x = ops.convert_to_tensor((3.0 * rng.standard_normal(shape) + 1.0).astype(np.float32))
    scale, offset = getattr(layer, "gamma", None), getattr(layer, "beta", None)
    for v in (scale, offset):  # (values that would show if they were not replaced)
        if v is not None:
            v.assign(rng.standard_normal(v.shape).astype(np.float32))
    mine = LayerNormalizationRule().normalized(layer, x, scale, offset)
    layer_call = NormalizationRule().normalized(layer, x, scale, offset)
    np.testing.assert_allclose(ops.convert_to_numpy(mine), ops.convert_to_numpy(layer_call),
                               rtol=1e-6, atol=1e-6)
