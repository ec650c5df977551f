"""Recurrent layers (``LSTM``, ``GRU``, ``SimpleRNN``, ``keras.layers.RNN`` of their cells):
every weight's per-example gradient is a sum over time steps of outer products, so the
layer's statistics are those of a ``Dense`` layer over the time steps.

A cell's gate pre-activations at step t are ``z_t = x_t W + h_{t-1} U + b`` (LSTM: four
gates, SimpleRNN: one). With ``delta_t = dL/dz_t`` (every gate), example i's gradients are

    W: sum_t x_t^T delta_t,    U: sum_t h_{t-1}^T delta_t,    b: sum_t delta_t,

a ``Dense`` layer's gradient over T positions with input ``x`` (or ``h_{t-1}``) and output
gradient ``delta``: the same ghost norms or formed gradients, chosen from static shapes,
the same weighted sums ``A^T diag(w) D`` and row maps (:mod:`pergrad.layer_rules.dense`).
``GRU`` splits differently:

- ``reset_after=True`` (Keras's default, cuDNN's): the reset gate multiplies the
  candidate's recurrent term ``h_{t-1} U_h + b_{h,rec}``, so the recurrent projection's
  gradient is ``delta_t`` in the update and reset gates' columns and ``r_t * delta_t`` in
  the candidate's (the loop records ``r_t``); the bias ``(2, 3 units)`` is the sums of the
  two projections' gradients;
- ``reset_after=False``: the candidate's recurrent input is ``r_t * h_{t-1}``: ``U``'s
  update and reset columns get ``sum_t h_{t-1}^T delta_t``, its candidate columns
  ``sum_t (r_t h_{t-1})^T delta_t`` — one Dense gradient over 2T positions, each block
  of ``delta`` zero in the other's columns.

The rule's forward runs the recurrence itself, through Keras's own time loop
(``keras.src.backend.rnn``, which the layers run: its masking, ``go_backwards``,
``unroll`` and ``zero_output_for_mask``), with the input projection of every step
computed before the loop and the probe added to it (``(B, T, gates)``): the gradient
there is every step's ``delta_t``. The loop's first state carries ``h_{t-1}`` (and GRU's
``r_t`` or ``r_t h_{t-1}``) next to ``h_t``, so that a masked step keeps them as Keras keeps its
state, and the statistics receive ``[x_t, h_{t-1}]`` for every step. Input dropout (one
mask per example and sequence, drawn as Keras draws it) scales ``x``; SimpleRNN's
recurrent dropout scales ``h_{t-1}``. Opacus gets the same gradients by re-implementing
the cells with linear layers (``DPLSTM``, ``DPGRU``).

Not covered (the exact per-layer fallback): ``stateful=True``, stacked cells, cells or
layers that redefine their arithmetic, a partly frozen cell, and LSTM and GRU with
per-gate dropout masks (``recurrent_dropout``, or ``dropout`` with ``implementation=1``).
"""

from __future__ import annotations

import keras
from keras import ops, tree

from pergrad import compat
from pergrad.aggregators.base import row_scales
from pergrad.layer_rules.base import (
    LayerRule,
    divide_rows,
    joined_slots,
    register_rule,
    slot_rows,
)
from pergrad.layer_rules.dense import (
    outer_materializes,
    outer_per_example,
    outer_squared_norms,
    outer_weighted_sum,
)
from pergrad.tensors import batch_size_of, cast


def _value(variable, dtype):
    return cast(ops.convert_to_tensor(variable), dtype)


def _columns(delta, start, stop):
    """``delta`` with every column outside ``[start, stop)`` zero."""
    width = delta.shape[-1]
    parts = [ops.zeros_like(delta[..., :start])] if start else []
    parts.append(delta[..., start:stop])
    if stop < width:
        parts.append(ops.zeros_like(delta[..., stop:]))
    return ops.concatenate(parts, axis=-1)


