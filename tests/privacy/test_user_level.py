"""User-level DP-SGD: against a NumPy reference, its noise, its refusals, its sampler."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import privacy
from pergrad.distributed import training
from pergrad.privacy import UserSampler, dp_gaussian, user_level_dp_gaussian

# Units of every size 1..K, interleaved (a unit's examples need not be contiguous).
K = 3
SIZES = [1, 2, 3, 1, 3, 2]
CLIP, EXPECTED = 0.7, 5.0


def batch(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.repeat(np.arange(len(sizes)), sizes)).astype("int32")
    x = rng.normal(size=(len(ids), 5)).astype("float32")
    y = (3.0 * rng.normal(size=(len(ids), 2))).astype("float32")
    return x, y, ids


def network():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    )


def flat_values(model):
    return np.concatenate([np.ravel(ops.convert_to_numpy(v)) for v in model.trainable_variables])


def reference_update(x, y, ids, clip=CLIP, expected=EXPECTED):
    """NumPy: per-example gradients summed per user, each sum clipped to C, summed, / E."""
    grads = pergrad.per_example_gradients(network(), x, y, loss="mse")
    flat = np.concatenate([np.asarray(ops.convert_to_numpy(g), "float64").reshape(len(x), -1)
                           for g in grads], axis=1)
    total = np.zeros(flat.shape[1])
    for unit in np.unique(ids):
        summed = flat[ids == unit].sum(axis=0)
        total += summed * min(1.0, clip / np.linalg.norm(summed))
    return total / expected


def trained_update(rule, x, y, ids=None, **options):
    """One SGD(1) step of ``rule`` through ``PerExampleModel``: minus the aggregated gradient."""
    inner = network()
    before = flat_values(inner)
    model = pergrad.PerExampleModel(inner, rule, **options)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    inputs = x if ids is None else {privacy.UNIT_INPUTS: x, privacy.UNIT_IDS: ids}
    model.train_on_batch(inputs, y)
    return before - flat_values(inner)


# -- exact against the materialized reference, noise 0 ---------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"path": "statistics"}, {"path": "materialized"}, {"microbatch_size": 4}],
    ids=["statistics", "materialized", "chunked"],
)
def test_each_users_summed_gradient_is_clipped_then_summed(options):
    x, y, ids = batch()
    rule = user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=EXPECTED)
    expected = reference_update(x, y, ids)
    # The reference clips some users and not others.
    np.testing.assert_allclose(trained_update(rule, x, y, ids, **options), expected, rtol=1e-5, atol=1e-5)


def test_users_of_one_example_train_exactly_like_example_level_dp_gaussian():
    x, y, _ = batch()
    ids = np.arange(len(x), dtype="int32")[::-1].copy()
    user_level = trained_update(user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=EXPECTED), x, y, ids)
    example_level = trained_update(dp_gaussian(CLIP, 0.0, expected_batch_size=EXPECTED), x, y)
    np.testing.assert_allclose(user_level, example_level, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(user_level, reference_update(x, y, ids), rtol=1e-5, atol=1e-5)


def test_a_padded_user_sampler_batch_trains_like_the_reference_of_its_real_rows():
    x, y, ids = batch(sizes=[4, 1, 5, 2, 3, 6, 1, 2], seed=1)
    sampler = UserSampler(x, y, users=ids, sampling_rate=0.6, examples_per_user=K, seed=4)
    inputs, targets, weights = sampler[0]
    real = int(weights.sum())
    assert 0 < real < len(weights)  # padded
    kept_x, kept_ids = inputs[privacy.UNIT_INPUTS][:real], inputs[privacy.UNIT_IDS][:real]
    inner = network()
    before = flat_values(inner)
    model = pergrad.PerExampleModel(
        inner, user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=sampler.expected_batch_size)
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    model.train_on_batch(inputs, targets, sample_weight=weights)
    expected = reference_update(kept_x, targets[:real], kept_ids, expected=sampler.expected_batch_size)
    np.testing.assert_allclose(before - flat_values(inner), expected, rtol=1e-5, atol=1e-5)


def test_a_user_whose_gram_block_overflows_is_still_clipped_to_at_most_c():
    """Gradients of 1e20: every Gram entry overflows float32; the triangle bound clips."""
    rng = np.random.default_rng(2)
    gradients = [(1e20 * rng.normal(size=(4, 3))).astype("float32")]
    ids = np.array([0, 0, 1, 1], "int32")
    rule = user_level_dp_gaussian(1.0, 0.0, expected_batch_size=1.0)
    result = np.asarray(ops.convert_to_numpy(rule([ops.convert_to_tensor(gradients[0])], units=ids)[0]))
    assert np.all(np.isfinite(result))
    # Two users, each clipped to at most 1, in nearly their own direction.
    assert 0.5 < np.linalg.norm(result) <= 2.0 + 1e-5


# -- noise ---------------------------------------------------------------------------------


def test_noise_standard_deviation_is_noise_multiplier_times_clip_over_expected_users():
    rng = np.random.default_rng(5)
    ids = np.array([0, 0, 1, 2, 2, 2], "int32")
    gradients = [ops.convert_to_tensor(rng.normal(size=(6, 8192)).astype("float32"))]
    noisy = user_level_dp_gaussian(CLIP, 1.3, expected_batch_size=EXPECTED, seed=7)
    clean = user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=EXPECTED)
    difference = np.asarray(ops.convert_to_numpy(noisy(gradients, units=ids)[0])) - np.asarray(
        ops.convert_to_numpy(clean(gradients, units=ids)[0]))
    std = 1.3 * CLIP / EXPECTED
    assert abs(difference.std() - std) < 0.03 * std
    assert abs(difference.mean()) < 0.03 * std


# -- refusals ------------------------------------------------------------------------------


def compiled(rule, **options):
    model = pergrad.PerExampleModel(network(), rule, **options)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    return model


def test_a_user_level_rule_refuses_a_batch_without_user_ids():
    x, y, _ = batch()
    model = compiled(user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=EXPECTED))
    with pytest.raises(ValueError, match="needs the user id of every example"):
        model.train_on_batch(x, y)


@pytest.mark.parametrize("rule", [lambda: dp_gaussian(CLIP, 0.0, expected_batch_size=EXPECTED),
                                  lambda: pergrad.aggregators.clip(CLIP)], ids=["dp_gaussian", "clip"])
def test_a_rule_that_does_not_read_user_ids_refuses_a_batch_with_them(rule):
    x, y, ids = batch()
    model = compiled(rule())
    with pytest.raises(ValueError, match="does not read them"):
        model.train_on_batch({privacy.UNIT_INPUTS: x, privacy.UNIT_IDS: ids}, y)


def test_the_sampler_must_sample_the_unit_the_rule_bounds():
    x, y, ids = batch()
    users = UserSampler(x, y, users=ids, sampling_rate=0.5, examples_per_user=K, seed=1)
    examples = privacy.PoissonSampler(x, y, sampling_rate=0.5, seed=1)
    example_rule = compiled(dp_gaussian(CLIP, 1.0, expected_batch_size=users.expected_batch_size))
    with pytest.raises(ValueError, match="samples users"):
        example_rule.fit(users, epochs=1, verbose=0)
    user_rule = compiled(user_level_dp_gaussian(CLIP, 1.0, expected_batch_size=examples.expected_batch_size))
    with pytest.raises(ValueError, match="samples examples"):
        user_rule.fit(examples, epochs=1, verbose=0)


def test_the_accountant_must_guarantee_the_unit_the_rule_bounds():
    x, y, ids = batch()
    sampler = UserSampler(x, y, users=ids, sampling_rate=0.5, examples_per_user=K, seed=1)
    model = compiled(user_level_dp_gaussian(CLIP, 1.0, expected_batch_size=sampler.expected_batch_size))
    with pytest.raises(ValueError, match="unit='user'"):
        model.fit(sampler, epochs=1, verbose=0,
                  callbacks=[privacy.PrivacyAccountant(1.0, 0.5, delta=1e-5)])
    with pytest.raises(ValueError, match="unit must be one of"):
        privacy.PrivacyAccountant(1.0, 0.5, delta=1e-5, unit="person")


def test_per_layer_clipping_and_several_tf_replicas_are_refused():
    with pytest.raises(ValueError, match="per_layer"):
        privacy.UserLevelDPGaussian(CLIP, 1.0, per_layer=True)
    reason = training.refusal(compiled(user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=1.0)))
    assert reason is not None
    if keras.backend.backend() == "tensorflow":  # elsewhere every replicated step is refused
        assert "part of a user" in reason


def test_the_network_never_sees_the_user_ids():
    x, y, ids = batch()
    seen = []

    class Record(keras.layers.Layer):
        def call(self, inputs):
            seen.append(inputs)
            return inputs

    keras.utils.set_random_seed(3)
    inner = keras.Sequential([keras.Input((5,)), Record(), keras.layers.Dense(2)])
    model = pergrad.PerExampleModel(inner, user_level_dp_gaussian(CLIP, 0.0, expected_batch_size=1.0))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    model.train_on_batch({privacy.UNIT_INPUTS: x, privacy.UNIT_IDS: ids}, y)
    model.predict({privacy.UNIT_INPUTS: x, privacy.UNIT_IDS: ids}, verbose=0)
    assert seen and all(not isinstance(s, dict) and tuple(s.shape)[-1] == 5 for s in seen)


# -- the sampler and the accounting -------------------------------------------------------


def test_the_user_sampler_includes_each_user_with_probability_q_and_at_most_k_examples():
    rng = np.random.default_rng(8)
    sizes = rng.integers(1, 8, size=40)
    users = rng.permutation(np.repeat(np.arange(100, 140), sizes))  # ids need not be 0..U-1
    x = np.arange(len(users), dtype="float32")[:, None]
    rate, k, steps = 0.2, 3, 400
    sampler = UserSampler(x, x, users=users, sampling_rate=rate, examples_per_user=k, seed=9)
    assert sampler.expected_batch_size == pytest.approx(rate * 40)
    included = np.zeros(40)
    for t in range(steps):
        inputs, _, weights = sampler[t]
        real = int(weights.sum())
        rows = inputs[privacy.UNIT_INPUTS][:real, 0].astype(int)
        batch_ids = inputs[privacy.UNIT_IDS]
        assert np.all(batch_ids[real:] == -1) and np.all(weights[real:] == 0)
        # Each row is its user's example, each included user has min(n_u, k) distinct rows.
        np.testing.assert_array_equal(sampler.users[batch_ids[:real]], users[rows])
        assert len(set(rows)) == real
        drawn, counts = np.unique(batch_ids[:real], return_counts=True)
        np.testing.assert_array_equal(counts, np.minimum(np.bincount(sampler.unit_of_example)[drawn], k))
        included[drawn] += 1
    # Each user's inclusion count is Binomial(steps, q): within 5 standard deviations.
    assert np.all(np.abs(included - rate * steps) < 5 * math.sqrt(steps * rate * (1 - rate)))
    assert abs(included.mean() - rate * steps) < 5 * math.sqrt(steps * rate * (1 - rate) / 40)
    # The draw of a step is a pure function of (seed, step).
    again = UserSampler(x, x, users=users, sampling_rate=rate, examples_per_user=k, seed=9)
    np.testing.assert_array_equal(again.indices_for_step(17), sampler.indices_for_step(17))


def test_a_user_level_fit_accounts_for_users():
    x, y, ids = batch(sizes=[2, 3, 1, 3, 2, 1, 3, 2])
    rate, noise = 0.5, 1.1
    sampler = UserSampler(x, y, users=ids, sampling_rate=rate, examples_per_user=K, seed=3,
                          steps_per_epoch=2)
    model = compiled(user_level_dp_gaussian(CLIP, noise, expected_batch_size=sampler.expected_batch_size))
    accountant = privacy.PrivacyAccountant(noise, rate, delta=1e-5, unit="user")
    history = model.fit(sampler, epochs=1, verbose=0, callbacks=[accountant])
    assert history.history["epsilon"][-1] == pytest.approx(privacy.epsilon(noise, rate, 2, 1e-5))
    assert accountant.unit == "user" and "one user (all of its examples)" in accountant.guarantee


def test_config_round_trip():
    rule = user_level_dp_gaussian(CLIP, 1.1, expected_batch_size=3.0, seed=2)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(rule))
    assert type(restored) is privacy.UserLevelDPGaussian
    assert restored.get_config() == rule.get_config() and restored.privacy_unit == "user"


def test_a_saved_model_loads_with_its_user_level_rule_and_step_count(tmp_path):
    x, y, ids = batch()
    model = compiled(user_level_dp_gaussian(CLIP, 1.0, expected_batch_size=EXPECTED, seed=1))
    model.train_on_batch({privacy.UNIT_INPUTS: x, privacy.UNIT_IDS: ids}, y)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.aggregator) is privacy.UserLevelDPGaussian
    assert int(ops.convert_to_numpy(loaded.aggregator.step_count)) == 1
    with pytest.raises(ValueError, match="needs the user id of every example"):
        loaded.train_on_batch(x, y)
