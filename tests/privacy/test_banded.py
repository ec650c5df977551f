"""Banded matrix factorization's foundations: the strategy and its noise recurrence, the
min-separation sensitivity, the cyclic Poisson sampler, the amplified accounting, and the
privacy cost of tuning (Papernot–Steinke). NumPy and dp-accounting only, so the same on every
backend; checked against jax-privacy where it is installed."""

from __future__ import annotations

import itertools
import math
from math import comb

import numpy as np
import pytest

import pergrad
from pergrad import privacy
from pergrad.privacy import BandedStrategy, CyclicPoissonSampler, PoissonSampler

dp_accounting = pytest.importorskip("dp_accounting")


def _jax_privacy(module):
    return pytest.importorskip(f"jax_privacy.{module}")


# --- the strategy and its noise ---------------------------------------------------------------


def test_fhu_coefficients_are_the_square_root_of_the_prefix_sum_matrix():
    coefficients = privacy.fhu_coefficients(12)
    np.testing.assert_allclose(coefficients, [comb(2 * k, k) / 4**k for k in range(12)], rtol=1e-15)
    C = BandedStrategy(coefficients).matrix(12)
    np.testing.assert_allclose(C @ C, np.tril(np.ones((12, 12))), atol=1e-12)
    strategy = BandedStrategy.fhu(5)
    np.testing.assert_allclose(strategy.coefficients, coefficients[:5] / np.linalg.norm(coefficients[:5]))
    assert strategy.max_column_norm == pytest.approx(1.0)
    # jax-privacy's closed form is the same
    toeplitz = _jax_privacy("matrix_factorization.toeplitz")
    np.testing.assert_allclose(toeplitz.optimal_max_error_strategy_coefs(12), coefficients, rtol=1e-6)


@pytest.mark.parametrize("bands", [1, 2, 3, 8, 64])
def test_the_recurrence_applies_the_inverse_of_the_banded_matrix(bands):
    steps = 300
    strategy = BandedStrategy.fhu(bands)
    C = strategy.matrix(steps)
    assert np.all(C[np.subtract.outer(np.arange(steps), np.arange(steps)) >= bands] == 0)
    z = np.random.default_rng(bands).standard_normal((steps, 4, 3))
    noise = strategy.correlate(z)
    expected = np.linalg.solve(C, z.reshape(steps, -1)).reshape(z.shape)
    assert np.max(np.abs(noise - expected)) < 1e-12
    # one step at a time on b - 1 buffers, as the rule will
    buffers = strategy.initial_buffers((4, 3))
    assert buffers.shape == (bands - 1, 4, 3)
    for t in range(steps):
        w, buffers = privacy.correlate_step(z[t], buffers, strategy.coefficients)
        np.testing.assert_array_equal(w, noise[t])
    scale, feedback = strategy.recurrence
    assert scale == 1 / strategy.coefficients[0] and feedback.shape == (bands - 1,)
    np.testing.assert_allclose(strategy.inverse_coefficients(steps), np.linalg.inv(C)[:, 0], atol=1e-12)


def test_one_band_is_dp_sgd_noise():
    strategy = BandedStrategy.fhu(1)
    assert strategy.coefficients.tolist() == [1.0] and strategy.bands == 1
    z = np.random.default_rng(0).standard_normal((50, 7))
    np.testing.assert_array_equal(strategy.correlate(z), z)
    np.testing.assert_array_equal(strategy.matrix(6), np.eye(6))
    np.testing.assert_array_equal(strategy.prefix_error(5), [1, 2, 3, 4, 5])


def test_the_noise_stays_bounded_and_the_prefix_sums_get_less():
    # FHU coefficients are positive and decreasing: no root of sum c_k x^k in the unit disk
    errors = []
    for bands in (1, 2, 16, 64):
        strategy = BandedStrategy.fhu(bands)
        roots = np.roots(strategy.coefficients[::-1])
        assert np.all(np.abs(roots) > 1)
        variance = strategy.noise_variance(5000)
        assert variance[-1] - variance[-1000] < 1e-6 * variance[-1]  # converged
        errors.append(strategy.prefix_error(1000)[-1])
    # at equal sensitivity (column norms 1), less noise in the prefix sums with more bands
    assert errors[0] == 1000 and np.all(np.diff(errors) < 0) and errors[-1] < 0.04 * 1000


