"""What pergrad refuses, and how: every error names the cause and the way out.

Run once per backend: ``KERAS_BACKEND=tensorflow pytest tests/test_errors.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems


def _mlp_problem(batch=6):
    problem = problems.dense_mlp(batch=batch)
    problem.compile()
    return problem


def _fit(problem, aggregator="mean", batch_size=3, epochs=1, **kwargs):
    wrapper = pergrad.PerExampleModel(problem.model, aggregator)
    problem.compile(wrapper)
    return wrapper, wrapper.fit(
        problem.x, problem.y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


# --- models whose per-example gradients are undefined or unsupported ---------------------------


def _batch_norm_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="mixing_bn"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


BATCH_NORM_MESSAGE = r"(?s)'mixing_bn'.*BatchNormalization.*LayerNormalization"


def test_batch_normalization_in_training_mode_is_refused():
    problem = _mlp_problem()
    model = _batch_norm_model()
    with pytest.raises(ValueError, match=BATCH_NORM_MESSAGE):
        pergrad.per_example_gradients(model, problem.x, problem.y)
    wrapper = pergrad.PerExampleModel(model, "mean")
    wrapper.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=BATCH_NORM_MESSAGE):
        wrapper.fit(problem.x, problem.y, batch_size=3, verbose=0)


def test_batch_normalization_in_inference_mode_or_frozen_is_fine():
    problem = _mlp_problem()
    model = _batch_norm_model()
    grads = pergrad.per_example_gradients(model, problem.x, problem.y, training=False)
    expected = oracle.batch_of_one_gradients(model, problem.x, problem.y, training=False)
    oracle.assert_gradients_close(grads, expected)
    model.get_layer("mixing_bn").trainable = False  # runs in inference mode, also in fit()
    wrapper = pergrad.PerExampleModel(model, "mean")
    wrapper.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = wrapper.fit(problem.x, problem.y, batch_size=3, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_model_without_trainable_variables():
    problem = _mlp_problem()
    problem.model.trainable = False
    with pytest.raises(ValueError, match="has no trainable variables"):
        pergrad.per_example_gradients(problem.model, problem.x, problem.y)
    wrapper = pergrad.PerExampleModel(problem.model, "mean")
    problem.compile(wrapper)
    with pytest.raises(ValueError, match="has no trainable variables"):
        wrapper.fit(problem.x, problem.y, verbose=0)


def test_unbuilt_model():
    model = keras.Sequential([keras.layers.Dense(2)])
    model.compile(loss="mse")
    with pytest.raises(ValueError, match="is not built yet"):
        pergrad.per_example_gradients(model, np.ones((2, 3), "float32"), np.ones((2, 2), "float32"))


def test_activity_regularizer_is_not_supported():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(3, activity_regularizer=keras.regularizers.L2(0.1))]
    )
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    problem = _mlp_problem()
    with pytest.raises(NotImplementedError, match=r"activity_regularizer.*Weight regularizers are supported"):
        pergrad.per_example_gradients(model, problem.x, problem.y)


def test_several_masked_outputs_are_not_supported():
    inputs = keras.Input((4,), dtype="int32")
    hidden = keras.layers.Embedding(5, 3, mask_zero=True)(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)])
    model.compile(loss=["mse", "mse"])
    x = np.array([[1, 2, 0, 0], [3, 0, 0, 0]], "int32")
    y = [np.zeros((2, 4, 2), "float32"), np.zeros((2, 4, 2), "float32")]
    with pytest.raises(NotImplementedError, match="single-output models only"):
        pergrad.per_example_gradients(model, x, y)


# --- losses ---------------------------------------------------------------------------------


def _scalar_loss(y_true, y_pred):
    return ops.mean(ops.square(ops.cast(y_true, y_pred.dtype) - y_pred))


def test_loss_function_returning_a_scalar_is_refused():
    problem = problems.make("conv1d")
    with pytest.raises(ValueError, match=r"'_scalar_loss' returns a scalar.*one loss per example"):
        pergrad.per_example_gradients(problem.model, problem.x, problem.y, loss=_scalar_loss)
    problem.loss = _scalar_loss
    wrapper = pergrad.PerExampleModel(problem.model, "mean")
    problem.compile(wrapper)
    with pytest.raises(ValueError, match="'_scalar_loss' returns a scalar"):
        wrapper.fit(problem.x, problem.y, batch_size=3, verbose=0)


@pytest.mark.parametrize("reduction", ["mean_with_sample_weight"])
def test_loss_reductions_that_are_not_a_mean_or_a_sum_are_refused(reduction):
    # Unreduced losses (None, "none") are accepted: tests/test_follow_model.py.
    problem = problems.make("conv1d")
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    with pytest.raises(ValueError, match=r"cannot be split into per-example losses.*'sum'"):
        pergrad.per_example_gradients(problem.model, problem.x, problem.y, loss=loss)


# --- aggregators ----------------------------------------------------------------------------


def test_unknown_aggregator_name():
    with pytest.raises(ValueError, match=r"Unknown aggregator 'no_such_rule'.*median.*clip\(l2_norm\)"):
        pergrad.PerExampleModel(_mlp_problem().model, "no_such_rule")
    with pytest.raises(ValueError, match="Did you mean 'median'"):
        pergrad.aggregators.get("medain")
    with pytest.raises(ValueError, match=r"'clip' needs arguments: pass pergrad.aggregators.clip\(l2_norm\)"):
        pergrad.aggregators.get("clip")


def test_aggregator_returning_the_wrong_number_of_tensors():
    problem = _mlp_problem()
    with pytest.raises(ValueError, match="returned 3 tensors for 4 trainable variables"):
        _fit(problem, lambda grads: [ops.mean(g, axis=0) for g in grads[:-1]])


def test_aggregator_returning_a_wrong_shape_names_the_variable():
    problem = _mlp_problem()
    path = problem.model.trainable_variables[-1].path

    def wrong_last_shape(grads):
        return [ops.mean(g, axis=0) for g in grads[:-1]] + [ops.mean(grads[-1], axis=(0, 1))]

    with pytest.raises(ValueError, match=rf"returned shape \(\) for variable '{path}' of shape \(3,\)"):
        _fit(problem, wrong_last_shape)


def test_trimmed_mean_cannot_trim_everything():
    """floor(trim * B) < B / 2 for any trim < 0.5, so only trim >= 0.5 could trim everything,
    and the constructor refuses it. At trim=0.49 a batch of 2 drops nothing: the mean."""
    with pytest.raises(ValueError, match=r"trim must be in \[0, 0.5\)"):
        pergrad.aggregators.trimmed_mean(0.5)
    problem = _mlp_problem(batch=2)
    grads = pergrad.per_example_gradients(problem.model, problem.x, problem.y)
    trimmed = pergrad.aggregators.trimmed_mean(0.49)(grads)
    oracle.assert_gradients_close(trimmed, [ops.convert_to_numpy(g).mean(0) for g in grads])


# No leading underscore in layer class names: TF refuses the derived scope name.
class NeedsThree(pergrad.aggregators.CoordinateAggregator):
    min_batch_size = 3

    def aggregate_variable(self, gradient):
        return ops.mean(gradient, axis=0)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _assert_unchanged(model, weights):
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_batch_smaller_than_the_rule_needs():
    problem = _mlp_problem()
    # A stream of batches (sizes unknown before they come): the step refuses the first.
    batches = [(problem.x[:1], problem.y[:1])] * 3
    wrapper = pergrad.PerExampleModel(problem.model, NeedsThree())
    problem.compile(wrapper)
    start = _weights(problem.model)
    with pytest.raises(ValueError, match="needs batches of at least 3 examples; got a batch of") as error:
        wrapper.fit((batch for batch in batches), steps_per_epoch=3, verbose=0)
    _one_line(error)
    _assert_unchanged(problem.model, start)
    # The refused fit() left the model usable (Keras's JAX fit() empties its variables).
    grads = pergrad.per_example_gradients(problem.model, problem.x[:2], problem.y[:2])
    with pytest.raises(ValueError, match="needs a batch of at least 3 examples, got 2"):
        NeedsThree()(grads)


@pytest.mark.parametrize("rule", ["needs_three", "krum"])
def test_every_batch_size_of_arrays_is_checked_before_the_first_step(rule):
    """8 examples in batches of 3 leave a last batch of 2: refused before any weight moves,
    with the batch sizes that work and the other way out."""
    problem = _mlp_problem(batch=8)
    aggregator = NeedsThree() if rule == "needs_three" else pergrad.aggregators.krum(0.2)
    start = _weights(problem.model)
    with pytest.raises(ValueError, match="at least 3 examples, got 2") as error:
        _fit(problem, aggregator, batch_size=3)
    message = _one_line(error)
    assert "last batch of 2 from 8 training examples" in message
    assert "batch_size=4" in message and "drop_remainder=True" in message and "x[:6]" in message
    _assert_unchanged(problem.model, start)
    # What the message proposes trains; so does validation_split's smaller training set.
    _fit(problem, aggregator, batch_size=4)
    with pytest.raises(ValueError, match="last batch of 1 from 7 training examples"):
        _fit(problem, aggregator, batch_size=3, validation_split=0.125)


def _small_batches_last():
    problem = _mlp_problem(batch=8)
    return problem, [(problem.x[:3], problem.y[:3]), (problem.x[3:6], problem.y[3:6]),
                     (problem.x[6:], problem.y[6:])]


def test_a_small_last_batch_of_a_stream_is_one_line():
    """Sizes that show only as the batches come: the step refuses the small one in one line
    (on TF a run-time assertion, not its graph's trace) and says that earlier steps ran."""
    problem, batches = _small_batches_last()
    wrapper = pergrad.PerExampleModel(problem.model, NeedsThree())
    problem.compile(wrapper)
    with pytest.raises(ValueError, match="needs batches of at least 3 examples") as error:
        wrapper.fit((batch for batch in batches), steps_per_epoch=3, verbose=0)
    _one_line(error)


def test_a_sequential_without_input_is_built_from_the_first_batch():
    """As plain Keras builds it, on every backend; ``mean`` then trains as plain Keras."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 5)).astype("float32"), rng.integers(0, 3, 12)
    trained = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
        fitted = pergrad.PerExampleModel(model, "mean") if wrap else model
        fitted.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        keras.utils.set_random_seed(1)
        fitted.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        assert model.built
        trained.append(model)
    oracle.assert_weights_close(trained[1], trained[0])


def test_shape_errors_quote_the_batch_shapes():
    """A wrong feature count and a target that does not match the output: the batch's
    shapes (6 examples), not one example's, as plain Keras says."""
    problem = _mlp_problem()
    wrong = np.ones((6, 4), "float32")
    start = _weights(problem.model)
    wrapper = pergrad.PerExampleModel(problem.model, "median")
    problem.compile(wrapper)
    for call in (lambda: pergrad.per_example_gradients(problem.model, wrong, problem.y),
                 lambda: wrapper.fit(wrong, problem.y, batch_size=6, verbose=0)):
        with pytest.raises(ValueError) as error:
            call()
        assert "(1, 4)" not in str(error.value) and ("(6, 4)" in str(error.value)
                                                     or "(None, 4)" in str(error.value))
    targets = np.ones((6, 2), "float32")
    # (torch writes torch.Size([6, 2]))
    with pytest.raises(ValueError, match=r"target.shape=\S*\(\[?6, 2\]?\), output.shape=\S*\(\[?6, 3"):
        pergrad.per_example_gradients(problem.model, problem.x, targets, loss="categorical_crossentropy")
    _assert_unchanged(problem.model, start)


def test_a_per_example_model_is_not_wrapped_twice():
    wrapper = pergrad.PerExampleModel(_mlp_problem().model, "mean")
    with pytest.raises(ValueError, match="already a PerExampleModel"):
        pergrad.PerExampleModel(wrapper, "median")


# --- non-finite per-example gradients -----------------------------------------------------------


def _sqrt_loss(y_true, y_pred):
    # Finite at a perfect prediction, but its gradient there is 0 * inf = NaN.
    return ops.mean(ops.sqrt(ops.abs(y_true - y_pred)), axis=-1)


def _nan_gradient_problem():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3)).astype("float32")
    y = rng.normal(size=(5, 1)).astype("float32")
    x[2], y[2] = 0.0, 0.0  # example 2 is predicted exactly
    return model, x, y


