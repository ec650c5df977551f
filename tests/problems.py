"""The test problems, defined once (in the style of BackPACK's and Opacus's test suites).

Each problem is a factory that builds a tiny, seeded Keras model with its inputs,
targets and loss. Every factory is deterministic: calling it twice gives the same
weights and data, which the "plain Keras vs pergrad" comparisons rely on.

Shapes are tiny on purpose: the suite runs on two CPU cores for three backends.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import pytest
from keras import ops

BATCH = 6  # examples per test batch (microbatch tests use a size that does not divide it)


@dataclass
class Problem:
    """A model, its data and its loss.

    ``loss`` and ``loss_weights`` are what one passes to ``compile``. No problem has
    dropout, batch normalization or weight regularizers: per-example gradients are
    deterministic and the batch-of-one oracle applies without adjustment.
    """

    name: str
    model: keras.Model
    x: Any
    y: Any
    loss: Any
    loss_weights: Any = None
    sample_weight: np.ndarray = field(default=None)
    metrics: Any = None
    #: Valid (unmasked) steps per example, for models with masked outputs.
    valid_steps: np.ndarray | None = None

    def scale(self):
        """pergrad's per-example factor on top of the batch-of-one gradient (DESIGN §1)."""
        if self.valid_steps is None:
            return None
        valid = np.asarray(self.valid_steps, "float64")
        return len(valid) * valid / valid.sum()

    @property
    def batch_size(self) -> int:
        return len(keras.tree.flatten(self.x)[0])

    def compile(self, model=None, optimizer="sgd", **kwargs):
        model = self.model if model is None else model
        model.compile(
            optimizer=optimizer,
            loss=self.loss,
            loss_weights=self.loss_weights,
            metrics=self.metrics,
            **kwargs,
        )
        return model


class UnsizedBatches(keras.utils.PyDataset):
    """``x, y`` in unshuffled batches of ``size``, a source whose sizes ``fit()`` cannot see
    before the steps (arrays are checked up front): a batch a rule refuses reaches its step."""

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        part = slice(index * self.size, (index + 1) * self.size)
        return self.x[part], self.y[part]


def _rng(seed):
    return np.random.default_rng(seed)


def _floats(rng, *shape):
    return rng.normal(size=shape).astype("float32")


def _labels(rng, classes, *shape):
    return rng.integers(0, classes, size=shape).astype("int32")


def _sample_weight(rng, batch):
    # Distinct, positive, not all one: a wrong weighting changes the result.
    return rng.uniform(0.2, 2.0, size=(batch,)).astype("float32")


# --- factories ------------------------------------------------------------------------


