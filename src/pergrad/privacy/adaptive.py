"""DP-SGD whose clipping norm follows a quantile of the per-example norms, privately.

Andrew, Thakkar, McMahan and Ramaswamy (2021): at every step each example
reports whether its gradient's norm is at most the current clipping norm ``C``,
``b_i = 1[||g_i|| <= C]``; the count is noised with the Gaussian mechanism and
divided by the expected batch size ``B_e``, giving a private estimate ``b~`` of
the unclipped fraction, and ``C`` moves geometrically towards the target
quantile ``gamma``: ``C <- C * exp(-eta * (b~ - gamma))``. The count is
centred (``b_i - 1/2``, as TF Privacy's ``QuantileEstimatorQuery``), so that
adding or removing one example moves it by at most ``1/2``::

    b~ = clip_[0, 1]((sum_i (b_i - 1/2) + N(0, sigma_b^2)) / B_e + 1/2)

**The noise split.** The step releases two Gaussian mechanisms on the same
Poisson sample: the clipped gradient sum (sensitivity ``C``, noise
``z_grad * C``) and the centred count (sensitivity ``1/2``, noise
``sigma_b``). Together they are one Gaussian mechanism whose noise multiplier
``z`` satisfies ``z^-2 = z_grad^-2 + (2 sigma_b)^-2`` (the sensitivities,
each over its noise, add in squares). The user gives the total ``z``, which is
what :func:`~pergrad.privacy.epsilon` and :class:`~pergrad.privacy.PrivacyAccountant`
account for; the gradient gets ``z_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2)``
(Andrew et al., Theorem 1), which needs ``2 sigma_b > z``.

References:
    Andrew, Thakkar, McMahan and Ramaswamy, 2021, "Differentially private
    learning with adaptive clipping", NeurIPS. https://arxiv.org/abs/1905.03871
"""

from __future__ import annotations

import math

import keras
from keras import ops

from pergrad.aggregators.base import Aggregation, BatchTotals, ExampleStatistics, serializable
from pergrad.arguments import check_number
from pergrad.privacy import noise
from pergrad.privacy.dp_sgd import DPGaussian

#: The count's noise at step ``t`` is the generator's draw for step ``t + COUNT_STREAM``:
#: other bits than any gradient noise of the first ``COUNT_STREAM`` steps. The clipping
#: norm stays fixed from that step on (no count is released there).
COUNT_STREAM = 2**30


def gradient_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """The gradient's noise multiplier ``z_grad`` when the clipped count takes noise
    ``count_stddev`` out of a total ``noise_multiplier`` (Andrew et al., 2021, Theorem 1).

    ``z_grad = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the gradient sum (sensitivity ``C``,
    noise ``z_grad C``) and the centred count (sensitivity ``1/2``, noise ``sigma_b``)
    released together are a Gaussian mechanism of noise multiplier ``z``.

    Args:
        noise_multiplier: the total ``z`` (>= 0) the accountant is given; ``0`` gives ``0``.
        count_stddev: ``sigma_b`` (>= 0), the noise on the centred count.

    Raises:
        ValueError: when ``2 * count_stddev <= noise_multiplier`` (with ``z > 0``): the
            count alone would spend the whole budget.
    """
    z = check_number("adaptive_dp_gaussian", "noise_multiplier", noise_multiplier, low=0)
    sigma = check_number("adaptive_dp_gaussian", "count_stddev", count_stddev, low=0)
    if z == 0:
        return 0.0
    if not 2 * sigma > z:
        raise ValueError(
            f"count_stddev={sigma:g} leaves no privacy budget for the gradient: the noised "
            f"count alone is a Gaussian mechanism of noise multiplier 2 * count_stddev = "
            f"{2 * sigma:g}, which must exceed the total noise_multiplier={z:g}. Use a "
            f"count_stddev well above {z / 2:g} (Andrew et al. suggest expected_batch_size / 20)."
        )
    return 1.0 / math.sqrt(z**-2 - (2 * sigma) ** -2)


