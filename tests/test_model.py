"""``PerExampleModel``: with ``"mean"`` it trains exactly like plain ``model.fit()``.

Run once per backend: ``KERAS_BACKEND=torch pytest tests/test_model.py``.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems

BACKEND = keras.backend.backend()


def _sgd():
    return keras.optimizers.SGD(0.1)


def _adam():
    return keras.optimizers.Adam(0.01)


def _assert_histories_close(plain, wrapped, rtol=1e-5, atol=1e-6):
    assert set(wrapped.history) == set(plain.history), (wrapped.history.keys(), plain.history.keys())
    for key, values in plain.history.items():
        np.testing.assert_allclose(wrapped.history[key], values, rtol=rtol, atol=atol, err_msg=key)


# --- mean == plain fit ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, optimizer, weighted",
    [
        ("dense_mlp", _sgd, False),
        ("dense_mlp", _adam, True),
        ("multi_output", _sgd, True),  # loss weights, per-output losses in History
        ("sequence_output", _adam, True),  # temporal sample weights
        # Keras normalizes by each batch's count of valid steps. SGD: on TF, plain fit with
        # Adam is no reference for embeddings (see test_tf_adam_embedding_reference).
        ("masked", _sgd, True),
    ],
)
def test_mean_trains_like_plain_fit(name, optimizer, weighted):
    """6 examples, batches of 4 (the last batch is smaller), 2 epochs, no shuffling."""
    fit_kwargs = {}
    if weighted:
        fit_kwargs["sample_weight"] = problems.make(name).sample_weight
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.PROBLEMS[name], optimizer=optimizer, fit_kwargs=fit_kwargs
    )
    oracle.assert_weights_close(wrapper.model, plain)
    _assert_histories_close(plain_history, history)
    start = problems.make(name).model.get_weights()
    moved = max(float(np.abs(a - b).max()) for a, b in zip(plain.get_weights(), start))
    assert moved > 1e-3, "training did not move the weights: the comparison is vacuous"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="documents a TensorFlow-only Keras behaviour")
def test_tf_adam_embedding_reference():
    """Why plain TF fit with Adam is no reference for models with embeddings: Keras's TF
    optimizers get an Embedding's gradient as tf.IndexedSlices, and Adam squares the slices
    before summing repeated rows (its velocity gets sum g^2, not (sum g)^2). pergrad hands
    the optimizer a dense gradient, which gives the exact update, so the two differ."""
    import tensorflow as tf

    variable = keras.Variable(np.zeros((3, 1), "float32"))
    optimizer = keras.optimizers.Adam(0.1, beta_2=0.5)
    optimizer.build([variable])
    repeated_row = tf.IndexedSlices(tf.constant([[1.0], [1.0]]), tf.constant([0, 0]), tf.constant([3, 1]))
    optimizer.apply([repeated_row], [variable])
    # The dense gradient of row 0 is 2, so v should be (1 - beta_2) * 2**2 = 2.
    (velocity,) = [v for v in optimizer.variables if v.path.endswith("velocity")]
    np.testing.assert_allclose(ops.convert_to_numpy(velocity).ravel(), [1.0, 0.0, 0.0])


def test_metrics_match_plain_fit():
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.dense_mlp, optimizer=_sgd, fit_kwargs={"epochs": 3}
    )
    assert "accuracy" in history.history
    _assert_histories_close(plain_history, history)


@pytest.mark.parametrize("optimizer", [_sgd, _adam], ids=["sgd", "adam"])
def test_l2_regularizer_is_added_after_aggregation(optimizer):
    """Weight regularizers belong to no example: their gradient is added once; with the
    mean this is exactly Keras (the History loss includes the penalty too)."""
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.dense_mlp, optimizer=optimizer, l2=0.05
    )
    assert len(plain.losses) == 2
    oracle.assert_weights_close(wrapper.model, plain)
    _assert_histories_close(plain_history, history)


def test_l2_regularizer_changes_training():
    """The comparison above can fail: with and without the penalty, training ends elsewhere."""
    ends = []
    for l2 in (0.05, None):
        problem = problems.dense_mlp(l2=l2)
        problem.compile(optimizer=_sgd()).fit(
            problem.x, problem.y, epochs=2, batch_size=4, shuffle=False, verbose=0
        )
        ends.append(problem.model.get_weights())
    assert max(float(np.abs(a - b).max()) for a, b in zip(*ends)) > 1e-4


def _expected_loss(wrapper, problem):
    """Keras's compute_loss of the batch with the weights before the step (as fit logs it)."""
    y_pred = wrapper.model(problem.x, training=True)
    return float(ops.convert_to_numpy(wrapper.compute_loss(
        x=problem.x, y=problem.y, y_pred=y_pred, sample_weight=problem.sample_weight)))


