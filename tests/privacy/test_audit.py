"""The one-run audit (Steinke, Nasr and Jagielski, 2023): its bound against closed forms and
an independent loop, and small audits of pergrad's DP-SGD on digits with and without noise."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from pergrad import privacy
from pergrad.apps.demo import load_digits_split
from pergrad.privacy import audit, audit_p_value, best_guesses, epsilon_lower_bound


def binomial_tail(trials: int, successes: int, probability: float) -> float:
    """P[Binomial(trials, probability) >= successes], summed term by term."""
    return sum(
        math.comb(trials, k) * probability**k * (1 - probability) ** (trials - k)
        for k in range(successes, trials + 1)
    )


def paper_p_value(canaries, guesses, correct, epsilon, delta):
    """The paper's p-value (its reference code), as a plain loop over the shortfall i."""
    right = math.exp(epsilon) / (1 + math.exp(epsilon))
    tail = binomial_tail(guesses, correct, right)
    alpha, below = 0.0, 0.0  # below = P[correct - i <= W < correct]
    for i in range(1, correct + 1):
        k = correct - i
        below += math.comb(guesses, k) * right**k * (1 - right) ** (guesses - k)
        alpha = max(alpha, below / i)
    return min(tail + alpha * delta * 2 * canaries, 1.0)


@pytest.mark.parametrize("guesses,correct", [(10, 10), (50, 41), (100, 60), (100, 100), (30, 5)])
@pytest.mark.parametrize("epsilon", [0.0, 0.7, 2.5])
def test_p_value_is_the_binomial_tail_without_delta_and_the_papers_with_it(guesses, correct, epsilon):
    assert audit_p_value(200, guesses, correct, epsilon) == pytest.approx(
        binomial_tail(guesses, correct, math.exp(epsilon) / (1 + math.exp(epsilon))), rel=1e-9, abs=1e-15
    )
    for delta in (1e-5, 1e-3):
        assert audit_p_value(200, guesses, correct, epsilon, delta) == pytest.approx(
            paper_p_value(200, guesses, correct, epsilon, delta), rel=1e-9, abs=1e-15
        )


