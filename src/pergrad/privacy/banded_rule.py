"""BandMF in ``fit()``: DP-SGD's clipping with correlated noise ``(C^-1 Z)_t`` (banded MF).

:class:`BandedMFGaussian` clips and sums as :class:`~pergrad.privacy.DPGaussian` and, instead of
the step's independent noise ``z_t``, adds ``w_t = (C^-1 Z)_t`` for a banded Toeplitz strategy
``C`` (:class:`~pergrad.privacy.BandedStrategy`), by the recurrence of
:func:`~pergrad.privacy.correlate_step` over the last ``b - 1`` noises, in a ring buffer, a Keras
variable of the rule. The mechanism, the sampler it needs and its accounting are in docs/banded-mf.md and
:mod:`pergrad.privacy.banded`, :mod:`pergrad.privacy.banded_accounting`.

References:
    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta and Xu, 2023, "(Amplified) banded
    matrix factorization: a unified approach to private training", NeurIPS.
    https://arxiv.org/abs/2306.08153
"""

from __future__ import annotations

import math

import numpy as np
from keras import ops

from pergrad.aggregators.base import ExampleStatistics, serializable
from pergrad.arguments import check_number
from pergrad.backend import assign_slot
from pergrad.privacy.banded import BandedStrategy
from pergrad.privacy.dp_sgd import DPGaussian, split_like


def _strategy(bands, strategy) -> BandedStrategy:
    """The normalized strategy of ``banded_mf_gaussian(bands=..., strategy=...)``."""
    if strategy is None:
        if bands is None:
            raise ValueError("banded_mf_gaussian needs bands= (or strategy=BandedStrategy...).")
        if isinstance(bands, bool) or int(bands) != bands or bands < 1:
            raise ValueError(f"bands must be a positive integer, got {bands!r}.")
        return BandedStrategy.fhu(int(bands))
    if not isinstance(strategy, BandedStrategy):
        strategy = BandedStrategy(strategy)  # coefficients (a saved config's)
    if bands is not None and bands != strategy.bands:
        raise ValueError(f"bands={bands!r} but the strategy has {strategy.bands} bands: pass one of them.")
    return strategy.normalized()