@serializable
class AdaptiveDPGaussian(DPGaussian):
    """DP-SGD with a clipping norm that tracks a quantile of the norms (Andrew et al., 2021).

    Each step clips every example to the current norm ``C`` (the variable
    ``l2_norm_clip_state``), adds Gaussian noise ``z_grad * C`` to the sum and divides
    by ``expected_batch_size``, exactly as :class:`DPGaussian` with ``C``; then it
    counts the examples whose norm is at most ``C``, noises the centred count with
    ``count_stddev`` and updates ``C <- C exp(-learning_rate (b~ - target_quantile))``
    for the next step (module docstring). ``noise_multiplier`` is the **total** ``z``
    of both mechanisms, the one to give :class:`~pergrad.privacy.PrivacyAccountant`
    and :func:`~pergrad.privacy.epsilon`; the gradient's share is
    :attr:`gradient_noise_multiplier` (:func:`gradient_noise_multiplier`).

    **What it logs.** ``l2_norm_clip`` (the norm this step clipped to) and
    ``unclipped_fraction`` (the noised estimate ``b~``) are outputs of the mechanism:
    functions of the noised counts only, covered by the privacy guarantee, and
    logged at every step (the epoch's logs hold their mean). ``diagnostics=True``
    adds :class:`DPGaussian`'s noise-free, **non-private** ``clipped_fraction`` and
    ``gradient_norm``.

    **State.** ``C`` is a non-trainable variable beside ``step_count``: carried
    through the JAX train step, saved by ``model.save`` and ``save_weights``,
    restored by ``load_model``, ``load_weights`` and ``BackupAndRestore``, left
    alone by ``compile()``; a resumed run clips with the norm it stopped at. Steps
    past the budget's ``step_limit`` leave it unchanged. On several ``tf.distribute``
    replicas the count is summed over the replicas and its noise (the same draw on
    every replica: one key, one step) added once to that sum, so that every replica
    computes the same ``C``.

    **Which examples count.** Rows with a zero gradient are left out of the count:
    the sampler's padding rows, and examples whose gradient is exactly zero or was
    zeroed as non-finite. Adding or removing one example still moves the centred count
    by at most ``1/2``.

    Args:
        initial_l2_norm_clip: ``C`` at the first step (> 0).
        noise_multiplier: the total ``z`` (>= 0); ``0`` gives no gradient noise.
        expected_batch_size: ``B_e`` (> 0), the denominator of the gradient and of the
            count (``sampler.expected_batch_size``); required.
        target_quantile: ``gamma`` in ``(0, 1)``, the fraction of examples to leave
            unclipped (0.5: the median norm, the paper's default).
        learning_rate: ``eta`` (> 0); ``C`` grows by at most a factor
            ``exp(eta * gamma)`` and shrinks by at most ``exp(eta * (1 - gamma))``
            per step (0.2, the paper's).
        count_stddev: ``sigma_b`` (>= 0); ``None``: ``expected_batch_size / 20`` (the
            paper's and TF Privacy's suggestion). With ``noise_multiplier > 0`` it must
            exceed ``noise_multiplier / 2``.
        seed: as :class:`DPGaussian` (``None``: a secret key; an integer is insecure).
        diagnostics: also log the non-private ``clipped_fraction`` and ``gradient_norm``.

    References:
        Andrew, Thakkar, McMahan and Ramaswamy, 2021, "Differentially private
        learning with adaptive clipping", NeurIPS. https://arxiv.org/abs/1905.03871
    """

    def __init__(
        self,
        initial_l2_norm_clip: float,
        noise_multiplier: float,
        *,
        expected_batch_size: float,
        target_quantile: float = 0.5,
        learning_rate: float = 0.2,
        count_stddev: float | None = None,
        seed: int | None = None,
        diagnostics: bool = False,
        **kwargs,
    ):
        if expected_batch_size is None:
            raise ValueError(
                "adaptive_dp_gaussian needs expected_batch_size: the noised count is divided by "
                "it (the number of real examples in a Poisson batch is itself private)."
            )
        super().__init__(
            initial_l2_norm_clip,
            noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            diagnostics=diagnostics,
            **kwargs,
        )
        self.target_quantile = float(
            check_number("adaptive_dp_gaussian", "target_quantile", target_quantile, low=0, high=1,
                         low_open=True, high_open=True)
        )
        self.learning_rate = float(
            check_number("adaptive_dp_gaussian", "learning_rate", learning_rate, low=0, low_open=True)
        )
        if count_stddev is None:
            count_stddev = self.expected_batch_size / 20
        self.count_stddev = float(check_number("adaptive_dp_gaussian", "count_stddev", count_stddev, low=0))
        #: ``z_grad``: the gradient's share of ``noise_multiplier``.
        self.gradient_noise_multiplier = gradient_noise_multiplier(self.noise_multiplier, self.count_stddev)
        self.diagnostics = ("l2_norm_clip", "unclipped_fraction") + self.diagnostics

    def build(self, shapes=None):
        super().build(shapes)
        self.l2_norm_clip_state = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(self.l2_norm_clip), dtype="float32",
            trainable=False, name="l2_norm_clip_state",
        )

    def current_l2_norm_clip(self):
        return self.l2_norm_clip_state.value

    @property
    def noise_stddev(self):
        """Standard deviation of the gradient noise on each coordinate of the sum at the
        current norm: ``z_grad * C``."""
        return self.gradient_noise_multiplier * self.current_l2_norm_clip()

    def save_own_variables(self, store):
        super().save_own_variables(store)  # the step count (never the key)
        store["l2_norm_clip"] = self.l2_norm_clip_state

    def load_own_variables(self, store):
        if "l2_norm_clip" not in store:
            raise ValueError(
                f"No clipping norm for {self.name!r} in the saved weights (keys "
                f"{list(store.keys())}): they were not saved from an AdaptiveDPGaussian."
            )
        super().load_own_variables(store)
        self.l2_norm_clip_state.assign(store["l2_norm_clip"])

    def finalize(self, result: list, stats: ExampleStatistics) -> Aggregation:
        """The gradient's noise at the current ``C`` (:meth:`DPGaussian.finalize`), and the
        count of unclipped examples as the batch's totals, from which the next step's ``C``
        follows (:class:`~pergrad.aggregators.base.BatchTotals`)."""
        # Read into tensors before any assignment (a TF or torch variable's value follows it).
        step = ops.convert_to_tensor(self.step_count.value)
        clip = ops.copy(self.current_l2_norm_clip())
        outcome = super().finalize(result, stats)
        norms = ops.cast(stats.flat_norms, "float32")
        centred = ops.where(norms > 0, ops.cast(norms <= clip, "float32") - 0.5, 0.0)

        def update(count):
            # The whole batch's count (summed over the replicas by the train step), noised
            # with the same draw on every replica (one key, one step): one noise in all.
            if self.count_stddev > 0:
                # (Capped: past COUNT_STREAM steps the draw is computed but never released.)
                stream = COUNT_STREAM + ops.minimum(step, COUNT_STREAM - 1)
                count = count + noise.gaussian_noise(self._key(), stream, 1, self.count_stddev)[0]
            estimate = ops.clip(count / self.expected_batch_size + 0.5, 0.0, 1.0)
            updated = clip * ops.exp(-self.learning_rate * (estimate - self.target_quantile))
            counted = ops.logical_and(ops.less(step, self.step_limit.value), ops.less(step, COUNT_STREAM))
            self.l2_norm_clip_state.assign(ops.where(counted, updated, clip))
            return {"l2_norm_clip": clip, "unclipped_fraction": ops.where(counted, estimate, float("nan"))}

        return Aggregation(outcome.gradients, outcome.reports, outcome.batch_term,
                           BatchTotals(ops.sum(centred), update))

    def get_config(self):
        config = super().get_config()
        for key in ("l2_norm_clip", "per_layer"):
            config.pop(key)
        return {
            **config,
            "initial_l2_norm_clip": self.l2_norm_clip,
            "target_quantile": self.target_quantile,
            "learning_rate": self.learning_rate,
            "count_stddev": self.count_stddev,
        }


