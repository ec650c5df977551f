"""The statistics path's per-layer store: every planned call's ``A`` and ``D``, and the
per-example statistics made from them by the calls' layer rules.

From ``A`` and ``D`` the rules give per-example squared norms, the Gram matrix and,
once the aggregator's weights are known, ``sum_i w_i g_i`` (docs/architecture.md,
'The statistics path'). A variable read by several calls (a layer called twice, a
variable shared by two layers) has its per-example gradients formed and summed first.
"""

from __future__ import annotations

import copy
import functools

from keras import ops, tree

from pergrad.aggregators.base import (
    RowMap,
    example_squared_norms,
    example_weighted_sum,
    overflow_safe,
    row_scales,
    row_squared_norms,
    scaled_squared_norms_of_rows,
    stack_columns,
    zero_examples,
)
from pergrad.engine.plan import is_tensor, leading_one
from pergrad.layer_rules.base import (
    divide_rows,
    factor_inner_products,
    per_example_vjp,
    variable_values,
)
from pergrad.tensors import as_float32, cast, example_rows, gram_block, is_float

_IDENTITY = RowMap()


def _scaled_factors(parts):
    """``(parts, scale)``: outer-product pieces of one gradient, all divided by the same
    ``(B,)`` scale with every factor's entries at most one (no product overflows).

    Piece ``c`` (``sum_t l_t ⊗ r_t``) is bilinear: its left factor divided by its own
    largest entry ``a_c`` and its right by ``scale / a_c``, where ``scale`` is the
    largest ``a_c`` times the right factor's largest entry; ids stay as they are.
    """
    lefts = [row_scales(left) if is_float(left) else None for left, _ in parts]
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