def dense_mlp(batch=BATCH, seed=0, l2=None, dropout=None, hidden=4):
    """The workhorse. ``l2`` adds an L2 kernel regularizer, ``dropout`` a Dropout layer
    (unseeded: ``keras.utils.set_random_seed(seed)`` seeds it)."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    regularizer = None if l2 is None else keras.regularizers.L2(l2)
    layers = [
        keras.Input((5,)),
        keras.layers.Dense(hidden, activation="tanh", kernel_regularizer=regularizer),
    ]
    if dropout is not None:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(3, kernel_regularizer=regularizer))
    model = keras.Sequential(layers, name="dense_mlp")
    return Problem(
        "dense_mlp",
        model,
        _floats(rng, batch, 5),
        _labels(rng, 3, batch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=_sample_weight(rng, batch),
        metrics=["accuracy"],
    )


def conv1d(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = keras.Sequential(
        [
            keras.Input((7, 2)),
            keras.layers.Conv1D(3, 3, activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ],
        name="conv1d",
    )
    return Problem(
        "conv1d", model, _floats(rng, batch, 7, 2), _floats(rng, batch, 2), "mse",
        sample_weight=_sample_weight(rng, batch),
    )


def conv2d(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = keras.Sequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.Conv2D(3, 3, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ],
        name="conv2d",
    )
    return Problem(
        "conv2d",
        model,
        _floats(rng, batch, 5, 5, 2),
        _labels(rng, 3, batch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=_sample_weight(rng, batch),
    )


def layer_norm(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2),
        ],
        name="layer_norm",
    )
    return Problem(
        "layer_norm", model, _floats(rng, batch, 5), _floats(rng, batch, 2), "mse",
        sample_weight=_sample_weight(rng, batch),
    )


def embedding(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(7, 3),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ],
        name="embedding",
    )
    x = _labels(rng, 7, batch, 5)
    x[:, 1] = x[:, 0]  # a repeated token: its embedding gradient must accumulate
    return Problem(
        "embedding", model, x, _floats(rng, batch, 2), "mse", sample_weight=_sample_weight(rng, batch)
    )


def _recurrent(name, layer_class, batch, seed):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = keras.Sequential(
        [keras.Input((4, 3)), layer_class(3), keras.layers.Dense(2)], name=name
    )
    return Problem(
        name, model, _floats(rng, batch, 4, 3), _floats(rng, batch, 2), "mse",
        sample_weight=_sample_weight(rng, batch),
    )


def lstm(batch=BATCH, seed=0):
    return _recurrent("lstm", keras.layers.LSTM, batch, seed)


def gru(batch=BATCH, seed=0):
    return _recurrent("gru", keras.layers.GRU, batch, seed)


def attention(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    inputs = keras.Input((4, 3))
    hidden = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)(inputs, inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    outputs = keras.layers.Dense(2)(hidden)
    model = keras.Model(inputs, outputs, name="attention")
    return Problem(
        "attention", model, _floats(rng, batch, 4, 3), _floats(rng, batch, 2), "mse",
        sample_weight=_sample_weight(rng, batch),
    )


def multi_input(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    hidden = keras.layers.Concatenate()(
        [keras.layers.Dense(3, activation="tanh")(a), keras.layers.Dense(2, activation="tanh")(b)]
    )
    outputs = keras.layers.Dense(2)(hidden)
    model = keras.Model({"a": a, "b": b}, outputs, name="multi_input")
    x = {"a": _floats(rng, batch, 3), "b": _floats(rng, batch, 2)}
    return Problem(
        "multi_input", model, x, _floats(rng, batch, 2), "mse", sample_weight=_sample_weight(rng, batch)
    )


def multi_output(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    first = keras.layers.Dense(2, name="first")(hidden)
    second = keras.layers.Dense(3, name="second")(hidden)
    model = keras.Model(inputs, {"first": first, "second": second}, name="multi_output")
    y = {"first": _floats(rng, batch, 2), "second": _labels(rng, 3, batch)}
    return Problem(
        "multi_output",
        model,
        _floats(rng, batch, 4),
        y,
        {"first": "mse", "second": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        loss_weights={"first": 0.3, "second": 2.0},
        sample_weight=_sample_weight(rng, batch),
    )


@keras.saving.register_keras_serializable(package="pergrad_tests")
class SmallSubclassed(keras.Model):
    """A subclassed model with a residual-ish connection."""

    def __init__(self, units=4, outputs=2, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.outputs_ = outputs
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.gate = keras.layers.Dense(units, activation="sigmoid")
        self.head = keras.layers.Dense(outputs)

    def call(self, inputs):
        hidden = self.hidden(inputs)
        return self.head(hidden * self.gate(hidden))

    def get_config(self):
        return {**super().get_config(), "units": self.units, "outputs": self.outputs_}


def subclassed(batch=BATCH, seed=0):
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = SmallSubclassed(name="subclassed")
    x = _floats(rng, batch, 5)
    model(x[:1])  # builds it
    return Problem(
        "subclassed", model, x, _floats(rng, batch, 2), "mse", sample_weight=_sample_weight(rng, batch)
    )


def sequence_output(batch=BATCH, seed=0):
    """A per-timestep loss: outputs (B, T, C), targets (B, T)."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    model = keras.Sequential(
        [
            keras.Input((4, 3)),
            keras.layers.Conv1D(4, 2, padding="same", activation="tanh"),
            keras.layers.Dense(3),
        ],
        name="sequence_output",
    )
    return Problem(
        "sequence_output",
        model,
        _floats(rng, batch, 4, 3),
        _labels(rng, 3, batch, 4),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # Temporal weights, one per example and step (Keras rejects (B,) weights here).
        sample_weight=rng.uniform(0.2, 2.0, size=(batch, 4)).astype("float32"),
    )


