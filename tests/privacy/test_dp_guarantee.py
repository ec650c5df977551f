"""DP-SGD's guarantee under ordinary use: resume, masks, noise secrecy, wrappers, quiet leaks.

One tiny problem throughout (20 examples, 3 features, Dense(1), q = 0.25: batches padded
to 8 or 16 rows), so JAX compiles few programs.
"""

from __future__ import annotations

import io
import zipfile

import h5py
import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad import privacy
from pergrad.aggregators import bucketing, chain, clip
from pergrad.backend import adapter
from pergrad.privacy import PoissonSampler, PrivacyAccountant, PrivacyBudgetExhaustedError, dp_gaussian, noise

BACKEND = keras.backend.backend()
SIZE, RATE, NOISE, DELTA, LR = 20, 0.25, 1.0, 1e-5, 0.1
BUDGET_STEPS = 10  # the budget below allows exactly this many steps (4 per epoch)
BUDGET = privacy.epsilon(NOISE, RATE, BUDGET_STEPS, DELTA) + 1e-9
SAMPLER_SEED, NOISE_SEED = 5, 7


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SIZE, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")


def sampler(seed=SAMPLER_SEED):
    return PoissonSampler(*data(), sampling_rate=RATE, seed=seed)


def dp_model(seed=NOISE_SEED, noise=NOISE, **rule):
    inner = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")]
    )
    expected = RATE * SIZE
    rule = dp_gaussian(1.0, noise, expected_batch_size=expected, seed=seed, **rule)
    model = pergrad.PerExampleModel(inner, rule)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    return model


def accountant():
    return PrivacyAccountant(NOISE, RATE, DELTA, max_epsilon=BUDGET)


def steps_of(model):
    return int(ops.convert_to_numpy(model.aggregator.step_count))


def weights_of(model):
    return [np.asarray(ops.convert_to_numpy(v)) for v in model.model.trainable_variables]


class CountSteps(keras.callbacks.Callback):
    """Counts the train steps run, across fits (independent of any step variable)."""

    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