@pytest.mark.parametrize("rule", ["mean", "clip", "median"])
@pytest.mark.parametrize("name, l2", [("dense_mlp", None), ("dense_mlp", 0.05), ("multi_output", None),
                                      ("masked", None)])
def test_logged_loss_is_keras_compute_loss_of_the_batch(rule, name, l2):
    """The logged loss is compute_loss on the batch before the update, whether the step
    reuses its pass's batch loss (one output, no regularizer) or computes it again."""
    problem = problems.dense_mlp(l2=l2) if l2 else problems.make(name)
    aggregator = {"mean": pergrad.aggregators.mean(), "clip": pergrad.aggregators.clip(0.01),
                  "median": pergrad.aggregators.median()}[rule]
    wrapper = pergrad.PerExampleModel(problem.model, aggregator)
    problem.compile(wrapper, optimizer=_sgd())
    wrapper.train_on_batch(problem.x, problem.y, sample_weight=problem.sample_weight)  # builds
    for _ in range(2):
        expected = _expected_loss(wrapper, problem)
        logs = wrapper.train_on_batch(problem.x, problem.y, sample_weight=problem.sample_weight,
                                      return_dict=True)
        np.testing.assert_allclose(logs["loss"], expected, rtol=1e-6)
    assert abs(_expected_loss(wrapper, problem) - expected) > 1e-6, "the step did not move the loss"


def test_the_step_reuses_its_batch_loss_only_where_it_is_keras_compute_loss(monkeypatch):
    """One output, no regularizer, Keras's compute_loss: the whole-batch pass's loss is
    logged (compute_loss is not called again); a subclass's own compute_loss is called."""
    calls = []
    original = keras.Model.compute_loss

    def counted(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    class Shifted(pergrad.PerExampleModel):
        def compute_loss(self, *args, **kwargs):
            return counted(self, *args, **kwargs) + 1.0

    monkeypatch.setattr(keras.Model, "compute_loss", counted)
    for cls in (pergrad.PerExampleModel, Shifted):
        problem = problems.dense_mlp()
        wrapper = cls(problem.model, pergrad.aggregators.clip(0.01))
        problem.compile(wrapper, optimizer=_sgd())
        weights = problem.sample_weight
        wrapper.train_on_batch(problem.x, problem.y, sample_weight=weights)  # builds, traces
        expected = _expected_loss(wrapper, problem)
        calls.clear()
        logs = wrapper.train_on_batch(problem.x, problem.y, sample_weight=weights, return_dict=True)
        np.testing.assert_allclose(logs["loss"], expected, rtol=1e-6)  # (Shifted's: 1 more)
        if BACKEND == "torch":  # (a traced TF or JAX step calls nothing again)
            assert calls == ([] if cls is pergrad.PerExampleModel else ["Shifted"])


def test_microbatched_model_trains_like_plain_fit():
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.dense_mlp, optimizer=_adam, wrapper_kwargs={"microbatch_size": 3}
    )
    oracle.assert_weights_close(wrapper.model, plain)
    _assert_histories_close(plain_history, history)


