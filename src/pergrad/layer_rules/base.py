"""The layer-rule protocol and its registry (docs/architecture.md, 'The statistics path').

The statistics path (:mod:`pergrad.engine.statistics`) runs one forward pass of
every example and one backward pass, and captures, for every call of a layer
that reads trainable variables, the call's input ``A`` and the gradient ``D`` of
the batch loss with respect to one of the call's tensors (the *probe point*:
for ``Dense``, the output before the activation). Example i's gradient of the
layer's variables depends only on row i of ``A`` and ``D``; a rule turns them
into that gradient's statistics without building ``B x P`` tensors.

A rule is a :class:`LayerRule` subclass registered for a Keras layer class with
:func:`register_rule`; the rule of a layer is found along its class's MRO, and
applies only to layers whose ``call`` is the registered class's (a subclass
that redefines ``call`` computes something else and takes the fallback). Every
method sees tensors with the batch first, as the layer sees them in a batched
call: ``inputs`` is the call's first argument, ``delta`` has the shape of the
probe point; both are float32 (``inputs`` keeps an integer dtype), and
``delta`` is unscaled (mixed precision's loss scale removed).

Only :meth:`LayerRule.variables`, :meth:`LayerRule.forward` and
:meth:`LayerRule.per_example` are required; the statistics default to ones
computed from :meth:`LayerRule.per_example`, which a rule overrides with a
cheaper formula (the "ghost" norms of Dense), choosing per call with
:meth:`LayerRule.materializes`.

An input that does not depend on the example (a constant made in ``build()``,
``ops.arange`` positions, a weight) reaches the rule broadcast over the batch:
a leading axis of one is replaced by ``B``, a tensor without one gets ``B``
prepended, so that row i is always what example i's call saw.
"""

from __future__ import annotations

import contextlib
import threading

import keras
from keras import ops

from pergrad import compat
from pergrad.aggregators.base import example_weighted_sum, row_scales
from pergrad.backend import adapter
from pergrad.tensors import batch_size_of, example_rows, gram_block, is_float, scale_rows

_RULES: dict[type, LayerRule] = {}
# Rules for classes named by their dotted path (a package pergrad does not import,
# keras-hub): registered for the class when a layer of it is first looked up.
_NAMED_RULES: dict[str, type] = {}

# Values of the model's other variables while the engine computes statistics:
# a layer recomputed by :func:`per_example_vjp` may read them (a frozen moving
# mean), and Keras's JAX step has emptied the variables themselves. The engine
# holds them explicitly (``engine.layers.Layers.context``) and makes them the
# context only around its calls of a rule, on the calling thread; the rule
# methods' signatures (the public protocol, a user's rule included) do not carry
# them, so a rule reads them here, like the ``keras.StatelessScope`` it runs in
# (which Keras keeps per thread too). Per thread: models trained concurrently in
# threads (tf.distribute's replicas included) each see their own.
_CONTEXT = threading.local()


def _context_stack() -> list:
    if not hasattr(_CONTEXT, "stack"):
        _CONTEXT.stack = []
    return _CONTEXT.stack


@contextlib.contextmanager
def variable_values(pairs):
    """Makes ``(variable, value)`` pairs what :func:`per_example_vjp`'s layer calls read."""
    stack = _context_stack()
    stack.append(list(pairs))
    try:
        yield
    finally:
        stack.pop()


def register_rule(layer_class: type | str):
    """Class decorator: registers a :class:`LayerRule` subclass for ``layer_class``.

    Example::

        @pergrad.layer_rules.register_rule(MyScale)
        class MyScaleRule(pergrad.layer_rules.OutputRule):
            def variables(self, layer):
                return [layer.scale]

    ``layer_class`` may also be a class's dotted path (``"package.module.Class"``,
    its ``__module__`` and ``__qualname__``): the rule is then registered for that
    class when a layer of it is first looked up, and the module is never imported
    by pergrad (how the keras-hub rules are registered). A later registration for
    the same class replaces the earlier one.
    """
    if isinstance(layer_class, str):
        def decorate_later(rule_class):
            for cls in [cls for cls in _RULES if _dotted_path(cls) == layer_class]:
                del _RULES[cls]
            _NAMED_RULES[layer_class] = rule_class
            return rule_class

        return decorate_later
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"register_rule expects a Keras layer class, got {layer_class!r}.")

    def decorate(rule_class):
        rule = rule_class()
        rule.layer_class = layer_class
        _RULES[layer_class] = rule
        _NAMED_RULES.pop(_dotted_path(layer_class), None)
        return rule_class

    return decorate


