"""The statistics path's forward and backward pass: every planned call's ``A`` and ``D``.

The forward pass of every example (vectorized, as the materialized path's) adds a
zero *probe* at each planned call's probe point (:mod:`pergrad.engine.plan`) and
returns the call's input ``A``. One backward pass of ``sum_i c_i L_i`` with respect
to the probes gives every call's output gradient ``D`` (``c_i``: the example's
scale, docs/architecture.md, 'Per-example gradients').
"""

from __future__ import annotations

from keras import ops, tree

from pergrad import compat
from pergrad.backend import NotVectorizable, adapter, optional_kernel
from pergrad.engine.plan import Interceptor, Unsupported, is_tensor
from pergrad.tensors import cast, float_count, is_float


def capture(problem, plan, trainable_values, batched, shared, batch_size, loss_scale=None,
            with_variables=False):
    """The forward pass with probes and the one backward pass: ``(captured, deltas, aux, batched)``.

    For a model that draws no random numbers and whose planned calls all have
    rules and outputs that follow the batch (``plan.whole_batch``), one batched
    forward pass (no vectorized map): ``B`` times the batch loss Keras reduces is
    ``sum_i c_i L_i`` (the definition of ``L_i``), so its gradient at the probes is
    every example's ``D``, as the vectorized pass gives it. Otherwise each example
    runs alone (its own random stream; the fallback needs each example's call as it
    was; an output shared by the batch needs each example's own probe).
    ``batched`` says which: captured tensors and deltas then have no batch-of-one axis.

    With ``with_variables`` (``plan.whole_batch`` only), the same backward pass is that
    of the batch loss times ``loss_scale``, Keras's own, differentiated with respect to
    the variables too: ``aux["gradients"]`` holds that gradient (the probes add zeros and
    pass their output gradient on unchanged, so it is the plain one), and the deltas
    are the probes' gradients times ``B`` (``loss_scale`` left in them).
    """
    model = problem.model
    whole_batch = plan.whole_batch

    def probe_zeros(spec):
        shape, dtype = spec
        return ops.zeros((batch_size,) + tuple(shape[1:] if whole_batch else shape), dtype=dtype)

    # torch differentiates with respect to the calls' outputs themselves (the probes'
    # zeros and additions are full-size ops): where one batched pass runs and every call
    # has a rule, whose forward returns a tensor of its own computation.
    marking = (whole_batch and not any(call.fallback for call in plan.calls)
               and optional_kernel("grad_with_aux_at_outputs") is not None)
    probes = [] if marking else [[probe_zeros(spec) for spec in call.specs] for call in plan.calls]
    # (the probes' passes: the values as constants, for no gradient of theirs)
    constants = [] if marking else [ops.stop_gradient(v) for v in trainable_values]

    def intercepted(own_probes, captured, marked=None):
        def handler(index, layer, original, args, kwargs):
            position = plan.by_index.get(index)
            if position is None:
                return original(*args, **kwargs)
            call = plan.calls[position]
            if marked is not None:  # (no fallback call)
                out, captured[position] = call.rule.forward_and_inputs(
                    layer, original, lambda t: marked.setdefault(position, t), args, kwargs)
                return out
            probe = own_probes[position]
            if not call.fallback:
                out, captured[position] = call.rule.forward_and_inputs(
                    layer, original, lambda t: t + probe[0], args, kwargs)
                return out
            flat = tree.flatten((args, kwargs))
            captured[position] = [leaf for leaf in flat if is_tensor(leaf)]
            out = original(*args, **kwargs)
            leaves, pending = tree.flatten(out), list(probe)
            leaves = [leaf + pending.pop(0) if is_tensor(leaf) and is_float(leaf) else leaf
                      for leaf in leaves]
            return tree.pack_sequence_as(out, leaves)

        return Interceptor(model, handler)

    def example_loss(example, shared):
        captured = [None] * len(plan.calls)
        with intercepted(example["probes"], captured):
            loss, aux = problem.example_loss(constants, example["example"], shared)
        aux["captured"] = captured
        return loss, aux

    counts = [len(group) for group in probes]

    def grouped(flat):
        flat, groups = list(flat), []
        for count in counts:
            groups.append(flat[:count])
            flat = flat[count:]
        return groups

    def total(probe_values):
        losses, aux = adapter().vectorized_call(
            example_loss, {"example": batched, "probes": grouped(probe_values)}, shared,
            layout_hints=has_convolutions(model),
        )
        return weighted_losses(problem, losses, aux, None, batch_size), aux

    def batch_pass(values, probe_values, marked=None):
        captured = [None] * len(plan.calls)
        with intercepted(grouped(probe_values), captured, marked):
            loss, y_pred, masks, _ = problem.batch_loss(
                values, shared["non_trainable"], batched["x"], batched.get("y"),
                batched.get("sample_weight"),
            )
        aux = {"y_pred": y_pred, "seeds": [], "captured": captured, "batch_loss": loss}
        if masks:
            aux["mask"] = masks[0]
        return loss, aux

    def batch_total(probe_values):
        loss, aux = batch_pass(constants, probe_values)
        factor = ops.cast(batch_size, "float32")
        if shared.get("loss_scale") is not None:
            factor = factor * ops.cast(shared["loss_scale"], "float32")
        return ops.cast(loss, "float32") * factor, aux

    flat_probes = [p for group in probes for p in group]
    if marking:
        return _capture_marked(plan, batch_pass, trainable_values, shared, batch_size, loss_scale,
                               with_variables)
    if with_variables:
        count = len(trainable_values)

        def joint_total(params):  # as statistics._batch_loss_gradient's, with the probes
            loss, aux = batch_pass(params[:count], params[count:])
            scaled = loss if loss_scale is None else loss * ops.cast(loss_scale, loss.dtype)
            return ops.cast(scaled, "float32"), aux

        gradients, aux = grad_with_aux(joint_total, list(trainable_values) + flat_probes)
        aux["gradients"] = gradients[:count]
        size = ops.cast(batch_size, "float32")
        deltas = [d * ops.cast(size, d.dtype) for d in gradients[count:]]
        return aux.pop("captured"), grouped(deltas), aux, whole_batch
    deltas, aux = grad_with_aux(batch_total if whole_batch else total, flat_probes)
    return aux.pop("captured"), grouped(deltas), aux, whole_batch


