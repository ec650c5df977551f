"""The statistics path: a statistics rule in one forward and one backward pass.

For a rule of kind ``"statistics"`` (the result is ``sum_i w_i g_i`` with
weights from per-example squared norms and, if asked, the Gram matrix), the
``B x P`` per-example gradients are never built (docs/architecture.md, 'The
statistics path'):

1. A *dry run* of one example's loss plans which layer calls to probe and with
   which rule (:mod:`pergrad.engine.plan`).
2. The forward pass of every example adds a zero probe at each planned call's
   probe point; one backward pass gives every call's input ``A`` and output
   gradient ``D`` (:mod:`pergrad.engine.capture`).
3. From ``A`` and ``D`` the rules give per-example squared norms, the Gram
   matrix and, once the aggregator's weights are known, ``sum_i w_i g_i``
   (:class:`pergrad.engine.layers.Layers`).

``mean`` and ``sum`` need no statistics: one ordinary backward pass of
``sum_i w_i c_i L_i`` with respect to the variables. This module runs the steps
and holds the public :func:`per_example_statistics`.
"""

from __future__ import annotations

from keras import ops

from pergrad import compat
from pergrad.aggregators.base import LOCAL_SUM, Aggregation, ExampleStatistics
from pergrad.backend import adapter
from pergrad.engine.capture import capture, grad_with_aux, has_convolutions, weighted_losses
from pergrad.engine.collectives import ONE_DEVICE
from pergrad.engine.layers import Layers
from pergrad.engine.materialized import per_example_gradients
from pergrad.engine.plan import Unsupported, cached_plan
from pergrad.engine.problem import cached_problem, check_model, compiled_once, map_optional
from pergrad.log import warn_once
from pergrad.tensors import as_float32

__all__ = [
    "Unsupported", "aggregate", "per_example_statistics", "prepare", "statistics",
    "statistics_or_materialized",
]


def statistics_or_materialized(on_statistics_path, on_materialized_path, owner, fallback: str,
                               refusal=None):
    """The one fallback from the statistics path to the materialized path.

    ``on_statistics_path()``; where the statistics path cannot take the model (it raises
    :class:`Unsupported`, found when its dry run plans the model), ``on_materialized_path()``
    (every per-example gradient) instead, logged once per ``owner`` and reason as
    ``"{fallback}: {reason}"``. ``refusal``: where given, ``refusal(reason)`` (an exception)
    is raised instead of falling back (the step's ``path="statistics"``). Used by the train
    step (``pergrad.training.step.run_engine``), :func:`per_example_statistics`, ``pergrad.scores``
    and ``pergrad.insight.diagnostics``; each says what it computes on either path.
    """
    try:
        return on_statistics_path()
    except Unsupported as error:
        if refusal is not None:
            raise refusal(str(error)) from error
        warn_once(owner, f"{fallback}: {error}")
    return on_materialized_path()


def _log_fallback(problem, plan):
    names = sorted(set(plan.fallback_names))
    if names:
        warn_once(problem, (
            f"statistics path: no layer rule for {names}; their per-example gradients are "
            "computed by a vectorized vjp of each layer alone (exact, slower; register a rule "
            "with pergrad.layer_rules.register_rule to speed them up)"
        ))


def finish_aux(problem, aux, non_trainable):
    """The ``aux`` a path returns: each example's ``loss`` times its scale ``c_i``,
    ``y_pred``, ``mask`` (masked outputs), the advanced ``seeds`` and, from a whole-batch
    pass, the ``batch_loss`` as Keras reduces it (``PerExampleProblem.batch_loss``)."""
    out = {"y_pred": aux["y_pred"]}
    if "batch_loss" in aux:
        out["batch_loss"] = aux["batch_loss"]
    if "loss" in aux:  # (not from a whole-batch pass; the step does not read it)
        scale = aux["example_scale"]
        out["loss"] = aux["loss"] if scale is None else aux["loss"] * ops.cast(scale, aux["loss"].dtype)
    if "mask" in aux:
        out["mask"] = aux["mask"]
    out["seeds"] = problem.advanced_seeds(non_trainable, aux["seeds"])
    return out


