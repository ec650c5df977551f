"""A rule's class is its kind: ``chain()`` and the function wrappers return the class
whose protocol they follow, a variant built directly with the wrong steps is refused,
and configs saved before the kinds had classes of their own still load."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pergrad import aggregators as agg
from pergrad.aggregators.base import ARBITRARY, COORDINATE, LOCAL_MEAN, STATISTICS, WeightedAggregator

PROTOCOL = {STATISTICS: agg.WeightedAggregator, COORDINATE: agg.CoordinateAggregator}

CHAINS = {
    "clip_mean": (lambda: agg.chain(agg.clip(1.0), agg.mean()), agg.WeightedChain),
    "clip_automatic_krum": (lambda: agg.chain(agg.clip(1.0), agg.automatic_clip(), agg.krum(0.2)),
                            agg.WeightedChain),
    "clip_median": (lambda: agg.chain(agg.clip(1.0), agg.median()), agg.CoordinateChain),
    "filter_bucketing_trimmed": (
        lambda: agg.chain(agg.norm_filter(drop_fraction=0.2), agg.bucketing(2), agg.trimmed_mean(0.1)),
        agg.CoordinateChain,
    ),
    "clip_per_variable_function": (
        lambda: agg.chain(agg.clip(1.0), agg.per_variable(lambda g: keras.ops.max(g, axis=0))),
        agg.CoordinateChain,
    ),
    # Per-layer scales do not give the Gram matrix the final rule reads.
    "clip_per_layer_krum": (lambda: agg.chain(agg.clip(1.0, per_layer=True), agg.krum(0.2)), agg.Chain),
    "filter_mean": (lambda: agg.chain(agg.norm_filter(drop_fraction=0.2), agg.mean()), agg.Chain),
    "bucketing_krum": (lambda: agg.chain(agg.bucketing(2), agg.krum(0.2)), agg.Chain),
    "clip_centered_clip": (lambda: agg.chain(agg.clip(1.0), agg.centered_clip(1.0)), agg.Chain),
    "clip_function": (lambda: agg.chain(agg.clip(1.0), lambda grads: [g[0] for g in grads]), agg.Chain),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chain_returns_the_class_its_kind_implies(name):
    make, expected = CHAINS[name]
    rule = make()
    assert type(rule) is expected
    for kind, protocol in PROTOCOL.items():
        assert isinstance(rule, protocol) == (rule.kind == kind), (kind, type(rule).__mro__)
    if expected is agg.Chain:
        assert rule.kind == ARBITRARY


def test_the_example_of_the_issue():
    assert isinstance(agg.chain(agg.clip(1), agg.median()), agg.CoordinateAggregator)
    assert not isinstance(agg.chain(agg.clip(1), agg.median()), agg.WeightedAggregator)


def test_a_coordinate_chain_has_no_aggregate_variable_of_its_own():
    rule = agg.chain(agg.clip(1.0), agg.median())
    assert not rule.in_protocol_form("aggregate")  # the steps run first
    with pytest.raises(TypeError, match="steps_and_rule"):
        rule.aggregate_variable(keras.ops.ones((4, 2)))


def _gradients(seed=0, batch=8):
    rng = np.random.default_rng(seed)
    return [keras.ops.convert_to_tensor(rng.normal(size=(batch,) + s).astype("float32") * 3.0)
            for s in [(3,), (2, 2)]]


def _numpy(values):
    return [keras.ops.convert_to_numpy(v) for v in values]


def test_each_chain_gives_the_result_of_its_steps_run_one_by_one():
    """The variants compute what the arbitrary chain computes (steps, then the rule):
    the statistics protocol from weights, the coordinate chain against NumPy."""
    gradients = _gradients()
    arrays = _numpy(gradients)
    flat = np.sqrt(sum(np.sum(a.reshape(8, -1) ** 2, axis=1) for a in arrays))
    clipped = [a * np.minimum(1.0, 1.0 / flat).reshape((-1,) + (1,) * (a.ndim - 1)) for a in arrays]

    weighted = agg.chain(agg.clip(1.0), agg.mean())
    arbitrary = agg.Chain([agg.clip(1.0), agg.mean()])  # built directly: kind arbitrary
    assert weighted.in_protocol_form("aggregate") and not arbitrary.in_protocol_form("aggregate")
    for got, other, want in zip(_numpy(weighted(gradients)), _numpy(arbitrary(gradients)), clipped):
        np.testing.assert_allclose(got, want.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other, want.mean(axis=0), rtol=1e-5, atol=1e-6)

    coordinate = agg.chain(agg.clip(1.0), agg.median())
    for got, want in zip(_numpy(coordinate(gradients)), clipped):
        np.testing.assert_allclose(got, np.median(want, axis=0), rtol=1e-5, atol=1e-6)


def test_a_variant_built_with_steps_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="CoordinateChain"):
        agg.WeightedChain([agg.clip(1.0), agg.median()])
    with pytest.raises(ValueError, match="WeightedChain"):
        agg.CoordinateChain([agg.clip(1.0), agg.mean()])


def _round_trip(rule, rename=None):
    config = keras.saving.serialize_keras_object(rule)
    if rename is not None:  # as saved before the kind had a class of its own
        config = {**config, "class_name": rename, "registered_name": f"pergrad>{rename}"}
    return keras.saving.deserialize_keras_object(config)


@pytest.mark.parametrize("name", ["clip_mean", "clip_median", "filter_mean", "clip_automatic_krum"])
def test_a_chain_saved_under_the_old_name_loads_as_its_kind(name):
    make, expected = CHAINS[name]
    rule = make()
    for loaded in (_round_trip(rule), _round_trip(rule, rename="Chain")):
        assert type(loaded) is expected
        assert [type(s) for s in loaded.steps] == [type(s) for s in rule.steps]
        assert loaded.get_config()["steps"] == rule.get_config()["steps"]


@keras.saving.register_keras_serializable(package="pergrad_test_protocols")
def first_example(gradient):
    return gradient[0]


@keras.saving.register_keras_serializable(package="pergrad_test_protocols")
def first_examples(gradients):
    return [g[0] for g in gradients]


def test_a_function_rule_is_a_class_per_kind_and_old_configs_load():
    whole = agg.get(first_examples)
    each = agg.per_variable(first_example)
    assert type(whole) is agg.FunctionAggregator and whole.kind == ARBITRARY
    assert type(each) is agg.PerVariableFunction and each.kind == COORDINATE
    assert isinstance(each, agg.CoordinateAggregator) and isinstance(each, agg.FunctionAggregator)
    assert not isinstance(whole, agg.CoordinateAggregator)
    assert each.in_protocol_form("aggregate") and not whole.in_protocol_form("aggregate")
    for rule in (whole, each):
        assert type(_round_trip(rule)) is type(rule)
    # Saved before PerVariableFunction: a FunctionAggregator config with per_variable.
    for rule, per_variable in ((whole, False), (each, True)):
        config = keras.saving.serialize_keras_object(rule)
        config = {**config, "class_name": "FunctionAggregator",
                  "registered_name": "pergrad>FunctionAggregator",
                  "config": {**config["config"], "per_variable": per_variable}}
        loaded = keras.saving.deserialize_keras_object(config)
        assert type(loaded) is type(rule) and loaded.function is rule.function
    gradients = _gradients()
    for got, want in zip(_numpy(each(gradients)), _numpy(gradients)):
        np.testing.assert_array_equal(got, want[0])
    with pytest.raises(ValueError, match="per_variable"):
        agg.FunctionAggregator(first_example, per_variable=True)


def test_uniform_weights_cannot_read_the_gram_matrix():
    with pytest.raises(TypeError, match="needs_gram"):

        class Contradiction(WeightedAggregator):  # noqa: F841 - raises at definition
            reads_statistics = False
            needs_gram = True
            distribution = LOCAL_MEAN