@serializable
class BandedMFGaussian(DPGaussian):
    """DP-SGD's clipping with BandMF's correlated noise (Choquette-Choo et al., 2023).

    The result of step ``t`` is ``(sum_i clip_C(g_i) + w_t) / B_e``: the clipped sum of
    :class:`~pergrad.privacy.DPGaussian` (flat or ``per_layer``, the same ``C``), plus the noise
    ``w = C_s^-1 Z`` of a banded lower-triangular Toeplitz strategy ``C_s`` of ``b`` bands,
    coefficients ``c_0 .. c_{b-1}`` (:class:`~pergrad.privacy.BandedStrategy`; default
    :meth:`~pergrad.privacy.BandedStrategy.fhu`), where ``z_t ~ N(0, (z C)^2 I)`` is exactly the
    noise ``dp_gaussian`` with this key draws at step ``t`` (:meth:`DPGaussian.step_noise`: the
    same secret counter-based generator, a pure function of (key, ``t``))::

        w_t = (z_t - c_1 w_{t-1} - ... - c_{b-1} w_{t-b+1}) / c_0

    **What the noise multiplier means.** The strategy is normalized to a largest column norm
    of 1 (``strategy.normalized()``, which ``fhu`` and ``optimized`` are already). The model
    sees ``A X + B Z`` with ``B = A C_s^-1``: the post-processing of the release ``C_s X + Z``,
    whose one participation of one example moves it by a column of ``C_s`` times a clipped
    gradient, of norm at most ``C * 1``. With participations at least ``b`` steps apart
    (:class:`~pergrad.privacy.CyclicPoissonSampler` with ``cycle_length >= b``) two
    participations touch disjoint rows, and each block of rows is one Poisson-subsampled
    Gaussian mechanism of sensitivity ``C`` under noise ``z C``: ``z`` is the noise multiplier
    of DP-SGD's accounting, over ``ceil(T / k)`` steps at the sampler's rate
    (:func:`~pergrad.privacy.banded_mf_epsilon`; docs/banded-mf.md, "Accounting"). A strategy
    given unnormalized is normalized here: the same model, at the noise this ``z`` calls for.
    With ``b = 1`` the strategy is ``C = I`` and the rule is ``dp_gaussian``, noise for noise.

    **State.** ``noise_buffer``: one non-trainable float32 variable of shape ``(b - 1, P)``,
    ``P`` the model's trainable parameters (its variables' coordinates in order), holding the
    last ``b - 1`` noises ``w`` added to the update: a ring, ``w_t`` in slot ``t mod (b - 1)``:
    ``b - 1`` copies of the parameters. Regenerating the past ``z`` from the key instead would
    need the whole history, ``C^-1`` being dense. The buffer is updated in the train step (carried through the
    JAX step like ``step_count``), not at a step past the budget's ``step_limit``, saved by
    ``model.save``, ``save_weights`` and ``BackupAndRestore`` and restored with the step count,
    so a resumed run continues the recurrence: it neither adds again noise it added nor loses
    the correlation. The key is never saved (a secret key is drawn afresh at a load, as
    :class:`DPGaussian`'s): the later ``z`` are then fresh draws, which the analysis allows.
    **The buffer is secret**: with the weights before and after a step it gives the clipped
    gradient sum without noise. A checkpoint of the ``PerExampleModel`` must be kept as
    private as the data; publish the trained network alone (``model.model.save(...)``),
    which holds no buffer.

    **Where it may be used.** As ``dp_gaussian``, on a sampler whose participations are at
    least ``b`` steps apart: ``fit`` refuses, before any step, a
    :class:`~pergrad.privacy.PoissonSampler` (``b > 1``) or a ``CyclicPoissonSampler`` with
    ``cycle_length < b``, and :class:`~pergrad.privacy.PrivacyAccountant` needs
    ``cycle_length=``. ``expected_batch_size`` is required (the noise is kept scaled by it).

    Args:
        l2_norm_clip: the clipping norm ``C`` (> 0).
        noise_multiplier: ``z`` (>= 0): ``Z``'s standard deviation over ``C``.
        bands: ``b`` (>= 1), for the default strategy ``BandedStrategy.fhu(b)``.
        expected_batch_size: the denominator ``B_e`` (``sampler.expected_batch_size``).
        strategy: a :class:`~pergrad.privacy.BandedStrategy` or its coefficients, instead of
            ``fhu(bands)`` (``bands`` may then be left out).
        per_layer, seed, diagnostics: as :class:`DPGaussian`'s (an integer seed is insecure).

    References:
        Choquette-Choo et al., 2023, "(Amplified) banded matrix factorization: a unified
        approach to private training", NeurIPS. https://arxiv.org/abs/2306.08153
        McKenna, 2024, "Scaling up the banded matrix factorization mechanism for
        differentially private ML". https://arxiv.org/abs/2405.15913
    """

    #: The buffer is sized by the trainable variables the rule was built for.
    state_per_variable = True

    def __init__(self, l2_norm_clip: float, noise_multiplier: float, *, bands: int | None = None,
                 expected_batch_size: float | None = None, strategy=None, per_layer: bool = False,
                 seed: int | None = None, diagnostics: bool = False, **kwargs):
        if expected_batch_size is None:
            raise ValueError(
                "banded_mf_gaussian needs expected_batch_size (sampler.expected_batch_size): its "
                "noise buffers hold the noise of the update, divided by it."
            )
        check_number("banded_mf_gaussian", "expected_batch_size", expected_batch_size, low=0, low_open=True)
        #: The normalized strategy (largest column norm 1).
        self.strategy = _strategy(bands, strategy)
        super().__init__(l2_norm_clip, noise_multiplier, per_layer=per_layer,
                         expected_batch_size=expected_batch_size, seed=seed, diagnostics=diagnostics,
                         **kwargs)
        #: The ring of past noises (a float32 variable of shape ``(b - 1, parameters)``), None
        #: for ``b = 1`` and before the rule is built.
        self.noise_buffer = None
        #: The :attr:`~pergrad.privacy.CyclicPoissonSampler.groups_fingerprint` of the sampler
        #: whose groups the buffer's noise was added on (saved with them); None before a fit.
        self.groups_fingerprint = None

    def continue_on(self, fingerprint: str, steps: int) -> None:
        """Called when a fit begins on a :class:`~pergrad.privacy.CyclicPoissonSampler` of the
        groups ``fingerprint``, the model at step ``steps``: a fit that continues the noise's
        recurrence (``steps > 0``) must keep the groups its earlier steps were drawn from, or
        an example's participations on either side of the resumption need not be ``bands``
        steps apart. Raises before any step if they differ; records them otherwise."""
        if steps > 0 and fingerprint != self.groups_fingerprint:
            raise ValueError(
                f"This banded_mf_gaussian model has taken {steps} steps, and its noise buffer "
                "continues their correlation, but the CyclicPoissonSampler of this fit has other "
                "groups than the one its noises were added on (a sampler made with seed=None draws new "
                "groups in each process), so participations around the resumption need not be "
                f"{self.bands} steps apart. Resume with the sampler of the same seed (pass seed= "
                "when making it, and keep it as secret as the checkpoint), or start a new run."
            )
        self.groups_fingerprint = fingerprint

    @property
    def bands(self) -> int:
        """``b``: the strategy's bands, the least separation of participations the rule needs."""
        return self.strategy.bands

    def build(self, shapes=None):
        super().build(shapes)
        self.noise_buffer = None
        if self.bands > 1:
            size = sum(math.prod(tuple(shape[1:])) for shape in shapes)
            self.noise_buffer = self.add_weight(shape=(self.bands - 1, size), initializer="zeros",
                                                dtype="float32", trainable=False, name="noise_buffer")

    def save_own_variables(self, store):
        super().save_own_variables(store)  # the step count (never the key)
        if self.noise_buffer is not None:
            store["noise_buffer"] = self.noise_buffer
            # which groups the buffer's noise was added on (32 bytes, 0: none)
            store["groups_fingerprint"] = np.frombuffer(
                bytes.fromhex(self.groups_fingerprint or "00" * 32), np.uint8)

    def load_own_variables(self, store):
        if self.noise_buffer is not None:
            saved = store["noise_buffer"] if "noise_buffer" in store else None
            if saved is None or tuple(saved.shape) != tuple(self.noise_buffer.shape):
                found = "none" if saved is None else f"shape {tuple(saved.shape)}"
                raise ValueError(
                    f"The saved weights hold no noise buffer of shape {tuple(self.noise_buffer.shape)} "
                    f"for {self.name!r} (found {found}; keys {list(store.keys())}): they were not "
                    f"saved from a BandedMFGaussian of {self.bands} bands for this model."
                )
        super().load_own_variables(store)
        if self.noise_buffer is not None:
            self.noise_buffer.assign(store["noise_buffer"])
            recorded = bytes(np.asarray(store["groups_fingerprint"], np.uint8)) \
                if "groups_fingerprint" in store else bytes(32)
            self.groups_fingerprint = recorded.hex() if any(recorded) else None

    def step_noise(self, result: list, stats: ExampleStatistics, step) -> list:
        """``w_t``, one step of the recurrence on :meth:`DPGaussian.flat_step_noise`'s ``z_t``,
        cut into the variables' shapes; the buffer takes ``w_t`` (unless the step is past
        ``step_limit``: not applied).

        The buffer is a ring indexed by the step count: ``w_t`` goes to slot ``t mod (b - 1)``,
        written in place (:func:`~pergrad.backend.assign_slot`), so a step reads the past
        noises once and writes one, not the whole buffer shifted; one buffer for all variables,
        so a step is a few operations whatever the model (torch dispatches each)."""
        z = self.flat_step_noise(result, stats, step)
        if self.bands == 1:  # c_0 = 1: DP-SGD's noise itself
            return split_like(z, result)
        scale, feedback = self.strategy.recurrence
        slots = self.bands - 1
        step = ops.cast(step, "int32")
        # Slot s holds w_{t-k} for k - 1 = (t - 1 - s) mod (b - 1) (+ b - 1: kept >= 0).
        lags = ops.mod(step - 1 - ops.arange(slots, dtype="int32") + slots, slots)
        weights = ops.take(ops.convert_to_tensor(np.asarray(feedback, np.float32)), lags)
        slot = ops.mod(step, slots)
        past = ops.convert_to_tensor(self.noise_buffer.value)
        w = z * np.float32(scale) - ops.tensordot(weights, past, axes=1)
        # Past the limit the slot keeps its value (one slot read, not a pass over the buffer),
        # and the step's noise is not applied, whatever its value.
        allowed = ops.less(step, self.step_limit.value)
        w = assign_slot(self.noise_buffer, slot, ops.where(allowed, w, ops.take(past, slot, axis=0)))
        return split_like(w, result)

    def get_config(self):
        return {
            **super().get_config(),
            "bands": self.bands,
            "strategy": [float(c) for c in self.strategy.coefficients],
        }