def masked(batch=BATCH, seed=0):
    """Embedding(mask_zero=True) + LSTM(return_sequences=True) + Dense, padded sequences.

    Examples have different numbers of valid steps, so Keras's normalization by the
    batch's count of valid steps differs from each example's own count.
    """
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    steps = 5
    model = keras.Sequential(
        [
            keras.Input((steps,), dtype="int32"),
            keras.layers.Embedding(6, 3, mask_zero=True),
            keras.layers.LSTM(3, return_sequences=True),
            keras.layers.Dense(2),
        ],
        name="masked",
    )
    x = rng.integers(1, 6, size=(batch, steps)).astype("int32")
    lengths = 1 + np.arange(batch) % steps  # 1, 2, ..., steps, 1, ...
    for i, length in enumerate(lengths):
        x[i, length:] = 0
    problem = Problem(
        "masked",
        model,
        x,
        _labels(rng, 2, batch, steps),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # Temporal weights: Keras cannot combine (B,) weights with a (B, T) mask, and
        # on torch not (B, 1) either (an in-place product in keras.losses.loss.apply_mask).
        sample_weight=rng.uniform(0.2, 2.0, size=(batch, steps)).astype("float32"),
    )
    problem.valid_steps = (x != 0).sum(axis=1)
    return problem


def masked_dense(batch=BATCH, seed=0):
    """A cheap masked sequence model: Embedding(mask_zero=True) + Dense layers (which pass
    the mask on), per-timestep loss. Same data layout as :func:`masked`, no RNN."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    steps = 5
    model = keras.Sequential(
        [
            keras.Input((steps,), dtype="int32"),
            keras.layers.Embedding(6, 3, mask_zero=True),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(2),
        ],
        name="masked_dense",
    )
    x = rng.integers(1, 6, size=(batch, steps)).astype("int32")
    lengths = 1 + np.arange(batch) % steps
    for i, length in enumerate(lengths):
        x[i, length:] = 0
    problem = Problem(
        "masked_dense",
        model,
        x,
        _labels(rng, 2, batch, steps),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=rng.uniform(0.2, 2.0, size=(batch, steps)).astype("float32"),
    )
    problem.valid_steps = (x != 0).sum(axis=1)
    return problem


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io's "Text classification with Transformer": positions from ``ops.arange``
    (no batch axis) through a second Embedding."""

    def __init__(self, maxlen, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab, dim)
        self.pos_emb = keras.layers.Embedding(maxlen, dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class ConstantPositions(keras.layers.Layer):
    """ViT's pattern: position ids made in ``build()`` with a leading axis of one."""

    def build(self, shape):
        self.table = keras.layers.Embedding(shape[1], shape[-1])
        self.table.build((1, shape[1]))
        self.position_ids = keras.ops.expand_dims(keras.ops.arange(shape[1]), 0)

    def call(self, x):
        return x + self.table(self.position_ids)


class FixedQueries(keras.layers.Layer):
    """A Dense layer called on a weight (``(T, d)``, no batch axis): learned queries."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.projection = keras.layers.Dense(units)

    def build(self, shape):
        self.queries = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal",
                                       trainable=False, name="queries")

    def call(self, x):
        return x + self.projection(self.queries)


def constant_inputs(batch=BATCH, seed=0):
    """Layers whose inputs do not depend on the example: an Embedding on ``arange``
    positions (``(T,)``), one on ids made in ``build()`` (``(1, T)``), a Dense on a
    weight (``(T, d)``). Each example's gradient reads them as broadcast over the batch."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    inputs = keras.Input((5,), dtype="int32")
    hidden = TokenAndPositionEmbedding(5, 7, 4)(inputs)
    hidden = ConstantPositions()(hidden)
    hidden = FixedQueries(4)(hidden)
    hidden = keras.layers.Dense(3, activation="tanh")(hidden)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, outputs, name="constant_inputs")
    return Problem(
        "constant_inputs", model, _labels(rng, 7, batch, 5), _floats(rng, batch, 2), "mse",
        sample_weight=_sample_weight(rng, batch),
    )


