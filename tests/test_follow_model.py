"""pergrad follows the user's changes after first use, compiles standalone calls once and
accepts unreduced losses (issue 8).

Workflows: recompiling with another loss, unfreezing a BatchNormalization, the keras.io
fine-tuning workflow (freeze the base, compile, fit the head, unfreeze, compile, fit all)
with and without Dropout, trainable changes without a recompile, repeated standalone calls,
``reduction=None``. References: plain Keras ``fit()`` and the batch-of-one loop oracle.

Run once per backend: ``KERAS_BACKEND=torch pytest tests/test_follow_model.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems
from pergrad import engine

BACKEND = keras.backend.backend()
BATCH = problems.BATCH


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, 5)).astype("float32")
    y = rng.integers(0, 3, size=(BATCH,)).astype("int32")
    return x, y


def _model(dropout=None, batch_norm=False, seed=0):
    """Dense "base" -> [BatchNormalization] -> [Dropout] -> Dense "head"."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="base")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    if dropout is not None:
        layers.append(keras.layers.Dropout(dropout, name="dropout"))
    layers.append(keras.layers.Dense(3, name="head"))
    return keras.Sequential(layers, name="follow")


def _scce(**kwargs):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def _seed_state(model):
    (state,) = [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]
    return ops.convert_to_numpy(state.value).copy()


def _fit(model, x, y, **kwargs):
    return model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, **kwargs)


# --- silent wrong results and crashes after a change ----------------------------------------


def test_recompiling_with_another_loss_is_followed():
    """``per_example_gradients`` and ``PerExampleModel`` use the loss of the latest compile."""
    x, _ = _data()
    y = np.random.default_rng(1).normal(size=(BATCH, 3)).astype("float32")
    model = _model()
    model.compile(loss="mse")
    pergrad.per_example_gradients(model, x, y)
    model.compile(loss="mae")
    expected = oracle.batch_of_one_gradients(model, x, y)
    oracle.assert_gradients_close(pergrad.per_example_gradients(model, x, y), expected)

    plain, inner = _model(), _model()
    wrapper = pergrad.PerExampleModel(inner, "mean")
    for loss in ("mse", "mae"):
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        plain_history, history = _fit(plain, x, y), _fit(wrapper, x, y)
        np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    oracle.assert_weights_close(inner, plain)


def test_unfreezing_batch_normalization_after_first_use_is_refused():
    x, y = _data()
    model = _model(batch_norm=True)
    model.get_layer("bn").trainable = False
    model.compile(loss=_scce())
    expected = oracle.batch_of_one_gradients(model, x, y)
    oracle.assert_gradients_close(pergrad.per_example_gradients(model, x, y), expected)
    wrapper = pergrad.PerExampleModel(model, "mean")
    wrapper.compile(optimizer="sgd", loss=_scce())
    _fit(wrapper, x, y)

    model.get_layer("bn").trainable = True
    message = r"(?s)'bn'.*BatchNormalization.*per-example gradients are undefined"
    with pytest.raises(ValueError, match=message):
        pergrad.per_example_gradients(model, x, y)
    with pytest.raises(ValueError, match=message):
        _fit(wrapper, x, y)  # without a recompile
    wrapper.compile(optimizer="sgd", loss=_scce())
    with pytest.raises(ValueError, match=message):
        _fit(wrapper, x, y)


def _fine_tune(model, x, y, dropout_seed=None):
    """keras.io's fine-tuning workflow on ``model`` (plain or wrapped): freeze the base,
    compile, fit the head, unfreeze, compile with a smaller learning rate, fit all."""
    inner = getattr(model, "model", model)
    inner.get_layer("base").trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=_scce())
    if dropout_seed is not None:
        keras.utils.set_random_seed(dropout_seed)  # torch: unseeded Dropout uses torch's generator
    first = _fit(model, x, y)
    inner.get_layer("base").trainable = True
    model.compile(optimizer=keras.optimizers.Adam(0.001), loss=_scce())
    second = _fit(model, x, y)
    return first.history["loss"] + second.history["loss"]


