#!/usr/bin/env python
"""BandMF (``privacy.banded_mf_gaussian``) against DP-SGD: the cost of a step, and digits at one epsilon.

Two parts, run once per backend::

    KERAS_BACKEND=jax .venv/bin/python benchmarks/banded_mf.py step
    KERAS_BACKEND=jax .venv/bin/python benchmarks/banded_mf.py digits --seeds 3

``step``: the train step of an MLP 784-256-256-10 (269,322 parameters) on a fixed batch of 64,
as ``fit()`` runs it (``runner.Stepper``), with ``dp_gaussian`` and with ``banded_mf_gaussian``
for ``b`` = 1, 4, 8 bands (beside ``mean``, the runner's calibration row); the rows are
interleaved in rounds, and the table gives the median over rounds of each row's time per step
and of its ratio to ``dp_gaussian`` in the same round. BandMF's extra state is ``b - 1`` float32
copies of the parameters.

``digits``: pergrad.apps.digits's network on the digits (1437 training examples), expected batch 64,
the same number of steps, Adam(3e-3) or SGD with momentum 0.9 (``--optimizer sgd``), clipping
norm 1, at ``epsilon`` = 3 (``delta`` = 1e-5): DP-SGD on a ``PoissonSampler``
(``noise_multiplier_for(3, 1e-5, q, T)``), BandMF on a ``CyclicPoissonSampler`` with
``cycle_length = b`` (rate ``B b / n``, noise for ``ceil(T / b)`` participations), over several
seeds; test accuracy, mean and standard deviation. The numbers are whatever they are.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from process import limit_threads  # noqa: E402


def step_cost(bands_list, rounds: int, clock: str) -> None:
    import keras

    import pergrad
    import runner
    from models import make_data
    from pergrad import privacy
    from runner import Stepper, median_ratio, time_steppers

    def mlp():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                                 keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])

    batch = 64
    rules = {"plain": "mean", "dp_gaussian": privacy.dp_gaussian(1.0, 1.0, expected_batch_size=batch)}
    for bands in bands_list:
        rules[f"bandmf b={bands}"] = privacy.banded_mf_gaussian(1.0, 1.0, bands=bands,
                                                                expected_batch_size=batch)
    steppers = {}
    for name, rule in rules.items():
        model = pergrad.PerExampleModel(mlp(), rule)
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        steppers[name] = Stepper(model, *make_data("mlp", batch))
    parameters = sum(math.prod(v.shape) for v in mlp().trainable_variables)
    options = argparse.Namespace(slow_factor=1e9, max_block=50, block_s=0.25, repeats=rounds, slow_steps=3)
    if clock == "cpu":  # the process's CPU time: other processes on a shared machine add nothing
        runner.CLOCK = time.process_time
    samples, _, _, _ = time_steppers("mlp", steppers, options, lambda message: None)
    print(f"MLP 784-256-256-10 ({parameters} parameters), batch {batch}, {keras.backend.backend()}, "
          f"{rounds} interleaved rounds, {clock} clock")
    print("| rule | ms / step (median) | / dp_gaussian (median of rounds) | extra state |")
    print("|---|---|---|---|")
    for name, times in samples.items():
        bands = int(name.split("=")[1]) if name.startswith("bandmf") else 1
        slots = bands - 1
        state = f"{slots} x {parameters} float32 ({4 * slots * parameters / 2**20:.1f} MiB)"
        print(f"| {name} | {1e3 * statistics.median(times.values()):.2f} | "
              f"{median_ratio(times, samples['dp_gaussian']):.3f} | {state if bands > 1 else '-'} |")


def digits_accuracy(bands_list, seeds: int, epochs: int, target: float, delta: float, optimizer: str,
                    learning_rate: float | None) -> None:
    import keras

    import pergrad
    from pergrad import privacy
    from pergrad.apps.digits import build_model, load_digits_split

    (x, y), test = load_digits_split(seed=0)
    n, batch, clip = len(x), 64, 1.0
    steps = round(epochs * n / batch)
    if learning_rate is None:
        learning_rate = 3e-3 if optimizer == "adam" else 0.1

    def make_optimizer():
        if optimizer == "adam":
            return keras.optimizers.Adam(learning_rate)
        return keras.optimizers.SGD(learning_rate, momentum=0.9)

    described = f"Adam({learning_rate:g})" if optimizer == "adam" else f"SGD({learning_rate:g}, momentum 0.9)"
    print(f"digits, {keras.backend.backend()}, n = {n}, expected batch {batch}, {steps} steps, "
          f"epsilon = {target:g} (delta = {delta:g}), C = {clip:g}, {described}, {seeds} seeds")
    print("| rule | z | epsilon reached | test accuracy, mean ± std | runs |")
    print("|---|---|---|---|---|")
    for bands in [1, *bands_list]:
        rate = batch * bands / n
        z = privacy.noise_multiplier_for(target, delta, rate, math.ceil(steps / bands))
        accuracies, start = [], time.perf_counter()
        for seed in range(seeds):
            if bands == 1:
                sampler = privacy.PoissonSampler(x, y, sampling_rate=rate, seed=seed, steps_per_epoch=steps)
                rule = privacy.dp_gaussian(clip, z, seed=seed,
                                           expected_batch_size=sampler.expected_batch_size)
                accountant = privacy.PrivacyAccountant(z, rate, delta)
            else:
                sampler = privacy.CyclicPoissonSampler(x, y, sampling_rate=rate, cycle_length=bands,
                                                       seed=seed, steps_per_epoch=steps)
                rule = privacy.banded_mf_gaussian(clip, z, bands=bands, seed=seed,
                                                  expected_batch_size=sampler.expected_batch_size)
                accountant = privacy.PrivacyAccountant(z, rate, delta, cycle_length=bands)
            model = pergrad.PerExampleModel(build_model(seed), rule)
            model.compile(optimizer=make_optimizer(), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
            history = model.fit(sampler, epochs=1, callbacks=[accountant], verbose=0)
            accuracies.append(float(model.evaluate(*test, verbose=0, return_dict=True)["accuracy"]))
        name = "DP-SGD (dp_gaussian)" if bands == 1 else f"BandMF b={bands} (FHU)"
        print(f"| {name} | {z:.3f} | {history.history['epsilon'][-1]:.3f} | "
              f"{100 * statistics.mean(accuracies):.1f} ± {100 * statistics.pstdev(accuracies):.1f} | "
              f"{', '.join(f'{a:.4f}' for a in accuracies)} ({time.perf_counter() - start:.0f} s) |",
              flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("step", "digits"))
    parser.add_argument("--bands", default="4,8", help="BandMF's bands (b = 1 is always a row)")
    parser.add_argument("--rounds", type=int, default=15, help="step: interleaved timing rounds")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20, help="digits: epochs' worth of steps")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="digits: Adam, or SGD with momentum 0.9 (a linear function of the updates)")
    parser.add_argument("--learning-rate", type=float, help="digits: default 3e-3 (Adam), 0.1 (SGD)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="step: time by the wall clock or by this process's CPU time")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    limit_threads(args.threads)
    bands = [int(b) for b in args.bands.split(",")]
    if args.part == "step":
        step_cost([1, *bands], args.rounds, args.clock)
    else:
        digits_accuracy(bands, args.seeds, args.epochs, args.epsilon, args.delta, args.optimizer,
                        args.learning_rate)


if __name__ == "__main__":
    main()
