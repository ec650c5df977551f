"""The per-example training step, written once for every backend (``keras.ops`` only).

``aggregated_gradients`` turns one batch into the gradients the optimizer
applies, as a short pipeline of named stages: :func:`replica_plan` (what this
replica's part is when several each run the step), :func:`run_engine` (the
engine path: statistics, chunked or materialized), :func:`check_output_mask`
(refusals that need the traced forward pass), :func:`apply_rule` (the rule on
materialized per-example gradients, as the plan says), :func:`combine_replicas`
(the rule's batch term and diagnostics, once over the replicas) and
:func:`post_process` (the non-finite rule, the replica's share, the regularizer,
the loss scale). Every collective is ``pergrad.replicas``'s; the rules return
local quantities. The backend-specific ``train_step`` glue that calls it lives
in ``pergrad.trainers``.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
from keras import ops, tree

from pergrad import compat, processes, replicas
from pergrad.aggregators.base import (
    LOCAL_MEAN,
    STATISTICS,
    UNIT_IDS,
    UNIT_INPUTS,
    WHOLE_BATCH,
    Aggregation,
    check_result,
    zero_non_finite_examples,
)
from pergrad.engine import chunked, statistics, streaming
from pergrad.tensors import all_finite

#: The paths ``engine_path`` chooses between.
STATISTICS_PATH, CHUNKED_PATH, MATERIALIZED_PATH = "statistics", "chunked", "materialized"


def check_units(aggregator, units) -> None:
    """Raises unless the batch carries unit ids
    (:func:`~pergrad.aggregators.base.split_units`) exactly when the rule reads them
    (:attr:`~pergrad.aggregators.Aggregator.reads_units`)."""
    name = f"{aggregator.name!r} ({type(aggregator).__name__})"
    if aggregator.reads_units and units is None:
        raise ValueError(
            f"Aggregator {name} clips each user's summed gradient and needs the user id of "
            "every example: train on pergrad.privacy.UserSampler(x, y, users=ids, ...), or "
            f"pass x as {{{UNIT_INPUTS!r}: x, {UNIT_IDS!r}: ids}}."
        )
    if units is not None and not aggregator.reads_units:
        raise ValueError(
            f"The batch carries user ids ({UNIT_IDS!r}, e.g. from pergrad.privacy.UserSampler) "
            f"but aggregator {name} does not read them: it would bound each example's "
            "influence, not each user's. Use pergrad.privacy.user_level_dp_gaussian, or "
            "pergrad.privacy.PoissonSampler for example-level DP."
        )


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
    refusal = processes.replica_refusal(aggregator)  # several workers: one Python process each
    if refusal:
        return refusal
    if aggregator.reads_units:
        return (
            f"{type(aggregator).__name__} clips each user's summed gradient, and a "
            "replica's shard may hold part of a user's examples"
        )
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
    problem = wrapper.per_example_problem()
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


class ReplicaPlan(NamedTuple):
    """What this replica's step computes (``pergrad.replicas``); on one device, the whole."""

    #: Whether several replicas each run the step on their shard of the batch.
    several: bool
    #: Whether the rule runs on the whole batch, gathered (its ``distribution`` needs it).
    gathered: bool
    #: ``B_r / B``, this replica's share of a mean (``LOCAL_MEAN`` rules), else ``None``.
    share: object
    #: The optimizer's loss scale (``None`` without a ``LossScaleOptimizer``).
    loss_scale: object
    #: The scale the backward pass uses: ``B_r / B`` of the loss scale, so that its float16
    #: values are those of one device (a replica's mean loss divides by ``B_r``).
    engine_scale: object


def replica_plan(wrapper, x) -> ReplicaPlan:
    """The plan of ``wrapper``'s step on batch ``x``, as its rule's ``distribution`` says:
    on several replicas each aggregates its shard, scaled by its share of the batch
    unless the rule sums, or the rule runs on the whole batch, gathered."""
    aggregator = wrapper.aggregator
    scale = loss_scale(wrapper.optimizer, compat.trainable_variables(wrapper.model))
    several = replicas.count(wrapper) > 1
    gathered = several and aggregator.distribution == WHOLE_BATCH
    divides = several and aggregator.distribution == LOCAL_MEAN
    share, engine_scale = None, scale
    if divides or (several and scale is not None):
        fraction = replicas.local_fraction(ops.shape(tree.flatten(x)[0])[0])  # B_r / B
        if divides:
            share = fraction
        if scale is not None:
            engine_scale = scale * fraction
    return ReplicaPlan(several, gathered, share, scale, engine_scale)


