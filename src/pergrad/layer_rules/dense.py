"""``Dense``: ghost norms, Gram matrix and weighted sums from ``A`` and ``D``.

With the input ``A_i`` of example i flattened to ``(n, d_in)`` (``n = 1`` for a
2-D input, ``T`` for a sequence) and the pre-activation gradient ``D_i`` to
``(n, d_out)``, the kernel's per-example gradient is ``A_i^T D_i`` and the
bias's ``sum_t D_it``. Without forming them (Goodfellow 2015; Li et al. 2022):

- ``||A_i^T D_i||^2 = sum_{t,s} (a_t . a_s)(d_t . d_s)``: ``n^2 (d_in + d_out)``
  per example instead of ``d_in d_out``, chosen when the formed gradients would
  hold more than its ``3 n^2`` (:func:`outer_materializes`); with more positions
  than ``d_in d_out / (d_in + d_out)`` the gradients formed a block at a time cost
  less and hold no more;
- ``<g_i, g_j> = (A A^T)_{ij} (D D^T)_{ij}`` for ``n = 1``;
- ``sum_i w_i A_i^T D_i = A^T diag(w) D``: one matmul, as in a plain backward pass.

A LoRA layer (``enable_lora(rank)``: ``y = x (W + s A B) + b``, ``s = alpha /
rank``; Hu et al. 2021) is three such products: ``A``'s gradient is that of a
Dense layer with input ``x`` and output gradient ``s D B^T``, ``B``'s that of
one with input ``s x A`` and output gradient ``D`` — small matrices, the same
formulas, the frozen ``W`` never formed per example. The module-level functions
are these formulas on one ``(a, d)`` pair, for the rules that reuse them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import keras
from keras import ops

from pergrad.backend import optional_kernel
from pergrad.layer_rules.base import (
    LayerRule,
    PreActivationRule,
    context_values,
    gram_memory,
    joined_slots,
    outer_inner_products,
    register_rule,
    slot_rows,
)
from pergrad.tensors import gram_block


def _flat(inputs, delta):
    """``(B, n, d_in)``, ``(B, n, d_out)``."""
    if len(inputs.shape) == 3:
        return inputs, delta
    if len(inputs.shape) == 2:
        return inputs[:, None, :], delta[:, None, :]
    batch = ops.shape(delta)[0]
    a = ops.reshape(inputs, (batch, -1, inputs.shape[-1]))
    d = ops.reshape(delta, (batch, -1, delta.shape[-1]))
    return a, d


def sequence_positions(inputs) -> int | None:
    """``n``: the positions per example (the static product of the middle axes)."""
    middle = tuple(inputs.shape[1:-1])
    return math.prod(middle) if all(m is not None for m in middle) else None


def outer_materializes(positions: int | None, d_in: int, d_out: int) -> bool:
    """Whether the statistics of a ``(d_in, d_out)`` kernel's ``A_i^T D_i`` over
    ``positions`` come from the formed gradients, kept until the weighted sum (decided
    from static shapes).

    Formed: ``n d_in d_out`` multiply-adds per example (the per-example product; the
    squares and the weighted sum then cost ``d_in d_out`` each), ``d_in d_out`` held.
    The ghost formula: ``n^2 (d_in + d_out)`` for its Gram matrices (or ``n d_in d_out``
    formed a block at a time, :func:`~pergrad.layer_rules.base.outer_inner_products`)
    plus the weighted sum's ``n d_in d_out`` matmul, ``3 n^2`` held
    (:func:`~pergrad.layer_rules.base.gram_memory`). Formed when it costs fewer
    multiply-adds and holds no more than the ghost formula would: a layer as wide as
    ``d = 4096`` at ``n = 2048`` keeps the ghost formula.
    """
    if positions is None:
        return True
    if positions <= 1:
        return False
    size = d_in * d_out
    formed = positions * size + 2 * size
    ghost = min(positions * positions * (d_in + d_out), positions * size) + positions * size
    return formed <= ghost and size <= gram_memory(positions)


def outer_per_example(inputs, delta):
    """``(B, d_in, d_out)``: every example's ``A_i^T D_i``."""
    if len(inputs.shape) == 2:  # an outer product per example
        return inputs[:, :, None] * delta[:, None, :]
    a, d = _flat(inputs, delta)
    fast = optional_kernel("outer_per_example")
    return ops.einsum("bni,bno->bio", a, d) if fast is None else fast(a, d)


def _single_slots(rows) -> bool:
    """Whether each output row of the map is one example's (scaled): no order, or one slot."""
    return rows.order is None or rows.order.shape[1] == 1