def _dotted_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def registered_rules() -> dict[str, type]:
    """Every registration, read-only: the layer class's dotted path (``__module__`` and
    ``__qualname__``) to its rule class, for the classes registered directly and for those
    registered by path whose module has not been imported (keras-hub's)."""
    rules = {path: rule_class for path, rule_class in _NAMED_RULES.items()}
    rules.update({_dotted_path(cls): type(rule) for cls, rule in _RULES.items()})
    return dict(sorted(rules.items()))


def _registered(cls: type) -> LayerRule | None:
    named = _NAMED_RULES.get(_dotted_path(cls)) if cls not in _RULES else None
    if named is not None:
        register_rule(cls)(named)
    return _RULES.get(cls)


def rule_for(layer) -> LayerRule | None:
    """The rule that applies to ``layer``, or ``None`` (the layer then takes the fallback)."""
    for cls in type(layer).__mro__:
        rule = _registered(cls)
        if rule is not None:
            return rule if rule.applies(layer) else None
    return None


@contextlib.contextmanager
def replaced_attribute(obj, name: str, value):
    """Sets an instance attribute for the duration of a block, then restores the instance.

    Written to the instance's ``__dict__`` directly: no Keras tracking, no torch
    module registration, and an attribute that came from the class comes from it again.
    """
    state = vars(obj)
    had, old = name in state, state.get(name)
    state[name] = value
    try:
        yield
    finally:
        if had:
            state[name] = old
        else:
            del state[name]


