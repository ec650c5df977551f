"""Privacy accounting of amplified banded matrix factorization (BandMF), with ``dp-accounting``.

**The mechanism.** ``T`` steps release ``C X + Z`` row by row (the model sees the noise
``C^-1 Z``, :mod:`pergrad.privacy.banded`): ``X`` stacks the clipped gradient sums (one row per
step, each example's gradient clipped to ``c``), ``C`` is a ``b``-banded lower-triangular strategy
whose columns have norm at most ``s`` (:attr:`BandedStrategy.max_column_norm`; 1 once normalized),
``Z`` has i.i.d. ``N(0, (z c s)^2)`` entries. The examples are sampled by
:class:`~pergrad.privacy.CyclicPoissonSampler` with ``k >= b`` groups and rate ``q``.

**The argument** (Choquette-Choo et al., 2023, Theorem 4; jax-privacy's
``DpsgdTrainingAccountant`` with ``cycle_length``). Fix the example ``x`` that one neighbouring
data set adds, in group ``g``. It can only enter the rows of ``X`` of the steps
``g, g + k, g + 2k, ...``, each independently with probability ``q``. Column ``j`` of ``C`` is
zero outside the rows ``j .. j + b - 1``, so with ``k >= b`` the contribution of ``x`` at its
``i``-th possible step ``j_i = g + i k`` lands only in the rows ``j_i .. j_i + k - 1``: the output
splits into consecutive blocks of ``k`` rows, block ``i`` depending on ``x`` only through its
participation at ``j_i``, plus independent Gaussian noise. Inside a block the rows of the other
examples are fixed given the past outputs (the gradients are computed from them: adaptivity, in
order). So block ``i`` is a Poisson-subsampled Gaussian mechanism: with probability ``q`` the
mean moves by ``C[:, j_i] x_{j_i}``, of norm at most ``c s``, under noise of standard deviation
``z c s`` per coordinate; its privacy loss is that of one DP-SGD step of noise multiplier ``z``
and rate ``q``, and the blocks compose adaptively. At most ``ceil(T / k)`` blocks exist (group 0),
so the mechanism is dominated by

    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), ceil(T / k))``

which :func:`banded_mf_event` builds and ``dp-accounting`` evaluates: DP-SGD on the ``n / k``
examples of one group, ``ceil(T / k)`` steps. With ``b = k = 1`` it is DP-SGD's event.

**Where it does not hold, refused.** Participations fewer than ``b`` steps apart (a
:class:`~pergrad.privacy.PoissonSampler`, which can draw an example at consecutive steps, or
``cycle_length < bands``): two participations' columns overlap, and their noise is not
independent; the amplification argument is void. The unamplified bound, one Gaussian mechanism of
sensitivity :meth:`BandedStrategy.sensitivity`, needs a fixed participation schedule and is not
what these samplers do.

References:
    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta and Xu, 2023, "(Amplified) banded
    matrix factorization: a unified approach to private training", NeurIPS.
    https://arxiv.org/abs/2306.08153
"""

from __future__ import annotations

import math

from pergrad.privacy.accounting import dp_sgd_event, epsilon


def participations(steps: int, cycle_length: int) -> int:
    """The most times one example is drawn in ``steps`` steps of a cyclic sampler:
    ``ceil(steps / cycle_length)``."""
    return math.ceil(int(steps) / int(cycle_length))


def check_separation(bands: int, cycle_length: int) -> None:
    """Raises ``ValueError`` unless participations ``cycle_length`` steps apart keep the columns
    of a ``bands``-band strategy disjoint (``cycle_length >= bands``)."""
    for name, value in (("bands", bands), ("cycle_length", cycle_length)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if cycle_length < bands:
        raise ValueError(
            f"Amplified BandMF accounting needs every example's participations at least "
            f"{bands} steps apart (the strategy's bands), and the sampler separates them by only "
            f"{cycle_length}: sample with CyclicPoissonSampler(..., cycle_length={bands}) (or "
            f"more), or use a strategy of at most {cycle_length} bands (1 band is DP-SGD)."
        )


def separation_of(sampler) -> int:
    """The fewest steps between two participations of one example that ``sampler`` guarantees:
    a :class:`~pergrad.privacy.CyclicPoissonSampler`'s ``cycle_length``; 1 for any other sampler
    (a :class:`~pergrad.privacy.PoissonSampler` may draw an example at consecutive steps)."""
    return int(getattr(sampler, "min_separation", 1))


def banded_mf_event(noise_multiplier: float, sampling_rate: float, steps: int, *, bands: int,
                    cycle_length: int | None = None):
    """The ``DpEvent`` that dominates ``steps`` steps of amplified BandMF (module docstring):
    ``ceil(steps / cycle_length)`` Poisson-subsampled Gaussian steps of rate ``q`` and multiplier
    ``z``.

    Args:
        noise_multiplier: ``z``: the standard deviation of ``Z`` over the sensitivity of one
            participation (clipping norm times the strategy's largest column norm, 1 for a
            normalized strategy).
        sampling_rate: ``q``: an example's probability at the steps of its group
            (``CyclicPoissonSampler.sampling_rate``).
        steps: the steps taken.
        bands: the strategy's bands ``b``.
        cycle_length: the sampler's groups ``k`` (default ``bands``); at least ``bands``.

    Raises:
        ValueError: ``cycle_length < bands`` (the argument does not hold).
    """
    cycle_length = bands if cycle_length is None else cycle_length
    check_separation(bands, cycle_length)
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}.")
    epsilon(noise_multiplier, sampling_rate, 0, 0.5)  # validates z and q (0 steps: nothing computed)
    return dp_sgd_event(noise_multiplier, sampling_rate, participations(steps, cycle_length))


def banded_mf_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float, *,
                      bands: int, cycle_length: int | None = None, sampler=None,
                      accountant: str = "rdp") -> float:
    """The ``epsilon`` at ``delta`` of ``steps`` steps of amplified BandMF
    (:func:`banded_mf_event`): :func:`pergrad.privacy.epsilon` of DP-SGD with
    ``ceil(steps / cycle_length)`` steps.

    Args:
        noise_multiplier, sampling_rate, steps, bands, cycle_length: as :func:`banded_mf_event`'s.
        delta: the target ``delta``.
        sampler: the data's sampler instead of ``cycle_length``: its guaranteed separation
            (:func:`separation_of`) is used, so a :class:`~pergrad.privacy.PoissonSampler` is
            refused for ``bands > 1``, and its ``sampling_rate`` must be ``sampling_rate``.
        accountant: ``"rdp"`` or ``"pld"``.

    Raises:
        ValueError: the participations are not ``bands`` apart, or the sampler's rate differs.
    """
    if sampler is not None:
        if cycle_length is not None:
            raise ValueError("Pass cycle_length or sampler, not both.")
        cycle_length = separation_of(sampler)
        if not math.isclose(sampler.sampling_rate, sampling_rate, rel_tol=1e-9):
            raise ValueError(
                f"sampling_rate={sampling_rate} is not the sampler's ({sampler.sampling_rate})."
            )
    cycle_length = bands if cycle_length is None else cycle_length
    check_separation(bands, cycle_length)
    return epsilon(noise_multiplier, sampling_rate, participations(steps, cycle_length), delta, accountant)
