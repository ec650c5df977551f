"""Adaptive clipping (Andrew et al., 2021) against a NumPy recurrence, the accountant and
its own state: saved, restored, resumed, carried through every backend's train step."""

from __future__ import annotations

import math

import dp_accounting
import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import privacy
from pergrad.privacy import AdaptiveDPGaussian, PoissonSampler, adaptive_dp_gaussian, dp_gaussian

SHAPES = [(3, 4), (5,)]
BATCH = 8


def numpy_of(value):
    return np.asarray(ops.convert_to_numpy(value), "float64")


def clip_of(rule) -> float:
    return float(numpy_of(rule.l2_norm_clip_state))


def random_gradients(seed: int, batch: int = BATCH, padding: int = 0) -> list[np.ndarray]:
    """Per-example gradients with norms over an order of magnitude; the last ``padding``
    rows zero (as the sampler's padding rows)."""
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.normal(size=batch))
    scales[batch - padding :] = 0.0
    return [
        (rng.normal(size=(batch,) + s) * scales.reshape((-1,) + (1,) * len(s))).astype("float32")
        for s in SHAPES
    ]


def flat_norms(gradients) -> np.ndarray:
    rows = np.concatenate([g.reshape(len(g), -1) for g in gradients], axis=1)
    return np.linalg.norm(rows.astype("float64"), axis=1)


def numpy_step(gradients, clip, expected, quantile, rate):
    """One noise-free step in NumPy: the clipped sum over ``expected`` and the next norm."""
    norms = flat_norms(gradients)
    factors = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    update = [np.tensordot(factors, g.astype("float64"), axes=1) / expected for g in gradients]
    present = norms > 0
    fraction = np.clip(np.sum(present * ((norms <= clip) - 0.5)) / expected + 0.5, 0.0, 1.0)
    return update, clip * math.exp(-rate * (fraction - quantile)), fraction


# -- the rule without noise: exact against NumPy -------------------------------------------


def test_without_noise_the_norm_follows_the_numpy_recurrence_and_the_update_clips_at_it():
    expected, quantile, rate = 9.0, 0.3, 0.5
    rule = adaptive_dp_gaussian(0.8, 0.0, expected_batch_size=expected, target_quantile=quantile,
                                learning_rate=rate, count_stddev=0.0)
    clip = 0.8
    for step in range(5):
        gradients = random_gradients(step, padding=2)  # the padding rows do not count
        got, reports = rule.aggregation([ops.convert_to_tensor(g) for g in gradients]).finish()
        reports = {k: float(numpy_of(v)) for k, v in reports.items()}
        want, next_clip, fraction = numpy_step(gradients, clip, expected, quantile, rate)
        for g, w in zip(got, want):
            np.testing.assert_allclose(numpy_of(g), w, rtol=1e-5, atol=1e-7)
        assert reports["l2_norm_clip"] == pytest.approx(clip, rel=1e-6)
        assert reports["unclipped_fraction"] == pytest.approx(fraction, abs=1e-6)
        clip = next_clip
        assert clip_of(rule) == pytest.approx(clip, rel=1e-5)
    assert int(numpy_of(rule.step_count)) == 5


def linear_gradients(kernel, bias, x, y, weights):
    """Per-example gradients of ``w (x k + b - y)^2`` for a Dense(1): ``2 w r x``, ``2 w r``."""
    residual = (x @ kernel + bias - y) * weights[:, None]
    return [2 * residual[:, :, None] * x[:, :, None], 2 * residual]