def test_non_finite_per_example_gradient_is_reported_as_is():
    model, x, y = _nan_gradient_problem()
    grads = [ops.convert_to_numpy(g) for g in pergrad.per_example_gradients(model, x, y, loss=_sqrt_loss)]
    bad = np.stack([~np.isfinite(g.reshape(len(g), -1)).all(axis=1) for g in grads]).any(axis=0)
    np.testing.assert_array_equal(bad, [False, False, True, False, False])


def _finite_mean(gradients):
    """A rule that would hide non-finite examples (treats them as zero)."""
    return [ops.mean(ops.where(ops.isfinite(g), g, ops.zeros_like(g)), axis=0) for g in gradients]


@pytest.mark.parametrize("aggregator", ["median", "mean", "finite_mean"])
def test_non_finite_gradients_make_the_step_nan_and_terminate_on_nan_stops(aggregator):
    """Documented behaviour: one non-finite per-example gradient makes the aggregated gradient
    NaN, even for a rule that would hide it (the median may; ``finite_mean`` does), so
    training diverges loudly."""
    model, x, y = _nan_gradient_problem()
    wrapper = pergrad.PerExampleModel(model, _finite_mean if aggregator == "finite_mean" else aggregator)
    wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss=_sqrt_loss)
    history = wrapper.fit(
        x, y, batch_size=len(x), epochs=5, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()]
    )
    losses = history.history["loss"]
    assert np.isfinite(losses[0]), "the first step's loss is computed before the update"
    assert len(losses) == 2 and np.isnan(losses[1]), losses
    assert all(np.isnan(w).all() for w in model.get_weights())