def test_validation_data_and_evaluate_predict_match_the_inner_model():
    validation = problems.dense_mlp(seed=1)
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.dense_mlp,
        optimizer=_sgd,
        fit_kwargs={"validation_data": (validation.x, validation.y)},
    )
    assert "val_loss" in history.history and "val_accuracy" in history.history
    _assert_histories_close(plain_history, history)

    evaluated = wrapper.evaluate(validation.x, validation.y, return_dict=True, verbose=0)
    np.testing.assert_allclose(evaluated["loss"], history.history["val_loss"][-1], rtol=1e-5)
    inner = problem.model
    problem.compile(inner)  # same loss and metrics, on the trained inner model
    expected = inner.evaluate(validation.x, validation.y, return_dict=True, verbose=0)
    assert set(evaluated) == set(expected)
    for key in expected:
        np.testing.assert_allclose(evaluated[key], expected[key], rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(
        wrapper.predict(validation.x, verbose=0), inner.predict(validation.x, verbose=0), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(wrapper(validation.x)), inner.predict(validation.x, verbose=0), atol=1e-6
    )


# --- callbacks -----------------------------------------------------------------------------


class _BatchRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append((batch, dict(logs or {})))


def test_callbacks_see_batch_logs():
    problem = problems.dense_mlp()
    wrapper = pergrad.PerExampleModel(problem.model, "median")
    problem.compile(wrapper, optimizer=_sgd())
    recorder = _BatchRecorder()
    history = wrapper.fit(
        problem.x, problem.y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[recorder]
    )
    assert [batch for batch, _ in recorder.logs] == [0, 1, 0, 1]
    for _, logs in recorder.logs:
        assert {"loss", "accuracy"} <= set(logs)
        assert np.isfinite(float(logs["loss"]))
    # The last batch's running average is the epoch's History value.
    np.testing.assert_allclose(float(recorder.logs[-1][1]["loss"]), history.history["loss"][-1], rtol=1e-6)


def test_early_stopping_stops_training():
    problem = problems.dense_mlp()
    wrapper = pergrad.PerExampleModel(problem.model, "mean")
    problem.compile(wrapper, optimizer=_sgd())
    # No epoch can improve the loss by 1e9: training stops after patience + 1 epochs.
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9, patience=1)
    history = wrapper.fit(problem.x, problem.y, batch_size=3, epochs=20, verbose=0, callbacks=[stopper])
    assert len(history.history["loss"]) == 2
    assert stopper.stopped_epoch == 1


def test_clip_diagnostic_is_logged():
    problem = problems.dense_mlp()
    wrapper = pergrad.PerExampleModel(problem.model, pergrad.aggregators.clip(1e-3))
    problem.compile(wrapper, optimizer=_sgd())
    history = wrapper.fit(problem.x, problem.y, batch_size=3, epochs=1, verbose=0)
    np.testing.assert_allclose(history.history["clipped_fraction"], [1.0])


