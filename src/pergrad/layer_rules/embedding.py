"""Embeddings: statistics from the token ids ``I`` and the output gradient ``D``.

Example i's gradient is ``sum_t onehot(I_it) D_it^T`` (rows of the table that its
tokens select), not formed unless the table holds no more than the formulas' token
pairs (``rows x d <= 3 T^2``, a position table: then one segment sum per batch):

- ``||g_i||^2 = sum_{t,s} [I_it = I_is] (D_it . D_is)``;
- ``<g_i, g_j> = sum_{t,s} [I_it = I_js] (D_it . D_js)``;
- ``sum_i w_i g_i``: ``w_i D_it`` added to row ``I_it`` (a segment sum).

``ReversibleEmbedding`` (keras-hub's token embeddings and tied LM heads) is this
rule when called on ids and, with ``reverse=True``, a Dense layer whose kernel is
the transposed table (``logits = h E^T``: example i's gradient of ``E`` is
``D_i^T h_i``, its norm the ghost formula over position pairs; Press & Wolf 2017
for the tying). A tied table read both ways is a variable two calls read: the
engine adds the two gradients per example, the norm of the sum from
:meth:`~pergrad.layer_rules.LayerRule.factors` (no ``B x vocabulary x d``
tensor). keras-hub's ``PositionEmbedding`` reads the rows ``start .. start + T``
of its table: the Embedding rule on those position ids.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from pergrad.aggregators.base import row_scales
from pergrad.backend import optional_kernel
from pergrad.layer_rules.base import (
    LayerRule,
    OutputRule,
    divide_rows,
    gram_memory,
    joined_slots,
    register_rule,
    replaced_attribute,
    slot_rows,
)
from pergrad.layer_rules.dense import (
    outer_gram,
    outer_materializes,
    outer_per_example,
    outer_squared_norms,
    outer_weighted_sum,
    sequence_positions,
)
from pergrad.tensors import batch_size_of, cast


def _segment_sum(rows, ids, count):
    """``ops.segment_sum(rows, ids, num_segments=count)``, by the backend adapter's own
    version where it has one (torch)."""
    fast = optional_kernel("segment_sum_rows")
    if fast is not None:
        return fast(rows, ids, count)
    return ops.segment_sum(rows, ids, num_segments=count)


def _token_pairs(ids, d, other_ids, other_d):
    """``(n, m)``: ``sum_{t,s} [I_it = I'_js] (D_it . D'_js)`` between two sets of examples."""
    same = ops.cast(ops.equal(ids[:, None, :, None], other_ids[None, :, None, :]), d.dtype)
    return ops.sum(same * ops.einsum("ato,bso->abts", d, other_d), axis=(2, 3))


def _flat(inputs, delta):
    # (no op where the ids and D already are so: each costs on torch)
    batch = batch_size_of(delta)
    ids = cast(inputs, "int32")
    if len(ids.shape) != 2:
        ids = ops.reshape(ids, (batch, -1))
    if len(delta.shape) != 3:
        delta = ops.reshape(delta, (batch, -1, ops.shape(delta)[-1]))
    return ids, delta


@register_rule(keras.layers.Embedding)
class EmbeddingRule(OutputRule):
    def applies(self, layer) -> bool:
        return (
            super().applies(layer)
            and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None
        )

    def rows(self, layer) -> int:
        """The table's number of rows (ids are in ``[0, rows)``)."""
        return layer.input_dim

    def materializes(self, layer, inputs, delta) -> bool:
        # Example i's table (rows x d, one segment sum) when it holds no more than the token
        # pairs' T x T matrices (equal ids, D Dᵀ, their product), as Dense decides: a
        # position table of T rows.
        positions, width = tuple(inputs.shape[1:]), delta.shape[-1]
        if width is None or any(p is None for p in positions):
            return False
        return self.rows(layer) * width <= gram_memory(math.prod(positions))

    def per_example(self, layer, values, inputs, delta) -> list:
        ids, d = _flat(inputs, delta)
        batch, vocab = ops.shape(d)[0], self.rows(layer)
        # Example b's rows of the table: one segment sum over (b, id) pairs, B x T x d adds.
        segments = ops.reshape(ids + ops.arange(batch, dtype="int32")[:, None] * vocab, (-1,))
        rows = ops.reshape(d, (-1, ops.shape(d)[-1]))
        table = _segment_sum(rows, segments, batch * vocab)
        return [ops.reshape(table, (batch, vocab, ops.shape(d)[-1]))]

    def factors(self, layer, values, inputs, delta) -> list:
        return [_flat(inputs, delta)]

    def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
        # Row j's table is the segment sum of its slots' weighted D rows at their ids.
        ids, d = _flat(inputs, delta)
        ids = joined_slots(slot_rows(ids, rows), rows)
        d = joined_slots(slot_rows(d, rows, columns[0]), rows)
        return EmbeddingRule.per_example(self, layer, values, ids, d)

    def squared_norms(self, layer, values, inputs, delta) -> list:
        ids, d = _flat(inputs, delta)
        fast = optional_kernel("token_squared_norms")
        if fast is not None:  # (torch: each example's ids sorted, B T d adds)
            return [fast(ids, d)]
        same = ops.cast(ops.equal(ids[:, :, None], ids[:, None, :]), d.dtype)
        return [ops.sum(same * ops.einsum("bto,bso->bts", d, d), axis=(1, 2))]

    def gram(self, layer, values, inputs, delta):
        ids, d = _flat(inputs, delta)
        positions = ids.shape[1]
        if positions is None or positions * positions > self.rows(layer):
            # Token pairs of two examples cost B^2 T^2 d, the per-example tables B^2 vocab d.
            return super().gram(layer, values, inputs, delta)
        return _token_pairs(ids, d, ids, d)

    def cross_gram(self, layer, values, inputs, delta, split: int):
        ids, d = _flat(inputs, delta)
        positions, vocab = ids.shape[1], self.rows(layer)
        others = ids.shape[0] - split if ids.shape[0] is not None else None
        if positions is None or others is None:
            return self.cross_gram_of_rows(layer, values, inputs, delta, split)
        if positions * positions * split <= vocab:
            # Token pairs of the two sides, B T n^2 d, cost less than the tables.
            return _token_pairs(ids[:split], d[:split], ids[split:], d[split:])
        # The second side's tables (B - split, vocabulary, d), read at the first side's ids:
        # <g_i, g_j> = sum_t <D_it, table_j[I_it]>, B n (B - split) d, no first-side table.
        (tables,) = EmbeddingRule.per_example(self, layer, values, ids[split:], d[split:])
        width = ops.shape(d)[-1]
        # (vocabulary, (B - split) d): whole rows gathered (a strided gather of the
        # (B - split, vocabulary, d) tables costs more than the arithmetic on torch's CPU)
        rows = ops.reshape(ops.transpose(tables, (1, 0, 2)), (vocab, others * width))
        picked = ops.take(rows, ops.reshape(ids[:split], (-1,)), axis=0)
        picked = ops.reshape(picked, (split * positions, others, width))
        first = ops.reshape(d[:split], (split * positions, width, 1))
        products = ops.reshape(ops.matmul(picked, first), (split, positions, others))
        return ops.sum(products, axis=1)

    def sum_grad_squared(self, layer, values, inputs, delta) -> list:
        # Row v of example i's gradient is S_iv = sum of D_it over its tokens t with id v.
        # Each token t holds its group's sum (token pairs with equal ids) and adds
        # S^2 / (the group's size) to row I_it: every group counts once, and no
        # B x vocabulary x d tensor is formed.
        ids, d = _flat(inputs, delta)
        same = ops.cast(ops.equal(ids[:, :, None], ids[:, None, :]), d.dtype)
        group_sums = ops.einsum("bts,bsq->btq", same, d)
        shares = ops.square(group_sums) / ops.sum(same, axis=2)[:, :, None]
        rows = ops.reshape(shares, (-1, ops.shape(d)[-1]))
        return [_segment_sum(rows, ops.reshape(ids, (-1,)), self.rows(layer))]

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        ids, d = _flat(inputs, delta)
        rows = ops.reshape(d * weights[0][:, None, None], (-1, ops.shape(d)[-1]))
        table = _segment_sum(rows, ops.reshape(ids, (-1,)), self.rows(layer))
        return [table]


