"""The recurrent layer rules (``pergrad.layer_rules.recurrent``) against the batch-of-one oracle.

LSTM, GRU (both ``reset_after``), SimpleRNN and ``RNN`` of a cell, with ``return_sequences``,
``go_backwards``, a padding mask (``Embedding(mask_zero=True)``, an interior masked step
too), ``Bidirectional``, stacked layers, initial and returned states, and the keras.io text
classifier's shape: each example's squared norms and the Gram matrix from the statistics
path, and a clipped step, equal to the oracle's, with every recurrent layer on its rule
(no fallback logged). Tiny: 4 examples, 5 steps, 3 units.
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
from pergrad.aggregators import clip
from pergrad.aggregators.aggregation import Aggregation
from pergrad.aggregators.base import ExampleStatistics
from pergrad.engine import PerExampleProblem
from pergrad.layer_rules import rule_for
from pergrad.layer_rules.recurrent import RecurrentRule
from pergrad.privacy import dp_gaussian

B, T, FEATURES, UNITS, VOCAB = 4, 5, 3, 3, 7


def _tokens():
    """Padded ids: lengths 5, 3, 1, 4, and example 3 has a masked step inside (id 0)."""
    x = np.random.default_rng(2).integers(1, VOCAB, size=(B, T)).astype("int32")
    for i, length in enumerate((5, 3, 1, 4)):
        x[i, length:] = 0
    x[3, 1] = 0
    return x


def _inputs(masked):
    """Float sequences, or ``Embedding(mask_zero=True)`` of padded ids."""
    if masked:
        inputs = keras.Input((T,), dtype="int32")
        return inputs, layers.Embedding(VOCAB, FEATURES, mask_zero=True)(inputs), _tokens()
    inputs = keras.Input((T, FEATURES))
    return inputs, inputs, np.random.default_rng(2).normal(size=(B, T, FEATURES)).astype("float32")


def _states(hidden):
    """An encoder's returned states start a decoder (``return_state``, ``initial_state``)."""
    _, h, c = layers.LSTM(UNITS, return_state=True)(hidden)
    decoded, state = layers.GRU(UNITS, return_sequences=True, return_state=True)(hidden, initial_state=h)
    return layers.Concatenate()([layers.GlobalAveragePooling1D()(decoded), state, c])


# Every configuration, each a branch of one model on the same inputs (one compiled pass for
# all: tracing and compiling each time loop is what these tests cost; each variable's norm is
# checked on its own). Stacked layers: the text classifier's.
BRANCHES = [
    lambda: layers.LSTM(UNITS, return_sequences=True, go_backwards=True),
    lambda: layers.LSTM(UNITS, use_bias=False, activation="relu", unit_forget_bias=False),
    lambda: layers.GRU(UNITS, return_sequences=True),
    lambda: layers.GRU(UNITS, reset_after=False, go_backwards=True),
    lambda: layers.GRU(UNITS, reset_after=False, use_bias=False, return_sequences=True),
    lambda: layers.SimpleRNN(UNITS, return_sequences=True, go_backwards=True, activation="relu"),
    lambda: layers.RNN(layers.GRUCell(UNITS, use_bias=False), unroll=True),
    lambda: layers.Bidirectional(layers.LSTM(UNITS, return_sequences=True)),
    lambda: _states,
]
# Without a mask Keras's time loop takes another branch: one layer of each kind.
UNMASKED_BRANCHES = [
    lambda: layers.LSTM(UNITS, return_sequences=True, go_backwards=True),
    lambda: layers.GRU(UNITS, reset_after=False, return_sequences=True),
    lambda: layers.SimpleRNN(UNITS),
    lambda: layers.Bidirectional(layers.GRU(UNITS), merge_mode="sum"),
]


def _every_configuration(masked):
    """Every branch (:data:`BRANCHES`, or :data:`UNMASKED_BRANCHES` on float sequences) on the
    inputs, each sequence output averaged over its valid steps, concatenated -> ``Dense(2)``,
    MSE with sample weights."""
    keras.utils.set_random_seed(0)
    inputs, hidden, x = _inputs(masked)
    outputs = []
    for branch in BRANCHES if masked else UNMASKED_BRANCHES:
        out = branch()(hidden)
        outputs.append(layers.GlobalAveragePooling1D()(out) if len(out.shape) == 3 else out)
    model = keras.Model(inputs, layers.Dense(2)(layers.Concatenate()(outputs)))
    rng = np.random.default_rng(3)
    problem = problems.Problem("recurrent", model, x, rng.normal(size=(B, 2)).astype("float32"), "mse",
                               sample_weight=rng.uniform(0.5, 2.0, B).astype("float32"))
    problem.compile()
    return problem


def _recurrent_layers(model):
    # (a Bidirectional's own `layer`, a template, is never called nor built)
    return [layer for layer in model._flatten_layers() if isinstance(layer, layers.RNN) and layer.built]


def _statistics_without_fallback(problem, caplog):
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        stats = pergrad.per_example_statistics(problem.model, problem.x, problem.y, problem.sample_weight,
                                               gram=True)
    # The statistics path ran, every recurrent layer on its rule.
    assert "materialized path" not in caplog.text, caplog.text
    assert "no layer rule" not in caplog.text, caplog.text
    return stats


