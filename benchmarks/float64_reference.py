#!/usr/bin/env python
"""How far float32 per-example gradients of a keras.applications backbone are from exact ones.

The batch-of-one oracle in float64 (plain Keras, the same weights) is the reference; the float32
oracle and pergrad's float32 per-example gradients are both measured against it, so a gap between
pergrad and the float32 oracle can be told apart from float32 rounding (docs/backbones.md)::

    KERAS_BACKEND=torch .venv/bin/python benchmarks/float64_reference.py EfficientNetB0 converted

The model is tests/test_applications.py's ``_backbone(name, mode)`` (smallest input, B = 2).
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests")]

import keras  # noqa: E402

import oracle  # noqa: E402
import pergrad  # noqa: E402
import test_applications as applications  # noqa: E402


def relative(actual, reference) -> float:
    """The largest error, as a fraction of each variable's largest reference entry."""
    return max(float(np.abs(a - r).max() / np.abs(r).max()) for a, r in zip(actual, reference))


def outside(actual, reference, rtol=1e-4, atol=1e-5) -> int:
    """Entries outside the tests' tolerance (tests/test_applications.py)."""
    return sum(int(np.sum(np.abs(a - r) > atol + rtol * np.abs(r))) for a, r in zip(actual, reference))


def main(name: str, mode: str) -> None:
    keras.config.set_floatx("float64")
    model, x, y = applications._backbone(name, mode)
    training = not applications._draws_random(model)  # (per-example draws cannot be replayed)
    exact = [np.asarray(g) for g in oracle.batch_of_one_gradients(
        model, x.astype("float64"), y.astype("float64"), training=training)]
    weights = model.get_weights()
    keras.config.set_floatx("float32")
    model, _, _ = applications._backbone(name, mode)
    model.set_weights([w.astype("float32") for w in weights])
    plain = [np.asarray(g, "float64") for g in oracle.batch_of_one_gradients(model, x, y, training=training)]
    ours = [oracle.to_numpy(g).astype("float64")
            for g in pergrad.per_example_gradients(model, x, y, training=training)]
    print(f"{name} {mode} ({keras.backend.backend()}, training={training}), against the float64 oracle:")
    print(f"  float32 oracle:                        {relative(plain, exact):.2e} "
          f"({outside(plain, exact)} entries outside the tests' tolerance)")
    print(f"  pergrad's float32 per-example gradients: {relative(ours, exact):.2e} "
          f"({outside(ours, exact)} entries)")


if __name__ == "__main__":
    main(*(sys.argv[1:3] if len(sys.argv) > 2 else ("EfficientNetB0", "converted")))