def adaptive_dp_gaussian(
    initial_l2_norm_clip: float,
    noise_multiplier: float,
    *,
    expected_batch_size: float,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_stddev: float | None = None,
    seed: int | None = None,
    diagnostics: bool = False,
) -> AdaptiveDPGaussian:
    """DP-SGD with adaptive clipping (Andrew et al., 2021): ``C`` follows a quantile.

    The clipping norm starts at ``initial_l2_norm_clip`` and moves, every step, towards
    the ``target_quantile`` of the per-example gradient norms, estimated from a noised
    count; ``noise_multiplier`` is the total ``z`` the accountant is given, split
    between the gradient and the count (:func:`gradient_noise_multiplier`). See
    :class:`AdaptiveDPGaussian`.

    Example:
        >>> sampler = pergrad.privacy.PoissonSampler(x, y, sampling_rate=0.01)
        >>> rule = pergrad.privacy.adaptive_dp_gaussian(
        ...     0.1, 1.1, expected_batch_size=sampler.expected_batch_size)
        >>> model = pergrad.PerExampleModel(net, rule)
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        >>> model.fit(sampler, epochs=10, callbacks=[
        ...     pergrad.privacy.PrivacyAccountant(1.1, 0.01, delta=1e-5)])

    References:
        Andrew, Thakkar, McMahan and Ramaswamy, 2021, "Differentially private
        learning with adaptive clipping", NeurIPS. https://arxiv.org/abs/1905.03871
    """
    return AdaptiveDPGaussian(
        initial_l2_norm_clip,
        noise_multiplier,
        expected_batch_size=expected_batch_size,
        target_quantile=target_quantile,
        learning_rate=learning_rate,
        count_stddev=count_stddev,
        seed=seed,
        diagnostics=diagnostics,
    )
