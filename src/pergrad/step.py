"""The per-example training step, written once for every backend (``keras.ops`` only).

``aggregated_gradients`` turns one batch into the gradients the optimizer
applies: it picks the engine path (statistics, chunked or materialized), runs
the aggregator, adds the regularizers' gradients and applies the non-finite
rule and the loss scale. The backend-specific ``train_step`` glue that calls it
lives in ``pergrad.trainers``.
"""

from __future__ import annotations

import keras
from keras import ops, tree

from pergrad import compat, replicas
from pergrad.aggregators.base import (
    LOCAL_MEAN,
    STATISTICS,
    WHOLE_BATCH,
    check_result,
    zero_non_finite_examples,
)
from pergrad.aggregators.compose import TwoLevel
from pergrad.engine import chunked, statistics, streaming
from pergrad.log import warn_once

#: The paths ``engine_path`` chooses between.
STATISTICS_PATH, CHUNKED_PATH, MATERIALIZED_PATH = "statistics", "chunked", "materialized"


def engine_path(aggregator, path: str, microbatch_size: int | None) -> str:
    """The engine path a step tries first, given ``PerExampleModel``'s settings.

    Args:
        aggregator: the model's aggregator.
        path: ``PerExampleModel``'s ``path=`` (``"auto"``, ``"statistics"``,
            ``"materialized"``).
        microbatch_size: ``PerExampleModel``'s ``microbatch_size``.

    Returns:
        ``"statistics"`` (the model may still need the materialized path, found
        out when the step is traced), ``"chunked"`` or ``"materialized"``.
    """
    weighted = chunked.supports(aggregator)
    supported = weighted or streaming.supports(aggregator)
    # Coordinate rules stream whatever the microbatch size: their backward pass has no
    # per-example term, and the microbatch size bounds the blocks they are aggregated in.
    if path != MATERIALIZED_PATH and supported and (
        path == STATISTICS_PATH or microbatch_size is None or not weighted
    ):
        return STATISTICS_PATH
    if microbatch_size is not None and weighted:
        return CHUNKED_PATH
    return MATERIALIZED_PATH


def replica_refusal(wrapper) -> str | None:
    """Why ``wrapper`` (a ``PerExampleModel``) cannot train exactly on several replicas
    that each run the step (``pergrad.replicas``), or ``None``."""
    if keras.backend.backend() != "tensorflow":
        return "replicas that each run the train step are supported on TensorFlow only"
    aggregator = wrapper.aggregator
    if aggregator.distribution == WHOLE_BATCH and (
        engine_path(aggregator, wrapper.engine_path, wrapper.microbatch_size) == CHUNKED_PATH
    ):
        return (
            f"with microbatch_size, {type(aggregator).__name__} takes the chunked "
            "path, whose statistics would be those of one replica's shard; without "
            "microbatch_size it takes the statistics path, which forms no B x P tensor"
        )
    if not (getattr(wrapper, "compiled", False) and wrapper.model.built):
        return None  # checked again when the step is traced
    problem = wrapper._problem()
    if problem.sum_reduction:
        return (
            "a 'sum'-reduced loss scales each example's loss by the batch size, which "
            "differs between a replica's shard and the whole batch"
        )
    return None


