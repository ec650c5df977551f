"""Privacy accounting for DP-SGD with the ``dp-accounting`` package.

One DP-SGD step with Poisson sampling rate ``q`` and noise multiplier ``z``
is a Poisson-subsampled Gaussian mechanism; ``T`` steps are its ``T``-fold
composition::

    SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), T)

The ``(epsilon, delta)`` guarantee of that event is computed by
``dp-accounting``'s Rényi-DP accountant (Mironov, 2017; Mironov, Talwar and
Zhang, 2019), the default, or by its privacy-loss-distribution accountant
(Koskela et al., 2020; Doroshenko et al., 2022), which is tighter and slower.
Neighbouring datasets differ by adding or removing one privacy unit: an example,
or with user-level DP (:mod:`pergrad.privacy.user_level`) one user and all of its
examples, ``q`` then being the users' sampling rate. Nothing here
re-implements the analysis: this module only builds the event.

Install the dependency with ``pip install pergrad[privacy]``.

References:
    Mironov, 2017, "Rényi differential privacy". https://arxiv.org/abs/1702.07476
    Mironov, Talwar and Zhang, 2019, "Rényi differential privacy of the sampled
    Gaussian mechanism". https://arxiv.org/abs/1908.10530
    Doroshenko, Ghazi, Kamath, Kumar and Manurangsi, 2022, "Connect the dots:
    tighter discrete approximations of privacy loss distributions".
    https://arxiv.org/abs/2207.04380
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting():
    try:
        import dp_accounting
    except ImportError as error:  # an optional dependency
        raise ImportError(
            "Privacy accounting needs the `dp-accounting` package: "
            "`pip install dp-accounting` (or `pip install pergrad[privacy]`)."
        ) from error
    return dp_accounting


class _ExcludedOrderFilter(logging.Filter):
    """Hides the RDP accountant's notes that it skipped an order it could not
    evaluate: skipping an order can only make epsilon larger (conservative)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Excluding this order" not in record.getMessage()


@contextlib.contextmanager
def _quiet_accountant():
    logger, quiet = logging.getLogger("absl"), _ExcludedOrderFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _check(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> None:
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}.")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps}.")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")


def make_accountant(accountant: str = "rdp"):
    """A fresh ``dp_accounting`` accountant: ``"rdp"`` or ``"pld"``."""
    dp_accounting = _dp_accounting()
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")


def dp_sgd_event(noise_multiplier: float, sampling_rate: float, steps: int):
    """The ``DpEvent`` of ``steps`` Poisson-sampled Gaussian DP-SGD steps."""
    dp_accounting = _dp_accounting()
    step = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.SelfComposedDpEvent(step, int(steps))


def epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """The ``epsilon`` of DP-SGD at ``delta`` after ``steps`` steps.

    Args:
        noise_multiplier: ``z``: noise std over clipping norm.
        sampling_rate: ``q``: each privacy unit's probability of being in a batch
            (Poisson sampling): an example's, ``expected_batch_size / dataset_size``
            (``PoissonSampler``), or for user-level DP a user's
            (``UserSampler.sampling_rate``). The guarantee is for adding or removing
            one such unit.
        steps: the number of optimizer steps taken.
        delta: the target ``delta``, typically below ``1 / dataset_size``.
        accountant: ``"rdp"`` (Rényi DP, the default) or ``"pld"`` (privacy
            loss distributions: tighter, slower).

    Returns:
        ``epsilon`` (``inf`` with no noise, ``0`` after no steps).
    """
    _check(noise_multiplier, sampling_rate, steps, delta)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    make_accountant(accountant)  # validates the name
    return _epsilon(float(noise_multiplier), float(sampling_rate), int(steps), float(delta), accountant)


# Pure functions of their arguments; the accountant callback asks for the same
# values at every epoch and every fit, and each costs a fraction of a second.
@functools.lru_cache(maxsize=256)
def _epsilon(noise_multiplier, sampling_rate, steps, delta, accountant) -> float:
    tracker = make_accountant(accountant)
    with _quiet_accountant():
        tracker.compose(dp_sgd_event(noise_multiplier, sampling_rate, steps))
        return float(tracker.get_epsilon(delta))


