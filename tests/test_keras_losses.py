"""Every loss Keras ships, with the label shapes Keras accepts for it (the loss matrix).

Driven by Keras's own list: every ``keras.losses.Loss`` subclass and every loss function
``keras.losses`` exports must have an entry in :data:`CASES` or :data:`NAMES` (a new Keras
loss fails ``test_every_keras_loss_is_in_the_matrix`` until it is added). For each case:

- each example's gradient equals the ordinary Keras gradient of that example alone
  (``oracle.batch_of_one_gradients``), and their mean the batch gradient;
- ``PerExampleModel(model, "mean")`` trains exactly as plain ``fit()`` (one case per loss
  class, the first of its list);
- a loss without per-example values (one that reduces over the batch, or mixes examples)
  is refused with a clear error before any weight moves, where plain Keras trains.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest

import oracle
import pergrad

BATCH = 6
CLASSES = 3
STEPS = 5  # the CTC model's sequence length


def _targets(kind: str, rng) -> np.ndarray:
    """Labels of one kind for :data:`BATCH` examples (the label shapes Keras accepts)."""
    ids = rng.integers(0, CLASSES, BATCH)
    bits = np.array([0, 1, 1, 0, 1, 0])
    return {
        "bits": bits,  # (B,) integers 0/1, a Dense(1) head: keras.io's binary classifier
        "bits_b1": bits[:, None].astype("float32"),
        "signs": (2 * bits - 1).astype("float32"),  # hinge labels -1/1
        "multilabel": rng.integers(0, 2, (BATCH, CLASSES)).astype("float32"),
        "onehot": np.eye(CLASSES, dtype="float32")[ids],
        "soft": rng.dirichlet(np.ones(CLASSES), BATCH).astype("float32"),
        "ids": ids,
        "ids_b1": ids[:, None],
        "real": rng.normal(size=BATCH).astype("float32"),
        "real_b1": rng.normal(size=(BATCH, 1)).astype("float32"),
        "real_3": rng.normal(size=(BATCH, CLASSES)).astype("float32"),
        "positive_3": rng.uniform(0.5, 2.0, (BATCH, CLASSES)).astype("float32"),
        "ctc": rng.integers(1, CLASSES, (BATCH, 2)),  # label ids (0 is CTC's blank)
    }[kind]


# The head's units for each kind of label.
_UNITS = {"bits": 1, "bits_b1": 1, "signs": 1, "real": 1, "real_b1": 1}


def _model(kind: str, activation):
    keras.utils.set_random_seed(7)
    if kind == "ctc":  # (B, T, classes) logits from a sequence
        inputs = keras.Input((STEPS, 4))
    else:
        inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    outputs = keras.layers.Dense(_UNITS.get(kind, CLASSES), activation=activation)(hidden)
    return keras.Model(inputs, outputs)


def _data(kind: str, weighted: bool = False):
    rng = np.random.default_rng(11)
    shape = (BATCH, STEPS, 4) if kind == "ctc" else (BATCH, 4)
    x = rng.normal(size=shape).astype("float32")
    weights = rng.uniform(0.2, 2.0, BATCH).astype("float32") if weighted else None
    return x, _targets(kind, rng), weights


L = keras.losses

# (loss, label kind, head activation, sample weights), by Keras loss class; the first entry
# of each class also trains against plain fit().
CASES = {
    "BinaryCrossentropy": [
        (lambda: L.BinaryCrossentropy(from_logits=True), "bits", None, False),
        (lambda: L.BinaryCrossentropy(), "bits", "sigmoid", True),
        (lambda: L.BinaryCrossentropy(from_logits=True, label_smoothing=0.1), "bits_b1", None, False),
        (lambda: L.BinaryCrossentropy(from_logits=True), "multilabel", None, False),
        (lambda: L.BinaryCrossentropy(from_logits=True, reduction="sum"), "bits", None, True),
        (lambda: L.BinaryCrossentropy(from_logits=True, reduction=None), "bits", None, False),
    ],
    "BinaryFocalCrossentropy": [
        (lambda: L.BinaryFocalCrossentropy(from_logits=True), "bits", None, False),
        (lambda: L.BinaryFocalCrossentropy(apply_class_balancing=True), "multilabel", "sigmoid", False),
        (lambda: L.BinaryFocalCrossentropy(label_smoothing=0.1), "bits_b1", "sigmoid", True),
    ],
    "CategoricalCrossentropy": [
        (lambda: L.CategoricalCrossentropy(from_logits=True), "onehot", None, False),
        (lambda: L.CategoricalCrossentropy(label_smoothing=0.1), "onehot", "softmax", True),
        (lambda: L.CategoricalCrossentropy(from_logits=True), "soft", None, False),
    ],
    "CategoricalFocalCrossentropy": [
        (lambda: L.CategoricalFocalCrossentropy(from_logits=True), "onehot", None, False),
        (lambda: L.CategoricalFocalCrossentropy(label_smoothing=0.1), "onehot", "softmax", False),
    ],
    "CategoricalGeneralizedCrossEntropy": [
        (lambda: L.CategoricalGeneralizedCrossEntropy(q=0.7), "ids", "softmax", True),
    ],
    "CategoricalHinge": [(lambda: L.CategoricalHinge(), "onehot", None, False)],
    "CosineSimilarity": [(lambda: L.CosineSimilarity(), "real_3", None, False)],
    "CTC": [(lambda: L.CTC(), "ctc", None, False)],
    "Dice": [(lambda: L.Dice(axis=-1), "multilabel", "sigmoid", False)],
    "Hinge": [
        (lambda: L.Hinge(), "signs", None, False),
        (lambda: L.Hinge(), "bits", None, False),  # 0/1 labels, which Keras maps to -1/1
        (lambda: L.Hinge(), "multilabel", None, True),
    ],
    "Huber": [
        (lambda: L.Huber(delta=0.5), "real", None, False),
        (lambda: L.Huber(), "real_3", None, True),
    ],
    "KLDivergence": [(lambda: L.KLDivergence(), "soft", "softmax", False)],
    "LogCosh": [(lambda: L.LogCosh(), "real_b1", None, False)],
    "MeanAbsoluteError": [
        (lambda: L.MeanAbsoluteError(), "real", None, False),
        (lambda: L.MeanAbsoluteError(reduction="sum"), "real_3", None, False),
    ],
    "MeanAbsolutePercentageError": [(lambda: L.MeanAbsolutePercentageError(), "positive_3", None, False)],
    "MeanSquaredError": [
        (lambda: L.MeanSquaredError(), "real", None, False),  # (B,) labels, a (B, 1) output
        (lambda: L.MeanSquaredError(), "real_b1", None, True),
        (lambda: L.MeanSquaredError(reduction="none"), "real_3", None, False),
    ],
    "MeanSquaredLogarithmicError": [
        (lambda: L.MeanSquaredLogarithmicError(), "positive_3", "softplus", False),
    ],
    "Poisson": [(lambda: L.Poisson(), "positive_3", "softplus", False)],
    "SparseCategoricalCrossentropy": [
        (lambda: L.SparseCategoricalCrossentropy(from_logits=True), "ids", None, False),
        (lambda: L.SparseCategoricalCrossentropy(), "ids_b1", "softmax", True),
        (lambda: L.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"), "ids_b1", None, False),
        (lambda: L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0), "ids", None, False),
    ],
    "SquaredHinge": [
        (lambda: L.SquaredHinge(), "signs", None, False),
        (lambda: L.SquaredHinge(), "bits_b1", None, False),
    ],
    "Tversky": [(lambda: L.Tversky(alpha=0.3, beta=0.7, axis=-1), "multilabel", "sigmoid", False)],
}

# Names compile() takes that also run through the per-example check (as the keras.io guides
# write them); every other name is covered by the class case whose function it names
# (test_every_keras_loss_name_names_a_function_the_matrix_covers).
NAMES = {
    "binary_crossentropy": ("bits", "sigmoid"),
    "sparse_categorical_crossentropy": ("ids", "softmax"),
    "categorical_crossentropy": ("onehot", "softmax"),
    "mse": ("real", None),
    "hinge": ("signs", None),
}

# Losses that have no per-example values: refused (plain Keras trains with them).
REFUSED = {
    "Circle": (lambda: L.Circle(), "ids", None, "from the other examples"),
    "Dice (axis=None)": (lambda: L.Dice(), "multilabel", "sigmoid", "returns a scalar"),
    "Tversky (axis=None)": (lambda: L.Tversky(), "multilabel", "sigmoid", "returns a scalar"),
    "dice": (lambda: "dice", "multilabel", "sigmoid", "returns a scalar"),
    "tversky": (lambda: "tversky", "multilabel", "sigmoid", "returns a scalar"),
    "circle": (lambda: "circle", "ids", None, "from the other examples"),
    # Keras one-hot encodes (B, 1) labels to (B, 1, classes), which broadcasts against every
    # example's prediction: each example's value is computed from the whole batch.
    "CategoricalGeneralizedCrossEntropy (B, 1) labels": (
        lambda: L.CategoricalGeneralizedCrossEntropy(), "ids_b1", "softmax", "from the other examples"),
}


def _keras_loss_classes() -> set[str]:
    return {
        name for name, obj in vars(keras.losses).items()
        if inspect.isclass(obj) and issubclass(obj, keras.losses.Loss) and obj is not keras.losses.Loss
    }


def _keras_loss_functions() -> set[str]:
    """The loss functions ``keras.losses`` exports under a name ``compile()`` takes."""

    def takes(name):
        try:
            return keras.losses.get(name) is not None
        except ValueError:  # exported, but not registered under its name
            return False

    return {
        name for name, obj in vars(keras.losses).items()
        if inspect.isfunction(obj) and name not in ("get", "serialize", "deserialize") and takes(name)
    }


def test_every_keras_loss_is_in_the_matrix():
    """A loss Keras adds must be added here: trained exactly, or refused with a reason."""
    refused_classes = {name for name in REFUSED if name[0].isupper()}
    missing = _keras_loss_classes() - set(CASES) - {name.split(" ")[0] for name in refused_classes}
    assert not missing, f"Keras loss classes not in the loss matrix: {sorted(missing)}"


def test_every_keras_loss_name_names_a_function_the_matrix_covers():
    """``compile(loss="name")`` resolves to a loss function; some case of the matrix (or of
    the refusals) trains a ``LossFunctionWrapper`` of that very function."""
    covered = {getattr(make(), "fn", None) for cases in CASES.values() for make, *_ in cases}
    covered |= {getattr(entry[0](), "fn", None) for entry in REFUSED.values()}
    missing = sorted(name for name in _keras_loss_functions() | set(NAMES)
                     if keras.losses.get(name) not in covered and name not in REFUSED)
    assert not missing, f"Keras loss names whose function no case trains: {missing}"


def _case_ids():
    for name, cases in CASES.items():
        for k, (make, kind, activation, weighted) in enumerate(cases):
            loss = make()
            reduction = getattr(loss, "reduction", "sum_over_batch_size")
            extra = "" if reduction == "sum_over_batch_size" else f"-{reduction}"
            yield pytest.param(make, kind, activation, weighted,
                               id=f"{name}-{kind}-{activation}{'-weighted' if weighted else ''}{extra}-{k}")
    for name, (kind, activation) in NAMES.items():
        yield pytest.param(lambda name=name: name, kind, activation, False, id=f"'{name}'-{kind}")


@pytest.mark.parametrize("make, kind, activation, weighted", list(_case_ids()))
def test_each_example_gradient_is_its_batch_of_one_gradient(make, kind, activation, weighted):
    loss = make()
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    reference = make()
    if reduction in (None, "none"):  # unreduced: pergrad's L_i is the default reduction's
        reference.reduction = "sum_over_batch_size"
    model = _model(kind, activation)
    model.compile(loss=reference)
    x, y, weights = _data(kind, weighted)
    scale = np.full(BATCH, float(BATCH)) if reduction == "sum" else None
    ignored = getattr(loss, "ignore_class", None)
    if ignored is not None:  # Keras divides by the examples not ignored in the whole batch
        valid = (np.reshape(y, (BATCH,)) != ignored).astype("float64")
        scale = BATCH * valid / valid.sum()
    expected = oracle.batch_of_one_gradients(model, x, y, weights, scale=scale)
    grads = pergrad.per_example_gradients(model, x, y, weights, loss=loss)
    oracle.assert_gradients_close(grads, expected)


def _fit_cases():
    """The first case of every loss class, and every case whose batch loss is not the plain
    mean of the examples' (a sum, ignore_class's normalization). Not unreduced losses: plain
    ``fit()`` differentiates their sum on TensorFlow (pergrad uses them like the default
    mean, docs/per-example-gradients.md)."""
    for name, cases in CASES.items():
        for k, (make, *_) in enumerate(cases):
            loss = make()
            if k == 0 or getattr(loss, "reduction", None) == "sum" or getattr(
                    loss, "ignore_class", None) is not None:
                yield pytest.param(name, k, id=f"{name}-{k}")


@pytest.mark.parametrize("name, k", list(_fit_cases()))
def test_mean_trains_exactly_as_plain_fit(name, k):
    make, kind, activation, weighted = CASES[name][k]
    x, y, weights = _data(kind, weighted)
    plain, wrapped = _model(kind, activation), _model(kind, activation)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=make())
    model = pergrad.PerExampleModel(wrapped, "mean")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=make())
    fit = {"batch_size": 3, "epochs": 1, "shuffle": False, "verbose": 0, "sample_weight": weights}
    plain_history = plain.fit(x, y, **fit)
    history = model.fit(x, y, **fit)
    oracle.assert_weights_close(plain, wrapped)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_losses_without_per_example_values_are_refused_before_any_weight_moves(name):
    make, kind, activation, message = REFUSED[name]
    x, y, _ = _data(kind)
    plain = _model(kind, activation)
    plain.compile(optimizer="sgd", loss=make())
    plain.fit(x, y, batch_size=BATCH, verbose=0)  # plain Keras trains with it

    wrapped = _model(kind, activation)
    before = wrapped.get_weights()
    model = pergrad.PerExampleModel(wrapped, "mean")
    model.compile(optimizer="sgd", loss=make())
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    for a, b in zip(before, wrapped.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=message):
        pergrad.per_example_gradients(wrapped, x, y, loss=make())


def test_a_loss_that_masks_its_values_is_refused_for_dp_before_any_weight_moves():
    """``ignore_class`` divides by the examples not ignored in the whole batch, as a masked
    output does: a DP rule cannot bound one example's share (docs/privacy.md)."""
    x, y, _ = _data("ids")
    wrapped = _model("ids", None)
    before = wrapped.get_weights()
    rule = pergrad.privacy.dp_gaussian(1.0, noise_multiplier=1.0, seed=0)
    model = pergrad.PerExampleModel(wrapped, rule)
    model.compile(optimizer="sgd", loss=L.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    with pytest.raises(ValueError, match="masks its values, such as ignore_class"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    for a, b in zip(before, wrapped.get_weights()):
        np.testing.assert_array_equal(a, b)
