"""Normalization layers (Layer, Group, RMS): the probe on the output.

Their output is ``n(x) * scale + offset``, the scale and offset broadcast along
trailing axes. ``n(x)`` is the layer's own output with the scale set to one and
the offset to zero (one batched call, Keras's arithmetic), and example i's
gradients are ``sum n(x_i) * D_i`` and ``sum D_i`` over the broadcast axes. A
layer whose variables are not broadcast along trailing axes (a normalization
axis other than the last) takes the layer's vectorized vjp.
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.layer_rules.base import OutputRule, context_values, reduce_to, register_rule


def _scale_and_offset(layer):
    scale = getattr(layer, "gamma", None) if not isinstance(layer, keras.layers.RMSNormalization) \
        else getattr(layer, "scale", None)
    return scale, getattr(layer, "beta", None)


for _cls in (keras.layers.LayerNormalization, keras.layers.GroupNormalization,
             keras.layers.RMSNormalization):

    @register_rule(_cls)
    class NormalizationRule(OutputRule):
        def per_example(self, layer, values, inputs, delta) -> list:
            variables = self.variables(layer)
            trailing = all(tuple(v.shape) == tuple(delta.shape[len(delta.shape) - len(v.shape):])
                           for v in variables)
            scale, offset = _scale_and_offset(layer)
            if not trailing or any(v is not scale and v is not offset for v in variables):
                return super().per_example(layer, values, inputs, delta)
            unit = [(v, ops.ones(v.shape, v.dtype)) for v in (scale,) if v is not None]
            unit += [(v, ops.zeros(v.shape, v.dtype)) for v in (offset,) if v is not None]
            with keras.StatelessScope(state_mapping=context_values() + unit):
                normalized = ops.cast(layer(inputs), "float32")
            return [
                reduce_to(normalized * delta if v is scale else delta, tuple(v.shape)) for v in variables
            ]
