#!/usr/bin/env python
"""The DP-SGD epoch on digits: pergrad's ``dp_gaussian`` with Poisson sampling against Opacus.

::

    .venv/bin/python benchmarks/dp_epoch.py                       # every backend, 10 epochs
    .venv/bin/python benchmarks/dp_epoch.py --backends jax --epochs 5 --json jax-epoch.json

Same problem on both sides: scikit-learn's digits with the demo's 80/20 split
(1437 training examples), the demo's MLP 64-64-10 (Keras's initial weights,
copied into the torch twin), Poisson sampling at ``q = 1/23`` (what Opacus's
``make_private(poisson_sampling=True)`` makes of the demo's batch of 64: one
over the 23 batches of its ``DataLoader``; expected batch 62.5), clipping
``C = 1``, noise multiplier ``z = 1``, Adam(3e-3), fixed seeds. Per backend a
fresh process (``--backends``; the backend is fixed at import) runs, epoch by
epoch in turn (the machine may be shared: every variant sees the same load):

- ``pergrad``: ``PerExampleModel(model, dp_gaussian(1, 1,
  expected_batch_size=sampler.expected_batch_size))`` fitted on a
  ``PoissonSampler`` (one ``fit(epochs=1)`` per epoch), its default buckets;
- ``pergrad one-shape``: the same with ``bucket_width=len(x)``, every batch
  padded to ``max_batch_size`` (the sampler before buckets: the padding's cost);
- ``opacus`` and ``opacus ghost`` (torch in the same process, if ``opacus``
  imports; one thread): the torch twin, ``PrivacyEngine().make_private(...,
  noise_multiplier=1, max_grad_norm=1, poisson_sampling=True)`` with its
  default per-sample hooks and with ``grad_sample_mode="ghost"`` (ghost
  clipping), one pass over its ``DPDataLoader`` per epoch. ``secure_mode=True``
  needs ``torchcsprng``, which has no build for this torch: not run.

Time per epoch is training only (pergrad: an epoch callback inside ``fit``;
Opacus: its loop), reported as the first epoch (JAX and TensorFlow trace and
compile there) and the median over the others, with ``x opacus`` the median
over epochs 2.. of (epoch time / the default Opacus's same epoch). Test
accuracy after the last epoch and the epsilon of the run (``privacy.epsilon``,
the same q, z and step count for all rows, delta 1e-5). ``pad / real`` is
the padding rows over the real rows of the batches trained on; ``traces`` the
Python calls of the train step (JAX: one compile per batch shape; TensorFlow:
traces that do not depend on the shapes; torch is eager: every step). Threads: 1 per library (``bench.py``'s
setting, ``process.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SEED = 0
RATE = 1 / 23  # Opacus's Poisson rate for the demo's batch of 64: 1 / len(DataLoader)
CLIP, NOISE, DELTA, LEARNING_RATE = 1.0, 1.0, 1e-5, 3e-3
BACKENDS = ("tensorflow", "jax", "torch")


#: the padding table: a Poisson batch of E[B] = 64 from 60,000 examples (MNIST's size)
PADDING_DATASET, PADDING_EXPECTED = 60_000, 64


def padding_cost(repeats: int) -> dict:
    """The DP step on the benchmark's MLP 784-256-256-10 at the mean padded size of a Poisson
    batch (its bucket) and at ``max_batch_size`` (one shape), interleaved (``runner.time_steppers``)."""
    import numpy as np

    from models import make_data
    from pergrad import privacy
    from recipes import make_variant
    from runner import Stepper, median_ratio, time_steppers

    n = PADDING_DATASET
    sampler = privacy.PoissonSampler(np.zeros((n, 1), "float32"), np.zeros(n),
                                     sampling_rate=PADDING_EXPECTED / n, seed=SEED)
    real = [len(sampler.indices_for_step(t)) for t in range(2000)]
    padded = [sampler.padded_size(k) for k in real]
    sizes = {"bucket": round(float(np.mean(padded))), "one shape": sampler.max_batch_size}
    plain = make_variant("plain", "mlp")
    steppers = {"plain": Stepper(plain, *make_data("mlp", sizes["bucket"]))}
    for rule in ("clip", "dp"):
        for label, rows in sizes.items():
            model = make_variant(f"pergrad {rule}", "mlp")
            steppers[f"{rule} {label}"] = Stepper(model, *make_data("mlp", rows))
    options = argparse.Namespace(slow_factor=1e9, max_block=50, block_s=0.25, repeats=repeats, slow_steps=3)
    samples, _, _, _ = time_steppers("mlp", steppers, options, lambda message: None)
    total = sum(real)
    out = dict(rows=sizes, real_mean=float(np.mean(real)), pad_over_real=(sum(padded) - total) / total,
               old_pad_over_real=(len(real) * sampler.max_batch_size - total) / total,
               ms={name: 1e3 * statistics.median(times.values()) for name, times in samples.items()})
    for rule in ("clip", "dp"):
        out[f"{rule} one shape / bucket"] = median_ratio(samples[f"{rule} one shape"],
                                                         samples[f"{rule} bucket"])
    return out


def child(backend: str, epochs: int, padding_repeats: int) -> dict:
    """One backend's rows (run with ``KERAS_BACKEND=backend``), interleaved epoch by epoch."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import process

    process.before_backend_import(threads=1)  # one thread per library
    import keras

    process.configure_threads(1)
    import numpy as np

    import pergrad
    from pergrad import privacy
    from pergrad.apps import demo

    assert keras.backend.backend() == backend, keras.backend.backend()
    (x, y), (x_test, y_test) = demo.load_digits_split(SEED)

    class CountingModel(pergrad.PerExampleModel):
        def train_step(self, *args):  # Python calls: traces on JAX and TF, steps on torch
            self.__dict__["traces"] = self.__dict__.get("traces", 0) + 1
            return super().train_step(*args)

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    class Pergrad:
        def __init__(self, bucket_width=None, noise=NOISE, private=True):
            self.sampler = privacy.PoissonSampler(x, y, sampling_rate=RATE, seed=SEED,
                                                  bucket_width=bucket_width)
            rule = privacy.dp_gaussian(CLIP, noise, expected_batch_size=self.sampler.expected_batch_size,
                                       seed=SEED)
            self.private = private and noise > 0
            self.model = (CountingModel(demo.build_model(SEED), rule) if private
                          else demo.build_model(SEED))  # the plain Keras model: the floor
            self.model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE),
                               loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            self.timer = EpochTimer()

        def epoch(self) -> float:
            self.model.fit(self.sampler, epochs=1, verbose=0, callbacks=[self.timer])
            return self.timer.seconds

        def steps(self) -> int:
            return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

        def accuracy(self) -> float:
            predicted = np.argmax(keras.ops.convert_to_numpy(self.model.predict(x_test, verbose=0)), axis=1)
            return float(np.mean(predicted == y_test))

        def extra(self) -> dict:
            real = [len(self.sampler.indices_for_step(t)) for t in range(self.steps())]
            rows = [self.sampler.padded_size(k) for k in real]
            traced = backend != "torch"
            return dict(pad_over_real=(sum(rows) - sum(real)) / sum(real), shapes=len(set(rows)),
                        traces=self.model.__dict__.get("traces") if traced else None,
                        bucket_width=self.sampler.bucket_width, max_batch_size=self.sampler.max_batch_size)

    class Opacus:
        def __init__(self, mode):
            import opacus
            import torch

            torch.set_num_threads(1)
            torch.manual_seed(SEED)
            nn = torch.nn
            net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
            with torch.no_grad():  # Keras's initial weights (kernels transposed)
                weights = demo.build_model(SEED).get_weights()
                for layer, (kernel, bias) in zip((net[0], net[2]), zip(weights[::2], weights[1::2])):
                    layer.weight.copy_(torch.from_numpy(np.asarray(kernel).T.copy()))
                    layer.bias.copy_(torch.from_numpy(np.asarray(bias)))
            optimizer = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
            data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())
            loader = torch.utils.data.DataLoader(data, batch_size=64)
            criterion = nn.CrossEntropyLoss()
            engine = opacus.PrivacyEngine(accountant="rdp")
            made = engine.make_private(
                module=net, optimizer=optimizer, data_loader=loader, criterion=criterion,
                noise_multiplier=NOISE, max_grad_norm=CLIP, poisson_sampling=True,
                grad_sample_mode=mode,
            )
            if mode == "ghost":  # the wrapped criterion runs its two backward passes
                self.net, self.optimizer, self.criterion, self.loader = made
            else:
                (self.net, self.optimizer, self.loader), self.criterion = made, criterion
            self.sample_rate, self.count = self.loader.sample_rate, 0
            self.torch, self.private = torch, True

        def epoch(self) -> float:
            start = time.perf_counter()
            self.net.train()
            for xb, yb in self.loader:
                self.optimizer.zero_grad(set_to_none=True)
                self.criterion(self.net(xb), yb).backward()
                self.optimizer.step()
                self.count += 1
            return time.perf_counter() - start

        def steps(self) -> int:
            return self.count

        def accuracy(self) -> float:
            self.net.eval()
            with self.torch.no_grad():
                predicted = self.net(self.torch.from_numpy(x_test)).argmax(1).numpy()
            return float(np.mean(predicted == y_test))

        def extra(self) -> dict:
            return dict(sample_rate=self.sample_rate)

    import warnings

    warnings.filterwarnings("ignore", message=".*(Full backward hook|secure_mode|Secure RNG).*")
    runs = {"pergrad": Pergrad(), "pergrad one-shape": Pergrad(bucket_width=len(x)),
            "pergrad z=0": Pergrad(noise=0.0), "keras plain": Pergrad(private=False)}
    skipped = {}
    try:
        import opacus  # noqa: F401

        runs["opacus"], runs["opacus ghost"] = Opacus("hooks"), Opacus("ghost")
    except ImportError:
        skipped["opacus"] = "opacus not installed"
    skipped["opacus secure_mode"] = "needs torchcsprng (no build for this torch)"
    seconds = {name: [] for name in runs}
    for _ in range(epochs):
        for name, run in runs.items():
            seconds[name].append(run.epoch())
    rows = []
    for name, run in runs.items():
        times = seconds[name]
        row = dict(backend=backend, variant=name, epochs=epochs, first_epoch_s=times[0],
                   median_epoch_s=statistics.median(times[1:] or times), steps=run.steps(),
                   accuracy=run.accuracy(),
                   epsilon=privacy.epsilon(NOISE, RATE, run.steps(), DELTA) if run.private else None,
                   seconds=times, **run.extra())
        if "opacus" in runs:
            pairs = list(zip(times, seconds["opacus"]))
            row["x_opacus"] = statistics.median(t / o for t, o in (pairs[1:] or pairs))
        rows.append(row)
    rows += [dict(backend=backend, variant=name, skipped=why) for name, why in skipped.items()]
    versions = f"keras {keras.__version__}, {backend} {_version(backend)}"
    if "opacus" in runs:
        torch_version = "" if backend == "torch" else f", torch {_version('torch')}"
        versions += f"{torch_version}, opacus {_version('opacus')}"
    padding = padding_cost(padding_repeats) if padding_repeats else None
    return dict(backend=backend, versions=versions, rows=rows, padding=padding)


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for distribution in (name, f"{name}-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "?"


def table(results) -> str:
    lines = ["| backend | variant | first epoch s | median epoch s | ms/step | x opacus | test accuracy "
             "| epsilon | pad / real | shapes | traces |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        for row in result["rows"]:
            if "skipped" in row:
                lines.append(f"| {row['backend']} | {row['variant']} | skipped: {row['skipped']} |"
                             + " |" * 8)
                continue
            per_step = 1e3 * row["median_epoch_s"] * row["epochs"] / max(row["steps"], 1)
            ratio = f"{row['x_opacus']:.2f}" if "x_opacus" in row else "–"
            pad = f"{row['pad_over_real']:.1%}" if "pad_over_real" in row else "–"
            shapes = str(row.get("shapes", "–"))
            traces = "eager" if row["variant"].startswith("pergrad") and row.get("traces") is None else (
                str(row["traces"]) if row.get("traces") is not None else "–")
            epsilon = "not private" if row["epsilon"] is None else f"{row['epsilon']:.2f}"
            lines.append(f"| {row['backend']} | {row['variant']} | {row['first_epoch_s']:.2f} | "
                         f"{row['median_epoch_s']:.2f} | {per_step:.1f} | {ratio} | {row['accuracy']:.3f} | "
                         f"{epsilon} | {pad} | {shapes} | {traces} |")
    return "\n".join(lines)


def padding_table(results) -> str:
    lines = ["| backend | rows: bucket / one shape | clip ms: bucket / one shape | one shape / bucket | "
             "dp_gaussian ms: bucket / one shape | one shape / bucket |", "|---|---:|---:|---:|---:|---:|"]
    for result in results:
        cost = result.get("padding")
        if not cost:
            continue
        ms, rows = cost["ms"], cost["rows"]
        cells = [result["backend"], f"{rows['bucket']} / {rows['one shape']}"]
        for rule in ("clip", "dp"):
            cells += [f"{ms[rule + ' bucket']:.2f} / {ms[rule + ' one shape']:.2f}",
                      f"{cost[rule + ' one shape / bucket']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--padding-repeats", type=int, default=7,
                        help="rounds of the padding table (0: no padding table)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.epochs, args.padding_repeats)))
        return 0
    results = []
    for backend in args.backends.split(","):
        print(f"{backend} ...", file=sys.stderr, flush=True)
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend, "--epochs",
                               str(args.epochs), "--padding-repeats", str(args.padding_repeats)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{backend} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"DP-SGD on digits (1437 training examples, MLP 64-64-10), q = 1/{round(1 / RATE)}, C = {CLIP:g}, "
          f"z = {NOISE:g}, Adam({LEARNING_RATE:g}), {args.epochs} epochs; "
          + "; ".join(r["versions"] for r in results) + ".\n")
    print(table(results))
    if any(r.get("padding") for r in results):
        cost = next(r["padding"] for r in results if r.get("padding"))
        print(f"\nPadding on the benchmark's MLP 784-256-256-10 (a Poisson batch of E[B] = "
              f"{PADDING_EXPECTED} from {PADDING_DATASET:,} examples: buckets pad "
              f"{cost['pad_over_real']:.1%} of the real rows over 2,000 draws, one shape of max_batch_size "
              f"{cost['old_pad_over_real']:.0%}; the step at the mean padded size against max_batch_size, "
              f"{args.padding_repeats} interleaved rounds, medians; clip and dp_gaussian(1, 1) as in "
              "bench.py):\n")
        print(padding_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