def loss_scale(optimizer, variables):
    """A ``LossScaleOptimizer``'s current scale (built on first use), else ``None``."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if not optimizer.built:  # TF's fit() builds it lazily, in the first step
            optimizer.build(variables)
        return optimizer.dynamic_scale
    return None


def all_finite(gradients):
    """A scalar boolean: every entry of every tensor in ``gradients`` is finite."""
    return ops.all(ops.stack([ops.all(ops.isfinite(g)) for g in gradients]))


def log_materialized(wrapper, reason: str) -> None:
    """Logs, once per model and reason, that ``path='auto'`` fell back to the materialized path."""
    warn_once(wrapper, f"model {wrapper.model.name!r} takes the materialized path (every "
                       f"per-example gradient): {reason}")


def aggregated_gradients(wrapper, trainable_values, non_trainable_values, x, y, sample_weight):
    """Returns ``(gradients, y_pred, new_seed_states)`` for one batch.

    Pure in the variable values; the aggregator may assign its own state
    (the JAX step runs it inside a ``StatelessScope``).

    Args:
        wrapper: the ``PerExampleModel`` (its wrapped model, aggregator, engine
            path, microbatch size, optimizer and compiled per-example problem).
        trainable_values: values of the wrapped model's trainable variables.
        non_trainable_values: values of its non-trainable variables.
        x: the batch's inputs.
        y: its targets.
        sample_weight: its sample weights, or ``None``.
    """
    problem = wrapper._problem()
    aggregator = wrapper.aggregator
    scale = loss_scale(wrapper.optimizer, wrapper.model.trainable_variables)
    private = getattr(aggregator, "differentially_private", False)
    path = engine_path(aggregator, wrapper.engine_path, wrapper.microbatch_size)
    per_example = None
    share = None
    engine_scale = scale
    several = replicas.count(wrapper) > 1
    # On several replicas (pergrad.replicas), as the rule's distribution says: each
    # aggregates its shard, scaled by its share of the batch unless the rule sums, or
    # the rule runs on the whole batch, gathered.
    gathered = several and aggregator.distribution == WHOLE_BATCH
    divides = several and aggregator.distribution == LOCAL_MEAN
    if divides or (several and scale is not None):
        fraction = replicas.local_fraction(ops.shape(tree.flatten(x)[0])[0])  # B_r / B
        if divides:
            share = fraction
        if scale is not None:
            # B_r / B of the scale: the backward pass's float16 values as on one
            # device (a replica's mean loss divides by B_r), so the same steps overflow.
            engine_scale = scale * fraction
    if path == STATISTICS_PATH:
        try:
            if chunked.supports(aggregator):
                result, aux = statistics.aggregate(
                    problem, aggregator, trainable_values, non_trainable_values,
                    x, y, sample_weight, loss_scale=engine_scale, gathered=gathered,
                )
            else:
                result, aux = streaming.aggregate(
                    problem, aggregator, trainable_values, non_trainable_values,
                    x, y, sample_weight, loss_scale=engine_scale, microbatch_size=wrapper.microbatch_size,
                    gathered=gathered,
                )
        except statistics.Unsupported as error:
            if wrapper.engine_path == STATISTICS_PATH:
                raise ValueError(
                    f"The statistics path cannot train model {wrapper.model.name!r}: {error}. "
                    "Use path='auto' (it then takes the materialized path) or 'materialized'."
                ) from error
            log_materialized(wrapper, str(error))
            path = MATERIALIZED_PATH
    if path == CHUNKED_PATH:
        # Accumulated chunk by chunk: no (B, ...) per-example tensor exists. A DP
        # rule's non-finite examples are zeroed in every chunk.
        result, aux = chunked.aggregate(
            problem, aggregator, trainable_values, non_trainable_values,
            x, y, sample_weight, wrapper.microbatch_size, loss_scale=engine_scale,
        )
    elif path == MATERIALIZED_PATH:
        per_example, aux = problem.compute(
            trainable_values,
            non_trainable_values,
            x,
            y,
            sample_weight,
            wrapper.microbatch_size,
            loss_scale=engine_scale,
        )
        if private:
            per_example = zero_non_finite_examples(per_example)
        if gathered and isinstance(aggregator, TwoLevel) and aggregator.groups == replicas.count(wrapper):
            # One group per replica: only the R local results are exchanged; counted once.
            result = [replicas.first_replica(g) for g in aggregator.aggregate_over_replicas(per_example)]
        elif gathered:  # every replica runs the rule on the whole batch; counted once
            per_example = [replicas.gather(g) for g in per_example]
            result = [replicas.first_replica(g) for g in aggregator(per_example)]
        else:
            result = aggregator(per_example)
    if private and "mask" in aux:
        from pergrad.privacy.dp_sgd import refuse_masked_output

        refuse_masked_output()
    if replicas.count(wrapper) > 1 and "mask" in aux:
        raise ValueError(
            "PerExampleModel cannot train a model with a masked output on several replicas: "
            "Keras divides a masked loss by the unmasked steps of the whole batch, which a "
            "replica's shard does not know. Give padding steps sample weight 0 instead of a "
            "mask, or train on one replica."
        )
    result = check_result(result, wrapper.model.trainable_variables, aggregator.name)
    if scale is not None and several:
        result = replicas.finite_everywhere(result)
    wrapper._keep_reports(aggregator.pop_reports())
    if share is not None:  # this replica's share of the single-device result
        result = [g * ops.cast(share, g.dtype) for g in result]
    _, regularization = problem.regularization(trainable_values)
    if regularization is not None:
        # Batch-level: once in the replicas' sum.
        regularization = [replicas.first_replica(r) for r in regularization]
        result = [g + ops.cast(r, g.dtype) for g, r in zip(result, regularization)]
    nan = ops.convert_to_tensor(float("nan"))
    # A weighted sum of per-example gradients is already non-finite when one
    # of them is (0 * inf is NaN), so only other kinds need the check, which
    # reads every per-example gradient. For a DP rule the non-finite examples
    # were zeroed above: a NaN update would reveal, without noise, that one was
    # in the batch.
    if aggregator.kind != STATISTICS and not private:
        finite = all_finite(per_example) if per_example is not None else aux["finite"]
        result = [ops.where(finite, g, ops.cast(nan, g.dtype)) for g in result]
    if scale is not None:  # LossScaleOptimizer expects scaled gradients
        result = [g * ops.cast(scale, g.dtype) for g in result]
    y_pred = aux["y_pred"]
    if "mask" in aux:
        compat.set_mask(tree.flatten(y_pred)[0], aux["mask"])
    return result, y_pred, aux["seeds"]
