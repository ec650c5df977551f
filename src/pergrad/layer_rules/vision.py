"""Vision embeddings: keras-hub ViT's class token (``ViTPatchingAndEmbedding``).

The layer's output is ``concat([class_token, patches], axis=1) + positions``: the
class token's gradient for example i is the output gradient at position 0. Its
patch projection (a ``Conv2D``) and position table (an ``Embedding`` on constant
ids, broadcast over the batch) are sublayers with their own rules.
"""

from __future__ import annotations

from keras import ops

from pergrad.layer_rules.base import OutputRule, register_rule


@register_rule("keras_hub.src.models.vit.vit_layers.ViTPatchingAndEmbedding")
class ClassTokenRule(OutputRule):
    def per_example(self, layer, values, inputs, delta) -> list:
        variables = self.variables(layer)
        if any(v is not getattr(layer, "class_token", None) for v in variables):
            return super().per_example(layer, values, inputs, delta)
        return [ops.reshape(delta[:, 0, :], (ops.shape(delta)[0],) + tuple(v.shape)) for v in variables]
