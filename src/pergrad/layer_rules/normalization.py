"""Normalization layers: the probe on the output; per-example gradients of the scale
and offset (``d`` floats per example) by a vectorized vjp of the layer alone."""

from __future__ import annotations

import keras

from pergrad.layer_rules.base import OutputRule, register_rule

for _cls in (keras.layers.LayerNormalization, keras.layers.GroupNormalization,
             keras.layers.RMSNormalization):

    @register_rule(_cls)
    class NormalizationRule(OutputRule):
        pass
