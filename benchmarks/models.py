"""The benchmarks' models, data, loss, optimizer and rule parameters, alike for every variant.

Random data, fixed seed, sparse categorical cross-entropy from logits,
SGD(0.01); ``mlp<B>`` / ``cnn<B>`` / ``tfm<B>`` / ``gpt<B>`` / ``lora<B>`` at
any batch size B:

- ``mlp<B>``: MLP 784-256-256-10;
- ``cnn<B>``: 28x28x1 -> Conv 3x3x16 relu -> Conv 3x3x32 relu -> MaxPool 2 ->
  Flatten -> Dense 10;
- ``tfm<B>``: a one-block transformer classifier on token ids (B, 64) from a
  vocabulary of 1000: Embedding(1000, 64) + a learned position Embedding(64, 64)
  -> MultiHeadAttention(2 heads, key_dim 32) + residual -> LayerNormalization ->
  Dense(128, relu) -> Dense(64) + residual -> LayerNormalization ->
  GlobalAveragePooling1D -> Dense(10);
- ``gpt<B>``: a GPT-2-style language model, keras-hub's ``GPT2CausalLM``
  (``GPT2Backbone``, no preprocessor) from constructor arguments: vocabulary
  8192, T = 128, hidden 64, 2 layers of 2 heads, MLP 256, no dropout; the LM
  head is the token embedding, tied (``ReversibleEmbedding``); per-token loss on
  random tokens (next-token prediction);
- ``lora<B>``: the same model after ``backbone.enable_lora(4)`` (only the LoRA
  factors of the query and value projections are trained);
- ``llama<B>``: keras-hub's ``LlamaCausalLM`` of the same sizes (4 query heads
  sharing 2 key/value heads, rotary positions, RMS norms, a gated MLP, an untied
  head), per-token loss as ``gpt<B>``;
- ``bert<B>``: keras-hub's ``BertTextClassifier`` (``BertBackbone`` of the same
  sizes: token, segment and position embeddings, post-LayerNorm) on 10 classes, one
  label per example;
- ``lstm<B>``: keras.io's bidirectional LSTM text classifier, one layer: token ids
  (B, 64) from a vocabulary of 1000 -> Embedding(1000, 64) -> Bidirectional(LSTM(32))
  -> Dense(10);
- ``gru<B>``: a time-series regressor: (B, 64, 8) floats -> GRU(32) -> Dense(1),
  mean squared error on one target per example.

The convolution models (``--suite conv``), on 32x32x3 images:

- ``resnet<B>``: a ResNet-style stack, frozen BatchNormalization (inference mode)
  after every convolution: a 3x3 stem of 32 channels, then four stages of two
  basic blocks (3x3, 3x3; the first of each later stage strides 2 with a 1x1
  projection shortcut) of 32, 64, 128 and 256 channels at 32x32 down to 4x4 ->
  GlobalAveragePooling2D -> Dense 10;
- ``convnext<B>``: ConvNeXt-style blocks as keras.applications builds them: a 4x4
  stride-4 stem of 48 channels + LayerNormalization, two blocks (depthwise 7x7 as a
  grouped Conv2D, LayerNormalization, Dense 4C, GELU, Dense C, LayerScale,
  residual) at 8x8, a LayerNormalization + 2x2 stride-2 convolution to 96 channels,
  two blocks at 4x4 -> GlobalAveragePooling2D -> LayerNormalization -> Dense 10;
- ``dwconv<B>``: 3x3 stem of 32 channels, then DepthwiseConv2D 3x3 (relu) and a
  1x1 Conv2D of 64 channels, DepthwiseConv2D 3x3 stride 2 and a 1x1 Conv2D of 128
  channels -> GlobalAveragePooling2D -> Dense 10 (MobileNet's separable pairs);
- ``mobilenet<B>``: MobileNetV2 inverted residual blocks with GroupNormalization
  (8 groups) after every convolution: a 3x3 stride-2 stem of 32 channels, then
  blocks (expansion 6: 1x1 expand, relu6, DepthwiseConv2D 3x3, relu6, 1x1 project)
  of 16, 24 (stride 2), 24, 32 (stride 2), 32 channels -> GlobalAveragePooling2D ->
  Dense 10.

The language models need keras-hub (a dev requirement).
"""