def run_engine(wrapper, problem, plan: ReplicaPlan, trainable_values, non_trainable_values, x, y,
               sample_weight, units=None):
    """``(result, per_example, aux)``: the engine path's result (the rule's
    :class:`~pergrad.aggregators.base.Aggregation`; ``None`` on the materialized path) or
    the per-example gradients (``None`` on the others; a DP rule's non-finite examples
    zeroed), and the batch's ``aux`` (``y_pred``, ``seeds``, ``mask``, ...); ``problem``:
    the wrapper's (``wrapper.per_example_problem()``, derived once a step); ``units``: the
    batch's unit ids, for a rule that reads them."""
    aggregator = wrapper.aggregator
    path = engine_path(aggregator, wrapper.engine_path, wrapper.microbatch_size)
    inputs = (problem, aggregator, trainable_values, non_trainable_values, x, y, sample_weight)

    def on_statistics_path():
        if chunked.supports(aggregator):
            result, aux = statistics.aggregate(
                *inputs, loss_scale=plan.engine_scale, gathered=plan.gathered,
                keep_layers=wrapper.diagnostics_request() is not None, units=units,
            )
        else:
            result, aux = streaming.aggregate(
                *inputs, loss_scale=plan.engine_scale, microbatch_size=wrapper.microbatch_size,
                gathered=plan.gathered,
            )
        return result, None, aux

    def on_materialized_path():
        per_example, aux = problem.compute(
            trainable_values, non_trainable_values, x, y, sample_weight, wrapper.microbatch_size,
            loss_scale=plan.engine_scale,
        )
        if aggregator.differentially_private:
            per_example = zero_non_finite_examples(per_example)
        return None, per_example, aux

    if path == STATISTICS_PATH:
        name = wrapper.model.name

        def refusal(reason):
            return ValueError(
                f"The statistics path cannot train model {name!r}: {reason}. "
                "Use path='auto' (it then takes the materialized path) or 'materialized'."
            )

        return statistics.statistics_or_materialized(
            on_statistics_path, on_materialized_path, wrapper,
            f"model {name!r} takes the materialized path (every per-example gradient)",
            refusal=refusal if wrapper.engine_path == STATISTICS_PATH else None,
        )
    if path == CHUNKED_PATH:
        # Accumulated chunk by chunk: no (B, ...) per-example tensor exists. A DP
        # rule's non-finite examples are zeroed in every chunk.
        result, aux = chunked.aggregate(*inputs, wrapper.microbatch_size, loss_scale=plan.engine_scale,
                                        units=units)
        return result, None, aux
    return on_materialized_path()


def check_output_mask(wrapper, problem, aux) -> None:
    """Refuses a masked output (``aux["mask"]``: known once the forward pass is traced,
    before any update) or a loss that masks its values (``ignore_class``: the same
    normalization by the whole batch) for a DP rule and on several replicas."""
    if "mask" not in aux and not problem.loss_masks:
        return
    if wrapper.aggregator.differentially_private:
        from pergrad.privacy.dp_sgd import refuse_masked_output

        refuse_masked_output()
    if replicas.count(wrapper) > 1:
        raise ValueError(
            "PerExampleModel cannot train a model with a masked output on several replicas: "
            "Keras divides a masked loss by the unmasked steps of the whole batch, which a "
            "replica's shard does not know. Give padding steps sample weight 0 instead of a "
            "mask, or train on one replica."
        )


def apply_rule(wrapper, plan: ReplicaPlan, per_example, units=None) -> Aggregation:
    """The rule's :class:`~pergrad.aggregators.base.Aggregation` of the per-example
    gradients, as ``plan`` says; on several replicas the whole batch's result is counted
    once (replica 0's), its batch term left to :func:`combine_replicas`."""
    aggregator = wrapper.aggregator
    if plan.gathered and aggregator.group_count() == replicas.count(wrapper):
        # One group per replica: only the R groups' results are exchanged.
        outcome = Aggregation.of(replicas.combine_groups(aggregator, per_example))
        return outcome.with_gradients([replicas.first_replica(g) for g in outcome.gradients])
    if plan.gathered:  # every replica runs the rule on the whole batch
        per_example = [replicas.gather(g) for g in per_example]
        outcome = aggregator.aggregation(per_example)
        return outcome.with_gradients([replicas.first_replica(g) for g in outcome.gradients])
    return aggregator.aggregation(per_example, units=units)


def combine_replicas(wrapper, plan: ReplicaPlan, outcome: Aggregation) -> list:
    """The rule's result with its batch term (DP noise) added once over the replicas, its
    state updated from its batch totals, and its diagnostics kept for the logs, over the
    whole batch: a rule that aggregated its shard reports sums and counts, which are summed
    over the replicas."""
    local = plan.several and not plan.gathered
    result, reports = outcome.finish(replicas.global_sum if local else None, replicas.first_replica)
    wrapper.keep_reports(reports)
    return result


