"""Train steps that run once per replica (``tf.distribute``): every rule made exact.

Keras's TF trainer runs ``train_step`` on every replica with its shard of the
batch and the optimizer sums the replicas' gradients. Each replica returns a
part of the single-device result, so that the sum is that result
(docs/multi-device.md): rules whose weights need no other example's gradient
(their ``distribution``; :class:`Replicas`) aggregate their shard, scaled by its
share of the batch (:func:`local_fraction`) unless they sum; the others
(:class:`GatheredReplicas`) see the whole batch through all-gathers (:func:`gather`:
norms, each layer's ``A`` and ``D``, or per-example gradients) and take their own
rows (:func:`local_rows`), their own coordinates (:func:`owns`) or, on replica 0,
the whole result (:func:`first_replica`); a rule of groups exchanges only the
groups' results (:func:`combine_groups`).

The one place of every collective of the step: rules return local quantities, and
the step calls the two classes here through the methods of
:class:`~pergrad.engine.collectives.Collectives` (``pergrad.distributed.training``
picks one). A rule's batch term (DP noise) and the weight regularizer's gradient
are added on replica 0 only, and a rule's diagnostics reported as sums and counts
are summed over the replicas (:func:`global_sum`), so that they describe the whole
batch. ``keras.ops`` and the backend adapter only; a rule is asked through its
methods, never imported. :func:`refusal` says what cannot be made exact.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.aggregators.base import WHOLE_BATCH, Aggregation
from pergrad.backend import adapter
from pergrad.distributed import layouts, processes
from pergrad.engine.collectives import Collectives
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


def first_row(local_size):
    """Where this replica's shard starts in the global batch (replica order): the sizes of
    the shards before it, summed."""
    sizes = gather(ops.reshape(ops.convert_to_tensor(local_size, "int32"), (1,)))
    return ops.sum(ops.where(ops.arange(count()) < adapter().replica_id(), sizes, 0))


def local_rows(values, local_size):
    """The rows of this replica's shard in ``values``, a ``(B, ...)`` tensor over the
    global batch in replica order (:func:`gather`)."""
    if count() <= 1:
        return values
    local_size = ops.convert_to_tensor(local_size, "int32")
    return ops.slice(values, (first_row(local_size),) + (0,) * (len(values.shape) - 1),
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


def batch_shards(model=None) -> int:
    """How many parts ``fit()`` splits each batch into, each for one device or replica.

    The replicas of a ``tf.distribute`` strategy (:func:`count`) times the devices the
    current ``keras.distribution`` shards the batch axis over
    (:func:`~pergrad.distributed.layouts.batch_devices`).
    Keras needs every batch to divide evenly over them.
    """
    return count(model) * layouts.batch_devices()


def refusal(wrapper, chunked: bool) -> str | None:
    """Why ``wrapper`` (a ``PerExampleModel``) cannot train exactly on several replicas
    that each run the step, or ``None`` (``chunked``: whether its rule takes the chunked
    path)."""
    if keras.backend.backend() != "tensorflow":
        return "replicas that each run the train step are supported on TensorFlow only"
    aggregator = wrapper.aggregator
    reason = processes.replica_refusal(aggregator)  # several workers: one Python process each
    if reason:
        return reason
    if aggregator.reads_units:
        return (
            f"{type(aggregator).__name__} clips each user's summed gradient, and a "
            "replica's shard may hold part of a user's examples"
        )
    if aggregator.distribution == WHOLE_BATCH and chunked:
        return (
            f"with microbatch_size, {type(aggregator).__name__} takes the chunked "
            "path, whose statistics would be those of one replica's shard; without "
            "microbatch_size it takes the statistics path, which forms no B x P tensor"
        )
    if not (getattr(wrapper, "compiled", False) and wrapper.model.built):
        return None  # checked again when the step is traced
    if wrapper.per_example_problem().sum_reduction:
        return (
            "a 'sum'-reduced loss scales each example's loss by the batch size, which "
            "differs between a replica's shard and the whole batch"
        )
    return None


class Replicas(Collectives):
    """The collectives of a step that each of several replicas runs on its shard, its rule
    aggregating the shard (``LOCAL_MEAN``, ``LOCAL_SUM``): each replica returns its part of
    the single-device result, and the optimizer sums the parts."""

    part_sum = staticmethod(global_sum)  # the rule's sums and counts: the whole batch's

    def __init__(self, fraction, divides: bool):
        #: ``B_r / B`` where the step needs it (a mean's share, a loss scale), else ``None``.
        self.fraction = fraction
        #: This replica's share of a mean (``LOCAL_MEAN``), else ``None``.
        self.share = fraction if divides else None

    def first_example(self, batch_size):
        return first_row(batch_size)

    def engine_loss_scale(self, loss_scale):
        # B_r / B of it, so that the backward pass's float16 values are those of one
        # device (a replica's mean loss divides by B_r).
        return None if loss_scale is None else loss_scale * self.fraction

    def once(self, value):
        return first_replica(value)

    def check_masked_output(self) -> None:
        raise ValueError(
            "PerExampleModel cannot train a model with a masked output on several replicas: "
            "Keras divides a masked loss by the unmasked steps of the whole batch, which a "
            "replica's shard does not know. Give padding steps sample weight 0 instead of a "
            "mask, or train on one replica."
        )

    def own_part(self, result, loss_scaled: bool) -> list:
        if loss_scaled:
            result = finite_everywhere(result)
        if self.share is not None:  # this replica's share of the single-device result
            result = [g * ops.cast(self.share, g.dtype) for g in result]
        return result

    def logged_loss(self, loss):
        return None  # a replica's loss is not the batch's (Keras's 1 / R)


class GatheredReplicas(Replicas):
    """The collectives of a step that each of several replicas runs on its shard, its rule
    running on the whole batch (``WHOLE_BATCH``): what the rule reads is all-gathered
    (norms, each layer's ``A`` and ``D``, per-example gradients), each replica keeps its
    own rows, its own coordinates or, on replica 0, the whole result."""

    works_alone = False
    part_sum = None  # every replica's rule saw the whole batch

    @property
    def parts(self):
        return count()

    def whole_size(self, batch_size):
        return global_size(batch_size)

    def gather(self, value):
        return gather(value)

    def whole_batch(self, layers):
        return layers.with_tensors(gather)

    def own_rows(self, values, batch_size):
        return local_rows(values, batch_size)

    def owns(self, piece: int):
        return owns(piece)

    def all_true(self, flag):
        return all_true(flag)

    def apply_rule(self, aggregator, per_example, units=None):
        if aggregator.group_count() == count():
            # One group per replica: only the R groups' results are exchanged.
            outcome = Aggregation.of(combine_groups(aggregator, per_example))
        else:  # every replica runs the rule on the whole batch
            outcome = aggregator.aggregation([gather(g) for g in per_example])
        return outcome.with_gradients([first_replica(g) for g in outcome.gradients])
