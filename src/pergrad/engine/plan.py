"""The statistics path's dry run: which layer calls to probe, and with which rule.

One example's loss runs once per trace (cached where steps run eagerly) with every
layer's ``call`` intercepted: each call's directly read trainable variables (outside
the calls of its sublayers) and the shape of the tensor at its *probe point* are
recorded, and every call that reads some gets a layer rule (``pergrad.layer_rules``)
where one applies, else the fallback (the layer's own vectorized vjp). See
docs/architecture.md, 'The statistics path'.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops, tree

from pergrad import compat
from pergrad.backend import adapter, eager, traced_apart
from pergrad.layer_rules import rule_for
from pergrad.layer_rules.base import OutputRule, replaced_attribute
from pergrad.tensors import is_float

FALLBACK = OutputRule()

# Plans kept per problem where steps run eagerly: enough for a few input signatures.
_EAGER_PLANS = 8


class Unsupported(Exception):
    """The statistics path cannot handle this model; the message says why."""


def is_tensor(value) -> bool:
    """Whether ``value`` is a concrete tensor (not a symbolic ``KerasTensor``)."""
    return ops.is_tensor(value) and not isinstance(value, keras.KerasTensor)


_TENSOR = object()  # marks the tensor slots of a recorded call's arguments


class Call:
    """One planned layer call: its rule and the trainable variables it gives gradients of.

    ``arguments`` is the call's ``(args, kwargs)`` with every tensor replaced by
    a marker: the fallback calls the layer again with one example's tensors.
    ``specs`` are the probe points' ``(shape, dtype)`` and ``input_shape`` the shape
    of the rule's ``inputs`` in the one-example dry run.
    """

    def __init__(self, index, layer, rule, variables, specs, arguments, input_shape=None):
        self.index, self.layer, self.rule, self.variables = index, layer, rule, variables
        self.specs, self.arguments, self.input_shape = specs, arguments, input_shape
        self.fallback = rule is FALLBACK

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
    :func:`pergrad.engine.capture.capture`)."""

    def __init__(self, calls, fallback_names, draws_random):
        self.calls = calls
        self.by_index = {call.index: position for position, call in enumerate(calls)}
        self.fallback_names = fallback_names
        self.draws_random = draws_random
        self.whole_batch = False


class Interceptor:
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


def _example(batched, position=0):
    # Copies: Keras's loss scales the sample weights by the mask in place, which on
    # torch would write through a view into the batch.
    return tree.map_structure(lambda t: ops.copy(t[position]), batched)


def _same_state(a, b) -> bool:
    """Whether two of the adapter's ``random_state()`` values are equal."""
    a, b = tree.flatten(a), tree.flatten(b)
    return len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def make_plan(problem, trainable_values, batched, shared) -> Plan:
    """The dry run: one example's loss, every layer call recorded. Raises :class:`Unsupported`."""
    model = problem.model
    trainable_ids = {id(v): v for v in compat.trainable_variables(model)}
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
        markers = [_TENSOR if is_tensor(leaf) else leaf for leaf in tree.flatten((args, kwargs))]
        record = {"index": index, "layer": layer, "reads": [], "specs": [], "rule": rule_for(layer),
                  "arguments": tree.pack_sequence_as((args, kwargs), markers)}
        if record["rule"] is not None:
            record["variables"] = record["rule"].call_variables(layer, args, kwargs)
        records.append(record)

        def probe(tensor):
            record["specs"].append((tuple(ops.shape(tensor)), tensor.dtype))
            return tensor

        stack.append(record)
        try:
            if any(isinstance(outer["layer"], keras.layers.RNN) for outer in stack[:-1]):
                return original(*args, **kwargs)  # inside a loop: never probed
            if record["rule"] is not None:
                out, inputs = record["rule"].forward_and_inputs(layer, original, probe, args, kwargs)
                record["input_shape"] = tuple(ops.shape(inputs))
                return out
            out = original(*args, **kwargs)
            for leaf in tree.flatten(out):
                if is_tensor(leaf) and is_float(leaf):
                    probe(leaf)
            return out
        finally:
            stack.pop()

    # Torch's unseeded random layers draw from its global generator: the dry run
    # must leave it where it was, so that the step draws what it would without it.
    # That it moved is how the plan sees that they drew: they read no seed state.
    random_state = adapter().random_state()
    try:
        with compat.recording_variable_reads(record_read), Interceptor(model, handler):
            problem.example_loss(list(trainable_values), _example(batched), shared)
        drew_globally = random_state is not None and not _same_state(random_state, adapter().random_state())
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
            rule, variables = FALLBACK, reads
            fallback_names.append(layer.name)
        calls.append(Call(record["index"], layer, rule, variables, record["specs"], record["arguments"],
                           record.get("input_shape")))
    every_read = root_reads + [v for record in records for v in record["reads"]]
    plan = Plan(calls, fallback_names, drew_globally or any(compat.is_seed_state(v) for v in every_read))
    if not plan.draws_random and not fallback_names:
        mark_whole_batch(problem, plan, trainable_values, batched, shared)
    return plan


def leading_one(shape) -> bool:
    """Whether a one-example dry run's shape has the batch-of-one axis."""
    return len(shape) > 0 and shape[0] == 1


def mark_whole_batch(problem, plan, trainable_values, batched, shared):
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

        out, inputs = call.rule.forward_and_inputs(layer, original, probe, args, kwargs)
        inputs = tuple(ops.shape(inputs))[:1]
        follows[position] = (inputs == (2,) and leading_one(call.input_shape)
                             and leading == [(2,)] and leading_one(call.specs[0][0]))
        return out

    # Stacked rows: a static leading axis of two even where the batch's is unknown (a TF retrace).
    pair = {key: tree.map_structure(lambda t: ops.stack([t[0], t[0]]), batched[key])
            for key in ("x", "y", "sample_weight") if batched.get(key) is not None}
    with Interceptor(problem.model, handler):
        problem.batch_loss(list(trainable_values), shared["non_trainable"], pair["x"], pair.get("y"),
                      pair.get("sample_weight"))
    plan.whole_batch = all(follows)


def cached_plan(problem, trainable_values, batched, shared) -> Plan:
    """The plan; made once per trace, or once per input signature and variables where steps run eagerly."""
    if not eager():  # (a graph's dry run apart from the step's graph, which would run it)
        return traced_apart(lambda: make_plan(problem, trainable_values, batched, shared))
    model = problem.model
    key = (
        tuple(id(v) for v in compat.trainable_variables(model)),
        tuple((tuple(t.shape[1:]), str(t.dtype)) for t in tree.flatten(batched)),
    )
    cache = problem.plans
    plan = cache.get(key)  # (read once: another thread may clear the cache meanwhile)
    if plan is None:
        try:
            plan = make_plan(problem, trainable_values, batched, shared)
        except Unsupported as error:
            plan = error  # found once, not on every step
        if len(cache) > _EAGER_PLANS:
            cache.clear()
        cache[key] = plan
    if isinstance(plan, Unsupported):
        raise plan
    return plan