class _Cell:
    """The arithmetic of one Keras cell class as the rule runs it: the input projection
    (before the loop), one step (in it), and each weight's gradient as ``(A, D)``."""

    cell_class: type

    def recorded_count(self, cell) -> int:
        """How many ``(B, units)`` tensors a step records for the statistics (``h_{t-1}``, ...)."""
        del cell
        return 1

    def covers(self, cell) -> bool:
        return type(cell).call is self.cell_class.call

    def dropout_masks(self, cell, first_step, first_state, training):
        """``(input mask, recurrent mask)`` (``None``: none applies), drawn as Keras's
        ``RNN.call`` draws them (whether or not they apply: the seed state advances alike)."""
        input_mask = cell.get_dropout_mask(first_step)
        recurrent_mask = cell.get_recurrent_dropout_mask(first_state)
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()
        applies = training and 0.0 < cell.dropout < 1.0
        recurrent_applies = training and 0.0 < cell.recurrent_dropout < 1.0
        return (input_mask if applies else None), (recurrent_mask if recurrent_applies else None)

    def projection(self, cell, x, weights):
        """``(B, T, gates)``: every step's input projection ``x_t W + b``."""
        kernel, _, bias = weights
        z = ops.matmul(x, kernel)
        return z if bias is None else z + bias

    def pieces(self, cell, inputs, delta, width):
        """Per weight (kernel, recurrent kernel, bias), ``(A, D)`` with the weight's
        gradient ``A^T D`` (``A`` ``None``: ``D`` summed over positions)."""
        x, h = inputs[..., :width], inputs[..., width:]
        return [(x, delta), (h, delta), (None, delta)]


class _LSTM(_Cell):
    cell_class = keras.layers.LSTMCell

    def covers(self, cell) -> bool:
        return (super().covers(cell) and compat.keeps_lstm_carry(cell, self.cell_class)
                and cell.recurrent_dropout == 0.0 and (cell.dropout == 0.0 or cell.implementation == 2))

    def step(self, cell, weights, p, h, states, recurrent_mask):
        z = p + ops.matmul(h, weights[1])
        z_i, z_f, z_c, z_o = ops.split(z, 4, axis=-1)
        act, gate = cell.activation, cell.recurrent_activation
        c = gate(z_f) * states[0] + gate(z_i) * act(z_c)
        new = gate(z_o) * act(c)
        return new, [c], [h]


class _SimpleRNN(_Cell):
    cell_class = keras.layers.SimpleRNNCell

    def dropout_masks(self, cell, first_step, first_state, training):
        # (SimpleRNNCell applies a mask in training whatever its rate)
        input_mask = cell.get_dropout_mask(first_step)
        recurrent_mask = cell.get_recurrent_dropout_mask(first_state)
        cell.reset_dropout_mask()
        cell.reset_recurrent_dropout_mask()
        return (input_mask if training else None), (recurrent_mask if training else None)

    def step(self, cell, weights, p, h, states, recurrent_mask):
        if recurrent_mask is not None:
            h = h * recurrent_mask
        return cell.activation(p + ops.matmul(h, weights[1])), [], [h]


class _GRU(_Cell):
    cell_class = keras.layers.GRUCell

    def covers(self, cell) -> bool:
        return (super().covers(cell) and cell.recurrent_dropout == 0.0
                and (cell.dropout == 0.0 or cell.implementation == 2))

    def projection(self, cell, x, weights):
        kernel, _, bias = weights
        z = ops.matmul(x, kernel)
        if bias is None:
            return z
        return z + (bias[0] if cell.reset_after else bias)

    def step(self, cell, weights, p, h, states, recurrent_mask):
        units = cell.units
        _, recurrent, bias = weights
        act, gate = cell.activation, cell.recurrent_activation
        # (splits, not slices: on TensorFlow each slice's gradient is a tensor of the
        # whole's size, in every step)
        p_z, p_r, p_h = ops.split(p, 3, axis=-1)
        if cell.reset_after:
            inner = ops.matmul(h, recurrent)
            if bias is not None:
                inner = inner + bias[1]
            inner_z, inner_r, inner_h = ops.split(inner, 3, axis=-1)
            z, r = gate(p_z + inner_z), gate(p_r + inner_r)
            candidate = act(p_h + r * inner_h)
            recorded = [h, r]
        else:
            gates, candidate_kernel = ops.split(recurrent, [2 * units], axis=-1)
            inner_z, inner_r = ops.split(ops.matmul(h, gates), 2, axis=-1)
            z, r = gate(p_z + inner_z), gate(p_r + inner_r)
            reset = r * h
            candidate = act(p_h + ops.matmul(reset, candidate_kernel))
            recorded = [h, reset]
        return z * h + (1 - z) * candidate, [], recorded

    def pieces(self, cell, inputs, delta, width):
        units = cell.units
        x = inputs[..., :width]
        h, recorded = inputs[..., width:width + units], inputs[..., width + units:]
        if cell.reset_after:
            # The recurrent projection's gradient: the update and reset gates' delta, and r_t
            # times the candidate's.
            inner = ops.concatenate([delta[..., :2 * units], recorded * delta[..., 2 * units:]], axis=-1)
            return [(x, delta), (h, inner), (None, ops.concatenate([delta, inner], axis=-1))]
        reset = recorded
        recurrent = (ops.concatenate([h, reset], axis=1),
                     ops.concatenate([_columns(delta, 0, 2 * units), _columns(delta, 2 * units, 3 * units)],
                                     axis=1))
        return [(x, delta), recurrent, (None, delta)]

    def recorded_count(self, cell) -> int:
        return 2  # h_{t-1}, and r_t (reset_after) or r_t h_{t-1}