def _direct(problem, weights, trainable_values, batched, shared, batch_size):
    """``sum_i w_i g_i`` as one ordinary backward pass of ``sum_i w_i c_i L_i``."""

    def total(values):
        losses, aux = adapter().vectorized_call(
            lambda example, shared: problem.example_loss(values, example, shared), batched, shared,
            layout_hints=has_convolutions(problem.model),
        )
        return weighted_losses(problem, losses, aux, weights, batch_size), aux

    return grad_with_aux(total, list(trainable_values))


def _draws_random(problem, trainable_values, batched, shared) -> bool:
    """Whether the forward pass reads a seed state (from the dry run's plan)."""
    if not problem.seed_positions:
        return False
    try:
        return cached_plan(problem, trainable_values, batched, shared).draws_random
    except Unsupported:
        return True


def _batch_loss_gradient(problem, aggregator, trainable_values, non_trainable, batched, loss_scale,
                         batch_size, layers_plan=None):
    """``mean`` and ``sum`` of a model that draws no random numbers: the gradient of the
    batch loss Keras itself differentiates, which is ``mean_i g_i`` by the definition of
    ``L_i`` (docs/architecture.md, 'Per-example gradients'). With randomness, each
    example draws from its own stream (``_direct``), as on the other paths.

    With ``layers_plan`` (a plan whose calls one batched pass captures), the same backward
    pass also gives every planned call's ``D``: ``aux["layers"]`` holds the batch's
    :class:`~pergrad.engine.layers.Layers` (for ``pergrad.insight.diagnostics``)."""

    def total(values):
        loss, y_pred, masks, _ = problem.batch_loss(
            values, non_trainable, batched["x"], batched.get("y"), batched.get("sample_weight")
        )
        aux = {"y_pred": y_pred, "seeds": [], "batch_loss": loss}
        if masks:
            aux["mask"] = masks[0]
        scaled = loss if loss_scale is None else loss * ops.cast(loss_scale, loss.dtype)
        return ops.cast(scaled, "float32"), aux

    if layers_plan is None:
        result, aux = grad_with_aux(total, list(trainable_values))
    else:
        shared = {"non_trainable": non_trainable, "loss_scale": None}
        captured, deltas, aux, _ = capture(problem, layers_plan, trainable_values, batched, shared,
                                           batch_size, loss_scale=loss_scale, with_variables=True)
        result = aux.pop("gradients")
        aux["layers"] = _layers(problem, layers_plan, captured, deltas, trainable_values, non_trainable,
                                _unscale(loss_scale), True)
    factor = None  # (skipped when 1: every op costs on an eager backend)
    if loss_scale is not None:
        factor = 1.0 / ops.cast(loss_scale, "float32")
    if aggregator.distribution == LOCAL_SUM:  # weights 1, not 1 / B
        size = ops.cast(batch_size, "float32")
        factor = size if factor is None else factor * size
    variables = compat.trainable_variables(problem.model)
    if factor is not None:
        result = [g * ops.cast(factor, g.dtype) for g in result]
    if layers_plan is not None:  # mean_i g_i, which the diagnostics read
        if aggregator.distribution == LOCAL_SUM:
            size = ops.cast(batch_size, "float32")
            aux["batch_mean"] = [ops.cast(g, "float32") / size for g in result]
        else:  # (no op: each costs on an eager backend)
            aux["batch_mean"] = [as_float32(g) for g in result]
    stats = ExampleStatistics(ops.zeros((batch_size, len(variables)), "float32"))
    return Aggregation.of(aggregator.finalize(result, stats)), aux


def _unscale(example_loss_scale):
    """The factor that removes the loss scale from gradients, or ``None`` (no scale)."""
    if example_loss_scale is None:
        return None
    return 1.0 / ops.cast(example_loss_scale, "float32")


def layers_of(problem, trainable_values, batched, shared, batch_size, inverse):
    """Plan, forward and backward pass: the :class:`~pergrad.engine.layers.Layers` of this
    batch, and ``aux``; ``inverse`` removes the loss scale from ``D``."""
    plan = cached_plan(problem, trainable_values, batched, shared)
    _log_fallback(problem, plan)
    captured, deltas, aux, whole_batch = capture(problem, plan, trainable_values, batched, shared,
                                                  batch_size)
    layers = _layers(problem, plan, captured, deltas, trainable_values, shared["non_trainable"], inverse,
                     whole_batch)
    return layers, aux


