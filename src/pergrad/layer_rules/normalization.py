"""Normalization layers (Layer, Group, RMS; keras-hub's RMS norms) and ConvNeXt's
``LayerScale``: the probe on the output.

Their output is ``n(x) * m(scale) + offset`` with ``m`` affine (``scale``, or
``1 + scale`` in Gemma's norms), the scale and offset broadcast along trailing
axes. ``n(x)`` is the layer's own output with the scale at the value that makes
``m`` one and the offset at zero (one batched call, the layer's arithmetic), and
example i's gradients are ``sum n(x_i) * D_i`` and ``sum D_i`` over the
broadcast axes. A layer whose variables are not broadcast along trailing axes (a
normalization axis other than the last) takes the layer's vectorized vjp.
``LayerScale`` is the same with ``n(x) = x`` and no offset.

keras-hub's norms are registered by their dotted paths (pergrad imports nothing
from keras-hub); each computes ``x / rms(x) * m(scale)`` along the last axis.
``LayerScale`` too (a class of ``keras.applications``' private modules).
"""

from __future__ import annotations

import keras
from keras import ops

from pergrad.layer_rules.base import OutputRule, layer_context, reduce_to, register_rule
from pergrad.tensors import cast


class NormalizationRule(OutputRule):
    """``n(x) * m(scale) + offset``: ``scale`` and ``offset`` name the layer's attributes
    (``None``: absent), ``unit`` is the scale's value at which ``m`` is one."""

    scale, offset, unit = "gamma", "beta", 1.0

    def per_example(self, layer, values, inputs, delta) -> list:
        variables = self.variables(layer)
        trailing = all(tuple(v.shape) == tuple(delta.shape[len(delta.shape) - len(v.shape):])
                       for v in variables)
        scale = getattr(layer, self.scale, None) if self.scale else None
        offset = getattr(layer, self.offset, None) if self.offset else None
        if not trailing or any(v is not scale and v is not offset for v in variables):
            return super().per_example(layer, values, inputs, delta)
        normalized = ops.cast(self.normalized(layer, inputs, scale, offset), "float32")
        return [
            reduce_to(normalized * delta if v is scale else delta, tuple(v.shape)) for v in variables
        ]

    def normalized(self, layer, inputs, scale, offset):
        """``n(x)``: the layer's own call with ``m`` one and the offset zero."""
        unit = [(v, ops.full(v.shape, self.unit, v.dtype)) for v in (scale,) if v is not None]
        unit += [(v, ops.zeros(v.shape, v.dtype)) for v in (offset,) if v is not None]
        # (normalization layers read their own variables only)
        with keras.StatelessScope(state_mapping=layer_context(layer) + unit):
            return layer(inputs)


register_rule(keras.layers.GroupNormalization)(NormalizationRule)


@register_rule("keras.src.applications.convnext.LayerScale")
class LayerScaleRule(NormalizationRule):
    """keras.applications ConvNeXt's ``LayerScale``, ``x * gamma`` (Touvron et al., "Going
    deeper with Image Transformers", ICCV 2021): ``n(x) = x``."""

    scale, offset = "gamma", None

    def normalized(self, layer, inputs, scale, offset):
        return inputs


@register_rule(keras.layers.LayerNormalization)
class LayerNormalizationRule(NormalizationRule):
    def normalized(self, layer, inputs, scale, offset):
        if "layer_normalization" not in type(layer).call.__code__.co_names:
            # (Keras 3.10 writes the arithmetic out in the layer's call; 3.15 calls the op)
            return super().normalized(layer, inputs, scale, offset)
        # The layer's call is ops.layer_normalization of its compute-dtype input: here
        # without gamma and beta (the same values as at one and zero), without the layer
        # call and its scope (half of a 1 ms recompute on torch at B = 64, T = 64).
        return ops.layer_normalization(
            cast(inputs, layer.compute_dtype), None, None, axis=layer.axis, epsilon=layer.epsilon,
            rms_scaling=layer.rms_scaling,
        )


@register_rule(keras.layers.RMSNormalization)
class RMSNormalizationRule(NormalizationRule):
    scale, offset = "scale", None


_KERAS_HUB_RMS_NORMS = [  # x / rms(x) * scale
    "layers.modeling.rms_normalization.RMSNormalization",
    "models.llama.llama_layernorm.LlamaLayerNorm",
    "models.mistral.mistral_layer_norm.MistralLayerNormalization",
    "models.mixtral.mixtral_layer_norm.MixtralLayerNormalization",
    "models.phi3.phi3_layernorm.Phi3LayerNorm",
    "models.qwen.qwen_layernorm.QwenLayerNorm",
    "models.qwen3.qwen3_layernorm.Qwen3LayerNorm",
]
for _path in _KERAS_HUB_RMS_NORMS:
    register_rule(f"keras_hub.src.{_path}")(RMSNormalizationRule)


@register_rule("keras_hub.src.models.t5.t5_layer_norm.T5LayerNorm")
class T5LayerNormRule(NormalizationRule):
    scale, offset = "weight", None


for _path in ("models.gemma.rms_normalization.RMSNormalization",
              "models.gemma3.gemma3_layers.RMSNormalization"):

    @register_rule(f"keras_hub.src.{_path}")
    class GemmaNormalizationRule(NormalizationRule):
        """Gemma's ``x / rms(x) * (1 + scale)``: ``n(x)`` at ``scale = 0``."""

        scale, offset, unit = "scale", None, 0.0
