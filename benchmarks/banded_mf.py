#!/usr/bin/env python
"""BandMF (``privacy.banded_mf_gaussian``) against DP-SGD: a step's cost; digits and a tiny LM at one epsilon.

Three parts, run once per backend::

    KERAS_BACKEND=jax .venv/bin/python benchmarks/banded_mf.py step
    KERAS_BACKEND=jax .venv/bin/python benchmarks/banded_mf.py digits --seeds 3
    KERAS_BACKEND=jax .venv/bin/python benchmarks/banded_mf.py lm --optimizer sgd --learning-rate 0.03

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

``lm``: the same comparison on the test suite's tiny keras-hub GPT-2 (1 layer, hidden 8, vocabulary
60; ``tests/problems.py``'s ``gpt2_lm``, sequences of 16 here), trained on 2048 sequences of a
fixed random Markov chain, each sequence one example; test next-token accuracy on 512 held-out
sequences (the chain's best possible accuracy is printed with it).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np

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


def digits_task(seed_split: int = 0):
    """pergrad.apps.digits' network on the digits: (train, test, build, loss, what is measured)."""
    from pergrad.apps.digits import build_model, load_digits_split

    train, test = load_digits_split(seed=seed_split)
    return "digits", train, test, build_model, "sparse_categorical_crossentropy", "test accuracy"


def markov_sequences(count: int, length: int, vocabulary: int, seed: int):
    """``count`` token sequences of a fixed random Markov chain (each token followed by one of a
    few likely successors), the same chain for every ``seed``; returns (sequences, the best
    next-token accuracy any model can reach: the mean of each row's largest probability)."""
    chain_rng = np.random.default_rng(1234)
    transition = chain_rng.dirichlet(np.full(vocabulary, 0.05), size=vocabulary)
    rng = np.random.default_rng(seed)
    tokens = np.empty((count, length), np.int64)
    tokens[:, 0] = rng.integers(0, vocabulary, count)
    cumulative = np.cumsum(transition, axis=1)
    for t in range(1, length):
        u = rng.random(count)[:, None]
        tokens[:, t] = np.minimum((u > cumulative[tokens[:, t - 1]]).sum(axis=1), vocabulary - 1)
    return tokens.astype("int32"), float(transition.max(axis=1).mean())


def language_model_task():
    """The tests' keras-hub GPT-2 (``tests/problems.py``'s ``gpt2_lm``, 1 layer, 2 heads, hidden
    8, vocabulary 60) on sequences of a random Markov chain: next-token accuracy on held-out
    sequences, each sequence one example (its mean token loss)."""
    import keras
    import keras_hub

    vocabulary, length = 60, 16
    sequences, best = markov_sequences(2560, length + 1, vocabulary, seed=0)

    def split(rows):
        ids = sequences[rows, :-1]
        return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, sequences[rows, 1:]

    train, test = split(slice(0, 2048)), split(slice(2048, None))

    def build(seed):
        keras.utils.set_random_seed(seed)
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocabulary, num_layers=1, num_heads=2,
                                                 hidden_dim=8, intermediate_dim=16,
                                                 max_sequence_length=length, dropout=0.0)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return ("keras-hub GPT-2 (tiny) on a Markov chain's sequences", train, test, build, loss,
            f"test next-token accuracy (best possible {100 * best:.1f})")


def accuracy_table(task, bands_list, seeds: int, epochs: int, target: float, delta: float, optimizer: str,
                   learning_rate: float | None) -> None:
    import keras

    import pergrad
    from pergrad import privacy

    title, (x, y), test, build_model, loss, measured = task
    n, batch, clip = len(y), 64, 1.0
    steps = round(epochs * n / batch)
    if learning_rate is None:
        learning_rate = 3e-3 if optimizer == "adam" else 0.1

    def make_optimizer():
        if optimizer == "adam":
            return keras.optimizers.Adam(learning_rate)
        return keras.optimizers.SGD(learning_rate, momentum=0.9)

    described = f"Adam({learning_rate:g})" if optimizer == "adam" else f"SGD({learning_rate:g}, momentum 0.9)"
    print(f"{title}, {keras.backend.backend()}, n = {n}, expected batch {batch}, {steps} steps, "
          f"epsilon = {target:g} (delta = {delta:g}), C = {clip:g}, {described}, {seeds} seeds; {measured}")
    print("| rule | z | epsilon reached | accuracy, mean ± std | runs |")
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
            model.compile(optimizer=make_optimizer(), loss=loss, metrics=["accuracy"])
            history = model.fit(sampler, epochs=1, callbacks=[accountant], verbose=0)
            accuracies.append(float(model.evaluate(*test, verbose=0, return_dict=True)["accuracy"]))
        name = "DP-SGD (dp_gaussian)" if bands == 1 else f"BandMF b={bands} (FHU)"
        print(f"| {name} | {z:.3f} | {history.history['epsilon'][-1]:.3f} | "
              f"{100 * statistics.mean(accuracies):.1f} ± {100 * statistics.pstdev(accuracies):.1f} | "
              f"{', '.join(f'{a:.4f}' for a in accuracies)} ({time.perf_counter() - start:.0f} s) |",
              flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("step", "digits", "lm"))
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
        task = digits_task() if args.part == "digits" else language_model_task()
        accuracy_table(task, bands, args.seeds, args.epochs, args.epsilon, args.delta, args.optimizer,
                       args.learning_rate)


if __name__ == "__main__":
    main()
