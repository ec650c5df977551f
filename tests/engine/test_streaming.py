"""The streaming path (``pergrad.engine.streaming``) against the materialized path.

Coordinate rules (median, trimmed mean, MeaMed, sign majority, ``per_variable``
functions), after clipping, norm filtering or bucketing, computed one variable
at a time from each layer's input and output gradient, must equal the same rule
applied to the materialized per-example gradients (itself checked against the
batch-of-one oracle in test_per_example_gradients.py): on every layer rule and
the fallback, through ``fit()`` with sample weights, masks and mixed precision.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems
from pergrad.aggregators import (
    bucketing,
    centered_clip,
    chain,
    clip,
    meamed,
    median,
    norm_filter,
    per_variable,
    sign_majority,
    trimmed_mean,
)
from pergrad.aggregators.base import RowMap
from pergrad.engine import PerExampleProblem, streaming
from pergrad.layer_rules.dense import DenseRule

B = problems.BATCH
RTOL, ATOL = 1e-5, 1e-5


def _second_largest(gradient):
    """A user's per-variable rule: the second largest value of each coordinate."""
    return ops.sort(gradient, axis=0)[-2]


RULES = {
    "median": median,
    "trimmed_mean": lambda: trimmed_mean(0.2),
    "meamed": lambda: meamed(0.2),
    "sign_majority": sign_majority,
    "per_variable": lambda: per_variable(_second_largest),
    "clip_median": lambda: chain(clip(0.05), median()),
    "clip_per_layer_median": lambda: chain(clip(0.05, per_layer=True), median()),
    "bucketing_median": lambda: bucketing(4, median(), seed=3),  # buckets of 4 and 2
    "clip_bucketing_trimmed": lambda: chain(
        clip(0.05, per_layer=True), bucketing(2, seed=4), trimmed_mean(0.2)
    ),
    "filter_bucketing_median": lambda: chain(norm_filter(drop_fraction=0.2), bucketing(2, seed=5), median()),
}


def _refuse(*args, **kwargs):
    raise AssertionError("the streaming path built the model's materialized per-example gradients")


def _fit(problem, rule, path, monkeypatch, epochs=2, **compile_kwargs):
    wrapper = pergrad.PerExampleModel(problem.model, rule, path=path)
    problem.compile(wrapper, optimizer=compile_kwargs.pop("optimizer", keras.optimizers.SGD(0.3)))
    with monkeypatch.context() as patch:
        if path != "materialized":
            patch.setattr(PerExampleProblem, "compute", _refuse)
        history = wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B,
                              epochs=epochs, shuffle=False, verbose=0)
    return wrapper, history


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_coordinate_rule_trains_as_on_the_materialized_path(rule, monkeypatch):
    results = []
    for path in ("materialized", "auto"):
        wrapper, history = _fit(problems.make("dense_mlp"), RULES[rule](), path, monkeypatch)
        results.append((wrapper, history))
    (reference, reference_history), (streamed, history) = results
    oracle.assert_weights_close(streamed.model, reference.model, atol=1e-5, rtol=1e-5)
    assert set(history.history) == set(reference_history.history)  # the same diagnostics
    for name, values in reference_history.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    initial = problems.make("dense_mlp").model
    moved = max(np.max(np.abs(a - b)) for a, b in zip(initial.get_weights(), streamed.model.get_weights()))
    assert moved > 1e-3  # the rule trained the model


@pytest.mark.parametrize("name", problems.LAYER_RULE_PROBLEMS)
def test_every_layer_rule_streams_the_materialized_result(name):
    """Each layer rule's ``mapped`` (Dense, Embedding: the map applied to A and D) or the
    default (per-example gradients, then the map), and the fallback, on 14 models."""
    problem = problems.make(name)
    problem.compile()
    model = problem.model
    engine = PerExampleProblem(model, training=True)
    trainable = [v.value for v in model.trainable_variables]
    states = [v.value for v in model.non_trainable_variables]
    grads = [ops.convert_to_tensor(g) for g in pergrad.per_example_gradients(
        model, problem.x, problem.y, problem.sample_weight)]
    rules = (median, lambda: chain(clip(0.05, per_layer=True), bucketing(2, seed=1), median()))
    for make in rules:
        result, aux = streaming.aggregate(engine, make(), trainable, states, problem.x, problem.y,
                                          problem.sample_weight)
        expected = make()(grads)
        oracle.assert_gradients_close([oracle.to_numpy(r) for r in result.gradients],
                                      [oracle.to_numpy(e) for e in expected], rtol=RTOL, atol=ATOL)
        assert bool(oracle.to_numpy(aux["finite"]))


