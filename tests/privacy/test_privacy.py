"""Accounting, Poisson sampling, the budget callback, model validation, end to end."""

from __future__ import annotations

import logging
import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import privacy
from pergrad.privacy import (
    BatchOverflowError,
    NotPoissonSampledWarning,
    NotPrivateError,
    PoissonSampler,
    PrivacyAccountant,
    PrivacyBudgetExhaustedError,
    dp_gaussian,
)

BACKEND = keras.backend.backend()


# -- accounting ------------------------------------------------------------------------------


def direct_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant):
    """One DP-SGD step composed ``steps`` times with dp-accounting, without pergrad."""
    tracker = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    tracker.compose(dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian), count=steps)
    return tracker.get_epsilon(delta)


@pytest.mark.parametrize(
    "noise_multiplier, sampling_rate, steps, delta, accountant",
    [(1.1, 0.01, 300, 1e-5, "rdp"), (0.8, 0.05, 40, 1e-6, "rdp"), (1.5, 0.02, 50, 1e-5, "pld")],
)
def test_epsilon_matches_dp_accounting_composed_step_by_step(
    noise_multiplier, sampling_rate, steps, delta, accountant
):
    ours = privacy.epsilon(noise_multiplier, sampling_rate, steps, delta, accountant=accountant)
    reference = direct_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant)
    assert ours == pytest.approx(reference, rel=0.02)


def test_without_subsampling_pld_matches_the_exact_gaussian_mechanism():
    """q = 1: T Gaussian steps are one Gaussian mechanism with noise z / sqrt(T), whose
    exact epsilon is known in closed form (Balle and Wang, 2018); RDP is an upper bound."""
    noise_multiplier, steps, delta = 2.0, 16, 1e-5
    exact = dp_accounting.get_epsilon_gaussian(noise_multiplier / math.sqrt(steps), delta)
    assert privacy.epsilon(noise_multiplier, 1.0, steps, delta, accountant="pld") == pytest.approx(
        exact, rel=0.02
    )
    assert exact <= privacy.epsilon(noise_multiplier, 1.0, steps, delta) <= 1.3 * exact


def test_epsilon_grows_with_steps_and_sampling_rate_and_falls_with_noise():
    base = privacy.epsilon(1.0, 0.01, 1000, 1e-5)
    assert privacy.epsilon(1.0, 0.01, 2000, 1e-5) > base
    assert privacy.epsilon(1.0, 0.02, 1000, 1e-5) > base
    assert privacy.epsilon(1.5, 0.01, 1000, 1e-5) < base
    assert privacy.epsilon(1.0, 0.01, 0, 1e-5) == 0.0
    assert privacy.epsilon(0.0, 0.01, 10, 1e-5) == math.inf


def test_pld_is_tighter_than_rdp():
    rdp = privacy.epsilon(1.1, 0.01, 500, 1e-5, accountant="rdp")
    pld = privacy.epsilon(1.1, 0.01, 500, 1e-5, accountant="pld")
    assert pld < rdp


@pytest.mark.parametrize(
    "arguments",
    [
        (1.0, 0.0, 10, 1e-5),
        (1.0, 1.5, 10, 1e-5),
        (1.0, 0.1, -1, 1e-5),
        (1.0, 0.1, 10, 0.0),
        (-1.0, 0.1, 1, 1e-5),
    ],
)
def test_epsilon_refuses_invalid_arguments(arguments):
    with pytest.raises(ValueError):
        privacy.epsilon(*arguments)
    with pytest.raises(ValueError, match="accountant"):
        privacy.epsilon(1.0, 0.1, 10, 1e-5, accountant="moments")


def test_noise_multiplier_for_inverts_epsilon():
    sampling_rate, steps, delta = 0.01, 1000, 1e-5
    target = privacy.epsilon(1.1, sampling_rate, steps, delta)
    noise = privacy.noise_multiplier_for(target, delta, sampling_rate, steps)
    assert noise == pytest.approx(1.1, abs=1e-3)
    noise = privacy.noise_multiplier_for(3.0, delta, sampling_rate, steps)
    assert 3.0 * 0.99 <= privacy.epsilon(noise, sampling_rate, steps, delta) <= 3.0


