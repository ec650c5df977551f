"""Aggregators with state: centered clipping's center and bucketing's random stream.

Their state is Keras state: carried by every backend's train step, saved by
``model.save()``, restored by ``keras.models.load_model()``, so that training
resumed from a file continues exactly as uninterrupted training would.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import aggregators as agg


def numpy(values):
    return [np.asarray(ops.convert_to_numpy(v), dtype="float64") for v in values]


def ref_centered_clip(points, center, tau, iters):
    for _ in range(iters):
        steps = []
        for p in points:
            norm = np.linalg.norm(p - center)
            steps.append((p - center) * min(1.0, tau / norm))
        center = center + np.mean(steps, axis=0)
    return center


def test_centered_clip_carries_its_center_across_calls():
    rng = np.random.default_rng(0)
    aggregator = agg.centered_clip(tau=0.5, iters=2)
    center = np.zeros(7)
    for step in range(3):
        gradients = [rng.normal(size=(6, 2, 2)) + step, rng.normal(size=(6, 3)) - step]
        result, reports = aggregator.aggregation(
            [ops.convert_to_tensor(g.astype("float32")) for g in gradients]).finish()
        result = numpy(result)
        points = np.concatenate([g.reshape(6, -1) for g in gradients], axis=1)
        center = ref_centered_clip(points, center, 0.5, 2)
        np.testing.assert_allclose(np.concatenate([r.ravel() for r in result]), center, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.concatenate([np.ravel(v) for v in numpy(aggregator.center)]), center, rtol=1e-5, atol=1e-6
        )
    assert float(ops.convert_to_numpy(reports["clipped_fraction"])) > 0


def test_bucketing_is_reproducible_under_set_random_seed():
    gradients = [ops.convert_to_tensor(np.arange(24, dtype="float32").reshape(8, 3) ** 1.5)]

    def three_calls():
        keras.utils.set_random_seed(7)
        aggregator = agg.bucketing(2, agg.median())
        return [numpy(aggregator(gradients))[0] for _ in range(3)]

    first, second = three_calls(), three_calls()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    # The stream advances: the three calls do not all draw the same buckets.
    assert not (np.array_equal(first[0], first[1]) and np.array_equal(first[1], first[2]))
    keras.utils.set_random_seed(8)
    other = agg.bucketing(2, agg.median())
    assert not all(np.array_equal(a, numpy(other(gradients))[0]) for a in first)


# -- through PerExampleModel.fit, save and load ------------------------------------------

RULES = {
    "centered_clip": lambda: agg.centered_clip(tau=0.05, iters=2),
    "bucketing_centered_clip": lambda: agg.chain(
        agg.clip(1.0), agg.bucketing(2), agg.centered_clip(tau=0.05)
    ),
}


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(24, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 * rng.normal(size=(24, 1))).astype("float32")
    return x, y


def _model(rule):
    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
    )
    model = pergrad.PerExampleModel(inner, RULES[rule]())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _fit(model, epochs):
    x, y = _data()
    return model.fit(x, y, batch_size=6, epochs=epochs, shuffle=False, verbose=0)


def _state(model):
    return numpy(model.model.trainable_variables), numpy(model.aggregator.variables)


@pytest.mark.parametrize("rule", list(RULES))
def test_training_resumed_from_a_file_continues_exactly(rule, tmp_path):
    uninterrupted = _model(rule)
    history = _fit(uninterrupted, 2)

    interrupted = _model(rule)
    _fit(interrupted, 1)
    path = str(tmp_path / "model.keras")
    interrupted.save(path)
    state_saved = _state(interrupted)
    restored = keras.models.load_model(path, safe_mode=True)
    assert type(restored.aggregator) is type(interrupted.aggregator)
    for a, b in zip(_state(restored), state_saved):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)  # the aggregator's state came back
    _fit(restored, 1)

    weights, aggregator_state = _state(restored)
    expected_weights, expected_state = _state(uninterrupted)
    for a, b in zip(weights + aggregator_state, expected_weights + expected_state):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    for name in uninterrupted.aggregator.diagnostics:  # logged by fit
        assert 0.0 <= history.history[name][-1] <= 1.0
    if rule != "centered_clip":
        return
    # The state matters: resuming with a fresh center trains differently.
    forgetful = keras.models.load_model(path, safe_mode=True)
    for variable in forgetful.aggregator.center:
        variable.assign(ops.zeros(variable.shape, variable.dtype))
    _fit(forgetful, 1)
    assert not all(
        np.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(_state(forgetful)[0], expected_weights)
    )


def test_aggregator_state_is_model_state():
    model = _model("bucketing_centered_clip")
    assert model.aggregator.diagnostics == ("step0_clipped_fraction", "step2_clipped_fraction")
    paths = [v.path for v in model.non_trainable_variables]
    assert sum("center" in p for p in paths) == 4  # one per trainable variable
    assert any("seed_generator_state" in p for p in paths)
    assert not any("center" in v.path for v in model.trainable_variables)