from __future__ import annotations

import re

import keras
import numpy as np
from keras import ops

SEED = 0
LEARNING_RATE = 0.01
# the transformer classifier
VOCAB, SEQUENCE, WIDTH, HEADS, KEY_DIM, FFN, CLASSES = 1000, 64, 64, 2, 32, 128, 10
# the GPT-2-style language model (keras-hub) and its LoRA variant
LM_KINDS = ("gpt", "lora", "llama")
#: the keras-hub models (``--suite lm``'s rows)
HUB_KINDS = LM_KINDS + ("bert",)
#: the convolution models (``--suite conv``), on IMAGE x IMAGE x 3 images
CONV_KINDS = ("resnet", "convnext", "dwconv", "mobilenet")
IMAGE = 32
LM_VOCAB, LM_SEQUENCE, LM_WIDTH, LM_LAYERS, LM_HEADS, LM_FFN, LORA_RANK = 8192, 128, 64, 2, 2, 256, 4
# the recurrent models (``--suite rnn``): the LSTM classifier reads the transformer's tokens
RNN_KINDS = ("lstm", "gru")
RNN_UNITS, SERIES_FEATURES = 32, 8

# the rules' parameters, the same in every variant of a rule (pergrad's, the recipes', the peers')
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
KRUM_BYZANTINE = 0.1
TRIM = 0.1  # trimmed_mean(TRIM), meamed(TRIM)
BUCKET_SIZE = 8  # bucketing(BUCKET_SIZE, median())


def parse_model(key: str) -> tuple[str, int]:
    """``"mlp64"`` -> ``("mlp", 64)``: the architecture and the batch size."""
    kinds = "mlp|cnn|tfm|gpt|lora|llama|bert|lstm|gru|resnet|convnext|dwconv|mobilenet"
    match = re.fullmatch(rf"({kinds})(\d+)", key)
    if not match:
        raise ValueError(
            f"unknown model {key!r}: use mlp<batch>, cnn<batch>, tfm<batch>, gpt<batch>, "
            "lora<batch>, llama<batch>, bert<batch>, lstm<batch>, gru<batch>, resnet<batch>, "
            "convnext<batch>, dwconv<batch> or mobilenet<batch>, e.g. mlp64, tfm64, gpt8, resnet16"
        )
    return match.group(1), int(match.group(2))