def test_the_strategy_refuses_what_is_not_one():
    for coefficients in ([], [[1.0]], [0.0, 1.0], [-1.0], [1.0, np.nan]):
        with pytest.raises(ValueError):
            BandedStrategy(coefficients)
    for bands in (0, 1.5, True):
        with pytest.raises(ValueError, match="bands"):
            BandedStrategy.fhu(bands)


# --- sensitivity under min-separation ---------------------------------------------------------


def _brute_force_sensitivity(C, separation, participations):
    """max over participation patterns (at most ``participations`` steps, ``separation`` apart)
    of sum_{i, j} |C^T C|_{ij}: the squared sensitivity for arbitrary gradients of norm 1."""
    X = np.abs(C.T @ C)
    best = 0.0
    steps = len(C)
    for count in range(1, participations + 1):
        for pattern in itertools.combinations(range(steps), count):
            if all(b - a >= separation for a, b in itertools.pairwise(pattern)):
                best = max(best, X[np.ix_(pattern, pattern)].sum())
    return math.sqrt(best)


@pytest.mark.parametrize("bands,separation,participations", [
    (3, 3, None), (3, 4, 2), (4, 2, None), (4, 1, 3), (1, 1, None), (5, 3, 2),
])
def test_min_separation_sensitivity(bands, separation, participations):
    steps = 12
    strategy = BandedStrategy.fhu(bands)
    found = strategy.sensitivity(steps, separation, participations)
    most = math.ceil(steps / separation) if participations is None else participations
    assert found == pytest.approx(_brute_force_sensitivity(strategy.matrix(steps), separation, most))
    if separation >= bands:  # disjoint columns: sqrt(k) for norm-1 columns of full length
        assert found <= math.sqrt(most) + 1e-12
    toeplitz = _jax_privacy("matrix_factorization.toeplitz")
    theirs = toeplitz.minsep_sensitivity_squared(
        strategy.coefficients, separation, max_participations=participations, n=steps)
    assert found == pytest.approx(math.sqrt(float(theirs)), rel=1e-5)


def test_the_sensitivity_of_other_coefficients_needs_separated_participations():
    strategy = BandedStrategy([1.0, -0.5, 0.25])
    assert strategy.sensitivity(9, 3) == pytest.approx(
        _brute_force_sensitivity(strategy.matrix(9), 3, 3))
    with pytest.raises(ValueError, match="cycle_length=3"):
        strategy.sensitivity(9, 2)


@pytest.mark.parametrize("steps,bands", [(64, 4), (512, 16)])
def test_optimized_coefficients_match_jax_privacy(steps, bands):
    optimized = BandedStrategy.optimized(bands, steps)
    assert optimized.max_column_norm == pytest.approx(1.0)
    assert optimized.loss(steps) < BandedStrategy.fhu(bands).loss(steps)
    toeplitz = _jax_privacy("matrix_factorization.toeplitz")
    theirs = np.asarray(toeplitz.optimize_banded_toeplitz(steps, bands), dtype=np.float64)
    assert BandedStrategy(theirs).loss(steps) == pytest.approx(float(toeplitz.loss(theirs, steps)), rel=1e-4)
    assert optimized.loss(steps) <= BandedStrategy(theirs).loss(steps) * (1 + 1e-4)


# --- the cyclic Poisson sampler ---------------------------------------------------------------

SIZE = 600


def data(size=SIZE):
    return np.arange(size, dtype="float32")[:, None], np.arange(size)


def _participations(sampler, steps):
    """{example: the steps it was drawn at}."""
    drawn = {}
    for step in range(steps):
        for example in sampler.indices_for_step(step):
            drawn.setdefault(int(example), []).append(step)
    return drawn


@pytest.mark.parametrize("cycle", [2, 5])
def test_participations_are_at_least_a_cycle_apart(cycle):
    sampler = CyclicPoissonSampler(*data(), sampling_rate=0.5, cycle_length=cycle, seed=3)
    steps = 12 * cycle
    drawn = _participations(sampler, steps)
    assert len(drawn) > 0.95 * SIZE
    for example, when in drawn.items():
        assert {step % cycle for step in when} == {sampler._groups[example]}
        assert np.all(np.diff(when) >= cycle)
    assert max(len(when) for when in drawn.values()) <= sampler.participations(steps) == 12
    assert sampler.min_separation == cycle
    # Poisson at rate q inside a group: sizes and inclusion frequency
    counts = np.bincount(sampler._groups, minlength=cycle)
    sizes = [len(sampler.indices_for_step(step)) for step in range(400)]
    assert np.mean(sizes) == pytest.approx(0.5 * SIZE / cycle, rel=0.05)
    assert sampler.expected_batch_size == 0.5 * SIZE / cycle
    assert counts.min() > 0.7 * SIZE / cycle  # the groups are uniform
    frequency = sum(len(when) for when in drawn.values()) / (SIZE * steps / cycle)
    assert frequency == pytest.approx(0.5, abs=0.03)