class TransformerBlock(keras.layers.Layer):
    """keras.io's "Text classification with Transformer" block, as published."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.dropout1(self.att(inputs, inputs))
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1))
        return self.layernorm2(out1 + ffn_output)


def text_transformer(batch=BATCH, seed=0, rate=0.0):
    """keras.io's "Text classification with Transformer" (token and ``arange`` position
    embeddings, one block, pooling, two Dense layers; ``rate`` its dropout, 0.1 there),
    in a tiny size."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    maxlen, vocab, dim = 6, 20, 4
    inputs = keras.Input((maxlen,))
    hidden = TokenAndPositionEmbedding(maxlen, vocab, dim)(inputs)
    hidden = TransformerBlock(dim, 2, 8, rate)(hidden)
    hidden = keras.layers.Dropout(rate)(keras.layers.GlobalAveragePooling1D()(hidden))
    hidden = keras.layers.Dropout(rate)(keras.layers.Dense(5, activation="relu")(hidden))
    outputs = keras.layers.Dense(2, activation="softmax")(hidden)
    model = keras.Model(inputs, outputs, name="text_transformer")
    return Problem(
        "text_transformer", model, _labels(rng, vocab, batch, maxlen).astype("float32"),
        _labels(rng, 2, batch), "sparse_categorical_crossentropy", sample_weight=_sample_weight(rng, batch),
    )


def _randomized_lora(layer, rng, rank):
    """``enable_lora(rank)`` with a random ``B`` (Keras starts it at zero, where ``A``'s
    gradient vanishes and a wrong formula for it would pass)."""
    layer.enable_lora(rank)
    layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))


