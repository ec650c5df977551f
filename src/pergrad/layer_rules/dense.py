"""``Dense``: ghost norms, Gram matrix and weighted sums from ``A`` and ``D``.

With the input ``A_i`` of example i flattened to ``(n, d_in)`` (``n = 1`` for a
2-D input, ``T`` for a sequence) and the pre-activation gradient ``D_i`` to
``(n, d_out)``, the kernel's per-example gradient is ``A_i^T D_i`` and the
bias's ``sum_t D_it``. Without forming them (Goodfellow 2015; Li et al. 2022):

- ``||A_i^T D_i||^2 = sum_{t,s} (a_t . a_s)(d_t . d_s)``: ``n^2 (d_in + d_out)``
  per example instead of ``d_in d_out``, chosen when ``2 n^2 <= d_in d_out``;
- ``<g_i, g_j> = (A A^T)_{ij} (D D^T)_{ij}`` for ``n = 1``;
- ``sum_i w_i A_i^T D_i = A^T diag(w) D``: one matmul, as in a plain backward pass.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from pergrad.layer_rules.base import PreActivationRule, joined_slots, register_rule, slot_rows


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


def _positions(inputs) -> int | None:
    """``n``: the positions per example (the static product of the middle axes)."""
    middle = tuple(inputs.shape[1:-1])
    return math.prod(middle) if all(m is not None for m in middle) else None


@register_rule(keras.layers.Dense)
class DenseRule(PreActivationRule):
    def _parts(self, layer):
        """Which of (kernel, bias) the rule's variables are, in order."""
        parts = []
        for v in self.variables(layer):
            parts.append("kernel" if v is layer.kernel else "bias")
        return parts

    def materializes(self, layer, inputs, delta) -> bool:
        n = _positions(inputs)
        return n is None or (n > 1 and 2 * n * n > inputs.shape[-1] * delta.shape[-1])

    def per_example(self, layer, values, inputs, delta) -> list:
        if len(inputs.shape) == 2:  # an outer product per example
            grads = {"kernel": lambda: inputs[:, :, None] * delta[:, None, :], "bias": lambda: delta}
            return [grads[part]() for part in self._parts(layer)]
        a, d = _flat(inputs, delta)
        grads = {"kernel": ops.einsum("bni,bno->bio", a, d), "bias": ops.sum(d, axis=1)}
        return [grads[part] for part in self._parts(layer)]

    def mapped(self, layer, values, inputs, delta, rows, columns) -> list:
        # Row j's kernel gradient is sum_t w_jt A_{o_jt}^T D_{o_jt}: the gradient of one
        # "example" whose positions are those of its slots, with D weighted.
        if rows.order is None and rows.weights is None:
            return self.per_example(layer, values, inputs, delta)
        a, d = _flat(inputs, delta)
        a = joined_slots(slot_rows(a, rows), rows)
        out = []
        for part, column in zip(self._parts(layer), columns):
            weighted = joined_slots(slot_rows(d, rows, column), rows)
            if part == "bias":
                out.append(ops.sum(weighted, axis=1))
            elif rows.order is None and len(inputs.shape) == 2:
                out.append(a[:, 0, :, None] * weighted[:, 0, None, :])
            else:
                out.append(ops.einsum("bni,bno->bio", a, weighted))
        return out

    def all_finite(self, layer, inputs, delta):
        finite = ops.all(ops.isfinite(delta))
        if len(inputs.shape) != 2 or "kernel" not in self._parts(layer):
            return None if len(inputs.shape) != 2 else finite
        # Exact for a_i ⊗ d_i: a non-finite entry of a_i or d_i makes a row or column of
        # the outer product non-finite, and with both finite its largest entry is
        # max|a_i| max|d_i|, which overflows exactly when some entry does.
        largest = ops.max(ops.abs(inputs), axis=1) * ops.max(ops.abs(delta), axis=1)
        return finite & ops.all(ops.isfinite(inputs)) & ops.all(ops.isfinite(largest))

    def mapped_pieces(self, layer, values, inputs, delta, rows, columns, pieces: int):
        size = inputs.shape[-1]
        if pieces <= 1 or size is None or "kernel" not in self._parts(layer):
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
        if len(inputs.shape) == 2:  # the common case, without reshapes (each op costs on torch)
            squared_delta = ops.sum(ops.square(delta), axis=1)
            norms = {"kernel": ops.sum(ops.square(inputs), axis=1) * squared_delta, "bias": squared_delta}
            return [norms[part] for part in self._parts(layer)]
        a, d = _flat(inputs, delta)
        if a.shape[1] == 1:
            kernel = ops.sum(ops.square(a[:, 0]), axis=1) * ops.sum(ops.square(d[:, 0]), axis=1)
        else:
            aa = ops.einsum("bni,bmi->bnm", a, a)
            dd = ops.einsum("bno,bmo->bnm", d, d)
            kernel = ops.sum(aa * dd, axis=(1, 2))
        norms = {"kernel": kernel, "bias": ops.sum(ops.square(ops.sum(d, axis=1)), axis=1)}
        return [norms[part] for part in self._parts(layer)]

    def gram(self, layer, values, inputs, delta):
        a, d = _flat(inputs, delta)
        if a.shape[1] != 1:
            return super().gram(layer, values, inputs, delta)
        a, d = a[:, 0], d[:, 0]
        dd = ops.matmul(d, ops.transpose(d))
        grams = {"kernel": ops.matmul(a, ops.transpose(a)) * dd, "bias": dd}
        return sum(grams[part] for part in self._parts(layer))

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        if len(inputs.shape) == 2:
            sums = {"kernel": lambda w: ops.matmul(ops.transpose(inputs), delta * w[:, None]),
                    "bias": lambda w: ops.matmul(w[None, :], delta)[0]}
            return [sums[part](w) for part, w in zip(self._parts(layer), weights)]
        a, d = _flat(inputs, delta)
        out = []
        for part, w in zip(self._parts(layer), weights):
            weighted = d * w[:, None, None]
            if part == "kernel":
                rows = ops.reshape(a, (-1, ops.shape(a)[-1]))
                out.append(ops.matmul(ops.transpose(rows), ops.reshape(weighted, (-1, ops.shape(d)[-1]))))
            else:
                out.append(ops.sum(weighted, axis=(0, 1)))
        return out
