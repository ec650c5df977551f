"""The digits that ``pergrad demo`` and ``pergrad insight`` train on (scikit-learn's bundled
digits) and the demo's small network; and the commands' plotting module.
"""

from __future__ import annotations

import keras
import numpy as np

from pergrad.privacy.canary_audit import default_network


def load_digits_split(seed: int = 0):
    """Digits (1797 images of 8x8), scaled to [0, 1], 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def digits_mlp(features: int = 64, classes: int = 10) -> keras.Model:
    """The demo's network: Dense(64, relu), Dense(classes, softmax) on ``features`` inputs."""
    return default_network(features, classes)


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return digits_mlp()


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files, no display), imported on first use:
    ``pergrad demo`` and ``pergrad insight`` plot, ``import pergrad`` does not need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
