"""The statistics path: a statistics rule in one forward and one backward pass.

For a rule of kind ``"statistics"`` (the result is ``sum_i w_i g_i`` with
weights from per-example squared norms and, if asked, the Gram matrix), the
``B x P`` per-example gradients are never built (docs/architecture.md, 'The
statistics path'):

1. A *dry run* of one example's loss, once per trace (cached where steps run
   eagerly), intercepts every layer call, records which trainable variables
   each call reads directly (outside the calls of its sublayers) and the shape
   of the tensor at each call's *probe point*, and makes the plan: a layer rule
   (``pergrad.layer_rules``) where one applies, else the fallback (the layer's
   own vectorized vjp).
2. The forward pass of every example (vectorized, as the materialized path's)
   adds a zero *probe* at each planned call's probe point and returns the
   call's input ``A``. One backward pass of ``sum_i c_i L_i`` with respect to
   the probes gives every call's output gradient ``D`` (``c_i``: the example's
   scale, docs/architecture.md, 'Per-example gradients').
3. From ``A`` and ``D`` the rules give per-example squared norms, the Gram
   matrix and, once the aggregator's weights are known, ``sum_i w_i g_i``.
   A variable read by several calls (a layer called twice, a variable shared
   by two layers) has its per-example gradients formed and summed first.

``mean`` and ``sum`` need no statistics: one ordinary backward pass of
``sum_i w_i c_i L_i`` with respect to the variables.
"""

from __future__ import annotations

import copy
import logging

import keras
from keras import ops, tree

from pergrad import compat, replicas
from pergrad.aggregators.base import (
    LOCAL_SUM,
    ExampleStatistics,
    RowMap,
    overflow_safe,
    row_scales,
    scaled_squared_norms_of_rows,
    zero_examples,
)
from pergrad.backend import NotVectorizable, adapter
from pergrad.engine.materialized import per_example_gradients
from pergrad.engine.problem import _bounded_get, _map, _problem, check_model
from pergrad.layer_rules import rule_for
from pergrad.layer_rules.base import (
    OutputRule,
    divide_rows,
    factor_inner_products,
    per_example_vjp,
    replaced_attribute,
    variable_values,
)

LOGGER = logging.getLogger("pergrad")
_FALLBACK = OutputRule()
_IDENTITY = RowMap()


class Unsupported(Exception):
    """The statistics path cannot handle this model; the message says why."""


def _is_tensor(value) -> bool:
    return ops.is_tensor(value) and not isinstance(value, keras.KerasTensor)


def _is_float(tensor) -> bool:
    return "float" in keras.backend.standardize_dtype(tensor.dtype)


_TENSOR = object()  # marks the tensor slots of a recorded call's arguments


class _Call:
    """One planned layer call: its rule and the trainable variables it gives gradients of.

    ``arguments`` is the call's ``(args, kwargs)`` with every tensor replaced by
    a marker: the fallback calls the layer again with one example's tensors.
    ``specs`` are the probe points' ``(shape, dtype)`` and ``input_shape`` the shape
    of the rule's ``inputs`` in the one-example dry run.
    """

    def __init__(self, index, layer, rule, variables, specs, arguments, input_shape=None):
        self.index, self.layer, self.rule, self.variables = index, layer, rule, variables
        self.specs, self.arguments, self.input_shape = specs, arguments, input_shape
        self.fallback = rule is _FALLBACK

    def recall(self, tensors):
        """The layer called on the recorded arguments with ``tensors`` in the tensor slots."""
        tensors = list(tensors)
        flat = [tensors.pop(0) if slot is _TENSOR else slot for slot in tree.flatten(self.arguments)]
        args, kwargs = tree.pack_sequence_as(self.arguments, flat)
        return self.layer(*args, **kwargs)


class Plan:
    """What the dry run found: the planned calls, in call order, whether the forward
    pass draws random numbers (reads a seed state: a ``Dropout`` with rate 0 does
    not), and whether one batched pass gives every call's ``D`` (``whole_batch``,
    :func:`_capture`)."""

    def __init__(self, calls, fallback_names, draws_random):
        self.calls = calls
        self.by_index = {call.index: position for position, call in enumerate(calls)}
        self.fallback_names = fallback_names
        self.draws_random = draws_random
        self.whole_batch = False


class _Interceptor:
    """Replaces the ``call`` of every layer of a model for the duration of a forward pass."""

    def __init__(self, model, handler):
        self.layers = compat.flatten_layers(model, include_self=False, recursive=True)
        self.handler = handler
        self.counts = {}

    def __enter__(self):
        self._contexts = []
        for layer in self.layers:
            original = layer.call

            def wrapper(*args, _layer=layer, _original=original, **kwargs):
                # A call is known by its layer and rank among that layer's calls: the
                # order of other layers' calls may change between traces (TensorFlow
                # traces a loop body again), a layer's own calls keep their order.
                rank = self.counts.get(id(_layer), 0)
                self.counts[id(_layer)] = rank + 1
                return self.handler((id(_layer), rank), _layer, _original, args, kwargs)

            context = replaced_attribute(layer, "call", wrapper)
            context.__enter__()
            self._contexts.append(context)
        return self

    def __exit__(self, *exc):
        for context in reversed(self._contexts):
            context.__exit__(*exc)


