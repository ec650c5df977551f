"""Several processes (hosts) training one model, the privacy guarantee intact.

On JAX, ``keras.distribution.initialize(...)`` joins N processes, typically one per host,
into one runtime, and a ``keras.distribution`` over every process's devices
(``DataParallel(devices=keras.distribution.list_devices())``) makes each train step one
global program: every process feeds its part of the global batch, XLA inserts the
collectives, and every rule gives the single-process result. What happens on the hosts,
outside that program, is per process: the batches each one feeds, a sampler's random
draws, the DP noise key. This module is where pergrad makes those one per run
(docs/multi-device.md, 'Several hosts'):

- :func:`count`, :func:`index` and :func:`data_part`: the processes, and the part of every
  global batch this one feeds, from JAX and the ``keras.distribution`` (on TensorFlow, the
  ``TF_CONFIG`` cluster that ``MultiWorkerMirroredStrategy`` reads);
- :func:`secret_words`: random words drawn once, on process 0, from :mod:`secrets`, and
  broadcast: the DP noise key, a sampler's secret seed (never saved, never logged);
- :func:`part_of_sample`: one global Poisson sample split into the processes' parts;
- :func:`join_sampler`: the host-level checks that the processes' samplers are one sampler,
  and where each one's shard starts;
- :func:`check_fit` and :func:`replica_refusal`: what could not keep the single-process
  result or the guarantee is refused before the first step.

Host-level collectives (:func:`gather`, the broadcast) run where every process runs the
same code at the same point: constructing a sampler or a DP rule, loading weights, the
start of a ``fit``. Nothing here runs inside the train step.
"""

from __future__ import annotations

import hashlib
import secrets

import keras
import numpy as np
from keras import tree

from pergrad.backend import adapter, optional_kernel


def count() -> int:
    """How many processes this run has (``jax.process_count()``; TensorFlow: the workers
    of the ``TF_CONFIG`` cluster); 1 on one host or where the backend has none."""
    counter = optional_kernel("process_count")
    return 1 if counter is None else int(counter())


def index() -> int:
    """This process's index, ``0 .. count() - 1``."""
    finder = optional_kernel("process_index")
    return 0 if finder is None else int(finder())


def data_part() -> tuple[int, int] | None:
    """``(part, parts)``: every global batch is ``parts`` equal contiguous parts, in order, and
    this process feeds part ``part`` of each (JAX: the current ``keras.distribution``'s data
    layout; ``DataParallel`` over every process's devices gives ``(index(), count())``, a
    ``ModelParallel`` whose batch axis does not span the processes fewer parts, each fed by
    several processes). ``(0, 1)`` on one process; ``None`` when no distribution spans every
    process (each then trains a model of its own)."""
    if count() <= 1:
        return 0, 1
    distribution = keras.distribution.distribution()
    finder = optional_kernel("data_part")
    if distribution is None or finder is None:
        return None
    return finder(distribution.get_data_layout((1,)))


def gather(values) -> np.ndarray:
    """Every process's ``values`` (a NumPy array of one shape everywhere), stacked in process
    order: ``(count(), *shape)``. A collective: every process must call it."""
    values = np.asarray(values)
    return values[None] if count() <= 1 else adapter().gather_processes(values)


def secret_words(words: int) -> np.ndarray:
    """``words`` random 32-bit words (``uint32``) from :mod:`secrets`: on several JAX
    processes drawn on process 0 and broadcast, so that every process holds the same (a
    collective). On several TensorFlow workers each draws its own (``MultiWorkerMirroredStrategy``
    adds a DP rule's noise on replica 0 only: :func:`replica_refusal`)."""
    drawn = np.array([secrets.randbits(32) for _ in range(words)], np.uint32)
    broadcast = optional_kernel("broadcast_from_first")
    if count() > 1 and broadcast is not None:
        drawn = np.asarray(broadcast(drawn), np.uint32)
    return drawn


def part_of_sample(indices: np.ndarray, part: int, parts: int) -> np.ndarray:
    """Part ``part`` of ``parts`` of a global sample ``indices``: contiguous, the parts' sizes
    differing by at most one, so that every example of the sample is in exactly one part."""
    return np.array_split(indices, parts)[part]