def _capture_marked(plan, batch_pass, trainable_values, shared, batch_size, loss_scale,
                    with_variables):
    """:func:`capture`'s result with every call's ``D`` the gradient with respect to its
    output (torch's ``grad_with_aux_at_outputs``): the probes' backward pass (a probe adds
    zeros and passes its output gradient on), and the same values and scales."""
    factor = float_count(batch_size)

    def total(params):
        marked = {}
        loss, aux = batch_pass(params, [], marked)
        outputs = [marked.get(position) for position in range(len(plan.calls))]
        if with_variables:  # the batch loss times loss_scale (Keras's own gradient)
            scaled = loss if loss_scale is None else loss * ops.cast(loss_scale, loss.dtype)
            return cast(scaled, "float32"), aux, outputs
        scaled = factor if shared.get("loss_scale") is None else (
            factor * ops.cast(shared["loss_scale"], "float32"))
        return cast(loss, "float32") * scaled, aux, outputs

    gradients, deltas, aux = adapter().grad_with_aux_at_outputs(total, list(trainable_values),
                                                                with_variables)
    for position, (call, delta) in enumerate(zip(plan.calls, deltas)):
        if delta is None:  # a planned call that did not run: no gradient reaches it
            shape, dtype = call.specs[0]
            deltas[position] = ops.zeros((batch_size,) + tuple(shape[1:]), dtype=dtype)
    if with_variables:
        aux["gradients"] = gradients
        deltas = [d * ops.cast(factor, d.dtype) for d in deltas]
    return aux.pop("captured"), [[d] for d in deltas], aux, True


def has_convolutions(model) -> bool:
    """Whether torch's convolutions will ask for memory layouts (``backend.torch``)."""
    kinds = ("Conv", "Pooling")
    return any(any(k in type(layer).__name__ for k in kinds)
               for layer in compat.flatten_layers(model, include_self=False))


def grad_with_aux(fn, params):
    try:
        return adapter().grad_with_aux(fn, params)
    except NotVectorizable:
        raise  # no path can: the materialized one fails the same way
    except NotImplementedError as error:
        raise Unsupported(str(error)) from error


def weighted_losses(problem, losses, aux, weights, batch_size):
    """``sum_i w_i c_i L_i`` of a vectorized pass's losses (``w_i = 1`` without ``weights``),
    the factors held constant; records ``L_i`` and ``c_i`` in ``aux``."""
    factors = problem.example_scale(aux.pop("valid", None), batch_size)
    aux["loss"], aux["example_scale"] = losses, factors
    if weights is not None:
        weights = ops.cast(weights, "float32")
        factors = weights if factors is None else weights * factors
    losses = ops.cast(losses, "float32")
    return ops.sum(losses if factors is None else ops.stop_gradient(factors) * losses)