def _float32(tensor):
    """Float tensors in float32 (the statistics' dtype); integer ones (token ids) as they are."""
    if not _is_float(tensor) or keras.backend.standardize_dtype(tensor.dtype) == "float32":
        return tensor
    return ops.cast(tensor, "float32")


def _rows32(gradient):
    """``(B, ...) -> (B, size)`` in float32."""
    return ops.reshape(ops.cast(gradient, "float32"), (ops.shape(gradient)[0], -1))


def _example(batched, position=0):
    # Copies: Keras's loss scales the sample weights by the mask in place, which on
    # torch would write through a view into the batch.
    return tree.map_structure(lambda t: ops.copy(t[position]), batched)


def make_plan(problem, trainable_values, batched, shared) -> Plan:
    """The dry run: one example's loss, every layer call recorded. Raises :class:`Unsupported`."""
    model = problem.model
    trainable_ids = {id(v): v for v in model.trainable_variables}
    records, stack, root_reads = [], [], []

    def owner():
        """The call a read belongs to: the innermost one, or the outermost RNN around it.

        Calls inside a recurrent layer run in its loop (a graph loop on TensorFlow and
        JAX), from which nothing can be captured: the RNN is planned as one call.
        """
        for record in stack:
            if isinstance(record["layer"], keras.layers.RNN):
                return record
        return stack[-1]

    def record_read(variable):
        (owner()["reads"] if stack else root_reads).append(variable)

    def handler(index, layer, original, args, kwargs):
        markers = [_TENSOR if _is_tensor(leaf) else leaf for leaf in tree.flatten((args, kwargs))]
        record = {"index": index, "layer": layer, "reads": [], "specs": [], "rule": rule_for(layer),
                  "arguments": tree.pack_sequence_as((args, kwargs), markers)}
        if record["rule"] is not None:
            record["variables"] = record["rule"].call_variables(layer, args, kwargs)
            record["input_shape"] = tuple(ops.shape(record["rule"].call_inputs(layer, args, kwargs)))
        records.append(record)

        def probe(tensor):
            record["specs"].append((tuple(ops.shape(tensor)), tensor.dtype))
            return tensor

        stack.append(record)
        try:
            if any(isinstance(outer["layer"], keras.layers.RNN) for outer in stack[:-1]):
                return original(*args, **kwargs)  # inside a loop: never probed
            if record["rule"] is not None:
                return record["rule"].forward(layer, original, probe, args, kwargs)
            out = original(*args, **kwargs)
            for leaf in tree.flatten(out):
                if _is_tensor(leaf) and _is_float(leaf):
                    probe(leaf)
            return out
        finally:
            stack.pop()

    # Torch's unseeded random layers draw from its global generator: the dry run
    # must leave it where it was, so that the step draws what it would without it.
    random_state = adapter().random_state()
    try:
        with compat.recording_variable_reads(record_read), _Interceptor(model, handler):
            problem._example_loss(list(trainable_values), _example(batched), shared)
    finally:
        adapter().set_random_state(random_state)

    def trainable(reads):
        seen, out = set(), []
        for v in reads:
            if id(v) in trainable_ids and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    if not root_reads and not any(record["reads"] for record in records):
        # The forward pass reads its variables in a StatelessScope, so reads are always
        # recorded; none means the recording failed, and planning on it would give every
        # layer a zero gradient.
        raise RuntimeError(
            f"pergrad's dry run of model {model.name!r} recorded no variable read; the "
            "statistics path cannot plan it. Please report this with the model."
        )
    if trainable(root_reads):
        names = [v.path for v in trainable(root_reads)]
        raise Unsupported(f"the model reads trainable variable(s) {names} outside any layer call")
    calls, fallback_names = [], []
    for record in records:
        reads = trainable(record["reads"])
        if not reads:
            continue
        layer, rule = record["layer"], record["rule"]
        if rule is not None:
            variables = record["variables"]
            if {id(v) for v in variables} != {id(v) for v in reads} or len(record["specs"]) != 1:
                raise Unsupported(
                    f"layer {layer.name!r} reads variables {[v.path for v in reads]} that its rule "
                    f"{type(rule).__name__} does not cover"
                )
        else:
            if any(compat.is_seed_state(v) for v in record["reads"]):
                raise Unsupported(
                    f"layer {layer.name!r} has no rule and draws random numbers in its own call"
                )
            rule, variables = _FALLBACK, reads
            fallback_names.append(layer.name)
        calls.append(_Call(record["index"], layer, rule, variables, record["specs"], record["arguments"],
                           record.get("input_shape")))
    every_read = root_reads + [v for record in records for v in record["reads"]]
    plan = Plan(calls, fallback_names, any(compat.is_seed_state(v) for v in every_read))
    if not plan.draws_random and not fallback_names:
        _mark_whole_batch(problem, plan, trainable_values, batched, shared)
    return plan


def _leading_one(shape) -> bool:
    """Whether a one-example dry run's shape has the batch-of-one axis."""
    return len(shape) > 0 and shape[0] == 1


