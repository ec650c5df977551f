"""A callback that logs DP-SGD's ``epsilon`` and enforces a privacy budget, and the
checks of a DP ``fit`` call that involve it (:func:`check_dp_fit`)."""

from __future__ import annotations

import math
import warnings

import keras

from pergrad.log import LOGGER
from pergrad.privacy.accounting import epsilon, make_accountant, steps_within_budget
from pergrad.privacy.banded_accounting import check_separation, participations
from pergrad.privacy.dp_sgd import UNLIMITED_STEPS, steps_taken
from pergrad.privacy.sampling import PoissonSampler
from pergrad.privacy.validation import (
    NotPoissonSampledWarning,
    check_accountant_matches,
    check_separation_matches,
    check_units_match,
    validate_model_for_dp,
)

#: The privacy units a guarantee can be for (``PrivacyAccountant(unit=...)``).
UNITS = ("example", "user")


class PrivacyBudgetExhaustedError(RuntimeError):
    """Training was asked to continue after the privacy budget was spent."""


class PrivacyAccountant(keras.callbacks.Callback):
    """Logs ``epsilon`` after every epoch and stops training at a budget.

    The number of DP steps taken is state of the model's DP rule
    (``DPGaussian.step_count``: incremented inside the train step, saved and
    restored with the weights, not reset by ``compile()``), and the callback
    reads it whenever it needs it, never caching it across a restore. So
    ``epsilon`` counts every step the model has taken, over several ``fit``
    calls, after ``load_model`` (re-compiled or not), ``load_weights``, or
    ``keras.callbacks.BackupAndRestore`` listed before or after this callback.
    ``epsilon`` is added to the epoch's logs, hence to ``History`` and the
    progress bar.

    With ``max_epsilon``, the number of steps the budget allows is computed
    once, and training stops (``model.stop_training = True``) after the last
    step that keeps ``epsilon <= max_epsilon``: the logged ``epsilon`` never
    exceeds the budget, and an interrupted and resumed run stops at the same
    total step count as an uninterrupted one. A ``fit`` that starts with the
    budget already spent raises :class:`PrivacyBudgetExhaustedError` before
    its first step (checked again at the first batch, after any restore).
    The budget also holds inside a group of ``steps_per_execution > 1`` steps,
    which Keras runs without calling back in between: for the fit, the callback
    sets the DP rule's ``step_limit``, and the train step applies no update (and
    counts no step) once the rule's step count has reached it.

    A restore discards the steps taken after the backup it restores; they are
    not counted. If the weights or outputs of such discarded steps were
    published, count them yourself.

    At the start of training the callback checks the model with
    :func:`pergrad.privacy.validate_model_for_dp` and that the model's DP
    aggregator uses the same ``noise_multiplier``; ``PerExampleModel.fit``
    also checks ``sampling_rate`` against its :class:`PoissonSampler`.

    Args:
        noise_multiplier: ``z`` of :func:`pergrad.privacy.dp_gaussian`.
        sampling_rate: ``q`` of the :class:`PoissonSampler`.
        delta: the ``delta`` of the guarantee.
        max_epsilon: the budget; ``None`` only logs.
        accountant: ``"rdp"`` (default) or ``"pld"``.
        log_name: the key under which ``epsilon`` is logged.
        unit: whom the guarantee protects: ``"example"`` (``dp_gaussian`` on a
            ``PoissonSampler``: adding or removing one example) or ``"user"``
            (``user_level_dp_gaussian`` on a ``UserSampler``: one user, all of its
            examples; ``sampling_rate`` is then the users'). It must match the
            model's rule; :attr:`guarantee` says it in words.
        cycle_length: the ``cycle_length`` ``k`` of the
            :class:`~pergrad.privacy.CyclicPoissonSampler` the model trains on; required
            for :func:`~pergrad.privacy.banded_mf_gaussian` with ``bands > 1`` (``k >= b``).
            ``epsilon`` is then BandMF's amplified one
            (:func:`~pergrad.privacy.banded_mf_epsilon`): DP-SGD's with ``ceil(T / k)``
            steps at ``sampling_rate``, and ``max_epsilon`` stops after ``k`` times the
            steps DP-SGD's budget allows. A rule with fewer bands, or a sampler with
            another separation, is refused at ``fit``.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling_rate: float,
        delta: float,
        *,
        max_epsilon: float | None = None,
        accountant: str = "rdp",
        log_name: str = "epsilon",
        unit: str = "example",
        cycle_length: int | None = None,
    ):
        super().__init__()
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}.")
        if cycle_length is not None:
            check_separation(1, cycle_length)  # a positive integer
            cycle_length = int(cycle_length)
        #: The sampler's ``cycle_length`` (BandMF's accounting), or ``None`` (DP-SGD's).
        self.cycle_length = cycle_length
        self.unit = unit
        # Validates the arguments and the accountant's name right away.
        epsilon(noise_multiplier, sampling_rate, 0, delta, accountant)
        make_accountant(accountant)
        if max_epsilon is not None and not max_epsilon > 0:
            raise ValueError(f"max_epsilon must be positive, got {max_epsilon}.")
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_rate = float(sampling_rate)
        self.delta = float(delta)
        self.max_epsilon = max_epsilon
        self.accountant = accountant
        self.log_name = log_name
        #: The step count last read from the model.
        self.steps = 0
        self.max_steps: int | None = None
        self._first_batch = True

    def accounted_steps(self, steps: int) -> int:
        """The DP-SGD steps whose composition ``epsilon`` counts after ``steps`` steps: the
        most participations of one example with a ``cycle_length``, ``steps`` otherwise."""
        return steps if self.cycle_length is None else participations(steps, self.cycle_length)

    @property
    def epsilon(self) -> float:
        """``epsilon`` after the steps counted at the last read."""
        return epsilon(self.noise_multiplier, self.sampling_rate, self.accounted_steps(self.steps),
                       self.delta, self.accountant)

    @property
    def guarantee(self) -> str:
        """What :attr:`epsilon` means, in words."""
        unit = "one example" if self.unit == "example" else "one user (all of its examples)"
        cyclic = "" if self.cycle_length is None else f" (cycles of {self.cycle_length} steps)"
        return (f"({self.epsilon:.4g}, {self.delta:g})-DP after {self.steps} steps{cyclic}, for "
                f"adding or removing {unit}")

    def _read_steps(self) -> int:
        # Optimizer steps for a model without a DP rule (warned at train begin).
        self.steps = steps_taken(self.model)
        return self.steps

    def _check_model(self) -> None:
        inner = getattr(self.model, "model", None)
        validate_model_for_dp(inner if isinstance(inner, keras.Model) else self.model)
        aggregator = getattr(self.model, "aggregator", None)
        if not getattr(aggregator, "differentially_private", False):
            warnings.warn(
                "PrivacyAccountant is used with a model whose aggregator is not a DP "
                "aggregator (pergrad.privacy.dp_gaussian): the logged epsilon describes "
                "nothing this training does.",
                stacklevel=3,
            )
            return
        check_accountant_matches(self, aggregator)

    def _check_budget(self) -> None:
        if self.max_steps is not None and self._read_steps() >= self.max_steps:
            raise PrivacyBudgetExhaustedError(
                f"The privacy budget epsilon={self.max_epsilon} (delta={self.delta}) allows "
                f"{self.max_steps} steps and {self.steps} were already taken."
            )

    def on_train_begin(self, logs=None):
        self._check_model()
        if self.max_epsilon is not None:
            self.max_steps = steps_within_budget(
                self.max_epsilon, self.delta, self.noise_multiplier, self.sampling_rate, self.accountant
            )
            if self.cycle_length is not None:  # ceil(T / k) <= n  <=>  T <= n k
                self.max_steps *= self.cycle_length
        self._first_batch = True
        self._check_budget()
        self._read_steps()
        self._set_step_limit(self.max_steps)

    def on_train_end(self, logs=None):
        self._set_step_limit(None)
        if self.max_steps is not None and self._read_steps() >= self.max_steps:
            LOGGER.warning(
                "pergrad: PrivacyAccountant stopped training at the privacy budget: %d steps "
                "taken, epsilon=%.4g reached, budget epsilon=%g (delta=%g).",
                self.steps, self.epsilon, self.max_epsilon, self.delta,
            )

    def _set_step_limit(self, steps: int | None) -> None:
        """The DP rule's ``step_limit`` for this fit (``None``: no limit)."""
        aggregator = getattr(self.model, "aggregator", None)
        if getattr(aggregator, "differentially_private", False) and aggregator.built:
            aggregator.step_limit.assign(UNLIMITED_STEPS if steps is None else min(steps, UNLIMITED_STEPS))

    def on_train_batch_begin(self, batch, logs=None):
        if self._first_batch:
            # BackupAndRestore listed after this callback restores the count
            # after on_train_begin: look again before the first step.
            self._first_batch = False
            self._check_budget()

    def on_train_batch_end(self, batch, logs=None):
        if self._read_steps() >= (self.max_steps if self.max_steps is not None else math.inf):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self._read_steps()
        if logs is not None:
            logs[self.log_name] = self.epsilon