def post_process(wrapper, problem, plan: ReplicaPlan, result, per_example, aux, trainable_values) -> list:
    """The checked result made NaN when an example's gradient is not finite (not for DP
    rules), scaled to this replica's share, plus the regularizers' gradient (once over
    the replicas) and times the loss scale."""
    aggregator = wrapper.aggregator
    result = check_result(result, compat.trainable_variables(wrapper.model), aggregator.name)
    scale = plan.loss_scale
    if scale is not None and plan.several:
        result = replicas.finite_everywhere(result)
    if plan.share is not None:  # this replica's share of the single-device result
        result = [g * ops.cast(plan.share, g.dtype) for g in result]
    _, regularization = problem.regularization(trainable_values)
    if regularization is not None:
        # Batch-level: once in the replicas' sum.
        regularization = [replicas.first_replica(r) for r in regularization]
        result = [g + ops.cast(r, g.dtype) for g, r in zip(result, regularization)]
    # A weighted sum of per-example gradients is already non-finite when one
    # of them is (0 * inf is NaN), so only other kinds need the check, which
    # reads every per-example gradient. For a DP rule the non-finite examples
    # were zeroed: a NaN update would reveal, without noise, that one was in
    # the batch.
    if aggregator.kind != STATISTICS and not aggregator.differentially_private:
        finite = all_finite(per_example) if per_example is not None else aux["finite"]
        nan = ops.convert_to_tensor(float("nan"))
        result = [ops.where(finite, g, ops.cast(nan, g.dtype)) for g in result]
    if scale is not None:  # LossScaleOptimizer expects scaled gradients
        result = [g * ops.cast(scale, g.dtype) for g in result]
    return result


def aggregated_gradients(wrapper, trainable_values, non_trainable_values, x, y, sample_weight,
                         units=None):
    """Returns ``(gradients, y_pred, new_seed_states, logged_loss)`` for one batch;
    ``logged_loss``: :func:`logged_loss` (``None``: the train step computes it).

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
        units: each example's unit id (``(B,)`` integers,
            :func:`~pergrad.aggregators.base.split_units`), for a rule that
            :attr:`~pergrad.aggregators.Aggregator.reads_units`; else ``None``.
    """
    aggregator = wrapper.aggregator
    check_units(aggregator, units)
    problem = wrapper.per_example_problem()
    plan = replica_plan(wrapper, x)
    result, per_example, aux = run_engine(
        wrapper, problem, plan, trainable_values, non_trainable_values, x, y, sample_weight, units
    )
    check_output_mask(wrapper, problem, aux)
    if result is None:
        result = apply_rule(wrapper, plan, per_example, units)
    result = combine_replicas(wrapper, plan, result)
    result = post_process(wrapper, problem, plan, result, per_example, aux, trainable_values)
    request = wrapper.diagnostics_request()
    if request is not None:  # pergrad.diagnostics: logged with the rule's diagnostics
        from pergrad.diagnostics import batch_values

        values = batch_values(request, problem, trainable_values, non_trainable_values, x, y,
                              sample_weight, per_example, aux.get("layers"), aux.get("batch_mean"))
        wrapper.keep_reports({**(wrapper.take_reports() or {}), **values})
    y_pred = aux["y_pred"]
    if "mask" in aux:
        compat.set_mask(tree.flatten(y_pred)[0], aux["mask"])
    return result, y_pred, aux["seeds"], logged_loss(wrapper, problem, aux)


def logged_loss(wrapper, problem, aux):
    """The loss Keras's ``compute_loss`` gives for the batch's logs, where the engine's
    whole-batch pass already computed that number (``aux["batch_loss"]``), else ``None``.

    The same number when the wrapper's ``compute_loss`` is Keras's own, the pass's loss is
    the wrapper's compiled loss (not a replacement of an unreduced one), that loss updates
    no per-output trackers (one output), the model adds no losses of its own
    (regularizers) and one replica trains (no ``1 / R`` to undo). Derived on every step:
    each of these may change.
    """
    loss = aux.get("batch_loss")
    if loss is None or type(wrapper).compute_loss is not keras.Model.compute_loss:
        return None
    compile_loss = compat.compiled_loss(wrapper)
    if problem.compile_loss is not compile_loss or compile_loss.metrics:
        return None
    if replicas.count(wrapper) > 1:
        return None
    # Keras adds `losses`: the trainable weights' regularizers (data losses are refused).
    if any(getattr(v, "regularizer", None) is not None for v in wrapper.trainable_weights):
        return None
    return loss
