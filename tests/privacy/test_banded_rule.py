"""BandMF in fit() (pergrad.privacy.banded_mf_gaussian): its noise is C^-1 applied to
dp_gaussian's, one band is dp_gaussian, a resumed fit continues the recurrence, the key is
never saved, fit refuses samplers whose participations are closer than the bands, and
PrivacyAccountant reports BandMF's epsilon."""

from __future__ import annotations

import io
import math
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import privacy
from pergrad.engine.paths import engine_path
from pergrad.privacy import (
    BandedMFGaussian,
    BandedStrategy,
    CyclicPoissonSampler,
    NotPoissonSampledWarning,
    PoissonSampler,
    PrivacyAccountant,
    banded_mf_gaussian,
    dp_gaussian,
)


def noises(rule, shapes, steps: int) -> np.ndarray:
    """``(steps, parameters)``: the rule's result on zero gradients (pure noise), per call."""
    gradients = [ops.zeros((2, *shape)) for shape in shapes]
    rows = [[np.ravel(ops.convert_to_numpy(r)) for r in rule(gradients)] for _ in range(steps)]
    return np.asarray([np.concatenate(row) for row in rows], np.float64)


def data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x @ rng.normal(size=(4, 1)) + rng.normal(size=(n, 1))).astype("float32")


def network():
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    return keras.Sequential([keras.Input((4,)), *layers])


def weights_of(model):
    return [np.asarray(w) for w in model.model.get_weights()]


def steps_of(model) -> int:
    return int(ops.convert_to_numpy(model.aggregator.step_count))


# -- the noise -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [BandedStrategy.fhu(2), BandedStrategy.fhu(5),
                                      BandedStrategy.optimized(4, 30)])
def test_the_noise_is_the_inverse_strategy_applied_to_dp_gaussians_noise(strategy):
    """Against the NumPy reference (float64 ``np.linalg.solve(C, Z)``): the rule's noise at
    step t is (C^-1 Z)_t, Z the noise dp_gaussian draws with the same seed at those steps;
    every variable, a scalar one too."""
    shapes, steps, scale = [(3, 4), (5,), ()], 30, 0.7 * 1.3 / 3.0
    z = noises(dp_gaussian(0.7, 1.3, expected_batch_size=3.0, seed=4), shapes, steps)
    rule = banded_mf_gaussian(0.7, 1.3, strategy=strategy, expected_batch_size=3.0, seed=4)
    w = noises(rule, shapes, steps)
    expected = np.linalg.solve(strategy.matrix(steps), z)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-5 * scale)
    assert not np.allclose(w[1:], z[1:] / strategy.coefficients[0], atol=0.1 * scale)  # correlated
    slots = strategy.bands - 1
    assert tuple(rule.noise_buffer.shape) == (slots, sum(math.prod(s) for s in shapes))
    # A ring: w_t in slot t mod slots, the last b - 1 noises all there.
    buffer = ops.convert_to_numpy(rule.noise_buffer)
    for lag in range(1, strategy.bands):
        np.testing.assert_allclose(buffer[(steps - lag) % slots], w[-lag], rtol=1e-6, atol=1e-7)


def test_a_step_past_the_budget_leaves_the_buffers_as_they_were():
    """Past ``step_limit`` the update is not applied, the step not counted: the buffers keep the
    last applied step's noises, so the next allowed step draws what it would have."""
    shapes = [(3,), (2, 2)]
    rule = banded_mf_gaussian(1.0, 1.0, bands=3, expected_batch_size=2.0, seed=5)
    reference = noises(banded_mf_gaussian(1.0, 1.0, bands=3, expected_batch_size=2.0, seed=5), shapes, 4)
    np.testing.assert_array_equal(noises(rule, shapes, 2), reference[:2])
    kept = np.array(ops.convert_to_numpy(rule.noise_buffer))
    rule.step_limit.assign(2)
    noises(rule, shapes, 2)
    assert steps_of_rule(rule) == 2
    np.testing.assert_array_equal(ops.convert_to_numpy(rule.noise_buffer), kept)
    rule.step_limit.assign(2**31 - 1)
    np.testing.assert_array_equal(noises(rule, shapes, 2), reference[2:])


def steps_of_rule(rule) -> int:
    return int(ops.convert_to_numpy(rule.step_count))