def _accountants(callbacks) -> list:
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return [c for c in callbacks if isinstance(c, PrivacyAccountant)]


def check_budget_on_replicas(model, callbacks=None) -> None:
    """Raises if a :class:`PrivacyAccountant` with ``max_epsilon`` among ``callbacks`` would
    have to stop ``model``, which trains on several replicas that each run the train step
    (``pergrad.distributed.training.check_fit`` asks), inside a group of
    ``steps_per_execution`` steps: a ``tf.distribute`` train step cannot skip the
    optimizer's all-reduce."""
    grouped = getattr(model, "steps_per_execution", 1) > 1
    if grouped and any(accountant.max_epsilon is not None for accountant in _accountants(callbacks)):
        raise ValueError(
            "PrivacyAccountant(max_epsilon=...) cannot enforce the budget inside a group of "
            f"steps_per_execution={model.steps_per_execution} steps on several replicas "
            "(a tf.distribute train step cannot skip the optimizer's all-reduce): compile "
            "with steps_per_execution=1."
        )


def check_dp_fit(model, x=None, callbacks=None) -> None:
    """Checks a ``fit(x, ...)`` call of a ``PerExampleModel`` with a DP aggregator.

    Does nothing unless ``model.aggregator`` is differentially private
    (``pergrad.privacy.dp_gaussian``). Then: validates the wrapped model
    (:func:`validate_model_for_dp`); warns
    (:class:`NotPoissonSampledWarning`) when ``x`` is not a
    :class:`PoissonSampler`, since the accountant assumes Poisson sampling;
    with a sampler, raises if the aggregator has no ``expected_batch_size``
    (the padded batch's size is not the number of examples) and warns if it
    differs from ``sampler.expected_batch_size``. Raises if a
    :class:`~pergrad.privacy.PrivacyAccountant` among ``callbacks`` has
    another noise multiplier than the rule, or another sampling rate than the
    sampler.
    """
    aggregator = getattr(model, "aggregator", None)
    if not getattr(aggregator, "differentially_private", False):
        return
    inner = getattr(model, "model", model)
    validate_model_for_dp(inner)
    if isinstance(x, PoissonSampler):  # participations as far apart as a banded rule's bands
        check_separation_matches(aggregator, x)
    for accountant in _accountants(callbacks):
        check_accountant_matches(accountant, aggregator, x if isinstance(x, PoissonSampler) else None)
    if isinstance(x, PoissonSampler):
        check_units_match(aggregator, x)
    if not isinstance(x, PoissonSampler):
        warnings.warn(
            "Training a DP model on batches that are not Poisson samples: the epsilon "
            "of pergrad.privacy.epsilon and PrivacyAccountant assumes each example is "
            "included independently with probability q at every step. Use "
            "pergrad.privacy.PoissonSampler(x, y, sampling_rate=q).",
            NotPoissonSampledWarning,
            stacklevel=3,
        )
        return
    expected = aggregator.expected_batch_size
    if expected is None:
        raise ValueError(
            "A PoissonSampler pads its batches with zero-weight rows, so the DP aggregator "
            "needs the expected batch size as its denominator: "
            f"dp_gaussian(..., expected_batch_size={x.expected_batch_size:g})."
        )
    if abs(expected - x.expected_batch_size) > 1e-6 * x.expected_batch_size:
        warnings.warn(
            f"The DP aggregator divides by expected_batch_size={expected:g} but the "
            f"sampler's expected batch size is {x.expected_batch_size:g} "
            f"(sampling_rate * dataset_size).",
            stacklevel=3,
        )
