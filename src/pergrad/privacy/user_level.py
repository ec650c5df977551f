"""User-level DP-SGD: every user's summed gradient clipped, users Poisson-sampled.

Example-level DP-SGD protects one example; when one person contributes many
(messages, sessions, visits), it does not protect the person. With a *privacy
unit* (a user id per example), user-level DP-SGD (McMahan, Ramage, Talwar and
Zhang, 2018; Charles, Ganesh, McKenna, McMahan, Mitchell, Pillutla and Rush,
2024) samples users instead of examples and clips each sampled user's
gradient, the sum of its examples' gradients, to ``C``:

- :class:`UserSampler` includes each user independently with probability
  ``q`` at every step and keeps at most ``k`` of each included user's
  examples (a fresh random subset each step): batches are Poisson samples of
  users, padded to few shapes as :class:`~pergrad.privacy.PoissonSampler`'s.
- :class:`UserLevelDPGaussian` (:func:`user_level_dp_gaussian`) clips each
  user's summed gradient ``sum_{i in u} g_i`` to ``C``, sums over the users,
  adds Gaussian noise of standard deviation ``z C`` and divides by the
  expected number of users per batch. Adding or removing one user (all of its
  examples) changes the clipped sum by at most ``C``: each step is the
  Poisson-sampled Gaussian mechanism over users, and
  :func:`~pergrad.privacy.epsilon` with the user sampling rate ``q`` gives the
  guarantee for one user (``PrivacyAccountant(..., unit="user")``).

On the statistics path a user's squared norm is a block sum of the Gram
matrix, ``||sum_{i in u} g_i||^2 = 1_u^T G 1_u``, and the result is the
weighted sum ``sum_i w_i g_i`` with ``w_i`` the clip factor of example i's
user: no ``B x P`` tensor.

**The channel.** A :class:`UserSampler` batch's ``x`` is
``{"pergrad_inputs": inputs, "pergrad_units": ids}``
(``pergrad.aggregators.base.UNIT_INPUTS``, ``UNIT_IDS``); ``PerExampleModel``'s train step
takes the ids out before anything reads ``x`` and passes them to the rule (the
statistics' ``units``, :attr:`~pergrad.aggregators.ExampleStatistics.units`): the
network never sees them. A
user-level rule refuses a batch without ids, every other rule one with them.

References:
    McMahan, Ramage, Talwar and Zhang, 2018, "Learning differentially private
    recurrent language models", ICLR. https://arxiv.org/abs/1710.06963
    Charles, Ganesh, McKenna, McMahan, Mitchell, Pillutla and Rush, 2024,
    "Fine-tuning large language models with user-level differential
    privacy". https://arxiv.org/abs/2407.07737
"""

from __future__ import annotations

import numpy as np
from keras import ops

from pergrad.aggregators.base import UNIT_IDS, UNIT_INPUTS, ExampleStatistics, serializable
from pergrad.privacy.dp_sgd import DPGaussian, clipping_reports
from pergrad.privacy.sampling import PoissonSampler, bernstein_bound, bucket_width_for

#: The unit id of a padding row: no user's (padding has zero gradient in any case).
PADDING_UNIT = -1


def unit_squared_norms(gram, units):
    """``(B,)``: the squared norm of the summed gradient of example i's unit,
    ``1_u^T G 1_u`` (``u`` the unit of i), and whether that block of ``gram`` is finite.

    ``same[i, j] = units_i == units_j`` is an equivalence: ``j`` and ``k`` in i's unit is
    ``same_ij same_jk``, so the block sum is ``same @ r`` with ``r_j = sum_k same_jk G_jk``
    (each row's sum within its unit's columns): ``O(B^2)``, no ``B^3`` product. Entries
    outside a unit's block never enter it (``where``, not a product: ``0 * inf`` is NaN),
    and a block holding a non-finite entry is reported (``finite`` False) rather than summed.
    """
    units = ops.convert_to_tensor(units)
    same = ops.equal(units[:, None], units[None, :])
    gram = ops.cast(gram, "float32")
    usable = ops.isfinite(gram)
    inside = ops.cast(same, "float32")
    rows = ops.sum(ops.where(same & usable, gram, 0.0), axis=1)
    unusable = ops.sum(ops.cast(same & ~usable, "float32"), axis=1)
    blocks = ops.matmul(inside, rows[:, None])[:, 0]
    unusable = ops.matmul(inside, unusable[:, None])[:, 0]
    # Rounding may leave a cancelling unit's sum slightly below 0.
    return ops.maximum(blocks, 0.0), ops.isfinite(blocks) & (unusable == 0)


