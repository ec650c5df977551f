"""DP-SGD's aggregation rule: clip each example, sum, add Gaussian noise, divide.

The Gaussian mechanism of Abadi et al. (2016): example i's gradient is scaled
to L2 norm at most ``C`` (``l2_norm_clip``), the clipped gradients are summed,
Gaussian noise of standard deviation ``z * C`` (``z`` the noise multiplier) is
added to every coordinate of the sum, and the result is divided by the
(expected) batch size. Adding or removing one example changes the clipped sum
by at most ``C`` in L2 norm, so each step is the sampled Gaussian mechanism
with noise multiplier ``z`` that :func:`pergrad.privacy.epsilon` accounts for.

References:
    Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar and Zhang, 2016, "Deep
    learning with differential privacy", CCS. https://arxiv.org/abs/1607.00133
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from pergrad.aggregators.base import (
    LOCAL_MEAN,
    LOCAL_SUM,
    Aggregation,
    ExampleStatistics,
    MeanOf,
    WeightedAggregator,
    serializable,
)
from pergrad.aggregators.basic import clip_factors
from pergrad.arguments import check_number
from pergrad.privacy import noise
from pergrad.tensors import as_float32

#: ``DPGaussian.step_limit`` without a budget.
UNLIMITED_STEPS = 2**31 - 1


def steps_taken(model) -> int:
    """The number of steps the model has taken, for accounting and sampling.

    For a DP rule, its ``step_count`` variable: model state, restored with the
    weights by every Keras path and never reset by ``compile()``. Otherwise
    ``optimizer.iterations`` (0 without an optimizer).
    """
    aggregator = getattr(model, "aggregator", None)
    if getattr(aggregator, "differentially_private", False):
        return int(keras.ops.convert_to_numpy(aggregator.step_count)) if aggregator.built else 0
    optimizer = getattr(model, "optimizer", None)
    return int(keras.ops.convert_to_numpy(optimizer.iterations)) if optimizer is not None else 0


@serializable
class DPGaussian(WeightedAggregator):
    """Per-example clipping plus Gaussian noise (DP-SGD, Abadi et al., 2016).

    The result is ``(sum_i clip_C(g_i) + N(0, (z C)^2 I)) / B_e``, where
    ``B_e`` is ``expected_batch_size`` when given and the batch's size
    otherwise.

    **Clipping.** With ``per_layer=False`` each example's gradient is clipped
    as one flat vector to norm ``C``. With ``per_layer=True`` each of the
    model's ``V`` trainable variables (a layer's kernel and bias count as two)
    is clipped separately to ``C / sqrt(V)``; the flat norm of a clipped
    example is then at most ``sqrt(V (C^2 / V)) = C``, so the sensitivity of
    the sum, and hence the noise ``z * C`` and the privacy guarantee, are the
    same as for flat clipping.

    **Denominator.** With Poisson sampling (:class:`PoissonSampler`) the
    number of real examples in a batch is random and itself private, and the
    padded batch's size is not the number of examples: pass
    ``expected_batch_size = sampling_rate * dataset_size``
    (``sampler.expected_batch_size``). Without it the denominator is the
    batch's size, which is right only for fixed-size batches with no padding
    (and fixed-size batches are not what the Poisson accountant analyses).

    **Noise.** Every coordinate of every step gets its own 128 random bits: a block
    of a counter-based generator (Salmon et al., 2011; Threefry-4x32-20 fused by XLA on
    JAX and TensorFlow, NumPy's Philox-4x64-10 on torch) keyed by 128 bits derived from a
    256-bit secret key and the step count, so the noise of step ``t`` is a pure function
    of (key, ``t``). The value is ``s * sqrt(-2 ln U) * sin(Psi)`` (Box-Muller's
    ``R cos(Theta)`` with ``|cos(Theta)|`` replaced by the equal-in-law ``sin(Psi)``),
    ``U`` uniform on ``2^96`` points of ``(0, 1]`` with a full float32 mantissa down to
    ``2^-72``, ``Psi`` uniform on ``2^24`` points of ``(0, pi/2)``, ``s`` a fair sign.
    The support matters for privacy: beyond the largest value a noise sampler can
    return, the privacy loss is infinite. Here the noise reaches ``sqrt(192 ln 2) =
    11.54`` standard deviations (a normal from one float32 uniform through ``erfinv``,
    as ``jax.random.normal``, stops at 5.4, where one record of a ``z = 0.5`` run lands
    outside the support with probability ~3e-4 per step). Against the floating-point
    attacks on Gaussian samplers (Mironov 2012; Holohan and Braghin 2021; Jin et al.,
    S&P 2022) it has no Box-Muller pairs to invert, every float32 value up to about 10.4
    standard deviations is one of its outputs, and each output's probability averages
    over ~2^24 angles (docs/architecture.md, "Noise generator").

    With ``seed=None`` (the default, and the only secure choice) the key
    comes from Python's :mod:`secrets` (the operating system's CSPRNG):
    ``keras.utils.set_random_seed`` does not touch it. The key is the XOR of
    two halves. One lives only in this Python object (and the programs
    compiled from it). The other is a non-trainable variable, ``noise_key``
    (eight int32 words), so that compiled steps read it at run time and it can
    change: it is never saved (``model.save``, ``save_weights`` and
    ``BackupAndRestore`` write only ``step_count``), and it is drawn afresh when
    this rule loads weights, so a restored run never replays noise an earlier
    run released. ``get_weights()`` shows ``noise_key`` but not the hidden
    half, and weights copied into another model do not give it this key. With
    an integer ``seed`` both halves are derived from it
    (``numpy.random.SeedSequence``): the noise of step ``t`` is reproducible,
    and a resumed run adds exactly the noise of an uninterrupted one. That is
    for tests and debugging only and **not secure**: anyone who knows the seed
    can subtract the noise (Opacus's ``secure_mode=False``).

    **Step count.** ``step_count``, a non-trainable int32 variable, counts the
    steps this rule has taken (one per call). It is model state: carried
    through the JAX train step, saved by ``model.save`` and ``save_weights``,
    restored by ``load_model``, ``load_weights`` and ``BackupAndRestore``,
    and left alone by ``compile()``. :class:`~pergrad.privacy.PrivacyAccountant`
    computes ``epsilon`` from it.

    **Non-finite gradients.** For DP rules ``PerExampleModel`` zeroes the
    gradient of every example that has a NaN or an infinity before the rule
    sees it (:func:`zero_non_finite_examples`, in one place whatever the
    rule): the example contributes nothing, which is within the sensitivity
    bound, whereas a NaN update would reveal without noise that such an
    example was in the batch. A finite example whose squared norm overflows
    float32 is clipped like any other (norms are computed with a per-example
    scale). Call :func:`zero_non_finite_examples` yourself
    when you apply the rule outside ``PerExampleModel``.

    **Where it may be used.** Only as the model's aggregator: a DP rule inside
    :func:`~pergrad.aggregators.chain` or
    :func:`~pergrad.aggregators.bucketing` is refused (bucketing makes one
    example's influence depend on the others' random assignment).

    **Diagnostics** ``clipped_fraction`` (examples whose norm exceeded the
    threshold) and ``gradient_norm`` (mean norm before clipping) are computed
    from the data without noise, so they are **not covered by the privacy
    guarantee**: one record can move ``gradient_norm`` arbitrarily. They are
    off by default; ``diagnostics=True`` logs them (over the examples with a
    non-zero gradient: padding rows are left out) for debugging on data that
    needs no protection.

    Args:
        l2_norm_clip: the clipping norm ``C`` (> 0).
        noise_multiplier: ``z`` (>= 0); the noise standard deviation on the
            sum is ``z * C``. ``0`` gives the clipped mean (no privacy).
        per_layer: clip each trainable variable to ``C / sqrt(V)`` instead of
            the flat gradient to ``C``.
        expected_batch_size: the denominator; required for Poisson sampling.
        seed: ``None`` (a secret key from :mod:`secrets`), or an integer for
            reproducible and therefore **insecure** noise.
        diagnostics: log ``clipped_fraction`` and ``gradient_norm``, which are
            not private.

    References:
        Abadi et al., 2016, "Deep learning with differential privacy".
        https://arxiv.org/abs/1607.00133
        Salmon, Moraes, Dror and Shaw, 2011, "Parallel random numbers: as easy
        as 1, 2, 3", SC'11. https://doi.org/10.1145/2063384.2063405
        Jin, McMurtry, Rubinstein and Ohrimenko, 2022, "Are we there yet?
        Timing and floating-point attacks on differential privacy systems",
        IEEE S&P. https://arxiv.org/abs/2112.05307
    """

    #: Tells ``pergrad.privacy.check_dp_fit`` and the accountant callback that
    #: this rule carries a privacy guarantee (and assumes Poisson sampling).
    differentially_private = True
    #: Whose addition or removal the guarantee covers: one example (``"user"``:
    #: :class:`~pergrad.privacy.user_level.UserLevelDPGaussian`). The sampler and the
    #: accountant must say the same (``PrivacyAccountant(unit=...)``).
    privacy_unit = "example"

    def __init__(
        self,
        l2_norm_clip: float,
        noise_multiplier: float,
        *,
        per_layer: bool = False,
        expected_batch_size: float | None = None,
        seed: int | None = None,
        diagnostics: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        l2_norm_clip = check_number("dp_gaussian", "l2_norm_clip", l2_norm_clip, low=0, low_open=True)
        noise_multiplier = check_number("dp_gaussian", "noise_multiplier", noise_multiplier, low=0)
        if expected_batch_size is not None:
            expected_batch_size = check_number(
                "dp_gaussian", "expected_batch_size", expected_batch_size, low=0, low_open=True
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise ValueError(f"seed must be None or an integer, got {seed!r}.")
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.per_layer = bool(per_layer)
        self.expected_batch_size = None if expected_batch_size is None else float(expected_batch_size)
        self.seed = None if seed is None else int(seed)
        self.log_diagnostics = bool(diagnostics)
        self.diagnostics = ("clipped_fraction", "gradient_norm") if diagnostics else ()
        # The key is the XOR of two halves. This one lives only in this object
        # (and the programs compiled from it): not in the variables, so not in
        # get_weights(), and another instance given these weights has another key.
        self.__dict__["_hidden_key"] = noise.key_words(self.seed, spawn=0)
        self._new_key()

    def _new_key(self) -> None:
        """Draws the variable half of the key (``noise_key``): at construction and after a load."""
        self.__dict__["_pending_key"] = noise.key_words(self.seed, spawn=1)
        if self.built:
            self.noise_key.assign(self._pending_key)

    def build(self, shapes=None):
        self.step_count = self.add_weight(
            shape=(), initializer="zeros", dtype="int32", trainable=False, name="step_count"
        )
        # A variable, so that compiled train steps read the key at run time (a
        # new key after a load takes effect) and JAX carries it in its state;
        # never saved (see save_own_variables).
        self.noise_key = self.add_weight(
            shape=(noise.KEY_WORDS,), initializer="zeros", dtype="int32", trainable=False, name="noise_key"
        )
        self.noise_key.assign(self._pending_key)
        # The step count the privacy budget stops at (set by PrivacyAccountant for a
        # fit, unlimited otherwise): a variable, so that a compiled group of
        # `steps_per_execution` steps reads it at every step. Never saved: a budget
        # belongs to the accountant, not to the weights.
        self.step_limit = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(UNLIMITED_STEPS), dtype="int32",
            trainable=False, name="step_limit",
        )
        self.built = True

    def update_allowed(self):
        """Whether the privacy budget allows this step: ``step_count < step_limit``.

        The train step reads it before the step and applies the update (and
        counts the step) only if it is true, so that a budget holds inside a
        group of ``steps_per_execution`` steps too.
        """
        return ops.less(self.step_count.value, self.step_limit.value)

    def save_own_variables(self, store):
        # The step count only: the key must not reach files, weights or backups.
        store["step_count"] = self.step_count

    def load_own_variables(self, store):
        if "step_count" not in store:
            raise ValueError(
                f"No step count for {self.name!r} in the saved weights (keys {list(store.keys())}): "
                "they were not saved from a DPGaussian of this version."
            )
        self.step_count.assign(store["step_count"])
        # Restored weights come with an earlier step count: a secret key must
        # not add again the noise it added at those steps.
        if self.seed is None:
            self._new_key()

    def current_l2_norm_clip(self):
        """The clipping norm ``C`` of the current step: ``l2_norm_clip`` here; a subclass
        whose norm adapts (:class:`~pergrad.privacy.AdaptiveDPGaussian`) reads its state."""
        return self.l2_norm_clip

    @property
    def noise_stddev(self) -> float:
        """Standard deviation of the noise added to each coordinate of the sum."""
        return self.noise_multiplier * self.l2_norm_clip

    @property
    def distribution(self) -> str:
        """Each example clipped by its own norm, the noise added once: the replicas'
        results add up over a fixed denominator, or are shares of the batch's mean."""
        return LOCAL_MEAN if self.expected_batch_size is None else LOCAL_SUM

    def _denominator(self, stats: ExampleStatistics):
        if self.expected_batch_size is not None:
            return ops.convert_to_tensor(self.expected_batch_size, "float32")
        return ops.cast(stats.batch_size, "float32")

    def _threshold(self, stats: ExampleStatistics):
        """``C``, or ``C / sqrt(V)`` per layer."""
        threshold = self.current_l2_norm_clip()
        if self.per_layer:
            threshold /= math.sqrt(stats.scaled_squared_norms.shape[1])
        return threshold

    def clip_factors(self, stats: ExampleStatistics):
        """``min(1, threshold / norm)``: ``(B,)`` flat, ``(B, V)`` per layer (clip's factors,
        :func:`~pergrad.aggregators.basic.clip_factors`, to ``C`` or ``C / sqrt(V)``)."""
        factors, _ = clip_factors(stats, self._threshold(stats), self.per_layer)
        # A NaN norm gives factor 0 (an infinite one does already): that example adds nothing.
        return ops.where(ops.isnan(factors), 0.0, factors)

    def clip_reports(self, stats: ExampleStatistics) -> dict:
        """The diagnostics ``clipped_fraction`` and ``gradient_norm`` of a batch with these
        statistics: means over the examples, as sums and counts (on several replicas the
        train step sums them: the whole batch's)."""
        threshold = self._threshold(stats)
        norms = as_float32(stats.norms if self.per_layer else stats.flat_norms)
        flat_norms = ops.cast(stats.flat_norms, "float32")
        clipped = ops.any(norms > threshold, axis=1) if self.per_layer else norms > threshold
        return clipping_reports(clipped, flat_norms, flat_norms)

    def example_weights(self, stats: ExampleStatistics):
        return self.clip_factors(stats) / self._denominator(stats)

    def _key(self):
        """The 256-bit key (int32 words): the hidden half XOR ``noise_key``."""
        return ops.bitwise_xor(self.noise_key.value, ops.convert_to_tensor(self._hidden_key, "int32"))

    def standard_normal(self, size: int, step):
        """``size`` standard normal values for step ``step``, a pure function of (key, step)."""
        return noise.gaussian_noise(self._key(), step, size, 1.0)

    def finalize(self, result: list, stats: ExampleStatistics) -> Aggregation:
        """Counts the step and draws its noise, returned as the batch's term
        (:attr:`~pergrad.aggregators.Aggregation.batch_term`): calling the rule adds it;
        on several replicas the train step adds it on replica 0 only (every replica has
        the same key and step), so that the replicas' sum holds one noise. With
        ``diagnostics``, reports :meth:`clip_reports`."""
        reports = self.clip_reports(stats) if self.log_diagnostics else {}
        # The step read into a tensor before the increment: the noise of the step it counts
        # (a TF or torch variable's value would otherwise follow the assignment).
        step = ops.convert_to_tensor(self.step_count.value)
        term = None
        if self.noise_multiplier > 0:
            term = self.step_noise(result, stats, step)
            term = [ops.cast(part, gradient.dtype) for part, gradient in zip(term, result)]
        # A step past the budget's limit is not applied (update_allowed), nor counted.
        self.step_count.assign(step + ops.cast(ops.less(step, self.step_limit.value), "int32"))
        return Aggregation(result, reports=reports, batch_term=term)

    def step_noise(self, result: list, stats: ExampleStatistics, step) -> list:
        """The noise of step ``step`` on the result (float32, one tensor per variable):
        ``N(0, (noise_stddev / denominator)^2)`` per coordinate, a pure function of (key,
        ``step``): :meth:`flat_step_noise` cut into the variables' shapes."""
        return split_like(self.flat_step_noise(result, stats, step), result)

    def flat_step_noise(self, result: list, stats: ExampleStatistics, step):
        """:meth:`step_noise` as one float32 vector, the variables' coordinates in order (one
        draw for all variables).
        :class:`~pergrad.privacy.BandedMFGaussian` correlates it across steps."""
        denominator = self._denominator(stats)  # the weights' denominator
        # The scale enters the generator: its last rounding then smooths the float32 values
        # (docs/architecture.md, "Noise generator").
        scale = self.noise_stddev / ops.cast(denominator, "float32")
        size = sum(math.prod(g.shape) for g in result)
        # Not drawn in a branch on the budget (ops.cond): on JAX a branch materializes the
        # draw, 16% faster on an MLP (XLA fuses the generator into each consumer otherwise),
        # but it made ResNet50's DP step 1.8x slower (docs/banded-mf.md, 'Cost of a step').
        return noise.gaussian_noise(self._key(), step, size, scale)

    def get_config(self):
        return {
            **super().get_config(),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "per_layer": self.per_layer,
            "expected_batch_size": self.expected_batch_size,
            "seed": self.seed,
            "diagnostics": self.log_diagnostics,
        }


def split_like(values, tensors) -> list:
    """The vector ``values`` cut, in order, into tensors of the shapes of ``tensors``."""
    parts, start = [], 0
    for tensor in tensors:
        size = math.prod(tensor.shape)
        parts.append(ops.reshape(values[start : start + size], tensor.shape))
        start += size
    return parts


def clipping_reports(clipped, norms, flat_norms) -> dict:
    """``clipped_fraction`` and ``gradient_norm``, the means of ``clipped`` and ``norms``
    (``(B,)``) over the examples whose gradient is not zero (``flat_norms > 0``): padding
    rows (weight 0) are left out, so that the diagnostics describe the real examples."""
    present = ops.cast(flat_norms > 0, "float32")
    count = ops.sum(present)
    return {
        "clipped_fraction": MeanOf(ops.sum(ops.cast(clipped, "float32") * present), count),
        "gradient_norm": MeanOf(ops.sum(ops.where(present > 0, norms, 0.0)), count),
    }


def dp_gaussian(
    l2_norm_clip: float,
    noise_multiplier: float,
    *,
    per_layer: bool = False,
    expected_batch_size: float | None = None,
    seed: int | None = None,
    diagnostics: bool = False,
) -> DPGaussian:
    """DP-SGD's aggregator (Abadi et al., 2016): clip, sum, add noise, divide.

    Each example's gradient is clipped to L2 norm ``l2_norm_clip`` (flat, or
    each trainable variable to ``l2_norm_clip / sqrt(V)`` with
    ``per_layer=True``: the same total sensitivity), the clipped gradients are
    summed, Gaussian noise of standard deviation
    ``noise_multiplier * l2_norm_clip`` is added to every coordinate and the
    sum is divided by ``expected_batch_size`` (the batch's size if ``None``;
    required with Poisson sampling). See :class:`DPGaussian`.

    Example:
        >>> sampler = pergrad.privacy.PoissonSampler(x, y, sampling_rate=0.01)
        >>> model = pergrad.PerExampleModel(
        ...     net, dp_gaussian(1.0, 1.1, expected_batch_size=sampler.expected_batch_size))
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        >>> model.fit(sampler, epochs=10, callbacks=[
        ...     pergrad.privacy.PrivacyAccountant(1.1, 0.01, delta=1e-5, max_epsilon=3.0)])

    References:
        Abadi et al., 2016, "Deep learning with differential privacy".
        https://arxiv.org/abs/1607.00133
    """
    return DPGaussian(
        l2_norm_clip,
        noise_multiplier,
        per_layer=per_layer,
        expected_batch_size=expected_batch_size,
        seed=seed,
        diagnostics=diagnostics,
    )


def refuse_masked_output() -> None:
    """Raises: DP rules cannot train a model with a masked output.

    Keras divides a masked loss by the batch's total count of unmasked steps,
    so each example's gradient is scaled, before clipping, by a factor that
    depends on the other examples: one record then moves the update by
    several times the clipping norm.
    """
    raise ValueError(
        "DP rules cannot train a model with a masked output (or a loss that masks its "
        "values, such as ignore_class): Keras divides a masked loss by the number of "
        "unmasked steps of the whole batch, so every example's gradient depends on the "
        "other examples' lengths and clipping no longer bounds one record's influence. "
        "Remove the mask (e.g. Embedding(mask_zero=False), no ignore_class) and give "
        "those steps sample weight 0 with a (batch, time) sample_weight instead: the loss "
        "is then divided by batch * time, which does not depend on the other examples."
    )

