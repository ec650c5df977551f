"""The test problems, defined once (in the style of BackPACK's and Opacus's test suites).

Each problem is a factory that builds a tiny, seeded Keras model with its inputs,
targets and loss. Every factory is deterministic: calling it twice gives the same
weights and data, which the "plain Keras vs pergrad" comparisons rely on.

Shapes are tiny on purpose: the suite runs on two CPU cores for three backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

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
    )
}


def make(name: str, **kwargs) -> Problem:
    return PROBLEMS[name](**kwargs)
