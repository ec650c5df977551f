"""The replica policy without devices: what rules hand the distributed layer (sums and
counts, a batch term, groups' results) combines into the whole batch's result.

Each test splits one batch into shards, runs the rule on each as a replica would, and
combines the parts as ``pergrad.training.step`` and ``pergrad.distributed.replicas`` do, against the rule
on the whole batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from keras import ops

from pergrad import aggregators
from pergrad.aggregators.compose import group_sizes
from pergrad.privacy import dp_gaussian

SHAPES = [(3, 2), (4,)]


def _gradients(batch_size, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(size=(batch_size,)))
    return [(rng.normal(size=(batch_size,) + s) * scales.reshape((-1,) + (1,) * len(s))).astype("float32")
            for s in SHAPES]


def _tensors(gradients, start=0, stop=None):
    return [ops.convert_to_tensor(g[start:stop]) for g in gradients]


def _summing_over(shards_parts):
    """A stand-in for ``replicas.global_sum`` over replicas whose stacked parts are known."""
    return lambda parts: parts + sum(ops.convert_to_tensor(p) for p in shards_parts)


def _merged_reports(make, gradients, split):
    """Diagnostics of replica 0 (rows ``[:split]``) merged with replica 1's (``[split:]``)."""
    other, seen = make(), []
    other.aggregation(_tensors(gradients, split)).finish(total=lambda parts: seen.append(parts) or parts)
    first = make()
    return first.aggregation(_tensors(gradients, 0, split)).finish(total=_summing_over(seen))[1]


@pytest.mark.parametrize("make", [
    lambda: aggregators.clip(1.0),
    lambda: aggregators.clip(0.8, per_layer=True),
    lambda: dp_gaussian(1.0, 0.0, expected_batch_size=6.0, diagnostics=True),
], ids=["clip", "clip_per_layer", "dp_gaussian"])
def test_reported_sums_and_counts_merge_into_the_whole_batch_diagnostics(make):
    gradients = _gradients(7)
    for g in gradients:
        g[5] = 0.0  # a padding row: dp_gaussian leaves it out of its counts
    whole = make().aggregation(_tensors(gradients)).finish()[1]
    expected = {k: float(ops.convert_to_numpy(v)) for k, v in whole.items()}
    merged = {k: float(ops.convert_to_numpy(v)) for k, v in _merged_reports(make, gradients, 4).items()}
    assert sorted(merged) == sorted(expected) and expected
    for name in expected:
        assert merged[name] == pytest.approx(expected[name], rel=1e-6), name
    # The merged value is not either shard's own (3 of 4 and 1 of 3 rows clipped, say).
    alone = make().aggregation(_tensors(gradients, 0, 4)).finish()[1]
    own = {k: float(ops.convert_to_numpy(v)) for k, v in alone.items()}
    assert any(own[name] != pytest.approx(expected[name]) for name in expected), (own, expected)


def test_the_noise_is_a_batch_term_added_once():
    gradients = _tensors(_gradients(6))
    noisy = dp_gaussian(1.0, 1.5, seed=3)(gradients)
    outcome = dp_gaussian(1.0, 1.5, seed=3).aggregation(gradients)
    clean, term = outcome.gradients, outcome.batch_term
    for n, c, t in zip(noisy, clean, term):
        np.testing.assert_array_equal(ops.convert_to_numpy(n), ops.convert_to_numpy(c + t))
        assert float(np.max(np.abs(ops.convert_to_numpy(t)))) > 0
    assert aggregators.clip(1.0).aggregation(gradients).batch_term is None  # rules without one


@pytest.mark.parametrize("batch, groups", [(6, 2), (5, 4)], ids=["even", "an_empty_group"])
def test_groups_results_combine_into_the_two_level_result(batch, groups):
    rule = aggregators.two_level(groups, local="median", across="mean")
    sizes = tuple(group_sizes(batch, groups))  # as tf.distribute splits the batch
    assert 0 in sizes or batch == 6
    gradients = _gradients(batch, seed=1)
    expected = rule(_tensors(gradients))
    starts = np.cumsum((0,) + sizes)
    groups = [rule.aggregate_group(_tensors(gradients, a, b)) for a, b in zip(starts[:-1], starts[1:])]
    rows = [ops.stack([g[k] for g in groups]) for k in range(len(SHAPES))]
    combined = rule.combine_groups(rows, ops.convert_to_tensor(np.array(sizes, "int32"))).finish()[0]
    assert rule.group_count() == len(sizes) and aggregators.median().group_count() is None
    for c, e in zip(combined, expected):
        np.testing.assert_allclose(ops.convert_to_numpy(c), ops.convert_to_numpy(e), rtol=1e-6, atol=1e-7)