@pytest.mark.parametrize("guesses", [20, 150, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_all_right_guesses_give_the_closed_form(guesses, confidence):
    # delta = 0 and v = r: P[W >= r] = p^r, so the bound is logit((1 - confidence)^(1 / r)).
    right = (1 - confidence) ** (1 / guesses)
    expected = math.log(right / (1 - right))
    assert epsilon_lower_bound(1000, guesses, guesses, 0.0, confidence) == pytest.approx(expected, rel=1e-7)
    # A delta only weakens the refutation.
    assert epsilon_lower_bound(1000, guesses, guesses, 1e-5, confidence) < expected


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("guesses", [100, 1000])
def test_bound_exceeds_the_true_epsilon_at_most_one_minus_confidence(epsilon, guesses):
    # epsilon-DP randomized response is the null's worst case: its right guesses are exactly
    # Binomial(r, e^eps / (1 + e^eps)). The probability that the bound refutes the true epsilon
    # is at most 5%, and close to it (the bound is tight for randomized response).
    right = math.exp(epsilon) / (1 + math.exp(epsilon))

    def refutes(correct):
        return epsilon_lower_bound(guesses, guesses, correct, 0.0, 0.95) > epsilon

    low, high = 0, guesses + 1  # the fewest right guesses that refute: refutes() grows with them
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if middle <= guesses and refutes(middle) else (middle + 1, high)
    probability = binomial_tail(guesses, low, right) if low <= guesses else 0.0
    assert probability <= 0.05
    if guesses == 1000:
        assert probability > 0.025


def test_guesses_no_better_than_chance_refute_nothing():
    assert epsilon_lower_bound(100, 100, 50) == 0.0
    assert epsilon_lower_bound(100, 1, 1) == 0.0  # one right guess: p-value 1/2 at epsilon 0
    assert epsilon_lower_bound(100, 100, 0) == 0.0


def test_best_guesses_corrects_for_the_numbers_it_tries():
    scores = np.arange(100.0)
    membership = scores >= 50  # perfectly separable
    bound, made, right = best_guesses(scores, membership, [10, 100], 0.0, 0.95)
    assert (made, right) == (100, 100)
    assert bound == pytest.approx(epsilon_lower_bound(100, 100, 100, 0.0, 0.975))
    assert bound < epsilon_lower_bound(100, 100, 100, 0.0, 0.95)


@pytest.mark.parametrize(
    "arguments",
    [(10, 5, 6, 1.0, 0.0), (10, 11, 5, 1.0, 0.0), (10, 5, 3, -1.0, 0.0), (10, 5, 3, 1.0, 1.0)],
)
def test_bad_counts_and_parameters_are_refused(arguments):
    with pytest.raises(ValueError):
        audit_p_value(*arguments)


# A small audit: 300 digits, 200 canaries, q = 0.2 (5 steps an epoch), 8 epochs, one padded
# shape. The noise gives epsilon = 1 (delta = 1e-5).
REAL, CANARIES, RATE, EPOCHS, DELTA = 300, 200, 0.2, 8, 1e-5
NOISE = privacy.noise_multiplier_for(1.0, DELTA, RATE, EPOCHS * round(1 / RATE))


def small_audit(rule=None, seed=0):
    (x, y), _ = load_digits_split(0)
    return audit(
        data=(x[:REAL], y[:REAL]),
        noise_multiplier=NOISE,
        rule=rule,
        canaries=CANARIES,
        sampling_rate=RATE,
        bucket_width=REAL + CANARIES,
        epochs=EPOCHS,
        delta=DELTA,
        seed=seed,
    )


def test_audit_of_dp_sgd_stays_below_the_accountants_epsilon():
    result = small_audit()
    assert result.steps == EPOCHS * round(1 / RATE)
    assert result.epsilon == pytest.approx(1.0, abs=1e-3)
    # Measured on seeds 0-4 (jax) and 0-2 (tensorflow, torch): bounds of 0 to 0.19.
    assert result.epsilon_lower_bound <= result.epsilon
    assert f"epsilon >= {result.epsilon_lower_bound:.2f}" in str(result)
    assert "accountant epsilon = 1.00" in str(result)


def test_audit_catches_a_rule_that_adds_no_noise():
    def noiseless(expected_batch_size):
        return privacy.dp_gaussian(1.0, 0.0, expected_batch_size=expected_batch_size, seed=0)

    result = small_audit(rule=noiseless)
    # The accountant believes the noise multiplier: epsilon = 1. The audit refutes it.
    assert result.epsilon == pytest.approx(1.0, abs=1e-3)
    # An excluded canary has sample weight 0: without noise its row never moves.
    np.testing.assert_array_equal(result.scores[~result.membership], 0.0)
    # 150 right guesses out of 150 give 3.46 (the most 200 canaries can show at 95% over the
    # five numbers of guesses); measured 3.46 on seeds 0-4 (jax) and 0-2 (tensorflow, torch).
    assert result.epsilon_lower_bound > 3.0


def test_audit_refuses_what_its_canaries_cannot_enter():
    x = np.zeros((20, 4), "float32")
    y = np.zeros(20, "int32")

    def normalized(features):
        return keras.Sequential(
            [keras.Input((features,)), keras.layers.LayerNormalization(), keras.layers.Dense(2)]
        )

    with pytest.raises(ValueError, match="first layer must be a Dense"):
        audit(normalized, (x, y), canaries=4, seed=0)
    with pytest.raises(ValueError, match="integer class labels"):
        audit(data=(x, np.zeros(20, "float32")), canaries=4, seed=0)
    with pytest.raises(ValueError, match="flat features"):
        audit(data=(np.zeros((20, 2, 2), "float32"), y), canaries=4, seed=0)


def small_banded_audit(noise_multiplier, bands=4, seed=0):
    """The small audit with BandMF: 4 groups, each step one group at q = 0.2, so 8 epochs are
    160 steps and each canary takes part at most 40 times, DP-SGD's 40 steps: the same noise
    gives epsilon = 1."""
    (x, y), _ = load_digits_split(0)

    def rule(expected_batch_size):
        return privacy.banded_mf_gaussian(1.0, noise_multiplier, bands=bands,
                                          expected_batch_size=expected_batch_size, seed=seed)

    return audit(data=(x[:REAL], y[:REAL]), noise_multiplier=NOISE, rule=rule, canaries=CANARIES,
                 sampling_rate=RATE, cycle_length=4, bucket_width=REAL + CANARIES, epochs=EPOCHS,
                 delta=DELTA, seed=seed)


def test_audit_of_banded_mf_stays_below_its_epsilon_and_catches_it_without_noise():
    result = small_banded_audit(NOISE)
    assert result.steps == 4 * EPOCHS * round(1 / RATE)
    assert result.epsilon == pytest.approx(1.0, abs=1e-3)  # ceil(160 / 4) = 40 participations
    assert result.epsilon_lower_bound <= result.epsilon
    broken = small_banded_audit(0.0)
    assert broken.epsilon == pytest.approx(1.0, abs=1e-3)
    np.testing.assert_array_equal(broken.scores[~broken.membership], 0.0)
    assert broken.epsilon_lower_bound > 3.0