def _mark_whole_batch(problem, plan, trainable_values, batched, shared):
    """Whether one batched pass gives every planned call's ``D`` (``plan.whole_batch``):
    when every call's inputs and output follow the batch.

    A second dry run on two examples (the first one twice): a tensor whose leading
    axis is one in the first run and two in this one is the example's; any other
    (a constant made in ``build()``, ``arange`` positions, a weight) is the same for
    every example, and a call that outputs one needs each example's own probe,
    which only the vectorized pass gives.
    """
    follows = [False] * len(plan.calls)

    def handler(index, layer, original, args, kwargs):
        position = plan.by_index.get(index)
        if position is None:
            return original(*args, **kwargs)
        call, leading = plan.calls[position], []

        def probe(tensor):
            leading.append(tuple(ops.shape(tensor))[:1])
            return tensor

        out = call.rule.forward(layer, original, probe, args, kwargs)
        inputs = tuple(ops.shape(call.rule.call_inputs(layer, args, kwargs)))[:1]
        follows[position] = (inputs == (2,) and _leading_one(call.input_shape)
                             and leading == [(2,)] and _leading_one(call.specs[0][0]))
        return out

    # Stacked rows: a static leading axis of two even where the batch's is unknown (a TF retrace).
    pair = {key: tree.map_structure(lambda t: ops.stack([t[0], t[0]]), batched[key])
            for key in ("x", "y", "sample_weight") if batched.get(key) is not None}
    with _Interceptor(problem.model, handler):
        problem._loss(list(trainable_values), shared["non_trainable"], pair["x"], pair.get("y"),
                      pair.get("sample_weight"))
    plan.whole_batch = all(follows)


def _cached_plan(problem, trainable_values, batched, shared) -> Plan:
    """The plan; made once per trace, or once per input signature and variables where steps run eagerly."""
    if not getattr(adapter(), "EAGER_LOOPS", False):
        return make_plan(problem, trainable_values, batched, shared)
    model = problem.model
    key = (
        tuple(id(v) for v in model.trainable_variables),
        tuple((tuple(t.shape[1:]), str(t.dtype)) for t in tree.flatten(batched)),
    )
    cache = problem.__dict__.setdefault("_statistics_plans", {})
    plan = cache.get(key)  # (read once: another thread may clear the cache meanwhile)
    if plan is None:
        try:
            plan = make_plan(problem, trainable_values, batched, shared)
        except Unsupported as error:
            plan = error  # found once, not on every step
        if len(cache) > 8:
            cache.clear()
        cache[key] = plan
    if isinstance(plan, Unsupported):
        raise plan
    return plan


def _log_fallback(problem, plan):
    names = sorted(set(plan.fallback_names))
    if names:
        _log_once(problem, (
            f"statistics path: no layer rule for {names}; their per-example gradients are "
            "computed by a vectorized vjp of each layer alone (exact, slower; register a rule "
            "with pergrad.layer_rules.register_rule to speed them up)"
        ))


def _capture(problem, plan, trainable_values, batched, shared, batch_size):
    """The forward pass with probes and the one backward pass: ``(captured, deltas, aux, batched)``.

    For a model that draws no random numbers and whose planned calls all have
    rules and outputs that follow the batch (``plan.whole_batch``), one batched
    forward pass (no vectorized map): ``B`` times the batch loss Keras reduces is
    ``sum_i c_i L_i`` (the definition of ``L_i``), so its gradient at the probes is
    every example's ``D``, as the vectorized pass gives it. Otherwise each example
    runs alone (its own random stream; the fallback needs each example's call as it
    was; an output shared by the batch needs each example's own probe).
    ``batched`` says which: captured tensors and deltas then have no batch-of-one axis.
    """
    model = problem.model
    whole_batch = plan.whole_batch

    def probe_zeros(spec):
        shape, dtype = spec
        return ops.zeros((batch_size,) + tuple(shape[1:] if whole_batch else shape), dtype=dtype)

    probes = [[probe_zeros(spec) for spec in call.specs] for call in plan.calls]
    constants = [ops.stop_gradient(v) for v in trainable_values]

    def intercepted(own_probes, captured):
        def handler(index, layer, original, args, kwargs):
            position = plan.by_index.get(index)
            if position is None:
                return original(*args, **kwargs)
            call, probe = plan.calls[position], own_probes[position]
            if not call.fallback:
                captured[position] = call.rule.call_inputs(layer, args, kwargs)
                return call.rule.forward(layer, original, lambda t: t + probe[0], args, kwargs)
            flat = tree.flatten((args, kwargs))
            captured[position] = [leaf for leaf in flat if _is_tensor(leaf)]
            out = original(*args, **kwargs)
            leaves, pending = tree.flatten(out), list(probe)
            leaves = [leaf + pending.pop(0) if _is_tensor(leaf) and _is_float(leaf) else leaf
                      for leaf in leaves]
            return tree.pack_sequence_as(out, leaves)

        return _Interceptor(model, handler)

    def example_loss(example, shared):
        captured = [None] * len(plan.calls)
        with intercepted(example["probes"], captured):
            loss, aux = problem._example_loss(constants, example["example"], shared)
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
            layout_hints=_has_convolutions(model),
        )
        return _weighted_losses(problem, losses, aux, None, batch_size), aux

    def batch_total(probe_values):
        captured = [None] * len(plan.calls)
        with intercepted(grouped(probe_values), captured):
            loss, y_pred, masks, _ = problem._loss(
                constants, shared["non_trainable"], batched["x"], batched.get("y"),
                batched.get("sample_weight"),
            )
        aux = {"y_pred": y_pred, "seeds": [], "captured": captured}
        if masks:
            aux["mask"] = masks[0]
        factor = ops.cast(batch_size, "float32")
        if shared.get("loss_scale") is not None:
            factor = factor * ops.cast(shared["loss_scale"], "float32")
        return ops.cast(loss, "float32") * factor, aux

    deltas, aux = _grad_with_aux(batch_total if whole_batch else total,
                                 [p for group in probes for p in group])
    return aux.pop("captured"), grouped(deltas), aux, whole_batch


