#!/usr/bin/env python
"""User-level DP-SGD against example-level ``dp_gaussian`` on the same batch, statistics path.

Run once per backend::

    KERAS_BACKEND=jax .venv/bin/python benchmarks/user_level.py --models mlp256,tfm64

The batch of ``B`` examples (``benchmarks/models.py``) is grouped into synthetic users of
``--user-size`` examples each (``B / size`` users; the ids interleaved, so that no user's
examples are contiguous). Rows: ``dp_gaussian(1, 1)`` and ``user_level_dp_gaussian(1, 1)``
(the Gram matrix, its block sums per user, the weighted sum), both ``path="statistics"``,
each on one compiled train function stepping the same fixed batch (``runner.Stepper``),
plus the plain Keras step. Timing: interleaved rounds (the order rotates), each a block of
steps; the table gives each row's median time per step and the median over rounds of its
ratio to ``dp_gaussian`` measured in the same round. One thread by default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from process import before_backend_import  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--models", default="mlp256,tfm64")
    parser.add_argument("--user-size", type=int, default=4, help="examples per synthetic user")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block-s", type=float, default=1.0, help="seconds per timed block")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    keys = args.models.split(",")
    before_backend_import(args.threads, models=[k.rstrip("0123456789") for k in keys])

    import keras
    import numpy as np

    import models
    import pergrad
    from pergrad import privacy
    from process import configure_threads
    from runner import Stepper

    configure_threads(args.threads)
    print(f"backend {keras.backend.backend()}, {args.threads} thread(s), users of {args.user_size} "
          f"examples, {args.rounds} rounds")
    print("| model | plain ms | dp_gaussian ms | user-level ms | user-level / dp_gaussian (median) |")
    print("|---|---|---|---|---|")
    for key in keys:
        kind, batch_size = models.parse_model(key)
        x, y = models.make_data(kind, batch_size)
        users = batch_size // args.user_size
        ids = (np.arange(batch_size) % users).astype("int32")  # interleaved users

        def wrapped(rule, kind=kind):
            model = pergrad.PerExampleModel(models.build_model(kind), rule, path="statistics")
            model.compile(optimizer=models.new_optimizer(), loss=models.new_loss())
            return model

        plain = models.build_model(kind)
        plain.compile(optimizer=models.new_optimizer(), loss=models.new_loss())
        steppers = {
            "plain": Stepper(plain, x, y),
            "example": Stepper(wrapped(privacy.dp_gaussian(
                models.CLIP_NORM, models.NOISE_MULTIPLIER, expected_batch_size=batch_size, seed=0)), x, y),
            "user": Stepper(wrapped(privacy.user_level_dp_gaussian(
                models.CLIP_NORM, models.NOISE_MULTIPLIER, expected_batch_size=users, seed=0)),
                {privacy.UNIT_INPUTS: x, privacy.UNIT_IDS: keras.ops.convert_to_tensor(ids)}, y),
        }
        block = {}
        for name, stepper in steppers.items():
            stepper.run(1)
            block[name] = max(1, round(args.block_s / stepper.run(1)[0]))
        times = {name: [] for name in steppers}
        order = list(steppers)
        for round_ in range(args.rounds):
            for name in order[round_ % 3:] + order[: round_ % 3]:
                times[name].append(steppers[name].run(block[name])[0] / block[name])
        for stepper in steppers.values():
            stepper.close()
        ratio = statistics.median(u / e for u, e in zip(times["user"], times["example"]))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        print(f"| {key} | {ms['plain']:.1f} | {ms['example']:.1f} | {ms['user']:.1f} | {ratio:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
