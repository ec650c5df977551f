"""Convolutions (1-D/2-D/3-D, grouped, depthwise, separable, transposed): the probe
before the activation; each layer's per-example gradients by a vectorized vjp of
the layer alone (the backend turns it into one batched convolution), computed
and reduced one layer at a time."""

from __future__ import annotations

import keras

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