def _has_convolutions(model) -> bool:
    """Whether torch's convolutions will ask for memory layouts (``backend.torch``)."""
    kinds = ("Conv", "Pooling")
    return any(any(k in type(layer).__name__ for k in kinds)
               for layer in compat.flatten_layers(model, include_self=False))


def _grad_with_aux(fn, params):
    try:
        return adapter().grad_with_aux(fn, params)
    except NotVectorizable:
        raise  # no path can: the materialized one fails the same way
    except NotImplementedError as error:
        raise Unsupported(str(error)) from error


def _weighted_losses(problem, losses, aux, weights, batch_size):
    """``sum_i w_i c_i L_i`` of a vectorized pass's losses (``w_i = 1`` without ``weights``),
    the factors held constant; records ``L_i`` and ``c_i`` in ``aux``."""
    factors = problem.example_scale(aux.pop("valid", None), batch_size)
    aux["loss"], aux["example_scale"] = losses, factors
    if weights is not None:
        weights = ops.cast(weights, "float32")
        factors = weights if factors is None else weights * factors
    losses = ops.cast(losses, "float32")
    return ops.sum(losses if factors is None else ops.stop_gradient(factors) * losses)


def _scaled_factors(parts):
    """``(parts, scale)``: outer-product pieces of one gradient, all divided by the same
    ``(B,)`` scale with every factor's entries at most one (no product overflows).

    Piece ``c`` (``sum_t l_t ⊗ r_t``) is bilinear: its left factor divided by its own
    largest entry ``a_c`` and its right by ``scale / a_c``, where ``scale`` is the
    largest ``a_c`` times the right factor's largest entry; ids stay as they are.
    """
    lefts = [row_scales(left) if _is_float(left) else None for left, _ in parts]
    rights = [row_scales(right) for _, right in parts]
    scale = None
    for left, right in zip(lefts, rights):
        size = right if left is None else left * right
        scale = size if scale is None else ops.maximum(scale, size)
    scaled = []
    for (left, right), left_scale in zip(parts, lefts):
        if left_scale is not None:
            left = divide_rows(left, left_scale)
        scaled.append((left, divide_rows(right, scale if left_scale is None else scale / left_scale)))
    return scaled, scale


def _finish_aux(problem, aux, non_trainable):
    out = {"y_pred": aux["y_pred"]}
    if "loss" in aux:  # (not from a whole-batch pass; the step does not read it)
        scale = aux["example_scale"]
        out["loss"] = aux["loss"] if scale is None else aux["loss"] * ops.cast(scale, aux["loss"].dtype)
    if "mask" in aux:
        out["mask"] = aux["mask"]
    out["seeds"] = problem.advanced_seeds(non_trainable, aux["seeds"])
    return out


