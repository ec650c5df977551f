"""Peak memory of one training step vs ``microbatch_size``, per backend.

Each variant runs in a fresh subprocess (the backend is chosen at import) that
builds an MLP 784-256-256-10, trains it for two steps on random data with
``fit()`` and reports its peak resident set size (``resource.getrusage``'s
``ru_maxrss``: the process's whole peak, framework included). Variants run one
after another, never in parallel.

    PYTHONPATH=src python benchmarks/memory.py                  # every backend, the default sizes
    PYTHONPATH=src python benchmarks/memory.py --batch 256 --backends torch
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

RULES = ("plain", "mean", "clip", "median")


def child(rule: str, microbatch_size: int | None, batch: int) -> None:
    import resource

    import keras
    import numpy as np

    import pergrad

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    if rule != "plain":
        aggregator = {"mean": "mean", "clip": pergrad.aggregators.clip(1.0), "median": "median"}[rule]
        model = pergrad.PerExampleModel(model, aggregator, microbatch_size=microbatch_size)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * batch, 784)).astype("float32")
    y = rng.integers(0, 10, size=(2 * batch,)).astype("int32")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # KiB -> GiB


def run(backend: str, rule: str, microbatch_size: int | None, batch: int) -> str:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    args = [sys.executable, __file__, "--child", rule, str(microbatch_size or 0), str(batch)]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return "failed"
    return f"{float(done.stdout.strip().splitlines()[-1]):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--sizes", default="256,64", help="microbatch sizes, comma-separated")
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rule, size, batch = args.child
        child(rule, int(size) or None, int(batch))
        return
    sizes = [None] + [int(s) for s in args.sizes.split(",") if s]
    backends = args.backends.split(",")
    print(f"Peak RSS (GiB), MLP 784-256-256-10, batch {args.batch}, 2 steps of fit()")
    header = ["rule", "microbatch_size"] + backends
    rows = []
    for rule in RULES:
        for size in [None] if rule == "plain" else sizes:
            cells = [run(backend, rule, size, args.batch) for backend in backends]
            rows.append([rule, "-" if size is None else str(size)] + cells)
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
