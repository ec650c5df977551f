"""What rules declare to the engine, and that a user's subclass inherits it.

The engine and the replica policy ask the rule (``distribution``, ``reads_statistics``,
``in_protocol_form``, ``steps_and_rule``, ``mixes_examples``) instead of checking
concrete classes: a subclass of ``Clip`` or ``Mean`` takes its parent's path and
aggregates each replica's shard as its parent does.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
import problems
from pergrad import aggregators as agg
from pergrad import privacy
from pergrad.aggregators.base import LOCAL_MEAN, LOCAL_SUM, WHOLE_BATCH, WeightedAggregator
from pergrad.aggregators.basic import Clip, Mean, Median, Sum
from pergrad.aggregators.clipping import AutomaticClip
from pergrad.aggregators.robust import Krum
from pergrad.engine import chunked, statistics, streaming
from pergrad.training import step


class MyClip(Clip):
    """A user's clipping rule that only renames its parent."""


class MyMean(Mean):
    pass


class MySum(Sum):
    pass


class MyAutomaticClip(AutomaticClip):
    pass


class MyDPGaussian(privacy.DPGaussian):
    pass


class MyMedian(Median):
    pass


class MyKrum(Krum):
    pass


# Each built-in rule's replica policy: LOCAL_MEAN (each replica aggregates its shard,
# scaled by B_r / B), LOCAL_SUM (its shard, summed as is) or WHOLE_BATCH (gathered).
BUILT_IN = {
    "mean": (agg.mean, LOCAL_MEAN),
    "sum": (agg.sum, LOCAL_SUM),
    "clip": (lambda: agg.clip(1.0), LOCAL_MEAN),
    "clip_per_layer": (lambda: agg.clip(1.0, per_layer=True), LOCAL_MEAN),
    "automatic_clip": (agg.automatic_clip, LOCAL_MEAN),
    "dp_gaussian": (lambda: privacy.dp_gaussian(1.0, 1.0), LOCAL_MEAN),
    "dp_gaussian_expected": (lambda: privacy.dp_gaussian(1.0, 1.0, expected_batch_size=8.0), LOCAL_SUM),
    "chain_clip_mean": (lambda: agg.chain(agg.clip(1.0), agg.mean()), LOCAL_MEAN),
    "chain_clip_sum": (lambda: agg.chain(agg.automatic_clip(), agg.sum()), LOCAL_SUM),
    "chain_clip_krum": (lambda: agg.chain(agg.clip(1.0), agg.krum(0.2)), WHOLE_BATCH),
    "chain_filter_mean": (lambda: agg.chain(agg.norm_filter(drop_fraction=0.2), agg.mean()), WHOLE_BATCH),
    "chain_bucketing_mean": (lambda: agg.chain(agg.bucketing(2), agg.mean()), WHOLE_BATCH),
    "chain_clip_median": (lambda: agg.chain(agg.clip(1.0), agg.median()), WHOLE_BATCH),
    "median": (agg.median, WHOLE_BATCH),
    "trimmed_mean": (agg.trimmed_mean, WHOLE_BATCH),
    "meamed": (agg.meamed, WHOLE_BATCH),
    "sign_majority": (agg.sign_majority, WHOLE_BATCH),
    "krum": (agg.krum, WHOLE_BATCH),
    "geometric_median": (agg.geometric_median, WHOLE_BATCH),
    "norm_filter": (agg.norm_filter, WHOLE_BATCH),
    "centered_clip": (lambda: agg.centered_clip(1.0), WHOLE_BATCH),
    "bucketing": (lambda: agg.bucketing(2, agg.median()), WHOLE_BATCH),
    "two_level": (lambda: agg.two_level(2), WHOLE_BATCH),
    "function": (lambda: agg.get(lambda grads: [g[0] for g in grads]), WHOLE_BATCH),
    "per_variable": (lambda: agg.per_variable(lambda g: g[0]), WHOLE_BATCH),
}


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_each_built_in_rule_declares_its_replica_policy(name):
    make, expected = BUILT_IN[name]
    assert make().distribution == expected


