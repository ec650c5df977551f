"""Cyclic Poisson sampling: each example's participations at least ``b`` steps apart.

Amplified banded matrix factorization (:mod:`pergrad.privacy.banded`) needs every example's
participations separated by at least the number of bands ``b`` (*b-min-separation*). The
:class:`CyclicPoissonSampler` gets it as Algorithm 2 of Choquette-Choo et al. (2023) does: the
data set is split into ``b`` groups once, and step ``t`` Poisson-samples group ``t mod b`` alone,
each of its examples independently with probability ``q``. An example of group ``g`` can be drawn
only at the steps ``g, g + b, g + 2b, ...``; at each of them it is drawn with probability ``q``,
independently of the other steps and examples. Over ``T`` steps it can take part at most
``ceil(T / b)`` times; the expected batch is ``q n / b``. ``b = 1`` is :class:`PoissonSampler`.

**The groups.** Each example's group is drawn independently and uniformly (jax-privacy's
``PartitionType.INDEPENDENT``), not by splitting a shuffled data set into equal parts
(``EQUAL_SPLIT``): adding or removing one example then leaves every other example's group and
draws as they were, which the add-or-remove analysis
(:func:`pergrad.privacy.banded_mf_epsilon`) needs; equal parts would tie every group to the data
set's size. The groups are a pure function of the seed (its own stream, drawn once when the
sampler is made) and stay fixed for the sampler's life: a restore that draws a fresh secret seed
for the batches (``seed=None``, :meth:`PoissonSampler.set_step`) keeps them, so participations stay
``b`` steps apart across it. They are secret like the seed: the analysis takes the worst group, but
a known assignment of *positions* to groups would tell which examples moved when one is removed.

**Resuming in a new process.** A sampler made there with ``seed=None`` draws new groups, so
participations just before and after the resumption need not be ``b`` apart while the BandMF rule
(:func:`~pergrad.privacy.banded_mf_gaussian`) continues its noise correlation over that boundary.
``fit`` refuses it: the rule records (and saves, with its noise buffers) :attr:`groups_fingerprint`,
a SHA-256 of the groups' seed, and a fit that continues its steps must bring a sampler of the same
groups. To resume BandMF in a new process, make the sampler with ``seed=`` from the start and keep
the seed as secret as the checkpoint (which is secret anyway: the buffers are).

References:
    Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta and Xu, 2023, "(Amplified) banded
    matrix factorization: a unified approach to private training", NeurIPS, Algorithm 2.
    https://arxiv.org/abs/2306.08153
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from keras import tree

from pergrad.privacy.dp_sgd import steps_taken
from pergrad.privacy.sampling import PoissonSampler, default_bucket_width, max_batch_size_for

# The SeedSequence spawn key of the groups' stream: three words, so no step's key ``(t,)``
# (one or two words below 2^64 steps) can equal it.
_GROUPS_KEY = (0, 0, 0)


class CyclicPoissonSampler(PoissonSampler):
    """Poisson sampling of one of ``cycle_length`` groups per step: b-min-separation.

    Every example belongs to one of ``b = cycle_length`` groups (drawn once, uniformly and
    independently per example); step ``t`` includes each example of group ``t mod b``
    independently with probability ``sampling_rate`` and no other example. So any example's
    participations are at least ``b`` steps apart, at most ``ceil(T / b)`` in ``T`` steps
    (:meth:`participations`), and the expected batch is ``sampling_rate * n / b``: for an expected
    batch ``B``, ``sampling_rate = B b / n`` (the rate of the amplified BandMF analysis, at most 1).
    Module docstring: why independent groups, and what a restore keeps.

    Everything else is :class:`PoissonSampler`'s: the draw of step ``t`` is a pure function of
    (seed, ``t``) (the same uniforms, kept for the examples of the step's group), batches padded
    to bucket sizes with zero-weight rows, ``fit`` setting the step from the model's step count,
    overflow raised rather than truncated, several processes. The defaults that depend on the
    batch's size use the per-step inclusion probability ``q / b``: ``max_batch_size`` (exceeded at
    a step with probability at most ``overflow_probability``), ``bucket_width``, and
    ``steps_per_epoch = b / q`` (each example drawn once in expectation).

    Args:
        x, y, sample_weight: the data, as :class:`PoissonSampler`'s.
        sampling_rate: ``q``, each example's inclusion probability at the steps of its group.
        cycle_length: ``b``, the number of groups and the least separation of two
            participations; at least the number of bands of the BandMF strategy.
        max_batch_size, bucket_width, steps_per_epoch, seed, overflow_probability, dataset_size,
            **kwargs: as :class:`PoissonSampler`'s.
    """

    def __init__(self, x, y, *, sampling_rate: float, cycle_length: int, sample_weight=None,
                 max_batch_size: int | None = None, bucket_width: int | None = None,
                 steps_per_epoch: int | None = None, overflow_probability: float = 1e-9,
                 dataset_size: int | None = None, **kwargs):
        if isinstance(cycle_length, bool) or int(cycle_length) != cycle_length or cycle_length < 1:
            raise ValueError(f"cycle_length must be a positive integer, got {cycle_length!r}.")
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
        #: ``b``: the groups, and the least separation of one example's participations.
        self.cycle_length = int(cycle_length)
        flat = tree.flatten(x)
        shard = len(np.asarray(flat[0])) if flat else 0
        whole = shard if dataset_size is None else int(dataset_size)
        step_rate = sampling_rate / self.cycle_length  # an example's probability at any one step
        if max_batch_size is None:
            max_batch_size = max_batch_size_for(max(shard, 1), step_rate, overflow_probability)
        if bucket_width is None:
            bucket_width = default_bucket_width(max(whole, 1), step_rate)
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(self.cycle_length / sampling_rate))
        super().__init__(x, y, sampling_rate=sampling_rate, sample_weight=sample_weight,
                         max_batch_size=max_batch_size, bucket_width=bucket_width,
                         steps_per_epoch=steps_per_epoch, overflow_probability=overflow_probability,
                         dataset_size=dataset_size, **kwargs)
        # The groups: the ``i``-th uniform of their stream for example ``i`` of the whole data set
        # (a shard skips those before it), from the seed drawn now; kept across restores.
        stream = np.random.default_rng(np.random.SeedSequence(self._entropy, spawn_key=_GROUPS_KEY))
        if self._offset:
            stream.bit_generator.advance(self._offset)
        groups = np.floor(stream.random(self.shard_size) * self.cycle_length).astype(np.int64)
        self._groups = np.minimum(groups, self.cycle_length - 1)
        #: Which groups these are: a SHA-256 of their seed, cycle length and data set size (the
        #: same on every process); the BandMF rule records it and refuses to continue its noise
        #: on other groups (:meth:`begin_fit`).
        self.groups_fingerprint = hashlib.sha256(
            f"{self._entropy}:{self.cycle_length}:{whole}".encode()).hexdigest()

    def begin_fit(self, model) -> None:
        """As :meth:`PoissonSampler.begin_fit`; a rule with correlated noise over several bands
        continues its recurrence only on these groups (:meth:`BandedMFGaussian.continue_on`)."""
        super().begin_fit(model)
        rule = getattr(model, "aggregator", None)
        if getattr(rule, "bands", 1) > 1:
            rule.continue_on(self.groups_fingerprint, steps_taken(model))

    @property
    def min_separation(self) -> int:
        """The fewest steps between two participations of one example: ``cycle_length``."""
        return self.cycle_length

    def participations(self, steps: int) -> int:
        """The most times one example can be drawn in ``steps`` steps: ``ceil(steps / b)``
        (group 0's, drawn at steps ``0, b, 2b, ...``)."""
        return math.ceil(int(steps) / self.cycle_length)

    @property
    def expected_batch_size(self) -> float:
        """``q n / b``: the denominator to give the DP rule."""
        return self.sampling_rate * self.dataset_size / self.cycle_length

    def indices_for_step(self, step: int) -> np.ndarray:
        """The sample of global step ``step``: the examples of group ``step mod b`` whose uniform
        of the step is below ``q`` (:meth:`PoissonSampler.indices_for_step`'s uniforms); a pure
        function of (seed, step)."""
        drawn = super().indices_for_step(step)
        return drawn[self._groups[drawn] == int(step) % self.cycle_length]