def test_fine_tuning_workflow_trains_like_plain_fit():
    x, y = _data()
    plain, inner = _model(), _model()
    start = plain.get_weights()
    plain_losses = _fine_tune(plain, x, y)
    losses = _fine_tune(pergrad.PerExampleModel(inner, "mean"), x, y)
    oracle.assert_weights_close(inner, plain)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert not np.allclose(plain.get_weights()[0], start[0]), "the base did not train"


def test_fine_tuning_with_dropout_follows_the_model():
    """Freezing and unfreezing layers of a model with Dropout moves its seed state among the
    non-trainable variables: the workflow runs, advances the seed state as plain fit() does,
    and per-example gradients still match the oracle after each change."""
    x, y = _data()
    plain, inner = _model(dropout=0.5), _model(dropout=0.5)
    _fine_tune(plain, x, y, dropout_seed=3)
    losses = _fine_tune(pergrad.PerExampleModel(inner, "mean"), x, y, dropout_seed=3)
    assert np.all(np.isfinite(losses))
    np.testing.assert_array_equal(_seed_state(inner), _seed_state(plain))
    model = _model(dropout=0.5)
    model.compile(loss=_scce())
    for trainable in (False, True):
        model.get_layer("base").trainable = trainable
        grads = pergrad.per_example_gradients(model, x, y)  # training=True: must run
        assert [tuple(g.shape[1:]) for g in grads] == [tuple(v.shape) for v in model.trainable_variables]
        expected = oracle.batch_of_one_gradients(model, x, y, training=False)
        oracle.assert_gradients_close(pergrad.per_example_gradients(model, x, y, training=False), expected)


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_trainable_change_without_recompile_is_refused(change):
    """Keras applies trainable changes at compile() only (TensorFlow's fit() ignores them,
    JAX's and torch's fail in the optimizer or follow them): pergrad asks for the recompile."""
    x, y = _data()
    inner = _model()
    inner.get_layer("base").trainable = change == "unfreeze"
    wrapper = pergrad.PerExampleModel(inner, "mean")
    wrapper.compile(optimizer="sgd", loss=_scce())
    _fit(wrapper, x, y)
    inner.get_layer("base").trainable = change == "freeze"
    with pytest.raises(ValueError, match=r"(?s)'base'.*trainable.*compile\(\)"):
        _fit(wrapper, x, y)
    wrapper.compile(optimizer="sgd", loss=_scce())
    _fit(wrapper, x, y)


def test_stateful_aggregator_built_for_other_variables_is_refused():
    """``centered_clip`` keeps one center per trainable variable: after unfreezing, a
    clear error instead of zipping the new gradients with the old centers."""
    x, y = _data()
    inner = _model()
    inner.get_layer("base").trainable = False
    wrapper = pergrad.PerExampleModel(inner, pergrad.aggregators.centered_clip(1.0))
    wrapper.compile(optimizer="sgd", loss=_scce())
    _fit(wrapper, x, y)
    inner.get_layer("base").trainable = True
    wrapper.compile(optimizer="sgd", loss=_scce())
    with pytest.raises(ValueError, match=r"(?s)'centered_clip(_\d+)?'.*keeps state.*new aggregator"):
        _fit(wrapper, x, y)


# --- standalone calls are compiled once ---------------------------------------------------------


def test_repeated_standalone_calls_are_compiled_once(monkeypatch):
    """TF and JAX trace the per-example pass once per model state and input signature;
    torch runs eagerly. Results carry no autograd graph (``np.asarray``) and match the
    oracle, also after the weights change; a freeze gives a new function for the new
    variables."""
    calls = []
    compute = engine.PerExampleProblem.compute

    def counting(self, *args, **kwargs):
        calls.append(1)
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(engine.PerExampleProblem, "compute", counting)
    x, y = _data()
    model = _model()
    model.compile(loss=_scce())
    expected = oracle.batch_of_one_gradients(model, x, y)
    for _ in range(3):
        grads = pergrad.per_example_gradients(model, x, y)
        oracle.assert_gradients_close([np.asarray(g) for g in grads], expected)
    assert len(calls) == (3 if BACKEND == "torch" else 1)
    model.set_weights([0.5 * w for w in model.get_weights()])  # read at every call, not traced in
    oracle.assert_gradients_close(
        pergrad.per_example_gradients(model, x, y), oracle.batch_of_one_gradients(model, x, y)
    )
    assert len(calls) == (4 if BACKEND == "torch" else 1)
    model.get_layer("base").trainable = False
    grads = pergrad.per_example_gradients(model, x, y)
    assert len(grads) == 2
    oracle.assert_gradients_close(grads, oracle.batch_of_one_gradients(model, x, y))