def test_an_unnormalized_strategy_is_normalized_and_its_noise_is_that_of_the_normalized_one():
    coefficients = 3.0 * privacy.fhu_coefficients(3)
    rule = banded_mf_gaussian(1.0, 1.0, strategy=coefficients, expected_batch_size=2.0, seed=1)
    np.testing.assert_allclose(rule.strategy.coefficients, BandedStrategy.fhu(3).coefficients, rtol=1e-15)
    assert rule.bands == 3 and rule.strategy.max_column_norm == pytest.approx(1.0)


def test_the_noise_covariance_over_steps_is_that_of_the_inverse_strategy():
    """Empirical covariance over 8000 independent coordinates of 24 steps: C w is white noise
    of variance (z C / B)^2 (so Cov(w) = sigma^2 C^-1 C^-T); DP-SGD's noise fails the check."""
    bands, steps, size, clip, z, batch = 4, 24, 8000, 0.5, 2.0, 4.0
    sigma = z * clip / batch
    strategy = BandedStrategy.fhu(bands)
    C = strategy.matrix(steps)

    def whitened_covariance(noise):
        white = C @ noise / sigma
        return white @ white.T / size

    w = noises(banded_mf_gaussian(clip, z, bands=bands, expected_batch_size=batch, seed=7), [(size,)], steps)
    identity = np.eye(steps)
    # standard errors ~ sqrt(2 / 8000) = 0.016 (diagonal), 0.011 (off it)
    assert np.max(np.abs(whitened_covariance(w) - identity)) < 0.08
    raw = w @ w.T / size / sigma**2
    expected = np.linalg.inv(C) @ np.linalg.inv(C).T
    assert np.max(np.abs(raw - expected) / np.sqrt(np.outer(np.diag(expected), np.diag(expected)))) < 0.08
    independent = noises(dp_gaussian(clip, z, expected_batch_size=batch, seed=7), [(size,)], steps)
    assert np.max(np.abs(whitened_covariance(independent) - identity)) > 0.3


# -- in fit() --------------------------------------------------------------------------------


class Kernels(keras.callbacks.Callback):
    def __init__(self, variable):
        super().__init__()
        self.variable, self.values = variable, [np.asarray(ops.convert_to_numpy(variable))]

    def on_epoch_end(self, epoch, logs=None):  # (JAX's fit syncs the variables at an epoch's end)
        self.values.append(np.asarray(ops.convert_to_numpy(self.variable)))


@pytest.mark.parametrize("path, microbatch_size, engine",
                         [("auto", None, "statistics"), ("auto", 2, "chunked"),
                          ("materialized", None, "materialized")])
def test_fit_adds_the_correlated_noise_at_every_step(path, microbatch_size, engine):
    """Zero gradients, SGD(1): the updates of a fit are minus the noise; BandMF's are C^-1 of
    dp_gaussian's (same seed, same sampler), on every engine path."""
    x, y = np.zeros((30, 6), "float32"), np.zeros((30, 5), "float32")
    strategy, steps = BandedStrategy.fhu(3), 9

    def updates(rule):
        sampler = CyclicPoissonSampler(x, y, sampling_rate=0.6, cycle_length=3, seed=1, steps_per_epoch=1)
        inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, use_bias=False,
                                                                        kernel_initializer="zeros")])
        model = pergrad.PerExampleModel(inner, rule, path=path, microbatch_size=microbatch_size)
        assert engine_path(model.aggregator, path, microbatch_size) == engine
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        record = Kernels(inner.trainable_variables[0])
        model.fit(sampler, epochs=steps, verbose=0, callbacks=[record])
        return -np.diff(np.reshape(record.values, (steps + 1, -1)).astype(np.float64), axis=0)

    z = updates(dp_gaussian(1.0, 1.0, expected_batch_size=6.0, seed=3))
    w = updates(banded_mf_gaussian(1.0, 1.0, bands=3, expected_batch_size=6.0, seed=3))
    assert np.all(z != 0)
    np.testing.assert_allclose(w, strategy.correlate(z), rtol=1e-5, atol=1e-6)


