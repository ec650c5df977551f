"""Banded matrix factorization (BandMF): the strategy, its noise recurrence and its sensitivity.

Pure NumPy, no Keras state: the reference that a correlated-noise rule in ``fit()`` follows.

**The mechanism.** DP-SGD adds independent noise ``z_t`` to the clipped gradient sum ``x_t`` of
every step; the model is (for SGD) a function of the prefix sums ``A x`` (``A`` the lower-triangular
matrix of ones), whose noise ``A z`` grows like ``sqrt(t)``. The matrix mechanism factors
``A = B C`` and releases ``C x + z``, so that the model sees ``A x + B z``: in terms of one step,
the noise added at step ``t`` is ``(C^-1 z)_t`` (``B = A C^-1``) instead of ``z_t``. Its
correlation across steps cancels much of the noise in the prefix sums. With ``C`` lower triangular
and *banded* (``C[i, j] = 0`` for ``i - j >= b``: ``b`` bands) and every example participating at
most once every ``b`` steps, the columns of ``C`` an example touches have disjoint supports, which
is what makes the privacy analysis (:mod:`pergrad.privacy.banded_accounting`) a DP-SGD one.

**Toeplitz strategies.** Here ``C`` is lower-triangular Toeplitz, ``C[i, j] = c_{i - j}``, given by
its ``b`` coefficients ``c_0 .. c_{b-1}`` (:class:`BandedStrategy`). The default,
:meth:`BandedStrategy.fhu`, is the square root of the prefix-sum matrix of Fichtenberger, Henzinger
and Upadhyay (2023), ``c_k = binom(2k, k) / 4^k`` (``A = C C``; optimal for the largest error
among all factorizations with single participation, Dvijotham et al., 2024), truncated to ``b``
bands and divided by its L2 norm, as jax-privacy's ``ColumnNormalizedBanded.default`` does: every
column of ``C`` then has norm at most 1 (the sensitivity of one participation).
:meth:`BandedStrategy.optimized` minimizes the mean squared error of the prefix sums instead
(McKenna, 2024; jax-privacy's ``optimize_banded_toeplitz``), with SciPy's L-BFGS.

**The noise recurrence.** ``w = C^-1 z`` solves ``sum_{k < b} c_k w_{t-k} = z_t``::

    w_t = (z_t - c_1 w_{t-1} - ... - c_{b-1} w_{t-b+1}) / c_0

so a step needs the last ``b - 1`` noises ``w`` (not the ``z``: ``C^-1`` is dense, so regenerating
past ``z`` from a key would cost the whole history). :func:`correlate_step` is one step of it on
``b - 1`` buffers, :meth:`BandedStrategy.correlate` applies ``C^-1`` to a stack of ``z``. With
positive non-increasing coefficients (the FHU ones) the recurrence is stable: the polynomial
``sum_k c_k x^k`` has no root in the closed unit disk (Eneström–Kakeya), so ``w`` stays bounded.
``b = 1`` is DP-SGD: ``C = I`` after normalization, ``w = z``.

References:
    Fichtenberger, Henzinger and Upadhyay, 2023, "Constant matters: fine-grained error bound on
    differentially private continual observation", ICML. https://arxiv.org/abs/2202.11205
    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta and Xu, 2023, "(Amplified) banded
    matrix factorization: a unified approach to private training", NeurIPS.
    https://arxiv.org/abs/2306.08153
    McKenna, 2024, "Scaling up the banded matrix factorization mechanism for differentially
    private ML". https://arxiv.org/abs/2405.15913
    Dvijotham, McMahan, Pillutla, Steinke and Thakurta, 2024, "Efficient and near-optimal noise
    generation for streaming differential privacy". https://arxiv.org/abs/2404.16706
    Kalinin and Lampert, 2024, "Banded square root matrix factorization for differentially
    private model training" (the min-separation sensitivity of non-negative, non-increasing
    Toeplitz strategies, Theorem 2). https://arxiv.org/abs/2405.13763
"""

from __future__ import annotations

import math

import numpy as np