def test_metric_updates_give_keras_mean_values():
    """The train step's metric updates (``update_mean``: in place on eager torch) and the
    diagnostics' ``StepMean`` give Keras's ``Mean`` totals, counts and results, the same
    bits; in a ``StatelessScope`` the update goes to the scope, as Keras's."""
    from pergrad.training.trainers import StepMean, update_mean

    values = [1.5, float("nan"), 3.25, float("inf"), -2.0, 0.1]
    for weights in ([None] * 6, [64, 3, 1, 0.5, 2, 7]):
        ours, keras_mean = StepMean(name="ours"), keras.metrics.Mean(name="keras")
        np.testing.assert_array_equal(ops.convert_to_numpy(ours.result()), 0.0)
        for k, (value, weight) in enumerate(zip(values, weights)):
            if k == 1:  # the results before the NaN arrives agree too
                ours_before = ops.convert_to_numpy(ours.result())
                np.testing.assert_array_equal(ours_before, ops.convert_to_numpy(keras_mean.result()))
            tensor = ops.convert_to_tensor(value, "float32")
            update_mean(ours, tensor, sample_weight=weight)
            keras_mean.update_state(tensor, sample_weight=weight)
        for a, b in ((ours.total, keras_mean.total), (ours.count, keras_mean.count)):
            np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
        np.testing.assert_array_equal(ops.convert_to_numpy(ours.result()),
                                      ops.convert_to_numpy(keras_mean.result()))
    finite = StepMean(name="finite")
    for value in (0.25, 0.5, 1.0):
        update_mean(finite, ops.convert_to_tensor(value, "float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(finite.result()), 1.75 / 3, rtol=1e-7)
    with keras.StatelessScope() as scope:
        update_mean(finite, ops.convert_to_tensor(10.0, "float32"), sample_weight=2)
    assert float(ops.convert_to_numpy(finite.count)) == 3.0  # the variables are untouched
    np.testing.assert_allclose(ops.convert_to_numpy(scope.get_current_value(finite.count)), 5.0)


# --- dropout through fit -----------------------------------------------------------------------


def _seed_state(model):
    (state,) = [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]
    return ops.convert_to_numpy(state.value).copy()


def _fit_dropout(seed, weights):
    problem = problems.dense_mlp(seed=seed, dropout=0.5, hidden=8)
    problem.model.set_weights(weights)
    wrapper = pergrad.PerExampleModel(problem.model, "mean")
    problem.compile(wrapper, optimizer=_sgd())
    keras.utils.set_random_seed(seed)  # torch: unseeded Dropout draws from torch's generator
    wrapper.fit(problem.x, problem.y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    return problem.model.get_weights(), _seed_state(problem.model)


def test_dropout_in_fit_is_seeded_and_advances_the_seed_state_like_keras():
    """The seed state the per-example pass advances is written back (JAX's stateless step
    included) exactly as plain fit() advances it; the same seed reproduces training, another
    seed changes it."""
    weights = problems.dense_mlp(dropout=0.5, hidden=8).model.get_weights()
    first, state = _fit_dropout(3, weights)
    plain = problems.dense_mlp(seed=3, dropout=0.5, hidden=8)
    plain.compile(optimizer=_sgd()).fit(plain.x, plain.y, batch_size=3, epochs=2, verbose=0)
    np.testing.assert_array_equal(state, _seed_state(plain.model))
    if BACKEND != "torch":  # Keras on torch: unseeded Dropout leaves its seed state alone
        assert not np.array_equal(state, _seed_state(problems.dense_mlp(seed=3, dropout=0.5).model))
    # Another seed gives other masks (the per-example tests check that the same seed
    # reproduces them), hence another end point.
    other, _ = _fit_dropout(4, weights)
    assert max(float(np.abs(a - b).max()) for a, b in zip(first, other)) > 1e-5
    again, state_again = _fit_dropout(3, weights)
    np.testing.assert_array_equal(state, state_again)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


# --- saving ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "aggregator, check",
    [
        ("median", lambda agg: type(agg).__name__ == "Median"),
        (
            pergrad.aggregators.clip(0.5, per_layer=True),
            lambda agg: type(agg).__name__ == "Clip" and agg.l2_norm == 0.5 and agg.per_layer,
        ),
    ],
    ids=["median", "clip"],
)
def test_save_and_load_round_trip(tmp_path, aggregator, check):
    problem = problems.dense_mlp()
    wrapper = pergrad.PerExampleModel(problem.model, aggregator, microbatch_size=4)
    problem.compile(wrapper, optimizer=_adam())
    wrapper.fit(problem.x, problem.y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "wrapper.keras"
    wrapper.save(path)

    loaded = keras.models.load_model(path, safe_mode=True)
    assert isinstance(loaded, pergrad.PerExampleModel)
    assert check(loaded.aggregator), loaded.aggregator.get_config()
    assert loaded.microbatch_size == 4
    np.testing.assert_array_equal(
        loaded.predict(problem.x, verbose=0), wrapper.predict(problem.x, verbose=0)
    )
    # Training continues from the restored optimizer state exactly as the original would.
    wrapper.fit(problem.x, problem.y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    loaded.fit(problem.x, problem.y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    oracle.assert_weights_close(loaded.model, wrapper.model)


# --- loss scaling ----------------------------------------------------------------------------------


def _loss_scale_sgd():
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))


def test_loss_scale_optimizer_trains_like_plain_fit():
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.dense_mlp,
        optimizer=_loss_scale_sgd,
        fit_kwargs={"sample_weight": problems.make("dense_mlp").sample_weight},
    )
    oracle.assert_weights_close(wrapper.model, plain)
    _assert_histories_close(plain_history, history)
    scales = [ops.convert_to_numpy(m.optimizer.dynamic_scale) for m in (wrapper, plain)]
    np.testing.assert_allclose(*scales)


def test_mixed_float16_with_loss_scaling_trains_like_plain_fit():
    """The fixture restores the float32 policy afterwards."""
    keras.config.set_dtype_policy("mixed_float16")
    problem, plain, plain_history, wrapper, history = oracle.fit_both(
        problems.dense_mlp, optimizer=_loss_scale_sgd
    )
    assert problem.model.layers[0].compute_dtype == "float16"
    # Same skipped steps: per-example float16 backward passes overflow when Keras's would.
    for attribute in ("dynamic_scale", "iterations"):
        values = [ops.convert_to_numpy(getattr(m.optimizer, attribute)) for m in (wrapper, plain)]
        np.testing.assert_array_equal(*values, err_msg=attribute)
    # float16 activations: per-example and batched forward passes round differently.
    oracle.assert_weights_close(wrapper.model, plain, atol=2e-3, rtol=2e-3)
    _assert_histories_close(plain_history, history, rtol=2e-3, atol=2e-3)


# --- the custom train_step recipe ---------------------------------------------------------------


CUSTOM_TRAIN_STEP = Path(__file__).resolve().parents[1] / "docs" / "custom-train-step.md"


def _train_step_recipe() -> str:
    """The code block of docs/custom-train-step.md's "The recipe", verbatim."""
    section = CUSTOM_TRAIN_STEP.read_text().split("## The recipe", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="JAX's Model.train_step(state, data) is stateless (variables go in and out as "
    "arrays), so a stateful train_step recipe does not apply; PerExampleModel implements "
    "the stateless JAX step and is tested on JAX everywhere else.",
)
def test_custom_train_step_recipe_matches_per_example_model():
    """docs/custom-train-step.md's recipe, run as written (given `keras_model`, `x`, `y`), trains like
    ``PerExampleModel(model, "median")`` and logs the same loss and metrics."""
    problem = problems.dense_mlp()
    namespace = {"keras_model": problem.model, "x": problem.x, "y": problem.y}
    exec(compile(_train_step_recipe(), "docs/custom-train-step.md", "exec"), namespace)  # noqa: S102 - our docs
    recipe, history = namespace["model"], namespace["history"]

    reference = problems.dense_mlp()
    wrapper = pergrad.PerExampleModel(reference.model, "median")
    wrapper.compile(optimizer="sgd", loss=reference.loss, metrics=["accuracy"])
    expected = wrapper.fit(reference.x, reference.y, batch_size=64, epochs=5, verbose=0)
    oracle.assert_weights_close(recipe, reference.model)
    assert set(history.history) == {"loss", "accuracy"}
    _assert_histories_close(expected, history)
    start = problems.dense_mlp().model.get_weights()
    moved = max(float(np.abs(a - b).max()) for a, b in zip(recipe.get_weights(), start))
    assert moved > 1e-4, "training did not move the weights: the comparison is vacuous"
