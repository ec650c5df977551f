#!/usr/bin/env python
"""Cost of DP-SGD's noise generator per million values, beside the backends' own samplers.

Run once per backend::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/noise.py
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/noise.py --sizes 269322,1000000
    KERAS_BACKEND=torch      .venv/bin/python benchmarks/noise.py --rounds 15

Rows (each called as a DP step calls it: inside ``jax.jit``, inside a ``tf.function``
(pergrad's draw is itself one XLA cluster there), eagerly on torch; the result brought
to the host):

- ``pergrad noise``: ``pergrad.privacy.noise.gaussian_noise`` (128 secret-keyed bits per
  value, the docs' "Noise generator");
- ``pergrad words``: its random words alone (Threefry-4x32-20 on JAX/TF, NumPy's
  Philox-4x64-10 on torch), 4 per value;
- ``keras.random.normal``: Keras's sampler with a seed generator (not secure: a 64-bit
  or narrower seed, support about 5.4 standard deviations on JAX);
- the native sampler DP libraries use: ``tf.random.normal`` (TensorFlow Privacy),
  ``jax.random.normal`` (jax-privacy), ``torch.normal`` (Opacus; its ``secure_mode`` sums
  four of them).

Timing: the rows are interleaved in rounds (the order rotates); each round times a block of
calls; the table gives the median over rounds of the wall time and of the process's CPU
time (which leaves out the time the process waited for a core on a shared machine), in
milliseconds per call and nanoseconds per value. One thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from process import limit_threads

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def samplers(size: int):
    """name -> zero-argument callable returning the values on the host."""
    import keras
    import numpy as np
    from keras import ops

    from pergrad.backend import adapter
    from pergrad.privacy import noise

    backend = keras.backend.backend()
    key = ops.convert_to_tensor(noise.key_words(0, 0))
    step = ops.convert_to_tensor(7, "int32")
    compiled = adapter().compile
    pergrad_noise = compiled(lambda k, s: noise.gaussian_noise(k, s, size, 0.5))
    # The words as gaussian_noise draws them: one XLA cluster on TensorFlow, NumPy's chunks
    # on torch.
    if hasattr(adapter(), "noise_words"):
        def pergrad_words(k, s):
            return [chunk[3] for chunk in adapter().noise_words(k, s, size)][-1]
    else:
        fused = getattr(adapter(), "fused", compiled)
        pergrad_words = fused(lambda k, s: noise.random_words(k, s, size)[3])
    seed = keras.random.SeedGenerator(0)
    rows = {
        "pergrad noise": lambda: pergrad_noise(key, step),
        "pergrad words": lambda: pergrad_words(key, step),
    }
    if backend == "jax":
        import jax

        keras_normal = jax.jit(lambda state: keras.random.normal((size,), seed=jax.random.key_data(state)))
        jax_key = jax.random.key(0)
        native = jax.jit(lambda k: jax.random.normal(k, (size,)))
        rows["keras.random.normal"] = lambda: keras_normal(jax_key)
        rows["jax.random.normal"] = lambda: native(jax_key)
    elif backend == "tensorflow":
        import tensorflow as tf

        keras_normal = tf.function(lambda: keras.random.normal((size,), seed=seed))
        native = tf.function(lambda: tf.random.normal((size,)))
        rows["keras.random.normal"] = keras_normal
        rows["tf.random.normal"] = native
    else:
        import torch

        generator = torch.Generator().manual_seed(0)
        rows["keras.random.normal"] = lambda: keras.random.normal((size,), seed=seed)
        rows["torch.normal"] = lambda: torch.normal(0.0, 0.5, (size,), generator=generator)

    def host(function):
        return lambda: np.asarray(ops.convert_to_numpy(function()))

    return {name: host(function) for name, function in rows.items()}


def measure(rows: dict, rounds: int, block: int):
    for function in rows.values():  # compile / warm up
        function()
        function()
    names = list(rows)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            started, started_cpu = time.perf_counter(), time.process_time()
            for _ in range(block):
                rows[name]()
            wall[name].append((time.perf_counter() - started) / block)
            cpu[name].append((time.process_time() - started_cpu) / block)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in names}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="269322,1000000",
                        help="values per draw (269,322: the benchmark MLP's parameters)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block", type=int, default=10, help="calls timed together")
    parser.add_argument("--threads", type=int, default=1, help="0: the backends' defaults")
    args = parser.parse_args()
    limit_threads(args.threads)

    import keras

    print(f"## {keras.backend.backend()} (keras {keras.__version__}; --threads {args.threads})\n")
    print("| values | sampler | ms per call (wall) | ms (CPU) | ns per value (wall) | ns per value (CPU) |")
    print("|---:|---|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        for name, (wall, cpu) in measure(samplers(size), args.rounds, args.block).items():
            print(f"| {size:,} | {name} | {wall * 1e3:.3f} | {cpu * 1e3:.3f} | "
                  f"{wall / size * 1e9:.2f} | {cpu / size * 1e9:.2f} |")


if __name__ == "__main__":
    main()
