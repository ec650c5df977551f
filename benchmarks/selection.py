"""Times the order-statistic strategies of ``pergrad.aggregators.selection``.

One backend per process; prints a table strategy x (B, N) -> milliseconds: the
median of ``--repeats`` timed calls per strategy after one warm-up call that
compiles, the strategies timed in turn (round robin) so that a change in the
machine's load hits them alike:

    KERAS_BACKEND=jax .venv/bin/python benchmarks/selection.py
    KERAS_BACKEND=torch .venv/bin/python benchmarks/selection.py --rule trimmed_mean --threads 1

JAX runs under ``jax.jit``, TensorFlow under ``tf.function``, torch eagerly, as
pergrad's training step does. Strategies: ``sort`` (``ops.sort`` over axis 0),
``top_k`` (``ops.top_k`` over the transposed block), ``backend`` (torch: the
adapter's NumPy sort; elsewhere ``top_k``), ``network`` (the bitonic
network in column blocks), ``network-1block`` (the same, unblocked) and, for
the median only, ``ops.median`` (Keras's own).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import keras
import numpy as np
from keras import ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from pergrad.aggregators import selection  # noqa: E402
from process import configure_threads  # noqa: E402

BACKEND = keras.backend.backend()


def _one_block(x, lo, hi):
    return selection._rows_network(x, lo, hi, block=0)


selection._ROWS["network-1block"] = _one_block


def _rule(rule: str, strategy: str):
    if strategy == "ops.median":
        return lambda x: ops.median(x, axis=0)
    if rule == "median":
        return lambda x: selection._median(x, strategy)
    if rule == "trimmed_mean":
        return lambda x: selection._trimmed_mean(x, int(0.1 * x.shape[0]), strategy)
    return lambda x: selection._meamed(x, x.shape[0] - int(0.1 * x.shape[0]), strategy)


def _compiled(fn):
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, autograph=False)
    return fn


def _call(fn, x) -> float:
    start = time.perf_counter()
    ops.convert_to_numpy(fn(x))
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", default="median", choices=("median", "trimmed_mean", "meamed"))
    parser.add_argument("--strategies", default="sort,top_k,backend,network,network-1block,ops.median")
    parser.add_argument("--batches", default="8,64,256")
    parser.add_argument("--sizes", default="4096,200000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: the backend's default")
    args = parser.parse_args()
    configure_threads(args.threads)
    strategies = [s for s in args.strategies.split(",") if s != "ops.median" or args.rule == "median"]
    shapes = [(int(b), int(n)) for b in args.batches.split(",") for n in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    times = {}
    for b, n in shapes:
        x = ops.convert_to_tensor(rng.standard_normal((b, n), dtype=np.float32))
        functions = {s: _compiled(_rule(args.rule, s)) for s in strategies}
        for fn in functions.values():
            _call(fn, x)  # compile, warm up
        runs = {s: [] for s in strategies}
        for _ in range(args.repeats):
            for s, fn in functions.items():
                runs[s].append(_call(fn, x))
        for s in strategies:
            times[s, b, n] = 1000 * statistics.median(runs[s])
        print(f"B={b} N={n}: " + ", ".join(f"{s} {times[s, b, n]:.1f}" for s in strategies), flush=True)
    threads = args.threads or "default"
    print(f"\n{BACKEND}, {args.rule}, float32, ms (median of {args.repeats}), threads {threads}")
    print(f"{'strategy':16s}" + "".join(f"{f'B={b} N={n}':>16s}" for b, n in shapes))
    for s in strategies:
        print(f"{s:16s}" + "".join(f"{times[s, b, n]:16.1f}" for b, n in shapes))


if __name__ == "__main__":
    main()