def _reverse(inputs, delta) -> bool:
    """Whether a ``ReversibleEmbedding`` call projected back (``h -> logits``, same rank)
    rather than embedded ids (one axis more out than in)."""
    return len(delta.shape) == len(inputs.shape)


def _reverse_call(args, kwargs) -> bool:
    return bool(kwargs.get("reverse", args[1] if len(args) > 1 else False))


if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras >= 3.13; keras-hub's subclasses it

    @register_rule(keras.layers.ReversibleEmbedding)
    class ReversibleEmbeddingRule(EmbeddingRule):
        """Ids: the Embedding rule. ``reverse=True``: a Dense layer on ``h`` with kernel
        ``E^T`` (or the untied ``reverse_embeddings``), probed before the soft cap."""

        def call_variables(self, layer, args, kwargs) -> list:
            untied = _reverse_call(args, kwargs) and not layer.tie_weights
            table = layer.reverse_embeddings if untied else layer.embeddings
            return [v for v in self.variables(layer) if v is table]

        def forward(self, layer, call, probe, args, kwargs):
            if not _reverse_call(args, kwargs):
                return super().forward(layer, call, probe, args, kwargs)
            cap = layer.logit_soft_cap
            with replaced_attribute(layer, "logit_soft_cap", None):
                logits = probe(call(*args, **kwargs))
            return logits if cap is None else ops.tanh(logits / cap) * cap

        def _transposed(self, layer) -> bool:
            """Whether the reverse call's kernel is the transposed table ``E^T`` (tied)."""
            return layer.tie_weights

        def _oriented(self, layer, gradient, axis=0):
            """A ``(d, vocab)`` kernel gradient as the variable's (``E``'s is ``(vocab, d)``)."""
            if not self._transposed(layer):
                return gradient
            axes = list(range(len(gradient.shape)))
            axes[axis], axes[axis + 1] = axes[axis + 1], axes[axis]
            return ops.transpose(gradient, axes)

        def materializes(self, layer, inputs, delta) -> bool:
            if not _reverse(inputs, delta):
                return super().materializes(layer, inputs, delta)
            return outer_materializes(sequence_positions(inputs), inputs.shape[-1], delta.shape[-1])

        def per_example(self, layer, values, inputs, delta) -> list:
            if not _reverse(inputs, delta):
                return super().per_example(layer, values, inputs, delta)
            return [self._oriented(layer, outer_per_example(inputs, delta), axis=1)]

        def factors(self, layer, values, inputs, delta) -> list:
            if not _reverse(inputs, delta):
                return super().factors(layer, values, inputs, delta)
            batch = ops.shape(delta)[0]
            h = ops.reshape(inputs, (batch, -1, inputs.shape[-1]))
            d = ops.reshape(delta, (batch, -1, delta.shape[-1]))
            return [(d, h) if self._transposed(layer) else (h, d)]

        def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
            if not _reverse(inputs, delta):
                return super().mapped(layer, values, inputs, delta, rows, columns)
            return LayerRule.mapped(self, layer, values, inputs, delta, rows, columns)

        def squared_norms(self, layer, values, inputs, delta) -> list:
            if not _reverse(inputs, delta):
                return super().squared_norms(layer, values, inputs, delta)
            return [outer_squared_norms(inputs, delta)]

        def scaled_squared_norms(self, layer, values, inputs, delta):
            if not _reverse(inputs, delta):
                return super().scaled_squared_norms(layer, values, inputs, delta)
            # D_i^T h_i is linear in h too: both divided, as for Dense.
            scale, input_scale = row_scales(delta), row_scales(inputs)
            norms = self.squared_norms(layer, values, divide_rows(inputs, input_scale),
                                       divide_rows(delta, scale))
            return norms, [scale * input_scale]

        def gram(self, layer, values, inputs, delta):
            if not _reverse(inputs, delta):
                return super().gram(layer, values, inputs, delta)
            if sequence_positions(inputs) != 1:
                return LayerRule.gram(self, layer, values, inputs, delta)
            return outer_gram([(inputs, delta)])

        def cross_gram(self, layer, values, inputs, delta, split: int):
            if not _reverse(inputs, delta):
                return super().cross_gram(layer, values, inputs, delta, split)
            if sequence_positions(inputs) != 1:
                return self.cross_gram_of_rows(layer, values, inputs, delta, split)
            return outer_gram([(inputs, delta)], split)

        def sum_grad_squared(self, layer, values, inputs, delta) -> list:
            if not _reverse(inputs, delta):
                return super().sum_grad_squared(layer, values, inputs, delta)
            return LayerRule.sum_grad_squared(self, layer, values, inputs, delta)

        def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
            if not _reverse(inputs, delta):
                return super().weighted_sum(layer, values, inputs, delta, weights)
            return [self._oriented(layer, outer_weighted_sum(inputs, delta, weights[0]))]


@register_rule("keras_hub.src.layers.modeling.position_embedding.PositionEmbedding")
class PositionEmbeddingRule(EmbeddingRule):
    """keras-hub's ``PositionEmbedding``: the Embedding rule on the positions it reads
    (``start_index + arange(T)``, or the ``positions`` it is given), broadcast to the
    input's leading axes."""

    def rows(self, layer) -> int:
        return layer.sequence_length

    def call_inputs(self, layer, args, kwargs):
        inputs = args[0]
        start = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
        positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
        if positions is None:
            positions = ops.arange(ops.shape(inputs)[-2], dtype="int32") + ops.cast(start, "int32")
        return ops.broadcast_to(ops.cast(positions, "int32"), ops.shape(inputs)[:-1])
