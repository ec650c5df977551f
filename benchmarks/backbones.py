#!/usr/bin/env python
"""keras.applications backbones: a plain step against pergrad's clip and DP-SGD, peak memory, exactness.

Run once per backend (one process per model and variant underneath)::

    KERAS_BACKEND=jax .venv/bin/python benchmarks/backbones.py --json jax-backbones.json

Models (``--models``), built with ``weights=None``, ``include_top=False`` at ``--size``
(64x64 by default), random images through the family's ``preprocess_input``, ``B = --batch``
(8), a ``Dense(1)`` head and ``BinaryCrossentropy(from_logits=True)`` (keras.io's recipe):

- ``resnet50-bn-frozen``: ResNet50 fully fine-tuned, its BatchNormalization frozen;
- ``mobilenetv2-transfer``: MobileNetV2 frozen (``base.trainable = False``, called with
  ``training=False``), pooling, ``Dropout(0.2)``: keras.io's transfer learning;
- ``mobilenetv2-groupnorm``: MobileNetV2 fully fine-tuned after
  ``pergrad.layers.replace_batch_normalization`` (GroupNormalization);
- ``efficientnetb0-transfer``: EfficientNetB0 as ``mobilenetv2-transfer`` (its drop-connect
  runs in training mode: Keras 3 passes ``fit()``'s ``training=True`` into the base);
- ``efficientnetb0-bn-frozen``: EfficientNetB0 fully fine-tuned, BatchNormalization frozen;
- ``convnexttiny``: ConvNeXtTiny fully fine-tuned (LayerNormalization, no BatchNormalization).

Variants: ``plain`` (Keras's own train step), ``clip`` (``clip(1.0)``) and ``dp``
(``dp_gaussian(1.0, 1.0)``), timed as ``fit()`` runs them (``runner.py``: interleaved rounds,
medians, ratios to the plain step of the same round). Each (model, variant) runs again in a
fresh process for its peak RSS (framework included), killed above ``--memory-limit`` GiB.
Exactness: each example's squared gradient norm from the statistics path against a
batch-of-one loop of plain Keras gradients (``tests/oracle.py``), the largest relative
error; and the layers that took the per-layer fallback (no rule).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests")]

import process  # noqa: E402  (imports no backend)

MODELS = {  # key: (constructor, mode)
    "resnet50-bn-frozen": ("ResNet50", "bn-frozen"),
    "mobilenetv2-transfer": ("MobileNetV2", "transfer"),
    "mobilenetv2-groupnorm": ("MobileNetV2", "groupnorm"),
    "efficientnetb0-transfer": ("EfficientNetB0", "transfer"),
    "efficientnetb0-bn-frozen": ("EfficientNetB0", "bn-frozen"),
    "convnexttiny": ("ConvNeXtTiny", "full"),
}
VARIANTS = ("plain", "clip", "dp")


def build(key: str, size: int, batch: int):
    """The model of ``key`` and a batch of random images and labels."""
    import keras

    from pergrad import compat
    from pergrad.layers import replace_batch_normalization

    name, mode = MODELS[key]
    keras.utils.set_random_seed(0)
    constructor = getattr(keras.applications, name)
    base = constructor(weights=None, include_top=False, input_shape=(size, size, 3))
    inputs = keras.Input((size, size, 3))
    hidden = keras.layers.GlobalAveragePooling2D()(base(inputs, training=False))
    if mode == "transfer":
        base.trainable = False
        hidden = keras.layers.Dropout(0.2)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden), name=key.replace("-", "_"))
    if mode == "bn-frozen":
        for layer in compat.flatten_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False
    if mode == "groupnorm":
        model = replace_batch_normalization(model)
    rng = np.random.default_rng(0)
    family = sys.modules[constructor.__module__].__name__.rsplit(".", 1)[-1]
    images = rng.uniform(0, 255, size=(batch, size, size, 3)).astype("float32")
    x = np.asarray(getattr(keras.applications, family).preprocess_input(images), "float32")
    y = rng.integers(0, 2, size=(batch, 1)).astype("float32")
    return model, x, y


def variant(model, name: str, batch: int):
    """``model`` (plain) or ``PerExampleModel(model, rule)``, compiled with SGD(0.01)."""
    import keras

    import pergrad
    from pergrad.privacy import dp_gaussian

    rule = {"clip": lambda: pergrad.aggregators.clip(1.0),
            "dp": lambda: dp_gaussian(1.0, 1.0, expected_batch_size=batch)}.get(name)
    trained = model if rule is None else pergrad.PerExampleModel(model, rule())
    trained.compile(optimizer=keras.optimizers.SGD(0.01),
                    loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return trained


def exactness(model, x, y) -> dict:
    """The statistics path's per-example squared norms against the batch-of-one oracle, and
    the layers that took the fallback (from pergrad's log)."""
    import keras

    import oracle
    import pergrad

    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    draws = any(v.path.endswith("seed_generator_state") for v in model.non_trainable_variables)
    training = not draws  # per-example draws cannot be replayed by a loop: inference mode then
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pergrad").addHandler(handler)
    try:
        stats = pergrad.per_example_statistics(model, x, y, training=training)
    finally:
        logging.getLogger("pergrad").removeHandler(handler)
    expected = oracle.batch_of_one_gradients(model, x, y, training=training)
    norms = sum(np.sum(np.reshape(e, (len(x), -1)).astype("float64") ** 2, axis=1) for e in expected)
    actual = np.sum(oracle.to_numpy(stats.squared_norms).astype("float64"), axis=1)
    return dict(norm_error=float(np.max(np.abs(actual - norms) / norms)), training=training,
                log=[r.getMessage() for r in records])


def timing_child(key: str, args) -> None:
    """Times every variant of ``key`` (interleaved rounds) and checks exactness: one JSON line."""
    import runner

    process.configure_threads(args.threads)
    model, x, y = build(key, args.size, args.batch)
    report = dict(model=key, parameters=int(model.count_params()),
                  trainable=int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)))
    try:
        report.update(exactness(model, x, y))
    except Exception as error:  # report and time the variants all the same
        report["exactness_failed"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    steppers = {}
    for name in VARIANTS:
        try:  # a model of its own (the same seeded weights): on JAX a stepper donates its state
            if steppers:
                model, _, _ = build(key, args.size, args.batch)
            steppers[name] = runner.Stepper(variant(model, name, args.batch), x, y)
            steppers[name].run(1)  # warm-up
        except Exception as error:  # report and go on with the other variants
            report[f"{name}_failed"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    if "plain" in steppers:
        samples, _, _, _ = runner.time_steppers(key, steppers, args, lambda message: None)
        for name, times in samples.items():
            report[f"{name}_ms"] = 1e3 * float(np.median(list(times.values())))
            report[f"{name}_ratio"] = runner.median_ratio(times, samples["plain"])
            report[f"{name}_first_step_s"] = steppers[name].first_step_s
    print(json.dumps(report))


def memory_child(key: str, name: str, args) -> None:
    """The peak RSS of ``key``'s variant ``name``: its first step and two more."""
    import runner

    process.configure_threads(args.threads)
    model, x, y = build(key, args.size, args.batch)
    before = runner.peak_rss_kib()
    stepper = runner.Stepper(variant(model, name, args.batch), x, y)
    stepper.run(2)
    print(json.dumps(dict(built_gib=before / 2**20, peak_gib=runner.peak_rss_kib() / 2**20)))


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def run_child(child_args: list[str], args) -> dict:
    """A child of this script in a fresh process, killed above ``args.memory_limit`` GiB of RSS."""
    command = [sys.executable, __file__, *child_args, "--size", str(args.size), "--batch",
               str(args.batch), "--threads", str(args.threads), "--repeats", str(args.repeats)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, start = 0.0, time.time()
    while child.poll() is None:
        peak = max(peak, _rss_gib(child.pid))
        if peak > args.memory_limit or time.time() - start > args.timeout:
            child.kill()
            child.wait()
            why = f"above {args.memory_limit:g} GiB" if peak > args.memory_limit else "timed out"
            return dict(failed=f"killed: {why} (RSS {peak:.1f} GiB)")
        time.sleep(0.2)
    out, err = child.communicate()
    lines = out.strip().splitlines()
    if child.returncode != 0 or not lines:
        return dict(failed=f"exit {child.returncode}: {(err.strip().splitlines() or ['?'])[-1][:200]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds")
    parser.add_argument("--memory-limit", type=float, default=6.0, help="GiB of RSS a child may reach")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a child may run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timing-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # (what time_steppers reads: blocks of about a second, slow variants one step at a time)
    args.block_s, args.max_block, args.slow_factor, args.slow_steps = 1.0, 5, 20.0, args.repeats
    process.before_backend_import(args.threads)
    if args.timing_child:
        timing_child(args.timing_child, args)
        return
    if args.memory_child:
        memory_child(*args.memory_child, args)
        return
    import keras

    backend = keras.backend.backend()
    rows = []
    for key in args.models.split(","):
        print(f"{backend}: {key} ...", file=sys.stderr, flush=True)
        row = dict(backend=backend, **run_child(["--timing-child", key], args))
        row.setdefault("model", key)
        for name in VARIANTS:
            row[f"{name}_memory"] = run_child(["--memory-child", key, name], args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=backend, size=args.size, batch=args.batch, threads=args.threads,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
