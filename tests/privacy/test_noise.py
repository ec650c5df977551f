"""DP noise as a sampler: its law against N(0, 1), its tails, its independence, its support.

Every threshold is a number of standard errors of the statistic at the sample size used
(6 SE: a false alarm in about one in 5e8 runs under the exact law), stated beside it; the
draws use fixed keys, so the tests are deterministic. The same checks run on every backend
(Threefry-4x32 words on JAX and TensorFlow, NumPy's Philox on torch).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from keras import ops
from scipy import integrate, special

from pergrad.backend import adapter
from pergrad.privacy import noise

SIZE = 2**22  # draws for the law tests
SMALL = 2**20  # draws for the tail and correlation tests
SE = 6.0  # standard errors allowed


def key(seed):
    return noise.key_words(seed, spawn=0)


_DRAW = {}


def draw(key_words, step, size):
    """``size`` standard normal values of ``(key_words, step)`` as float64 NumPy."""
    if size not in _DRAW:  # compiled once per size (jit / tf.function; eager on torch)
        _DRAW[size] = adapter().compile(lambda k, s: noise.gaussian_noise(k, s, size, 1.0))
    values = _DRAW[size](ops.convert_to_tensor(key_words), ops.convert_to_tensor(step, "int32"))
    return np.asarray(ops.convert_to_numpy(values), np.float64)


@pytest.fixture(scope="module")
def sample():
    return draw(key(11), 0, SIZE)


def test_moments_are_those_of_a_standard_normal(sample):
    """Mean, variance, skewness and excess kurtosis of 2^22 draws. Their standard errors
    under N(0, 1): sqrt(1/n), sqrt(2/n), sqrt(6/n), sqrt(24/n)."""
    n = sample.size
    mean = sample.mean()
    centred = sample - mean
    variance = np.mean(centred**2)
    skewness = np.mean(centred**3) / variance**1.5
    kurtosis = np.mean(centred**4) / variance**2 - 3.0
    assert abs(mean) < SE * math.sqrt(1 / n)
    assert abs(variance - 1.0) < SE * math.sqrt(2 / n)
    assert abs(skewness) < SE * math.sqrt(6 / n)
    assert abs(kurtosis) < SE * math.sqrt(24 / n)


def test_kolmogorov_smirnov_against_the_normal_cdf(sample):
    """sup |F_n - Phi| over 2^22 draws. Under the exact law P(sqrt(n) D > t) <= 2 exp(-2 t^2)
    (Dvoretzky-Kiefer-Wolfowitz, Massart's constant): t = 3.3 is a 1e-9 false alarm."""
    values = np.sort(sample)
    n = values.size
    cdf = special.ndtr(values)
    above = np.arange(1, n + 1) / n - cdf
    below = cdf - np.arange(n) / n
    statistic = max(above.max(), below.max())
    assert statistic < math.sqrt(math.log(2 / 1e-9) / 2) / math.sqrt(n)


@pytest.mark.parametrize("threshold", [3.0, 3.5, 4.0, 4.5])
def test_tail_frequencies_match_the_exact_gaussian(sample, threshold):
    """Counts of |n| > t in 2^22 draws against n * 2Q(t), within 6 binomial standard
    errors (expected counts 11,300 at 3 sigma to 28 at 4.5 sigma; further out, see the next
    test)."""
    n = sample.size
    p = 2 * special.ndtr(-threshold)
    count = np.count_nonzero(np.abs(sample) > threshold)
    assert abs(count - n * p) < SE * math.sqrt(n * p * (1 - p))


def conditional_tail(threshold, zero_bits):
    """P(|n| > t | the leading ``zero_bits`` bits of U are 0), exactly.

    Given them, U = 2^-k V with V uniform (k = ``zero_bits``): R^2 = 2 k ln 2 + E, E
    exponential with mean 2, and |n| = R sin(Psi) with Psi uniform on (0, pi/2)
    independent of R."""
    floor = 2 * zero_bits * math.log(2)

    def given(psi):
        return min(1.0, math.exp(-((threshold / math.sin(psi)) ** 2 - floor) / 2))

    value, _ = integrate.quad(given, 1e-9, math.pi / 2, epsabs=1e-13, limit=200)
    return value * 2 / math.pi


@pytest.mark.parametrize(
    "zero_bits, thresholds",
    [(16, (5.0, 5.5, 6.0)), (24, (6.0, 6.5, 7.0)), (48, (8.25, 8.5, 8.75, 9.0)), (72, (10.1, 10.25, 10.5))],
)
def test_deep_tail_matches_the_exact_gaussian_given_a_small_uniform(zero_bits, thresholds):
    """The tail from 5 sigma on, in counts that 2^20 draws can test: the generator's words with
    U's leading k = 16, 24, 48 or 72 bits set to 0 (an event of probability 2^-k, uniform bits
    given it) sample n given U < 2^-k, whose tail is known exactly. This checks the
    transform's tail (U's low digits, the logarithm at tiny U, the sine) out to 10.5 sigma;
    expected counts 45 to 47,000, compared within 6 binomial standard errors."""
    words = noise.random_words(ops.convert_to_tensor(key(12)), 3, SMALL)
    masks = {16: (0xFFFF,), 24: (0xFF,), 48: (0, 0xFFFF), 72: (0, 0, 0xFFFFFF)}[zero_bits]
    for index, mask in enumerate(masks):  # keep the bits below the leading k of words 0..2
        words[index] = ops.bitwise_and(words[index], mask)
    values = np.abs(np.asarray(ops.convert_to_numpy(noise.normal_from_words(words, 1.0)), np.float64))
    for threshold in thresholds:
        p = conditional_tail(threshold, zero_bits)
        count = np.count_nonzero(values > threshold)
        assert abs(count - SMALL * p) < SE * math.sqrt(SMALL * p * (1 - p)), (threshold, count, SMALL * p)


def correlation(a, b):
    return float(np.corrcoef(a, b)[0, 1])


def test_no_correlation_between_coordinates(sample):
    """Lag-1 to lag-4 correlations of the values and of their squares (which catch a shared
    radius or magnitude) in 2^22 draws; standard error 1/sqrt(n)."""
    limit = SE / math.sqrt(sample.size)
    squares = sample**2
    for lag in (1, 2, 3, 4):
        assert abs(correlation(sample[:-lag], sample[lag:])) < limit
        assert abs(correlation(squares[:-lag], squares[lag:])) < limit
    # The first and second halves (where Box-Muller pairs used to sit).
    half = sample.size // 2
    assert abs(correlation(squares[:half], squares[half:])) < limit


def test_no_correlation_between_steps_or_keys():
    """Coordinate i against coordinate i of the next step, of the step 2^16 later, of
    another key and of the key with one bit flipped; values and squares, 2^20 draws."""
    limit = SE / math.sqrt(SMALL)
    base = draw(key(13), 5, SMALL)
    flipped = key(13).copy()
    flipped[6] ^= 1 << 9
    others = {
        "next step": draw(key(13), 6, SMALL),
        "step + 2^16": draw(key(13), 5 + 2**16, SMALL),
        "other key": draw(key(14), 5, SMALL),
        "one key bit flipped": draw(flipped, 5, SMALL),
    }
    for name, other in others.items():
        assert abs(correlation(base, other)) < limit, name
        assert abs(correlation(base**2, other**2)) < limit, name
        assert np.count_nonzero(base == other) < 10, name


def test_noise_is_a_pure_function_of_key_and_step():
    first = draw(key(15), 7, 1000)
    np.testing.assert_array_equal(first, draw(key(15), 7, 1000))
    # The first 1000 of a larger draw are the same values: coordinates do not depend on size.
    np.testing.assert_allclose(first, draw(key(15), 7, 4096)[:1000], rtol=2e-7)
    np.testing.assert_array_equal(noise.key_words(3, 1), noise.key_words(3, 1))
    assert not np.array_equal(noise.key_words(3, 0), noise.key_words(3, 1))
    assert not np.array_equal(noise.key_words(None, 0), noise.key_words(None, 0))


def test_the_random_words_are_uniform_bits():
    """Each of the 128 bit positions of a coordinate's words is 1 half of the time in 2^18
    coordinates (standard error 1 / (2 sqrt(n)))."""
    count = 2**18
    words = noise.random_words(ops.convert_to_tensor(key(16)), 9, count)
    bits = np.stack([np.asarray(ops.convert_to_numpy(w)).astype(np.int64) & 0xFFFFFFFF for w in words])
    frequencies = ((bits[:, None, :] >> np.arange(32)[None, :, None]) & 1).mean(axis=2)
    assert np.abs(frequencies - 0.5).max() < SE * 0.5 / math.sqrt(count)


def test_the_support_reaches_eleven_standard_deviations():
    """The extreme words: U = 2^-96 and Psi next to pi/2 give sqrt(192 ln 2) = 11.54 (beyond
    the support of sampled noise the privacy loss is infinite; a float32 erfinv sampler stops
    at 5.4); U = 1 gives 0; the last bit is the sign."""
    top = np.int32(-1)  # all 32 bits set
    columns = np.array(
        [
            [0, 0, 0, top & ~np.int32(1)],  # U = 2^-96, Psi largest, positive
            [0, 0, 0, top],  # the same, negative
            [top, top, top, top & ~np.int32(1)],  # U = 1
        ],
        np.int32,
    ).T
    words = [ops.convert_to_tensor(row) for row in columns]
    values = np.asarray(ops.convert_to_numpy(noise.normal_from_words(words, 1.0)))
    assert noise.SUPPORT == pytest.approx(math.sqrt(192 * math.log(2))) and noise.SUPPORT > 8
    assert values[0] == pytest.approx(noise.SUPPORT, rel=1e-5)
    assert values[1] == pytest.approx(-noise.SUPPORT, rel=1e-5)
    assert values[2] == 0.0
    # The scale multiplies the value (here through the radius).
    scaled = np.asarray(ops.convert_to_numpy(noise.normal_from_words(words, 0.25)))
    np.testing.assert_allclose(scaled, values * 0.25, rtol=1e-6)


def test_the_transform_resolves_the_angle_and_the_radius_bits():
    """The statistical tests cannot see a coarse angle (256 angles already give a law close
    to N(0, 1)), but the floating-point argument needs angle and radius resolved to float32
    precision: 2^20 consecutive angles (near Psi = 0, U = 1/4) and 2^16 values of U's last
    24-bit digit (near U = 2^-96, where the radius is 11.5) give as many distinct, ordered
    values."""

    def transform(*words):
        words = [np.asarray(w, np.int64).astype(np.uint32).view(np.int32) for w in words]
        words = [ops.convert_to_tensor(w) for w in words]
        return np.asarray(ops.convert_to_numpy(noise.normal_from_words(words, 1.0)))

    sweep = np.arange(2**20, dtype=np.int64)
    quarter = np.full(sweep.size, 0x40000000)  # U = 1/4: every word's digits 0x400000...
    by_angle = transform(quarter, quarter, quarter, sweep << 8)
    assert np.all(np.diff(by_angle) > 0)
    # ... and they are the radius times the sine (float32 rounding: a few ulps).
    quarter_uniform = (0x400000 + (0x4000 + (0x40 + 2.0**-24) * 2.0**-24) * 2.0**-24) * 2.0**-24  # digits
    exact = math.sqrt(-2 * math.log(quarter_uniform)) * np.sin((sweep + 0.5) * math.pi / 2**25)
    np.testing.assert_allclose(by_angle, exact, rtol=4e-7)
    sweep = sweep[: 2**16]
    zeros, angle = np.zeros(sweep.size), np.full(sweep.size, 0xFFFFFFFE)  # sin(Psi) ~ 1, positive
    by_radius = transform(zeros, zeros, sweep, angle)
    assert np.all(np.diff(by_radius) < 0) and by_radius[0] == pytest.approx(noise.SUPPORT, rel=1e-5)
