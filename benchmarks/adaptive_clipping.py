#!/usr/bin/env python
"""Adaptive clipping against hand-tuned clipping norms: DP-SGD on digits at one epsilon.

Trains pergrad.apps.demo's network on scikit-learn's digits with DP-SGD (Poisson sampling,
the same total noise multiplier, sampling rate and number of steps, hence the same
epsilon) once per clipping norm of a grid of five, and once with adaptive clipping
(Andrew et al., 2021: target quantile 0.5, learning rate 0.2, count noise
``expected_batch_size / 20``, the paper's), over several seeds, and prints the final
test accuracies::

    KERAS_BACKEND=jax .venv/bin/python benchmarks/adaptive_clipping.py
    KERAS_BACKEND=jax .venv/bin/python benchmarks/adaptive_clipping.py --seeds 5 --epochs 30

The grid is fixed before any run, logarithmic around the norms these gradients have;
the numbers are whatever they are.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import pergrad  # noqa: E402
from pergrad import privacy  # noqa: E402
from pergrad.apps.demo import build_model, load_digits_split  # noqa: E402

GRID = (0.1, 0.3, 1.0, 3.0, 10.0)


def train(rule_for, seed: int, epochs: int, batch_size: int, noise_multiplier: float, delta: float,
          learning_rate: float):
    """``(test accuracy, epsilon, final clipping norm)`` of one DP run; ``rule_for(expected)``
    makes the rule for the sampler's expected batch size."""
    (x, y), test = load_digits_split(seed=0)  # one split: the seeds vary the run only
    rate = batch_size / len(x)
    sampler = privacy.PoissonSampler(x, y, sampling_rate=rate, seed=seed)
    rule = rule_for(sampler.expected_batch_size, seed)
    model = pergrad.PerExampleModel(build_model(seed), rule)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    accountant = privacy.PrivacyAccountant(noise_multiplier, rate, delta)
    history = model.fit(sampler, epochs=epochs, callbacks=[accountant], verbose=0)
    accuracy = float(model.evaluate(*test, verbose=0, return_dict=True)["accuracy"])
    clip = float(keras.ops.convert_to_numpy(rule.current_l2_norm_clip()))
    return accuracy, float(history.history["epsilon"][-1]), clip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="the expected batch size")
    parser.add_argument("--noise-multiplier", type=float, default=1.64,
                        help="the total z (1.64: epsilon 3 at delta 1e-5 after 20 epochs)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="Adam's, as pergrad.apps.demo")
    parser.add_argument("--initial-clip", type=float, default=0.1, help="adaptive clipping's first C")
    args = parser.parse_args(argv)
    z = args.noise_multiplier
    configurations = [
        (f"C = {c:g}", lambda expected, seed, c=c: privacy.dp_gaussian(
            c, z, expected_batch_size=expected, seed=seed)) for c in GRID
    ] + [(
        f"adaptive (C0 = {args.initial_clip:g}, q = 0.5, eta = 0.2)",
        lambda expected, seed: privacy.adaptive_dp_gaussian(
            args.initial_clip, z, expected_batch_size=expected, target_quantile=0.5,
            learning_rate=0.2, seed=seed),
    )]
    print(f"digits, {keras.backend.backend()}, DP-SGD z = {z:g} (total), expected batch "
          f"{args.batch_size}, {args.epochs} epochs, Adam({args.learning_rate:g}), "
          f"{args.seeds} seeds")
    rows = []
    for label, rule_for in configurations:
        accuracies, clips, start = [], [], time.perf_counter()
        for seed in range(args.seeds):
            accuracy, epsilon, clip = train(rule_for, seed, args.epochs, args.batch_size, z, args.delta,
                                            args.learning_rate)
            accuracies.append(accuracy)
            clips.append(clip)
        rows.append((label, accuracies, epsilon, clips))
        print(f"  {label}: {', '.join(f'{a:.4f}' for a in accuracies)} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    best = max(np.mean(a) for label, a, _, _ in rows[:-1])
    print()
    print(f"| clipping | test accuracy, mean ± std | epsilon (delta = {args.delta:g}) | final C |")
    print("|---|---|---|---|")
    for label, accuracies, epsilon, clips in rows:
        print(f"| {label} | {100 * np.mean(accuracies):.1f} ± {100 * np.std(accuracies):.1f} | "
              f"{epsilon:.2f} | {np.mean(clips):.3g} |")
    adaptive = np.mean(rows[-1][1])
    print(f"\nadaptive - best grid value: {100 * (adaptive - best):+.1f} points")


if __name__ == "__main__":
    main()