# --- the seed's own loss: reduction=None ---------------------------------------------------------


def test_unreduced_loss_is_the_mean_reductions_per_example_loss():
    """``L_i`` of an unreduced loss is example i's value averaged over its non-batch axes
    times its weight: the same as for the mean reduction, passed or compiled; masks too."""
    problem = problems.make("dense_mlp")
    model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
    expected = pergrad.per_example_gradients(model, x, y, weights, loss=_scce())
    oracle.assert_gradients_close(
        pergrad.per_example_gradients(model, x, y, weights, loss=_scce(reduction=None)),
        [ops.convert_to_numpy(g) for g in expected],
    )
    model.compile(loss=_scce(reduction="none"))
    oracle.assert_gradients_close(
        pergrad.per_example_gradients(model, x, y, weights), [ops.convert_to_numpy(g) for g in expected]
    )
    masked = problems.make("masked")
    masked.compile()
    expected = oracle.batch_of_one_gradients(
        masked.model, masked.x, masked.y, masked.sample_weight, scale=masked.scale()
    )
    unreduced = type(masked.loss).from_config({**masked.loss.get_config(), "reduction": None})
    grads = pergrad.per_example_gradients(
        masked.model, masked.x, masked.y, masked.sample_weight, loss=unreduced
    )
    oracle.assert_gradients_close(grads, expected)


def test_compiled_unreduced_loss_trains_like_the_mean_reduction():
    """Plain Keras cannot train an unreduced loss on JAX and torch and sums it on TensorFlow;
    ``PerExampleModel`` trains it like the default mean reduction, logged loss included."""
    problem = problems.make("dense_mlp")
    x, y, weights = problem.x, problem.y, problem.sample_weight
    plain, inner = _model(), _model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=_scce(), metrics=["accuracy"])
    wrapper = pergrad.PerExampleModel(inner, "mean")
    wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss=_scce(reduction=None), metrics=["accuracy"])
    expected = plain.fit(x, y, sample_weight=weights, batch_size=4, epochs=2, shuffle=False, verbose=0)
    history = wrapper.fit(x, y, sample_weight=weights, batch_size=4, epochs=2, shuffle=False, verbose=0)
    oracle.assert_weights_close(inner, plain)
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, err_msg=key)


def test_variable_lists_are_read_once_within_a_step_and_again_after_it():
    """``compat.one_read_per_step`` (a training step's reads of the variable lists): one walk
    of the layers inside it, a fresh one at every call outside it, its own per model."""
    from pergrad import compat

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4)])
    with compat.one_read_per_step():
        first = compat.trainable_variables(model)
        assert len(first) == 4 and len(compat.trainable_variables(other)) == 2
        model.layers[0].trainable = False  # (no step does this: shows the one read)
        assert compat.trainable_variables(model) == first
        assert len(compat.non_trainable_variables(model)) == 2  # its first read: after the change
        compat.trainable_variables(model).pop()  # each caller gets its own list
        assert compat.trainable_variables(model) == first
    assert compat.trainable_variables(model) == model.layers[1].trainable_variables
    model.layers[0].trainable = True
    assert len(compat.trainable_variables(model)) == 4 and compat.non_trainable_variables(model) == []


def test_the_model_check_runs_once_within_a_step_and_at_every_call_after_it():
    """``check_model`` inside ``compat.one_read_per_step``: its first call checks (and
    raises); later ones in the same step reuse the answer; outside, each call checks."""
    from pergrad import compat
    from pergrad.engine.problem import check_model

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.layers[1].trainable = False
    with compat.one_read_per_step():
        check_model(model)
        model.layers[1].trainable = True  # (no step does this: shows the one check)
        check_model(model)
    with pytest.raises(ValueError, match="BatchNormalization"):
        check_model(model)
    with compat.one_read_per_step():  # a failed check is not remembered
        for _ in range(2):
            with pytest.raises(ValueError, match="BatchNormalization"):
                check_model(model)