class _Layers:
    """Every planned call's ``A`` and ``D``, and the statistics made from them."""

    def __init__(self, plan, captured, deltas, values, variables, inverse_scale, whole_batch=False):
        self.plan, self.values_of = plan, dict(zip(map(id, variables), values))
        self.index_of = {id(v): k for k, v in enumerate(variables)}
        self.count = len(variables)
        self.inputs, self.deltas = [], []
        for call, inputs, delta in zip(plan.calls, captured, deltas):
            if call.fallback:
                self.inputs.append(inputs)
                self.deltas.append(delta)  # raw (scaled, compute dtype): the layer's own vjp
                continue
            delta = delta[0]
            if not whole_batch:
                # The vectorized pass stacked each example's tensors: the batch-of-one axis
                # removed where the example's call had one; a tensor shared by the batch
                # (no such axis) comes broadcast.
                inputs = ops.squeeze(inputs, 1) if _leading_one(call.input_shape) else inputs
                delta = ops.squeeze(delta, 1) if _leading_one(call.specs[0][0]) else delta
            delta = _float32(delta)
            self.inputs.append(_float32(inputs))
            self.deltas.append(delta if inverse_scale is None else delta * inverse_scale)
        self.inverse_scale = inverse_scale
        uses = {}
        for call in plan.calls:
            for v in call.variables:
                uses[id(v)] = uses.get(id(v), 0) + 1
        # Calls with a variable that another call reads too: their gradients are summed
        # per example before any statistic.
        self.shared = [any(uses[id(v)] > 1 for v in call.variables) for call in plan.calls]
        self._materialized = {}

    def zero_rows(self, keep):
        """Zeroes example i's ``A`` and ``D`` in every call where ``keep[i]`` is false."""

        # Per-example gradients already materialized (for the norms) keep serving the
        # weighted sum, zeroed alike: recomputing them from the zeroed A and D would give the
        # same values at the cost of a second per-example pass (a convolution's, say).
        self.inputs, self.deltas, self._materialized = zero_examples(
            keep, (self.inputs, self.deltas, self._materialized))

    def with_tensors(self, function):
        """These layers with ``function`` applied to every tensor of each call's ``A`` and ``D``."""
        other = copy.copy(self)

        def apply(t):
            return function(t) if _is_tensor(t) else t

        other.inputs = [tree.map_structure(apply, t) for t in self.inputs]
        other.deltas = [tree.map_structure(apply, t) for t in self.deltas]
        other._materialized = {}
        return other

    def gathered(self):
        """These layers over every replica's examples: each call's ``A`` and ``D``
        all-gathered, in replica order (``pergrad.replicas``)."""
        return self.with_tensors(replicas.gather)

    def _values(self, call):
        return [self.values_of[id(v)] for v in call.variables]

    def _per_example(self, position):
        call = self.plan.calls[position]
        if position not in self._materialized:
            if call.fallback:
                grads = per_example_vjp(call.recall, call.variables, self._values(call),
                                        self.inputs[position], self.deltas[position])
                if self.inverse_scale is not None:
                    grads = [g * ops.cast(self.inverse_scale, g.dtype) for g in grads]
            else:
                grads = call.rule.per_example(call.layer, self._values(call), self.inputs[position],
                                              self.deltas[position])
            self._materialized[position] = grads
        return self._materialized[position]

    def _take_per_example(self, position):
        """:meth:`_per_example`, dropped from the cache: the streaming path uses it once."""
        grads = self._per_example(position)
        del self._materialized[position]
        return grads

    def finite_from_layers(self):
        """``(flags, variable indices)``: the rules' finiteness checks from ``A`` and ``D``
        (:meth:`~pergrad.layer_rules.LayerRule.all_finite`) and the variables they cover."""
        flags, covered = [], set()
        for position, call in enumerate(self.plan.calls):
            if self.shared[position] or call.fallback:
                continue
            flag = call.rule.all_finite(call.layer, self.inputs[position], self.deltas[position])
            if flag is not None:
                flags.append(flag)
                covered.update(self.index_of[id(v)] for v in call.variables)
        return flags, covered

    def mapped(self, rows, variables, batch_size, pieces=1):
        """``(k, J x variable k's gradients)``: the row map applied to every variable's
        per-example gradients (``rows`` ``None``: the identity), one call at a time, so
        that only one call's gradients exist at once (where steps run eagerly; a compiler
        frees them as it sees fit). With ``pieces > 1``, rules that can
        (:meth:`~pergrad.layer_rules.LayerRule.mapped_pieces`) give a variable in parts
        along its first axis, yielded in order."""
        for position, call in enumerate(self.plan.calls):
            if self.shared[position]:
                continue
            columns = [self.index_of[id(v)] for v in call.variables]
            if call.fallback or (rows is None and pieces <= 1):
                grads = self._take_per_example(position)
                for k, g in zip(columns, grads):
                    yield k, g if rows is None else rows.apply(g, k)
                continue
            mapping = rows if rows is not None else _IDENTITY
            parts = call.rule.mapped_pieces(call.layer, self._values(call), self.inputs[position],
                                            self.deltas[position], mapping, columns, pieces)
            for m, g in parts:
                yield columns[m], g
        read = {self.index_of[id(v)] for call in self.plan.calls for v in call.variables}
        for k, summed in self._shared_variables().items():
            g = ops.reshape(summed, (-1,) + tuple(variables[k].shape))
            yield k, g if rows is None else rows.apply(g, k)
        for k, v in enumerate(variables):
            if k not in read:  # no call reads it: zero gradients
                zeros = ops.zeros((batch_size,) + tuple(v.shape), "float32")
                yield k, zeros if rows is None else rows.apply(zeros, k)

    def _ghost(self, position):
        """Whether the call's statistics come from its rule's formulas (else from its
        per-example gradients)."""
        call = self.plan.calls[position]
        return not (call.fallback or call.rule.materializes(
            call.layer, self.inputs[position], self.deltas[position]))

    def _shared_variables(self, only=None):
        """``{variable index: (B, size) summed per-example gradient rows}`` of shared
        variables (those in ``only``, when given)."""
        sums = {}
        for position, call in enumerate(self.plan.calls):
            if not self.shared[position]:
                continue
            indices = [self.index_of[id(v)] for v in call.variables]
            if only is not None and not set(indices) & set(only):
                continue
            for k, g in zip(indices, self._per_example(position)):
                if only is None or k in only:
                    rows = _rows32(g)
                    sums[k] = rows if k not in sums else sums[k] + rows
        return sums

    def _shared_squared_norms(self, scaled=False):
        """``{variable index: ((B,) squared norm, (B,) scale or None)}`` of the variables
        that several calls read (with ``scaled``, divided by the scale squared, computed
        so that none overflows).

        Example i's gradient is the sum of the calls' pieces, and its squared norm
        the sum of their pairwise inner products: from the rules' factors
        (:meth:`~pergrad.layer_rules.LayerRule.factors`) where every call that
        reads the variable takes its rule's formulas and gives them (a tied
        embedding and output layer: no ``B x vocabulary x d`` tensor), else from
        the summed per-example gradients.
        """
        pieces = {}
        for position, call in enumerate(self.plan.calls):
            if not self.shared[position]:
                continue
            factors = None
            if self._ghost(position):
                factors = call.rule.factors(call.layer, self._values(call), self.inputs[position],
                                            self.deltas[position])
            for m, v in enumerate(call.variables):
                pieces.setdefault(self.index_of[id(v)], []).append(None if factors is None else factors[m])
        formed = [k for k, parts in pieces.items() if any(part is None for part in parts)]
        out = {}
        for k, rows in self._shared_variables(formed).items():
            if scaled:
                (norms,), (scale,) = scaled_squared_norms_of_rows([rows])
                out[k] = (norms, scale)
            else:
                out[k] = (ops.sum(ops.square(rows), axis=1), None)
        for k, parts in pieces.items():
            if k in out:
                continue
            scale = None
            if scaled:
                parts, scale = _scaled_factors(parts)
            total = 0.0
            for a, first in enumerate(parts):
                total = total + factor_inner_products(first, first)
                for second in parts[a + 1:]:
                    total = total + 2.0 * factor_inner_products(first, second)
            out[k] = (ops.cast(total, "float32"), scale)
        return out

    def _per_call(self, statistic, from_rows, arguments=lambda call: (), every_call=False):
        """``(call, value)`` for every call with no shared variable (with ``every_call``, for
        every call): the rule's ``statistic`` (a ghost formula), or ``from_rows`` of the
        call's per-example gradient rows; both also get ``arguments(call)``."""
        for position, call in enumerate(self.plan.calls):
            if self.shared[position] and not every_call:
                continue
            extra = arguments(call)
            if self._ghost(position):
                value = getattr(call.rule, statistic)(
                    call.layer, self._values(call), self.inputs[position], self.deltas[position], *extra
                )
            else:
                value = from_rows([_rows32(g) for g in self._per_example(position)], *extra)
            yield call, value

    def squared_norms(self, batch_size):
        """``((B, V) squared norms, (B, V) scale)``: divided by the scale squared, computed
        again with rescaled ``A``, ``D`` and rows only if one overflowed
        (:func:`~pergrad.aggregators.base.overflow_safe`)."""

        def columns(scaled):
            norms, scales = [None] * self.count, [None] * self.count

            def from_rows(rows):
                if scaled:
                    return scaled_squared_norms_of_rows(rows)
                return [ops.sum(r * r, axis=1) for r in rows]

            def keep(indices, value):
                found, found_scales = value if scaled else (value, [None] * len(value))
                for k, n, scale in zip(indices, found, found_scales):
                    norms[k], scales[k] = ops.cast(n, "float32"), scale

            statistic = "scaled_squared_norms" if scaled else "squared_norms"
            for call, value in self._per_call(statistic, from_rows):
                keep([self.index_of[id(v)] for v in call.variables], value)
            for k, (n, scale) in self._shared_squared_norms(scaled).items():
                norms[k], scales[k] = n, scale
            zeros, ones = ops.zeros((batch_size,), "float32"), ops.ones((batch_size,), "float32")
            norms = [zeros if n is None else n for n in norms]
            return norms, [ones if s is None else ops.cast(s, "float32") for s in scales]

        def rescaled():
            norms, scales = columns(True)
            return ops.stack(norms, axis=1), ops.stack(scales, axis=1)

        return overflow_safe(ops.stack(columns(False)[0], axis=1), rescaled)

    def gram(self, batch_size):
        total = ops.zeros((batch_size, batch_size), "float32")
        def from_rows(rows):
            return sum(ops.matmul(r, ops.transpose(r)) for r in rows)

        for _, part in self._per_call("gram", from_rows):
            total = total + ops.cast(part, "float32")
        for rows in self._shared_variables().values():
            total = total + ops.matmul(rows, ops.transpose(rows))
        return total

    def weighted_sums(self, weights, variables):
        """``sum_i w_i g_i`` for every variable; ``weights`` ``(B,)`` or ``(B, V)``.

        Linear in each call's gradient: a variable that several calls read gets the
        sum of their weighted sums (each by its rule's formula where it has one)."""

        def weight(v):
            w = weights if len(weights.shape) == 1 else weights[:, self.index_of[id(v)]]
            return ops.cast(w, "float32")

        def from_rows(rows, ws):
            return [ops.matmul(w[None, :], r)[0] for r, w in zip(rows, ws)]

        out = [None] * self.count
        calls = self._per_call("weighted_sum", from_rows, lambda call: ([weight(v) for v in call.variables],),
                               every_call=True)
        for call, sums in calls:
            for v, part in zip(call.variables, sums):
                k = self.index_of[id(v)]
                part = ops.reshape(ops.cast(part, "float32"), v.shape)
                out[k] = part if out[k] is None else out[k] + part
        return [
            ops.zeros(v.shape, v.dtype) if s is None else ops.cast(s, v.dtype)
            for s, v in zip(out, variables)
        ]


