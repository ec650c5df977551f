"""Refusals say the true cause, log nothing contradictory first, and leave the model usable.

A refused ``fit()`` must leave the user's model as it was: it still predicts the same
and trains with plain Keras afterwards (Keras's JAX ``fit()`` empties the variables
while a step runs). A mixture-of-experts router (``one_hot(argmax(...))``) trains on
every backend; on torch, what ``torch.func.vmap`` cannot batch is named as it is.
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
from conftest import BACKEND
from test_errors import NeedsThree


class AddsLoss(layers.Layer):
    """A data-dependent ``add_loss`` (an activity penalty)."""

    def call(self, x):
        self.add_loss(0.01 * ops.mean(ops.square(x)))
        return x


class SwitchRouter(layers.Layer):
    """A mixture-of-experts block (Switch Transformer routing): each example goes to its
    most probable expert, whose output is scaled by that probability; optionally the
    router adds a load-balancing loss, which depends on the batch."""

    def __init__(self, experts=3, units=4, balance=False, **kwargs):
        super().__init__(**kwargs)
        self.gate = layers.Dense(experts)
        self.experts = [layers.Dense(units) for _ in range(experts)]
        self.balance = balance

    def call(self, x):
        probabilities = ops.softmax(self.gate(x))
        choice = ops.one_hot(ops.argmax(probabilities, axis=-1), len(self.experts))
        if self.balance:
            self.add_loss(ops.sum(ops.square(ops.mean(probabilities, axis=0))))
        outputs = ops.stack([expert(x) for expert in self.experts], axis=-2)
        return ops.sum(outputs * (choice * probabilities)[..., None], axis=-2)


def _model(kind):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = layers.Dense(4, activation="tanh")(inputs)
    hidden = {
        "add_loss": lambda h: AddsLoss()(h),
        "router_balance_loss": lambda h: SwitchRouter(balance=True)(h),
        "batch_normalization": lambda h: layers.BatchNormalization()(h),
        "router": lambda h: SwitchRouter()(h),
    }[kind](hidden)
    model = keras.Model(inputs, layers.Dense(2)(hidden))
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(6, 5)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")


_CAUSES = {
    "add_loss": (NotImplementedError, "add_loss"),
    "router_balance_loss": (NotImplementedError, "add_loss"),
    "batch_normalization": (ValueError, "BatchNormalization"),
}


@pytest.mark.parametrize(
    "kind, rule, path",
    [
        ("add_loss", "mean", "auto"),  # the batch loss's gradient
        ("add_loss", "clip", "auto"),  # the statistics path
        ("router_balance_loss", "mean", "auto"),
        ("router_balance_loss", "median", "auto"),  # the streaming path
        ("router_balance_loss", "clip", "materialized"),
        ("batch_normalization", "clip", "auto"),
    ],
)
def test_refused_fit_says_why_and_leaves_the_model_usable(kind, rule, path, caplog):
    model, x, y = _model(kind)
    model.compile(optimizer="sgd", loss="mse")
    before, weights = model.predict(x, verbose=0), model.get_weights()
    aggregator = pergrad.aggregators.clip(1.0) if rule == "clip" else rule
    wrapper = pergrad.PerExampleModel(model, aggregator, path=path)
    wrapper.compile(optimizer="sgd", loss="mse")
    error, cause = _CAUSES[kind]
    with caplog.at_level(logging.INFO, logger="pergrad"), pytest.raises(error, match=cause):
        wrapper.fit(x, y, batch_size=3, epochs=1, verbose=0)
    logged = [record.getMessage() for record in caplog.records if record.name == "pergrad"]
    assert not logged, f"no path is taken before a refusal: {logged}"
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    for weight, start in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(weight, start)
    model.compile(optimizer="sgd", loss="mse")  # plain Keras trains it
    model.fit(x, y, batch_size=3, epochs=1, verbose=0)
    assert any(not np.array_equal(w, s) for w, s in zip(model.get_weights(), weights))


def test_refusal_in_a_later_step_keeps_what_the_steps_before_learned():
    """7 examples in batches of 3 from a source fit() cannot size up front: the last batch
    is smaller than the rule needs, found
    when its step is traced (TF: when it runs). The weights of the two steps that ran are
    kept, as plain Keras keeps them after any error."""
    model, x, y = _model("router")
    x, y = np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]])
    wrapper = pergrad.PerExampleModel(model, NeedsThree())
    wrapper.compile(optimizer="sgd", loss="mse")
    start = model.get_weights()
    with pytest.raises(ValueError, match="needs batches of at least 3 examples; got a batch of (1|fewer)"):
        wrapper.fit(problems.UnsizedBatches(x, y, 3), epochs=1, verbose=0, shuffle=False)
    after = model.get_weights()
    model.set_weights(start)  # the two steps again, by themselves
    wrapper.fit(x[:6], y[:6], batch_size=3, epochs=1, verbose=0, shuffle=False)
    for weight, expected in zip(after, model.get_weights()):
        np.testing.assert_array_equal(weight, expected)
    assert any(not np.array_equal(a, b) for a, b in zip(after, start))


@pytest.mark.parametrize("path", ["auto", "materialized"])
def test_mixture_of_experts_router_trains_exactly(path):
    """``one_hot(argmax(...))`` routing: per-example gradients equal the batch-of-one oracle
    on every backend (torch's ``one_hot`` cannot run under ``vmap(grad)``: pergrad runs an
    equal comparison there), and ``clip`` trains on both paths."""
    model, x, y = _model("router")
    model.compile(optimizer="sgd", loss="mse")
    expected = oracle.batch_of_one_gradients(model, x, y)
    assert float(np.max(np.abs(expected[2]))) > 0, "the gate is trained (through the probabilities)"
    oracle.assert_gradients_close(pergrad.per_example_gradients(model, x, y), expected)
    norms = np.stack([np.sum(np.reshape(g, (len(x), -1)) ** 2, axis=1) for g in expected], axis=1)
    np.testing.assert_allclose(pergrad.per_example_statistics(model, x, y).squared_norms, norms,
                               rtol=1e-5, atol=1e-7)
    wrapper = pergrad.PerExampleModel(model, pergrad.aggregators.clip(0.5), path=path)
    wrapper.compile(optimizer="sgd", loss="mse")
    wrapper.fit(x, y, batch_size=3, epochs=1, verbose=0)


class DataDependentBranch(layers.Layer):
    """Python control flow on a tensor's value (runs eagerly on torch only)."""

    def call(self, x):
        return x * 2.0 if bool(ops.any(x > 10.0)) else x


