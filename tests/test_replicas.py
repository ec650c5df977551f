"""The replica policy's helpers (``pergrad.distributed.replicas``, ``layouts``) on one replica, as documented.

On one replica (no ``tf.distribute`` strategy, no ``keras.distribution``) every
collective is the identity: a sum, a mean, a gather over the replicas is the value
itself, the replica's part of the batch is all of it and it owns every piece. On
several replicas test_distributed.py trains through them (TensorFlow's
MirroredStrategy on 1, 2 and 4 replicas and MultiWorkerMirroredStrategy, JAX's
DataParallel) against the single-device result.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/test_replicas.py``.
"""

from __future__ import annotations

import types

import keras
import numpy as np
import pytest
from keras import ops

import pergrad
from pergrad.distributed import layouts, replicas, training
from pergrad.engine.collectives import ONE_DEVICE

VALUES = np.arange(12, dtype="float32").reshape(4, 3) - 5.0


def _numpy(value):
    return ops.convert_to_numpy(value)


def test_one_replica_without_a_strategy_or_a_distribution():
    assert replicas.count() == 1
    assert layouts.batch_devices() == 1
    assert layouts.data_parallel() is None


@pytest.mark.parametrize("local_size", [1, 7])
def test_the_one_replica_holds_the_whole_batch(local_size):
    fraction = replicas.local_fraction(local_size)
    assert keras.backend.standardize_dtype(fraction.dtype) == "float32"
    assert float(_numpy(fraction)) == 1.0
    size = replicas.global_size(local_size)
    assert keras.backend.standardize_dtype(size.dtype) == "int32" and int(_numpy(size)) == local_size


def test_sums_gathers_and_first_replica_are_the_value_itself():
    value = ops.convert_to_tensor(VALUES)
    for helper in (replicas.global_sum, replicas.gather, replicas.first_replica):
        np.testing.assert_array_equal(_numpy(helper(value)), VALUES, err_msg=helper.__name__)
    np.testing.assert_array_equal(_numpy(replicas.local_rows(value, 4)), VALUES)


def test_a_batch_is_split_into_one_shard():
    assert replicas.batch_shards() == 1


@pytest.mark.parametrize("piece", [0, 1, 5])
def test_the_one_replica_owns_every_piece(piece):
    assert bool(_numpy(replicas.owns(piece)))


@pytest.mark.parametrize("flag", [True, False])
def test_all_true_is_the_flag(flag):
    assert bool(_numpy(replicas.all_true(ops.convert_to_tensor(flag)))) is flag


def test_finite_everywhere_passes_finite_gradients_and_makes_all_nan_otherwise():
    finite = [ops.convert_to_tensor(VALUES), ops.convert_to_tensor(VALUES[0])]
    for got, expected in zip(replicas.finite_everywhere(finite), (VALUES, VALUES[0])):
        np.testing.assert_array_equal(_numpy(got), expected)
    with_inf = VALUES.copy()
    with_inf[1, 2] = np.inf
    gradients = [ops.convert_to_tensor(VALUES[0]), ops.convert_to_tensor(with_inf)]
    for got in replicas.finite_everywhere(gradients):
        assert np.isnan(_numpy(got)).all()


def test_layouts_are_unchanged_without_a_data_parallel_distribution():
    value = ops.convert_to_tensor(VALUES)
    assert layouts.by_example(value) is value
    assert layouts.spread_coordinates(value) is value


def test_a_step_on_one_device_calls_no_collective():
    """The train step's collectives on one device are the engine's identity object."""
    model = types.SimpleNamespace(aggregator=pergrad.aggregators.get("median"))
    assert training.collectives(model, ops.convert_to_tensor(VALUES), None) is ONE_DEVICE
    assert not training.replicated(model) and training.whole_batch_size(model, VALUES) is None