def test_masked_outputs_and_a_custom_layer_stream_through_fit(monkeypatch):
    for name in ("masked_dense", "shared_and_fallback"):
        results = []
        for path in ("materialized", "statistics"):
            problem = problems.make(name)
            wrapper, _ = _fit(problem, chain(clip(0.5), bucketing(2, seed=2), median()), path, monkeypatch)
            results.append(wrapper.model)
        oracle.assert_weights_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_mixed_precision_with_loss_scaling_streams_as_on_the_materialized_path(monkeypatch):
    """float16 layer inputs and output gradients, the loss scale removed from D; a
    non-finite step skipped on both paths. (conftest restores the float32 policy.)"""
    keras.config.set_dtype_policy("mixed_float16")
    results = []
    for path in ("materialized", "statistics"):
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.3))
        wrapper, _ = _fit(problems.make("dense_mlp"), chain(clip(0.05), median()), path, monkeypatch,
                          optimizer=optimizer)
        results.append(wrapper)
    assert results[1].model.layers[-1].compute_dtype == "float16"
    for attribute in ("dynamic_scale", "iterations"):
        values = [ops.convert_to_numpy(getattr(m.optimizer, attribute)) for m in results]
        np.testing.assert_array_equal(*values, err_msg=attribute)
    oracle.assert_weights_close(results[1].model, results[0].model, atol=2e-3, rtol=2e-3)


def test_a_non_finite_example_makes_the_update_nan_even_when_the_rule_drops_it(monkeypatch):
    """As on the materialized path: the median or a filter would hide it; the step does not."""
    for rule in (median(), chain(norm_filter(drop_fraction=0.2), median())):
        problem = problems.make("dense_mlp")
        x = np.array(problem.x)
        x[2, 0] = np.inf
        wrapper = pergrad.PerExampleModel(problem.model, rule, path="statistics")
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.3))
        monkeypatch.setattr(PerExampleProblem, "compute", _refuse)
        wrapper.train_on_batch(x, problem.y)
        assert all(np.isnan(w).all() for w in wrapper.model.get_weights()), rule.name


def test_rules_the_streaming_path_does_not_cover_take_the_materialized_path():
    assert streaming.supports(chain(clip(1.0), bucketing(2), median()))
    assert not streaming.supports(centered_clip(1.0))
    assert not streaming.supports(chain(bucketing(2), clip(1.0), median()))  # norms of bucket means
    assert not streaming.supports(pergrad.aggregators.get(lambda grads: grads))
    assert not streaming.supports(chain(clip(1.0), centered_clip(1.0)))
    with pytest.raises(ValueError, match="not a statistics rule"):
        pergrad.PerExampleModel(problems.make("dense_mlp").model, centered_clip(1.0), path="statistics")


def test_row_maps_compose_like_the_steps_applied_in_turn():
    """``RowMap.then`` against applying each map to the rows (NumPy: rows are examples)."""
    rng = np.random.default_rng(0)
    g = [rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(6, 2, 2)).astype("float32")]
    scale = RowMap.scaling(ops.convert_to_tensor(rng.uniform(0.1, 2.0, (6, 2)).astype("float32")))
    pick = RowMap(ops.convert_to_tensor(np.array([[4], [0], [5], [2]], "int32")))
    buckets = RowMap(ops.convert_to_tensor(np.array([[1, 3], [2, 0]], "int32")),
                     ops.convert_to_tensor(np.array([[[0.5], [0.5]], [[1.0], [0.0]]], "float32")))
    maps = [scale, pick, buckets, RowMap.scaling(ops.convert_to_tensor(np.array([2.0, -1.0], "float32")))]
    for count in range(2, len(maps) + 1):
        composed = maps[0]
        for m in maps[1:count]:
            composed = composed.then(m)
        for k, rows in enumerate(g):
            stepwise = ops.convert_to_tensor(rows)
            for m in maps[:count]:
                stepwise = m.apply(stepwise, k)
            np.testing.assert_allclose(oracle.to_numpy(composed.apply(ops.convert_to_tensor(rows), k)),
                                       oracle.to_numpy(stepwise), rtol=1e-6, atol=1e-6)


def _normalized_first(gradient):
    """A per-variable rule that mixes a variable's coordinates: it must not be split."""
    return gradient[0] / (ops.sum(ops.abs(gradient)) + 1.0)


