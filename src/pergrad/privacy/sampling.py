"""Poisson sampling with few shapes, as DP-SGD's accountant assumes.

The privacy analysis of DP-SGD (:mod:`pergrad.privacy.accounting`) assumes
that every step includes each example independently with probability ``q``,
so that batch sizes vary. A jitted train step wants few shapes. The
:class:`PoissonSampler` reconciles both: it draws a Poisson sample every step
and pads it with rows of sample weight 0 to the next of a few *bucket* sizes,
the multiples of ``bucket_width`` (by default about the standard deviation of
the batch size, at least 8 rows) up to ``max_batch_size``. A zero-weight
example has loss 0 and a zero per-example gradient, so padding adds nothing to
the clipped sum; with ``expected_batch_size`` given to
:func:`pergrad.privacy.dp_gaussian`, the aggregated gradient is exactly that
of the unpadded Poisson batch, whatever the bucket. A compiled step (JAX)
compiles once per bucket size it meets: at most
``ceil(max_batch_size / bucket_width)`` shapes, about 8 in practice (the
draws within 4 standard deviations of the mean); padding costs about
``bucket_width / 2`` rows per step (5.5% of the real rows at an expected batch of 64,
instead of 91% when every batch was padded to ``max_batch_size``).

**What the shape reveals.** The trained weights are the same function of the
Poisson sample whatever the padding, so the accountant's mechanism (the noised
clipped sum divided by the expected batch size) is what the weights and
everything computed from them release. The padded size is a coarsening of the
drawn size ``|S_t|`` and shows only in how the step runs (its time, memory,
the shapes compiled), which the analysis assumes no adversary sees (as with
Opacus's variable-size Poisson batches, which show ``|S_t|`` itself). Where
such an observer must be guarded against, ``bucket_width >= max_batch_size``
(e.g. ``bucket_width=len(x)``) pads every batch to ``max_batch_size``: one
shape whatever the draw. Rules that count the padding rows (``mean``,
``clip``, ``median``, ...: all but ``dp_gaussian`` with
``expected_batch_size`` and ``sum``) would change with the bucket, so during
``PerExampleModel.fit`` they always get batches of ``max_batch_size`` rows.

**Overflow.** Dropping examples when more than ``max_batch_size`` are drawn
would change the mechanism and void the analysis. The sampler therefore
raises :class:`BatchOverflowError` instead, and by default chooses
``max_batch_size`` so that this happens with probability at most
``overflow_probability`` (``1e-9``) per step, by a Bernstein bound on the
binomial tail. The abort reveals only that a batch was unusually large, an
event whose probability barely depends on any one example; with ``T`` steps
it happens with probability at most ``T * overflow_probability``, which is
negligible next to a usual ``delta`` (and may be added to it for a
conservative statement).

**Several devices.** ``fit()`` splits each batch over the devices or replicas
(``keras.distribution.DataParallel`` on JAX, ``tf.distribute.MirroredStrategy``
on TensorFlow), and Keras needs the batch to divide evenly over them. A Poisson
sample of the whole dataset split over the replicas is distributed exactly as
independent Poisson samples of each replica's shard at the same rate ``q``, so
the accounting at the global ``q`` holds unchanged, and every step counts once.
During such a ``fit`` the sampler pads its batches to multiples of the
number of parts (``pergrad.distributed.replicas.batch_shards``: the bucket width and ``max_batch_size``
rounded up to one), which changes nothing for rules that
ignore padding (``dp_gaussian`` with ``expected_batch_size``, ``sum``); other
rules divide by the padded size, so for them a ``max_batch_size`` that does not
divide is refused with the value to pass instead.

**Several hosts.** On N JAX processes (``keras.distribution.initialize``) the global
batch of step ``t`` is still one Poisson sample of the whole data set, a pure function
of (seed, ``t``) that does not depend on N, and each process yields its part of it
(:mod:`pergrad.distributed.processes`; docs/multi-device.md, 'Several hosts'). Every process holding
the whole data set: all draw the same sample and each yields its contiguous share, padded
to ``padded_size / N`` rows. Each holding a disjoint shard (``dataset_size=`` the whole
set's size): example ``j`` of the whole set is included when the ``j``-th uniform of the
step's generator is below ``q``, so each shard samples its own examples and their union
is the one-process sample; every part is padded to the largest shard's
``max_batch_size``. A secret seed is drawn on process 0 and broadcast; the processes'
samplers are checked to agree when they are constructed (a collective: construct them on
every process).
"""

