"""A finite per-example gradient whose squared norm overflows float32.

One example of a batch of 8 has a gradient of norm ~1e19-1e20: finite, but its squared
norm is not (float32 stops at 3.4e38). The rule meant to bound large examples must bound
this one too: clipping scales it to norm C (it used to get factor 0 and vanish, or make
the update NaN), Krum and the norm filter keep it out, the geometric median gives it no
weight. References in float64 (NumPy), on every engine path.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/aggregators/test_overflow.py``.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import pergrad
from pergrad import aggregators as agg
from pergrad import privacy

BATCH, FEATURES, CLASSES, C = 8, 5, 3, 1.0
GIANT = 2  # the example whose squared norm overflows


def _case(kind):
    """``(x, y, loss, W, b, per-example gradients in float64)`` of a Dense(3) model.

    ``"input"``: a 3e19 input feature, softmax cross-entropy (output gradients at most 1);
    ``"target"``: a -3e19 regression target, mean squared error (output gradient ~2e19).
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    kernel = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    bias = np.zeros(CLASSES, "float32")
    logits = x.astype(np.float64) @ kernel + bias
    if kind == "input":
        x[GIANT, 0] = 3e19
        y = rng.integers(0, CLASSES, BATCH)
        logits = x.astype(np.float64) @ kernel + bias
        p = np.exp(logits - logits.max(1, keepdims=True))
        delta = p / p.sum(1, keepdims=True) - np.eye(CLASSES)[y]
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        y = rng.normal(size=(BATCH, CLASSES)).astype("float32")
        y[GIANT] = -3e19
        delta = 2.0 * (logits - y.astype(np.float64)) / CLASSES
        loss = "mse"
    grads = [x.astype(np.float64)[:, :, None] * delta[:, None, :], delta]
    return x, y, loss, kernel, bias, grads


def _flat(grads):
    return np.concatenate([g.reshape(BATCH, -1) for g in grads], axis=1)


def _scaled(grads, factors):
    """Example i's gradient times ``factors[i]`` (``(B,)``) or ``factors[i, k]`` (``(B, V)``)."""
    factors = np.asarray(factors, np.float64)
    columns = [factors if factors.ndim == 1 else factors[:, k] for k in range(len(grads))]
    return [g * f.reshape(-1, *([1] * (g.ndim - 1))) for g, f in zip(grads, columns)]


def _mean(grads, weights=None):
    weights = np.full(BATCH, 1.0 / BATCH) if weights is None else np.asarray(weights)
    return [np.tensordot(weights, g, axes=1) for g in grads]


def _norms(grads, per_layer):
    if per_layer:
        return np.stack([np.linalg.norm(g.reshape(BATCH, -1), axis=1) for g in grads], axis=1)
    return np.linalg.norm(_flat(grads), axis=1)


def clip_reference(grads, threshold=C, per_layer=False):
    return _mean(_scaled(grads, np.minimum(1.0, threshold / _norms(grads, per_layer))))


def automatic_clip_reference(grads, gamma=0.01, per_layer=False):
    return _mean(_scaled(grads, 1.0 / (_norms(grads, per_layer) + gamma)))


def norm_filter_reference(grads, factor=None, drop=None):
    norms = _norms(grads, False)
    if factor is not None:
        kept = norms <= factor * np.median(norms)
    else:
        kept = np.argsort(np.argsort(norms, kind="stable"), kind="stable") < BATCH - math.floor(drop * BATCH)
    return _mean(grads, kept / kept.sum())


def krum_reference(grads, byzantine):
    flat = _flat(grads)
    f = math.floor(byzantine * BATCH)
    distances = ((flat[:, None] - flat[None]) ** 2).sum(-1)
    scores = [np.sort(np.delete(distances[i], i))[: BATCH - f - 2].sum() for i in range(BATCH)]
    return [g[int(np.argmin(scores))] for g in grads]


def geometric_median_reference(grads, iterations=10, eps=1e-6):
    """Weiszfeld over the examples whose squared norm float32 can hold (the rule's definition)."""
    flat = _flat(grads)
    usable = (flat**2).sum(1) < np.finfo(np.float32).max
    weights = usable / usable.sum()
    for _ in range(iterations):
        center = weights @ flat
        inverse = np.where(usable, 1.0 / np.maximum(np.linalg.norm(flat - center, axis=1), eps), 0.0)
        weights = inverse / inverse.sum()
    return _mean(grads, weights)


