"""The privacy cost of hyperparameter tuning: Papernot and Steinke's repeat-and-select.

Tuning the learning rate, clipping norm or number of epochs by training several times on the
private data and keeping the best model spends privacy in every run: ``K`` runs, each
``epsilon``-DP, are ``K epsilon``-DP by composition. Papernot and Steinke (2022) bound it far
better when the *number* of runs is random: run the training a random number ``K`` of times, each
time with hyperparameters drawn independently from a fixed distribution (a random candidate of a
fixed list, say), and release only the best run (its model and score), nothing of the others.
If one run is ``(lambda, epsilon(lambda))``-RDP at every order, the selection is RDP with

- ``K`` truncated negative binomial of shape ``eta`` and parameter ``gamma`` (Theorem 2;
  ``eta = 1`` is the geometric distribution, ``eta = 0`` the logarithmic one)::

      epsilon'(lambda) = epsilon(lambda) + (1 + eta) (1 - 1/lambda_hat) epsilon(lambda_hat)
                         + (1 + eta) log(1 / gamma) / lambda_hat + log(E[K]) / (lambda - 1)

  for any ``lambda_hat`` (the best is taken);
- ``K`` Poisson of mean ``mu`` (Theorem 6)::

      epsilon'(lambda) = epsilon(lambda) + mu delta_hat + log(mu) / (lambda - 1)

  with ``delta_hat`` the ``delta`` of one run at ``epsilon_hat = log(1 + 1 / (lambda - 1))``.

``dp-accounting``'s ``RepeatAndSelectDpEvent(event, mean, shape)`` implements both in its RDP
accountant; :func:`tuning_epsilon` builds that event around one run's event (DP-SGD's
:func:`~pergrad.privacy.dp_sgd_event`, BandMF's :func:`~pergrad.privacy.banded_mf_event`, or any
other) and converts it to ``(epsilon, delta)``. Nothing here re-implements the analysis.

What the guarantee needs: the number of runs really is drawn from the distribution (not "until
the score is good enough", not fixed), each run's hyperparameters are drawn independently of the
data, each run is the same DP mechanism, and the selection uses only what a run releases (a
score computed from the DP model on public data, or itself part of the run's DP output). Only the
selected run is released.

References:
    Papernot and Steinke, 2022, "Hyperparameter tuning with Renyi differential privacy", ICLR.
    https://arxiv.org/abs/2110.03620
"""

from __future__ import annotations

import math

from pergrad.privacy.accounting import make_accountant

#: The named distributions of the number of runs: their ``RepeatAndSelectDpEvent`` shape.
DISTRIBUTIONS = {"logarithmic": 0.0, "geometric": 1.0, "poisson": math.inf}


def _shape(distribution) -> float:
    if isinstance(distribution, str):
        if distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {sorted(DISTRIBUTIONS)} or a truncated negative "
                f"binomial's shape (a number >= 0), got {distribution!r}."
            )
        return DISTRIBUTIONS[distribution]
    shape = float(distribution)
    if not shape >= 0:
        raise ValueError(f"A truncated negative binomial's shape must be >= 0, got {distribution!r}.")
    return shape


def tuning_event(run_event, mean_runs: float, distribution="geometric"):
    """The ``RepeatAndSelectDpEvent`` of releasing the best of a random number of runs.

    Args:
        run_event: one run's ``DpEvent`` (e.g. :func:`pergrad.privacy.dp_sgd_event`).
        mean_runs: ``E[K]``, the expected number of runs (at least 1).
        distribution: the law of ``K``: ``"geometric"`` (default), ``"logarithmic"``,
            ``"poisson"``, or a truncated negative binomial's shape ``eta >= 0``.
    """
    make_accountant("rdp")  # raises the install hint without dp-accounting
    from dp_accounting.dp_event import RepeatAndSelectDpEvent

    if not mean_runs >= 1:
        raise ValueError(f"mean_runs must be at least 1, got {mean_runs}.")
    return RepeatAndSelectDpEvent(run_event, float(mean_runs), _shape(distribution))


def tuning_epsilon(run_event, mean_runs: float, delta: float, distribution="geometric") -> float:
    """The ``epsilon`` at ``delta`` of training a random number ``K`` of times (``E[K] =
    mean_runs``, hyperparameters drawn independently each time) and releasing the best run
    (Papernot and Steinke, 2022; module docstring), by ``dp-accounting``'s RDP accountant (the
    only one that supports ``RepeatAndSelectDpEvent``).

    Example: each run is DP-SGD with ``z = 1.1``, ``q = 0.01``, 5000 steps; ten candidates::

        run = pergrad.privacy.dp_sgd_event(1.1, 0.01, 5000)
        pergrad.privacy.tuning_epsilon(run, mean_runs=10, delta=1e-5)

    Draw the number of runs with ``numpy.random.Generator.geometric(1 / mean_runs)`` (for
    ``"geometric"``), or a Poisson draw (``"poisson"``; a draw of 0 runs releases nothing).

    Args:
        run_event: one run's ``DpEvent``.
        mean_runs: ``E[K] >= 1``.
        delta: the target ``delta``.
        distribution: as :func:`tuning_event`'s.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    event = tuning_event(run_event, mean_runs, distribution)
    accountant = make_accountant("rdp")
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))