def lora(batch=BATCH, seed=0):
    """LoRA-enabled Dense (2-D and sequence input, one with its kernel trainable again)
    and EinsumDense (an attention-style projection)."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    inputs = keras.Input((3, 4))
    sequence = keras.layers.Dense(5, activation="tanh")
    heads = keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(3, 2, 3), bias_axes="nh")
    pooled = keras.layers.Dense(4, activation="tanh")
    head = keras.layers.Dense(3)
    hidden = sequence(inputs)
    hidden = keras.layers.Reshape((3, 6))(heads(hidden))
    hidden = pooled(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, head(hidden), name="lora")
    for layer, rank in ((sequence, 2), (heads, 2), (pooled, 1)):
        _randomized_lora(layer, rng, rank)
    pooled.kernel.trainable = True  # LoRA and the full kernel both trained
    return Problem(
        "lora", model, _floats(rng, batch, 3, 4), _labels(rng, 3, batch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=_sample_weight(rng, batch),
    )


def reversible_embedding(batch=BATCH, seed=0):
    """A language model with tied input/output embeddings (``ReversibleEmbedding``, one
    table read as the embedding and, transposed, as the output layer; its logits soft-
    capped) and an untied one; per-token loss. Shapes put the tied head on the ghost
    formula (3 T^2 < d vocab; its norm from blocks of the formed gradients, T > d vocab / (d + vocab))
    and the untied one on formed gradients."""
    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    steps, vocab = 5, 11
    tied = keras.layers.ReversibleEmbedding(vocab, 8, logit_soft_cap=3.0)
    untied = keras.layers.ReversibleEmbedding(vocab, 4, tie_weights=False)
    inputs = keras.Input((steps,), dtype="int32")
    hidden = keras.layers.Dense(8, activation="tanh")(tied(inputs))
    small = keras.layers.Dense(4, activation="tanh")(untied(inputs))
    logits = tied(hidden, reverse=True) + untied(small, reverse=True)
    model = keras.Model(inputs, logits, name="reversible_embedding")
    x = _labels(rng, vocab, batch, steps)
    x[:, 1] = x[:, 0]  # a repeated token
    return Problem(
        "reversible_embedding", model, x, _labels(rng, vocab, batch, steps),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=rng.uniform(0.2, 2.0, size=(batch, steps)).astype("float32"),
    )


# --- keras-hub's own layers (the package is optional: these factories import it) -----------

#: Marks a test that builds keras-hub layers (a dev requirement, not one of pergrad's).
needs_keras_hub = pytest.mark.skipif(importlib.util.find_spec("keras_hub") is None,
                                     reason="keras-hub is not installed")

KERAS_HUB_NORMS = [  # (path under keras_hub.src.models, class name, constructor arguments)
    ("llama.llama_layernorm", "LlamaLayerNorm", {}),
    ("mistral.mistral_layer_norm", "MistralLayerNormalization", {}),
    ("mixtral.mixtral_layer_norm", "MixtralLayerNormalization", {}),
    ("phi3.phi3_layernorm", "Phi3LayerNorm", {}),
    ("qwen.qwen_layernorm", "QwenLayerNorm", {}),
    ("qwen3.qwen3_layernorm", "Qwen3LayerNorm", {}),
    ("t5.t5_layer_norm", "T5LayerNorm", {}),
    ("gemma.rms_normalization", "RMSNormalization", {}),
    ("gemma3.gemma3_layers", "RMSNormalization", {}),
]


def keras_hub_text(batch=BATCH, seed=0):
    """keras-hub's token embedding (tied), ``PositionEmbedding`` and every RMS norm
    pergrad has a rule for, with random scales, as in a small decoder."""
    import importlib

    import keras_hub

    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    steps, vocab, dim = 5, 13, 6
    tokens = keras_hub.layers.ReversibleEmbedding(vocab, dim)
    inputs = keras.Input((steps,), dtype="int32")
    hidden = tokens(inputs)
    hidden = hidden + keras_hub.layers.PositionEmbedding(sequence_length=7)(hidden)
    norms = [keras_hub.layers.RMSNormalization(dim)]
    for module, name, kwargs in KERAS_HUB_NORMS:
        norms.append(getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)(**kwargs))
    for norm in norms:
        hidden = keras.layers.Dense(dim)(norm(hidden))
    model = keras.Model(inputs, tokens(hidden, reverse=True), name="keras_hub_text")
    for norm in norms:
        (scale,) = norm.trainable_variables
        scale.assign(rng.uniform(0.5, 1.5, size=scale.shape).astype("float32"))
    return Problem(
        "keras_hub_text", model, _labels(rng, vocab, batch, steps), _labels(rng, vocab, batch, steps),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=rng.uniform(0.2, 2.0, size=(batch, steps)).astype("float32"),
    )


def keras_hub_patches(batch=BATCH, seed=0):
    """keras-hub ViT's patch embedding: a class token, a Conv2D, constant position ids."""
    from keras_hub.src.models.vit.vit_layers import ViTPatchingAndEmbedding

    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    inputs = keras.Input((4, 4, 3))
    hidden = ViTPatchingAndEmbedding(image_size=(4, 4), patch_size=(2, 2), hidden_dim=4)(inputs)
    hidden = keras.layers.Dense(3, activation="tanh")(hidden)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, outputs, name="keras_hub_patches")
    return Problem(
        "keras_hub_patches", model, _floats(rng, batch, 4, 4, 3), _labels(rng, 3, batch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=_sample_weight(rng, batch),
    )


def _token_inputs(rng, batch, steps, vocab, padded=True):
    ids = _labels(rng, vocab, batch, steps)
    mask = np.ones((batch, steps), "int32")
    if padded:
        mask[::2, -2:] = 0  # padded examples: the attention mask differs between examples
    return {"token_ids": ids, "padding_mask": mask}


def _language_model(name, task, backbone, batch, rng, steps, vocab):
    """A causal LM from keras-hub (no preprocessor: token ids in, logits out), per-token loss."""
    model = task(backbone=backbone, preprocessor=None, name=name)
    return Problem(
        name, model, _token_inputs(rng, batch, steps, vocab), _labels(rng, vocab, batch, steps),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=rng.uniform(0.2, 2.0, size=(batch, steps)).astype("float32"),
    )


def bert_classifier(batch=BATCH, seed=0):
    """keras-hub BERT (an encoder: token, segment and position embeddings, attention) and a
    classification head."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None,
                                                dropout=0.0, name="bert_classifier")
    x = _token_inputs(rng, batch, 8, 50)
    x["segment_ids"] = np.repeat(np.array([[0] * 5 + [1] * 3], "int32"), batch, axis=0)
    return Problem(
        "bert_classifier", model, x, _labels(rng, 3, batch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=_sample_weight(rng, batch),
    )


def gpt2_lm(batch=BATCH, seed=0):
    """keras-hub GPT-2 (a decoder whose LM head is its token embedding, tied)."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=60, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8, dropout=0.0)
    return _language_model("gpt2_lm", keras_hub.models.GPT2CausalLM, backbone, batch, _rng(seed), 8, 60)


def llama_lm(batch=BATCH, seed=0):
    """keras-hub Llama: rotary positions, RMS norms, grouped-query attention (4 query heads,
    2 key/value heads), an untied LM head."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=60, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=8, intermediate_dim=16)
    return _language_model("llama_lm", keras_hub.models.LlamaCausalLM, backbone, batch, _rng(seed), 8, 60)


def gemma_lm(batch=BATCH, seed=0):
    """keras-hub Gemma: grouped-query attention whose scores are 5-D for one example
    (batch, key/value heads, query groups, queries, keys), RMS norms, a tied LM head."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=60, num_layers=1, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
                                              head_dim=4)
    return _language_model("gemma_lm", keras_hub.models.GemmaCausalLM, backbone, batch, _rng(seed), 8, 60)