def _direct(problem, weights, trainable_values, batched, shared, batch_size):
    """``sum_i w_i g_i`` as one ordinary backward pass of ``sum_i w_i c_i L_i``."""

    def total(values):
        losses, aux = adapter().vectorized_call(
            lambda example, shared: problem._example_loss(values, example, shared), batched, shared,
            layout_hints=_has_convolutions(problem.model),
        )
        return _weighted_losses(problem, losses, aux, weights, batch_size), aux

    return _grad_with_aux(total, list(trainable_values))


def _draws_random(problem, trainable_values, batched, shared) -> bool:
    """Whether the forward pass reads a seed state (from the dry run's plan)."""
    if not problem.seed_positions:
        return False
    try:
        return _cached_plan(problem, trainable_values, batched, shared).draws_random
    except Unsupported:
        return True


def _batch_loss_gradient(problem, aggregator, trainable_values, non_trainable, batched, loss_scale,
                         batch_size):
    """``mean`` and ``sum`` of a model that draws no random numbers: the gradient of the
    batch loss Keras itself differentiates, which is ``mean_i g_i`` by the definition of
    ``L_i`` (docs/architecture.md, 'Per-example gradients'). With randomness, each
    example draws from its own stream (``_direct``), as on the other paths."""

    def total(values):
        loss, y_pred, masks, _ = problem._loss(
            values, non_trainable, batched["x"], batched.get("y"), batched.get("sample_weight")
        )
        aux = {"y_pred": y_pred, "seeds": []}
        if masks:
            aux["mask"] = masks[0]
        scaled = loss if loss_scale is None else loss * ops.cast(loss_scale, loss.dtype)
        return ops.cast(scaled, "float32"), aux

    result, aux = _grad_with_aux(total, list(trainable_values))
    factor = None  # (skipped when 1: every op costs on an eager backend)
    if loss_scale is not None:
        factor = 1.0 / ops.cast(loss_scale, "float32")
    if aggregator.distribution == LOCAL_SUM:  # weights 1, not 1 / B
        size = ops.cast(batch_size, "float32")
        factor = size if factor is None else factor * size
    variables = problem.model.trainable_variables
    if factor is not None:
        result = [g * ops.cast(factor, g.dtype) for g in result]
    stats = ExampleStatistics(ops.zeros((batch_size, len(variables)), "float32"))
    return aggregator.finalize(result, stats), aux