def _recording_widths():
    """``(widths, mapped)``: ``DenseRule.mapped`` that appends ``(input features given,
    kernel rows)`` of each call to ``widths``."""
    widths = []
    original = DenseRule.mapped

    def recording(self, layer, values, inputs, *args):
        widths.append((inputs.shape[-1], layer.kernel.shape[0]))
        return original(self, layer, values, inputs, *args)

    return widths, recording


@pytest.mark.parametrize("rule", ["signs", "per_variable"])
def test_microbatches_bound_the_blocks_a_dense_kernel_is_aggregated_in(rule, monkeypatch):
    """With ``microbatch_size`` a coordinate-wise rule gets each Dense kernel in blocks of
    input features (never a function that may mix coordinates); the result is unchanged.
    (Torch's median, trimmed mean and MeaMed get factors: test_streaming_outer.py.)"""
    make = {"signs": lambda: chain(clip(0.05), sign_majority()),
            "per_variable": lambda: per_variable(_normalized_first)}[rule]
    widths, recording = _recording_widths()
    results = []
    for path, microbatch in (("materialized", None), ("auto", 2)):
        problem = problems.make("dense_mlp")
        wrapper = pergrad.PerExampleModel(problem.model, make(), path=path, microbatch_size=microbatch)
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.3))
        with monkeypatch.context() as patch:
            if path == "auto":
                patch.setattr(PerExampleProblem, "compute", _refuse)
                patch.setattr(DenseRule, "mapped", recording)
            wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B,
                        epochs=2, shuffle=False, verbose=0)
        results.append(wrapper.model)
    oracle.assert_weights_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    split = any(width < full for width, full in widths)
    assert split == (rule == "signs"), widths


@pytest.mark.parametrize("rule", ["signs", "bucketmedian", "per_variable"])
def test_eager_backends_form_large_kernels_in_parts_without_microbatches(rule, monkeypatch):
    """Without ``microbatch_size``, an eager backend (torch) forms a coordinate-wise rule's
    Dense kernels in parts of at most ``EAGER_PIECE_BYTES`` (here forced small); compiled
    backends, and a function that may mix coordinates, get them whole. The result is the
    materialized path's. (The median, trimmed mean and MeaMed of a 2-D input's kernel are
    not formed on torch: test_streaming_outer.py.)"""
    make = {"signs": sign_majority, "bucketmedian": lambda: bucketing(2, median(), seed=3),
            "per_variable": lambda: per_variable(_normalized_first)}[rule]
    widths, recording = _recording_widths()
    results = []
    for path in ("materialized", "auto"):
        problem = problems.make("dense_mlp")
        wrapper = pergrad.PerExampleModel(problem.model, make(), path=path)
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.3))
        with monkeypatch.context() as patch:
            if path == "auto":
                patch.setattr(PerExampleProblem, "compute", _refuse)
                patch.setattr(DenseRule, "mapped", recording)
                patch.setattr(streaming, "EAGER_PIECE_BYTES", 64)
            wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B,
                        epochs=2, shuffle=False, verbose=0)
        results.append(wrapper.model)
    oracle.assert_weights_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    split = any(width < full for width, full in widths)
    assert split == (rule != "per_variable" and keras.backend.backend() == "torch"), widths


def test_the_dense_rule_finds_non_finite_per_example_gradients_from_a_and_d():
    """``a_i ⊗ d_i`` has a non-finite entry iff an entry of a_i or d_i is, or the largest
    product overflows; checked against the formed outer products."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    rule = DenseRule()
    cases = {
        "finite": ([[1.0, -2.0, 3.0]], [[4.0, 5.0]]),
        "near overflow": ([[1e19, 1.0, 0.0]], [[-3e19, 1.0]]),
        "overflow": ([[1e20, 1.0, 0.0]], [[-1e20, 1.0]]),
        "inf times zero": ([[np.inf, 1.0, 0.0]], [[0.0, 0.0]]),
        "nan in d": ([[1.0, 1.0, 1.0]], [[np.nan, 0.0]]),
    }
    for name, (a, d) in cases.items():
        a, d = np.array(a * 2, "float32"), np.array(d * 2, "float32")
        expected = all(np.isfinite(g).all() for g in rule.per_example(
            layer, None, ops.convert_to_tensor(a), ops.convert_to_tensor(d)))
        actual = rule.all_finite(layer, ops.convert_to_tensor(a), ops.convert_to_tensor(d))
        assert bool(oracle.to_numpy(actual)) == expected, name
    assert [bool(oracle.to_numpy(rule.all_finite(layer, ops.convert_to_tensor(np.array(a * 2, "float32")),
                                                  ops.convert_to_tensor(np.array(d * 2, "float32")))))
            for a, d in cases.values()] == [True, True, False, False, False]
