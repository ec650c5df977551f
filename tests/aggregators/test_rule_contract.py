"""The rules' contract: what a rule hands to the step is returned (an Aggregation), never set on it."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import aggregators as agg
from pergrad.aggregators import Aggregation, Aggregator, MeanOf, WeightedAggregator
from pergrad.privacy import adaptive_dp_gaussian, dp_gaussian


class BelowNorm(WeightedAggregator):
    """docs/aggregators.md's example: the mean of the examples of norm at most ``threshold``."""

    diagnostics = ("kept_fraction",)

    def __init__(self, threshold, **kwargs):
        super().__init__(**kwargs)
        self.threshold = threshold

    def example_weights(self, stats):
        kept = ops.cast(stats.flat_norms <= self.threshold, "float32")
        return kept / ops.maximum(ops.sum(kept), 1.0)

    def finalize(self, result, stats):
        kept = ops.sum(ops.cast(stats.flat_norms <= self.threshold, "float32"))
        return Aggregation(result, reports={"kept_fraction": MeanOf(kept, stats.batch_size)})


class ArbitraryBelowNorm(Aggregator):
    """The Aggregator docstring's example (kind arbitrary)."""

    diagnostics = ("kept_fraction",)

    def __init__(self, threshold, **kwargs):
        super().__init__(**kwargs)
        self.threshold = threshold

    def aggregate(self, gradients):
        flat = ops.concatenate([ops.reshape(g, (ops.shape(g)[0], -1)) for g in gradients], axis=1)
        kept = ops.cast(ops.norm(flat, axis=1) <= self.threshold, "float32")
        count = ops.maximum(ops.sum(kept), 1.0)
        result = [ops.tensordot(kept, g, axes=1) / count for g in gradients]
        return Aggregation(result, reports={"kept_fraction": MeanOf(ops.sum(kept), ops.shape(kept)[0])})


def _gradients():
    rng = np.random.default_rng(0)
    scales = np.array([0.1, 0.2, 5.0, 0.3, 9.0, 0.1], "float32")
    return [ops.convert_to_tensor((rng.normal(size=(6,) + s) * scales.reshape((-1,) + (1,) * len(s)))
                                  .astype("float32")) for s in ((3,), (2, 2))]


@pytest.mark.parametrize("make", [BelowNorm, ArbitraryBelowNorm], ids=["weighted", "arbitrary"])
def test_the_documented_rules_return_their_result_and_reports(make):
    gradients = _gradients()
    flat = np.concatenate([ops.convert_to_numpy(g).reshape(6, -1) for g in gradients], axis=1)
    kept = np.linalg.norm(flat, axis=1) <= 1.0
    expected = [ops.convert_to_numpy(g)[kept].mean(axis=0) for g in gradients]
    rule = make(1.0)
    for got, want in zip(rule(gradients), expected):
        np.testing.assert_allclose(ops.convert_to_numpy(got), want, rtol=1e-5, atol=1e-7)
    result, reports = rule.aggregation(gradients).finish()
    assert float(ops.convert_to_numpy(reports["kept_fraction"])) == pytest.approx(kept.mean())
    for got, want in zip(result, expected):
        np.testing.assert_allclose(ops.convert_to_numpy(got), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", ["statistics", "materialized"])
def test_a_returned_report_reaches_the_logs(path):
    keras.utils.set_random_seed(0)
    network = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model = pergrad.PerExampleModel(network, BelowNorm(0.5), path=path)
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    history = model.fit(x, x[:, :3] * 3, batch_size=8, epochs=1, verbose=0)
    assert 0.0 <= history.history["kept_fraction"][0] <= 1.0


def test_an_undeclared_report_is_refused():
    class Undeclared(Aggregator):
        def aggregate(self, gradients):
            return Aggregation([ops.mean(g, axis=0) for g in gradients], reports={"x": 1.0})

    with pytest.raises(ValueError, match="'x' is not one of Undeclared.diagnostics"):
        Undeclared()(_gradients())


@pytest.mark.parametrize("make", [
    lambda: agg.chain(agg.clip(1.0), agg.norm_filter(drop_fraction=0.2), agg.krum(0.1)),
    lambda: dp_gaussian(1.0, 1.0, seed=1, diagnostics=True),
    lambda: adaptive_dp_gaussian(1.0, 1.1, expected_batch_size=6.0, count_stddev=2.0, seed=1),
    lambda: agg.centered_clip(0.5),
], ids=["chain", "dp_gaussian", "adaptive", "centered_clip"])
def test_no_call_leaves_anything_on_the_rule(make):
    """No channel to clear: a call that raised (or whose aggregation is never finished) leaves
    the rule as it was, and the rule carries no per-call attribute."""
    rule = make()
    rule.aggregation(_gradients())  # never finished: its term, totals and reports are dropped
    for name in ("report", "pop_reports", "set_batch_term", "pop_batch_term", "set_batch_totals",
                 "pop_batch_totals", "set_units", "pop_units"):
        assert not hasattr(rule, name), name
    assert not any(key in vars(rule) for key in ("_reports", "_batch_terms", "_batch_totals", "_units"))
    first = rule.aggregation(_gradients()).finish()[1]
    assert set(first) <= set(rule.diagnostics)


def test_a_chain_may_end_in_a_rule_that_is_no_step():
    """A chain's last rule is asked for no output batch size (norm_filter(factor=...) has none)."""
    rule = agg.chain(agg.clip(1.0), agg.norm_filter(factor=1.5))
    assert rule.min_batch_size == 1
    result, reports = rule.aggregation(_gradients()).finish()
    assert set(reports) == {"clipped_fraction", "rejected_fraction"}
    assert [tuple(r.shape) for r in result] == [(3,), (2, 2)]