class OuterRows:
    """A 2-D input's kernel rows ``a_j ⊗ d_j`` (``(J, d_in, d_out)``) as their factors ``a``
    (``(J, d_in)``) and ``d`` (``(J, d_out)``): what :meth:`DenseRule.mapped_pieces`
    gives within :func:`outer_rows`, for ``pergrad.aggregators.selection``'s median and
    trimmed mean (the torch adapter forms, sorts and sums them a block at a time), which
    form them in ``pieces`` parts (:meth:`formed_parts`) where they cannot."""

    def __init__(self, a, d, pieces: int = 1):
        self.a, self.d, self.pieces = a, d, pieces

    @property
    def outer_factors(self):
        return self.a, self.d

    @property
    def shape(self):
        return (self.a.shape[0], self.a.shape[1], self.d.shape[1])

    def formed(self):
        """The ``(J, d_in, d_out)`` products, as :meth:`DenseRule.mapped` forms them."""
        return self.a[:, :, None] * self.d[:, None, :]

    def formed_parts(self):
        """:meth:`formed` in up to ``pieces`` parts along ``d_in``, as
        :meth:`DenseRule.mapped_pieces` splits a kernel."""
        size = self.a.shape[1]
        step = -(-size // max(1, min(self.pieces, size)))
        for start in range(0, size, step):
            yield OuterRows(self.a[:, start:start + step], self.d).formed()

    def all_finite(self):
        """Whether every product is finite, from the factors (:meth:`DenseRule.all_finite`'s
        argument: exact)."""
        largest = ops.max(ops.abs(self.a), axis=1) * ops.max(ops.abs(self.d), axis=1)
        return ops.all(ops.isfinite(self.a)) & ops.all(ops.isfinite(self.d)) & ops.all(ops.isfinite(largest))


_OUTER_ROWS = contextvars.ContextVar("pergrad_outer_rows", default=False)


@contextlib.contextmanager
def outer_rows(enabled=True):
    """Within it, :meth:`DenseRule.mapped_pieces` gives a 2-D input's kernel parts (also
    LoRA's), where each row is one example's (no row map's order, or one of one slot:
    a filter's), whole as :class:`OuterRows` (formed in ``pieces`` parts where needed)."""
    token = _OUTER_ROWS.set(bool(enabled))
    try:
        yield
    finally:
        _OUTER_ROWS.reset(token)


def outer_squared_norms(inputs, delta):
    """``(B,)``: ``||A_i^T D_i||^2`` by the ghost formula."""
    if len(inputs.shape) == 2:  # the common case, without reshapes (each op costs on torch)
        return _row_squared_norms(inputs) * _row_squared_norms(delta)
    a, d = _flat(inputs, delta)
    if a.shape[1] == 1:
        return ops.sum(ops.square(a[:, 0]), axis=1) * ops.sum(ops.square(d[:, 0]), axis=1)
    return outer_inner_products(a, d)


def outer_weighted_sum(inputs, delta, weights):
    """``(d_in, d_out)``: ``sum_i w_i A_i^T D_i = (diag(w) A)^T D``."""
    if len(inputs.shape) == 2:
        fast = optional_kernel("outer_weighted_sum_2d")
        if fast is not None:
            return fast(inputs, delta, weights)
        return ops.matmul(ops.transpose(inputs), delta * weights[:, None])
    a, d = _flat(inputs, delta)
    # The weights scale the input side: an LM head's D (B x T x vocabulary) is the larger.
    rows = ops.reshape(a * ops.cast(weights[:, None, None], a.dtype), (-1, ops.shape(a)[-1]))
    return ops.matmul(ops.transpose(rows), ops.reshape(d, (-1, ops.shape(d)[-1])))


def _row_squared_norms(rows):
    """``(B,)``: each row's squared norm of a ``(B, n)`` tensor."""
    fast = optional_kernel("row_squared_norms_2d")
    return ops.sum(ops.square(rows), axis=1) if fast is None else fast(rows)


def _bias_squared_norms(delta):
    if len(delta.shape) == 2:
        return _row_squared_norms(delta)
    _, d = _flat(delta, delta)
    return ops.sum(ops.square(ops.sum(d, axis=1)), axis=1)


def _bias_weighted_sum(delta, weights):
    if len(delta.shape) == 2:
        fast = optional_kernel("weighted_row_sum_2d")
        return ops.matmul(weights[None, :], delta)[0] if fast is None else fast(delta, weights)
    _, d = _flat(delta, delta)
    return ops.sum(d * weights[:, None, None], axis=(0, 1))


def variable_value(variable, variables, values):
    """The current value of ``variable``: one of the rule's (``values``), else the engine's."""
    for v, value in zip(variables, values or ()):
        if v is variable:
            return value
    for v, value in context_values():
        if v is variable:
            return value
    return variable.value


def lora_scale(layer) -> float:
    return layer.lora_alpha / layer.lora_rank


def outer_gram(pieces, split=None):
    """``sum (A Aᵀ) * (D Dᵀ)`` over ``(A, D)`` pieces (``A`` None: ``D Dᵀ``, a bias): the
    Gram matrix of per-example gradients ``a_i ⊗ d_i`` without forming them, or its block
    ``[:split, split:]`` (:func:`~pergrad.tensors.gram_block`)."""
    total = 0.0
    for a, d in pieces:
        dd = gram_block(ops.reshape(d, (ops.shape(d)[0], -1)), split)
        if a is not None:
            dd = gram_block(ops.reshape(a, (ops.shape(a)[0], -1)), split) * dd
        total = total + dd
    return total


@register_rule(keras.layers.Dense)
class DenseRule(PreActivationRule):
    def applies(self, layer) -> bool:  # LoRA layers too
        return LayerRule.applies(self, layer) and getattr(layer, "quantization_mode", None) is None

    def _parts(self, layer):
        """Which of (kernel, bias, lora_a, lora_b) the rule's variables are, in order."""
        # (an absent attribute of a torch layer costs a raised AttributeError: LoRA's asked only
        # of a layer with LoRA on)
        lora = ("lora_kernel_a", "lora_kernel_b") if self._lora(layer) else ()
        names = {id(getattr(layer, name, None)): name for name in ("bias",) + lora}
        return [names.get(id(v), "kernel") for v in self.variables(layer)]

    def _pieces(self, layer, values, inputs, delta):
        """Per variable, the ``(a, d)`` of a Dense product whose kernel it is, or ``(None, d)``
        for the bias: ``(x, D)`` for the kernel; under LoRA ``(x, s D B^T)`` for ``A``
        and ``(s x A, D)`` for ``B``."""
        pieces = []
        variables = self.variables(layer)
        for part in self._parts(layer):
            if part == "kernel":
                pieces.append((inputs, delta))
            elif part == "bias":
                pieces.append((None, delta))
            elif part == "lora_kernel_a":
                b = ops.cast(variable_value(layer.lora_kernel_b, variables, values), delta.dtype)
                pieces.append((inputs, lora_scale(layer) * ops.matmul(delta, ops.transpose(b))))
            else:
                a = ops.cast(variable_value(layer.lora_kernel_a, variables, values), inputs.dtype)
                pieces.append((lora_scale(layer) * ops.matmul(inputs, a), delta))
        return pieces

    def _lora(self, layer) -> bool:
        return getattr(layer, "lora_enabled", False)

    def materializes(self, layer, inputs, delta) -> bool:
        d_in, d_out = inputs.shape[-1], delta.shape[-1]
        rank = getattr(layer, "lora_rank", None) if self._lora(layer) else None
        sizes = {"kernel": (d_in, d_out), "lora_kernel_a": (d_in, rank), "lora_kernel_b": (rank, d_out)}
        return any(outer_materializes(sequence_positions(inputs), *sizes[part])
                   for part in self._parts(layer) if part in sizes)

    def per_example(self, layer, values, inputs, delta) -> list:
        out = []
        for a, d in self._pieces(layer, values, inputs, delta):
            out.append(outer_per_example(a, d) if a is not None else
                       d if len(d.shape) == 2 else ops.sum(_flat(d, d)[1], axis=1))
        return out

    def factors(self, layer, values, inputs, delta) -> list:
        out = []
        for a, d in self._pieces(layer, values, inputs, delta):
            a_flat, d_flat = _flat(d if a is None else a, d)
            left = ops.zeros(ops.shape(d_flat)[:2], "int32") if a is None else a_flat
            out.append((left, d_flat))
        return out

    def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
        return self._mapped(layer, values, inputs, delta, rows, columns, outer=0)

    def _mapped(self, layer, values, inputs, delta, rows, columns, outer: int):
        """:meth:`mapped`'s parts; with ``outer`` (pieces, > 0), a 2-D input's kernel parts
        (products ``a_j ⊗ d_j``) as :class:`OuterRows` instead of formed."""
        # Row j's kernel gradient is sum_t w_jt A_{o_jt}^T D_{o_jt}: the gradient of one
        # "example" whose positions are those of its slots, with D weighted.
        if rows.order is None and rows.weights is None:
            if outer and len(inputs.shape) == 2:
                return [d if a is None else OuterRows(a, d, outer)
                        for a, d in self._pieces(layer, values, inputs, delta)]
            return self.per_example(layer, values, inputs, delta)
        out = []
        for (a, d), column in zip(self._pieces(layer, values, inputs, delta), columns):
            _, d_flat = _flat(d, d)
            weighted = joined_slots(slot_rows(d_flat, rows, column), rows)
            if a is None:
                out.append(ops.sum(weighted, axis=1))
                continue
            a_flat = joined_slots(slot_rows(_flat(a, d)[0], rows), rows)
            if rows.order is None and len(a.shape) == 2:
                rows_of = OuterRows(a_flat[:, 0], weighted[:, 0], outer)
                out.append(rows_of if outer else rows_of.formed())
            elif outer and len(a.shape) == 2 and a_flat.shape[1] == 1:  # one example a row
                out.append(OuterRows(a_flat[:, 0], weighted[:, 0], outer))  # (the einsum's bits)
            else:
                out.append(ops.einsum("bni,bno->bio", a_flat, weighted))
        return out

    def all_finite(self, layer, inputs, delta):
        finite = ops.all(ops.isfinite(delta))
        if self._lora(layer):
            return None
        if len(inputs.shape) != 2 or "kernel" not in self._parts(layer):
            return None if len(inputs.shape) != 2 else finite
        # Exact for a_i ⊗ d_i: a non-finite entry of a_i or d_i makes a row or column of
        # the outer product non-finite, and with both finite its largest entry is
        # max|a_i| max|d_i|, which overflows exactly when some entry does.
        largest = ops.max(ops.abs(inputs), axis=1) * ops.max(ops.abs(delta), axis=1)
        return finite & ops.all(ops.isfinite(inputs)) & ops.all(ops.isfinite(largest))

    def mapped_pieces(self, layer, values, inputs, delta, rows, columns, pieces: int):
        size = inputs.shape[-1]
        whole = pieces <= 1 or size is None or "kernel" not in self._parts(layer) or self._lora(layer)
        if _OUTER_ROWS.get() and len(inputs.shape) == 2 and _single_slots(rows):
            # Products of rows, not formed here: each kernel in one part (formed, where it
            # must be, in the parts it would have had below).
            yield from enumerate(self._mapped(layer, values, inputs, delta, rows, columns,
                                              outer=1 if whole else pieces))
            return
        if whole:
            yield from super().mapped_pieces(layer, values, inputs, delta, rows, columns, pieces)
            return
        step = -(-size // min(pieces, size))
        for start in range(0, size, step):
            # The kernel's rows [start, start + step) come from those input features alone.
            parts = self.mapped(layer, values, inputs[..., start:start + step], delta, rows, columns)
            for m, (part, value) in enumerate(zip(self._parts(layer), parts)):
                if part == "kernel" or start == 0:
                    yield m, value

    def squared_norms(self, layer, values, inputs, delta) -> list:
        pieces = self._pieces(layer, values, inputs, delta)
        if len(inputs.shape) != 2:
            return [_bias_squared_norms(d) if a is None else outer_squared_norms(a, d) for a, d in pieces]
        # One position per example: ||a_i||^2 ||d_i||^2 and the bias's ||d_i||^2, each row
        # factor's norms computed once (the kernel and the bias share D's).
        norms = {}

        def of(rows):
            if id(rows) not in norms:
                norms[id(rows)] = _row_squared_norms(rows)
            return norms[id(rows)]

        return [of(d) if a is None else of(a) * of(d) for a, d in pieces]

    def gram(self, layer, values, inputs, delta):
        if len(inputs.shape) != 2 and sequence_positions(inputs) != 1:
            return super().gram(layer, values, inputs, delta)
        return outer_gram(self._pieces(layer, values, inputs, delta))

    def cross_gram(self, layer, values, inputs, delta, split: int):
        if len(inputs.shape) != 2 and sequence_positions(inputs) != 1:
            # (per-example gradients, as gram's: cheaper than T^2 position pairs here)
            return self.cross_gram_of_rows(layer, values, inputs, delta, split)
        return outer_gram(self._pieces(layer, values, inputs, delta), split)

    def sum_grad_squared(self, layer, values, inputs, delta) -> list:
        # One position per example: the kernel's g_i is a_i ⊗ d_i, whose squares sum
        # to (A^2)^T (D^2) (one matmul); over a sequence g_i sums several products and
        # must be formed (the default).
        if sequence_positions(inputs) != 1:
            return super().sum_grad_squared(layer, values, inputs, delta)
        out = []
        for a, d in self._pieces(layer, values, inputs, delta):
            d = ops.reshape(d, (ops.shape(d)[0], -1))
            if a is None:
                out.append(ops.reshape(ops.sum(ops.square(d), axis=0), tuple(layer.bias.shape)))
                continue
            a = ops.reshape(a, (ops.shape(a)[0], -1))
            out.append(ops.matmul(ops.transpose(ops.square(a)), ops.square(d)))
        return out

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        return [_bias_weighted_sum(d, w) if a is None else outer_weighted_sum(a, d, w)
                for (a, d), w in zip(self._pieces(layer, values, inputs, delta), weights)]
