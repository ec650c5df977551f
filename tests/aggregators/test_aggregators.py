"""Every aggregator against an independent NumPy reference and closed forms, on the active backend."""

from __future__ import annotations

import itertools
import math

import keras
import numpy as np
import pytest
from keras import ops

from pergrad import aggregators as agg
from pergrad.aggregators import base, basic, clipping, robust

BACKEND = keras.backend.backend()
SHAPES = [(2, 3, 2), (5,)]


# -- data and helpers ------------------------------------------------------------------


def random_gradients(batch_size: int, seed: int = 0, shapes=SHAPES) -> list[np.ndarray]:
    """Per-example gradients whose norms spread over two orders of magnitude."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(size=batch_size))
    return [
        (rng.normal(size=(batch_size,) + shape) * scales.reshape((-1,) + (1,) * len(shape))).astype(
            "float32"
        )
        for shape in shapes
    ]


def tensors(gradients):
    return [ops.convert_to_tensor(np.asarray(g, "float32")) for g in gradients]


def numpy(values):
    return [np.asarray(ops.convert_to_numpy(v), dtype="float64") for v in values]


def run(aggregator, gradients):
    return numpy(aggregator(tensors(gradients)))


def reports_of(aggregator, gradients) -> dict:
    """The diagnostics of one call on ``gradients`` (the rule's Aggregation), as floats."""
    reports = aggregator.aggregation(tensors(gradients)).finish()[1]
    return {name: float(ops.convert_to_numpy(value)) for name, value in reports.items()}


def flatten(gradients):
    batch_size = gradients[0].shape[0]
    return np.concatenate([np.reshape(g, (batch_size, -1)) for g in gradients], axis=1).astype("float64")


def unflatten(vector, shapes):
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(np.reshape(vector[start : start + size], shape))
        start += size
    return out


def shapes_of(gradients):
    return [g.shape[1:] for g in gradients]


def assert_close(actual, expected, rtol=1e-4, atol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


# -- NumPy references: written independently, loops over examples and coordinates -------


def ref_mean(gs):
    return [np.mean(np.asarray(g, "float64"), axis=0) for g in gs]


def ref_sum(gs):
    return [np.sum(np.asarray(g, "float64"), axis=0) for g in gs]


def _per_coordinate(gs, rule):
    out = []
    for g in gs:
        columns = np.reshape(np.asarray(g, "float64"), (g.shape[0], -1))
        values = [rule(columns[:, c]) for c in range(columns.shape[1])]
        out.append(np.reshape(np.array(values), g.shape[1:]))
    return out


def ref_median(gs):
    return _per_coordinate(gs, np.median)


def ref_trimmed_mean(gs, trim):
    def rule(values):
        dropped = math.floor(trim * len(values))
        return np.mean(sorted(values)[dropped : len(values) - dropped])

    return _per_coordinate(gs, rule)


def ref_meamed(gs, byzantine):
    def rule(values):
        kept = len(values) - math.floor(byzantine * len(values))
        median = np.median(values)
        nearest = sorted(values, key=lambda v: abs(v - median))[:kept]
        return np.mean(nearest)

    return _per_coordinate(gs, rule)


def ref_sign_majority(gs):
    return _per_coordinate(gs, lambda values: np.sign(sum(np.sign(v) for v in values)))


def _scaled_mean(gs, scale_of_norm, per_layer):
    gs = [np.asarray(g, "float64") for g in gs]
    batch_size = gs[0].shape[0]
    out = [np.zeros(g.shape[1:]) for g in gs]
    for i in range(batch_size):
        flat_norm = np.sqrt(sum(np.sum(g[i] ** 2) for g in gs))
        for k, g in enumerate(gs):
            norm = np.sqrt(np.sum(g[i] ** 2)) if per_layer else flat_norm
            out[k] += scale_of_norm(norm) * g[i] / batch_size
    return out


def ref_clip(gs, l2_norm, per_layer=False):
    return _scaled_mean(gs, lambda n: min(1.0, l2_norm / n) if n > 0 else 1.0, per_layer)


def ref_automatic_clip(gs, gamma=0.01, per_layer=False):
    return _scaled_mean(gs, lambda n: 1.0 / (n + gamma) if n + gamma > 0 else 0.0, per_layer)


def ref_krum(gs, byzantine, select=1):
    points = flatten(gs)
    n = len(points)
    f = math.floor(byzantine * n)
    scores = []
    for i in range(n):
        distances = sorted(np.sum((points[i] - points[j]) ** 2) for j in range(n) if j != i)
        scores.append(sum(distances[: n - f - 2]))
    best = sorted(range(n), key=lambda i: scores[i])[:select]
    return unflatten(np.mean(points[best], axis=0), shapes_of(gs))


def ref_geometric_median(gs, max_iter=10, eps=1e-6):
    points = flatten(gs)
    z = points.mean(axis=0)
    for _ in range(max_iter):
        betas = [1.0 / max(eps, np.linalg.norm(p - z)) for p in points]
        z = sum(b * p for b, p in zip(betas, points)) / sum(betas)
    return unflatten(z, shapes_of(gs))


def ref_norm_filter(gs, factor=None, drop_fraction=None):
    points = flatten(gs)
    norms = [np.linalg.norm(p) for p in points]
    if factor is not None:
        kept = [i for i, norm in enumerate(norms) if norm <= factor * np.median(norms)]
    else:
        count = len(points) - math.floor(drop_fraction * len(points))
        kept = sorted(sorted(range(len(points)), key=lambda i: norms[i])[:count])
    return kept


def ref_norm_filter_mean(gs, **kwargs):
    kept = ref_norm_filter(gs, **kwargs)
    return unflatten(flatten(gs)[kept].mean(axis=0), shapes_of(gs))


def ref_centered_clip(gs, center, tau, iters=1):
    points = flatten(gs)
    v = flatten([c[None] for c in center])[0]
    for _ in range(iters):
        steps = []
        for p in points:
            norm = np.linalg.norm(p - v)
            steps.append((p - v) * min(1.0, tau / norm) if norm > 0 else p - v)
        v = v + np.mean(steps, axis=0)
    return unflatten(v, shapes_of(gs))


def ref_two_level(gs, groups, local, across):
    """``local`` on each contiguous group of ``ceil(B / groups)`` examples (the last ones
    smaller, empty ones skipped), ``across`` on the stacked group results."""
    batch_size = gs[0].shape[0]
    rows = math.ceil(batch_size / groups)
    results = [local([np.asarray(g, "float64")[start : start + rows] for g in gs])
               for start in range(0, batch_size, rows)]
    return across([np.stack([r[k] for r in results]) for k in range(len(gs))])


# Pre-processing references for chain: lists (B, ...) -> (B', ...).


def pre_clip(gs, l2_norm, per_layer=False):
    batch_size = gs[0].shape[0]
    out = [np.array(g, "float64") for g in gs]
    for i in range(batch_size):
        flat_norm = np.sqrt(sum(np.sum(g[i] ** 2) for g in out))
        norms = [np.sqrt(np.sum(g[i] ** 2)) if per_layer else flat_norm for g in out]
        for g, norm in zip(out, norms):
            g[i] *= min(1.0, l2_norm / norm)
    return out


def pre_automatic_clip(gs, gamma=0.01):
    points = flatten(gs)
    scaled = points / (np.linalg.norm(points, axis=1, keepdims=True) + gamma)
    return [np.stack([unflatten(p, shapes_of(gs))[k] for p in scaled]) for k in range(len(gs))]


def pre_norm_filter(gs, drop_fraction):
    kept = ref_norm_filter(gs, drop_fraction=drop_fraction)
    return [np.asarray(g, "float64")[kept] for g in gs]


# -- every rule against its reference ---------------------------------------------------

CASES = {
    "mean": (agg.mean, ref_mean),
    "sum": (agg.sum, ref_sum),
    "median": (agg.median, ref_median),
    "trimmed_mean_0.1": (lambda: agg.trimmed_mean(0.1), lambda g: ref_trimmed_mean(g, 0.1)),
    "trimmed_mean_0.25": (lambda: agg.trimmed_mean(0.25), lambda g: ref_trimmed_mean(g, 0.25)),
    "clip": (lambda: agg.clip(1.5), lambda g: ref_clip(g, 1.5)),
    "clip_per_layer": (lambda: agg.clip(0.8, per_layer=True), lambda g: ref_clip(g, 0.8, True)),
    "meamed_0.2": (lambda: agg.meamed(0.2), lambda g: ref_meamed(g, 0.2)),
    "meamed_0.3": (lambda: agg.meamed(0.3), lambda g: ref_meamed(g, 0.3)),
    "krum": (lambda: agg.krum(0.2), lambda g: ref_krum(g, 0.2)),
    "multi_krum": (lambda: agg.krum(0.1, select=3), lambda g: ref_krum(g, 0.1, 3)),
    "geometric_median": (agg.geometric_median, ref_geometric_median),
    "geometric_median_smoothed": (
        lambda: agg.geometric_median(max_iter=3, eps=0.5),
        lambda g: ref_geometric_median(g, 3, 0.5),
    ),
    "centered_clip": (
        lambda: agg.centered_clip(1.0, iters=3),
        lambda g: ref_centered_clip(g, [np.zeros(s) for s in shapes_of(g)], 1.0, 3),
    ),
    "sign_majority": (agg.sign_majority, ref_sign_majority),
    "norm_filter_factor": (
        lambda: agg.norm_filter(factor=1.5),
        lambda g: ref_norm_filter_mean(g, factor=1.5),
    ),
    "norm_filter_drop": (
        lambda: agg.norm_filter(drop_fraction=0.3),
        lambda g: ref_norm_filter_mean(g, drop_fraction=0.3),
    ),
    "automatic_clip": (agg.automatic_clip, ref_automatic_clip),
    "automatic_clip_per_layer": (
        lambda: agg.automatic_clip(0.0, per_layer=True),
        lambda g: ref_automatic_clip(g, 0.0, True),
    ),
    "chain_clip_krum": (
        lambda: agg.chain(agg.clip(2.0), agg.krum(0.2, select=2)),
        lambda g: ref_krum(pre_clip(g, 2.0), 0.2, 2),
    ),
    "chain_clip_per_layer_geometric_median": (
        lambda: agg.chain(agg.clip(1.0, per_layer=True), agg.geometric_median()),
        lambda g: ref_geometric_median(pre_clip(g, 1.0, True)),
    ),
    "chain_clip_clip_mean": (
        lambda: agg.chain(agg.clip(2.0), agg.clip(1.0, per_layer=True), agg.mean()),
        lambda g: ref_mean(pre_clip(pre_clip(g, 2.0), 1.0, True)),
    ),
    "chain_automatic_filter_meamed": (
        lambda: agg.chain(agg.automatic_clip(), agg.norm_filter(drop_fraction=0.25), agg.meamed(0.1)),
        lambda g: ref_meamed(pre_norm_filter(pre_automatic_clip(g), 0.25), 0.1),
    ),
    "bucketing_one": (lambda: agg.bucketing(1, agg.median()), ref_median),
    # B = 7: groups of 2, 2, 2, 1; B = 10: 3, 3, 3, 1.
    "two_level": (lambda: agg.two_level(4), lambda g: ref_two_level(g, 4, ref_median, ref_median)),
    # B = 7: 3, 3, 1; B = 10: 4, 4, 2.
    "two_level_trimmed_geometric": (
        lambda: agg.two_level(3, agg.trimmed_mean(0.25), agg.geometric_median()),
        lambda g: ref_two_level(g, 3, lambda x: ref_trimmed_mean(x, 0.25), ref_geometric_median),
    ),
}


@pytest.mark.parametrize("batch_size", [7, 10])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy_reference(name, batch_size):
    factory, reference = CASES[name]
    gradients = random_gradients(batch_size, seed=batch_size)
    assert_close(run(factory(), gradients), reference(gradients))


def test_references_tell_the_rules_apart():
    # Guards the test above: on this data no two rules' references coincide.
    gradients = random_gradients(10, seed=10)
    results = {name: flatten([r[None] for r in reference(gradients)])[0] for name, (_, reference) in
               CASES.items() if name not in ("bucketing_one",)}
    for (a, x), (b, y) in itertools.combinations(results.items(), 2):
        assert not np.allclose(x, y, rtol=1e-3, atol=1e-4), (a, b)


# -- closed forms ------------------------------------------------------------------------


def _equal_examples(batch_size=10):
    single = [np.random.default_rng(1).normal(size=s).astype("float32") for s in SHAPES]
    return single, [np.repeat(s[None], batch_size, axis=0) for s in single]


def _flat_norm(single):
    return float(np.sqrt(sum(np.sum(np.asarray(s, "float64") ** 2) for s in single)))


# What each rule returns when every example's gradient is the same g (norm about 3.9).
EQUAL_EXAMPLES = {
    "mean": (agg.mean, lambda g, b: g),
    "sum": (agg.sum, lambda g, b: [b * x for x in g]),
    "median": (agg.median, lambda g, b: g),
    "trimmed_mean": (lambda: agg.trimmed_mean(0.2), lambda g, b: g),
    "meamed": (lambda: agg.meamed(0.3), lambda g, b: g),
    "krum": (lambda: agg.krum(0.2, select=3), lambda g, b: g),
    "geometric_median": (agg.geometric_median, lambda g, b: g),
    "norm_filter": (agg.norm_filter, lambda g, b: g),
    "norm_filter_drop": (lambda: agg.norm_filter(drop_fraction=0.4), lambda g, b: g),
    "bucketing": (lambda: agg.bucketing(3, agg.median()), lambda g, b: g),
    "centered_clip_large_tau": (lambda: agg.centered_clip(100.0), lambda g, b: g),
    "clip_large": (lambda: agg.clip(100.0), lambda g, b: g),
    "clip_small": (lambda: agg.clip(0.5), lambda g, b: [0.5 * x / _flat_norm(g) for x in g]),
    "sign_majority": (agg.sign_majority, lambda g, b: [np.sign(x) for x in g]),
    "automatic_clip": (
        lambda: agg.automatic_clip(0.0),
        lambda g, b: [x / _flat_norm(g) for x in g],
    ),
    "chain": (
        lambda: agg.chain(agg.clip(1.0), agg.bucketing(2), agg.geometric_median()),
        lambda g, b: [x / _flat_norm(g) for x in g],
    ),
}


@pytest.mark.parametrize("name", list(EQUAL_EXAMPLES))
def test_equal_examples(name):
    factory, expected = EQUAL_EXAMPLES[name]
    single, gradients = _equal_examples()
    assert _flat_norm(single) > 1.0
    assert_close(run(factory(), gradients), expected([np.asarray(s, "float64") for s in single], 10))


def test_median_of_known_values():
    assert_close(run(agg.median(), [np.array([1.0, 5, 2, 8, 3])]), [np.array(3.0)])
    assert_close(run(agg.median(), [np.array([[1.0], [2], [3], [10]])]), [np.array([2.5])])


def test_trimmed_mean_drops_floor_of_trim_times_batch():
    values = np.array([0.0, 1, 2, 3, 4, 5, 6, 7, 8, 100])
    # floor(0.15 * 10) = 1 at each end: 0 and 100 go.
    assert_close(run(agg.trimmed_mean(0.15), [values]), [np.array(4.5)])
    # floor(0.19 * 5) = 0: nothing is dropped.
    assert_close(run(agg.trimmed_mean(0.19), [values[:4].tolist() + [100.0]]), [np.array(21.2)])
    # floor(0.2 * 5) = 1.
    assert_close(run(agg.trimmed_mean(0.2), [[0.0, 1, 2, 3, 100]]), [np.array(2.0)])


def test_meamed_of_known_values():
    # f = floor(0.2 * 5) = 1; the 4 values closest to the median 2 are 0, 1, 2, 3.
    assert_close(run(agg.meamed(0.2), [np.array([[100.0], [0], [2], [1], [3]])]), [np.array([1.5])])


def test_clip_of_one_huge_example():
    huge = [np.zeros((5, 2, 2), "float32"), np.zeros((5, 3), "float32")]
    huge[0][2] = 3e3
    huge[1][2] = -4e3
    norm = np.sqrt(4 * 9e6 + 3 * 16e6)
    result = run(agg.clip(2.0), huge)
    assert_close(result, [2.0 * h[2] / norm / 5 for h in huge])


def test_clip_per_layer_clips_each_variable_separately():
    gradients = [np.array([[3.0, 4.0]]), np.array([[0.3, 0.4]])]
    aggregator = agg.clip(1.0, per_layer=True)
    assert_close(run(aggregator, gradients), [np.array([0.6, 0.8]), np.array([0.3, 0.4])])
    assert reports_of(aggregator, gradients)["clipped_fraction"] == 0.5
    assert_close(run(agg.clip(1.0), gradients), [np.array([3.0, 4.0]) / 5.025, np.array([0.3, 0.4]) / 5.025],
                 rtol=1e-3)


def test_krum_never_selects_a_far_outlier():
    gradients = random_gradients(10, seed=3)
    gradients[0][6] += 1000.0
    inliers = [np.delete(g, 6, axis=0) for g in gradients]
    # Multi-Krum keeping all but one example keeps exactly the inliers.
    assert_close(run(agg.krum(0.2, select=9), gradients), [g.mean(axis=0) for g in inliers])
    single = run(agg.krum(0.2), gradients)
    chosen = flatten([s[None] for s in single])[0]
    matches = [i for i, point in enumerate(flatten(gradients)) if np.allclose(chosen, point)]
    assert len(matches) == 1 and matches[0] != 6


def test_geometric_median_of_symmetric_points_is_the_center():
    rng = np.random.default_rng(4)
    center = rng.normal(size=6)
    offsets = rng.normal(size=(4, 6)) * 3
    points = np.concatenate([center + offsets, center - offsets]).astype("float32")
    gradients = [points[:, :4], points[:, 4:].reshape(8, 2, 1)]
    assert_close(run(agg.geometric_median(), gradients), [center[:4], center[4:].reshape(2, 1)])


def test_geometric_median_of_collinear_points_is_the_middle_one():
    direction = np.array([0.6, 0.8])
    points = np.array([0.0, 1, 2, 10, 50])[:, None] * direction
    result = run(agg.geometric_median(max_iter=100, eps=1e-8), [points.astype("float32")])
    assert_close(result, [2 * direction], atol=1e-4)


def test_sign_majority_of_known_signs():
    values = np.array([[1.0, -2, 0, 1], [3, -1, 5, -1], [-4, -6, 0, 0]])
    assert_close(run(agg.sign_majority(), [values]), [np.array([1.0, -1, 1, 0])])


def test_norm_filter_rejects_the_outlier_and_reports_it():
    gradients = [np.array([[1.0, 0], [0, 1], [-1, 0], [30, 40]])]
    aggregator = agg.norm_filter(factor=3.0)
    assert_close(run(aggregator, gradients), [np.array([0.0, 1 / 3])])
    assert reports_of(aggregator, gradients)["rejected_fraction"] == 0.25


def test_automatic_clip_normalizes():
    gradients = [np.array([[3.0, 4.0], [0.0, 0.0]]), np.array([[0.0], [2.0]])]
    assert_close(
        run(agg.automatic_clip(gamma=0.0), gradients),
        [np.array([0.3, 0.4]), np.array([0.5])],
    )
    assert_close(
        run(agg.automatic_clip(gamma=1.0, per_layer=True), gradients),
        [np.array([3 / 12, 4 / 12]), np.array([2 / 6])],
    )


def test_centered_clip_moves_at_most_tau():
    gradients = [np.array([[30.0, 40.0], [30.0, 40.0]])]
    aggregator = agg.centered_clip(tau=2.0)
    assert_close(run(aggregator, gradients), [np.array([1.2, 1.6])])
    assert_close(run(aggregator, gradients), [np.array([2.4, 3.2])])  # starts from the kept center


def test_bucketing_averages_a_random_partition():
    batch_size, size = 10, 2
    gradients = random_gradients(batch_size, seed=5)
    seen = []

    def capture(bucket_means):
        seen.append(numpy(bucket_means))
        return [ops.mean(b, axis=0) for b in bucket_means]

    aggregator = agg.bucketing(size, agg.FunctionAggregator(capture))
    result = run(aggregator, gradients)
    means = seen[0]
    assert means[0].shape[0] == batch_size // size
    points = flatten(gradients)
    used = set()
    for mean in flatten(means):
        pairs = [p for p in itertools.combinations(range(batch_size), size)
                 if np.allclose(points[list(p)].mean(axis=0), mean, atol=1e-5)]
        assert len(pairs) == 1
        used.update(pairs[0])
    assert used == set(range(batch_size))  # a partition of the batch
    assert_close(result, ref_mean(gradients))
    run(aggregator, gradients)
    assert not np.allclose(flatten(seen[0]), flatten(seen[1]))  # a new permutation each call


def test_bucketing_with_a_partial_last_bucket():
    gradients = random_gradients(7, seed=7)
    seen = []

    def capture(bucket_means):
        seen.append(numpy(bucket_means))
        return [b[0] for b in bucket_means]

    run(agg.bucketing(3, agg.FunctionAggregator(capture)), gradients)
    # Buckets of 3, 3 and 1 (the last): each bucket's mean over its own members.
    means = flatten(seen[0])
    points = flatten(gradients)
    assert means.shape[0] == 3
    np.testing.assert_allclose(3 * means[0] + 3 * means[1] + means[2], points.sum(axis=0), atol=1e-4)
    assert any(np.allclose(means[2], p, atol=1e-5) for p in points)


@pytest.mark.parametrize(
    "batch_size, groups, sizes",
    [(5, 2, [3, 2]), (7, 4, [2, 2, 2, 1]), (5, 4, [2, 2, 1]), (13, 4, [4, 4, 4, 1]), (4, 3, [2, 2])],
)
def test_two_level_groups_split_as_tf_distribute(batch_size, groups, sizes):
    # tf.distribute's split of a global batch over R replicas (checked on TF 2.21 for
    # B = 1..13, R = 2, 3, 4): ceil(B / R) rows each, in order; empty groups skipped.
    gradients = random_gradients(batch_size, seed=batch_size)
    seen, rows = [], []

    def local(group):
        seen.append(numpy(group))
        return [ops.max(g, axis=0) for g in group]

    def across(results):
        rows.append(numpy(results))
        return [ops.sum(r, axis=0) for r in results]

    result = run(agg.two_level(groups, local, across), gradients)
    assert [len(group[0]) for group in seen] == sizes
    start = 0
    for group, size in zip(seen, sizes):  # contiguous, in order
        assert_close(group, [np.asarray(g[start : start + size], "float64") for g in gradients])
        start += size
    assert len(rows[0][0]) == len(sizes)
    assert_close(result, [sum(np.max(g[a : a + n], axis=0) for a, n in zip(np.cumsum([0] + sizes), sizes))
                          for g in gradients])


def test_two_level_closed_forms():
    gradients = random_gradients(10, seed=3)
    # One group: the local rule (across one row is that row).
    assert_close(run(agg.two_level(1, agg.trimmed_mean(0.2), agg.median()), gradients),
                 ref_trimmed_mean(gradients, 0.2))
    # B groups of one example: the across rule over the examples, whatever the local rule.
    assert_close(run(agg.two_level(10, agg.trimmed_mean(0.3), agg.krum(0.2)), gradients),
                 ref_krum(gradients, 0.2))
    # A median of medians, not the median: the two rules differ on this batch.
    assert not np.allclose(flatten([r[None] for r in run(agg.two_level(2), gradients)]),
                           flatten([r[None] for r in ref_median(gradients)]), atol=1e-3)
    # One corrupted group out of five is one bad row of the across median.
    corrupted = [g.copy() for g in gradients]
    for g in corrupted:
        g[:2] = 1e6
    clean = run(agg.two_level(5), gradients)
    assert max(float(np.max(np.abs(c))) for c in run(agg.two_level(5), corrupted)) < 10
    assert max(float(np.max(np.abs(c))) for c in clean) < 10


def test_two_level_refuses_bad_arguments():
    from pergrad import privacy

    for groups in (0, -1, 2.5, True, "2", None):
        with pytest.raises(ValueError, match="two_level: groups must be a positive integer"):
            agg.two_level(groups)
    with pytest.raises(ValueError, match="Unknown aggregator 'medain'"):
        agg.two_level(2, "medain")
    for stateful in (agg.centered_clip(1.0), agg.bucketing(2, agg.median())):
        with pytest.raises(ValueError, match="local rule .* keeps state"):
            agg.two_level(2, stateful)
    agg.two_level(2, across=agg.centered_clip(1.0))  # state across the groups: allowed
    with pytest.raises(ValueError, match="Krum needs 3 rows and gets at most groups=2"):
        agg.two_level(2, across=agg.krum(0.2))
    for where in ("local", "across"):
        with pytest.raises(ValueError, match=r"cannot be used inside two_level\(\.\.\.\)"):
            agg.two_level(2, **{where: privacy.dp_gaussian(1.0, 1.0)})
    # Krum(0.2) needs 3 examples per group: 9 examples in 4 groups (3, 3, 3) do, 8 and
    # 10 (3, 3, 3, 1) do not.
    rule = agg.two_level(4, agg.krum(0.2))
    assert rule.min_batch_size == 9
    run(rule, random_gradients(9, shapes=[(3,)]))
    for batch_size in (8, 10):
        with pytest.raises(ValueError, match=r"groups of \[3, 3, 3, 1\]|needs a batch of at least 9"):
            run(rule, random_gradients(batch_size, shapes=[(3,)]))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="only TensorFlow traces unknown batch sizes")
def test_two_level_checks_groups_at_run_time_for_unknown_batch_sizes():
    import tensorflow as tf

    rule = agg.two_level(4, agg.krum(0.2))
    graph = tf.function(lambda g: rule([g]), input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    graph(tensors(random_gradients(9, shapes=[(3,)]))[0])  # 3, 3, 3
    with pytest.raises(tf.errors.InvalidArgumentError, match="Krum needs 3 examples"):
        graph(tensors(random_gradients(10, shapes=[(3,)]))[0])  # 3, 3, 3, 1
    across = agg.two_level(4, agg.median(), agg.krum(0.2))  # Krum needs 3 groups
    graph = tf.function(lambda g: across([g]), input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    graph(tensors(random_gradients(3, shapes=[(3,)]))[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-empty groups"):
        graph(tensors(random_gradients(2, shapes=[(3,)]))[0])


def test_two_level_trains_as_the_batch_of_one_oracle():
    import oracle
    import pergrad
    import problems

    problem = problems.dense_mlp(batch=7)
    problem.compile(optimizer=keras.optimizers.SGD(0.5))
    initial = problem.model.get_weights()
    per_example = oracle.batch_of_one_gradients(problem.model, problem.x, problem.y, problem.sample_weight)
    expected = ref_two_level(per_example, 4, ref_median, lambda x: ref_trimmed_mean(x, 0.25))
    model = pergrad.PerExampleModel(problem.model, agg.two_level(4, across=agg.trimmed_mean(0.25)))
    problem.compile(model, optimizer=keras.optimizers.SGD(0.5))
    model.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=7, epochs=1,
              shuffle=False, verbose=0)
    for weight, start, step in zip(problem.model.get_weights(), initial, expected):
        np.testing.assert_allclose(weight, start - 0.5 * step, atol=1e-5)


# -- kinds, names, diagnostics, configs, batch sizes --------------------------------------

KINDS = {
    "mean": base.STATISTICS,
    "sum": base.STATISTICS,
    "median": base.COORDINATE,
    "trimmed_mean_0.1": base.COORDINATE,
    "clip": base.STATISTICS,
    "clip_per_layer": base.STATISTICS,
    "meamed_0.2": base.COORDINATE,
    "krum": base.STATISTICS,
    "geometric_median": base.STATISTICS,
    "centered_clip": base.ARBITRARY,
    "sign_majority": base.COORDINATE,
    "norm_filter_factor": base.STATISTICS,
    "norm_filter_drop": base.STATISTICS,
    "automatic_clip": base.STATISTICS,
    "chain_clip_krum": base.STATISTICS,
    "chain_clip_per_layer_geometric_median": base.ARBITRARY,
    "chain_clip_clip_mean": base.STATISTICS,
    "chain_automatic_filter_meamed": base.COORDINATE,  # its final rule's kind
    "bucketing_one": base.ARBITRARY,
    "two_level": base.ARBITRARY,
    "two_level_trimmed_geometric": base.ARBITRARY,
}


@pytest.mark.parametrize("name", list(KINDS))
def test_declared_kind(name):
    aggregator = CASES[name][0]()
    assert aggregator.kind == KINDS[name]
    if aggregator.kind == base.STATISTICS:
        assert isinstance(aggregator, base.WeightedAggregator)
    if aggregator.kind == base.COORDINATE:
        assert isinstance(aggregator, base.CoordinateAggregator)


def test_statistics_chain_uses_only_statistics():
    # A statistics-kind chain gives its result as weights from norms and the Gram matrix.
    gradients = random_gradients(10, seed=2)
    aggregator = agg.chain(agg.clip(2.0), agg.krum(0.2, select=2))
    stats = base.ExampleStatistics.from_gradients(tensors(gradients), gram=aggregator.needs_gram)
    weights = aggregator.example_weights(stats)
    result = numpy(base.weighted_sum(tensors(gradients), weights))
    assert_close(result, ref_krum(pre_clip(gradients, 2.0), 0.2, 2))


NAMES = {
    "meamed": robust.MeaMed,
    "krum": robust.Krum,
    "geometric_median": robust.GeometricMedian,
    "sign_majority": robust.SignMajority,
    "norm_filter": robust.NormFilter,
    "automatic_clip": clipping.AutomaticClip,
    "median": basic.Median,
    "trimmed_mean": basic.TrimmedMean,
}


@pytest.mark.parametrize("name", list(NAMES))
def test_get_by_name(name):
    assert type(agg.get(name)) is NAMES[name]


def test_diagnostics():
    gradients = random_gradients(10, seed=10)
    expected_rejected = 1 - len(ref_norm_filter(gradients, factor=1.5)) / 10
    aggregator = agg.chain(agg.clip(1.0), agg.norm_filter(drop_fraction=0.2), agg.krum(0.1, select=2))
    assert aggregator.diagnostics == ("clipped_fraction", "rejected_fraction", "selected_fraction")
    reports = reports_of(aggregator, gradients)
    norms = np.linalg.norm(flatten(gradients), axis=1)
    assert reports == pytest.approx(
        {"clipped_fraction": np.mean(norms > 1.0), "rejected_fraction": 0.2, "selected_fraction": 2 / 8}
    )
    single = agg.norm_filter(factor=1.5)
    assert reports_of(single, gradients)["rejected_fraction"] == pytest.approx(expected_rejected)
    assert 0 < expected_rejected < 1
    twice = agg.chain(agg.clip(1.0), agg.clip(2.0), agg.mean())
    assert twice.diagnostics == ("step0_clipped_fraction", "step1_clipped_fraction")
    assert set(reports_of(twice, gradients)) == set(twice.diagnostics)
    wrapped = agg.bucketing(2, agg.krum(0.1))
    assert set(reports_of(wrapped, gradients)) == {"selected_fraction"}


@pytest.mark.parametrize("name", list(CASES))
def test_config_round_trip(name):
    aggregator = CASES[name][0]()
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(aggregator))
    assert type(restored) is type(aggregator)
    assert restored.get_config() == aggregator.get_config()
    again = type(aggregator).from_config(aggregator.get_config())
    assert again.get_config() == aggregator.get_config()
    gradients = random_gradients(10, seed=9)
    assert_close(run(restored, gradients), run(aggregator, gradients))


def test_invalid_arguments():
    for make in (
        lambda: agg.meamed(0.5),
        lambda: agg.krum(-0.1),
        lambda: agg.krum(select=0),
        lambda: agg.geometric_median(max_iter=0),
        lambda: agg.centered_clip(0.0),
        lambda: agg.norm_filter(factor=0.5),
        lambda: agg.norm_filter(factor=2.0, drop_fraction=0.1),
        lambda: agg.automatic_clip(-1.0),
        lambda: agg.bucketing(0, agg.mean()),
        lambda: agg.chain(),
    ):
        with pytest.raises(ValueError):
            make()


def test_chain_rejects_steps_that_cannot_preprocess():
    with pytest.raises(ValueError, match="Median cannot be a pre-processing step"):
        agg.chain(agg.median(), agg.mean())
    with pytest.raises(ValueError, match="NormFilter"):
        agg.chain(agg.norm_filter(factor=2.0), agg.mean())
    with pytest.raises(ValueError, match="Bucketing"):
        agg.chain(agg.bucketing(2, agg.mean()), agg.mean())
    with pytest.raises(TypeError, match="pre-processing step"):
        agg.bucketing(2)(tensors(random_gradients(4)))


@pytest.mark.parametrize(
    "make, minimum, rule",
    [
        (lambda: agg.krum(0.4), 4, "Krum"),  # n - floor(0.4 n) - 2 >= 1 first holds at n = 4
        (lambda: agg.krum(0.1, select=6), 6, "Krum"),
        (lambda: agg.bucketing(3, agg.krum(0.4)), 10, "Bucketing"),  # ceil(B / 3) >= 4
        (lambda: agg.chain(agg.norm_filter(drop_fraction=0.5), agg.krum(0.2)), 5, "Chain"),
    ],
)
def test_batch_size_requirements(make, minimum, rule):
    aggregator = make()
    assert aggregator.min_batch_size == minimum
    with pytest.raises(ValueError, match=rf"{rule}\) needs a batch of at least {minimum}"):
        aggregator(tensors(random_gradients(minimum - 1, shapes=[(3,)])))


def test_krum_at_its_smallest_batch():
    # B = 4, f = floor(0.4 * 4) = 1: one neighbour each; the closest pair wins.
    points = np.array([[0.0, 0], [0.1, 0], [5, 5], [-7, 3]])
    assert_close(run(agg.krum(0.4, select=2), [points]), [np.array([0.05, 0.0])])


# -- compiled as in fit: one jax.jit (state carried explicitly), or one tf.function -----


@pytest.mark.skipif(BACKEND == "torch", reason="the torch train step runs eagerly")
def test_every_rule_compiled():
    """Every rule inside one compiled function, as the train step runs it.

    JAX: under ``jax.jit`` in a ``StatelessScope`` holding the rules' state (the
    stateless train step). TensorFlow: a ``tf.function`` with an unknown batch
    size, as TensorFlow retraces a partial last batch.
    """
    gradients = random_gradients(10, seed=10)
    shapes = [(None,) + g.shape[1:] for g in gradients]
    aggregators = {name: factory() for name, (factory, _) in CASES.items()}
    for aggregator in aggregators.values():
        aggregator.build(shapes)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        signature = [[tf.TensorSpec(shape, tf.float32) for shape in shapes]]
        graph = tf.function(lambda gs: {n: a(gs) for n, a in aggregators.items()}, input_signature=signature)
        results = graph(tensors(gradients))
    else:
        import jax

        variables = [v for aggregator in aggregators.values() for v in aggregator.variables]

        def step(values, gs):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
                finished = {n: a.aggregation(gs).finish() for n, a in aggregators.items()}
                out = {n: result for n, (result, _) in finished.items()}
                reports = {n: reports for n, (_, reports) in finished.items()}
                return out, [scope.get_current_value(v) for v in variables], reports

        results, values, reports = jax.jit(step)([v.value for v in variables], tensors(gradients))
        for name, aggregator in aggregators.items():
            assert set(reports[name]) == set(aggregator.diagnostics), name
        changed = [v.path for v, value in zip(variables, values) if value is not None]
        assert any("center" in path for path in changed) and any("seed" in path for path in changed)
    for name, (_, reference) in CASES.items():
        try:
            assert_close(numpy(results[name]), reference(gradients))
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