def test_the_draws_are_a_pure_function_of_seed_and_step():
    first = CyclicPoissonSampler(*data(), sampling_rate=0.3, cycle_length=4, seed=11)
    second = CyclicPoissonSampler(*data(), sampling_rate=0.3, cycle_length=4, seed=11)
    other = CyclicPoissonSampler(*data(), sampling_rate=0.3, cycle_length=4, seed=12)
    for step in (7, 0, 3, 7, 100):
        np.testing.assert_array_equal(first.indices_for_step(step), second.indices_for_step(step))
    assert any(not np.array_equal(first.indices_for_step(s), other.indices_for_step(s)) for s in range(8))
    second.set_step(5)
    for step in range(5, 9):
        np.testing.assert_array_equal(second.sample_indices(), first.indices_for_step(step))
    # one group is PoissonSampler, draw for draw
    poisson = PoissonSampler(*data(), sampling_rate=0.3, seed=11)
    cyclic = CyclicPoissonSampler(*data(), sampling_rate=0.3, cycle_length=1, seed=11)
    for step in range(5):
        np.testing.assert_array_equal(cyclic.indices_for_step(step), poisson.indices_for_step(step))
    assert (cyclic.max_batch_size, cyclic.bucket_width, len(cyclic)) == (
        poisson.max_batch_size, poisson.bucket_width, len(poisson))


def test_a_restore_with_a_secret_seed_redraws_the_batches_and_keeps_the_groups():
    sampler = CyclicPoissonSampler(*data(), sampling_rate=0.5, cycle_length=3)
    groups, before = sampler._groups.copy(), sampler.indices_for_step(4)
    sampler.set_step(10)
    sampler.set_step(4)  # a restore
    np.testing.assert_array_equal(sampler._groups, groups)
    after = sampler.indices_for_step(4)
    assert not np.array_equal(before, after)
    assert set(groups[after]) == set(groups[before]) == {1}


def test_batches_are_padded_poisson_samples_of_one_group():
    x, y = data()
    sampler = CyclicPoissonSampler(x, y, sampling_rate=0.2, cycle_length=4, seed=0)
    assert sampler.steps_per_epoch == 20 and len(sampler) == 20
    assert sampler.max_batch_size == privacy.max_batch_size_for(SIZE, 0.05)
    for step in range(8):
        expected = sampler.indices_for_step(step)
        batch_x, batch_y, weights = sampler[0]
        real = batch_y[weights > 0]
        np.testing.assert_array_equal(real, y[expected])
        assert len(batch_y) == sampler.padded_size(len(expected))
        assert set(sampler._groups[real]) <= {step % 4}


def test_a_shard_draws_its_part_of_the_whole_sample(monkeypatch):
    from pergrad.distributed import processes

    whole = CyclicPoissonSampler(*data(), sampling_rate=0.4, cycle_length=3, seed=5)
    monkeypatch.setattr(processes, "count", lambda: 2)
    parts = []
    for offset, size in ((0, 350), (350, 250)):
        monkeypatch.setattr(processes, "join_sampler", lambda sampler, sharded, o=offset: (o, 99))
        x, y = data()
        parts.append((offset, CyclicPoissonSampler(
            x[offset:offset + size], y[offset:offset + size], sampling_rate=0.4, cycle_length=3,
            seed=5, dataset_size=SIZE)))
    for step in range(6):
        union = np.concatenate([shard.indices_for_step(step) + offset for offset, shard in parts])
        np.testing.assert_array_equal(union, whole.indices_for_step(step))


def test_the_sampler_refuses_bad_settings():
    for cycle in (0, 2.5, True):
        with pytest.raises(ValueError, match="cycle_length"):
            CyclicPoissonSampler(*data(), sampling_rate=0.5, cycle_length=cycle)
    with pytest.raises(ValueError, match="sampling_rate"):
        CyclicPoissonSampler(*data(), sampling_rate=0.0, cycle_length=2)


