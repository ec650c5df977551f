"""``EinsumDense`` (the projections of ``MultiHeadAttention``): the probe before the
activation; each example's gradient of this layer formed from ``A`` and ``D``.

For ``y = einsum("<in>,<kernel>-><out>", x, W)`` whose batch letter (the first of
``<in>`` and ``<out>``) is not in ``<kernel>``, example i's kernel gradient is
``einsum("<in>,<out>-><batch><kernel>", A, D)``: one einsum, no vjp. The bias is
added by broadcasting: its gradient sums ``D`` over the broadcast axes. Other
equations (an ellipsis, a repeated letter) take the layer's vectorized vjp.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.layer_rules.base import PreActivationRule, reduce_to, register_rule


def _specs(equation: str):
    """``(input, kernel, output)`` letters, or ``None`` when the equation is not plain."""
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    x, kernel = parts
    batch = x[:1]
    plain = (
        batch and output[:1] == batch and batch not in kernel
        and all(len(set(s)) == len(s) for s in (x, kernel, output))
        and set(kernel) <= set(x) | set(output)
    )
    return (x, kernel, output) if plain else None


@register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(PreActivationRule):
    def per_example(self, layer, values, inputs, delta) -> list:
        specs = _specs(layer.equation)
        if specs is None:
            return super().per_example(layer, values, inputs, delta)
        x, kernel, output = specs
        grads = []
        for v in self.variables(layer):
            if v is layer.kernel:
                grads.append(ops.einsum(f"{x},{output}->{x[0]}{kernel}", inputs, delta))
            else:
                grads.append(reduce_to(delta, tuple(v.shape)))
        return grads