@serializable
class UserLevelDPGaussian(DPGaussian):
    """DP-SGD with a user as the privacy unit: each user's summed gradient clipped to ``C``.

    The result is ``(sum_u clip_C(sum_{i in u} g_i) + N(0, (z C)^2 I)) / B_e``, the users
    ``u`` those of the batch (each example's id from the batch, :class:`UserSampler`),
    ``B_e`` the expected number of users per batch (``expected_batch_size``:
    ``UserSampler.expected_batch_size``). Everything else (noise, key, step count,
    budget, non-finite examples, saving) is :class:`~pergrad.privacy.DPGaussian`'s;
    a user of one example is clipped exactly as ``dp_gaussian`` clips it.

    The weights read the Gram matrix (``needs_gram``): user ``u``'s squared norm is
    ``1_u^T G 1_u``, and example i's weight is its user's clip factor over ``B_e``.
    Where a user's block of the Gram matrix overflows float32 (gradients above about
    ``1e19``) the user's norm is bounded by the sum of its examples' norms (the
    triangle inequality): clipped by that bound, the user still adds at most ``C``.

    Flat clipping only (the Gram matrix is over all variables). Refused on several
    ``tf.distribute`` replicas (a replica's shard may hold part of a user); exact on
    the statistics, chunked (``microbatch_size``) and materialized paths. JAX's
    ``DataParallel`` runs one step over the whole batch, so nothing splits a user there
    (tested on two processes, a user's examples on both: tests/test_processes.py).

    Diagnostics (``diagnostics=True``, not private) count each example with its
    user's norm.

    Args:
        l2_norm_clip: ``C`` (> 0), the bound on each user's summed gradient.
        noise_multiplier: ``z`` (>= 0).
        expected_batch_size: the expected number of users per batch, ``q * U``
            (required with a sampler).
        seed, diagnostics: as :class:`~pergrad.privacy.DPGaussian`'s.

    References:
        Charles et al., 2024, "Fine-tuning large language models with user-level
        differential privacy". https://arxiv.org/abs/2407.07737
    """

    privacy_unit = "user"
    reads_units = True
    needs_gram = True

    def __init__(self, l2_norm_clip: float, noise_multiplier: float, *, per_layer: bool = False,
                 **kwargs):
        if per_layer:
            raise ValueError(
                "user_level_dp_gaussian clips each user's flat gradient: per_layer=True is not "
                "supported (the Gram matrix it reads is over all variables)."
            )
        super().__init__(l2_norm_clip, noise_multiplier, **kwargs)

    def unit_norms(self, stats: ExampleStatistics):
        """``(B,)``: the norm ``||sum_{j in u} g_j||`` of example i's user ``u`` (the ids:
        ``stats.units``, which the train step passes, or ``rule(gradients, units=ids)``)."""
        units = stats.units
        if units is None:
            raise ValueError(
                f"{type(self).__name__} needs each example's user id: call it as "
                "rule(gradients, units=ids), or train on pergrad.privacy.UserSampler."
            )
        squared, finite = unit_squared_norms(stats.gram, units)
        same = ops.cast(ops.equal(units[:, None], units[None, :]), "float32")
        # The triangle inequality where the block overflowed: still at most C once clipped.
        bound = ops.matmul(same, ops.cast(stats.flat_norms, "float32")[:, None])[:, 0]
        return ops.where(finite, ops.sqrt(squared), bound)

    def clip_factors(self, stats: ExampleStatistics):
        """``(B,)``: example i's weight before the denominator, the clip factor
        ``min(1, C / ||sum_{j in u} g_j||)`` of its user ``u``."""
        threshold = self.l2_norm_clip
        factors = threshold / ops.maximum(self.unit_norms(stats), threshold)
        return ops.where(ops.isnan(factors), 0.0, factors)

    def clip_reports(self, stats: ExampleStatistics) -> dict:
        """As :meth:`DPGaussian.clip_reports`, each example counted with its user's norm."""
        norms = self.unit_norms(stats)
        return clipping_reports(norms > self.l2_norm_clip, norms, ops.cast(stats.flat_norms, "float32"))


def user_level_dp_gaussian(
    l2_norm_clip: float,
    noise_multiplier: float,
    *,
    expected_batch_size: float | None = None,
    seed: int | None = None,
    diagnostics: bool = False,
) -> UserLevelDPGaussian:
    """User-level DP-SGD's aggregator: clip each user's summed gradient, sum, noise, divide.

    See :class:`UserLevelDPGaussian`; train it on a :class:`UserSampler`.

    Example:
        >>> sampler = pergrad.privacy.UserSampler(x, y, users=ids, sampling_rate=0.05,
        ...                                       examples_per_user=8)
        >>> model = pergrad.PerExampleModel(net, pergrad.privacy.user_level_dp_gaussian(
        ...     1.0, 1.1, expected_batch_size=sampler.expected_batch_size))
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        >>> model.fit(sampler, epochs=10, callbacks=[pergrad.privacy.PrivacyAccountant(
        ...     1.1, 0.05, delta=1e-5, unit="user")])
    """
    return UserLevelDPGaussian(
        l2_norm_clip, noise_multiplier, expected_batch_size=expected_batch_size, seed=seed,
        diagnostics=diagnostics,
    )