class Interrupt(keras.callbacks.Callback):
    """Kills training when epoch ``epoch`` begins (after the previous epoch's backup)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.fixture(scope="module")
def uninterrupted():
    keras.utils.set_random_seed(1234)
    model, count = dp_model(), CountSteps()
    history = model.fit(sampler(), epochs=10, verbose=0, callbacks=[accountant(), count])
    return count.steps, history.history["epsilon"][-1], weights_of(model)


# -- 1. the step count is state of the DP rule; the accountant reads it ----------------------


@pytest.mark.parametrize(
    "resume", ["accountant_then_backup", "backup_then_accountant", "load_model_recompile", "weights_only"]
)
def test_a_resumed_run_stops_where_an_uninterrupted_one_does(resume, uninterrupted, tmp_path):
    """Every Keras resume path, in both callback orders, against the uninterrupted run: same
    total step count, same logged epsilon, and (explicit seeds: noise and batches are
    functions of (seed, step)) the same weights. A fit with the budget spent raises."""
    total, final_epsilon, final_weights = uninterrupted
    assert total == BUDGET_STEPS and final_epsilon <= BUDGET
    first, count = dp_model(), CountSteps()
    if "backup" in resume:
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))

        def order():
            return [accountant(), backup] if resume == "accountant_then_backup" else [backup, accountant()]

        with pytest.raises(RuntimeError, match="interrupted"):
            first.fit(sampler(), epochs=10, verbose=0, callbacks=[*order(), Interrupt(2), count])
        resumed = dp_model()  # a new process: model, sampler and callbacks re-created
        history = resumed.fit(sampler(), epochs=10, verbose=0, callbacks=[*order(), count])
    else:
        path = tmp_path / ("model.keras" if resume == "load_model_recompile" else "model.weights.h5")
        checkpoint = keras.callbacks.ModelCheckpoint(
            str(path), save_weights_only=resume == "weights_only", save_freq="epoch"
        )
        with pytest.raises(RuntimeError, match="interrupted"):
            callbacks = [accountant(), checkpoint, Interrupt(2), count]
            first.fit(sampler(), epochs=10, verbose=0, callbacks=callbacks)
        if resume == "load_model_recompile":
            resumed = keras.models.load_model(path)
            resumed.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")  # a fresh optimizer
        else:
            resumed = dp_model()
            resumed.load_weights(path)
        history = resumed.fit(sampler(), epochs=10, verbose=0, callbacks=[accountant(), count])
    assert count.steps == total
    assert history.history["epsilon"][-1] == pytest.approx(final_epsilon, rel=1e-12)
    for got, want in zip(weights_of(resumed), final_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert steps_of(resumed) == total
    with pytest.raises(PrivacyBudgetExhaustedError):
        resumed.fit(sampler(), epochs=1, verbose=0, callbacks=[accountant()])


def test_a_budget_spent_in_a_backup_raises_before_the_first_step(tmp_path):
    """The accountant listed before BackupAndRestore sees the restored count in time."""
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):  # 12 steps, no accountant
        dp_model().fit(sampler(), epochs=10, verbose=0, callbacks=[backup, Interrupt(3)])
    resumed = dp_model()
    with pytest.raises(PrivacyBudgetExhaustedError, match="12 were already taken"):
        resumed.fit(sampler(), epochs=10, verbose=0, callbacks=[accountant(), backup])
    assert steps_of(resumed) == 12


@pytest.mark.skipif(BACKEND == "torch", reason="Keras's torch fit() refuses steps_per_execution > 1")
def test_the_budget_holds_inside_a_group_of_steps_per_execution(uninterrupted):
    """Keras runs steps_per_execution steps without calling back in between: with 4 steps per
    group and a budget of 10, the third group used to train steps 9-12 (12 steps, epsilon over
    the budget). The train step refuses the steps past the limit: 10 steps, applied exactly as
    in the uninterrupted run with one step per execution."""
    total, final_epsilon, final_weights = uninterrupted
    model = dp_model()
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", steps_per_execution=4)
    budget = accountant()
    history = model.fit(sampler(), epochs=10, verbose=0, callbacks=[budget])
    assert steps_of(model) == total == BUDGET_STEPS
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == BUDGET_STEPS
    assert history.history["epsilon"][-1] == pytest.approx(final_epsilon, rel=1e-12)
    assert history.history["epsilon"][-1] <= BUDGET
    for got, want in zip(weights_of(model), final_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The limit belongs to that fit: without an accountant the rule trains on.
    model.fit(sampler(), epochs=1, verbose=0)
    assert steps_of(model) == BUDGET_STEPS + 4


# -- 2. masked outputs -------------------------------------------------------------------------


def test_a_dp_rule_refuses_a_masked_output_and_names_the_alternative():
    """Keras divides a masked loss by the batch's unmasked count: one record would move
    the others' gradients before clipping. Refused when the step is traced."""
    inputs = keras.Input((4,), dtype="int32")
    hidden = keras.layers.Embedding(5, 3, mask_zero=True)(inputs)
    model = pergrad.PerExampleModel(
        keras.Model(inputs, keras.layers.Dense(1)(hidden)), dp_gaussian(1.0, 0.0, expected_batch_size=2.0)
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.array([[1, 2, 0, 0], [3, 1, 2, 0]], "int32")
    with pytest.raises(ValueError, match="masked output.*sample_weight"):
        model.train_on_batch(x, np.zeros((2, 4, 1), "float32"))


# -- 3. the noise is secret --------------------------------------------------------------------


def noise_of(rule, size=4000):
    """One noisy step on zero gradients: pure noise."""
    return np.asarray(ops.convert_to_numpy(rule([ops.zeros((2, size))])[0]))


def test_noise_ignores_the_global_seed():
    """The key comes from `secrets`: two rules built after the same set_random_seed (as two
    processes with the same script would) draw unrelated noise."""
    keras.utils.set_random_seed(0)
    first_rule = dp_gaussian(1.0, 1.0)
    first = noise_of(first_rule)
    keras.utils.set_random_seed(0)
    second_rule = dp_gaussian(1.0, 1.0)
    second = noise_of(second_rule)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.1
    # Copying the variables (get_weights/set_weights) does not copy the key.
    for source, target in zip(first_rule.weights, second_rule.weights):
        target.assign(ops.convert_to_numpy(source) - (1 if "step" in source.path else 0))
    assert abs(np.corrcoef(first, noise_of(second_rule))[0, 1]) < 0.1
    # An explicit seed is reproducible (and insecure), whatever the global seed.
    keras.utils.set_random_seed(1)
    seeded = noise_of(dp_gaussian(1.0, 1.0, seed=3))
    keras.utils.set_random_seed(2)
    np.testing.assert_array_equal(seeded, noise_of(dp_gaussian(1.0, 1.0, seed=3)))


def test_every_key_bit_changes_the_noise_on_every_backend():
    """At least 128 bits key each draw, torch included (whose own generators take a 32- or
    64-bit seed): flipping any one of the key's bits (in ``noise_key``; the hidden half is
    XORed with it bit for bit) changes every one of a step's noise values."""
    rule = dp_gaussian(1.0, 1.0)
    rule.build()
    words = np.asarray(ops.convert_to_numpy(rule.noise_key))
    assert words.size * 32 >= 256
    draw = adapter().compile(lambda key: noise.gaussian_noise(key, 3, 16, 1.0))  # the rule's draw, jitted
    base = np.asarray(ops.convert_to_numpy(draw(rule._key())))
    # (jitted and eager XLA may round a logarithm differently in the last bit)
    np.testing.assert_allclose(base, ops.convert_to_numpy(rule.standard_normal(16, 3)), rtol=1e-6)
    for bit in range(words.size * 32):
        flipped = words.view(np.uint32).copy()
        flipped[bit // 32] ^= np.uint32(1 << (bit % 32))
        rule.noise_key.assign(flipped.view(np.int32))
        changed = np.asarray(ops.convert_to_numpy(draw(rule._key()))) != base
        assert changed.all(), bit


def test_saved_models_hold_no_key_and_restoring_does_not_replay_the_noise(tmp_path):
    """Zero data and zero weights: every update is pure noise. A model saved before a step
    and loaded again (load_model, or load_weights into the same model) must not add the
    noise the original added at that step; the file holds the step count, not the key."""
    zeros = np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32")

    def build():
        inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        model = pergrad.PerExampleModel(inner, dp_gaussian(1.0, 1.0))
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        return model

    def one_step(model):
        before = np.concatenate([w.ravel() for w in weights_of(model)])
        model.train_on_batch(*zeros)
        return np.concatenate([w.ravel() for w in weights_of(model)]) - before

    model = build()
    path, weights = tmp_path / "m.keras", tmp_path / "m.weights.h5"
    model.save(path)
    model.save_weights(weights)
    original = one_step(model)
    assert np.all(original != 0)
    loaded = keras.models.load_model(path)
    assert steps_of(loaded) == 0
    assert not np.allclose(one_step(loaded), original)
    model.load_weights(weights)  # the same instance, rewound to step 0
    assert steps_of(model) == 0
    assert not np.allclose(one_step(model), original)

    key_words = set(np.ravel(ops.convert_to_numpy(model.aggregator.noise_key)).tolist())
    assert len(key_words) > 5
    with zipfile.ZipFile(path) as archive:
        stored = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
        names, values = [], []
        stored.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
        for name in names:
            values.extend(np.ravel(stored[name][()]).tolist())
    assert not any("seed" in name for name in names), names
    assert key_words.isdisjoint(int(v) for v in values if float(v).is_integer())


# -- 4. DP rules only outermost; non-finite examples zeroed by the model -----------------------


def test_dp_rules_are_refused_inside_wrappers():
    assert pergrad.aggregators.get("mean").differentially_private is False
    assert dp_gaussian(1.0, 1.0).differentially_private is True
    for build in (
        lambda: bucketing(2, dp_gaussian(1.0, 1.0)),
        lambda: chain(clip(1.0), dp_gaussian(1.0, 1.0)),
    ):
        with pytest.raises(ValueError, match="differentially private.*outermost|differentially private"):
            build()
    assert chain(clip(1.0), "mean").differentially_private is False


def test_the_model_zeroes_a_non_finite_example_before_the_dp_rule():
    """A NaN example in a noise-free DP step changes nothing: the update equals that of the
    batch with the example's weight 0. A NaN update would reveal its presence."""
    x, y = data()
    x, y = x[:5].copy(), y[:5].copy()
    updates = []
    for poison in (False, True):
        model = dp_model(seed=None, noise=0.0)
        weights = np.ones(5, "float32")
        batch_x = x.copy()
        if poison:
            batch_x[2] = np.nan
        else:
            weights[2] = 0.0
        before = weights_of(model)
        model.train_on_batch(batch_x, y, sample_weight=weights)
        updates.append([a - b for a, b in zip(weights_of(model), before)])
    for poisoned, clean in zip(updates[1], updates[0]):
        assert np.all(np.isfinite(poisoned))
        np.testing.assert_allclose(poisoned, clean, rtol=1e-5, atol=1e-7)


# -- 5. quieter leaks --------------------------------------------------------------------------


def test_fit_refuses_an_accountant_whose_sampling_rate_is_not_the_samplers():
    model = dp_model()
    with pytest.raises(ValueError, match="sampling_rate"):
        model.fit(sampler(), epochs=1, verbose=0, callbacks=[PrivacyAccountant(NOISE, 0.01, DELTA)])
    with pytest.raises(ValueError, match="noise_multiplier"):
        model.fit(sampler(), epochs=1, verbose=0, callbacks=[PrivacyAccountant(2.0, RATE, DELTA)])
    assert steps_of(model) == 0


def test_sampler_draws_are_a_function_of_seed_and_step():
    straight = sampler()
    draws = [straight[0][1] for _ in range(6)]
    resumed = sampler()
    resumed.set_step(4)
    for step in (4, 5):
        np.testing.assert_array_equal(resumed[0][1], draws[step])
    secret = sampler(seed=None)
    first = [secret.sample_indices() for _ in range(3)]
    secret.set_step(0)  # a restore with a secret seed: fresh draws, no replay
    assert any(not np.array_equal(a, secret.sample_indices()) for a in first)


def test_dp_diagnostics_are_off_unless_asked_and_dp_arguments_must_be_finite():
    """clipped_fraction and gradient_norm are computed without noise: not logged by default."""
    history = dp_model().fit(sampler(), epochs=1, verbose=0)
    assert not {"clipped_fraction", "gradient_norm"} & set(history.history)
    history = dp_model(diagnostics=True).fit(sampler(), epochs=1, verbose=0)
    assert {"clipped_fraction", "gradient_norm"} <= set(history.history)
    for arguments in ((float("inf"), 1.0), (1.0, float("inf")), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="finite"):
            dp_gaussian(*arguments)
    with pytest.raises(ValueError, match="finite"):
        dp_gaussian(1.0, 1.0, expected_batch_size=float("inf"))


def test_fine_tuning_a_dp_model_keeps_its_step_count():
    """Freeze a layer and recompile mid-training (the fine-tuning workflow): the DP rule's
    state is not per variable, so it carries on and the accountant counts every step."""
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    rule = dp_gaussian(1.0, NOISE, expected_batch_size=RATE * SIZE, seed=NOISE_SEED)
    model = pergrad.PerExampleModel(inner, rule)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    model.fit(sampler(), epochs=1, verbose=0)
    inner.layers[0].trainable = False
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    history = model.fit(sampler(), epochs=1, verbose=0, callbacks=[PrivacyAccountant(NOISE, RATE, DELTA)])
    assert steps_of(model) == 2 * round(1 / RATE)
    expected = privacy.epsilon(NOISE, RATE, steps_of(model), DELTA)
    assert history.history["epsilon"][-1] == pytest.approx(expected)


def test_callbacks_given_positionally_still_sync_the_sampler():
    """fit(x, y, batch_size, epochs, verbose, callbacks): the resumed sampler draws steps 4-7."""
    straight = dp_model()
    straight.fit(sampler(), epochs=2, verbose=0)
    resumed = dp_model()
    resumed.fit(sampler(), epochs=1, verbose=0)
    resumed.fit(sampler(), None, None, 1, 0, [keras.callbacks.History()])
    assert steps_of(resumed) == steps_of(straight)
    for got, want in zip(weights_of(resumed), weights_of(straight)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
