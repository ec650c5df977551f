"""DP-SGD's aggregator against NumPy references and its privacy-relevant closed forms."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad.aggregators.base import zero_non_finite_examples
from pergrad.privacy import DPGaussian, PoissonSampler, dp_gaussian

SHAPES = [(3, 4), (5,), (2, 1, 3)]
# One batch size and few shapes throughout: eager JAX compiles every new shape.
BATCH = 6
NOISE_SHAPE = (BATCH, 20_000)


def random_gradients(batch_size: int, seed: int = 0, shapes=SHAPES) -> list[np.ndarray]:
    """Per-example gradients whose norms spread over two orders of magnitude."""
    rng = np.random.default_rng(seed)
    scales = np.exp(1.5 * rng.normal(size=batch_size))
    return [
        (rng.normal(size=(batch_size,) + s) * scales.reshape((-1,) + (1,) * len(s))).astype("float32")
        for s in shapes
    ]


def run(aggregator, gradients):
    result = aggregator([ops.convert_to_tensor(g) for g in gradients])
    return [np.asarray(ops.convert_to_numpy(r), dtype="float64") for r in result]


def flat(values):
    return np.concatenate([np.ravel(v) for v in values])


def numpy_clipped_sum(gradients, clip, per_layer=False):
    """Independent reference: clip each example (flat or per variable), then sum."""
    gradients = [np.asarray(g, "float64") for g in gradients]
    batch_size, variables = len(gradients[0]), len(gradients)
    out = [np.zeros(g.shape[1:]) for g in gradients]
    for i in range(batch_size):
        if per_layer:
            threshold = clip / math.sqrt(variables)
            for k, g in enumerate(gradients):
                norm = np.linalg.norm(g[i])
                out[k] += g[i] * min(1.0, threshold / norm) if norm > 0 else 0.0
        else:
            norm = math.sqrt(sum(np.sum(g[i] ** 2) for g in gradients))
            factor = min(1.0, clip / norm) if norm > 0 else 1.0
            for k, g in enumerate(gradients):
                out[k] += g[i] * factor
    return out


# -- clipping without noise --------------------------------------------------------------


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("expected_batch_size", [None, 13.5])
def test_without_noise_is_the_clipped_sum_over_the_batch_size(per_layer, expected_batch_size):
    gradients = random_gradients(BATCH, seed=1)
    aggregator = dp_gaussian(1.3, 0.0, per_layer=per_layer, expected_batch_size=expected_batch_size)
    denominator = expected_batch_size or BATCH
    expected = [s / denominator for s in numpy_clipped_sum(gradients, 1.3, per_layer)]
    for got, want in zip(run(aggregator, gradients), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_layer", [False, True])
def test_one_adversarial_example_moves_the_update_by_at_most_clip_over_batch_size(per_layer):
    batch_size, clip = BATCH, 0.5
    honest = [np.zeros((batch_size,) + s, "float32") for s in SHAPES]
    attacked = [g.copy() for g in honest]
    for g in attacked:
        g[3] = 1e6  # every coordinate of one example huge
    change = flat(run(dp_gaussian(clip, 0.0, per_layer=per_layer), attacked)) - flat(
        run(dp_gaussian(clip, 0.0, per_layer=per_layer), honest)
    )
    assert np.linalg.norm(change) <= clip / batch_size * (1 + 1e-5)
    # Every variable exceeds its threshold, so the bound is attained.
    np.testing.assert_allclose(np.linalg.norm(change), clip / batch_size, rtol=1e-4)


def test_a_gradient_whose_squared_norm_overflows_contributes_nothing():
    gradients = [np.zeros((BATCH,) + s, "float32") for s in SHAPES]
    gradients[0][1] = 1e30  # ||g||^2 = inf in float32
    result = flat(run(dp_gaussian(1.0, 0.0), gradients))
    assert np.all(np.isfinite(result))
    assert np.linalg.norm(result) <= 1.0 / BATCH * (1 + 1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_an_example_with_a_non_finite_gradient_contributes_nothing(bad):
    """``PerExampleModel`` zeroes non-finite examples before a DP rule (one place, for
    every rule): ``zero_non_finite_examples`` then the rule."""
    gradients = random_gradients(BATCH, seed=2)
    clean = [g.copy() for g in gradients]
    for g in clean:
        g[2] = 0.0
    gradients[1][2, 1] = bad
    got = run(
        dp_gaussian(1.0, 0.0, expected_batch_size=5),
        zero_non_finite_examples([ops.convert_to_tensor(g) for g in gradients]),
    )
    want = run(dp_gaussian(1.0, 0.0, expected_batch_size=5), clean)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_per_layer_clipping_bounds_the_flat_norm_by_the_clip_norm():
    gradients = [np.zeros_like(g) for g in random_gradients(BATCH, seed=3)]
    for g, big in zip(gradients, random_gradients(BATCH, seed=3)):
        g[0] = big[0] * 1e3  # one example, every variable far above C / sqrt(V)
    result = flat(run(dp_gaussian(2.0, 0.0, per_layer=True, expected_batch_size=1), gradients))
    np.testing.assert_allclose(np.linalg.norm(result), 2.0, rtol=1e-5)


def test_diagnostics_leave_out_zero_gradient_padding_rows():
    gradients = random_gradients(BATCH, seed=4)
    for g in gradients:
        g[4:] = 0.0  # two padding rows
    aggregator = dp_gaussian(1.0, 0.0, expected_batch_size=4, diagnostics=True)
    _, reports = aggregator.aggregation([ops.convert_to_tensor(g) for g in gradients]).finish()
    reports = {k: float(ops.convert_to_numpy(v)) for k, v in reports.items()}
    norms = np.linalg.norm(np.concatenate([g.reshape(BATCH, -1) for g in gradients], axis=1), axis=1)[:4]
    assert reports["clipped_fraction"] == pytest.approx(np.mean(norms > 1.0))
    assert reports["gradient_norm"] == pytest.approx(np.mean(norms), rel=1e-5)


# -- noise -----------------------------------------------------------------------------------


@pytest.mark.parametrize("expected_batch_size", [None, 10.0])
def test_noise_standard_deviation_is_noise_multiplier_times_clip_over_batch_size(expected_batch_size):
    batch_size, clip, noise_multiplier = BATCH, 0.7, 1.3
    gradients = [np.zeros(NOISE_SHAPE, "float32")]
    aggregator = dp_gaussian(clip, noise_multiplier, expected_batch_size=expected_batch_size, seed=5)
    result = run(aggregator, gradients)[0]
    std = noise_multiplier * clip / (expected_batch_size or batch_size)
    assert abs(result.std() - std) < 0.1 * std
    assert abs(result.mean()) < 5 * std / math.sqrt(result.size)


def test_every_call_draws_fresh_noise():
    aggregator = dp_gaussian(1.0, 1.0, seed=6)
    gradients = [np.zeros(NOISE_SHAPE, "float32")]
    first, second = run(aggregator, gradients)[0], run(aggregator, gradients)[0]
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.05


def test_the_same_seed_gives_the_same_noise_and_another_seed_does_not():
    gradients = random_gradients(BATCH, seed=7)
    first = [flat(run(dp_gaussian(1.0, 1.0, seed=8), gradients)) for _ in range(2)]
    np.testing.assert_array_equal(first[0], first[1])
    other = flat(run(dp_gaussian(1.0, 1.0, seed=9), gradients))
    assert not np.allclose(first[0], other)


def test_noise_is_added_to_every_variable_including_untouched_ones():
    gradients = [np.zeros((BATCH,) + s, "float32") for s in SHAPES]
    result = run(dp_gaussian(1.0, 2.0, seed=10), gradients)
    assert all(np.count_nonzero(r) == r.size for r in result)


# -- configuration -----------------------------------------------------------------------


def test_config_round_trip_through_keras_serialization():
    aggregator = dp_gaussian(0.5, 1.1, per_layer=True, expected_batch_size=64, seed=3, diagnostics=True)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(aggregator))
    assert isinstance(restored, DPGaussian)
    keys = ("l2_norm_clip", "noise_multiplier", "per_layer", "expected_batch_size", "seed", "diagnostics")
    for key in keys:
        assert getattr(restored, key) == getattr(aggregator, key)
    assert restored.noise_stddev == pytest.approx(0.55)


@pytest.mark.parametrize(
    "arguments",
    [
        dict(l2_norm_clip=0.0, noise_multiplier=1.0),
        dict(l2_norm_clip=1.0, noise_multiplier=-1.0),
        dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=0),
    ],
)
def test_invalid_arguments_are_refused(arguments):
    with pytest.raises(ValueError):
        dp_gaussian(**arguments)


# -- inside fit() ------------------------------------------------------------------------------


def test_a_padded_poisson_batch_trains_like_the_clipped_sum_of_its_real_examples():
    """Padding rows add nothing; the update is the NumPy clipped sum / expected batch size."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = rng.normal(size=(40, 1)).astype("float32")
    y[::5] *= 100.0  # some examples far above the clipping norm
    sampler = PoissonSampler(x, y, sampling_rate=0.3, seed=12)
    batch_x, batch_y, weights = sampler[0]
    real = int(weights.sum())
    assert 0 < real < sampler.max_batch_size  # the batch is padded

    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    kernel, bias = (np.asarray(ops.convert_to_numpy(v), "float64") for v in inner.trainable_variables)
    clip, expected = 2.0, sampler.expected_batch_size
    model = pergrad.PerExampleModel(
        inner, dp_gaussian(clip, 0.0, expected_batch_size=expected, diagnostics=True)
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    logs = model.train_on_batch(batch_x, batch_y, sample_weight=weights, return_dict=True)

    # d/dw (x w + b - y)^2 = 2 r x, d/db = 2 r, per real example.
    residual = batch_x[:real] @ kernel + bias - batch_y[:real]
    reference = numpy_clipped_sum([2 * residual[:, :, None] * batch_x[:real, :, None], 2 * residual], clip)
    new_kernel, new_bias = (np.asarray(ops.convert_to_numpy(v)) for v in inner.trainable_variables)
    np.testing.assert_allclose(kernel - new_kernel, reference[0] / expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bias - new_bias, reference[1] / expected, rtol=1e-4, atol=1e-6)
    norms = np.sqrt((2 * residual[:, 0]) ** 2 * (1 + np.sum(batch_x[:real] ** 2, axis=1)))
    assert logs["clipped_fraction"] == pytest.approx(np.mean(norms > clip), abs=1e-6)


@pytest.mark.parametrize(
    "path, microbatch_size, engine",
    [("auto", None, "statistics"), ("auto", 2, "chunked"), ("materialized", None, "materialized")],
)
def test_fit_adds_fresh_noise_of_the_right_scale_at_every_step(path, microbatch_size, engine):
    """Zero gradients: each update is pure noise, std z C / B, different at every step,
    on every engine path (the rule sets its noise aside; the step adds it)."""
    inner = keras.Sequential([keras.Input((100,)), keras.layers.Dense(200, use_bias=False)])
    batch_size, clip, noise_multiplier = 4, 0.5, 1.2
    model = pergrad.PerExampleModel(
        inner, dp_gaussian(clip, noise_multiplier, seed=13), path=path, microbatch_size=microbatch_size
    )
    assert pergrad.training.step.engine_path(model.aggregator, path, microbatch_size) == engine
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    kernels = [np.asarray(ops.convert_to_numpy(inner.trainable_variables[0]))]

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            kernels.append(np.asarray(ops.convert_to_numpy(inner.trainable_variables[0])))

    zeros = np.zeros((batch_size, 100), "float32")
    model.fit(
        zeros,
        np.zeros((batch_size, 200), "float32"),
        batch_size=batch_size,
        epochs=3,
        verbose=0,
        callbacks=[Record()],
    )
    updates = [np.ravel(b - a) for a, b in zip(kernels, kernels[1:])]
    std = noise_multiplier * clip / batch_size
    for update in updates:
        assert abs(update.std() - std) < 0.1 * std
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert abs(np.corrcoef(updates[a], updates[b])[0, 1]) < 0.1


@pytest.mark.parametrize("path", ["statistics", "materialized"])
def test_a_non_finite_example_adds_nothing_to_a_convolution(path):
    """A NaN example in a noise-free DP step of a convolution equals the batch with that
    example's weight 0, on both paths. On the statistics path the convolution's per-example
    gradients are materialized for the norms and serve the weighted sum, zeroed with A and D."""
    import problems

    updates = []
    for poison in (False, True):
        problem = problems.conv2d(batch=5)
        x, weights = problem.x.copy(), np.ones(5, "float32")
        if poison:
            x[2, 1, 1, 0] = np.nan
        else:
            weights[2] = 0.0
        rule = dp_gaussian(1.0, 0.0, expected_batch_size=4.0)
        model = pergrad.PerExampleModel(problem.model, rule, path=path)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=problem.loss)
        before = [np.array(w) for w in model.model.get_weights()]
        model.train_on_batch(x, problem.y, sample_weight=weights)
        updates.append([w - b for w, b in zip(model.model.get_weights(), before)])
    for poisoned, clean in zip(updates[1], updates[0]):
        assert np.all(np.isfinite(poisoned)) and np.any(clean != 0)
        np.testing.assert_allclose(poisoned, clean, rtol=1e-5, atol=1e-7)
