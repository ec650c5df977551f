"""Layer rules of the statistics path: a registry keyed by Keras layer class.

See :mod:`pergrad.layer_rules.base` for the protocol. pergrad registers rules
for ``Dense`` (ghost norms; LoRA too), ``EinsumDense``, the convolutions,
``Embedding``, ``ReversibleEmbedding`` (both directions) and the normalization
layers, and, by dotted path without importing keras-hub, for keras-hub's
``PositionEmbedding``, its RMS norms and ViT's class token; users register
rules for their own layers with :func:`register_rule` (:func:`registered_rules`
lists every registration). A trainable layer without a rule takes the fallback:
its per-example gradients by a vectorized vjp of the layer alone.
"""

from pergrad.layer_rules import (  # noqa: F401 (registers)
    conv,
    dense,
    einsum_dense,
    embedding,
    normalization,
    recurrent,
    vision,
)
from pergrad.layer_rules.base import (
    LayerRule,
    OutputRule,
    PreActivationRule,
    per_example_vjp,
    register_rule,
    registered_rules,
    rule_for,
)

__all__ = ["LayerRule", "OutputRule", "PreActivationRule", "per_example_vjp", "register_rule",
           "registered_rules", "rule_for"]
