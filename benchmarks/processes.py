#!/usr/bin/env python
"""A step on two JAX processes against one, and the bytes communicated per step, measured.

One process (one CPU device, no distribution), then two processes joined by
``keras.distribution.initialize`` on 127.0.0.1 (CPU collectives by gloo), one CPU device
each, ``DataParallel`` over both, train the same ``PerExampleModel`` on the same global
batch, each of the two feeding its half. Both run one thread (``--threads``): the two
processes use two cores where the one uses one. For each rule the child prints the
median time of Keras's jitted train step called directly (as ``benchmarks/replicas.py``
does; ``--steps`` timed steps after 3 untimed ones) and, on two processes, the
collectives of its compiled per-device program (``replicas.hlo_collectives``: result
bytes of every all-reduce, all-gather, all-to-all, collective-permute, reduce-scatter)::

    python benchmarks/processes.py                          # MLP 784-256-256-10, B = 256
    python benchmarks/processes.py --model small            # MLP 5-32-3, B = 32: the docs' devices table
    python benchmarks/processes.py --rules clip,median --steps 50

The ratio is the two-process step over the one-process step (below 1: faster on two).
Processes on one machine talk over loopback TCP (gloo): hosts on a network pay its
latency and bandwidth for the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "..", "src")
RULES = ("mean", "clip", "dp_gaussian", "median")
MODELS = {"mlp": ((784, 256, 256, 10), 256), "small": ((5, 32, 3), 32)}  # widths, global batch


def _rule(name: str):
    from pergrad import aggregators, privacy

    return {
        "mean": lambda: aggregators.mean(),
        "clip": lambda: aggregators.clip(1.0),
        "dp_gaussian": lambda: privacy.dp_gaussian(1.0, 1.0, seed=0),
        "median": lambda: aggregators.median(),
    }[name]()


def _build(rule: str, widths):
    import keras

    import pergrad

    keras.utils.set_random_seed(0)
    layers = [keras.Input((widths[0],))]
    layers += [keras.layers.Dense(width, "relu" if k < len(widths) - 2 else None)
               for k, width in enumerate(widths[1:])]
    model = pergrad.PerExampleModel(keras.Sequential(layers), _rule(rule))
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _measure(rule: str, widths, batch: int, steps: int, part: int, parts: int) -> dict:
    import numpy as np

    from replicas import jax_step

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, widths[0])).astype("float32")
    y = rng.integers(0, widths[-1], size=(batch,)).astype("int32")
    rows = slice(part * batch // parts, (part + 1) * batch // parts)  # this process's half
    model = _build(rule, widths)
    model.train_on_batch(x[rows], y[rows])  # builds and compiles, as fit() does
    found = jax_step(model, x[rows], y[rows], steps, untimed=3)
    found["parameters"] = int(sum(np.prod(v.shape) for v in model.model.trainable_variables))
    return found


def child(process: int | None, port: int, rules, model: str, steps: int) -> None:
    """One process: alone (``process`` None) or one of two; one ``ROW`` line per rule."""
    import jax
    import keras

    widths, batch = MODELS[model]
    parts = 1
    if process is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keras.distribution.initialize(job_addresses=f"127.0.0.1:{port}", num_processes=2,
                                      process_id=process)
        keras.distribution.set_distribution(keras.distribution.DataParallel(
            devices=keras.distribution.list_devices(), auto_shard_dataset=False))
        parts = 2
    for rule in rules:
        try:
            found = _measure(rule, widths, batch, steps, jax.process_index(), parts)
        except Exception as error:  # a row that says why, not a lost table
            found = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        found["rule"] = rule
        if jax.process_index() == 0:
            print("ROW " + json.dumps(found), flush=True)


def _run(processes: list[list[str]], timeout: float) -> list[dict]:
    sys.path.insert(0, HERE)
    from process import limit_threads

    limit_threads(1)  # each process one thread: XLA_FLAGS for the children
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SOURCE, HERE, env.get("PYTHONPATH")]))
    started = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *arguments], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for arguments in processes]
    outputs = [p.communicate(timeout=timeout) for p in started]
    for p, (_, err) in zip(started, outputs):
        if p.returncode:
            raise RuntimeError(f"a process exited {p.returncode}: {err.strip().splitlines()[-1:]}")
    return [json.loads(line[4:]) for line in outputs[0][0].splitlines() if line.startswith("ROW ")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", default=",".join(RULES), help="comma list from " + ",".join(RULES))
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per rule")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    common = ["--rules", ",".join(rules), "--model", args.model, "--steps", str(args.steps)]
    if args.child is not None:
        process = None if args.child[0] == "alone" else int(args.child[0])
        child(process, int(args.child[1]), rules, args.model, args.steps)
        return 0
    one = _run([["--child", "alone", "0", *common]], args.timeout)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = str(probe.getsockname()[1])
    probe.close()
    two = _run([["--child", str(i), port, *common] for i in range(2)], args.timeout)
    widths, batch = MODELS[args.model]
    print(f"MLP {'-'.join(map(str, widths))}, global batch B = {batch}, P = "
          f"{one[0].get('parameters', '?')} parameters, one thread per process; step: median of "
          f"{args.steps} steps; bytes: result sizes of the two-process step's collectives on one "
          "device.\n")
    print("| rule | 1 process ms | 2 processes ms | ratio (2 / 1) | collectives (2 processes) "
          "| bytes/step/device |")
    print("|---|---:|---:|---:|---|---:|")
    for alone, pair in zip(one, two):
        if "error" in alone or "error" in pair:
            print(f"| {alone['rule']} | {alone.get('error', '')} | {pair.get('error', '')} | | | |")
            continue
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(pair["counts"].items())) or "none"
        print(f"| {alone['rule']} | {alone['step_ms']:.2f} | {pair['step_ms']:.2f} | "
              f"{pair['step_ms'] / alone['step_ms']:.2f}x | {kinds} | {sum(pair['bytes'].values()):,} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one": one, "two": two}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