def build_model(kind: str) -> keras.Model:
    keras.utils.set_random_seed(SEED)  # every variant starts from the same weights
    if kind == "tfm":
        return build_transformer()
    if kind in ("gpt", "lora"):
        return build_language_model(lora=kind == "lora")
    if kind == "llama":
        return build_llama()
    if kind == "bert":
        return build_bert()
    if kind in RNN_KINDS:
        return build_recurrent(kind)
    if kind in CONV_KINDS:
        return CONV_BUILDERS[kind]()
    if kind == "mlp":
        layers = [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        layers = [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    return keras.Sequential(layers, name=kind)


def build_transformer() -> keras.Model:
    """A one-block transformer classifier on token ids (B, 64), post-LayerNorm.

    The learned position embedding is an ``Embedding(64, 64)`` of the position
    ids, built inside the graph from the token ids' shape (no custom layer).
    """
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    positions = ops.zeros_like(tokens) + ops.arange(SEQUENCE, dtype="int32")[None, :]
    h = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")(tokens)
    h = h + keras.layers.Embedding(SEQUENCE, WIDTH, name="positions")(positions)
    attended = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm1")(h + attended)
    f = keras.layers.Dense(FFN, activation="relu", name="ffn1")(h)
    f = keras.layers.Dense(WIDTH, name="ffn2")(f)
    h = keras.layers.LayerNormalization(name="norm2")(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    logits = keras.layers.Dense(CLASSES, name="logits")(h)
    return keras.Model(tokens, logits, name="tfm")


def build_language_model(lora: bool) -> keras.Model:
    """keras-hub's GPT-2 causal LM (its head the tied token embedding), from constructor
    arguments; with ``lora``, ``backbone.enable_lora(LORA_RANK)``."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=LM_VOCAB, num_layers=LM_LAYERS, num_heads=LM_HEADS, hidden_dim=LM_WIDTH,
        intermediate_dim=LM_FFN, max_sequence_length=LM_SEQUENCE, dropout=0.0,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None,
                                          name="lora" if lora else "gpt")
    if lora:
        backbone.enable_lora(LORA_RANK)
    return model


def build_llama() -> keras.Model:
    """keras-hub's Llama causal LM (untied head), the GPT-2 model's sizes."""
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=LM_VOCAB, num_layers=LM_LAYERS, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=LM_WIDTH, intermediate_dim=LM_FFN, dropout=0.0,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None, name="llama")


def build_bert() -> keras.Model:
    """keras-hub's BERT classifier, the GPT-2 model's sizes, 10 classes."""
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=LM_VOCAB, num_layers=LM_LAYERS, num_heads=LM_HEADS, hidden_dim=LM_WIDTH,
        intermediate_dim=LM_FFN, max_sequence_length=LM_SEQUENCE, dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=CLASSES, preprocessor=None,
                                               dropout=0.0, name="bert")


def build_recurrent(kind: str) -> keras.Model:
    """``lstm``: Embedding(1000, 64) of (B, 64) ids -> Bidirectional(LSTM(32)) -> Dense(10);
    ``gru``: (B, 64, 8) floats -> GRU(32) -> Dense(1)."""
    if kind == "lstm":
        layers = [keras.Input((SEQUENCE,), dtype="int32"), keras.layers.Embedding(VOCAB, WIDTH),
                  keras.layers.Bidirectional(keras.layers.LSTM(RNN_UNITS)), keras.layers.Dense(CLASSES)]
    else:
        layers = [keras.Input((SEQUENCE, SERIES_FEATURES)), keras.layers.GRU(RNN_UNITS),
                  keras.layers.Dense(1)]
    return keras.Sequential(layers, name=kind)


def _frozen_norm(h):
    """BatchNormalization in inference mode (frozen: no trainable variable, no batch statistics)."""
    norm = keras.layers.BatchNormalization()
    norm.trainable = False
    return norm(h)


def build_resnet() -> keras.Model:
    """A ResNet-style stack of basic blocks, BatchNormalization frozen."""
    layers = keras.layers

    def conv(h, filters, kernel, strides=1):
        return _frozen_norm(layers.Conv2D(filters, kernel, strides=strides, padding="same")(h))

    inputs = keras.Input((IMAGE, IMAGE, 3))
    h = layers.ReLU()(conv(inputs, 32, 3))
    for stage, filters in enumerate((32, 64, 128, 256)):
        for block in range(2):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = conv(h, filters, 1, strides) if strides > 1 else h
            y = layers.ReLU()(conv(h, filters, 3, strides))
            h = layers.ReLU()(conv(y, filters, 3) + shortcut)
    logits = layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, logits, name="resnet")


def build_convnext() -> keras.Model:
    """ConvNeXt-style blocks as ``keras.applications.ConvNeXt*`` builds them (its own
    ``LayerScale``; the depthwise 7x7 a grouped Conv2D)."""
    from keras.src.applications.convnext import LayerScale

    layers = keras.layers
    inputs = keras.Input((IMAGE, IMAGE, 3))
    h = layers.LayerNormalization(epsilon=1e-6)(layers.Conv2D(48, 4, strides=4)(inputs))
    for stage, width in enumerate((48, 96)):
        if stage:
            h = layers.Conv2D(width, 2, strides=2)(layers.LayerNormalization(epsilon=1e-6)(h))
        for _ in range(2):
            y = layers.Conv2D(width, 7, padding="same", groups=width)(h)
            y = layers.LayerNormalization(epsilon=1e-6)(y)
            y = layers.Dense(4 * width, activation="gelu")(y)
            y = LayerScale(1e-6, width)(layers.Dense(width)(y))
            h = h + y
    h = layers.LayerNormalization(epsilon=1e-6)(layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, layers.Dense(CLASSES)(h), name="convnext")


def build_depthwise() -> keras.Model:
    """MobileNet's separable pairs: DepthwiseConv2D 3x3, then a 1x1 Conv2D."""
    layers = keras.layers
    inputs = keras.Input((IMAGE, IMAGE, 3))
    h = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    for filters, strides in ((64, 1), (128, 2)):
        h = layers.DepthwiseConv2D(3, strides=strides, padding="same", activation="relu")(h)
        h = layers.Conv2D(filters, 1, activation="relu")(h)
    logits = layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, logits, name="dwconv")


def build_mobilenet() -> keras.Model:
    """MobileNetV2's inverted residual blocks, GroupNormalization after every convolution."""
    layers = keras.layers

    def norm(h):
        return layers.GroupNormalization(8)(h)

    inputs = keras.Input((IMAGE, IMAGE, 3))
    h = layers.ReLU(6.0)(norm(layers.Conv2D(32, 3, strides=2, padding="same")(inputs)))
    for filters, strides in ((16, 1), (24, 2), (24, 1), (32, 2), (32, 1)):
        y = layers.ReLU(6.0)(norm(layers.Conv2D(6 * h.shape[-1], 1)(h)))
        y = layers.ReLU(6.0)(norm(layers.DepthwiseConv2D(3, strides=strides, padding="same")(y)))
        y = norm(layers.Conv2D(filters, 1)(y))
        h = h + y if strides == 1 and filters == h.shape[-1] else y
    logits = layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, logits, name="mobilenet")


CONV_BUILDERS = {"resnet": build_resnet, "convnext": build_convnext, "dwconv": build_depthwise,
                 "mobilenet": build_mobilenet}


def make_data(kind: str, batch_size: int):
    rng = np.random.default_rng(SEED)
    if kind == "bert":
        x = {"token_ids": rng.integers(0, LM_VOCAB, size=(batch_size, LM_SEQUENCE)).astype("int32"),
             "segment_ids": np.zeros((batch_size, LM_SEQUENCE), "int32"),
             "padding_mask": np.ones((batch_size, LM_SEQUENCE), "int32")}
        y = rng.integers(0, CLASSES, size=(batch_size,)).astype("int32")
        return keras.tree.map_structure(ops.convert_to_tensor, x), ops.convert_to_tensor(y)
    if kind in LM_KINDS:  # next-token prediction on random tokens
        tokens = rng.integers(0, LM_VOCAB, size=(batch_size, LM_SEQUENCE + 1)).astype("int32")
        x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch_size, LM_SEQUENCE), "int32")}
        return keras.tree.map_structure(ops.convert_to_tensor, x), ops.convert_to_tensor(tokens[:, 1:])
    if kind == "gru":
        x = rng.normal(size=(batch_size, SEQUENCE, SERIES_FEATURES)).astype("float32")
        y = rng.normal(size=(batch_size, 1)).astype("float32")
        return ops.convert_to_tensor(x), ops.convert_to_tensor(y)
    if kind in ("tfm", "lstm"):
        x = rng.integers(0, VOCAB, size=(batch_size, SEQUENCE)).astype("int32")
    elif kind in CONV_KINDS:
        x = rng.normal(size=(batch_size, IMAGE, IMAGE, 3)).astype("float32")
    else:
        shape = (batch_size, 784) if kind == "mlp" else (batch_size, 28, 28, 1)
        x = rng.normal(size=shape).astype("float32")
    y = rng.integers(0, 10, size=(batch_size,)).astype("int32")
    return ops.convert_to_tensor(x), ops.convert_to_tensor(y)


def model_sizes(key: str) -> dict:
    """The batch size, parameter count and largest trainable variable (elements) of ``key``."""
    kind, batch_size = parse_model(key)
    sizes = [int(np.prod(v.shape)) for v in build_model(kind).trainable_variables]
    return dict(batch=batch_size, parameters=sum(sizes), largest_variable=max(sizes))


def example_losses(y, logits, kind: str = "mlp"):
    """The unreduced per-example loss vector, shape (B,)."""
    if kind == "gru":
        return keras.losses.mean_squared_error(y, logits)
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def new_loss(kind: str = "mlp"):
    """``kind``'s loss: mean squared error for the regressor, else sparse categorical
    cross-entropy from logits."""
    if kind == "gru":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def new_optimizer():
    return keras.optimizers.SGD(LEARNING_RATE)