class LayerRule:
    """How the statistics path handles the layers of one class."""

    #: The layer class the rule was registered for (set by :func:`register_rule`).
    layer_class: type | None = None

    def applies(self, layer) -> bool:
        """Whether the rule handles ``layer``; by default, when ``call`` is not redefined."""
        return type(layer).call is self.layer_class.call

    def variables(self, layer) -> list:
        """The trainable variables the rule gives gradients of, in the order of its results."""
        raise NotImplementedError

    def call_variables(self, layer, args, kwargs) -> list:
        """The variables one call gives gradients of (by default :meth:`variables`): a
        layer whose calls read different variables (``ReversibleEmbedding`` with an
        untied output table) says which."""
        del args, kwargs
        return self.variables(layer)

    def call_inputs(self, layer, args, kwargs):
        """The tensor the statistics receive as ``inputs``: by default the call's first argument."""
        del layer, kwargs
        return args[0]

    def forward(self, layer, call, probe, args, kwargs):
        """The layer's call with ``probe`` applied to the tensor whose gradient is ``delta``.

        Args:
            layer: the layer.
            call: its original ``call`` method (bound).
            probe: a function ``t -> t`` (plus a zero tensor) to apply once.
            args, kwargs: the call's arguments.
        """
        raise NotImplementedError

    def forward_and_inputs(self, layer, call, probe, args, kwargs):
        """``(output, inputs)``: :meth:`forward`'s output and the tensor the statistics
        receive as ``inputs`` (by default :meth:`call_inputs`). A rule whose ``inputs``
        are made by its forward pass (a recurrent layer's state before each step)
        returns them from it."""
        return self.forward(layer, call, probe, args, kwargs), self.call_inputs(layer, args, kwargs)

    def per_example(self, layer, values, inputs, delta) -> list:
        """Example i's gradient of every variable: ``(B,) + variable.shape`` each.

        ``values`` are the variables' current values (in :meth:`variables` order).
        """
        raise NotImplementedError

    def materializes(self, layer, inputs, delta) -> bool:
        """Whether to compute the statistics from :meth:`per_example` (decided from static shapes)."""
        return True

    def factors(self, layer, values, inputs, delta) -> list | None:
        """Example i's gradient of each variable as a sum of outer products, or ``None``.

        One ``(left, right)`` pair per variable: ``right`` is ``(B, n, q)`` and
        ``left`` either ``(B, n, p)`` floats or ``(B, n)`` integer ids (rows of the
        identity, ``p`` wide); example i's gradient, reshaped to ``(p, q)``, is
        ``sum_t left_it ⊗ right_it``. The engine needs them only for a variable
        that several calls read (a tied embedding): the norm of a sum of such
        gradients follows from their pairwise inner products
        (:func:`factor_inner_products`), without forming any of them.
        """
        return None

    def squared_norms(self, layer, values, inputs, delta) -> list:
        """``(B,)`` squared norms of example i's gradient, one per variable."""
        grads = self.per_example(layer, values, inputs, delta)
        return [ops.sum(ops.square(example_rows(g)), axis=1) for g in grads]

    def scaled_squared_norms(self, layer, values, inputs, delta):
        """``(norms, scales)``: :meth:`squared_norms` of example i's gradients divided by
        ``scales[m][i]`` (``(B,)`` each), computed so that none overflows float32.

        The engine calls it only for a batch in which a squared norm overflowed. By
        default ``delta`` is divided by each example's largest entry: a gradient is
        linear in ``delta`` (it is the vjp of the layer with ``delta``), so the norms
        scale exactly. Rules whose gradients are also linear in ``inputs`` divide
        those too (:class:`PreActivationRule`).
        """
        scale = row_scales(delta)
        norms = self.squared_norms(layer, values, inputs, divide_rows(delta, scale))
        return norms, [scale] * len(norms)

    def gram(self, layer, values, inputs, delta):
        """``(B, B)``: ``<g_i, g_j>`` summed over the rule's variables."""
        return self.cross_gram_of_rows(layer, values, inputs, delta, None)

    def cross_gram(self, layer, values, inputs, delta, split: int):
        """``(split, B - split)``: ``<g_i, g_j>`` for ``i < split <= j``, summed over the rule's
        variables (the off-diagonal block of :meth:`gram`; ``pergrad.scores``' influence of
        the first ``split`` examples on the others). By default the block of the rule's own
        :meth:`gram` where it has one, else from :meth:`per_example`: ``split x (B - split)``
        dot products instead of ``B x B``."""
        if type(self).gram is not LayerRule.gram:
            return self.gram(layer, values, inputs, delta)[:split, split:]
        return self.cross_gram_of_rows(layer, values, inputs, delta, split)

    def cross_gram_of_rows(self, layer, values, inputs, delta, split: int):
        """:meth:`cross_gram` from :meth:`per_example` (for the rules' own fallbacks; with
        ``split=None`` the whole :meth:`gram`)."""
        rows = [example_rows(g) for g in self.per_example(layer, values, inputs, delta)]
        return sum(gram_block(r, split) for r in rows)

    def sum_grad_squared(self, layer, values, inputs, delta) -> list:
        """``sum_i g_i ** 2`` per coordinate, one tensor of each variable's shape.

        The per-coordinate second moment of the batch's gradients (BackPACK's
        ``SumGradSquared``; Dangel, Kunstner, Hennig, ICLR 2020), which the gradient
        signal-to-noise ratio needs (``pergrad.insight.diagnostics``). By default from
        :meth:`per_example`; ``Dense`` without a sequence axis and ``Embedding``
        override it with formulas in ``A`` and ``D``.
        """
        return [ops.sum(ops.square(g), axis=0) for g in self.per_example(layer, values, inputs, delta)]

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        """``sum_i w_i g_i`` per variable; ``weights`` holds one ``(B,)`` tensor per variable."""
        return [example_weighted_sum(g, w)
                for g, w in zip(self.per_example(layer, values, inputs, delta), weights)]

    def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
        """A linear map of the batch applied to every variable's per-example gradients.

        ``rows`` is a :class:`pergrad.aggregators.base.RowMap` (output row ``j`` is
        ``sum_t w_jt g_{order_jt}``: clipped, filtered or bucket-averaged examples)
        and ``columns[m]`` the column of the rule's ``m``-th variable in its
        weights. Returns ``(J,) + variable.shape`` per variable. By default from
        :meth:`per_example`; rules whose gradient is linear in ``delta`` and sums
        over positions override it to map ``A`` and ``D`` first (only ``J``
        gradients formed).
        """
        grads = self.per_example(layer, values, inputs, delta)
        return [rows.apply(g, k) for g, k in zip(grads, columns)]

    def all_finite(self, layer, inputs, delta):
        """Whether every example's gradient of the rule's variables is finite, as a scalar
        boolean computed from ``A`` and ``D`` alone, or ``None`` when that takes the
        gradients themselves (the streaming path then checks what it forms)."""
        return None

    def mapped_pieces(self, layer, values, inputs, delta, rows, columns, pieces: int):
        """:meth:`mapped` in up to ``pieces`` parts per variable, to bound memory.

        Yields ``(m, part)``: the parts of the ``m``-th variable's result, in order,
        concatenated along axis 0 give :meth:`mapped`'s. By default one part each;
        ``Dense`` splits its kernel by input features.
        """
        del pieces
        yield from enumerate(self.mapped(layer, values, inputs, delta, rows, columns))


