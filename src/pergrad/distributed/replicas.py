"""Train steps that run once per replica (``tf.distribute``): every rule made exact.

Keras's TF trainer runs ``train_step`` on every replica with its shard of the
batch and the optimizer sums the replicas' gradients. Each replica returns a
part of the single-device result, so that the sum is that result
(docs/architecture.md, 'Multi-device training'): rules whose weights need no
other example's gradient (their ``distribution``; ``pergrad.step`` decides)
aggregate their shard, scaled by its share of the batch (:func:`local_fraction`)
unless they sum; the others see the whole batch through all-gathers
(:func:`gather`: norms, each layer's ``A`` and ``D``, or per-example gradients)
and take their own rows (:func:`local_rows`), their own coordinates
(:func:`owns`) or, on replica 0, the whole result (:func:`first_replica`); a
rule of groups exchanges only the groups' results (:func:`combine_groups`).

The one place of every collective: rules return local quantities. The step adds
a rule's batch term (DP noise) and the weight regularizer's gradient on replica
0 only, and sums a rule's diagnostics reported as sums and counts over the
replicas (:func:`global_sum`), so that they describe the whole batch.
``keras.ops``, ``keras.distribution`` and the backend adapter only; a rule is
asked through its methods, never imported.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from pergrad.backend import adapter
from pergrad.tensors import all_finite


def count(model=None) -> int:
    """How many replicas each run the train step on their own part of the batch."""
    return adapter().replicas(model)


def local_fraction(local_size):
    """``B_r / B``: this replica's part of the batch (``B``: the sum of the shard sizes)."""
    local = ops.cast(local_size, "float32")
    return local / adapter().all_reduce_sum(local)


def finite_everywhere(gradients):
    """``gradients``, or NaN on every replica when any replica's are not finite.

    Keras's TF ``LossScaleOptimizer`` (3.15) decides whether to skip a step from
    replica 0's gradients before they are all-reduced: a float16 overflow on
    another replica would be applied, and the weights become NaN.
    """
    finite = all_true(all_finite(gradients))
    return [ops.where(finite, g, ops.cast(float("nan"), g.dtype)) for g in gradients]


def first_replica(value):
    """``value`` on replica 0, zeros on the others: added once to the replicas' sum."""
    if count() <= 1:
        return value
    replica = adapter().replica_id()
    if isinstance(replica, int):
        return value if replica == 0 else ops.zeros_like(value)
    # Not a product: the value may be infinite on a replica with an empty shard.
    return ops.where(ops.equal(replica, 0), value, ops.zeros_like(value))


def global_sum(value):
    """``value`` summed over the replicas (itself on one replica)."""
    return value if count() <= 1 else adapter().all_reduce_sum(value)


def gather(value):
    """Every replica's ``value`` concatenated along axis 0, in replica order (the order
    of the examples in the global batch); ``value`` itself on one replica."""
    return value if count() <= 1 else adapter().all_gather(value)


def combine_groups(rule, gradients):
    """The result of ``rule`` (``rule.group_count()`` equal to :func:`count`: one group per
    replica, ``two_level``) from this replica's shard's per-example gradients: the rule's
    ``aggregate_group`` on the shard, the groups' results and sizes all-gathered (one
    row per replica, in replica order: the groups' order), the rule's ``combine_groups``
    on them. Every replica returns the same value."""
    size = ops.shape(gradients[0])[0]
    rows = [gather(ops.expand_dims(r, 0)) for r in rule.aggregate_group(gradients)]
    sizes = gather(ops.reshape(ops.convert_to_tensor(size, "int32"), (1,)))
    return rule.combine_groups(rows, sizes)


def global_size(local_size):
    """The global batch size: the replicas' shard sizes summed."""
    return global_sum(ops.convert_to_tensor(local_size, "int32"))


def local_rows(values, local_size):
    """The rows of this replica's shard in ``values``, a ``(B, ...)`` tensor over the
    global batch in replica order (:func:`gather`)."""
    if count() <= 1:
        return values
    local_size = ops.convert_to_tensor(local_size, "int32")
    sizes = gather(ops.reshape(local_size, (1,)))
    before = ops.sum(ops.where(ops.arange(count()) < adapter().replica_id(), sizes, 0))
    return ops.slice(values, (before,) + (0,) * (len(values.shape) - 1),
                     (local_size,) + tuple(values.shape[1:]))


def owns(piece: int):
    """Whether this replica aggregates part number ``piece`` of a result split over the
    replicas (round robin): a Python bool where the replica index is static, else a
    scalar boolean tensor."""
    replica = adapter().replica_id()
    if isinstance(replica, int):
        return piece % count() == replica
    return ops.equal(replica, piece % count())


def all_true(flag):
    """``flag`` (a scalar boolean) on every replica."""
    if count() <= 1:
        return flag
    return ops.equal(global_sum(ops.cast(ops.logical_not(flag), "int32")), 0)


def batch_devices() -> int:
    """How many devices the current ``keras.distribution`` splits the batch over
    (``DataParallel``: all of its devices; ``ModelParallel``: its mesh's batch axis);
    1 without one."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    layout = distribution.get_data_layout((1,))
    axis = layout.axes[0]
    names = () if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    mesh = layout.device_mesh
    return math.prod(int(mesh.shape[list(mesh.axis_names).index(name)]) for name in names)


def batch_shards(model=None) -> int:
    """How many parts ``fit()`` splits each batch into, each for one device or replica.

    The replicas of a ``tf.distribute`` strategy (:func:`count`) times the devices the
    current ``keras.distribution`` shards the batch axis over (:func:`batch_devices`).
    Keras needs every batch to divide evenly over them.
    """
    return count(model) * batch_devices()


def data_parallel():
    """``(mesh, batch axis name, devices on it)`` of a ``keras.distribution.DataParallel``
    with several devices, else ``None``."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel) or batch_devices() <= 1:
        return None
    return distribution.device_mesh, distribution.batch_dim_name, batch_devices()


def _laid_out(tensor, axis, mesh, name):
    spec = [None] * len(tensor.shape)
    spec[axis] = name
    return keras.distribution.distribute_tensor(tensor, keras.distribution.TensorLayout(spec, mesh))


def by_example(tensor):
    """``tensor`` (examples first) split by example over a ``DataParallel``'s devices,
    as Keras lays out the batch; ``tensor`` itself in any other setting."""
    found = data_parallel()
    if found is None or not tensor.shape or tensor.shape[0] is None or tensor.shape[0] % found[2]:
        return tensor
    return _laid_out(tensor, 0, found[0], found[1])


def spread_coordinates(gradients):
    """``gradients`` (``(J, ...)`` rows of one variable) laid out over the devices of a
    ``keras.distribution.DataParallel`` by coordinate instead of by example.

    A coordinate rule compares every example's value of a coordinate: with the rows
    split by example, XLA's partitioner brings all ``J`` rows to every device; split
    by coordinate (the largest axis the device count divides), each device forms and
    selects over its own coordinates only (XLA gathers the layers' input and
    output-gradient rows it needs: docs/architecture.md, 'Communication per step').
    Values are unchanged; any other setting returns ``gradients``.
    """
    found = data_parallel()
    if found is None:
        return gradients
    mesh, name, devices = found
    shape = tuple(gradients.shape)
    axes = [k for k in range(1, len(shape)) if shape[k] and shape[k] % devices == 0]
    if not axes:
        return gradients
    return _laid_out(gradients, max(axes, key=lambda k: shape[k]), mesh, name)