@pytest.mark.skipif(BACKEND != "torch", reason="TF and JAX trace the model: plain Keras refuses it too")
@pytest.mark.parametrize("path, dropout", [("materialized", 0.0), ("auto", 0.1)],
                         ids=["materialized", "statistics_vectorized"])
def test_torch_names_what_vmap_cannot_batch(path, dropout, caplog):
    """Not the seeded-random-layer message: the actual cause (a tensor's value read in the
    forward pass), where it happens, and what to do; no path logged before it. (With
    dropout, the statistics path's forward pass runs under ``vmap`` too.)"""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), layers.Dense(4), layers.Dropout(dropout),
                              DataDependentBranch(), layers.Dense(2)])
    x, y = np.ones((4, 5), "float32"), np.zeros((4, 2), "float32")
    wrapper = pergrad.PerExampleModel(model, pergrad.aggregators.clip(1.0), path=path)
    wrapper.compile(optimizer="sgd", loss="mse")
    with caplog.at_level(logging.INFO, logger="pergrad"), pytest.raises(NotImplementedError) as raised:
        wrapper.fit(x, y, batch_size=2, verbose=0)
    message = str(raised.value)
    assert "depends on a tensor's value" in message and "test_refusals.py" in message, message
    assert "seed" not in message and "training=False" not in message, message
    assert "ops.where" in message
    logged = [record.getMessage() for record in caplog.records if record.name == "pergrad"]
    assert not logged, logged