def _layers(problem, plan, captured, deltas, trainable_values, non_trainable, inverse, whole_batch):
    model = problem.model
    trainable = compat.trainable_variables(model)
    context = (list(zip(compat.non_trainable_variables(model), non_trainable))
               + list(zip(trainable, trainable_values)))
    return Layers(plan, captured, deltas, list(trainable_values), trainable, inverse, whole_batch, context)


def prepare(problem, aggregator, non_trainable_values, x, y, sample_weight, loss_scale,
            collectives=ONE_DEVICE):
    """``(batched, B, non_trainable, shared, inverse loss scale)`` of a batch, the batch
    size checked against the rule's minimum where it is static."""
    batched, batch_size, non_trainable, example_loss_scale = problem.batched_inputs(
        non_trainable_values, x, y, sample_weight, loss_scale, collectives=collectives
    )
    if isinstance(batch_size, int):
        aggregator.check_batch_size(batch_size)
    shared = {"non_trainable": non_trainable, "loss_scale": example_loss_scale}
    return batched, batch_size, non_trainable, shared, _unscale(example_loss_scale)


def _whole_batch_plan(problem, trainable_values, batched, shared):
    """The plan, when one batched pass captures every planned call (else ``None``)."""
    try:
        plan = cached_plan(problem, trainable_values, batched, shared)
    except Unsupported:
        return None
    return plan if plan.whole_batch else None


def aggregate(problem, aggregator, trainable_values, non_trainable_values, x, y=None,
              sample_weight=None, loss_scale=None, collectives=ONE_DEVICE, keep_layers=False, units=None):
    """A statistics rule's result over the batch, without per-example gradients of the model.

    Args and returns as :func:`pergrad.engine.chunked.aggregate`: ``(result, aux)``,
    ``result`` the rule's :class:`~pergrad.aggregators.base.Aggregation` (its gradients
    aligned with the trainable variables, unscaled), ``aux`` with each
    example's ``loss``, ``y_pred``, ``mask`` (masked outputs) and advanced ``seeds``.
    ``collectives`` (:class:`~pergrad.engine.collectives.Collectives`): the weights come
    from the statistics of the batch the rule sees (``gather``: the norms; for a Gram
    rule, ``whole_batch``: each layer's ``A`` and ``D``) and ``result`` is the sum over
    this batch's examples (``own_rows``).
    With ``keep_layers``, ``aux["layers"]`` holds the batch's
    :class:`~pergrad.engine.layers.Layers` where the rule's pass made them (a rule that
    reads statistics; ``mean`` and ``sum`` where one batched pass captures every call).
    Raises :class:`Unsupported` when the model needs the materialized path.
    """
    batched, batch_size, non_trainable, shared, inverse = prepare(
        problem, aggregator, non_trainable_values, x, y, sample_weight, loss_scale, collectives
    )
    variables = compat.trainable_variables(problem.model)
    # Every example weighs the same (reads_statistics): Keras's own batch gradient.
    if not aggregator.reads_statistics and not _draws_random(problem, trainable_values, batched, shared):
        plan = _whole_batch_plan(problem, trainable_values, batched, shared) if keep_layers else None
        return _batch_loss_gradient(problem, aggregator, trainable_values, non_trainable, batched,
                                    loss_scale, batch_size, plan)

    if not aggregator.reads_statistics:
        stats = ExampleStatistics(ops.zeros((collectives.whole_size(batch_size), len(variables)), "float32"))
        weights = collectives.own_rows(aggregator.example_weights(stats), batch_size)
        grads, aux = _direct(problem, weights, trainable_values, batched, shared, batch_size)
        if inverse is not None:
            grads = [g * ops.cast(inverse, g.dtype) for g in grads]
        result = [ops.cast(g, v.dtype) for g, v in zip(grads, variables)]
        return Aggregation.of(aggregator.finalize(result, stats)), finish_aux(problem, aux, non_trainable)
    layers, aux = layers_of(problem, trainable_values, batched, shared, batch_size, inverse)
    norms, scale = layers.squared_norms(batch_size)
    if getattr(aggregator, "differentially_private", False):
        # A DP rule's non-finite examples contribute nothing (as on the materialized
        # path: zero_non_finite_examples); a NaN update would reveal them.
        keep = ExampleStatistics(norms, scale=scale).finite
        layers.zero_rows(keep)
        norms = ops.where(keep[:, None], norms, ops.zeros_like(norms))
        if scale is not None:
            scale = ops.where(keep[:, None], scale, ops.ones_like(scale))
    norms, scale = collectives.gather(norms), map_optional(collectives.gather, scale)
    gram = collectives.whole_batch(layers).gram(ops.shape(norms)[0]) if aggregator.needs_gram else None
    stats = ExampleStatistics(norms, gram, scale=scale, units=units)
    weights = ops.stop_gradient(aggregator.example_weights(stats))
    result = layers.weighted_sums(collectives.own_rows(weights, batch_size), variables)
    out = finish_aux(problem, aux, non_trainable)
    if keep_layers:
        out["layers"] = layers
    return Aggregation.of(aggregator.finalize(result, stats)), out