def context_values() -> list:
    """The ``(variable, value)`` pairs of :func:`variable_values` (empty outside the engine)."""
    stack = _context_stack()
    return list(stack[-1]) if stack else []


def layer_context(layer) -> list:
    """:func:`context_values` of ``layer``'s own variables (its sublayers' included): the
    state a rule needs to recompute a layer that reads no other layer's variables. A
    ``StatelessScope`` converts every pair it is given (~10 us each on torch): a
    keras-hub model's full context costs ~0.4 ms per scope."""
    own = {id(v) for v in layer.variables}
    return [(v, value) for v, value in context_values() if id(v) in own]


def per_example_vjp(function, variables, values, inputs, delta) -> list:
    """Example i's gradient of ``<function(inputs_i), delta_i>`` w.r.t. ``variables``.

    ``inputs`` and ``delta`` are nests of tensors with the batch first; row i of
    each is what one example's call saw (``function`` gets the rows without the
    batch axis, exactly as in that call). ``function`` reads ``variables``,
    whose values are ``values``, through a ``StatelessScope``. Vectorized over
    the batch by the backend: the per-example gradient of one layer only.
    """

    def example_loss(params, example, shared):
        del shared
        with keras.StatelessScope(state_mapping=context_values() + list(zip(variables, params))):
            output = function(example["inputs"])
        total = 0.0
        for out, d in zip(keras.tree.flatten(output), keras.tree.flatten(example["delta"])):
            total = total + ops.sum(ops.cast(out, "float32") * ops.cast(d, "float32"))
        return total, {}

    grads, _ = adapter().vectorized_grad(
        example_loss, list(values), {"inputs": inputs, "delta": delta}, {}, None
    )
    return grads


def reduce_to(delta, shape):
    """Example i's gradient of a bias of ``shape`` broadcast-added to the rows of ``delta``."""
    per_example = tuple(delta.shape[1:])
    leading = len(per_example) - len(shape)
    axes = list(range(1, 1 + leading))
    axes += [1 + leading + k for k, size in enumerate(shape) if size == 1 and per_example[leading + k] != 1]
    summed = ops.sum(delta, axis=axes) if axes else delta
    if tuple(summed.shape[1:]) == tuple(shape):  # (no reshape op: each costs on torch)
        return summed
    return ops.reshape(summed, (batch_size_of(delta),) + tuple(shape))


def slot_rows(tensor, rows, column=None):
    """The rows of ``tensor`` (batch first) in ``rows.order``'s slots, ``(J * s, ...)``,
    times the slot weights of variable ``column`` when it is given."""
    if rows.order is not None:
        tensor = ops.take(tensor, ops.reshape(rows.order, (-1,)), axis=0)
    weights = None if column is None else rows.variable_weights(column)
    if weights is None:
        return tensor
    return scale_rows(tensor, ops.reshape(weights, (-1,)))