def test_one_band_is_dp_gaussian_exactly():
    shapes = [(3, 2), (4,)]
    np.testing.assert_array_equal(
        noises(banded_mf_gaussian(0.5, 1.1, bands=1, expected_batch_size=3.0, seed=9), shapes, 3),
        noises(dp_gaussian(0.5, 1.1, expected_batch_size=3.0, seed=9), shapes, 3),
    )
    x, y = data()
    trained = []
    for rule in (dp_gaussian(0.5, 1.1, expected_batch_size=12.0, seed=2),
                 banded_mf_gaussian(0.5, 1.1, bands=1, expected_batch_size=12.0, seed=2)):
        model = pergrad.PerExampleModel(network(), rule)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(PoissonSampler(x, y, sampling_rate=0.2, seed=1), epochs=1, verbose=0)
        trained.append(weights_of(model))
    assert model.aggregator.noise_buffer is None
    for a, b in zip(*trained):
        np.testing.assert_array_equal(a, b)


def test_a_resumed_fit_continues_the_recurrence(tmp_path):
    """2k steps in one fit equal k steps, save (.keras) and load, k more; the buffers are what
    makes it so: a resume that loses them (load_weights, buffers zeroed) trains otherwise."""
    x, y = data()

    def sampler():
        return CyclicPoissonSampler(x, y, sampling_rate=0.6, cycle_length=3, seed=1, steps_per_epoch=5)

    def build():
        batch = sampler().expected_batch_size
        rule = banded_mf_gaussian(1.0, 1.0, bands=3, expected_batch_size=batch, seed=2)
        model = pergrad.PerExampleModel(network(), rule)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    whole = build()
    whole.fit(sampler(), epochs=2, verbose=0)
    half = build()
    half.fit(sampler(), epochs=1, verbose=0)
    path, weights = tmp_path / "bandmf.keras", tmp_path / "bandmf.weights.h5"
    half.save(path)
    half.save_weights(weights)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.aggregator, BandedMFGaussian)
    assert loaded.aggregator.get_config() == half.aggregator.get_config()
    assert steps_of(loaded) == 5
    loaded.fit(sampler(), epochs=1, verbose=0)
    assert steps_of(loaded) == steps_of(whole) == 10
    for a, b in zip(weights_of(loaded), weights_of(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ops.convert_to_numpy(loaded.aggregator.noise_buffer),
                               ops.convert_to_numpy(whole.aggregator.noise_buffer), rtol=1e-6, atol=1e-7)

    lost = build()
    lost.load_weights(weights)
    assert steps_of(lost) == 5
    lost.aggregator.noise_buffer.assign(ops.zeros(lost.aggregator.noise_buffer.shape))
    lost.fit(sampler(), epochs=1, verbose=0)
    assert not all(np.allclose(a, b, atol=1e-4) for a, b in zip(weights_of(lost), weights_of(whole)))


def test_a_resume_on_other_groups_is_refused(tmp_path):
    """A resumed BandMF run must draw from the groups its buffers' noise was added on: a sampler
    with seed=None made anew (as in a new process), or another seed, is refused before any step,
    after a load and after BackupAndRestore's restore; the same sampler, or one of the same seed,
    continues. A new run (step 0) takes any sampler."""
    x, y = data()

    def build():
        rule = banded_mf_gaussian(1.0, 1.0, bands=3, expected_batch_size=12.0, seed=2)
        model = pergrad.PerExampleModel(network(), rule)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    def sampler(seed=None):
        return CyclicPoissonSampler(x, y, sampling_rate=0.6, cycle_length=3, seed=seed, steps_per_epoch=4)

    first = sampler()
    assert first.groups_fingerprint != sampler().groups_fingerprint  # new secret groups
    assert sampler(7).groups_fingerprint == sampler(7).groups_fingerprint
    model = build()
    backups = tmp_path / "backups"
    model.fit(first, epochs=1, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backups)])
    assert model.aggregator.groups_fingerprint == first.groups_fingerprint
    path = tmp_path / "bandmf.keras"
    model.save(path)

    def refused(model, data, callbacks=None):
        before, steps = weights_of(model), steps_of(model)
        with pytest.raises(ValueError, match="other groups"):
            model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
        assert steps_of(model) == steps
        for a, b in zip(weights_of(model), before):
            np.testing.assert_array_equal(a, b)

    loaded = keras.models.load_model(path)
    assert loaded.aggregator.groups_fingerprint == first.groups_fingerprint
    refused(loaded, sampler())  # a new process: seed=None draws new groups
    refused(loaded, sampler(7))
    refused(model, sampler())  # the same process, another sampler
    model.fit(first, epochs=1, verbose=0)  # the same sampler continues
    assert steps_of(model) == 8
    loaded.fit(first, epochs=1, verbose=0)
    assert steps_of(loaded) == 8

    # BackupAndRestore after an interrupted run, in a "new process": the restore brings the
    # groups' fingerprint with the buffers, and the check runs after it.
    interrupted = build()

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(first, epochs=2, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(tmp_path / "b2", save_freq=1), Stop()])
    fresh, restore = build(), [keras.callbacks.BackupAndRestore(tmp_path / "b2")]
    with pytest.raises(ValueError, match="other groups"):
        fresh.fit(sampler(), epochs=2, verbose=0, callbacks=restore)
    fresh = build()
    fresh.fit(first, epochs=2, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(tmp_path / "b2")])
    assert steps_of(fresh) > 8  # continued from the restored count (2 steps; Keras reruns the epoch)

    new = build()  # a new run takes any sampler, and a file from before a fit records none
    new.save(tmp_path / "new.keras")
    assert keras.models.load_model(tmp_path / "new.keras").aggregator.groups_fingerprint is None
    new.fit(sampler(), epochs=1, verbose=0)
    assert steps_of(new) == 4