_CELLS = (_LSTM(), _GRU(), _SimpleRNN())
_CALLS = {cls.call for cls in (keras.layers.RNN, keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN)}
_LOOPS = {cls.inner_loop for cls in (keras.layers.RNN, keras.layers.LSTM, keras.layers.GRU)}


def _cell_of(layer):
    cell = getattr(layer, "cell", None)
    for kind in _CELLS:
        if isinstance(cell, kind.cell_class):
            return kind if kind.covers(cell) else None
    return None


def _weights(cell):
    """The cell's kernel, recurrent kernel and bias (``None`` where it has none)."""
    return [getattr(cell, name, None) for name in ("kernel", "recurrent_kernel", "bias")]


def _mapped_piece(a, d, rows, column):
    """Row ``j`` of a row map applied to ``A_i^T D_i`` (``A`` ``None``: ``sum_t D_it``): the
    gradient of one "example" whose positions are those of its slots, ``D`` weighted
    (as ``DenseRule.mapped``)."""
    weighted = joined_slots(slot_rows(d, rows, column), rows)
    if a is None:
        return ops.sum(weighted, axis=1)
    return ops.einsum("bni,bno->bio", joined_slots(slot_rows(a, rows), rows), weighted)


@register_rule(keras.layers.RNN)
class RecurrentRule(LayerRule):
    """``LSTM``, ``GRU``, ``SimpleRNN`` and ``RNN`` of one of their cells (module docstring)."""

    def applies(self, layer) -> bool:
        cls = type(layer)
        return (cls.call in _CALLS and cls.inner_loop in _LOOPS and not layer.stateful
                and _cell_of(layer) is not None
                and all(v.trainable for v in _weights(layer.cell) if v is not None))

    def variables(self, layer) -> list:
        if not layer.trainable:
            return []
        return [v for v in _weights(layer.cell) if v is not None and v.trainable]

    def forward_and_inputs(self, layer, call, probe, args, kwargs):
        del call
        arguments = dict(zip(("sequences", "initial_state", "mask", "training"), args), **kwargs)
        sequences, mask = arguments["sequences"], arguments.get("mask")
        training = bool(arguments.get("training", False))
        cell, kind = layer.cell, _cell_of(layer)
        dtype, units = cell.compute_dtype, cell.units
        states = arguments.get("initial_state")
        if states is None:
            states = layer.get_initial_state(batch_size=ops.shape(sequences)[0])
        states = [ops.convert_to_tensor(s, dtype=dtype) for s in tree.flatten(states)]
        if tree.is_nested(mask):
            mask = tree.flatten(mask)[0]
        input_mask, recurrent_mask = kind.dropout_masks(cell, sequences[:, 0, :], states[0], training)
        x = sequences if input_mask is None else sequences * ops.expand_dims(input_mask, 1)
        weights = [None if v is None else _value(v, dtype) for v in _weights(cell)]
        projected = probe(kind.projection(cell, x, weights))

        def step(p, carried):
            # carried[0] is [h_t, what step t recorded]: Keras masks it as its own h state.
            h = ops.split(carried[0], [units], axis=-1)[0]
            new, others, recorded = kind.step(cell, weights, p, h, list(carried[1:]), recurrent_mask)
            joined = ops.concatenate([new] + recorded, axis=-1)
            return joined, [joined] + others

        extra = [ops.zeros_like(states[0])] * kind.recorded_count(cell)
        first = ops.concatenate([states[0]] + extra, axis=-1)
        last, outputs, final = compat.rnn(
            step, projected, [first] + states[1:], go_backwards=layer.go_backwards, mask=mask,
            unroll=layer.unroll, input_length=sequences.shape[1],
            zero_output_for_mask=layer.zero_output_for_mask, return_all_outputs=True,
        )
        recorded = outputs[:, :, units:]
        if layer.go_backwards:  # (the loop's outputs are in the order it ran)
            recorded = ops.flip(recorded, axis=1)
        inputs = ops.concatenate([x, cast(recorded, x.dtype)], axis=-1)
        output = outputs[:, :, :units] if layer.return_sequences else last[:, :units]
        output = ops.cast(output, layer.compute_dtype)
        if not layer.return_state:
            return output, inputs
        final = [final[0][:, :units]] + list(final[1:])
        return (output, *[ops.cast(s, layer.compute_dtype) for s in final]), inputs

    def _pieces(self, layer, inputs, delta):
        """Per variable, ``(A, D)`` (``A`` ``None``: a bias), in :meth:`variables` order."""
        cell, kind = layer.cell, _cell_of(layer)
        width = inputs.shape[-1] - kind.recorded_count(cell) * cell.units  # x's features
        pieces = kind.pieces(cell, inputs, delta, width)
        wanted = {id(v) for v in self.variables(layer)}
        return [piece for piece, v in zip(pieces, _weights(cell)) if v is not None and id(v) in wanted]

    def _shaped(self, layer, grads, count):
        """``grads`` with each variable's shape (a GRU bias is ``(2, 3 units)``)."""
        return [ops.reshape(g, (count,) + tuple(v.shape)) for g, v in zip(grads, self.variables(layer))]

    def materializes(self, layer, inputs, delta) -> bool:
        return any(outer_materializes(a.shape[1], a.shape[2], d.shape[2])
                   for a, d in self._pieces(layer, inputs, delta) if a is not None)

    def per_example(self, layer, values, inputs, delta) -> list:
        grads = [ops.sum(d, axis=1) if a is None else outer_per_example(a, d)
                 for a, d in self._pieces(layer, inputs, delta)]
        return self._shaped(layer, grads, batch_size_of(delta))

    def squared_norms(self, layer, values, inputs, delta) -> list:
        return [ops.sum(ops.square(ops.sum(d, axis=1)), axis=1) if a is None else outer_squared_norms(a, d)
                for a, d in self._pieces(layer, inputs, delta)]

    def scaled_squared_norms(self, layer, values, inputs, delta):
        # Each piece's A and D divided by their own rows' largest entries: a product of
        # the two scales per weight (D's alone for the bias).
        norms, scales = [], []
        for a, d in self._pieces(layer, inputs, delta):
            d_scale = row_scales(d)
            d = divide_rows(d, d_scale)
            if a is None:
                norms.append(ops.sum(ops.square(ops.sum(d, axis=1)), axis=1))
                scales.append(d_scale)
                continue
            a_scale = row_scales(a)
            norms.append(outer_squared_norms(divide_rows(a, a_scale), d))
            scales.append(a_scale * d_scale)
        return norms, scales

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        sums = [ops.sum(d * ops.cast(w, d.dtype)[:, None, None], axis=(0, 1)) if a is None
                else outer_weighted_sum(a, d, w)
                for (a, d), w in zip(self._pieces(layer, inputs, delta), weights)]
        return [ops.reshape(s, v.shape) for s, v in zip(sums, self.variables(layer))]

    def factors(self, layer, values, inputs, delta) -> list:
        return [(ops.zeros(ops.shape(d)[:2], "int32") if a is None else a, d)
                for a, d in self._pieces(layer, inputs, delta)]

    def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
        if rows.order is None and rows.weights is None:
            return self.per_example(layer, values, inputs, delta)
        grads = [_mapped_piece(a, d, rows, column)
                 for (a, d), column in zip(self._pieces(layer, inputs, delta), columns)]
        return self._shaped(layer, grads, -1)