def test_fit_trains_and_adapts_as_the_numpy_recurrence_through_each_backends_step():
    """train_on_batch (JAX: the stateless jitted step carries the norm) against NumPy."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH, 3)).astype("float32")
    y = (3.0 * rng.normal(size=(BATCH, 1))).astype("float32")
    weights = np.ones(BATCH, "float32")
    weights[-2:] = 0.0  # padding rows
    expected, quantile, rate, lr = 7.0, 0.5, 0.2, 0.1
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    kernel, bias = (numpy_of(v) for v in inner.trainable_variables)
    model = pergrad.PerExampleModel(inner, adaptive_dp_gaussian(
        0.5, 0.0, expected_batch_size=expected, target_quantile=quantile, learning_rate=rate,
        count_stddev=0.0))
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    clip = 0.5
    for _ in range(4):
        logs = model.train_on_batch(x, y, sample_weight=weights, return_dict=True)
        gradients = linear_gradients(kernel, bias, x, y, weights)
        (kernel_step, bias_step), next_clip, fraction = numpy_step(gradients, clip, expected, quantile, rate)
        kernel, bias = kernel - lr * kernel_step, bias - lr * bias_step
        assert logs["l2_norm_clip"] == pytest.approx(clip, rel=1e-5)
        assert logs["unclipped_fraction"] == pytest.approx(fraction, abs=1e-6)
        clip = next_clip
        assert clip_of(model.aggregator) == pytest.approx(clip, rel=1e-5)
        np.testing.assert_allclose(numpy_of(inner.trainable_variables[0]), kernel, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(numpy_of(inner.trainable_variables[1]), bias, rtol=1e-4, atol=1e-6)
    assert clip != pytest.approx(0.5)  # the norm moved


@pytest.mark.filterwarnings("ignore::pergrad.privacy.NotPoissonSampledWarning")
@pytest.mark.parametrize("quantile", [0.5, 0.9])
def test_the_norm_converges_to_the_target_quantile_with_the_count_noised(quantile):
    """A frozen model (learning rate 0) of one weight 1: example i's loss ``(s_i w)^2`` has
    gradient norm ``2 s_i^2``, 200 of them spread over [1, 3]; one step an epoch, each
    logging the norm it clipped to."""
    batch, steps = 200, 60
    norms = np.random.default_rng(7).uniform(1.0, 3.0, size=batch)
    x = np.sqrt(norms / 2).astype("float32")[:, None]
    weight = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    inner = keras.Sequential([keras.Input((1,)), weight])
    rule = adaptive_dp_gaussian(0.2, 0.0, expected_batch_size=batch, target_quantile=quantile,
                                count_stddev=batch / 20, seed=8)
    model = pergrad.PerExampleModel(inner, rule)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    history = model.fit(x, np.zeros((batch, 1), "float32"), batch_size=batch, epochs=steps, verbose=0)
    fractions = [np.mean(norms <= clip) for clip in history.history["l2_norm_clip"]]
    # From every example clipped to the quantile in ~30 steps, then around it.
    assert fractions[0] == 0.0
    assert abs(np.mean(fractions[-20:]) - quantile) < 0.05, fractions
    assert np.quantile(norms, quantile - 0.1) < clip_of(rule) < np.quantile(norms, min(quantile + 0.1, 1.0))


# -- noise and accounting ------------------------------------------------------------------


def test_the_gradient_noise_is_the_gradients_share_times_the_current_norm():
    """Zero gradients: the update is pure noise of std z_grad * C / B_e at the norm of the
    step (z_grad = 1.81 here, not the total z = 1)."""
    noise_multiplier, count_stddev, expected = 1.0, 0.6, 10.0
    rule = adaptive_dp_gaussian(0.7, noise_multiplier, expected_batch_size=expected,
                                count_stddev=count_stddev, seed=5)
    share = 1 / math.sqrt(noise_multiplier**-2 - (2 * count_stddev) ** -2)
    assert rule.gradient_noise_multiplier == pytest.approx(share) and share > 1.8
    zeros = [ops.convert_to_tensor(np.zeros((BATCH, 20_000), "float32"))]
    first = numpy_of(rule(zeros)[0])
    assert abs(first.std() - share * 0.7 / expected) < 0.05 * share * 0.7 / expected
    assert clip_of(rule) != pytest.approx(0.7)  # moved by the count's noise alone
    rule.l2_norm_clip_state.assign(2.5)
    second = numpy_of(rule(zeros)[0])
    assert abs(second.std() - share * 2.5 / expected) < 0.05 * share * 2.5 / expected


def test_epsilon_is_the_accountants_for_the_total_noise_multiplier():
    """The accountant's epsilon for the total z equals dp_accounting's for the composition
    of what each step releases: the gradient (z_grad) and the count (2 sigma_b)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")
    rate, noise_multiplier, delta = 0.2, 1.1, 1e-5
    sampler = PoissonSampler(x, y, sampling_rate=rate, seed=1)
    rule = adaptive_dp_gaussian(1.0, noise_multiplier, expected_batch_size=sampler.expected_batch_size,
                                count_stddev=1.0, seed=2)
    model = pergrad.PerExampleModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), rule)
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(sampler, epochs=2, verbose=0,
                        callbacks=[privacy.PrivacyAccountant(noise_multiplier, rate, delta)])
    steps = int(numpy_of(rule.step_count))
    assert steps == 10
    step = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(rule.gradient_noise_multiplier),
        dp_accounting.GaussianDpEvent(2 * rule.count_stddev),  # sensitivity 1/2
    ]))
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    assert history.history["epsilon"][-1] == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
    assert history.history["epsilon"][-1] == pytest.approx(
        privacy.epsilon(noise_multiplier, rate, steps, delta), rel=1e-12)
    with pytest.raises(ValueError, match="does not match"):  # the accountant needs the total z
        model.fit(sampler, epochs=1, verbose=0, callbacks=[
            privacy.PrivacyAccountant(rule.gradient_noise_multiplier, rate, delta)])