def _digest(*nests) -> list[int]:
    """Two 64-bit words that identify the arrays of ``nests`` (shapes, dtypes and bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    for array in (a for nest in nests if nest is not None for a in tree.flatten(nest)):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.data if array.dtype != object else repr(array.tolist()).encode())
    return list(np.frombuffer(digest.digest(), np.uint64))


def join_sampler(sampler, sharded: bool) -> tuple[int, int]:
    """Checks that the processes' ``sampler`` objects are one sampler of one data set; returns
    ``(offset, largest)``: where this process's shard starts in the whole data set (0 unless
    ``sharded``) and the largest ``max_batch_size`` of the processes' samplers. A collective,
    made when the sampler is constructed on several processes.

    Every process holds the whole data set (``sharded=False``): the data, the seed and the
    settings must agree, so that every process draws the same global sample. Each holds a
    shard (``sharded=True``): the shards' sizes must add up to ``dataset_size`` and no two
    shards may be the same data.

    Raises:
        ValueError: the samplers disagree, or the backend cannot join them (TensorFlow).
    """
    type_name = type(sampler).__name__
    if optional_kernel("gather_processes") is None:
        raise ValueError(
            f"{type_name} cannot split its Poisson samples over the {count()} TensorFlow workers of "
            "this TF_CONFIG cluster (each worker process would draw its own batches, so the "
            "global batch would not be one Poisson sample): train DP-SGD on several hosts with "
            "the JAX backend and keras.distribution (docs/multi-device.md, 'Several hosts'), "
            "or on one worker."
        )
    seed = 0 if sampler.seed is None else _digest(np.asarray(repr(sampler.seed).encode()))[0]
    users = getattr(sampler, "unit_of_example", None)  # a UserSampler's
    local = {  # what every process contributes; the data set's digest is two words
        "dataset_size": [sampler.dataset_size], "whether dataset_size= is given": [int(sharded)],
        "seed": [seed], "sampling_rate": [np.float64(sampler.sampling_rate).view(np.uint64)],
        "bucket_width": [sampler.bucket_width], "steps_per_epoch": [sampler.steps_per_epoch],
        "max_batch_size": [sampler.max_batch_size], "workers": [sampler.workers],
        "shard": [sampler.shard_size],
        "data": _digest(sampler.x, sampler.y, sampler.sample_weight, users),
    }
    gathered = gather(np.array([word for words in local.values() for word in words], np.uint64))
    starts = np.cumsum([0] + [len(words) for words in local.values()])
    rows = {name: gathered[:, start:stop] for name, start, stop in zip(local, starts[:-1], starts[1:])}
    shared = list(local)[:6] + ([] if sharded else ["max_batch_size", "shard", "data"])
    for name in shared:
        if np.any(rows[name] != rows[name][0]):
            way_out = "the same arguments on every process"
            if name in ("shard", "data"):
                name, way_out = "the data set (x, y, sample_weight, users)", (
                    "the same data set on every process, or each process its own shard of it with "
                    "dataset_size=<the whole data set's size> (docs/multi-device.md, 'Several hosts')")
            raise ValueError(f"The {count()} processes' {type_name} objects differ in {name}: create one "
                             f"sampler with {way_out}.")
    if rows["workers"].max() > 1:
        raise ValueError(
            f"{type_name}(workers={int(rows['workers'].max())}) on several processes: threads fetch "
            "steps out of order, and every process's k-th batch must be its part of the same "
            "global step. Use workers=1 (the default)."
        )
    if not sharded:
        return 0, sampler.max_batch_size
    sizes = [int(size) for size in rows["shard"][:, 0]]
    if sum(sizes) != sampler.dataset_size:
        raise ValueError(
            f"{type_name}(dataset_size={sampler.dataset_size}): the {count()} processes' shards hold "
            f"{sizes} examples, {sum(sizes)} in all. Pass the whole data set's size, each process "
            "its own disjoint shard."
        )
    if len({tuple(words) for words in rows["data"]}) < len(sizes):
        raise ValueError(
            f"{type_name}(dataset_size=...): two processes hold the same shard, so its examples would "
            "be sampled twice (twice the sensitivity). Give each process its own disjoint shard, "
            "or every process the whole data set without dataset_size."
        )
    return sum(sizes[: index()]), int(rows["max_batch_size"].max())


def check_fit(model, sampled: bool) -> None:
    """Raises, before the first step, for a DP ``fit`` of ``model`` on several processes whose
    guarantee could not hold (``PerExampleModel.fit`` calls it; ``sampled``: whether the data
    is a ``pergrad.privacy.PoissonSampler``)."""
    processes = count()
    if processes <= 1 or not getattr(getattr(model, "aggregator", None), "differentially_private", False):
        return
    if optional_kernel("data_part") is None:
        # TensorFlow: a fit() outside MultiWorkerMirroredStrategy trains this worker's own model,
        # and Keras 3.15's fit() fails under it (custom loops: replica_refusal).
        return
    if data_part() is None:
        raise ValueError(
            f"DP training on {processes} processes needs one keras.distribution over every "
            "process's devices, so that they train one model: without one, each process would "
            "train and release a model of its own. Call keras.distribution.set_distribution("
            "keras.distribution.DataParallel(devices=keras.distribution.list_devices())) "
            "before building the model."
        )
    if not sampled:
        raise ValueError(
            f"DP training on {processes} processes takes its batches from "
            "pergrad.privacy.PoissonSampler (or UserSampler), which draws one Poisson sample of "
            "the whole data set per step and gives each process its part: with other data "
            "(arrays, a tf.data pipeline, a PyDataset) nothing shows that the processes' batches "
            "are disjoint, and an example fed by two processes enters the global batch twice "
            "(twice the sensitivity)."
        )


def replica_refusal(aggregator) -> str | None:
    """Why ``aggregator`` cannot train exactly on the replicas of several TensorFlow workers
    (``pergrad.distributed.replicas.refusal`` asks), or ``None``.

    ``MultiWorkerMirroredStrategy`` runs one Python process per worker, each with its own
    copy of the rule. A DP rule's secret key is then each worker's own: the noise of the
    gradient is added on replica 0 only, so one key is used; but adaptive clipping noises
    its count on every replica, and different keys would give each worker its own
    clipping norm."""
    if count() > 1 and getattr(aggregator, "count_stddev", 0) > 0 and aggregator.seed is None:
        return (
            f"{type(aggregator).__name__} with a secret key (seed=None) on {count()} TensorFlow "
            "workers: each worker process draws its own key, and the noised count that sets "
            "the next clipping norm must be the same draw on every replica (train on the JAX "
            "backend with keras.distribution, whose processes share one key)"
        )
    return None
