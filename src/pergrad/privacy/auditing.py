"""Privacy auditing with one training run (Steinke, Nasr and Jagielski, NeurIPS 2023): the bound.

:func:`pergrad.privacy.audit` (in :mod:`pergrad.privacy.canary_audit`, which trains the
model) runs the audit; this module holds its statistics. ``m`` canaries are
each included with probability 1/2; a guesser says "in" or "out" for ``r`` of
them and is right ``v`` times. If training is ``(epsilon, delta)``-DP, ``v`` is
stochastically dominated by ``Binomial(r, e^epsilon / (1 + e^epsilon))`` (the
right guesses of randomized response) up to a ``delta`` term, which turns
``v`` into a lower bound on ``epsilon`` at a chosen confidence.

References:
    Steinke, Nasr and Jagielski, 2023, "Privacy auditing with one (1) training
    run", NeurIPS. https://arxiv.org/abs/2305.08846
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"Need 0 <= correct <= guesses <= canaries, got correct={correct}, guesses={guesses}, "
            f"canaries={canaries}."
        )


def _check_delta(delta: float) -> None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}.")


def audit_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float = 0.0) -> float:
    """An upper bound on the probability of ``correct`` or more right guesses under ``(epsilon, delta)``-DP.

    Steinke et al.'s theorem for ``(epsilon, delta)``-DP, in the closed form
    of the paper's reference code: with ``r = guesses``, ``v = correct`` and
    ``W ~ Binomial(r, e^epsilon / (1 + e^epsilon))`` (the right-guess count of
    ``epsilon``-DP randomized response),
    ``P[correct >= v] <= P[W >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= W < v] / i``,
    ``m`` the number of canaries. With ``delta = 0`` it is the binomial tail.

    Args:
        canaries: ``m``, each included independently with probability 1/2.
        guesses: ``r``, the number of canaries guessed (the others abstained on).
        correct: ``v``, the number of right guesses.
        epsilon: the ``epsilon`` of the null hypothesis (>= 0).
        delta: its ``delta``.

    Returns:
        The p-value, at most 1.
    """
    from scipy import special, stats

    _check_counts(canaries, guesses, correct)
    _check_delta(delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be non-negative, got {epsilon}.")
    right = special.expit(epsilon)  # e^eps / (1 + e^eps)
    tail = stats.binom.sf(correct - 1, guesses, right)  # P[W >= v]
    if delta == 0 or correct == 0:
        return float(min(tail, 1.0))
    shortfall = np.arange(1, correct + 1)
    below = stats.binom.sf(correct - shortfall - 1, guesses, right) - tail  # P[v - i <= W < v]
    return float(min(tail + 2 * canaries * delta * np.max(below / shortfall), 1.0))


def epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float = 0.0, confidence: float = 0.95
) -> float:
    """The largest ``epsilon`` that ``correct`` right guesses out of ``guesses`` refute.

    The supremum of the ``epsilon`` whose :func:`audit_p_value` is below
    ``1 - confidence`` (0 when even ``epsilon = 0`` is not refuted): if the
    training run is ``(epsilon, delta)``-DP, the bound exceeds ``epsilon`` with
    probability at most ``1 - confidence``.

    Args:
        canaries: ``m``, each included independently with probability 1/2.
        guesses: ``r``, the number of canaries guessed.
        correct: ``v``, the number of right guesses.
        delta: the ``delta`` of the guarantee audited.
        confidence: ``1 - beta`` (in (0, 1)).
    """
    from scipy import optimize

    _check_counts(canaries, guesses, correct)
    _check_delta(delta)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    significance = 1.0 - confidence

    def excess(epsilon: float) -> float:  # increasing in epsilon; > 0 where epsilon is not refuted
        return audit_p_value(canaries, guesses, correct, epsilon, delta) - significance

    if excess(0.0) >= 0:
        return 0.0
    high = 1.0
    while excess(high) < 0:
        high *= 2.0
    return float(optimize.brentq(excess, high / 2 if high > 1 else 0.0, high, xtol=1e-9, rtol=1e-12))


@dataclass(frozen=True)
class AuditResult:
    """What :func:`audit` found; ``str()`` gives the one-line summary.

    Attributes:
        epsilon_lower_bound: the empirical lower bound on ``epsilon``.
        epsilon: the accountant's ``epsilon`` for the run (``inf`` without noise).
        delta: the ``delta`` of both.
        confidence: the bound's confidence.
        canaries: ``m``, the canaries drawn.
        included: how many of them were in the training data.
        guesses: ``r``, the guesses of the best-scoring number of guesses.
        correct: how many of those were right.
        noise_multiplier: the noise multiplier the accountant was given.
        sampling_rate: ``q`` of the run's Poisson sampling.
        steps: the DP steps taken.
        scores: every canary's score (higher: more likely included).
        membership: every canary's inclusion (the truth the guesses are scored on).
    """

    epsilon_lower_bound: float
    epsilon: float
    delta: float
    confidence: float
    canaries: int
    included: int
    guesses: int
    correct: int
    noise_multiplier: float
    sampling_rate: float
    steps: int
    scores: np.ndarray = field(repr=False)
    membership: np.ndarray = field(repr=False)

    def __str__(self) -> str:
        return (
            f"one-run audit: epsilon >= {self.epsilon_lower_bound:.2f} at {self.confidence:.0%} "
            f"confidence ({self.correct}/{self.guesses} right guesses on {self.canaries} canaries) "
            f"vs accountant epsilon = {self.epsilon:.2f} (delta={self.delta:g})"
        )


def best_guesses(
    scores, membership, guesses: Sequence[int], delta: float, confidence: float
) -> tuple[float, int, int]:
    """The largest bound over several numbers of guesses, Bonferroni-corrected.

    For each ``r`` in ``guesses``, guesses "included" for the ``r / 2``
    highest scores and "excluded" for the ``r / 2`` lowest, and computes
    :func:`epsilon_lower_bound` at confidence ``1 - (1 - confidence) /
    len(guesses)``, so that the largest of them holds at ``confidence``.

    Returns:
        ``(bound, r, right guesses)`` of the best ``r``.
    """
    scores, membership = np.asarray(scores, dtype="float64"), np.asarray(membership, dtype=bool)
    canaries = len(scores)
    each = 1.0 - (1.0 - confidence) / len(guesses)
    # A stable sort: tied scores (all 0 for the excluded canaries of a run without noise)
    # keep an order that does not depend on membership.
    order = np.argsort(scores, kind="stable")
    best = (0.0, 0, 0)
    for count in guesses:
        half = int(count) // 2
        if half == 0:
            continue
        right = int(membership[order[-half:]].sum() + (~membership[order[:half]]).sum())
        bound = epsilon_lower_bound(canaries, 2 * half, right, delta, each)
        if bound > best[0] or best[1] == 0:
            best = (bound, 2 * half, right)
    return best
