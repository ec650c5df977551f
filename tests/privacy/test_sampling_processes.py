"""The sampler's parts on several processes, simulated in this process (every backend).

``pergrad.distributed.processes`` is asked for the process count, this process's part and the shard
offsets; here it answers as process ``p`` of 2 would, so that each process's batches can
be computed one after the other and compared with one process's. The real two-process
runs: tests/test_processes.py (JAX).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
from pergrad.distributed import processes
from pergrad.privacy import PoissonSampler, UserSampler, dp_gaussian, max_batch_size_for

SIZE, RATE = 60, 0.2


def data():
    return np.arange(SIZE, dtype="float32")[:, None], np.arange(SIZE)


def model(**rule):
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    return pergrad.PerExampleModel(net, dp_gaussian(1.0, 1.0, **rule))


def as_process(monkeypatch, process, shards=None):
    """Makes ``pergrad.distributed.processes`` answer as process ``process`` of 2 (``shards``: the
    shard sizes, for a sampler built with ``dataset_size``)."""
    monkeypatch.setattr(processes, "count", lambda: 2)
    monkeypatch.setattr(processes, "index", lambda: process)
    monkeypatch.setattr(processes, "data_part", lambda: (process, 2))

    def join(sampler, sharded):
        if not sharded:
            return 0, sampler.max_batch_size
        # (the offset, the processes' largest max_batch_size), as the all-gather gives them
        return sum(shards[:process]), max(max_batch_size_for(size, RATE) for size in shards)

    monkeypatch.setattr(processes, "join_sampler", join)


def batches(sampler, steps, shards=2):
    """``steps`` batches as ``fit`` on ``shards`` devices gets them: (real y, rows) each."""
    found = []
    with sampler.split_for(model(expected_batch_size=RATE * SIZE), shards):
        for _ in range(steps):
            _, y, weights = sampler[0]
            found.append((y[weights > 0].tolist(), len(weights)))
    return found


@pytest.mark.parametrize("shards", [None, (36, 24)])
def test_the_processes_parts_are_one_poisson_sample(monkeypatch, shards):
    # Every process holding the whole data set, or each a shard (36 and 24 examples): at
    # every step the parts are disjoint, their union is the one-process sample of the same
    # seed, and both processes yield the same number of rows.
    x, y = data()
    one = PoissonSampler(x, y, sampling_rate=RATE, seed=4)
    parts = []
    for process in range(2):
        with monkeypatch.context() as patch:
            as_process(patch, process, shards)
            if shards is None:
                sampler = PoissonSampler(x, y, sampling_rate=RATE, seed=4)
            else:
                rows = np.arange(sum(shards[:process]), sum(shards[: process + 1]))
                sampler = PoissonSampler(x[rows], y[rows], sampling_rate=RATE, seed=4, dataset_size=SIZE)
                assert sampler.expected_batch_size == one.expected_batch_size
            parts.append(batches(sampler, 40))
    sizes = set()
    for step, ((first, rows), (second, other_rows)) in enumerate(zip(*parts)):
        assert rows == other_rows, step
        assert sorted(first + second) == one.indices_for_step(step).tolist(), step
        assert len(set(first + second)) == len(first + second)
        if shards is None:  # contiguous halves of the sample
            assert first + second == sorted(first + second) and abs(len(first) - len(second)) <= 1
        sizes.add(rows)
    # Buckets with the whole data set; one shape (the largest shard's bound) with shards.
    if shards is None:
        assert len(sizes) > 1
    else:
        assert sizes == {max(max_batch_size_for(size, RATE) for size in shards)}


def test_a_shard_draws_its_slice_of_the_whole_sets_uniforms():
    # The shard at offset o skips the o uniforms before it: a pure function of (seed, step).
    x, y = data()
    whole = PoissonSampler(x, y, sampling_rate=0.5, seed=9)
    generator = whole.generator_for_step(3)
    uniforms = generator.random(SIZE)
    generator = whole.generator_for_step(3)
    generator.bit_generator.advance(17)
    np.testing.assert_array_equal(generator.random(SIZE - 17), uniforms[17:])


def test_one_process_refuses_a_dataset_size_it_does_not_hold_and_user_shards():
    x, y = data()
    given = PoissonSampler(x, y, sampling_rate=RATE, seed=1, dataset_size=SIZE)
    plain = PoissonSampler(x, y, sampling_rate=RATE, seed=1)
    assert given.indices_for_step(0).tolist() == plain.indices_for_step(0).tolist()
    with pytest.raises(ValueError, match="on one process pass the whole data set"):
        PoissonSampler(x[:30], y[:30], sampling_rate=RATE, dataset_size=SIZE)
    with pytest.raises(ValueError, match="dataset_size must be the whole data set's size"):
        PoissonSampler(x, y, sampling_rate=RATE, dataset_size=SIZE - 1)
    with pytest.raises(ValueError, match="dataset_size .a shard per process. is not supported"):
        UserSampler(x, y, users=np.arange(SIZE) // 3, sampling_rate=RATE, examples_per_user=2,
                    dataset_size=SIZE)


def test_a_sampler_created_before_the_processes_joined_is_refused_at_fit(monkeypatch):
    x, y = data()
    sampler = PoissonSampler(x, y, sampling_rate=RATE, seed=1)  # one process
    monkeypatch.setattr(processes, "count", lambda: 2)
    with pytest.raises(ValueError, match=r"created on 1 process\(es\) and trains on 2"):
        with sampler.split_for(model(expected_batch_size=RATE * SIZE), 2):
            pass


def test_a_sharded_sampler_refuses_a_rule_that_counts_padding_and_a_batch_not_split_by_process(monkeypatch):
    from pergrad.aggregators import clip

    x, y = data()
    as_process(monkeypatch, 0, (30, 30))
    sampler = PoissonSampler(x[:30], y[:30], sampling_rate=RATE, seed=1, dataset_size=SIZE)
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="Clip counts the padding rows"):
        with sampler.split_for(pergrad.PerExampleModel(net, clip(1.0)), 2):
            pass
    monkeypatch.setattr(processes, "data_part", lambda: (0, 1))  # a batch axis over no process
    with pytest.raises(ValueError, match="splits the batch into 1 part"):
        with sampler.split_for(model(expected_batch_size=RATE * SIZE), 2):
            pass
