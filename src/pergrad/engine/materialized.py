"""The materialized path: every example's gradient of every variable, ``(B,) + shape``.

The reference engine (docs/architecture.md, 'Engine paths'): one vectorized
backward pass of the single-example loss (:class:`PerExampleProblem`), exact for
any model. Coordinate and arbitrary rules need its output; statistics rules use
it when the statistics path cannot handle the model, or when asked to.
"""

from __future__ import annotations

from keras import ops

from pergrad.arguments import check_microbatch_size
from pergrad.engine.problem import cached_problem, check_model, compiled_once, map_optional


def _standalone_function(problem, microbatch_size):
    """``problem.compute`` as a compiled, pure function of the variable values and data.

    One per (trainable variables, non-trainable variables, microbatch size), in
    order and by identity (:func:`compiled_once`): a freeze or unfreeze selects
    another function. The backend's compiler keys on the input signature itself
    (TF: relaxed shapes, so a new batch size retraces at most once more; JAX: one
    trace per shape).
    """
    def pure(trainable_values, non_trainable_values, x, y, sample_weight):
        grads, aux = problem.compute(
            trainable_values, non_trainable_values, x, y, sample_weight, microbatch_size
        )
        return grads, aux["seeds"]

    return compiled_once(problem, "materialized", pure, microbatch_size)


def per_example_gradients(
    model,
    x,
    y=None,
    sample_weight=None,
    *,
    loss=None,
    training: bool = True,
    microbatch_size: int | None = None,
) -> list:
    """Each example's gradient of its own loss, for every trainable variable.

    Example i's loss ``L_i`` is defined so that ``mean_i L_i`` is the data loss
    Keras reduces over the batch (sample weights, multi-dimensional outputs,
    masks, several outputs with loss weights), hence ``mean_i g_i`` is the
    gradient plain ``fit()`` uses (without the weight regularizers, which belong
    to no example).

    Args:
        model: a built Keras model.
        x: the inputs, as the model takes them (a tensor, list or dict).
        y: the targets.
        sample_weight: optional per-example weights, shape ``(B,)``.
        loss: the loss; defaults to the model's compiled loss (the one of the
            latest ``compile``). A Keras loss with a mean-like, ``"sum"`` or no
            reduction (``None``: used like the default mean), a string or a function.
        training: whether the forward pass runs in training mode (dropout on).
        microbatch_size: compute the per-example pass in chunks of this many
            examples to bound peak memory; the results are the same.

    The per-example pass is compiled once per model state (loss, ``training``,
    which variables are trainable, ``microbatch_size``) and input signature:
    calling this in a loop does not retrace (TensorFlow, JAX), and changes to the
    model (a recompile, a freeze) are followed. Dropout seed states advance as
    in a training-mode forward pass.

    Returns:
        A list aligned with ``model.trainable_variables`` (the current ones); entry
        ``k`` has shape ``(B,) + model.trainable_variables[k].shape``. Dense
        tensors, without an autograd graph on torch.
    """
    microbatch_size = check_microbatch_size(microbatch_size)
    check_model(model, training)  # the flags may have changed since the last call
    problem = cached_problem(model, loss, training)
    problem.check_once(x, y)
    function = _standalone_function(problem, microbatch_size)
    x, y, sample_weight = (map_optional(ops.convert_to_tensor, t) for t in (x, y, sample_weight))
    grads, seeds = function(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        x,
        y,
        sample_weight,
    )
    for position, state in zip(problem.seed_positions, seeds):
        model.non_trainable_variables[position].assign(state)
    return grads
