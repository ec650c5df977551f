#!/usr/bin/env python
"""Cost of ``pergrad.scores`` over a data set, next to a forward-backward pass over it.

Run once per backend::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/scores.py
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/scores.py --models mlp256 tfm64 --rounds 5

Models and data as in ``models.py`` (random data, sparse categorical cross-entropy
from logits): ``--batches`` batches of the model key's batch size. Variants, each over
the whole data set, timed in interleaved rounds after one warm-up round (tracing and
compiling excluded), the median reported:

- ``fit epoch``: one epoch of plain Keras ``fit`` (SGD, no shuffling): a forward and a
  backward pass per batch, the reference the goal is stated against;
- ``predict``: plain Keras ``predict`` (a forward pass per batch);
- ``scores(kind)``: ``loss``, ``el2n``, ``grand``, ``self_influence`` at one
  checkpoint (TracIn's cost is this times the number of checkpoints) and
  ``influence`` on 8 test examples (joined to every batch).

The goal (docs/scores.md): a score for a data set costs at most 2x a forward-backward
pass over it (the ``fit epoch`` column).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from process import before_backend_import

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KINDS = ("loss", "el2n", "grand", "self_influence", "influence")
TEST_EXAMPLES = 8


def variants(key: str, batches: int, full_gram: bool = False):
    """``(N, {name: callable})``: every variant over ``batches`` batches of ``key``'s data
    (with ``full_gram``, also ``influence_full_gram``: the joined batch's whole Gram matrix,
    ``pergrad.per_example_statistics(gram=True)``, of which influence needs one block)."""
    import keras
    import numpy as np

    import pergrad
    from models import build_model, make_data, new_loss, new_optimizer, parse_model

    kind, batch_size = parse_model(key)
    x, y = make_data(kind, batch_size * batches)
    x, y = keras.ops.convert_to_numpy(x), keras.ops.convert_to_numpy(y)
    trained, scored = build_model(kind), build_model(kind)
    for model in (trained, scored):
        model.compile(optimizer=new_optimizer(), loss=new_loss())
    test = (x[:TEST_EXAMPLES], y[:TEST_EXAMPLES])

    def score(kind):
        extra = {"test_data": test} if kind == "influence" else {}
        return lambda: pergrad.scores(scored, x, y, kind=kind, batch_size=batch_size, verbose=0, **extra)

    found = {
        "fit epoch": lambda: trained.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0),
        "predict": lambda: scored.predict(x, batch_size=batch_size, verbose=0),
    }
    found.update({kind: score(kind) for kind in KINDS})
    if full_gram:
        def whole_gram():
            for start in range(0, len(x), batch_size):
                joined = [np.concatenate([a[start:start + batch_size], t]) for a, t in zip((x, y), test)]
                keras.ops.convert_to_numpy(
                    pergrad.per_example_statistics(scored, *joined, training=False, gram=True).gram)

        found["influence_full_gram"] = whole_gram
    return len(x), found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp256", "tfm64"])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="0: the backends' defaults")
    parser.add_argument("--full-gram", action="store_true",
                        help="also time influence from the joined batch's whole Gram matrix")
    args = parser.parse_args(argv)
    before_backend_import(args.threads or None, args.models)
    import keras

    kinds = KINDS + (("influence_full_gram",) if args.full_gram else ())
    print("| backend | model | N | fit epoch (ms) | predict | " + " | ".join(kinds) + " |")
    print("|---|---|---|---|---|" + "---|" * len(kinds))
    for key in args.models:
        size, runs = variants(key, args.batches, args.full_gram)
        times = {name: [] for name in runs}
        for round_ in range(args.rounds + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if round_:  # round 0 traces and compiles
                    times[name].append(1e3 * (time.perf_counter() - start))
        fit_ms = statistics.median(times["fit epoch"])
        cells = [f"{statistics.median(times[name]) / fit_ms:.2f}x" for name in ("predict",) + kinds]
        print(f"| {keras.backend.backend()} | {key} | {size} | {fit_ms:.0f} | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