def statistics(problem, trainable_values, non_trainable_values, x, y=None, sample_weight=None,
               gram: bool = False):
    """``(ExampleStatistics, aux)`` of the batch's per-example gradients, from the layers.

    Raises :class:`Unsupported` when the model needs the materialized path.
    """
    batched, batch_size, non_trainable, _ = problem.batched_inputs(non_trainable_values, x, y, sample_weight)
    shared = {"non_trainable": non_trainable, "loss_scale": None}
    layers, aux = layers_of(problem, trainable_values, batched, shared, batch_size, _unscale(None))
    norms, scale = layers.squared_norms(batch_size)
    stats = ExampleStatistics(norms, layers.gram(batch_size) if gram else None, scale=scale)
    return stats, finish_aux(problem, aux, non_trainable)


def _statistics_function(problem, gram: bool):
    """``statistics`` compiled once per (trainable variables, non-trainable variables, gram)."""
    def pure(trainable_values, non_trainable_values, x, y, sample_weight):
        stats, aux = statistics(problem, trainable_values, non_trainable_values, x, y,
                                sample_weight, gram=gram)
        return stats.scaled_squared_norms, stats.scale, stats.gram, aux["seeds"]

    return compiled_once(problem, "statistics", pure, gram)


def per_example_statistics(model, x, y=None, sample_weight=None, *, loss=None, training: bool = True,
                           gram: bool = False) -> ExampleStatistics:
    """Each example's squared gradient norms (and the Gram matrix), without its gradient.

    The statistics of the gradients :func:`pergrad.per_example_gradients` returns
    (same loss definition, arguments and dropout seeds), computed by the
    statistics path: from each layer's input and output gradient, in one
    backward pass, without a ``B x P`` tensor. For models the statistics path
    cannot handle (the reason is logged), from the materialized gradients.

    Returns:
        :class:`~pergrad.aggregators.ExampleStatistics`: ``squared_norms`` of shape
        ``(B, V)`` (one column per trainable variable, in
        ``model.trainable_variables`` order; ``sqrt(sum(axis=1))`` is the flat
        norm) and, with ``gram=True``, ``gram`` of shape ``(B, B)``.
    """
    check_model(model, training)
    problem = cached_problem(model, loss, training)
    problem.check_once(x, y)
    x, y, sample_weight = (map_optional(ops.convert_to_tensor, t) for t in (x, y, sample_weight))
    values = [v.value for v in model.trainable_variables]
    states = [v.value for v in model.non_trainable_variables]

    def on_statistics_path():
        norms, scale, gram_matrix, seeds = _statistics_function(problem, gram)(
            values, states, x, y, sample_weight
        )
        for position, state in zip(problem.seed_positions, seeds):
            model.non_trainable_variables[position].assign(state)
        return ExampleStatistics(norms, gram_matrix, scale=scale)

    def on_materialized_path():  # (per_example_gradients advances the seed states)
        grads = per_example_gradients(model, x, y, sample_weight, loss=loss, training=training)
        return ExampleStatistics.from_gradients(grads, gram=gram)

    return statistics_or_materialized(on_statistics_path, on_materialized_path, problem,
                                      "per_example_statistics uses the materialized path")