def fhu_coefficients(bands: int) -> np.ndarray:
    """The first ``bands`` coefficients of the square root of the prefix-sum matrix:
    ``c_k = binom(2k, k) / 4^k = prod_{j <= k} (2j - 1) / (2j)`` (``1, 1/2, 3/8, 5/16, ...``),
    not normalized (Fichtenberger, Henzinger and Upadhyay, 2023)."""
    bands = _positive_int("bands", bands)
    k = np.arange(1, bands, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def correlate_step(z, buffers, coefficients):
    """One step of ``w = C^-1 z``: returns ``(w_t, buffers')``.

    Args:
        z: ``z_t``, the step's independent noise (any shape).
        buffers: ``(b - 1, *z.shape)``: the previous noises, newest first
            (``w_{t-1}, ..., w_{t-b+1}``; zeros before the first step).
        coefficients: ``c_0 .. c_{b-1}``.

    Returns:
        ``w_t = (z_t - sum_{k >= 1} c_k w_{t-k}) / c_0`` and the buffers with ``w_t`` first and the
        oldest dropped.
    """
    coefficients = np.asarray(coefficients, dtype=np.float64)
    z = np.asarray(z, dtype=np.float64)
    if len(coefficients) == 1:
        return z / coefficients[0], buffers
    w = (z - np.tensordot(coefficients[1:], buffers, axes=1)) / coefficients[0]
    return w, np.concatenate([w[None], buffers[:-1]])


class BandedStrategy:
    """A banded lower-triangular Toeplitz strategy matrix ``C``: ``C[i, j] = c_{i-j}`` for
    ``0 <= i - j < b``, else 0 (module docstring).

    Args:
        coefficients: ``c_0 .. c_{b-1}`` (``c_0 > 0``), as given: :meth:`normalized` divides
            them by their norm, which :meth:`fhu` and :meth:`optimized` do.
    """

    def __init__(self, coefficients):
        coefficients = np.array(coefficients, dtype=np.float64)
        if coefficients.ndim != 1 or len(coefficients) == 0:
            raise ValueError(f"coefficients must be a non-empty vector, got shape {coefficients.shape}.")
        if not np.all(np.isfinite(coefficients)):
            raise ValueError("coefficients must be finite.")
        if not coefficients[0] > 0:
            raise ValueError(f"c_0 must be positive (C must be invertible), got {coefficients[0]}.")
        coefficients.setflags(write=False)
        self._coefficients = coefficients

    @classmethod
    def fhu(cls, bands: int) -> BandedStrategy:
        """Fichtenberger–Henzinger–Upadhyay's coefficients truncated to ``bands`` bands, of norm 1
        (:func:`fhu_coefficients`; jax-privacy's ``ColumnNormalizedBanded.default`` before the
        column normalization that needs the number of steps). ``fhu(1)`` is DP-SGD."""
        return cls(fhu_coefficients(bands)).normalized()

    @classmethod
    def optimized(cls, bands: int, steps: int, *, initial=None, max_iterations: int = 500) -> BandedStrategy:
        """The ``bands`` coefficients (of norm 1) that minimize :meth:`loss` for ``steps`` steps: the
        mean squared error of the prefix sums times the squared sensitivity of one participation,
        jax-privacy's ``toeplitz.optimize_banded_toeplitz`` objective, by SciPy's L-BFGS on its
        logarithm from :meth:`fhu` (or ``initial``) with the exact gradient; never worse than the
        start. Milliseconds to a fraction of a second for ``steps <= 10^4``, ``bands <= 64``.
        Needs SciPy (which ``dp-accounting`` brings).

        The coefficients are optimized for ``steps`` steps; unlike the FHU ones they need not be
        positive and non-increasing, so nothing guarantees that the noise recurrence stays
        bounded beyond ``steps`` (check :meth:`noise_variance` for longer runs).
        """
        try:
            from scipy import optimize
        except ImportError as error:  # an optional dependency
            raise ImportError(
                "BandedStrategy.optimized needs SciPy: `pip install scipy` (or pergrad[privacy])."
            ) from error
        bands, steps = _positive_int("bands", bands), _positive_int("steps", steps)
        start = cls.fhu(bands).coefficients if initial is None else np.asarray(initial, np.float64)
        if start.shape != (bands,):
            raise ValueError(f"initial must have shape ({bands},), got {start.shape}.")
        start = start / np.linalg.norm(start)
        result = optimize.minimize(
            lambda c: _log_loss_and_gradient(c, steps), start, jac=True, method="L-BFGS-B",
            options={"maxiter": int(max_iterations), "gtol": 1e-12, "ftol": 1e-15},
        )
        found = result.x
        better = _log_loss_and_gradient(found, steps)[0] < _log_loss_and_gradient(start, steps)[0]
        if not (found[0] > 0 and better):
            found = start  # never worse than where it started
        return cls(found).normalized()

    @property
    def coefficients(self) -> np.ndarray:
        """``c_0 .. c_{b-1}`` (read-only float64)."""
        return self._coefficients

    @property
    def bands(self) -> int:
        """``b``: the number of nonzero diagonals."""
        return len(self._coefficients)

    @property
    def max_column_norm(self) -> float:
        """The largest column norm of ``C`` (``||c||_2``, the first column's, for ``b`` steps or
        more): the L2 sensitivity of one participation with clipping norm 1. The noise of
        ``z`` is this times the clipping norm times the noise multiplier."""
        return float(np.linalg.norm(self._coefficients))

    def normalized(self) -> BandedStrategy:
        """The same strategy divided by :attr:`max_column_norm` (every column of norm at most 1)."""
        return BandedStrategy(self._coefficients / self.max_column_norm)

    def matrix(self, steps: int) -> np.ndarray:
        """``C`` for ``steps`` steps, ``(steps, steps)``."""
        steps = _positive_int("steps", steps)
        column = np.zeros(steps)
        used = min(steps, self.bands)
        column[:used] = self._coefficients[:used]
        index = np.arange(steps)
        difference = index[:, None] - index[None, :]
        return np.where(difference >= 0, column[np.clip(difference, 0, steps - 1)], 0.0)

    @property
    def recurrence(self) -> tuple[float, np.ndarray]:
        """``(scale, feedback)``: ``w_t = scale z_t - sum_{k=1}^{b-1} feedback[k-1] w_{t-k}``,
        ``scale = 1 / c_0``, ``feedback = c_{1..b-1} / c_0`` (:func:`correlate_step`)."""
        c0 = self._coefficients[0]
        return 1.0 / c0, self._coefficients[1:] / c0

    def initial_buffers(self, shape=()) -> np.ndarray:
        """``(b - 1, *shape)`` zeros: the noise buffers before the first step."""
        return np.zeros((self.bands - 1, *tuple(shape)))

    def correlate(self, z) -> np.ndarray:
        """``C^-1 z`` along the first axis of the stack ``z`` (steps first), by the recurrence
        (:func:`correlate_step`): the reference the rule's noise follows."""
        z = np.asarray(z, dtype=np.float64)
        buffers = self.initial_buffers(z.shape[1:])
        out = np.empty_like(z)
        for t in range(len(z)):
            out[t], buffers = correlate_step(z[t], buffers, self._coefficients)
        return out

    def inverse_coefficients(self, steps: int) -> np.ndarray:
        """The first column of ``C^-1`` for ``steps`` steps (it is lower-triangular Toeplitz too,
        and dense): the weights of past ``z`` in the noise of a step."""
        impulse = np.zeros(_positive_int("steps", steps))
        impulse[0] = 1.0
        return self.correlate(impulse)

    def noise_variance(self, steps: int) -> np.ndarray:
        """``Var(w_t) / Var(z)`` for ``t < steps``: the variance of each step's noise relative to
        DP-SGD's at the same ``z`` (``sum_{j <= t} (C^-1)_{t j}^2``)."""
        return np.cumsum(self.inverse_coefficients(steps) ** 2)

    def prefix_error(self, steps: int) -> np.ndarray:
        """``E ||(B z)_t||^2`` per coordinate with unit-variance ``z``, for ``t < steps``: the
        variance of the noise in the prefix sum of the first ``t + 1`` updates (``B = A C^-1``);
        DP-SGD's (``b = 1``) is ``t + 1``. Multiply by ``max_column_norm^2`` to compare strategies
        at equal privacy."""
        return np.cumsum(np.cumsum(self.inverse_coefficients(steps)) ** 2)

    def loss(self, steps: int) -> float:
        """``mean_t prefix_error(steps)_t * max_column_norm^2``: the objective of
        :meth:`optimized` (jax-privacy's ``toeplitz.loss`` with ``jnp.mean``)."""
        return float(np.mean(self.prefix_error(steps)) * self.max_column_norm**2)

    def sensitivity(self, steps: int, min_separation: int, max_participations: int | None = None) -> float:
        """The L2 sensitivity of ``C x`` over ``steps`` steps (clipping norm 1) when each example
        participates at most ``max_participations`` times (default: as often as the separation
        allows, ``ceil(steps / min_separation)``), any two participations at least
        ``min_separation`` steps apart (``min_separation = 1``: every step).

        With ``min_separation >= bands`` the columns of two participations have disjoint
        supports, so the squared sensitivity is the sum of the participations' squared column
        norms, largest for the columns ``0, s, 2s, ...`` (Choquette-Choo et al., 2023): exact,
        whatever the signs. With fewer than ``bands`` steps between participations it is exact
        only for non-negative, non-increasing coefficients, where the worst case is the same
        pattern (Kalinin and Lampert, 2024, Theorem 2; jax-privacy's
        ``toeplitz.minsep_sensitivity_squared``); other coefficients are refused.

        This is the sensitivity of the whole release without amplification; the amplified
        accounting (:func:`pergrad.privacy.banded_mf_epsilon`) uses one participation's,
        :attr:`max_column_norm`.
        """
        steps = _positive_int("steps", steps)
        separation = _positive_int("min_separation", min_separation)
        count = math.ceil(steps / separation)
        if max_participations is not None:
            count = min(count, _positive_int("max_participations", max_participations))
        c = self._coefficients
        if separation >= self.bands:
            norms = [np.sum(c[: steps - i * separation] ** 2) for i in range(count)]
            return float(math.sqrt(math.fsum(norms)))
        if np.any(c < 0) or np.any(np.diff(c) > 0):
            raise ValueError(
                f"The sensitivity of a {self.bands}-band strategy with participations "
                f"{separation} steps apart is computed here only for non-negative, non-increasing "
                "coefficients (as the FHU ones): separate participations by at least "
                f"{self.bands} steps (CyclicPoissonSampler(cycle_length={self.bands}))."
            )
        pattern = np.zeros(steps)
        pattern[: count * separation : separation] = 1.0
        return float(np.linalg.norm(np.convolve(c, pattern)[:steps]))

    def __repr__(self) -> str:
        return f"BandedStrategy({np.array2string(self._coefficients, precision=4)})"


def _loss_and_gradient(c: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """:meth:`BandedStrategy.loss` of the (unnormalized) coefficients ``c`` and its gradient.

    ``y = C^-1 1`` (the first column of ``B = A C^-1``), ``L = s^2 mean_t cumsum(y^2)_t`` with
    ``s^2 = ||c||^2``. ``dL/dy_j = 2 s^2 y_j (n - j) / n``; ``C y = 1`` gives
    ``dy/dc_k = -C^-1 S_k y`` (``S_k`` the shift by ``k``), so
    ``dL/dc_k = -(C^-T dL/dy) . (S_k y) + 2 c_k L / s^2``, and ``C^-T g`` is ``C^-1`` applied to
    ``g`` reversed, reversed (a Toeplitz matrix is persymmetric).
    """
    from scipy import signal

    n = steps
    y = signal.lfilter([1.0], c, np.ones(n))
    squared_norm = float(c @ c)
    error = float(np.mean(np.cumsum(y**2)))
    loss = squared_norm * error
    weights = (n - np.arange(n)) / n
    adjoint = signal.lfilter([1.0], c, (2.0 * squared_norm * y * weights)[::-1])[::-1]
    shifted = [float(adjoint[k:] @ y[: n - k]) if k < n else 0.0 for k in range(len(c))]
    gradient = -np.asarray(shifted) + 2.0 * c * error
    return loss, gradient


def _log_loss_and_gradient(c: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """``log`` of :func:`_loss_and_gradient` (better scaled for L-BFGS); a large value and no
    gradient where the recurrence diverges (a root of ``sum c_k x^k`` inside the unit disk), so
    that the line search steps back."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        loss, gradient = _loss_and_gradient(c, steps)
    if not (np.isfinite(loss) and loss > 0 and np.all(np.isfinite(gradient))):
        return 1e6, np.zeros_like(c)
    return math.log(loss), gradient / loss


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
