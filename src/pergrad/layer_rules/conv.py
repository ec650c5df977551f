"""Convolutions (1-D/2-D/3-D, grouped, depthwise, separable, transposed): the probe
before the activation; each layer's per-example gradients by a vectorized vjp of
the layer alone (the backend turns it into one batched convolution), computed
and reduced one layer at a time. Where the backend adapter has a formula for an
ungrouped ``Conv1D`` / ``Conv2D`` (torch: the input's patches times the output
gradient, ``conv_kernel_per_example``), the kernel's per-example gradients come
from ``A`` and ``D`` directly and the bias's are ``D`` summed over positions."""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend import adapter
from pergrad.layer_rules.base import PreActivationRule, register_rule

_CLASSES = (
    keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
    keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D, keras.layers.SeparableConv2D,
    keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose,
)

for _cls in _CLASSES:

    @register_rule(_cls)
    class ConvolutionRule(PreActivationRule):
        pass


class _PatchConvolutionRule(PreActivationRule):
    """``Conv1D`` / ``Conv2D``: per-example gradients from ``A`` and ``D`` where the
    adapter can (ungrouped, "valid" or "same" padding), else the vjp."""

    def per_example(self, layer, values, inputs, delta) -> list:
        formula = getattr(adapter(), "conv_kernel_per_example", None)
        variables = self.variables(layer)
        kernel, bias = layer.kernel, getattr(layer, "bias", None)
        usable = (formula is not None and getattr(layer, "groups", 1) == 1
                  and all(v is kernel or v is bias for v in variables))
        grads = None
        if usable and any(v is kernel for v in variables):
            grads = formula(inputs, delta, layer.kernel_size, layer.strides, layer.padding,
                            layer.dilation_rate, layer.data_format == "channels_last")
        if not usable or (grads is None and any(v is kernel for v in variables)):
            return super().per_example(layer, values, inputs, delta)
        channel_axis = len(delta.shape) - 1 if layer.data_format == "channels_last" else 1
        positions = [axis for axis in range(1, len(delta.shape)) if axis != channel_axis]
        return [grads if v is kernel else ops.sum(delta, axis=positions) for v in variables]


for _cls in (keras.layers.Conv1D, keras.layers.Conv2D):
    register_rule(_cls)(type("ConvolutionRule", (_PatchConvolutionRule,), {}))