# -- state: saved, restored, resumed -------------------------------------------------------


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")


def sampler():
    return PoissonSampler(*data(), sampling_rate=0.25, seed=5)


def adaptive_model():
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")]
    )
    rule = adaptive_dp_gaussian(0.3, 1.0, expected_batch_size=5.0, count_stddev=1.0, seed=7)
    model = pergrad.PerExampleModel(inner, rule)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def state_of(model):
    return [numpy_of(v) for v in model.model.trainable_variables], clip_of(model.aggregator)


def test_save_load_and_resume_keep_the_norm(tmp_path):
    """Seeded noise and batches are functions of (seed, step): a run saved after one epoch
    and resumed from the file (load_model, load_weights) ends with the uninterrupted
    run's weights and norm."""
    uninterrupted = adaptive_model()
    uninterrupted.fit(sampler(), epochs=2, verbose=0)
    weights, clip = state_of(uninterrupted)
    first = adaptive_model()
    first.fit(sampler(), epochs=1, verbose=0)
    assert clip_of(first.aggregator) not in (pytest.approx(0.3), pytest.approx(clip))
    first.save(tmp_path / "model.keras")
    first.save_weights(tmp_path / "model.weights.h5")
    from_file = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(from_file.aggregator, AdaptiveDPGaussian)
    from_weights = adaptive_model()
    from_weights.load_weights(tmp_path / "model.weights.h5")
    for resumed in (from_file, from_weights):
        assert clip_of(resumed.aggregator) == clip_of(first.aggregator)
        resumed.fit(sampler(), epochs=1, verbose=0)
        resumed_weights, resumed_clip = state_of(resumed)
        assert resumed_clip == pytest.approx(clip, rel=1e-5)
        for got, want in zip(resumed_weights, weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_weights_without_a_norm_are_refused(tmp_path):
    plain = pergrad.PerExampleModel(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        dp_gaussian(1.0, 1.0, expected_batch_size=5.0, seed=1),
    )
    plain.compile(optimizer="sgd", loss="mse")
    plain.train_on_batch(*data())
    plain.save_weights(tmp_path / "plain.weights.h5")
    model = adaptive_model()
    model.train_on_batch(*data())
    with pytest.raises(ValueError, match="No clipping norm"):
        model.load_weights(tmp_path / "plain.weights.h5")


# -- configuration and refusals ------------------------------------------------------------


def test_config_round_trip_through_keras_serialization():
    rule = adaptive_dp_gaussian(0.5, 1.1, expected_batch_size=64, target_quantile=0.7,
                                learning_rate=0.3, count_stddev=2.0, seed=3, diagnostics=True)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(rule))
    assert isinstance(restored, AdaptiveDPGaussian)
    for key in ("l2_norm_clip", "noise_multiplier", "expected_batch_size", "target_quantile",
                "learning_rate", "count_stddev", "seed", "gradient_noise_multiplier", "diagnostics"):
        assert getattr(restored, key) == getattr(rule, key), key
    assert restored.diagnostics == ("l2_norm_clip", "unclipped_fraction", "clipped_fraction",
                                    "gradient_norm")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(noise_multiplier=1.0, count_stddev=0.5), "leaves no privacy budget"),
        (dict(noise_multiplier=1.0, count_stddev=0.0), "leaves no privacy budget"),
        (dict(noise_multiplier=2.0), "leaves no privacy budget"),  # default 10 / 20
        (dict(expected_batch_size=None), "needs expected_batch_size"),
        (dict(target_quantile=0.0), "target_quantile"),
        (dict(target_quantile=1.0), "target_quantile"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(count_stddev=-1.0), "count_stddev"),
        (dict(initial_l2_norm_clip=0.0), "l2_norm_clip"),
    ],
)
def test_invalid_arguments_are_refused(arguments, message):
    arguments = {"initial_l2_norm_clip": 1.0, "noise_multiplier": 0.5, "expected_batch_size": 10.0,
                 **arguments}
    with pytest.raises(ValueError, match=message):
        adaptive_dp_gaussian(**arguments)