def _in_context(method):
    """``method`` run with the model's variable values as the layer rules' context."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with variable_values(self.context):
            return method(self, *args, **kwargs)

    return run


class Layers:
    """Every planned call's ``A`` and ``D``, and the statistics made from them.

    ``context`` holds the ``(variable, value)`` pairs of the model's variables: a
    layer that a rule recomputes may read any of them (a frozen moving mean), and
    Keras's JAX step has emptied the variables themselves. Every method that calls
    the rules makes them the rules' context (``layer_rules.base.variable_values``)
    for its own duration, on the calling thread: never across a collective.
    """

    def __init__(self, plan, captured, deltas, values, variables, inverse_scale, whole_batch=False,
                 context=()):
        self.plan, self.values_of = plan, dict(zip(map(id, variables), values))
        self.context = list(context)
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
                inputs = ops.squeeze(inputs, 1) if leading_one(call.input_shape) else inputs
                delta = ops.squeeze(delta, 1) if leading_one(call.specs[0][0]) else delta
            delta = as_float32(delta)
            self.inputs.append(as_float32(inputs))
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
        self._ghosts = {}  # (this step's: from the calls' static shapes)

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
            return function(t) if is_tensor(t) else t

        other.inputs = [tree.map_structure(apply, t) for t in self.inputs]
        other.deltas = [tree.map_structure(apply, t) for t in self.deltas]
        other._materialized, other._ghosts = {}, {}
        return other

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

    @_in_context
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
        parts = self._mapped(rows, variables, batch_size, pieces)
        while True:
            with variable_values(self.context):  # (not held open while the caller works)
                part = next(parts, None)
            if part is None:
                return
            yield part

    def _mapped(self, rows, variables, batch_size, pieces):
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
        ghost = self._ghosts.get(position)
        if ghost is None:
            call = self.plan.calls[position]
            ghost = self._ghosts[position] = not (call.fallback or call.rule.materializes(
                call.layer, self.inputs[position], self.deltas[position]))
        return ghost

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
                    rows = example_rows(g, "float32")
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
                out[k] = (row_squared_norms(rows), None)
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
        call's per-example gradients (float32, batch first, each variable's shape); both
        also get ``arguments(call)``."""
        for position, call in enumerate(self.plan.calls):
            if self.shared[position] and not every_call:
                continue
            extra = arguments(call)
            if self._ghost(position):
                value = getattr(call.rule, statistic)(
                    call.layer, self._values(call), self.inputs[position], self.deltas[position], *extra
                )
            else:
                value = from_rows([as_float32(g) for g in self._per_example(position)], *extra)
            yield call, value

    @_in_context
    def squared_norms(self, batch_size, rescale: bool = True):
        """``((B, V) squared norms, (B, V) scale)``: divided by the scale squared, computed
        again with rescaled ``A``, ``D`` and rows only if one overflowed
        (:func:`~pergrad.aggregators.base.overflow_safe`). Without ``rescale``, the plain
        float32 values and a scale of ``None`` (no conditional: the diagnostics')."""

        def columns(scaled):
            norms, scales = [None] * self.count, [None] * self.count

            def from_rows(grads):
                if scaled:
                    return scaled_squared_norms_of_rows([example_rows(g) for g in grads])
                return [example_squared_norms(g) for g in grads]

            def keep(indices, value):
                found, found_scales = value if scaled else (value, [None] * len(value))
                for k, n, scale in zip(indices, found, found_scales):
                    norms[k], scales[k] = as_float32(n), scale

            statistic = "scaled_squared_norms" if scaled else "squared_norms"
            for call, value in self._per_call(statistic, from_rows):
                keep([self.index_of[id(v)] for v in call.variables], value)
            for k, (n, scale) in self._shared_squared_norms(scaled).items():
                norms[k], scales[k] = n, scale
            if any(n is None for n in norms):  # a variable no call reads
                zeros = ops.zeros((batch_size,), "float32")
                norms = [zeros if n is None else n for n in norms]
            if not scaled:
                return norms, None
            ones = ops.ones((batch_size,), "float32")
            return norms, [ones if s is None else as_float32(s) for s in scales]

        def rescaled():
            norms, scales = columns(True)
            return stack_columns(norms), stack_columns(scales)

        plain = stack_columns(columns(False)[0])
        if not rescale:
            return plain, None
        return overflow_safe(plain, rescaled)

    @_in_context
    def gram(self, batch_size):
        total = ops.zeros((batch_size, batch_size), "float32")
        def from_rows(grads):
            return sum(gram_block(example_rows(g)) for g in grads)

        for _, part in self._per_call("gram", from_rows):
            total = total + ops.cast(part, "float32")
        for rows in self._shared_variables().values():
            total = total + gram_block(rows)
        return total

    @_in_context
    def cross_gram(self, split: int):
        """``(split, B - split)``: ``<g_i, g_j>`` for ``i < split <= j`` (the off-diagonal
        block of :meth:`gram`, each rule's :meth:`~pergrad.layer_rules.LayerRule.cross_gram`)."""

        def from_rows(grads, _split=None):
            return sum(gram_block(example_rows(g), split) for g in grads)

        total = 0.0
        for _, part in self._per_call("cross_gram", from_rows, lambda call: (split,)):
            total = total + ops.cast(part, "float32")
        for rows in self._shared_variables().values():
            total = total + from_rows([rows])
        return total

    @_in_context
    def sum_grad_squared(self, variables):
        """``sum_i g_i ** 2`` per coordinate of every variable (float32, the variables'
        shapes; zeros for a variable no call reads): the rule's formula
        (:meth:`~pergrad.layer_rules.LayerRule.sum_grad_squared`) or the squares of the
        call's per-example gradients; a variable several calls read, from their
        per-example gradients summed."""

        def from_rows(grads):
            return [ops.sum(g * g, axis=0) for g in grads]

        out = [None] * self.count
        for call, parts in self._per_call("sum_grad_squared", from_rows):
            for v, part in zip(call.variables, parts):
                out[self.index_of[id(v)]] = ops.reshape(ops.cast(part, "float32"), v.shape)
        for k, rows in self._shared_variables().items():
            out[k] = ops.reshape(ops.sum(rows * rows, axis=0), variables[k].shape)
        return [ops.zeros(v.shape, "float32") if s is None else s for s, v in zip(out, variables)]

    @_in_context
    def weighted_sums(self, weights, variables):
        """``sum_i w_i g_i`` for every variable; ``weights`` ``(B,)`` or ``(B, V)``.

        Linear in each call's gradient: a variable that several calls read gets the
        sum of their weighted sums (each by its rule's formula where it has one)."""

        def weight(v):
            w = weights if len(weights.shape) == 1 else weights[:, self.index_of[id(v)]]
            return as_float32(w)

        def from_rows(grads, ws):
            return [example_weighted_sum(g, w) for g, w in zip(grads, ws)]

        out = [None] * self.count
        calls = self._per_call("weighted_sum", from_rows, lambda call: ([weight(v) for v in call.variables],),
                               every_call=True)
        for call, sums in calls:
            for v, part in zip(call.variables, sums):
                k = self.index_of[id(v)]
                part = as_float32(part)
                if tuple(part.shape) != tuple(v.shape):
                    part = ops.reshape(part, v.shape)
                out[k] = part if out[k] is None else out[k] + part
        return [
            ops.zeros(v.shape, v.dtype) if s is None else cast(s, v.dtype)
            for s, v in zip(out, variables)
        ]
