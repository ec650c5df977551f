"""``EinsumDense`` (the projections of ``MultiHeadAttention``): the probe before the
activation; each example's gradient of this layer formed from ``A`` and ``D``.

For ``y = einsum("<in>,<kernel>-><out>", x, W)`` whose batch letter (the first of
``<in>`` and ``<out>``) is not in ``<kernel>``, example i's kernel gradient is
``einsum("<in>,<out>-><batch><kernel>", A, D)``: one einsum, no vjp. The bias is
added by broadcasting: its gradient sums ``D`` over the broadcast axes. Other
equations (an ellipsis, a repeated letter) take the layer's vectorized vjp.

With LoRA (``W + s A B``, ``A`` the kernel's shape with its last axis ``r``, ``B``
``(r, o)``), where the kernel's last letter is the output's last (every Keras and
keras-hub projection): ``y = x W + s (x A) B``, so ``A``'s gradient is the kernel
formula with output gradient ``s D B^T``, and ``B``'s that of a Dense layer on
``s x A`` (positions: every output axis but the last) — no ``W``-sized gradient.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from pergrad.backend import optional_kernel
from pergrad.layer_rules.base import LayerRule, PreActivationRule, reduce_to, register_rule
from pergrad.layer_rules.dense import lora_scale, outer_per_example, variable_value


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


def _positions(x, kernel, output):
    """``p`` where the input is ``x[:p] X`` and the output ``x[:p] Y`` (the batch and the
    positions), and the kernel ``X Y``: example i's kernel gradient is then Dense's
    ``A_i^T D_i`` of the axes ``X`` and ``Y`` flattened (the attention projections);
    else ``None``."""
    p = 0
    while p < min(len(x), len(output)) and x[p] == output[p]:
        p += 1
    return p if kernel == x[p:] + output[p:] and p < len(x) and p < len(output) else None


def _lora_specs(layer):
    """The specs of a LoRA layer whose kernel's last letter is the output's last, else ``None``."""
    specs = _specs(layer.equation)
    if specs is None:
        return None
    x, kernel, output = specs
    return specs if kernel[-1] == output[-1] and kernel[-1] not in x else None


@register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(PreActivationRule):
    def applies(self, layer) -> bool:  # LoRA layers too, where the factors split as above
        lora = getattr(layer, "lora_enabled", False)
        return (LayerRule.applies(self, layer) and getattr(layer, "quantization_mode", None) is None
                and (not lora or _lora_specs(layer) is not None))

    def per_example(self, layer, values, inputs, delta) -> list:
        specs = _specs(layer.equation)
        if specs is None:
            return super().per_example(layer, values, inputs, delta)
        x, kernel, output = specs
        variables = self.variables(layer)
        fast = optional_kernel("outer_per_example")
        shared = None if fast is None else _positions(x, kernel, output)

        def kernel_gradient(d):
            if shared is None:
                return ops.einsum(f"{x},{output}->{x[0]}{kernel}", inputs, d)
            # (torch: the Dense formula of the flattened axes, one batched matmul)
            batch = ops.shape(d)[0]
            rows = outer_per_example(ops.reshape(inputs, (batch, -1, math.prod(inputs.shape[shared:]))),
                                     ops.reshape(d, (batch, -1, math.prod(d.shape[shared:]))))
            return ops.reshape(rows, (batch,) + tuple(inputs.shape[shared:]) + tuple(d.shape[shared:]))

        grads = []
        for v in variables:
            if v is getattr(layer, "lora_kernel_a", None):
                b = ops.cast(variable_value(layer.lora_kernel_b, variables, values), delta.dtype)
                grads.append(kernel_gradient(lora_scale(layer) * ops.matmul(delta, ops.transpose(b))))
            elif v is getattr(layer, "lora_kernel_b", None):
                a = ops.cast(variable_value(layer.lora_kernel_a, variables, values), inputs.dtype)
                projected = lora_scale(layer) * ops.einsum(layer.equation, inputs, a)
                batch = ops.shape(delta)[0]
                grads.append(outer_per_example(
                    ops.reshape(projected, (batch, -1, projected.shape[-1])),
                    ops.reshape(delta, (batch, -1, delta.shape[-1])),
                ))
            elif v is getattr(layer, "bias", None):
                grads.append(reduce_to(delta, tuple(v.shape)))
            else:
                grads.append(kernel_gradient(delta))
        return grads
