#!/usr/bin/env python
"""The cost of ``pergrad.insight.diagnostics.GradientDiagnostics``: a diagnostics step against a plain one.

Run once per backend::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/diagnostics.py
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/diagnostics.py --models mlp256 --repeats 9

Variants, on the benchmark models of ``models.py`` (default ``mlp256`` and ``tfm64``):

- ``plain``: the Keras model's own train step;
- ``mean``: ``PerExampleModel(model, "mean")`` without diagnostics;
- ``diag``: ``mean`` with ``GradientDiagnostics()``, the default: norm quantiles
  and noise scale every step, the GSNR of every variable every 10th step;
- ``diag-gsnr1``: the GSNR every step too (``gsnr_every_n_steps=1``);
- ``diag-nogsnr``: no GSNR (``gsnr=False``);
- ``diag10``: every 10th step (``every_n_steps=10``: the GSNR every 100th), the rest plain.

Every variant runs the way ``fit()`` runs it (``runner.py``): the model's
compiled train function, and for the diagnostics the callback's hooks around each
step; every step's logs are converted to Python floats as ``fit()``'s callbacks
do (one sync per step, for every variant alike). Interleaved rounds, the median
over rounds of each variant's time per step over the plain step's in the same
round (``runner.time_steppers``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]

import process  # noqa: E402  (imports no backend)

VARIANTS = ("plain", "mean", "diag", "diag-gsnr1", "diag-nogsnr", "diag10")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp256,tfm64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--warmup", type=int, default=12, help="steps before timing (traces, compiles)")
    parser.add_argument("--block-s", type=float, default=1.0, help="seconds of steps per block")
    parser.add_argument("--max-block", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


ARGS = parse_args()
process.before_backend_import(ARGS.threads, ARGS.models.split(","))

import keras  # noqa: E402

import pergrad  # noqa: E402
import runner  # noqa: E402
from models import build_model, make_data, new_loss, new_optimizer, parse_model  # noqa: E402
from pergrad.insight.diagnostics import GradientDiagnostics  # noqa: E402

CALLBACKS = {
    "diag": dict(),
    "diag-gsnr1": dict(gsnr_every_n_steps=1),
    "diag-nogsnr": dict(gsnr=False),
    "diag10": dict(every_n_steps=10),
}


class FitSteps(runner.Stepper):
    """:class:`runner.Stepper` with a callback's batch hooks around each step and every
    step's logs made Python floats, as ``fit()``'s callback list does."""

    def __init__(self, model, x, y, callback=None):
        super().__init__(model, x, y)
        self.callback, self.index = callback, 0
        if callback is not None:
            callback.set_model(model)
            callback.on_train_begin()

    def steps(self, count: int) -> None:
        for _ in range(count):
            if self.callback is not None:
                self.callback.on_train_batch_begin(self.index)
            function = self.model.train_function
            if runner.BACKEND == "jax":
                logs, self.state = function(self.state, iter([self.data]))
            else:
                logs = function([self.data])
            logs = {k: float(keras.ops.convert_to_numpy(v)) for k, v in logs.items()}
            if self.callback is not None:
                self.callback.on_train_batch_end(self.index, logs)
            self.index += 1


def make_stepper(name, kind, x, y):
    model = build_model(kind)
    if name != "plain":
        model = pergrad.PerExampleModel(model, "mean")
    model.compile(optimizer=new_optimizer(), loss=new_loss())
    callback = GradientDiagnostics(**CALLBACKS[name]) if name in CALLBACKS else None
    return FitSteps(model, x, y, callback)


def main():
    args = ARGS
    args.slow_factor, args.slow_steps = 1e9, args.repeats  # every variant in full blocks
    process.configure_threads(args.threads)
    names = args.variants.split(",")
    print(f"backend {runner.BACKEND}, keras {keras.__version__}, threads {args.threads}, "
          f"{args.repeats} rounds")
    print("| model | variant | ms/step | ratio to plain |")
    print("|---|---|---|---|")
    for key in args.models.split(","):
        kind, _ = parse_model(key)
        x, y = make_data(kind, parse_model(key)[1])
        steppers = {}
        for name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steppers[name] = make_stepper(name, kind, x, y)
                steppers[name].run(args.warmup)
        samples, _, _, _ = runner.time_steppers(key, steppers, args, lambda message: None)
        for name in names:
            times = samples[name]
            ms = 1e3 * sorted(times.values())[len(times) // 2]
            print(f"| {key} | {name} | {ms:.2f} | {runner.median_ratio(times, samples['plain']):.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