def vit_classifier(batch=BATCH, seed=0):
    """keras-hub ViT: patches, a class token, constant position ids, an encoder block."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    rng = _rng(seed)
    backbone = keras_hub.models.ViTBackbone(image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
                                            hidden_dim=8, mlp_dim=16)
    model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None,
                                                dropout=0.0, name="vit_classifier")
    return Problem(
        "vit_classifier", model, _floats(rng, batch, 8, 8, 3), _labels(rng, 3, batch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sample_weight=_sample_weight(rng, batch),
    )


#: keras-hub's layers, for the shared per-layer tests
KERAS_HUB_PROBLEMS = {factory.__name__: factory for factory in (keras_hub_text, keras_hub_patches)}
#: keras-hub's architectures (test_keras_hub.py)
KERAS_HUB_MODELS = {
    factory.__name__: factory for factory in (bert_classifier, gpt2_lm, llama_lm, vit_classifier, gemma_lm)
}


PROBLEMS = {
    factory.__name__: factory
    for factory in (
        dense_mlp,
        conv1d,
        conv2d,
        layer_norm,
        embedding,
        lstm,
        gru,
        attention,
        multi_input,
        multi_output,
        subclassed,
        sequence_output,
        masked,
        masked_dense,
        constant_inputs,
        text_transformer,
        lora,
        reversible_embedding,
    )
}


# Layer coverage: the models on which every layer rule is checked against the
# materialized path (engine/test_statistics_path.py, engine/test_streaming.py).

class Scale(keras.layers.Layer):
    """A layer without a rule: the fallback (a vjp of the layer alone)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w + ops.sin(x * self.w)


class TiedOutput(keras.layers.Layer):
    """Reads another layer's embedding table (tied input/output embeddings)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return ops.matmul(x, ops.transpose(self.embedding.embeddings))


def classifier(name, inputs, hidden, x, classes=3, sample_weight=True):
    rng = np.random.default_rng(1)
    outputs = keras.layers.Dense(classes)(hidden)
    model = keras.Model(inputs, outputs, name=name)
    y = rng.integers(0, classes, BATCH)
    weights = rng.uniform(0.5, 2.0, BATCH).astype("float32") if sample_weight else None
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Problem(name, model, x, y, loss, sample_weight=weights)


def seeded_floats(*shape):
    return np.random.default_rng(2).normal(size=shape).astype("float32")


def seeded_ids(vocab, *shape):
    return np.random.default_rng(3).integers(0, vocab, shape).astype("int32")


def dense_sequence():
    """Dense on (B, T, d), T = 3, every branch of the kernel's statistics
    (``dense.outer_materializes``: formed when ``d_in d_out <= 3 T^2``, else the ghost
    norm by Gram matrices, or by gradients formed in blocks when ``T > d_in d_out / (d_in + d_out)``)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3, 4))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)  # 32 > 27, 96 < 108: ghost, blocks
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)  # 64 > 27, 192 > 144: ghost, Gram
    hidden = keras.layers.Dense(3, activation="relu")(hidden)  # 18 < 24 <= 27: formed
    hidden = keras.layers.Dense(2)(hidden)  # 6 <= 27: formed
    return classifier("dense_sequence", inputs, keras.layers.Flatten()(hidden), seeded_floats(BATCH, 3, 4))


