"""What the BatchNormalization choices do to accuracy: a small CNN on scikit-learn's digits.

Per-example gradients (and so clipping and DP-SGD) are undefined with a trainable
``BatchNormalization``; the ways out are to freeze it or to replace it by a
``GroupNormalization`` (``pergrad.layers.replace_batch_normalization``). This script measures
what each costs in test accuracy (docs/backbones.md prints its table):

- **from scratch**: the CNN with BatchNormalization trained by plain Keras (the reference, not
  possible per example), converted to GroupNormalization before training, and with its
  BatchNormalization frozen from the start (then an affine map with the initial moving
  statistics: no normalization at all); each with ``mean`` and with DP-SGD;
- **pretrained, then fine-tuned**: the CNN with BatchNormalization pretrained by plain Keras on
  digits 0-4, then fine-tuned on all ten digits (a new head) with its BatchNormalization
  frozen (moving statistics kept) or converted (moving statistics dropped: the converted
  network computes another function until it is trained), each with ``mean`` and with DP-SGD.

One process per backend; seeds 0..n-1, the mean and range printed. Run:
``KERAS_BACKEND=jax python benchmarks/batch_norm_choices.py --seeds 3``.
"""

from __future__ import annotations

import argparse
import json

import keras
import numpy as np

import pergrad
from pergrad import compat
from pergrad.apps.demo import load_digits_split
from pergrad.layers import replace_batch_normalization
from pergrad.privacy import dp_gaussian


def build(seed: int, classes: int = 10) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 1))
    h = inputs
    for filters in (16, 32):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(classes, name="head")(h), name="cnn")


def freeze_batch_normalization(model: keras.Model) -> keras.Model:
    for layer in compat.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
    return model


def new_head(model: keras.Model, classes: int, seed: int) -> keras.Model:
    """The pretrained network up to its head, and a fresh ``Dense(classes)`` head."""
    keras.utils.set_random_seed(seed + 1000)
    features = model.get_layer("head").input
    return keras.Model(model.input, keras.layers.Dense(classes, name="new_head")(features), name="cnn")


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train(model, rule, x, y, epochs, batch_size, learning_rate):
    """Trains ``model`` by plain Keras (``rule=None``) or by ``PerExampleModel(model, rule)``."""
    trained = model if rule is None else pergrad.PerExampleModel(model, rule)
    trained.compile(optimizer=keras.optimizers.Adam(learning_rate), loss=loss(), metrics=["accuracy"])
    trained.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0)
    return model


def accuracy(model, x, y) -> float:
    logits = keras.ops.convert_to_numpy(model.predict(x, batch_size=256, verbose=0))
    return float(np.mean(np.argmax(logits, axis=1) == y))


def rules(batch_size):
    # DP-SGD: clip 1, noise multiplier 1 (no accounting here: the accuracy the noise leaves)
    return {"mean": lambda: "mean",
            "dp_sgd": lambda: dp_gaussian(1.0, 1.0, expected_batch_size=batch_size)}


def run(seed: int, epochs: int, batch_size: int) -> dict:
    (x, y), (x_test, y_test) = load_digits_split(seed)
    x, x_test = x.reshape(-1, 8, 8, 1), x_test.reshape(-1, 8, 8, 1)
    results = {}
    # From scratch.
    results["scratch: BatchNorm, plain Keras"] = accuracy(
        train(build(seed), None, x, y, epochs, batch_size, 1e-2), x_test, y_test)
    for name, rule in rules(batch_size).items():
        results[f"scratch: GroupNorm, {name}"] = accuracy(
            train(replace_batch_normalization(build(seed)), rule(), x, y, epochs, batch_size, 1e-2),
            x_test, y_test)
        results[f"scratch: BatchNorm frozen, {name}"] = accuracy(
            train(freeze_batch_normalization(build(seed)), rule(), x, y, epochs, batch_size, 1e-2),
            x_test, y_test)
    # Pretrained on digits 0-4 with BatchNorm (plain Keras), fine-tuned on all ten.
    low, low_test = y < 5, y_test < 5
    pretrained = train(build(seed, classes=5), None, x[low], y[low], epochs, batch_size, 1e-2)
    weights = pretrained.get_weights()
    results["pretrained (0-4), its own test digits"] = accuracy(
        pretrained, x_test[low_test], y_test[low_test])
    converted = replace_batch_normalization(pretrained)
    results["pretrained (0-4) converted to GroupNorm, untrained"] = accuracy(
        converted, x_test[low_test], y_test[low_test])
    results["pretrained: BatchNorm kept trainable, plain Keras"] = accuracy(
        train(new_head(pretrained, 10, seed), None, x, y, epochs, batch_size, 1e-3), x_test, y_test)
    for name, rule in rules(batch_size).items():
        for choice in ("frozen", "GroupNorm"):
            model = build(seed, classes=5)
            model.set_weights(weights)
            if choice == "frozen":
                model = freeze_batch_normalization(model)
            else:
                model = replace_batch_normalization(model)
            results[f"pretrained: BatchNorm {choice}, {name}"] = accuracy(
                train(new_head(model, 10, seed), rule(), x, y, epochs, batch_size, 1e-3), x_test, y_test)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", help="write the per-seed results here")
    args = parser.parse_args()
    runs = [run(seed, args.epochs, args.batch) for seed in range(args.seeds)]
    print(f"backend {keras.backend.backend()}, {args.epochs} epochs, B = {args.batch}, "
          f"seeds 0-{args.seeds - 1}: test accuracy, mean (min-max)")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"| {key} | {np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