class UserSampler(PoissonSampler):
    """Poisson sampling of users, at most ``examples_per_user`` examples of each.

    At every step each user is included independently with probability
    ``sampling_rate`` (``q``, the rate the accountant needs), and of each included
    user ``min(n_u, k)`` of its ``n_u`` examples are kept, chosen uniformly at random
    afresh at each step (``k = examples_per_user``): a bounded number of examples per
    user (Charles et al., 2024), which bounds the batch; the sensitivity is bounded by
    clipping the user's summed gradient, whichever examples were kept. The kept rows
    come grouped by user, followed by padding rows (sample weight 0, unit id ``-1``)
    to :class:`~pergrad.privacy.PoissonSampler`'s bucket sizes; everything about
    steps, seeds, resuming, buckets and overflow is that class's, with the batch size
    now the sum of the kept counts (its default maximum from Bernstein's bound on that
    sum, its bucket width about its standard deviation).

    Batches are ``({"pergrad_inputs": x, "pergrad_units": ids}, y, sample_weight)``:
    ``PerExampleModel`` hands ``ids`` (``int32``, ``0 .. U - 1`` in the order of
    :attr:`users`) to the user-level rule and the inputs alone to the network.

    Args:
        x, y, sample_weight: the data, as :class:`~pergrad.privacy.PoissonSampler`'s.
        users: ``(n,)`` the user id of every example (any hashable values NumPy can
            sort: integers, strings).
        sampling_rate: ``q``, each user's inclusion probability per step.
        examples_per_user: ``k``, the most examples of one user in a batch.
        max_batch_size, bucket_width, steps_per_epoch, seed, overflow_probability,
            **kwargs: as :class:`~pergrad.privacy.PoissonSampler`'s.
    """

    privacy_unit = "user"

    def __init__(self, x, y, *, users, sampling_rate: float, examples_per_user: int,
                 sample_weight=None, max_batch_size: int | None = None,
                 bucket_width: int | None = None, overflow_probability: float = 1e-9, **kwargs):
        if kwargs.get("dataset_size") is not None:
            raise ValueError(
                "UserSampler draws each user from the whole data set, every process holding all "
                "of it: dataset_size (a shard per process) is not supported. Give every process "
                "the whole data set."
            )
        users = np.asarray(users)
        if users.ndim != 1:
            raise ValueError(f"users must have shape (n,), one id per example; got {users.shape}.")
        if isinstance(examples_per_user, bool) or int(examples_per_user) != examples_per_user \
                or examples_per_user < 1:
            raise ValueError(f"examples_per_user must be a positive integer, got {examples_per_user!r}.")
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
        #: The distinct user ids, sorted; batch ids index into it.
        self.users, self.unit_of_example = np.unique(users, return_inverse=True)
        self.examples_per_user = int(examples_per_user)
        self.order = np.argsort(self.unit_of_example, kind="stable")  # examples grouped by user
        self.counts = np.bincount(self.unit_of_example, minlength=len(self.users))
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        kept = np.minimum(self.counts, self.examples_per_user).astype("float64")
        mean = sampling_rate * kept.sum()
        variance = sampling_rate * (1.0 - sampling_rate) * np.sum(kept**2)
        if max_batch_size is None:
            max_batch_size = bernstein_bound(mean, variance, self.examples_per_user, int(kept.sum()),
                                             overflow_probability)
        if bucket_width is None:
            bucket_width = bucket_width_for(variance)
        super().__init__(x, y, sampling_rate=sampling_rate, sample_weight=sample_weight,
                         max_batch_size=max_batch_size, bucket_width=bucket_width,
                         overflow_probability=overflow_probability, **kwargs)
        if len(users) != self.dataset_size:
            raise ValueError(f"users has {len(users)} ids for {self.dataset_size} examples.")

    @property
    def user_count(self) -> int:
        """``U``, the number of distinct users."""
        return len(self.users)

    @property
    def expected_batch_size(self) -> float:
        """``q * U``, the expected number of users per batch: the denominator to give
        :func:`user_level_dp_gaussian`."""
        return self.sampling_rate * self.user_count

    def indices_for_step(self, step: int) -> np.ndarray:
        """The examples of global step ``step``, grouped by user: each user with probability
        ``q``, at most ``k`` of its examples (a random subset); a pure function of (seed, step)."""
        generator = self.generator_for_step(step)
        sampled = np.flatnonzero(generator.random(self.user_count) < self.sampling_rate)
        counts = self.counts[sampled]
        if not len(sampled):
            return np.zeros((0,), dtype=np.int64)
        # Every member of the sampled users, grouped by user; a random key ranks each
        # user's members, and the k first are kept.
        group = np.repeat(np.arange(len(sampled)), counts)
        offsets = np.arange(len(group)) - np.repeat(np.cumsum(counts) - counts, counts)
        members = self.order[np.repeat(self.starts[sampled], counts) + offsets]
        ranked = np.lexsort((generator.random(len(members)), group))
        rank = np.arange(len(group)) - np.repeat(np.cumsum(counts) - counts, counts)
        return members[ranked][rank < self.examples_per_user]

    def inputs(self, rows: np.ndarray, drawn: int):
        ids = np.full(len(rows), PADDING_UNIT, dtype="int32")
        ids[:drawn] = self.unit_of_example[rows[:drawn]]
        return {UNIT_INPUTS: super().inputs(rows, drawn), UNIT_IDS: ids}