def _unscale(example_loss_scale):
    """The factor that removes the loss scale from gradients, or ``None`` (no scale)."""
    if example_loss_scale is None:
        return None
    return 1.0 / ops.cast(example_loss_scale, "float32")


def _layers(problem, trainable_values, batched, shared, batch_size, inverse):
    """Plan, forward and backward pass: the :class:`_Layers` of this batch, and ``aux``."""
    plan = _cached_plan(problem, trainable_values, batched, shared)
    _log_fallback(problem, plan)
    captured, deltas, aux, whole_batch = _capture(problem, plan, trainable_values, batched, shared,
                                                  batch_size)
    variables = problem.model.trainable_variables
    layers = _Layers(plan, captured, deltas, list(trainable_values), variables, inverse, whole_batch)
    return layers, aux


def _context(problem, trainable_values, non_trainable):
    model = problem.model
    return variable_values(
        list(zip(model.non_trainable_variables, non_trainable))
        + list(zip(model.trainable_variables, trainable_values))
    )


def prepare(problem, aggregator, non_trainable_values, x, y, sample_weight, loss_scale):
    """``(batched, B, non_trainable, shared, inverse loss scale)`` of a batch, the batch
    size checked against the rule's minimum where it is static."""
    batched, batch_size, non_trainable, example_loss_scale = problem.batched_inputs(
        non_trainable_values, x, y, sample_weight, loss_scale
    )
    if isinstance(batch_size, int):
        aggregator.check_batch_size(batch_size)
    shared = {"non_trainable": non_trainable, "loss_scale": example_loss_scale}
    return batched, batch_size, non_trainable, shared, _unscale(example_loss_scale)