def convolutions():
    """Grouped, depthwise, separable and transposed convolutions; group and RMS normalization."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((7, 7, 4))
    hidden = keras.layers.Conv2D(4, 3, groups=2, activation="relu")(inputs)
    hidden = keras.layers.DepthwiseConv2D(2)(hidden)
    hidden = keras.layers.GroupNormalization(2)(hidden)
    hidden = keras.layers.SeparableConv2D(3, 2, activation="tanh")(hidden)
    hidden = keras.layers.Conv2DTranspose(2, 2)(hidden)
    hidden = keras.layers.RMSNormalization()(hidden)
    return classifier("convolutions", inputs, keras.layers.Flatten()(hidden), seeded_floats(BATCH, 7, 7, 4))


def conv_sequence():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 2))
    hidden = keras.layers.Conv1D(3, 2, padding="causal", activation="relu")(inputs)
    hidden = keras.layers.SeparableConv1D(2, 2)(hidden)
    hidden = keras.layers.Conv3D(2, 1)(keras.layers.Reshape((5, 2, 1, 1))(hidden))
    return classifier("conv_sequence", inputs, keras.layers.Flatten()(hidden), seeded_floats(BATCH, 6, 2))


def transformer():
    """Embedding, MultiHeadAttention (EinsumDense), LayerNormalization, Dense on sequences."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    # Two tables: T^2 = 25 > 9 forms the per-example table, 25 <= 40 takes token pairs.
    hidden = keras.layers.Embedding(9, 4)(inputs) + keras.layers.Embedding(40, 4)(inputs)
    attended = keras.layers.MultiHeadAttention(2, 2)(hidden, hidden)
    hidden = keras.layers.LayerNormalization()(hidden + attended)
    hidden = keras.layers.Dense(6, activation="relu")(hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return classifier("transformer", inputs, hidden, seeded_ids(9, BATCH, 5))


def shared_and_fallback():
    """A Dense layer called twice, a layer without a rule, a table read by two keras.layers."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(6, 3)
    hidden = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
    twice = keras.layers.Dense(3, activation="tanh")
    hidden = twice(Scale()(twice(hidden)))
    logits = TiedOutput(embedding)(hidden)  #  (BATCH, 6): the table again
    model = keras.Model(inputs, logits, name="shared_and_fallback")
    rng = np.random.default_rng(1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Problem(
        "shared_and_fallback", model, seeded_ids(6, BATCH, 4), rng.integers(0, 6, BATCH), loss,
        sample_weight=rng.uniform(0.5, 2.0, BATCH).astype("float32"),
    )


LAYER_COVERAGE = {
    factory.__name__: factory
    for factory in (dense_sequence, convolutions, conv_sequence, transformer, shared_and_fallback)
}
# gru: a recurrent layer is planned as one call (the recurrent rule runs its time loop).
LAYER_RULE_PROBLEMS = sorted(LAYER_COVERAGE) + [
    "dense_mlp", "conv1d", "embedding", "layer_norm", "gru", "multi_output", "masked_dense",
    "sequence_output", "subclassed", "constant_inputs", "lora", "reversible_embedding",
] + [pytest.param(name, marks=needs_keras_hub) for name in KERAS_HUB_PROBLEMS]


def make(name: str, **kwargs) -> Problem:
    return {**PROBLEMS, **LAYER_COVERAGE, **KERAS_HUB_PROBLEMS, **KERAS_HUB_MODELS}[name](**kwargs)