def test_weights_of_other_bands_are_refused_at_the_load(tmp_path):
    """A buffer saved for 3 bands does not continue a 4-band recurrence: the load raises, naming
    the shapes, rather than assigning a ring of other slots."""
    x, y = data(8)

    def model_of(bands):
        model = pergrad.PerExampleModel(network(), banded_mf_gaussian(1.0, 1.0, bands=bands,
                                                                      expected_batch_size=4.0))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.train_on_batch(x, y)
        return model

    path = tmp_path / "three.weights.h5"
    model_of(3).save_weights(path)
    other = model_of(4)
    before = ops.convert_to_numpy(other.aggregator.noise_buffer).copy()
    with pytest.raises(ValueError, match=r"no noise buffer of shape \(3, 19\)"):
        other.load_weights(path)
    np.testing.assert_array_equal(ops.convert_to_numpy(other.aggregator.noise_buffer), before)


def test_the_file_holds_the_buffers_and_never_the_key(tmp_path):
    x, y = data(8)
    model = pergrad.PerExampleModel(network(), banded_mf_gaussian(1.0, 1.0, bands=4, expected_batch_size=4.0))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(x, y)
    path = tmp_path / "bandmf.keras"
    model.save(path)
    key_words = set(np.ravel(ops.convert_to_numpy(model.aggregator.noise_key)).tolist())
    assert len(key_words) > 5
    with zipfile.ZipFile(path) as archive:
        config = archive.read("config.json").decode()
        stored = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
        names, values = [], []
        stored.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
        for name in names:
            values.extend(np.ravel(stored[name][()]).tolist())
    assert sum("noise_buffer" in name for name in names) == 1, names
    assert not any("key" in name or "seed" in name for name in names), names
    assert key_words.isdisjoint(int(v) for v in values if float(v).is_integer())
    assert not any(str(word) in config for word in key_words if abs(word) > 1000)
    loaded = keras.models.load_model(path)
    assert not np.array_equal(ops.convert_to_numpy(loaded.aggregator.noise_key),
                              ops.convert_to_numpy(model.aggregator.noise_key))  # a new secret key
    a, b = (ops.convert_to_numpy(m.aggregator.noise_buffer) for m in (loaded, model))
    np.testing.assert_array_equal(a, b)
    assert np.all(a[0] != 0) and np.all(a[1:] == 0)  # one step: slot 0 written, the rest zeros


# -- refusals -------------------------------------------------------------------------------