def test_steps_within_budget_is_the_last_step_inside_the_budget():
    steps = privacy.steps_within_budget(2.0, 1e-5, 1.0, 0.02)
    assert privacy.epsilon(1.0, 0.02, steps, 1e-5) <= 2.0 < privacy.epsilon(1.0, 0.02, steps + 1, 1e-5)
    assert privacy.steps_within_budget(1e-3, 1e-5, 1.0, 0.02) == 0


# -- Poisson sampling --------------------------------------------------------------------------


def test_poisson_sampler_includes_each_example_with_probability_q():
    size, rate, draws = 500, 0.05, 400
    x = np.arange(size, dtype="float32")[:, None]
    sampler = PoissonSampler(x, np.arange(size), sampling_rate=rate, seed=1)
    counts, batch_sizes = np.zeros(size), []
    for step in range(draws):
        batch_x, batch_y, weights = sampler[step]
        real = int(weights.sum())
        assert batch_x.shape == (sampler.padded_size(real), 1)
        assert batch_y.shape == (sampler.padded_size(real),)
        assert np.all(weights[:real] == 1.0) and np.all(weights[real:] == 0.0)
        rows = batch_y[:real]
        assert len(np.unique(rows)) == real  # without replacement within a step
        np.testing.assert_array_equal(batch_x[:real, 0], rows)
        counts[rows] += 1
        batch_sizes.append(real)
    rate_seen = counts.sum() / (size * draws)
    standard_error = math.sqrt(rate * (1 - rate) / (size * draws))
    assert abs(rate_seen - rate) < 4 * standard_error
    # Independent inclusions: the batch size is Binomial(n, q).
    assert np.var(batch_sizes) == pytest.approx(size * rate * (1 - rate), rel=0.25)
    # No example is systematically favoured (a chi-square-like spread check).
    assert np.std(counts) == pytest.approx(math.sqrt(draws * rate * (1 - rate)), rel=0.2)


def test_poisson_sampler_is_reproducible_with_a_seed_and_fresh_at_every_step():
    x = np.random.default_rng(0).normal(size=(200, 2)).astype("float32")
    first = PoissonSampler(x, x[:, 0], sampling_rate=0.1, seed=3)
    second = PoissonSampler(x, x[:, 0], sampling_rate=0.1, seed=3)
    a, b = [first[i][2] for i in range(3)], [second[i][2] for i in range(3)]
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    # The index is ignored: asking again for batch 0 draws a new sample.
    assert not np.array_equal(first[0][0], first[0][0])
    other = PoissonSampler(x, x[:, 0], sampling_rate=0.1, seed=4)
    assert not np.array_equal(other[0][0], PoissonSampler(x, x[:, 0], sampling_rate=0.1, seed=3)[0][0])


def test_poisson_sampler_keeps_nested_inputs_and_user_sample_weights():
    size = 50
    x = {"a": np.arange(size, dtype="float32")[:, None], "b": np.ones((size, 2, 2), "float32")}
    weights = np.linspace(0.5, 2.0, size).astype("float32")
    sampler = PoissonSampler(
        x, np.arange(size), sample_weight=weights, sampling_rate=0.2, max_batch_size=30, seed=5
    )
    batch_x, batch_y, batch_weights = sampler[0]
    real = np.count_nonzero(batch_weights)
    rows = sampler.padded_size(real)
    assert batch_x["a"].shape == (rows, 1) and batch_x["b"].shape == (rows, 2, 2)
    np.testing.assert_allclose(batch_weights[:real], weights[batch_y[:real]])
    assert len(sampler) == 5  # round(1 / q) steps per epoch by default


def _sequence_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(12, 4),
                             keras.layers.Dense(12)])


