"""``EinsumDense`` (the projections of ``MultiHeadAttention``): the probe before the
activation; per-example gradients of this one layer by a vectorized vjp (its
kernels are small next to ``B x`` the model)."""

from __future__ import annotations

import keras

from pergrad.layer_rules.base import PreActivationRule, register_rule


@register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(PreActivationRule):
    pass
