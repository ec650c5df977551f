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
from keras import ops

from pergrad.aggregators.base import ExampleStatistics, WeightedAggregator


@keras.saving.register_keras_serializable(package="pergrad")
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

    **Noise.** Drawn with ``keras.random.normal`` from a
    ``keras.random.SeedGenerator`` owned by the aggregator: a Keras variable
    carried through the JAX train step, advanced at every step (fresh noise
    each step), saved with the model and restored by ``load_model`` (resuming
    continues the noise stream). A given ``seed`` makes the noise
    reproducible; keep it secret, or leave it ``None`` (a random seed), when
    the privacy guarantee matters: noise an adversary can predict protects
    nothing.

    **Non-finite gradients.** An example whose gradient has a NaN or an
    infinity, or whose squared norm overflows, gets weight 0: it contributes
    nothing, which is within the sensitivity bound, whereas a NaN update would
    reveal without noise that such an example is in the batch.

    **Diagnostics** (logged as metrics): ``clipped_fraction``, the fraction
    of examples whose norm exceeded the threshold, and ``gradient_norm``, the
    mean per-example norm before clipping, both over the examples with a
    non-zero gradient (padding rows of a Poisson batch have zero gradient and
    are left out). They are computed from the raw data without noise: they
    are for monitoring and are not covered by the privacy guarantee.

    Args:
        l2_norm_clip: the clipping norm ``C`` (> 0).
        noise_multiplier: ``z`` (>= 0); the noise standard deviation on the
            sum is ``z * C``. ``0`` gives the clipped mean (no privacy).
        per_layer: clip each trainable variable to ``C / sqrt(V)`` instead of
            the flat gradient to ``C``.
        expected_batch_size: the denominator; required for Poisson sampling.
        seed: an integer for reproducible noise, or ``None``.

    References:
        Abadi et al., 2016, "Deep learning with differential privacy".
        https://arxiv.org/abs/1607.00133
    """

    diagnostics = ("clipped_fraction", "gradient_norm")
    #: Tells ``pergrad.privacy.check_dp_fit`` and the accountant callback that
    #: this rule carries a privacy guarantee (and assumes Poisson sampling).
    differentially_private = True

    def __init__(
        self,
        l2_norm_clip: float,
        noise_multiplier: float,
        *,
        per_layer: bool = False,
        expected_batch_size: float | None = None,
        seed: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not l2_norm_clip > 0:
            raise ValueError(f"l2_norm_clip must be positive, got {l2_norm_clip}.")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}.")
        if expected_batch_size is not None and not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}.")
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.per_layer = bool(per_layer)
        self.expected_batch_size = None if expected_batch_size is None else float(expected_batch_size)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed, name="dp_noise_seed")

    @property
    def noise_stddev(self) -> float:
        """Standard deviation of the noise added to each coordinate of the sum."""
        return self.noise_multiplier * self.l2_norm_clip

    def _denominator(self, stats: ExampleStatistics):
        if self.expected_batch_size is not None:
            return ops.convert_to_tensor(self.expected_batch_size, "float32")
        return ops.cast(stats.batch_size, "float32")

    def clip_factors(self, stats: ExampleStatistics):
        """``min(1, threshold / norm)``: ``(B,)`` flat, ``(B, V)`` per layer."""
        flat_norms = ops.sqrt(ops.cast(stats.flat_squared_norms, "float32"))
        if self.per_layer:
            variables = stats.squared_norms.shape[1]
            threshold = self.l2_norm_clip / math.sqrt(variables)
            norms = ops.sqrt(ops.cast(stats.squared_norms, "float32"))
            clipped = ops.any(norms > threshold, axis=1)
        else:
            threshold = self.l2_norm_clip
            norms = flat_norms
            clipped = norms > threshold
        # Padding rows (weight 0) have zero gradient: leave them out of the
        # diagnostics so that they describe the real examples.
        present = ops.cast(flat_norms > 0, "float32")
        count = ops.maximum(ops.sum(present), 1.0)
        self.report("clipped_fraction", ops.sum(ops.cast(clipped, "float32") * present) / count)
        self.report("gradient_norm", ops.sum(ops.where(present > 0, flat_norms, 0.0)) / count)
        # An overflowing norm (inf) gives factor 0, a NaN norm too: that example
        # adds nothing.
        factors = threshold / ops.maximum(norms, threshold)
        return ops.where(ops.isnan(factors), 0.0, factors)

    def example_weights(self, stats: ExampleStatistics):
        denominator = self._denominator(stats)
        # ``finalize`` (called next, in the same step) divides the noise by the
        # same denominator; the protocol hands it only the weighted sum.
        self.__dict__["_step_denominator"] = denominator
        return self.clip_factors(stats) / denominator

    def finalize(self, result: list) -> list:
        denominator = self.__dict__.pop("_step_denominator", None)
        if self.noise_multiplier == 0:
            return result
        if denominator is None:
            raise RuntimeError("DPGaussian.finalize must follow example_weights in the same step.")
        noisy = []
        for gradient in result:
            noise = keras.random.normal(
                ops.shape(gradient),
                stddev=self.noise_stddev,
                dtype=gradient.dtype,
                seed=self.seed_generator,
            )
            noisy.append(gradient + noise / ops.cast(denominator, gradient.dtype))
        return noisy

    def aggregate(self, gradients):
        # A non-finite example contributes nothing: a NaN update would reveal,
        # without noise, that some example of the batch has a non-finite gradient.
        rows = [ops.reshape(g, (ops.shape(g)[0], -1)) for g in gradients]
        finite = ops.all(ops.stack([ops.all(ops.isfinite(r), axis=1) for r in rows], axis=1), axis=1)
        gradients = [
            ops.where(ops.reshape(finite, (-1,) + (1,) * (len(g.shape) - 1)), g, ops.zeros_like(g))
            for g in gradients
        ]
        return super().aggregate(gradients)

    def get_config(self):
        return {
            **super().get_config(),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "per_layer": self.per_layer,
            "expected_batch_size": self.expected_batch_size,
            "seed": self.seed,
        }


def dp_gaussian(
    l2_norm_clip: float,
    noise_multiplier: float,
    *,
    per_layer: bool = False,
    expected_batch_size: float | None = None,
    seed: int | None = None,
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
    )
