"""The per-example training step, written once for every backend (``keras.ops`` only).

``aggregated_gradients`` turns one batch into the gradients the optimizer
applies, as a short pipeline of named stages: :func:`run_engine` (the engine
path: statistics, chunked or materialized), :func:`check_output_mask` (refusals
that need the traced forward pass), the rule on materialized per-example
gradients, :func:`add_batch_term` (the rule's batch term, state totals and
diagnostics) and :func:`post_process` (the non-finite rule, the regularizer, the
loss scale). Whatever several devices change is asked of one collectives object
(``pergrad.distributed.training.collectives``: none on one device); the rules
return local quantities. The backend-specific ``train_step`` glue that calls it
lives in ``pergrad.training.trainers``.
"""

from __future__ import annotations

import keras
from keras import ops, tree

from pergrad import compat
from pergrad.aggregators.base import (
    STATISTICS,
    UNIT_IDS,
    UNIT_INPUTS,
    check_result,
    zero_non_finite_examples,
)
from pergrad.distributed import training
from pergrad.engine import chunked, statistics, streaming
from pergrad.engine.paths import CHUNKED_PATH, STATISTICS_PATH, engine_path
from pergrad.tensors import all_finite


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


def loss_scale(optimizer, variables):
    """A ``LossScaleOptimizer``'s current scale (built on first use), else ``None``."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if not optimizer.built:  # TF's fit() builds it lazily, in the first step
            optimizer.build(variables)
        return optimizer.dynamic_scale
    return None


def run_engine(wrapper, problem, collectives, loss_scale, trainable_values, non_trainable_values, x,
               y, sample_weight, units=None):
    """``(result, per_example, aux)``: the engine path's result (the rule's
    :class:`~pergrad.aggregators.base.Aggregation`; ``None`` on the materialized path) or
    the per-example gradients (``None`` on the others; a DP rule's non-finite examples
    zeroed), and the batch's ``aux`` (``y_pred``, ``seeds``, ``mask``, ...); ``problem``:
    the wrapper's (``wrapper.per_example_problem()``, derived once a step); ``loss_scale``:
    the backward pass's (``collectives.engine_loss_scale``); ``units``: the batch's unit
    ids, for a rule that reads them."""
    aggregator = wrapper.aggregator
    path = engine_path(aggregator, wrapper.engine_path, wrapper.microbatch_size)
    inputs = (problem, aggregator, trainable_values, non_trainable_values, x, y, sample_weight)

    def on_statistics_path():
        if chunked.supports(aggregator):
            result, aux = statistics.aggregate(
                *inputs, loss_scale=loss_scale, collectives=collectives,
                keep_layers=wrapper.diagnostics_request() is not None, units=units,
            )
        else:
            result, aux = streaming.aggregate(
                *inputs, loss_scale=loss_scale, microbatch_size=wrapper.microbatch_size,
                collectives=collectives,
            )
        return result, None, aux

    def on_materialized_path():
        per_example, aux = problem.compute(
            trainable_values, non_trainable_values, x, y, sample_weight, wrapper.microbatch_size,
            loss_scale=loss_scale, collectives=collectives,
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
        result, aux = chunked.aggregate(*inputs, wrapper.microbatch_size, loss_scale=loss_scale,
                                        collectives=collectives, units=units)
        return result, None, aux
    return on_materialized_path()


def check_output_mask(wrapper, problem, collectives, aux) -> None:
    """Refuses a masked output (``aux["mask"]``: known once the forward pass is traced,
    before any update) or a loss that masks its values (``ignore_class``: the same
    normalization by the whole batch) for a DP rule and where ``collectives`` cannot."""
    if "mask" not in aux and not problem.loss_masks:
        return
    if wrapper.aggregator.differentially_private:
        from pergrad.privacy.dp_sgd import refuse_masked_output

        refuse_masked_output()
    collectives.check_masked_output()


def add_batch_term(wrapper, collectives, outcome) -> list:
    """The rule's result (its :class:`~pergrad.aggregators.base.Aggregation`) with its
    batch term (DP noise) added once, its state updated from its batch totals, and its
    diagnostics kept for the logs, over the whole batch: a rule that aggregated a part of
    it reports sums and counts, which ``collectives.part_sum`` adds up."""
    result, reports = outcome.finish(collectives.part_sum, collectives.once)
    wrapper.keep_reports(reports)
    return result


def post_process(wrapper, problem, collectives, loss_scale, result, per_example, aux,
                 trainable_values) -> list:
    """The checked result made NaN when an example's gradient is not finite (not for DP
    rules), this device's part of it, plus the regularizers' gradient (once) and times
    the loss scale."""
    aggregator = wrapper.aggregator
    result = check_result(result, compat.trainable_variables(wrapper.model), aggregator.name)
    result = collectives.own_part(result, loss_scale is not None)
    _, regularization = problem.regularization(trainable_values)
    if regularization is not None:  # batch-level
        result = [g + ops.cast(collectives.once(r), g.dtype) for g, r in zip(result, regularization)]
    # A weighted sum of per-example gradients is already non-finite when one
    # of them is (0 * inf is NaN), so only other kinds need the check, which
    # reads every per-example gradient. For a DP rule the non-finite examples
    # were zeroed: a NaN update would reveal, without noise, that one was in
    # the batch.
    if aggregator.kind != STATISTICS and not aggregator.differentially_private:
        finite = all_finite(per_example) if per_example is not None else aux["finite"]
        nan = ops.convert_to_tensor(float("nan"))
        result = [ops.where(finite, g, ops.cast(nan, g.dtype)) for g in result]
    if loss_scale is not None:  # LossScaleOptimizer expects scaled gradients
        result = [g * ops.cast(loss_scale, g.dtype) for g in result]
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
    scale = loss_scale(wrapper.optimizer, compat.trainable_variables(wrapper.model))
    collectives = training.collectives(wrapper, x, scale)
    result, per_example, aux = run_engine(
        wrapper, problem, collectives, collectives.engine_loss_scale(scale), trainable_values,
        non_trainable_values, x, y, sample_weight, units
    )
    check_output_mask(wrapper, problem, collectives, aux)
    if result is None:  # the rule on the materialized per-example gradients
        result = collectives.apply_rule(aggregator, per_example, units)
    result = add_batch_term(wrapper, collectives, result)
    result = post_process(wrapper, problem, collectives, scale, result, per_example, aux,
                          trainable_values)
    request = wrapper.diagnostics_request()
    if request is not None:  # pergrad.insight.diagnostics: logged with the rule's diagnostics
        from pergrad.insight.diagnostics import batch_values

        values = batch_values(request, problem, trainable_values, non_trainable_values, x, y,
                              sample_weight, per_example, aux.get("layers"), aux.get("batch_mean"))
        wrapper.keep_reports({**(wrapper.take_reports() or {}), **values})
    y_pred = aux["y_pred"]
    if "mask" in aux:
        compat.set_mask(tree.flatten(y_pred)[0], aux["mask"])
    return result, y_pred, aux["seeds"], logged_loss(wrapper, problem, collectives, aux)


def logged_loss(wrapper, problem, collectives, aux):
    """The loss Keras's ``compute_loss`` gives for the batch's logs, where the engine's
    whole-batch pass already computed that number (``aux["batch_loss"]``), else ``None``.

    The same number when the wrapper's ``compute_loss`` is Keras's own, the pass's loss is
    the wrapper's compiled loss (not a replacement of an unreduced one), that loss updates
    no per-output trackers (one output), the model adds no losses of its own
    (regularizers) and the collectives keep it (one device: no ``1 / R`` to undo).
    Derived on every step: each of these may change.
    """
    loss = aux.get("batch_loss")
    if loss is None or type(wrapper).compute_loss is not keras.Model.compute_loss:
        return None
    compile_loss = compat.compiled_loss(wrapper)
    if problem.compile_loss is not compile_loss or compile_loss.metrics:
        return None
    # Keras adds `losses`: the trainable weights' regularizers (data losses are refused).
    if any(getattr(v, "regularizer", None) is not None for v in wrapper.trainable_weights):
        return None
    return collectives.logged_loss(loss)