SUBCLASSES = {
    "clip": (lambda: agg.clip(1.0), lambda: MyClip(1.0)),
    "clip_per_layer": (lambda: agg.clip(1.0, per_layer=True), lambda: MyClip(1.0, per_layer=True)),
    "mean": (agg.mean, MyMean),
    "sum": (agg.sum, MySum),
    "automatic_clip": (agg.automatic_clip, MyAutomaticClip),
    "dp_gaussian": (lambda: privacy.dp_gaussian(1.0, 1.0), lambda: MyDPGaussian(1.0, 1.0)),
    "dp_gaussian_expected": (
        lambda: privacy.dp_gaussian(1.0, 1.0, expected_batch_size=8.0),
        lambda: MyDPGaussian(1.0, 1.0, expected_batch_size=8.0),
    ),
    "median": (agg.median, MyMedian),
    "krum": (agg.krum, MyKrum),
    "chain_my_clip_median": (
        lambda: agg.chain(agg.clip(1.0), agg.median()), lambda: agg.chain(MyClip(1.0), MyMedian())
    ),
    "chain_my_clip_mean": (
        lambda: agg.chain(agg.clip(1.0), agg.mean()), lambda: agg.chain(MyClip(1.0), MyMean())
    ),
}


def _decisions(rule):
    """Everything the engine decides from the rule alone."""
    streamed = streaming.plan(rule)
    return {
        "distribution": rule.distribution,
        "reads_statistics": getattr(rule, "reads_statistics", None),
        "chunked": chunked.supports(rule),
        "streamed": None if streamed is None else (len(streamed[0]), streamed[1].kind),
        "paths": [step.engine_path(rule, path, m) for path in ("auto", "statistics") for m in (None, 3)],
    }


@pytest.mark.parametrize("name", sorted(SUBCLASSES))
def test_a_user_subclass_takes_its_parents_path_and_replica_policy(name):
    parent, child = SUBCLASSES[name]
    assert _decisions(child()) == _decisions(parent())


def test_a_subclass_of_mean_takes_keras_own_batch_gradient(monkeypatch):
    """Mean's and sum's fast path (one ordinary backward pass) is theirs by declaration
    (``reads_statistics = False``), not by class: a subclass gets it, with mean's result."""
    calls = []
    original = statistics._batch_loss_gradient

    def counted(problem, aggregator, *args):
        calls.append(type(aggregator))
        return original(problem, aggregator, *args)

    monkeypatch.setattr(statistics, "_batch_loss_gradient", counted)
    weights = []
    for rule in (Mean(), MyMean(), Sum(), MySum()):
        problem = problems.dense_mlp()
        model = pergrad.PerExampleModel(problem.model, rule)
        problem.compile(model)
        model.fit(problem.x, problem.y, batch_size=problems.BATCH, epochs=1, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    assert set(calls) == {Mean, MyMean, Sum, MySum}
    for a, b in zip(weights[0], weights[1]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(weights[2], weights[3]):
        np.testing.assert_array_equal(a, b)


def test_a_subclass_that_overrides_a_method_takes_the_path_of_what_it_computes():
    class OwnAggregate(Median):
        def aggregate(self, gradients):
            return [keras.ops.max(g, axis=0) for g in gradients]

    class OwnPreprocess(Clip):
        def preprocess(self, gradients):
            return [g * 2.0 for g in gradients]

    class OwnRowMap(Clip):
        def row_map(self, stats, batch_size):
            return super().row_map(stats, batch_size)

    assert streaming.plan(agg.median()) is not None
    assert streaming.plan(OwnAggregate()) is None  # not aggregate_variable on each variable
    assert streaming.plan(agg.chain(OwnPreprocess(1.0), agg.median())) is None  # not its row map
    # Its preprocess is still its (own) row map applied.
    assert streaming.plan(agg.chain(OwnRowMap(1.0), agg.median())) is not None


def test_uniform_weights_must_say_how_they_split():
    with pytest.raises(TypeError, match="reads_statistics = False"):

        class Uniform(WeightedAggregator):  # noqa: F841 - raises at definition
            reads_statistics = False

    class UniformMean(WeightedAggregator):
        reads_statistics = False
        distribution = LOCAL_MEAN

    assert not UniformMean().reads_statistics