from __future__ import annotations

import contextlib
import math
import threading

import keras
import numpy as np
from keras import tree

from pergrad.aggregators.base import LOCAL_SUM, WHOLE_BATCH
from pergrad.distributed import processes
from pergrad.privacy.dp_sgd import steps_taken


class BatchOverflowError(RuntimeError):
    """More examples were sampled than fit in ``max_batch_size``."""


def max_batch_size_for(dataset_size: int, sampling_rate: float, overflow_probability: float = 1e-9) -> int:
    """A batch size that a Poisson sample exceeds with probability at most ``overflow_probability``.

    The size ``X`` of a Poisson sample is Binomial(n, q), mean ``mu = n q`` and
    variance ``s^2 = n q (1 - q)``. Bernstein's inequality gives
    ``P(X >= mu + t) <= exp(-t^2 / (2 (s^2 + t / 3)))``; solving for the ``t``
    that makes the right side ``overflow_probability`` gives a bound that holds
    for any ``n`` and ``q`` (a little larger than the exact quantile).
    """
    mean = dataset_size * sampling_rate
    return bernstein_bound(mean, mean * (1.0 - sampling_rate), 1, dataset_size, overflow_probability)


def bernstein_bound(mean: float, variance: float, largest: float, total: int,
                    overflow_probability: float) -> int:
    """A size that a sum of independent terms in ``[0, largest]`` (of ``mean`` and
    ``variance``, at most ``total``) exceeds with probability at most ``overflow_probability``.

    Bernstein's inequality: ``P(X >= mean + t) <= exp(-t^2 / (2 (variance + largest t / 3)))``;
    the ``t`` that makes the right side ``overflow_probability`` bounds any such sum (a
    Poisson sample's size: terms in ``[0, 1]``; a user sample's: ``[0, k]``).
    """
    if not 0 < overflow_probability < 1:
        raise ValueError(f"overflow_probability must be in (0, 1), got {overflow_probability}.")
    log_term = math.log(1.0 / overflow_probability)
    third = largest * log_term / 3.0
    t = third + math.sqrt(third**2 + 2.0 * variance * log_term)
    return max(1, min(int(total), math.ceil(mean + t)))


#: The narrowest default bucket: fewer padding rows are not worth another compiled shape.
MIN_BUCKET_WIDTH = 8


def default_bucket_width(dataset_size: int, sampling_rate: float) -> int:
    """``max(8, ceil(s))``, ``s = sqrt(n q (1 - q))`` the standard deviation of the batch size.

    Buckets one standard deviation wide keep the compiled shapes to about 8
    (the draws within 4 standard deviations of the mean, ``P > 0.9999``) at any
    batch size, while padding costs about ``s / 2`` rows, a fraction
    ``1 / (2 sqrt(n q))`` of the batch: 6% at an expected batch of 64, 3% at 256.
    """
    return bucket_width_for(dataset_size * sampling_rate * (1.0 - sampling_rate))


def bucket_width_for(variance: float) -> int:
    """``max(8, ceil(s))`` for a batch size of variance ``s^2``."""
    return max(MIN_BUCKET_WIDTH, math.ceil(math.sqrt(variance)))


