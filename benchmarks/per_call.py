#!/usr/bin/env python
"""Cost of a standalone ``pergrad.per_example_gradients`` call, repeated.

Run once per backend::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/per_call.py
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/per_call.py --batch 64 --repeats 20

Model: MLP 784-256-10 (relu), random data, sparse categorical cross-entropy from
logits, batch 64 by default. Reported (milliseconds, one thread by default as in
``bench.py``):

- ``first call``: the first ``per_example_gradients`` call (tracing/compiling
  included on TF and JAX);
- ``repeated call``: the median of the following calls on the same batch
  (results converted to NumPy, so asynchronous backends finish the work);
- ``step mean`` / ``step clip``: the median ``train_on_batch`` step of
  ``PerExampleModel(model, "mean")`` and ``PerExampleModel(model, clip(1.0))``
  on the same batch, after a warm-up step. ``clip`` materializes every
  per-example gradient, as a standalone call does; ``mean`` reduces directly.

A repeated call is to be compared with one compiled pergrad training step on the
same batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from process import limit_threads

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="0: the backends' defaults")
    args = parser.parse_args()
    limit_threads(args.threads)  # before the backend starts its thread pools

    import keras
    import numpy as np

    import pergrad

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
        )

    def loss():
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 784)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch,)).astype("int32")

    def timed(fn):
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)

    plain = model()
    plain.compile(loss=loss())

    def call():
        return [np.asarray(keras.ops.convert_to_numpy(g)) for g in pergrad.per_example_gradients(plain, x, y)]

    first = timed(call)
    repeated = statistics.median(timed(call) for _ in range(args.repeats))

    def step_ms(aggregator):
        wrapper = pergrad.PerExampleModel(model(), aggregator)
        wrapper.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss())
        wrapper.train_on_batch(x, y)  # traces/compiles
        return statistics.median(
            timed(lambda: wrapper.train_on_batch(x, y)) for _ in range(args.repeats)  # returns NumPy: synced
        )

    mean_step = step_ms("mean")
    clip_step = step_ms(pergrad.aggregators.clip(1.0))
    print(
        f"| {keras.backend.backend()} | MLP 784-256-10, B={args.batch} | {first:.0f} | "
        f"{repeated:.1f} | {mean_step:.1f} | {clip_step:.1f} |"
    )


if __name__ == "__main__":
    main()