def test_fit_refuses_participations_closer_than_the_bands_before_any_step():
    x, y = data()
    rule = banded_mf_gaussian(1.0, 1.0, bands=3, expected_batch_size=12.0)
    model = pergrad.PerExampleModel(network(), rule)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = weights_of(model)
    with pytest.raises(ValueError, match=r"CyclicPoissonSampler\(x, y, sampling_rate=0.6, cycle_length=3\)"):
        model.fit(PoissonSampler(x, y, sampling_rate=0.2), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="separates them by 2 step"):
        model.fit(CyclicPoissonSampler(x, y, sampling_rate=0.4, cycle_length=2), epochs=1, verbose=0)
    cyclic = CyclicPoissonSampler(x, y, sampling_rate=0.6, cycle_length=3)
    with pytest.raises(ValueError, match="cycle_length=k"):
        model.fit(cyclic, epochs=1, verbose=0, callbacks=[PrivacyAccountant(1.0, 0.6, 1e-5)])
    with pytest.raises(ValueError, match="does not match the sampler"):
        model.fit(cyclic, epochs=1, verbose=0, callbacks=[PrivacyAccountant(1.0, 0.6, 1e-5, cycle_length=4)])
    with pytest.raises(ValueError, match="below the rule's bands=3"):
        model.fit(cyclic, epochs=1, verbose=0, callbacks=[PrivacyAccountant(1.0, 0.6, 1e-5, cycle_length=2)])
    assert steps_of(model) == 0
    for a, b in zip(weights_of(model), before):
        np.testing.assert_array_equal(a, b)
    with pytest.warns(NotPoissonSampledWarning):  # arrays: as dp_gaussian
        privacy.check_dp_fit(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        privacy.check_dp_fit(model, CyclicPoissonSampler(x, y, sampling_rate=0.8, cycle_length=4))


@pytest.mark.parametrize("arguments, message", [
    (dict(bands=3, expected_batch_size=None), "expected_batch_size"),
    (dict(expected_batch_size=4.0), "bands="),
    (dict(bands=0, expected_batch_size=4.0), "positive integer"),
    (dict(bands=2, strategy=BandedStrategy.fhu(3), expected_batch_size=4.0), "3 bands"),
    (dict(bands=2, expected_batch_size=4.0, seed=1.5), "seed"),
])
def test_invalid_arguments_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        banded_mf_gaussian(1.0, 1.0, **arguments)


def test_config_round_trip_through_keras_serialization():
    rule = banded_mf_gaussian(0.5, 1.1, strategy=BandedStrategy.optimized(3, 20), expected_batch_size=8.0,
                              per_layer=True, seed=3)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(rule))
    assert isinstance(restored, BandedMFGaussian) and restored.get_config() == rule.get_config()
    np.testing.assert_array_equal(restored.strategy.coefficients, rule.strategy.coefficients)


# -- accounting -----------------------------------------------------------------------------


def test_the_accountant_reports_bandmf_epsilon_and_stops_at_the_budget():
    pytest.importorskip("dp_accounting")
    x, y = data()
    z, rate, delta, bands = 1.0, 0.6, 1e-5, 3
    sampler = CyclicPoissonSampler(x, y, sampling_rate=rate, cycle_length=bands, seed=1, steps_per_epoch=4)
    rule = banded_mf_gaussian(1.0, z, bands=bands, expected_batch_size=sampler.expected_batch_size, seed=2)
    model = pergrad.PerExampleModel(network(), rule)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    accountant = PrivacyAccountant(z, rate, delta, cycle_length=bands)
    history = model.fit(sampler, epochs=2, verbose=0, callbacks=[accountant])
    expected = [privacy.banded_mf_epsilon(z, rate, steps, delta, bands=bands, sampler=sampler)
                for steps in (4, 8)]
    np.testing.assert_allclose(history.history["epsilon"], expected, rtol=1e-12)
    assert expected[1] < privacy.epsilon(z, rate, 8, delta)  # 3 participations, not 8 steps
    assert "cycles of 3 steps" in accountant.guarantee

    # The budget of 7 steps allows ceil(7 / 3) = 3 participations: 9 steps in all.
    budget = privacy.banded_mf_epsilon(z, rate, 7, delta, bands=bands) + 1e-9
    limited = PrivacyAccountant(z, rate, delta, cycle_length=bands, max_epsilon=budget)
    model.fit(sampler, epochs=5, verbose=0, callbacks=[limited])
    assert limited.max_steps == 9 and steps_of(model) == 9
    assert privacy.banded_mf_epsilon(z, rate, 10, delta, bands=bands) > budget >= limited.epsilon