# --- amplified BandMF accounting --------------------------------------------------------------


@pytest.mark.parametrize("bands,cycle", [(1, 1), (4, 4), (4, 8), (16, 16)])
def test_banded_mf_epsilon_is_dp_sgd_on_one_group(bands, cycle):
    z, q, steps, delta = 1.0, 0.05, 1000, 1e-6
    found = privacy.banded_mf_epsilon(z, q, steps, delta, bands=bands, cycle_length=cycle)
    assert found == privacy.epsilon(z, q, math.ceil(steps / cycle), delta)
    by_hand = dp_accounting.rdp.RdpAccountant()
    by_hand.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
                    math.ceil(steps / cycle))
    assert found == pytest.approx(by_hand.get_epsilon(delta), rel=1e-12)
    if bands == cycle == 1:
        assert found == privacy.epsilon(z, q, steps, delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("size,batch,bands,steps,z", [
    (60000, 256, 4, 2000, 1.0), (60000, 1000, 16, 1000, 2.0), (50000, 512, 8, 999, 0.8),
    (1024, 1024, 1, 100, 5.0),
])
def test_banded_mf_epsilon_matches_jax_privacy(accountant, size, batch, bands, steps, z):
    analysis = _jax_privacy("accounting.analysis")
    accountants = _jax_privacy("accounting.accountants")
    params = analysis.DpParams(noise_multipliers=z, num_samples=size, delta=1e-6, batch_size=batch,
                               cycle_length=bands)

    def theirs(config):
        return analysis.DpsgdTrainingAccountant(config).compute_epsilon(steps, params)

    # the rate of one group, batch / (size / bands): CyclicPoissonSampler's sampling_rate
    ours = privacy.banded_mf_epsilon(z, batch * bands / size, steps, 1e-6, bands=bands,
                                     accountant=accountant)
    if accountant == "pld":
        assert ours == pytest.approx(theirs(accountants.PldAccountantConfig()), rel=1e-3)
        return
    # the same event: the same epsilon at dp-accounting's orders (pergrad's), within 0.2% at theirs
    orders = dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    assert ours == pytest.approx(theirs(accountants.RdpAccountantConfig(orders=orders)), rel=1e-12)
    assert ours == pytest.approx(theirs(accountants.RdpAccountantConfig()), rel=2e-3)


def test_banded_mf_accounting_refuses_unseparated_participations():
    with pytest.raises(ValueError, match="cycle_length=4"):
        privacy.banded_mf_epsilon(1.0, 0.1, 100, 1e-5, bands=4, cycle_length=2)
    with pytest.raises(ValueError, match="at least 4 steps apart"):
        privacy.banded_mf_event(1.0, 0.1, 100, bands=4, cycle_length=3)
    for bad in ({"steps": -1}, {"steps": 2.5}, {"noise_multiplier": -1.0}, {"sampling_rate": 1.5}):
        arguments = {"noise_multiplier": 1.0, "sampling_rate": 0.1, "steps": 100, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            privacy.banded_mf_event(**arguments, bands=2)
    poisson = PoissonSampler(*data(), sampling_rate=0.1, seed=0)
    with pytest.raises(ValueError, match="CyclicPoissonSampler"):
        privacy.banded_mf_epsilon(1.0, 0.1, 100, 1e-5, bands=2, sampler=poisson)
    # one band is DP-SGD, whatever the sampler
    assert privacy.banded_mf_epsilon(1.0, 0.1, 100, 1e-5, bands=1, sampler=poisson) == \
        privacy.epsilon(1.0, 0.1, 100, 1e-5)
    cyclic = CyclicPoissonSampler(*data(), sampling_rate=0.1, cycle_length=4, seed=0)
    assert privacy.banded_mf_epsilon(1.0, 0.1, 100, 1e-5, bands=4, sampler=cyclic) == \
        privacy.epsilon(1.0, 0.1, 25, 1e-5)
    with pytest.raises(ValueError, match="not the sampler's"):
        privacy.banded_mf_epsilon(1.0, 0.2, 100, 1e-5, bands=4, sampler=cyclic)
    with pytest.raises(ValueError, match="not both"):
        privacy.banded_mf_epsilon(1.0, 0.1, 100, 1e-5, bands=4, sampler=cyclic, cycle_length=4)


# --- the privacy cost of tuning ---------------------------------------------------------------


def test_tuning_epsilon_is_dp_accountings_repeat_and_select():
    run = privacy.dp_sgd_event(1.1, 0.01, 2000)
    for distribution, shape in (("geometric", 1.0), ("logarithmic", 0.0), ("poisson", math.inf), (0.5, 0.5)):
        by_hand = dp_accounting.rdp.RdpAccountant()
        by_hand.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(run, 10.0, shape))
        found = privacy.tuning_epsilon(run, 10, 1e-5, distribution)
        assert found == pytest.approx(by_hand.get_epsilon(1e-5), rel=1e-12)
        single = privacy.epsilon(1.1, 0.01, 2000, 1e-5)
        # costs more than one run, far less than composing the ten runs
        assert single < found < privacy.epsilon(1.1, 0.01, 20000, 1e-5)
    assert privacy.tuning_epsilon(run, 20, 1e-5) > privacy.tuning_epsilon(run, 10, 1e-5)
    banded = privacy.banded_mf_event(1.0, 0.05, 1000, bands=4)
    assert privacy.tuning_epsilon(banded, 5, 1e-5) > privacy.banded_mf_epsilon(1.0, 0.05, 1000, 1e-5, bands=4)


def _gaussian_delta(sigma, eps):
    """The exact delta(eps) of the Gaussian mechanism of sensitivity 1 (Balle and Wang, 2018)."""
    from scipy.stats import norm

    return norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)