def aggregate(problem, aggregator, trainable_values, non_trainable_values, x, y=None,
              sample_weight=None, loss_scale=None, gathered=False):
    """A statistics rule's result over the batch, without per-example gradients of the model.

    Args and returns as :func:`pergrad.engine.chunked.aggregate`: ``(result, aux)``,
    ``result`` aligned with the trainable variables (unscaled), ``aux`` with each
    example's ``loss``, ``y_pred``, ``mask`` (masked outputs) and advanced ``seeds``.
    With ``gathered`` (a replica of several, ``pergrad.replicas``), the weights come
    from the statistics of the whole batch (norms all-gathered; for a Gram rule, each
    layer's ``A`` and ``D``) and ``result`` is this replica's examples' part of the sum.
    Raises :class:`Unsupported` when the model needs the materialized path.
    """
    batched, batch_size, non_trainable, shared, inverse = prepare(
        problem, aggregator, non_trainable_values, x, y, sample_weight, loss_scale
    )
    variables = problem.model.trainable_variables
    # Every example weighs the same (reads_statistics): Keras's own batch gradient.
    if not aggregator.reads_statistics and not _draws_random(problem, trainable_values, batched, shared):
        return _batch_loss_gradient(problem, aggregator, trainable_values, non_trainable, batched,
                                    loss_scale, batch_size)

    def local(weights):
        return replicas.local_rows(weights, batch_size) if gathered else weights

    if not aggregator.reads_statistics:
        rows = replicas.global_size(batch_size) if gathered else batch_size
        stats = ExampleStatistics(ops.zeros((rows, len(variables)), "float32"))
        grads, aux = _direct(problem, local(aggregator.example_weights(stats)), trainable_values,
                             batched, shared, batch_size)
        if inverse is not None:
            grads = [g * ops.cast(inverse, g.dtype) for g in grads]
        result = [ops.cast(g, v.dtype) for g, v in zip(grads, variables)]
        return aggregator.finalize(result, stats), _finish_aux(problem, aux, non_trainable)
    layers, aux = _layers(problem, trainable_values, batched, shared, batch_size, inverse)
    with _context(problem, trainable_values, non_trainable):
        norms, scale = layers.squared_norms(batch_size)
        if getattr(aggregator, "differentially_private", False):
            # A DP rule's non-finite examples contribute nothing (as on the materialized
            # path: zero_non_finite_examples); a NaN update would reveal them.
            keep = ExampleStatistics(norms, scale=scale).finite
            layers.zero_rows(keep)
            norms = ops.where(keep[:, None], norms, ops.zeros_like(norms))
            scale = ops.where(keep[:, None], scale, ops.ones_like(scale))
        whole = layers.gathered() if gathered and aggregator.needs_gram else layers
        if gathered:
            norms, scale = replicas.gather(norms), replicas.gather(scale)
        gram = whole.gram(ops.shape(norms)[0]) if aggregator.needs_gram else None
        stats = ExampleStatistics(norms, gram, scale=scale)
        weights = ops.stop_gradient(aggregator.example_weights(stats))
        result = layers.weighted_sums(local(weights), variables)
    return aggregator.finalize(result, stats), _finish_aux(problem, aux, non_trainable)


def statistics(problem, trainable_values, non_trainable_values, x, y=None, sample_weight=None,
               gram: bool = False):
    """``(ExampleStatistics, aux)`` of the batch's per-example gradients, from the layers.

    Raises :class:`Unsupported` when the model needs the materialized path.
    """
    batched, batch_size, non_trainable, _ = problem.batched_inputs(non_trainable_values, x, y, sample_weight)
    shared = {"non_trainable": non_trainable, "loss_scale": None}
    layers, aux = _layers(problem, trainable_values, batched, shared, batch_size, _unscale(None))
    with _context(problem, trainable_values, non_trainable):
        norms, scale = layers.squared_norms(batch_size)
        stats = ExampleStatistics(norms, layers.gram(batch_size) if gram else None, scale=scale)
    return stats, _finish_aux(problem, aux, non_trainable)




def _statistics_function(problem, gram: bool):
    """``statistics`` compiled once per (trainable variables, non-trainable variables, gram)."""
    model = problem.model
    trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
    key = ("statistics", tuple(map(id, trainable)), tuple(map(id, non_trainable)), gram)

    def make():
        def pure(trainable_values, non_trainable_values, x, y, sample_weight):
            stats, aux = statistics(problem, trainable_values, non_trainable_values, x, y,
                                    sample_weight, gram=gram)
            return stats.scaled_squared_norms, stats.scale, stats.gram, aux["seeds"]

        return (trainable, non_trainable), adapter().compile(pure)

    return _bounded_get(problem._functions, key, make)[1]


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
    problem = _problem(model, loss, training)
    problem._check_once(x, y)
    x, y, sample_weight = (_map(ops.convert_to_tensor, t) for t in (x, y, sample_weight))
    values = [v.value for v in model.trainable_variables]
    states = [v.value for v in model.non_trainable_variables]
    try:
        norms, scale, gram_matrix, seeds = _statistics_function(problem, gram)(
            values, states, x, y, sample_weight
        )
    except Unsupported as error:
        _log_once(problem, f"per_example_statistics uses the materialized path: {error}")
        grads = per_example_gradients(model, x, y, sample_weight, loss=loss, training=training)
        return ExampleStatistics.from_gradients(grads, gram=gram)
    for position, state in zip(problem.seed_positions, seeds):
        model.non_trainable_variables[position].assign(state)
    return ExampleStatistics(norms, gram_matrix, scale=scale)


def _log_once(problem, message):
    logged = problem.__dict__.setdefault("_logged_fallbacks", set())
    if message not in logged:
        logged.add(message)
        LOGGER.warning("pergrad: %s.", message)