def joined_slots(tensor, rows):
    """``(J * s, n, ...) -> (J, s * n, ...)``: each output row's examples as one
    sequence of positions (identity when ``rows.order`` is ``None``)."""
    if rows.order is None:
        return tensor
    count = ops.shape(rows.order)[0]
    return ops.reshape(tensor, (count, -1) + tuple(tensor.shape[2:]))


def factor_inner_products(first, second):
    """``(B,)``: ``<g_i, h_i>`` of two gradients given as :meth:`LayerRule.factors` pairs.

    ``sum_{t,s} (l_t . l'_s)(r_t . r'_s)`` over the positions of both, where an
    id's product with a row is the row's entry at the id (a gather), and two ids'
    is whether they are equal: ``B n n' (q + p)`` work, never ``B p q`` at once (two
    sums of outer products of rows: :func:`outer_inner_products`, whose blocks of the
    formed gradients are no larger than the ``n x n'`` matrices).
    """
    (left, right), (other_left, other_right) = first, second
    ids, other_ids = not is_float(left), not is_float(other_left)
    if not (ids or other_ids):  # two sums of outer products of rows
        if first is second:
            return outer_inner_products(left, right)
        return outer_inner_products(left, right, other_left, other_right)
    rights = ops.einsum("btq,bsq->bts", right, other_right)
    if ids and other_ids:
        lefts = ops.cast(ops.equal(left[:, :, None], other_left[:, None, :]), rights.dtype)
    else:
        table, index = (other_left, left) if ids else (left, other_left)
        shape = (ops.shape(table)[0], ops.shape(table)[1], ops.shape(index)[1])
        picked = ops.take_along_axis(table, ops.broadcast_to(index[:, None, :], shape), axis=2)
        lefts = ops.transpose(picked, (0, 2, 1)) if ids else picked  # (B, n, n')
    return ops.sum(lefts * rights, axis=(1, 2))


def gram_memory(positions: int, other_positions: int | None = None) -> int:
    """Per example, the elements the Gram formula ``sum (A A'ᵀ) ∘ (D D'ᵀ)`` holds at once:
    the two ``n x n'`` matrices and their product."""
    return 3 * positions * (positions if other_positions is None else other_positions)


def _static(*tensors):
    """``(n, p)`` of each ``(B, n, p)`` tensor, or ``None`` when one is not static."""
    sizes = [tuple(t.shape[1:]) for t in tensors]
    return None if any(len(s) != 2 or None in s for s in sizes) else sizes


def _formed_is_cheaper(a, d, other_a=None, other_d=None) -> bool:
    """Whether ``<A_iᵀ D_i, A'_iᵀ D'_i>`` costs fewer multiply-adds from the formed
    ``p x q`` gradients, ``(n + n') p q`` (``n p q`` for a squared norm), than from the
    Gram matrices, ``n n' (p + q)``."""
    same = other_a is None
    sizes = _static(a, d) if same else _static(a, d, other_a, other_d)
    if sizes is None:
        return False
    (n, p), (_, q) = sizes[:2]
    m = n if same else sizes[2][0]
    return (n if same else n + m) * p * q < n * m * (p + q)