def _assert_statistics_equal_the_oracle(problem, caplog):
    """Squared norms (per variable) and the Gram matrix against the oracle's; the oracle's
    gradients (``(B,) + shape`` each)."""
    stats = _statistics_without_fallback(problem, caplog)
    grads = oracle.batch_of_one_gradients(problem.model, problem.x, problem.y, problem.sample_weight)
    flat = np.concatenate([g.reshape(B, -1) for g in grads], axis=1)
    assert np.abs(flat - flat[:1]).max() > 1e-4  # examples differ: the comparison can fail
    expected = ExampleStatistics.from_gradients([ops.convert_to_tensor(g) for g in grads], gram=True)
    paths = [v.path for v in problem.model.trainable_variables]
    norms, reference = oracle.to_numpy(stats.squared_norms), oracle.to_numpy(expected.squared_norms)
    for k, path in enumerate(paths):
        np.testing.assert_allclose(norms[:, k], reference[:, k], rtol=1e-5,
                                   atol=1e-5 * max(1.0, float(reference[:, k].max())), err_msg=path)
    gram = oracle.to_numpy(expected.gram)
    np.testing.assert_allclose(oracle.to_numpy(stats.gram), gram, rtol=1e-5,
                               atol=1e-5 * max(1.0, float(np.abs(gram).max())))
    return grads


def _assert_one_step_equals_the_oracle(problem, rule, grads, monkeypatch):
    """One ``fit`` step with ``rule`` on the statistics path (never the materialized
    per-example gradients) moves the weights by the rule's result on the oracle's gradients."""
    model = problem.model
    before = [oracle.to_numpy(v.value).copy() for v in model.trainable_variables]
    wrapper = pergrad.PerExampleModel(model, rule, path="statistics")
    problem.compile(wrapper, optimizer=keras.optimizers.SGD(1.0))
    monkeypatch.setattr(PerExampleProblem, "compute", _refuse)
    wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B, epochs=1,
                shuffle=False, verbose=0)
    expected = Aggregation.of(rule.aggregate([ops.convert_to_tensor(g) for g in grads])).gradients
    moved = [b - oracle.to_numpy(v.value) for b, v in zip(before, model.trainable_variables)]
    oracle.assert_gradients_close(moved, [oracle.to_numpy(e) for e in expected], rtol=1e-5, atol=1e-6)


def _refuse(*args, **kwargs):
    raise AssertionError("the statistics path built the materialized per-example gradients")


@pytest.mark.parametrize("masked", [False, True], ids=["floats", "masked"])
def test_every_configuration_equals_the_batch_of_one_oracle(masked, caplog, monkeypatch):
    problem = _every_configuration(masked)
    recurrent = _recurrent_layers(problem.model)
    assert len(recurrent) == (11 if masked else 5)
    assert all(isinstance(rule_for(layer), RecurrentRule) for layer in recurrent)
    grads = _assert_statistics_equal_the_oracle(problem, caplog)
    if masked:  # (the weighted sums' formulas do not see the mask: one compiled step is enough)
        _assert_one_step_equals_the_oracle(problem, clip(0.05), grads, monkeypatch)


@pytest.mark.filterwarnings("ignore::pergrad.privacy.NotPoissonSampledWarning")
def test_the_text_classifier_equals_the_batch_of_one_oracle(caplog, monkeypatch):
    """keras.io's "Bidirectional LSTM on IMDB" shape: Embedding(mask_zero=True) ->
    Bidirectional(LSTM) twice -> Dense(1), binary cross-entropy; a DP step (no noise)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T,), dtype="int32")
    hidden = layers.Embedding(VOCAB, 4, mask_zero=True)(inputs)
    hidden = layers.Bidirectional(layers.LSTM(UNITS, return_sequences=True))(hidden)
    hidden = layers.Bidirectional(layers.LSTM(UNITS))(hidden)
    model = keras.Model(inputs, layers.Dense(1)(hidden))
    rng = np.random.default_rng(4)
    problem = problems.Problem("text_classifier", model, _tokens(),
                               rng.integers(0, 2, size=(B, 1)).astype("float32"),
                               keras.losses.BinaryCrossentropy(from_logits=True),
                               sample_weight=rng.uniform(0.5, 2.0, B).astype("float32"))
    problem.compile()
    grads = _assert_statistics_equal_the_oracle(problem, caplog)
    _assert_one_step_equals_the_oracle(problem, dp_gaussian(0.05, 0.0, expected_batch_size=B), grads,
                                       monkeypatch)


class _OwnCell(layers.LSTMCell):
    """A cell whose arithmetic is its own (a peephole, say): not the rule's."""

    def call(self, inputs, states, training=False):
        return super().call(inputs * 2.0, states, training=training)


@pytest.mark.parametrize("make", [
    lambda: layers.LSTM(UNITS, stateful=True),
    lambda: layers.LSTM(UNITS, recurrent_dropout=0.2),
    lambda: layers.GRU(UNITS, dropout=0.2, implementation=1),
    lambda: layers.RNN(_OwnCell(UNITS)),
    lambda: layers.RNN([layers.LSTMCell(UNITS), layers.GRUCell(UNITS)]),
], ids=["stateful", "recurrent_dropout", "per_gate_dropout", "own_cell", "stacked_cells"])
def test_configurations_the_rule_does_not_cover_take_the_exact_fallback(make):
    layer = make()
    layer.build((B, T, FEATURES))
    assert rule_for(layer) is None


def test_a_partly_frozen_cell_takes_the_fallback():
    layer = layers.LSTM(UNITS)
    layer.build((B, T, FEATURES))
    assert isinstance(rule_for(layer), RecurrentRule)
    layer.cell.bias.trainable = False
    assert rule_for(layer) is None