class PoissonSampler(keras.utils.PyDataset):
    """A ``fit()`` data source that Poisson-samples every step, with few shapes.

    Each call draws a fresh sample: every example is included independently
    with probability ``sampling_rate``. The sampled rows are followed by
    padding rows (copies of example 0 with sample weight 0) up to the next
    multiple of ``bucket_width`` (at most ``max_batch_size``;
    :meth:`padded_size`), so a jitted train step is traced once per bucket
    size it meets, a handful in all, and padding costs about half a bucket.
    Batches are ``(x, y, sample_weight)``; the sample weight is the user's (or
    1) for sampled rows and 0 for padding. A weight per example is shaped
    ``(rows, 1, ...)`` to the rank of ``y`` (one array), so that it weighs every
    value of an example whose loss has several (a sequence's tokens, an image's
    pixels), which Keras's own reduction does not broadcast from ``(rows,)``.

    Use it with :func:`pergrad.privacy.dp_gaussian` and pass
    ``expected_batch_size=sampler.expected_batch_size``: the padded batch's
    size is not the number of examples. The batch's shape depends on the
    drawn size, not the weights: see the module docstring for what it
    reveals, and pass ``bucket_width=len(x)`` for one shape whatever the
    draw. During ``PerExampleModel.fit`` with a rule that counts the padding
    rows (all but ``dp_gaussian`` with ``expected_batch_size`` and ``sum``),
    every batch has ``max_batch_size`` rows.

    **Several devices.** During a ``fit`` on several devices or replicas the
    bucket sizes are multiples of their number, at most :attr:`batch_size`
    (``max_batch_size`` rounded up to one); see the module docstring.

    **Draws as a function of the step.** The draw of global step ``t`` is a
    pure function of (seed, ``t``): a fresh ``numpy`` generator seeded with
    ``SeedSequence(seed, spawn_key=(t,))``. The sampler keeps the step of its
    next draw (:attr:`step`) and advances it at every call (the batch index
    Keras passes is ignored, so ``fit(shuffle=...)`` has no effect). At the
    start of every ``PerExampleModel.fit`` (``on_train_begin``, after
    ``keras.callbacks.BackupAndRestore`` has restored the weights), the step is
    set to the number of steps the model's DP rule has taken
    (``step_count``; ``optimizer.iterations`` for other rules). So a run
    resumed from a backup, from ``load_model`` or from ``load_weights``, with
    a re-created sampler and the same ``seed``, draws exactly the batches of
    an uninterrupted run. The batches Keras fetches before training starts
    (TensorFlow infers the data's signature from two, JAX and torch build the
    model with one) only read draws that training draws again; they change
    nothing. Exact reproduction needs batches requested in order, as with
    the default ``workers=1``; threads (``workers=N``) still draw distinct
    steps. Multiprocessing workers would copy the sampler and repeat its
    draws, and are refused.

    With ``seed=None`` the seed is 128 bits from :mod:`secrets`, unknown to
    anyone, and drawn again when the step is moved back (a restore), so that
    a restored run never repeats the draws of the run it replaces. A fixed
    ``seed`` is for tests: an adversary who knows it knows every batch.

    If more than ``max_batch_size`` examples are drawn, the sampler raises
    :class:`BatchOverflowError` rather than truncating (see the module
    docstring); the default ``max_batch_size`` makes that a ``1e-9``-per-step
    event.

    Args:
        x: inputs: an array or a nest (list, tuple, dict) of arrays sharing
            the first axis.
        y: targets (same structure rules). Required: Keras batches cannot carry
            a sample weight without targets.
        sampling_rate: ``q``, each example's inclusion probability per step.
        sample_weight: optional weights, shape ``(n,)`` (one an example) or the shape
            of the per-example loss values (``(n, steps)`` for a sequence's tokens,
            as keras-hub's preprocessors give).
        max_batch_size: the largest padded batch size; by default
            :func:`max_batch_size_for` with ``overflow_probability``.
        bucket_width: batches are padded to the next multiple of it (at most
            ``max_batch_size``); by default :func:`default_bucket_width`,
            about the standard deviation of the batch size (at least 8).
            ``bucket_width >= max_batch_size`` pads every batch to
            ``max_batch_size``.
        steps_per_epoch: batches per epoch; by default ``round(1 / q)``, so
            that an epoch sees ``n`` examples in expectation.
        seed: seeds the sampling; ``None`` (the default) draws a secret
            128-bit seed. For privacy the sample must be unpredictable: a fixed
            seed is for reproducible tests.
        overflow_probability: target per-step overflow probability for the
            default ``max_batch_size``.
        dataset_size: the whole data set's size when ``x``, ``y`` are this
            process's disjoint shard of it, on one of several processes
            (module docstring, 'Several hosts'); ``None``: they are the whole
            data set. ``max_batch_size`` then bounds this shard's draw.
        **kwargs: ``workers``, ``max_queue_size`` for ``keras.utils.PyDataset``.
    """

    def __init__(
        self,
        x,
        y,
        *,
        sampling_rate: float,
        sample_weight=None,
        max_batch_size: int | None = None,
        bucket_width: int | None = None,
        steps_per_epoch: int | None = None,
        seed: int | None = None,
        overflow_probability: float = 1e-9,
        dataset_size: int | None = None,
        **kwargs,
    ):
        if kwargs.get("use_multiprocessing"):
            raise ValueError(
                "PoissonSampler cannot use multiprocessing: each process would copy the "
                "random state and repeat the same samples. Use threads (workers=N)."
            )
        super().__init__(**kwargs)
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
        self.x = tree.map_structure(np.asarray, x)
        if y is None:
            raise ValueError(
                "PoissonSampler needs targets y: a Keras batch carries the padding's zero "
                "sample weights only alongside targets."
            )
        self.y = tree.map_structure(np.asarray, y)
        sizes = {len(a) for a in tree.flatten(self.x)} | {len(a) for a in tree.flatten(self.y)}
        if sample_weight is not None:
            sample_weight = np.asarray(sample_weight, dtype="float32")
            if sample_weight.ndim < 1:
                raise ValueError(f"sample_weight must have shape (n, ...), got {sample_weight.shape}.")
            sizes.add(len(sample_weight))
        if len(sizes) != 1:
            raise ValueError(f"x, y and sample_weight must share their first axis; got sizes {sizes}.")
        #: The examples this sampler holds: the whole data set, or this process's shard.
        self.shard_size = sizes.pop()
        if self.shard_size == 0:
            raise ValueError("The dataset is empty.")
        if dataset_size is not None and (isinstance(dataset_size, bool) or int(dataset_size) != dataset_size
                                         or dataset_size < self.shard_size):
            raise ValueError(
                f"dataset_size must be the whole data set's size, an integer of at least this "
                f"shard's {self.shard_size} examples; got {dataset_size!r}."
            )
        #: The examples of the whole data set (``dataset_size``, else those given).
        self.dataset_size = self.shard_size if dataset_size is None else int(dataset_size)
        self.sample_weight = sample_weight
        targets = tree.flatten(self.y)
        #: The shape of one row's weight: the user's, or ``(1,) * (rank of y - 1)`` for one
        #: weight an example (Keras's loss reduction broadcasts ``(B, 1)`` over ``(B, T)``
        #: values, not ``(B,)``).
        self.weight_shape = tuple(sample_weight.shape[1:]) if sample_weight is not None and \
            sample_weight.ndim > 1 else (1,) * (targets[0].ndim - 1 if len(targets) == 1 else 0)
        self.sampling_rate = float(sampling_rate)
        if max_batch_size is None:
            max_batch_size = max_batch_size_for(self.shard_size, self.sampling_rate, overflow_probability)
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size}.")
        self.max_batch_size = int(max_batch_size)
        if bucket_width is None:
            bucket_width = default_bucket_width(self.dataset_size, self.sampling_rate)
        if int(bucket_width) < 1:
            raise ValueError(f"bucket_width must be a positive integer, got {bucket_width}.")
        self.bucket_width = int(bucket_width)
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(1.0 / self.sampling_rate))
        self.steps_per_epoch = int(steps_per_epoch)
        self.seed = seed
        self._entropy = seed if seed is not None else _secret_entropy()
        self._step = 0
        self._lock = threading.Lock()
        self._multiple = 1  # set by `split_for` during a fit on several devices
        self._buckets = True  # `split_for`: False for a rule that counts the padding rows
        # Several processes: where this shard starts in the whole data set, and the
        # processes' largest max_batch_size (pergrad.distributed.processes.join_sampler).
        self._processes = processes.count()
        self._sharded = dataset_size is not None and self._processes > 1
        self._offset, self._largest = 0, self.max_batch_size
        if self._processes > 1:
            self._offset, self._largest = processes.join_sampler(self, self._sharded)
        elif self.dataset_size != self.shard_size:
            raise ValueError(
                f"dataset_size={self.dataset_size} but this one process holds {self.shard_size} "
                "examples: on one process pass the whole data set (dataset_size is for a shard "
                "on each of several processes)."
            )
        self._part = (0, 1)  # `split_for`: (this process's part, parts) of every global batch
        self._shard_rows = None  # `split_for`, sharded: the rows of every process's part

    @property
    def batch_size(self) -> int:
        """The largest padded batch: ``max_batch_size`` rounded up to a multiple
        of the devices a ``fit`` on several devices splits them over (the global batch's
        rows during a ``fit`` on several processes each holding a shard)."""
        if self._shard_rows is not None:
            return self._shard_rows * self._part[1]
        return _round_up(self.max_batch_size, self._multiple)

    def padded_size(self, drawn: int) -> int:
        """The rows of a batch of ``drawn`` examples: the next multiple of the bucket
        width (rounded up to a multiple of the devices), at least one bucket, at
        most :attr:`batch_size`; :attr:`batch_size` during a ``fit`` whose rule
        counts the padding rows."""
        if not self._buckets or self._shard_rows is not None:
            return self.batch_size
        width = _round_up(self.bucket_width, self._multiple)
        return min(self.batch_size, _round_up(max(int(drawn), 1), width))

    @property
    def padded_sizes(self) -> list[int]:
        """Every batch size :meth:`padded_size` can give: the shapes a step may be
        compiled for (a bound; the draws meet about 8 of them)."""
        return sorted({self.padded_size(drawn) for drawn in range(self.max_batch_size + 1)})

    @contextlib.contextmanager
    def split_for(self, model, shards: int):
        """Pads batches for ``model``'s devices and rule during a ``fit`` (``PerExampleModel.fit``
        uses it): to multiples of ``shards``, the parts ``fit()`` splits each batch into
        (``pergrad.distributed.replicas.batch_shards``), and to :attr:`batch_size` for a rule that
        counts the padding rows. On several processes, each process yields its part
        (module docstring, 'Several hosts').

        Raises:
            ValueError: ``max_batch_size`` does not divide over the devices and
                ``model``'s rule does not ignore padding; the sampler and the fit disagree
                on the processes (module docstring).
        """
        aggregator = getattr(model, "aggregator", None)
        sums = getattr(aggregator, "distribution", WHOLE_BATCH) == LOCAL_SUM
        part = self._process_part(aggregator, sums)
        if self.max_batch_size % shards and not sums:
            multiple = _round_up(self.max_batch_size, shards)
            raise ValueError(
                f"PoissonSampler's batches (max_batch_size={self.max_batch_size}) do not split "
                f"evenly over the {shards} devices or replicas that fit() splits them over, as "
                "Keras requires, and padding them further would change the result of "
                f"{type(aggregator).__name__}, which counts the padding rows. Pass "
                f"PoissonSampler(..., max_batch_size={multiple}) (a multiple of {shards}; one "
                "device then gives the same result), or use a rule that ignores padding "
                "(dp_gaussian with expected_batch_size, or sum)."
            )
        previous = self._multiple, self._buckets, self._part, self._shard_rows
        self._multiple, self._buckets, self._part = shards, sums, part
        if self._sharded:  # one shape on every process: the largest shard's bound
            self._shard_rows = _round_up(self._largest, max(1, shards // part[1]))
        try:
            yield self
        finally:
            self._multiple, self._buckets, self._part, self._shard_rows = previous

    def _process_part(self, aggregator, sums: bool) -> tuple[int, int]:
        """``(part, parts)`` of every global batch this process yields during a ``fit``
        (:func:`pergrad.distributed.processes.data_part`), after the checks that need the fit."""
        now = processes.count()
        if now != self._processes:
            raise ValueError(
                f"This {type(self).__name__} was created on {self._processes} process(es) and "
                f"trains on {now}: create it after keras.distribution.initialize(...), so that "
                "the processes draw one sample together."
            )
        part = processes.data_part() or (0, 1)  # None: each process trains its own model
        if self._sharded and part[1] != now:
            raise ValueError(
                f"{type(self).__name__}(dataset_size=...) holds one shard per process, so each of "
                f"the {now} processes must feed its own part of every global batch; the current "
                f"keras.distribution splits the batch into {part[1]} part(s). Use "
                "keras.distribution.DataParallel(devices=keras.distribution.list_devices()), or "
                "give every process the whole data set (without dataset_size)."
            )
        if self._sharded and not sums:
            raise ValueError(
                f"{type(self).__name__}(dataset_size=...) pads each process's part of the batch to "
                "the largest shard's max_batch_size, and "
                f"{type(aggregator).__name__} counts the padding rows, so its result would depend "
                "on the shards: use a rule that ignores padding (dp_gaussian with "
                "expected_batch_size, or sum), or give every process the whole data set."
            )
        return part

    @property
    def step(self) -> int:
        """The global step of the next draw."""
        return self._step

    def set_step(self, step: int) -> None:
        """Makes the next draw that of global step ``step`` (``fit`` calls it)."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}.")
        with self._lock:
            if self.seed is None and step < self._step:
                # A restore: never repeat the draws of the run it replaces.
                self._entropy = _secret_entropy()
            self._step = step

    def begin_fit(self, model) -> None:
        """``fit`` calls it when training begins, after any restore (``BackupAndRestore``): the
        next draw is that of the model's step count."""
        self.set_step(steps_taken(model))

    def with_step_callback(self, callbacks=None):
        """``callbacks`` followed by the callback that sets :attr:`step` at train begin."""
        sync = _StepSync(self)
        if callbacks is None:
            return [sync]
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.append(sync)
            return callbacks
        return [*callbacks, sync]

    #: What one draw includes independently with probability ``sampling_rate``, and what
    #: the accountant's guarantee is for (``PrivacyAccountant(unit=...)``).
    privacy_unit = "example"

    def generator_for_step(self, step: int) -> np.random.Generator:
        """The generator of global step ``step``'s draw: a pure function of (seed, step)."""
        return np.random.default_rng(np.random.SeedSequence(self._entropy, spawn_key=(int(step),)))

    def indices_for_step(self, step: int) -> np.ndarray:
        """The Poisson sample of global step ``step``: a pure function of (seed, step). For a
        shard (``dataset_size``), its examples of that sample: example ``i`` of the whole
        data set is included when the ``i``-th uniform of the step's generator is below
        ``q``, whichever process holds it."""
        generator = self.generator_for_step(step)
        if self._offset:  # the uniforms of this shard's examples: skip those before it
            generator.bit_generator.advance(self._offset)
        return np.flatnonzero(generator.random(self.shard_size) < self.sampling_rate)

    @property
    def expected_batch_size(self) -> float:
        """``q * n``: the denominator to give :func:`pergrad.privacy.dp_gaussian`."""
        return self.sampling_rate * self.dataset_size

    def __len__(self) -> int:
        return self.steps_per_epoch

    def sample_indices(self) -> np.ndarray:
        """The next Poisson sample: the indices of the included examples."""
        with self._lock:
            step = self._step
            self._step += 1
        indices = self.indices_for_step(step)
        if len(indices) > self.max_batch_size:
            raise BatchOverflowError(
                f"Poisson sampling drew {len(indices)} examples, more than max_batch_size="
                f"{self.max_batch_size}. Truncating would invalidate the privacy analysis; "
                "use a larger max_batch_size (or the default, chosen so that this is a "
                "negligible-probability event)."
            )
        return indices

    def __getitem__(self, index):
        indices, size = self.local_part(self.sample_indices())
        rows = np.concatenate([indices, np.zeros(size - len(indices), dtype=indices.dtype)])
        weights = np.zeros((size, *self.weight_shape), dtype="float32")
        weights[: len(indices)] = 1.0 if self.sample_weight is None else \
            self.sample_weight[indices].reshape((len(indices), *self.weight_shape))
        return self.inputs(rows, len(indices)), tree.map_structure(lambda a: a[rows], self.y), weights

    def local_part(self, indices: np.ndarray) -> tuple[np.ndarray, int]:
        """``(examples, rows)``: this process's examples of the draw ``indices`` and the rows
        of its part of the batch (padding after them). One process: all of them, in
        :meth:`padded_size` rows. Several, each holding the whole data set: its contiguous
        share of the one global sample (:func:`pergrad.distributed.processes.part_of_sample`), in
        ``padded_size / parts`` rows. Several, each holding a shard: its shard's draw, in as
        many rows as every other process's part."""
        if self._shard_rows is not None:
            return indices, self._shard_rows
        part, parts = self._part
        return processes.part_of_sample(indices, part, parts), self.padded_size(len(indices)) // parts

    def inputs(self, rows: np.ndarray, drawn: int):
        """The batch's ``x``: the rows ``rows`` of the inputs, the first ``drawn`` of them
        sampled and the rest padding."""
        return tree.map_structure(lambda a: a[rows], self.x)


def _secret_entropy() -> int:
    """128 secret bits, the same on every process (:func:`pergrad.distributed.processes.secret_words`)."""
    return int.from_bytes(processes.secret_words(4).tobytes(), "little")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _StepSync(keras.callbacks.Callback):
    """Sets a sampler's step to the model's step count when training begins.

    Listed after the user's callbacks, so that it reads the count that
    ``BackupAndRestore`` (whatever its position) has restored.
    """

    def __init__(self, sampler: PoissonSampler):
        super().__init__()
        self.sampler = sampler

    def on_train_begin(self, logs=None):
        self.sampler.begin_fit(self.model)