@pytest.mark.parametrize("per_token", [False, True])
def test_sampler_weights_broadcast_over_a_sequence_loss_and_train_like_keras(per_token):
    """Token labels ``(n, T)``: one weight an example comes as ``(rows, 1)``, which Keras's loss
    reduction broadcasts over the tokens (from ``(rows,)`` plain Keras raises: 'Incompatible
    shapes'); per-token weights ``(n, T)`` come as ``(rows, T)``; padding rows weigh 0. The
    ``mean`` rule on a sampler's batch trains as plain Keras on it, and a DP fit runs."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, size=(40, 6)).astype("int32")
    y = rng.integers(0, 12, size=(40, 6)).astype("int32")
    weights = rng.uniform(0.5, 2.0, size=(40, 6)).astype("float32") if per_token else None
    sampler = PoissonSampler(x, y, sample_weight=weights, sampling_rate=0.3, seed=1)
    batch_x, batch_y, batch_weights = sampler[0]
    real = int(np.count_nonzero(batch_weights.reshape(len(batch_weights), -1).any(axis=1)))
    assert batch_weights.shape == (len(batch_x), 6 if per_token else 1)
    assert 0 < real < len(batch_x) and not batch_weights[real:].any()
    if per_token:
        rows = [int(np.flatnonzero((x == row).all(axis=1))[0]) for row in batch_x[:real]]
        np.testing.assert_array_equal(batch_weights[:real], weights[rows])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain, wrapped = _sequence_model(), pergrad.PerExampleModel(_sequence_model(), "mean")
    for model in (plain, wrapped):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
        model.train_on_batch(batch_x, batch_y, sample_weight=batch_weights)
    for a, b in zip(plain.get_weights(), wrapped.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    before = _sequence_model().get_weights()
    dp = pergrad.PerExampleModel(_sequence_model(), dp_gaussian(
        1.0, 0.5, expected_batch_size=sampler.expected_batch_size, seed=2))
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    dp.fit(sampler, epochs=1, verbose=0)
    after = dp.model.get_weights()
    assert all(np.isfinite(w).all() for w in after)
    assert any(not np.allclose(a, b) for a, b in zip(before, after))


def test_poisson_batches_are_padded_to_a_few_bucket_sizes_near_the_drawn_size():
    """At an expected batch of 64 (the demo's digits: 1437 examples), padding is
    <= 10% of the real rows (it was 91% when every batch had max_batch_size rows)."""
    size, expected = 1437, 64
    sampler = PoissonSampler(np.zeros((size, 1), "float32"), np.zeros(size), sampling_rate=expected / size,
                             seed=0)
    assert sampler.bucket_width == 8 == privacy.default_bucket_width(size, expected / size)
    real = np.array([len(sampler.indices_for_step(t)) for t in range(2000)])
    padded = np.array([sampler.padded_size(k) for k in real])
    assert np.all(padded >= real) and np.all(padded - real < sampler.bucket_width)
    assert (padded - real).sum() / real.sum() <= 0.10
    # A bounded set of shapes, a handful of them met; every padded size is one of them.
    assert set(padded) <= set(sampler.padded_sizes)
    assert len(sampler.padded_sizes) == math.ceil(sampler.max_batch_size / sampler.bucket_width)
    assert len(set(padded)) <= 10
    assert sampler.padded_size(0) == 8
    assert sampler.padded_size(sampler.max_batch_size) == sampler.max_batch_size
    # bucket_width >= max_batch_size: one shape whatever the draw.
    fixed = PoissonSampler(np.zeros((size, 1), "float32"), np.zeros(size), sampling_rate=expected / size,
                           bucket_width=size)
    assert fixed.padded_sizes == [fixed.max_batch_size]
    with pytest.raises(ValueError, match="bucket_width"):
        PoissonSampler(np.zeros((size, 1)), np.zeros(size), sampling_rate=0.1, bucket_width=0)


def test_bucket_sizes_divide_over_the_devices_and_rules_that_count_padding_get_one_shape():
    x = np.zeros((200, 1), "float32")
    sampler = PoissonSampler(x, np.zeros(200), sampling_rate=0.1, max_batch_size=41, bucket_width=8)
    dp = pergrad.PerExampleModel(small_model(), dp_gaussian(1.0, 1.0, expected_batch_size=20.0))
    with sampler.split_for(dp, 3):  # widths of 9 (8 rounded up to 3 devices), at most 42 rows
        assert sampler.padded_sizes == [9, 18, 27, 36, 42]
        assert sampler.padded_size(0) == 9 and sampler.padded_size(19) == 27
    with pytest.raises(ValueError, match="max_batch_size=42"):
        with sampler.split_for(pergrad.PerExampleModel(small_model(), "mean"), 3):
            pass
    with sampler.split_for(pergrad.PerExampleModel(small_model(), "mean"), 1):
        assert sampler.padded_sizes == [41]  # mean divides by the rows: always max_batch_size
    assert sampler.padded_sizes == [8, 16, 24, 32, 40, 41]  # outside a fit


def test_overflowing_the_batch_size_raises_instead_of_truncating():
    sampler = PoissonSampler(np.zeros((100, 1)), np.zeros(100), sampling_rate=0.5, max_batch_size=10, seed=0)
    with pytest.raises(BatchOverflowError, match="max_batch_size"):
        sampler[0]


@pytest.mark.parametrize("size, rate", [(60_000, 256 / 60_000), (1000, 0.1), (100, 0.5)])
def test_default_max_batch_size_bounds_the_overflow_probability(size, rate):
    from scipy import stats

    probability = 1e-9
    bound = privacy.max_batch_size_for(size, rate, probability)
    assert stats.binom.sf(bound, size, rate) <= probability  # P(X > bound)
    assert bound < size * rate + 10 * math.sqrt(size * rate) + 30  # and not absurdly large
    assert PoissonSampler(np.zeros((size, 1)), np.zeros(size), sampling_rate=rate).max_batch_size == bound


def test_poisson_sampler_refuses_multiprocessing_and_bad_arguments():
    x = np.zeros((10, 1))
    with pytest.raises(ValueError, match="multiprocessing"):
        PoissonSampler(x, x, sampling_rate=0.1, workers=2, use_multiprocessing=True)
    with pytest.raises(ValueError, match="sampling_rate"):
        PoissonSampler(x, x, sampling_rate=0.0)
    with pytest.raises(ValueError, match="targets"):
        PoissonSampler(x, None, sampling_rate=0.1)
    with pytest.raises(ValueError, match="first axis"):
        PoissonSampler(x, np.zeros(9), sampling_rate=0.1)


# -- validation --------------------------------------------------------------------------------


def small_model(*layers, inputs=(4,)):
    return keras.Sequential([keras.Input(inputs), *layers, keras.layers.Dense(1)])


def test_validation_refuses_layers_that_mix_examples_or_keep_data_state():
    with pytest.raises(NotPrivateError, match="BatchNormalization"):
        privacy.validate_model_for_dp(small_model(keras.layers.BatchNormalization()))
    with pytest.raises(NotPrivateError, match="activity_regularizer"):
        privacy.validate_model_for_dp(small_model(keras.layers.Dense(3, activity_regularizer="l2")))
    stateful = keras.Sequential(
        [keras.Input(batch_shape=(2, 3, 1)), keras.layers.SimpleRNN(2, stateful=True), keras.layers.Dense(1)]
    )
    with pytest.raises(NotPrivateError, match="stateful"):
        privacy.validate_model_for_dp(stateful)


def test_validation_accepts_per_example_layers_and_frozen_batch_norm():
    frozen = keras.layers.BatchNormalization()
    model = small_model(keras.layers.LayerNormalization(), frozen, keras.layers.Dropout(0.5))
    frozen.trainable = False
    privacy.validate_model_for_dp(model, x=np.ones((3, 4), "float32"))


def test_validation_with_data_finds_state_the_forward_pass_writes():
    class RunningMean(keras.layers.Layer):
        def build(self, input_shape):
            self.mean = self.add_weight(shape=input_shape[1:], initializer="zeros", trainable=False)

        def call(self, x, training=None):
            if training:
                self.mean.assign(0.9 * self.mean + 0.1 * ops.mean(x, axis=0))
            return x

    model = small_model(RunningMean())
    privacy.validate_model_for_dp(model)  # not detectable by type
    with pytest.raises(NotPrivateError, match="without noise"):
        privacy.validate_model_for_dp(model, x=np.ones((3, 4), "float32"))


def test_check_dp_fit_warns_without_poisson_sampling_and_checks_the_denominator():
    x, y = np.zeros((20, 4), "float32"), np.zeros((20, 1), "float32")
    sampler = PoissonSampler(x, y, sampling_rate=0.25, seed=0)
    private = pergrad.PerExampleModel(small_model(), dp_gaussian(1.0, 1.0, expected_batch_size=5.0))
    with pytest.warns(NotPoissonSampledWarning):
        privacy.check_dp_fit(private, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        privacy.check_dp_fit(private, sampler)
        privacy.check_dp_fit(pergrad.PerExampleModel(small_model(), "mean"), x)  # not DP: no check
    with pytest.raises(ValueError, match="expected_batch_size"):
        privacy.check_dp_fit(pergrad.PerExampleModel(small_model(), dp_gaussian(1.0, 1.0)), sampler)
    with pytest.warns(UserWarning, match="expected batch size"):
        privacy.check_dp_fit(
            pergrad.PerExampleModel(small_model(), dp_gaussian(1.0, 1.0, expected_batch_size=8)), sampler
        )
    with pytest.raises(NotPrivateError):
        privacy.check_dp_fit(
            pergrad.PerExampleModel(small_model(keras.layers.BatchNormalization()), dp_gaussian(1.0, 1.0)),
            sampler,
        )


# -- end to end --------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="pergrad_tests")
class TracingModel(pergrad.PerExampleModel):
    """Counts Python calls of ``train_step``: traces on JAX and TensorFlow, steps on torch."""

    def train_step(self, *args):
        self.__dict__["traces"] = self.__dict__.get("traces", 0) + 1
        return super().train_step(*args)


def test_dp_sgd_fit_logs_epsilon_saves_resumes_and_stops_at_the_budget(tmp_path, caplog):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    noise_multiplier, rate, delta = 1.0, 0.2, 1e-5
    sampler = PoissonSampler(x, y, sampling_rate=rate, seed=1)  # 5 steps per epoch
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    aggregator = dp_gaussian(
        1.0, noise_multiplier, expected_batch_size=sampler.expected_batch_size, seed=2, diagnostics=True
    )
    model = TracingModel(inner, aggregator)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    accountant = PrivacyAccountant(noise_multiplier, rate, delta)
    history = model.fit(sampler, epochs=2, verbose=0, callbacks=[accountant])

    expected = [privacy.epsilon(noise_multiplier, rate, steps, delta) for steps in (5, 10)]
    np.testing.assert_allclose(history.history["epsilon"], expected, rtol=1e-9)
    assert set(history.history) >= {"loss", "epsilon", "clipped_fraction", "gradient_norm"}
    # JAX traces the step once per bucket size met; TF once (its data has no static batch size).
    shapes = {sampler.padded_size(len(sampler.indices_for_step(t))) for t in range(10)}
    assert len(shapes) >= 2, shapes  # draws of 4 to 20 rows, buckets of 8
    if BACKEND in ("jax", "tensorflow"):
        assert model.traces == (len(shapes) if BACKEND == "jax" else 1), (model.traces, shapes)

    # Saving keeps the aggregator and its step count; with an explicit (insecure) seed
    # the noise is a function of (seed, step), so the loaded model continues it.
    path = tmp_path / "dp.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.aggregator, privacy.DPGaussian)
    assert loaded.aggregator.get_config() == model.aggregator.get_config()
    assert int(ops.convert_to_numpy(loaded.aggregator.step_count)) == 10
    np.testing.assert_array_equal(  # the noise of step 10, without taking a step
        ops.convert_to_numpy(loaded.aggregator.standard_normal(50, 10)),
        ops.convert_to_numpy(model.aggregator.standard_normal(50, 10)),
    )

    # Resuming counts the earlier steps; the budget stops training at the last allowed step.
    budget = privacy.epsilon(noise_multiplier, rate, 13, delta) + 1e-9
    limited = PrivacyAccountant(noise_multiplier, rate, delta, max_epsilon=budget)
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        history = model.fit(sampler, epochs=10, verbose=0, callbacks=[limited])
    # One line says why training stopped: the steps, the epsilon reached and the budget.
    said = [r.getMessage() for r in caplog.records if "PrivacyAccountant stopped" in r.getMessage()]
    assert said == [f"pergrad: PrivacyAccountant stopped training at the privacy budget: 13 steps taken, "
                    f"epsilon={limited.epsilon:.4g} reached, budget epsilon={budget:g} (delta={delta:g})."]
    assert limited.max_steps == 13
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 13
    assert history.history["epsilon"][-1] <= budget
    assert len(history.history["epsilon"]) == 1  # stopped inside the first epoch
    with pytest.raises(PrivacyBudgetExhaustedError):
        model.fit(sampler, epochs=1, verbose=0, callbacks=[limited])


class RecordingSampler(PoissonSampler):
    """Records the rows of every batch it serves."""

    def __getitem__(self, index):
        batch = super().__getitem__(index)
        self.__dict__.setdefault("rows", []).append(len(batch[2]))
        return batch


@pytest.mark.parametrize("rule", ["dp", "clip"])
def test_bucketed_batches_train_exactly_like_batches_of_max_batch_size(rule):
    """The padding changes nothing: the weights after a fit on buckets are those after
    a fit on one shape (``bucket_width=len(x)``), draws and noise alike (same seeds);
    a rule that counts the padding rows (``clip``) gets ``max_batch_size`` rows."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(80, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + rng.normal(size=(80, 1))).astype("float32")

    def fit(bucket_width):
        sampler = RecordingSampler(x, y, sampling_rate=0.2, seed=4, bucket_width=bucket_width)
        keras.utils.set_random_seed(0)
        inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(1)])
        aggregator = (dp_gaussian(0.5, 1.0, expected_batch_size=sampler.expected_batch_size, seed=5)
                      if rule == "dp" else pergrad.aggregators.clip(0.5))
        model = pergrad.PerExampleModel(inner, aggregator)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(sampler, epochs=1, verbose=0)
        return inner.get_weights(), sampler

    buckets, sampler = fit(None)
    one_shape, fixed = fit(len(x))
    for a, b in zip(buckets, one_shape):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    trained = sampler.rows[-len(sampler):]  # the batches of the 5 steps (after those Keras peeks at)
    assert set(fixed.rows) == {fixed.max_batch_size}
    if rule == "dp":
        assert max(trained) < sampler.max_batch_size and set(trained) <= set(sampler.padded_sizes)
        assert sum(trained) < 0.5 * len(trained) * sampler.max_batch_size
    else:
        assert set(sampler.rows) == {sampler.max_batch_size}


def test_accountant_refuses_a_noise_multiplier_the_model_does_not_use():
    sampler = PoissonSampler(np.zeros((20, 4), "float32"), np.zeros((20, 1), "float32"), sampling_rate=0.25)
    model = pergrad.PerExampleModel(small_model(), dp_gaussian(1.0, 1.0, expected_batch_size=5.0))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="does not match"):
        model.fit(sampler, epochs=1, verbose=0, callbacks=[PrivacyAccountant(2.0, 0.25, 1e-5)])
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant(1.0, 0.25, 1e-5, accountant="moments")
    with pytest.raises(ValueError, match="max_epsilon"):
        PrivacyAccountant(1.0, 0.25, 1e-5, max_epsilon=0.0)