def outer_inner_products(a, d, other_a=None, other_d=None):
    """``(B,)``: ``<A_iᵀ D_i, A'_iᵀ D'_i>`` for ``(B, n, p)`` ``A`` and ``(B, n, q)`` ``D``
    (``other_a`` ``None``: ``||A_iᵀ D_i||²``).

    From the Gram matrices, ``sum (A A'ᵀ) ∘ (D D'ᵀ)`` (``B n n' (p + q)`` work), or,
    where that costs more (the positions outnumber ``pq / (p + q)``; Li et al. 2022
    compare the same two costs), from the per-example gradients formed a block of
    columns of the larger side at a time (``B (n + n') p q``), each block no larger
    than the Gram matrices (:func:`gram_memory`): the cheaper arithmetic, never more memory.
    """
    same = other_a is None
    formed = _formed_is_cheaper(a, d, other_a, other_d)
    other_a, other_d = (a, d) if same else (other_a, other_d)
    if not formed:
        aa = ops.einsum("bnp,bmp->bnm", a, other_a)
        dd = ops.einsum("bnq,bmq->bnm", d, other_d)
        return ops.sum(aa * dd, axis=(1, 2))
    (n, p), (_, q), (m, _), _ = _static(a, d, other_a, other_d)
    # Columns of the larger side per block, so that the blocks held at once (the block,
    # its square; or two blocks and their product) are no larger than the Gram matrices.
    block = max(1, gram_memory(n, m) // (min(p, q) * (2 if same else 3)))
    total = 0.0
    for start in range(0, max(p, q), block):
        columns = slice(start, start + block)
        g = _gradient_block(a, d, columns)
        other = g if same else _gradient_block(other_a, other_d, columns)
        total = total + ops.sum(g * other, axis=(1, 2))
    return total


def _gradient_block(a, d, columns):
    """``(B, smaller side, block)``: the columns ``columns`` of the wider side of every
    ``A_iᵀ D_i`` (the smaller side first: the faster matmul on torch's CPU)."""
    if d.shape[-1] >= a.shape[-1]:
        return ops.einsum("bnp,bnq->bpq", a, d[..., columns])
    return ops.einsum("bnq,bnp->bqp", d, a[..., columns])


def divide_rows(tensor, scales):
    """Example i's rows of ``tensor`` (batch first) divided by ``scales[i]``."""
    return tensor / ops.reshape(ops.cast(scales, tensor.dtype), (-1,) + (1,) * (len(tensor.shape) - 1))


def _batch_of_one(tensor):
    return ops.expand_dims(tensor, 1)


class OutputRule(LayerRule):
    """The probe on the layer's output; per-example gradients by a vjp of the layer alone.

    Exact for any layer whose variables are its own (read in its own ``call``):
    the fallback for layers without a rule is this rule with the variables the
    call reads. Cheap when the variables are small (normalization layers).
    """

    def variables(self, layer) -> list:
        return compat.own_trainable_variables(layer)

    def forward(self, layer, call, probe, args, kwargs):
        return probe(call(*args, **kwargs))

    def per_example(self, layer, values, inputs, delta) -> list:
        return per_example_vjp(
            layer, self.variables(layer), values, _batch_of_one(inputs), _batch_of_one(delta)
        )


class PreActivationRule(LayerRule):
    """The probe before the layer's activation (``Dense``, ``EinsumDense``, convolutions).

    The layer's own ``call`` computes the pre-activation output with its
    ``activation`` set to ``None`` for the call; the rule then applies the
    activation. Per-example gradients by a vjp of that pre-activation call.
    """

    def applies(self, layer) -> bool:
        return (
            super().applies(layer)
            and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None
        )

    def variables(self, layer) -> list:
        return compat.own_trainable_variables(layer)

    def forward(self, layer, call, probe, args, kwargs):
        activation = layer.activation
        with replaced_attribute(layer, "activation", None):
            out = call(*args, **kwargs)
        out = probe(out)
        return out if activation is None else activation(out)

    def scaled_squared_norms(self, layer, values, inputs, delta):
        # Every variable but the bias has a gradient linear in the inputs too (the
        # kernel's is A_i^T D_i): divide both, the bias's norm scales with D's only.
        scale = row_scales(delta)
        input_scale = row_scales(inputs) if is_float(inputs) else ops.ones_like(scale)
        norms = self.squared_norms(
            layer, values, divide_rows(inputs, input_scale), divide_rows(delta, scale)
        )
        bias = getattr(layer, "bias", None)
        return norms, [scale if v is bias else scale * input_scale for v in self.variables(layer)]

    def pre_activation(self, layer, inputs):
        """The layer's output before its activation, from a batched call."""
        with replaced_attribute(layer, "activation", None):
            return layer(inputs)

    def per_example(self, layer, values, inputs, delta) -> list:
        return per_example_vjp(
            lambda x: self.pre_activation(layer, x), self.variables(layer), values,
            _batch_of_one(inputs), _batch_of_one(delta),
        )