def _bracket(gap, start: float, factor: float, smallest: float = 0.01) -> tuple[float, float]:
    """``(low, high)`` with ``gap(low) > 0 >= gap(high)``, ``gap`` decreasing."""
    if gap(start) > 0:
        low, high = start, start * factor
        while gap(high) > 0:
            low, high = high, high * factor
        return low, high
    high, low = start, start / factor
    while gap(low) <= 0:
        if low < smallest:
            raise ValueError(
                f"The target is met with a noise multiplier below {smallest}: the budget is "
                "so loose that it protects practically nothing."
            )
        high, low = low, low / factor
    return low, high


def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 1e-4,
) -> float:
    """The smallest noise multiplier whose ``epsilon`` is at most ``target_epsilon``.

    A root search over the noise multiplier with
    ``dp_accounting.calibrate_dp_mechanism``; the result is within
    ``tolerance`` of the optimum and never gives more than ``target_epsilon``.
    The PLD search starts from the RDP answer (PLD is tighter, so its answer is
    smaller) and takes seconds to minutes: each evaluation builds a privacy
    loss distribution, slower for smaller noise.

    Args:
        target_epsilon: the privacy budget ``epsilon`` (> 0).
        delta: the target ``delta``.
        sampling_rate: Poisson sampling rate ``q``.
        steps: the number of training steps planned.
        accountant: ``"rdp"`` or ``"pld"``.
        tolerance: the precision of the search, in noise-multiplier units.
    """
    _check(0.0, sampling_rate, steps, delta)
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon}.")
    make_accountant(accountant)  # validates the name before the search
    if steps == 0:
        return 0.0
    dp_accounting = _dp_accounting()

    def gap(noise: float) -> float:
        return epsilon(noise, sampling_rate, steps, delta, accountant) - target_epsilon

    if accountant == "pld":
        start = noise_multiplier_for(target_epsilon, delta, sampling_rate, steps, "rdp", tolerance)
        low, high = _bracket(gap, start, factor=1.25)
    else:
        low, high = _bracket(gap, 1.0, factor=2.0)
    with _quiet_accountant():
        noise = dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(accountant),
            lambda z: dp_sgd_event(z, sampling_rate, steps),
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(low, high),
            tol=tolerance,
        )
    return float(noise)


def steps_within_budget(
    max_epsilon: float,
    delta: float,
    noise_multiplier: float,
    sampling_rate: float,
    accountant: str = "rdp",
) -> int:
    """The largest number of steps whose ``epsilon`` is at most ``max_epsilon``.

    An integer root search with ``dp_accounting.calibrate_dp_mechanism``
    (epsilon grows with the number of steps). Returns ``0`` when even one step
    exceeds the budget (or there is no noise).
    """
    _check(noise_multiplier, sampling_rate, 0, delta)
    make_accountant(accountant)
    return _steps_within_budget(
        float(max_epsilon), float(delta), float(noise_multiplier), float(sampling_rate), accountant
    )


@functools.lru_cache(maxsize=64)
def _steps_within_budget(max_epsilon, delta, noise_multiplier, sampling_rate, accountant) -> int:
    if noise_multiplier == 0 or epsilon(noise_multiplier, sampling_rate, 1, delta, accountant) > max_epsilon:
        return 0
    dp_accounting = _dp_accounting()
    with _quiet_accountant():
        steps = dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(accountant),
            lambda count: dp_sgd_event(noise_multiplier, sampling_rate, count),
            max_epsilon,
            delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(1, 64),
            discrete=True,
        )
    steps = int(steps)
    # The search is exact to one step; make the answer the largest count.
    while epsilon(noise_multiplier, sampling_rate, steps + 1, delta, accountant) <= max_epsilon:
        steps += 1
    return steps