def clip_median_reference(grads):
    return [np.median(g, axis=0) for g in _scaled(grads, np.minimum(1.0, C / _norms(grads, False)))]


RULES = {
    "clip": (lambda: agg.clip(C), clip_reference),
    "clip_per_layer": (lambda: agg.clip(C, per_layer=True),
                       lambda g: clip_reference(g, per_layer=True)),
    "automatic_clip": (lambda: agg.automatic_clip(0.01), automatic_clip_reference),
    "automatic_clip_per_layer": (lambda: agg.automatic_clip(0.01, per_layer=True),
                                 lambda g: automatic_clip_reference(g, per_layer=True)),
    "dp_gaussian": (lambda: privacy.dp_gaussian(C, 0.0, seed=1), clip_reference),
    "dp_gaussian_per_layer": (lambda: privacy.dp_gaussian(C, 0.0, per_layer=True, seed=1),
                              lambda g: clip_reference(g, C / math.sqrt(2), per_layer=True)),
    "norm_filter": (lambda: agg.norm_filter(factor=3.0), lambda g: norm_filter_reference(g, factor=3.0)),
    "norm_filter_drop": (lambda: agg.norm_filter(drop_fraction=0.25),
                         lambda g: norm_filter_reference(g, drop=0.25)),
    "krum": (lambda: agg.krum(0.125), lambda g: krum_reference(g, 0.125)),
    "geometric_median": (agg.geometric_median, geometric_median_reference),
    "chain_clip_median": (lambda: agg.chain(agg.clip(C), agg.median()), clip_median_reference),
}


def _update(kind, rule, **options):
    x, y, loss, kernel, bias, grads = _case(kind)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    model.set_weights([kernel, bias])
    wrapper = pergrad.PerExampleModel(model, RULES[rule][0](), **options)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    wrapper.train_on_batch(x, y)
    after = model.get_weights()
    update = [before - np.asarray(now, np.float64) for before, now in zip((kernel, bias), after)]
    return update, RULES[rule][1](grads)


# Every rule on the statistics (or streaming) and the materialized path with a large input;
# a large output gradient and the chunked path (microbatches) for the rules whose norms
# they compute differently. (Fewer cases: each compiles its own step.)
_LARGE_DELTA = ("clip", "clip_per_layer", "dp_gaussian", "krum", "geometric_median")
_CHUNKED = ("clip", "dp_gaussian_per_layer", "krum", "norm_filter", "chain_clip_median")
CASES = (
    [(rule, path, "input") for rule in sorted(RULES) for path in ("auto", "materialized")]
    + [(rule, path, "target") for rule in _LARGE_DELTA for path in ("auto", "materialized")]
    + [(rule, "microbatch", kind) for rule in _CHUNKED for kind in ("input", "target")]
)


@pytest.mark.parametrize(("rule", "path", "kind"), CASES)
def test_a_finite_gradient_with_an_overflowing_squared_norm(rule, path, kind):
    options = {"microbatch_size": 3} if path == "microbatch" else {"path": path}
    _, _, _, _, _, grads = _case(kind)
    assert np.all(np.isfinite(_flat(grads).astype(np.float32)))  # the gradient is finite in float32
    assert (_flat(grads) ** 2).sum(1)[GIANT] > np.finfo(np.float32).max  # its squared norm is not
    update, expected = _update(kind, rule, **options)
    for got, want in zip(update, expected):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_statistics_give_the_norm_of_a_gradient_whose_squared_norm_overflows():
    x, y, loss, kernel, bias, grads = _case("input")
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    model.set_weights([kernel, bias])
    stats = pergrad.per_example_statistics(model, x, y, loss=loss)
    np.testing.assert_allclose(np.asarray(stats.flat_norms), _norms(grads, False), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.norms), _norms(grads, True), rtol=1e-5, atol=1e-7)
    squared = np.asarray(stats.flat_squared_norms)
    assert np.isinf(squared[GIANT]) and np.all(np.isfinite(np.delete(squared, GIANT)))
    assert bool(np.all(np.asarray(stats.finite)))
