"""Train steps that run once per replica (``tf.distribute``): the rules made exact.

Keras's TF trainer runs ``train_step`` on every replica with its shard of the
batch and the optimizer sums the replicas' gradients. For the rules here each
replica returns its share of the single-device result, so that the sum is that
result (docs/architecture.md, 'Multi-device training'): per-example statistics
are local, the weights need only the global batch size (an all-reduce of the
shard sizes), DP noise and the weight regularizer's gradient are added on
replica 0 only, and diagnostics are all-reduced. ``keras.ops`` and the backend
adapter only.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend import adapter


def count(model=None) -> int:
    """How many replicas each run the train step on their own part of the batch."""
    return adapter().replicas(model)


def refusal(wrapper) -> str | None:
    """Why ``wrapper`` (a ``PerExampleModel``) cannot train exactly on several replicas, or ``None``."""
    from pergrad.aggregators.basic import Clip, Mean, Sum
    from pergrad.aggregators.clipping import AutomaticClip

    supported = [Mean, Sum, Clip, AutomaticClip]
    try:
        from pergrad.privacy.dp_sgd import DPGaussian

        supported.append(DPGaussian)
    except ImportError:  # pragma: no cover - dp-accounting missing
        pass
    if keras.backend.backend() != "tensorflow":
        return "replicas that each run the train step are supported on TensorFlow only"
    if type(wrapper.aggregator) not in supported:
        return (
            f"the aggregator ({type(wrapper.aggregator).__name__}) is not one of the rules made "
            "exact on several replicas (mean, sum, clip, automatic_clip, dp_gaussian)"
        )
    if wrapper.microbatch_size is not None:
        return "microbatch_size is not supported on several replicas"
    if not (getattr(wrapper, "compiled", False) and wrapper.model.built):
        return None  # checked again when the step is traced
    problem = wrapper._problem()
    if problem.sum_reduction:
        return (
            "a 'sum'-reduced loss scales each example's loss by the batch size, which "
            "differs between a replica's shard and the whole batch"
        )
    if problem.seed_positions:
        return (
            "the model draws random numbers (a Dropout or another layer with a seed): each "
            "example's stream comes from its position in the batch, which a replica's shard "
            "does not know"
        )
    return None


def batch_share(aggregator, local_size):
    """The factor on a replica's result that makes the replicas' sum the single-device one.

    ``B_r / B`` (``B``: the sum of the shard sizes) for rules whose weights divide
    by the batch size (mean, clipping, DP-SGD without ``expected_batch_size``),
    ``None`` (1) for sums.
    """
    from pergrad.aggregators.basic import Sum

    if isinstance(aggregator, Sum) or getattr(aggregator, "expected_batch_size", None) is not None:
        return None
    return local_fraction(local_size)


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
    flags = [ops.any(ops.logical_not(ops.isfinite(g))) for g in gradients]
    failed = global_sum(ops.cast(ops.any(ops.stack(flags)), "float32")) > 0
    return [ops.where(failed, ops.cast(float("nan"), g.dtype), g) for g in gradients]


def first_replica(value):
    """``value`` on replica 0, zeros on the others: added once to the replicas' sum."""
    if count() <= 1:
        return value
    return value * ops.cast(ops.equal(adapter().replica_id(), 0), value.dtype)


def global_sum(value):
    """``value`` summed over the replicas (itself on one replica)."""
    return value if count() <= 1 else adapter().all_reduce_sum(value)


def global_mean(values):
    """The mean of ``values`` over every replica's shard (its own mean on one replica)."""
    if count() <= 1:
        return ops.mean(values)
    values = ops.cast(values, "float32")
    total = global_sum(ops.stack([ops.sum(values), ops.cast(ops.size(values), "float32")]))
    return total[0] / total[1]
