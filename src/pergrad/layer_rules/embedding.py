"""``Embedding``: statistics from the token ids ``I`` and the output gradient ``D``.

Example i's gradient is ``sum_t onehot(I_it) D_it^T`` (rows of the table that its
tokens select), never formed:

- ``||g_i||^2 = sum_{t,s} [I_it = I_is] (D_it . D_is)``;
- ``<g_i, g_j> = sum_{t,s} [I_it = I_js] (D_it . D_js)``;
- ``sum_i w_i g_i``: ``w_i D_it`` added to row ``I_it`` (a segment sum).
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.layer_rules.base import OutputRule, joined_slots, register_rule, slot_rows


def _flat(inputs, delta):
    batch = ops.shape(delta)[0]
    ids = ops.reshape(ops.cast(inputs, "int32"), (batch, -1))
    return ids, ops.reshape(delta, (batch, -1, ops.shape(delta)[-1]))


@register_rule(keras.layers.Embedding)
class EmbeddingRule(OutputRule):
    def applies(self, layer) -> bool:
        return (
            super().applies(layer)
            and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None
        )

    def materializes(self, layer, inputs, delta) -> bool:
        return False  # norms and weighted sums: token pairs and a segment sum, always

    def per_example(self, layer, values, inputs, delta) -> list:
        ids, d = _flat(inputs, delta)
        batch, vocab = ops.shape(d)[0], layer.input_dim
        # Example b's rows of the table: one segment sum over (b, id) pairs, B x T x d adds.
        segments = ops.reshape(ids + ops.arange(batch, dtype="int32")[:, None] * vocab, (-1,))
        rows = ops.reshape(d, (-1, ops.shape(d)[-1]))
        table = ops.segment_sum(rows, segments, num_segments=batch * vocab)
        return [ops.reshape(table, (batch, vocab, ops.shape(d)[-1]))]

    def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
        # Row j's table is the segment sum of its slots' weighted D rows at their ids.
        ids, d = _flat(inputs, delta)
        ids = joined_slots(slot_rows(ids, rows), rows)
        d = joined_slots(slot_rows(d, rows, columns[0]), rows)
        return self.per_example(layer, values, ids, d)

    def squared_norms(self, layer, values, inputs, delta) -> list:
        ids, d = _flat(inputs, delta)
        same = ops.cast(ops.equal(ids[:, :, None], ids[:, None, :]), d.dtype)
        return [ops.sum(same * ops.einsum("bto,bso->bts", d, d), axis=(1, 2))]

    def gram(self, layer, values, inputs, delta):
        ids, d = _flat(inputs, delta)
        positions = ids.shape[1]
        if positions is None or positions * positions > layer.input_dim:
            # Token pairs of two examples cost B^2 T^2 d, the per-example tables B^2 vocab d.
            return super().gram(layer, values, inputs, delta)
        same = ops.cast(ops.equal(ids[:, None, :, None], ids[None, :, None, :]), d.dtype)
        return ops.sum(same * ops.einsum("ato,bso->abts", d, d), axis=(2, 3))

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        ids, d = _flat(inputs, delta)
        rows = ops.reshape(d * weights[0][:, None, None], (-1, ops.shape(d)[-1]))
        table = ops.segment_sum(rows, ops.reshape(ids, (-1,)), num_segments=layer.input_dim)
        return [table]