@pytest.mark.parametrize("distribution", ["geometric", 0.5, "poisson"])
def test_tuning_epsilon_follows_papernot_and_steinke(distribution):
    # One run: the Gaussian mechanism, RDP lambda / (2 sigma^2) at every order.
    sigma, mean, delta = 3.0, 8.0, 1e-6
    rdp = dp_accounting.rdp.rdp_privacy_accountant
    orders = np.asarray([o for o in rdp.DEFAULT_RDP_ORDERS if o > 1], dtype=np.float64)
    single = orders / (2 * sigma**2)
    if distribution == "poisson":  # Theorem 6, delta_hat from the RDP curve as dp-accounting's
        hats = [math.log1p(1 / (a - 1)) for a in orders]
        deltas = np.array([rdp.compute_delta(orders, single, hat)[0] for hat in hats])
        selected = single + mean * deltas + math.log(mean) / (orders - 1)
        # with the exact Gaussian delta_hat (Balle and Wang, 2018) the bound is smaller
        exact = np.array([_gaussian_delta(sigma, hat) for hat in hats])
        tighter = rdp.compute_epsilon(orders, single + mean * exact + math.log(mean) / (orders - 1), delta)
        run = dp_accounting.GaussianDpEvent(sigma)
        assert tighter[0] < privacy.tuning_epsilon(run, mean, delta, "poisson")
    else:  # Theorem 2: truncated negative binomial of shape eta, gamma from its mean
        from scipy.optimize import brentq

        eta = 1.0 if distribution == "geometric" else distribution
        gamma = brentq(lambda g: eta * (1 - g) / (g * (1 - g**eta)) - mean, 1e-9, 1 - 1e-9, xtol=1e-15)
        constant = (1 + eta) * np.min((1 - 1 / orders) * single + math.log(1 / gamma) / orders)
        selected = single + constant + math.log(mean) / (orders - 1)
    closed_form = rdp.compute_epsilon(orders, selected, delta)[0]
    found = privacy.tuning_epsilon(dp_accounting.GaussianDpEvent(sigma), mean, delta, distribution)
    assert found == pytest.approx(closed_form, rel=1e-6)


def test_tuning_refusals():
    run = privacy.dp_sgd_event(1.0, 0.01, 10)
    with pytest.raises(ValueError, match="mean_runs"):
        privacy.tuning_epsilon(run, 0.5, 1e-5)
    with pytest.raises(ValueError, match="distribution"):
        privacy.tuning_epsilon(run, 5, 1e-5, "uniform")
    with pytest.raises(ValueError, match="shape"):
        privacy.tuning_epsilon(run, 5, 1e-5, -1)
    with pytest.raises(ValueError, match="delta"):
        privacy.tuning_epsilon(run, 5, 0.0)


def test_the_names_are_exported():
    for name in ("BandedStrategy", "CyclicPoissonSampler", "banded_mf_epsilon", "banded_mf_event",
                 "correlate_step", "fhu_coefficients", "tuning_epsilon", "tuning_event"):
        assert name in privacy.__all__ and hasattr(pergrad.privacy, name)