def banded_mf_gaussian(
    l2_norm_clip: float,
    noise_multiplier: float,
    *,
    bands: int | None = None,
    expected_batch_size: float,
    strategy=None,
    per_layer: bool = False,
    seed: int | None = None,
    diagnostics: bool = False,
) -> BandedMFGaussian:
    """DP-SGD with BandMF's correlated noise (Choquette-Choo et al., 2023): clip, sum, add
    ``(C^-1 Z)_t``, divide.

    Each example is clipped to ``l2_norm_clip`` as by :func:`~pergrad.privacy.dp_gaussian`; the
    noise of step ``t`` is ``w_t = (z_t - sum_k c_k w_{t-k}) / c_0`` over the last ``bands - 1``
    noises, ``z_t`` the noise ``dp_gaussian`` would add (standard deviation
    ``noise_multiplier * l2_norm_clip`` on the sum), for the column-normalized strategy
    ``BandedStrategy.fhu(bands)`` or ``strategy``. Train it on a
    :class:`~pergrad.privacy.CyclicPoissonSampler` with ``cycle_length >= bands`` and account
    with ``PrivacyAccountant(..., cycle_length=...)``. See :class:`BandedMFGaussian`.

    Example:
        >>> b, B = 4, 64
        >>> sampler = pergrad.privacy.CyclicPoissonSampler(
        ...     x, y, sampling_rate=B * b / len(x), cycle_length=b)
        >>> rule = pergrad.privacy.banded_mf_gaussian(
        ...     1.0, 1.5, bands=b, expected_batch_size=sampler.expected_batch_size)
        >>> model = pergrad.PerExampleModel(net, rule)
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        >>> model.fit(sampler, epochs=10, callbacks=[pergrad.privacy.PrivacyAccountant(
        ...     1.5, sampler.sampling_rate, delta=1e-5, cycle_length=b, max_epsilon=3.0)])
    """
    return BandedMFGaussian(l2_norm_clip, noise_multiplier, bands=bands,
                            expected_batch_size=expected_batch_size, strategy=strategy,
                            per_layer=per_layer, seed=seed, diagnostics=diagnostics)
