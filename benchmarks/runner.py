"""Timing and memory: steps run the way ``fit()`` runs them, interleaved rounds, medians.

Every variant is trained through the model's compiled train function called
the way ``fit()`` calls it (:class:`Stepper`; TF: Keras's default
``tf.function`` train function, ``jit_compile`` resolved by Keras; JAX: Keras's
jitted, state-donating train step, state kept between steps as ``fit()`` does;
torch: eager). Tracing / compilation is excluded (warm-up steps run first).

Timing (:func:`time_steppers`): variants are interleaved in rounds (the order
rotates each round) so that load on a shared machine hits all of them alike.
Each round times a block of steps per variant; a row's time is the median over
rounds and its ratio the median over rounds of (variant / plain in the same
round). Variants slower than ``slow_factor`` x plain (on one calibration step;
two if under 1 s) are timed one step at a time on at most ``slow_steps``
rounds. Each row also gives the minor page faults per step: on Linux, glibc
serves every block above its mmap threshold (32 MiB at most) with fresh pages,
so a step that builds large per-example tensors pays one fault per 4 KiB
touched, which is most of its time on some machines.

Memory (:func:`measure_memory`): each (model, variant) runs again in a fresh
process of ``bench.py --memory-child`` (same backend and options): the first
step and :data:`MEMORY_STEPS` more, then its peak resident set size
(:func:`peak_rss_kib`). A row gives the peak (framework included), its ratio
to the plain step's peak, and the step's share: the peak minus the peak after
the imports and the data, before the model is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import keras

from models import SEED, make_data, model_sizes, parse_model
from process import configure_threads

BACKEND = keras.backend.backend()
if BACKEND == "jax":
    import jax
elif BACKEND == "tensorflow":
    import tensorflow as tf

#: the entry point a memory subprocess runs
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")
MEMORY_STEPS = 2  # steps after the first (compiling) one in a memory subprocess


class Skipped(Exception):
    """A variant that does not apply to this model or checkout (a row saying why)."""


#: what a step's time is: wall-clock seconds, or with ``bench.py --clock cpu`` the CPU
#: seconds of this process (all its threads), which other processes on a shared machine
#: do not inflate
CLOCK = time.perf_counter


class Steps:
    """A variant built, compiled and stepped once on its fixed batch (``first_step_s``).

    Subclasses define :meth:`steps`; :meth:`run` times them.
    """

    first_step_s: float

    def steps(self, count: int) -> None:
        """Runs ``count`` steps, to the end of the last one."""
        raise NotImplementedError

    def run(self, count: int) -> tuple[float, int]:
        """Seconds (of :data:`CLOCK`) and minor page faults for ``count`` steps."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = CLOCK()
        self.steps(count)
        seconds = CLOCK() - start
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def close(self) -> None:
        pass


class Stepper(Steps):
    """Runs a compiled Keras model's train function on one fixed batch, like ``fit()``."""

    def __init__(self, model, x, y):
        self.model, self.data = model, (x, y, None)
        start = time.perf_counter()
        model.train_on_batch(x, y)  # builds, traces / compiles
        self.first_step_s = time.perf_counter() - start
        model.make_train_function()
        self.function = model.train_function
        self.state = None
        if BACKEND == "jax":
            self.state = model._get_jax_state(
                trainable_variables=True,
                non_trainable_variables=True,
                optimizer_variables=True,
                metrics_variables=True,
                purge_model_variables=False,
            )
        elif BACKEND == "torch":
            model.train()

    def steps(self, count: int) -> None:
        if BACKEND == "jax":
            state = self.state
            for _ in range(count):
                logs, state = self.function(state, iter([self.data]))
            jax.block_until_ready((logs, state))
            self.state = state
        else:
            for _ in range(count):
                logs = self.function([self.data])
            if BACKEND == "tensorflow":
                [t.numpy() for t in tf.nest.flatten(logs)]

    def close(self):
        if BACKEND == "jax":  # hand the donated state back to the variables
            names = ("trainable_variables", "non_trainable_variables", "optimizer_variables",
                     "metrics_variables")
            self.model._jax_state = dict(zip(names, self.state))
            self.model.jax_state_sync()


def time_steppers(key, steppers, args, log):
    """Interleaved timing rounds; per variant: {round: s/step}, faults/step, block, slow set."""
    # calibration: one timed step each, to size the blocks and spot slow variants
    estimate = {name: s.run(1)[0] for name, s in steppers.items()}
    estimate["plain"] = min(estimate["plain"], steppers["plain"].run(3)[0] / 3)
    for name, s in steppers.items():  # a second look (if under 1 s) before capping its steps:
        if 1.0 > estimate[name] > args.slow_factor * estimate["plain"]:  # TF's early steps lag
            estimate[name] = min(estimate[name], s.run(1)[0])
    slow = {n for n, t in estimate.items() if t > args.slow_factor * estimate["plain"]}
    block = {
        n: 1 if n in slow else int(min(args.max_block, max(1, round(args.block_s / t))))
        for n, t in estimate.items()
    }
    samples = {n: {} for n in steppers}
    faults = {n: [] for n in steppers}
    order = list(steppers)
    for round_ in range(args.repeats):
        rotated = order[round_ % len(order):] + order[: round_ % len(order)]
        for name in rotated:
            if name in slow and len(samples[name]) >= args.slow_steps:
                continue
            seconds, count = steppers[name].run(block[name])
            samples[name][round_] = seconds / block[name]
            faults[name].append(count / block[name])
        log(f"  {key}: round {round_ + 1}/{args.repeats} done")
    for s in steppers.values():
        s.close()
    return samples, faults, block, slow


def peak_rss_kib() -> int:
    """This process's peak resident set size, KiB.

    Linux: ``VmHWM`` of ``/proc/self/status``, the peak of this process's own
    address space. ``ru_maxrss`` is not used there: ``execve`` carries the
    spawning parent's peak into it (the kernel's ``signal->maxrss``), so a
    child spawned by a 1 GiB benchmark process would report >= 1 GiB.
    Elsewhere ``ru_maxrss`` (bytes on macOS).
    """
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def memory_child(key: str, name: str, make_stepper, threads: int) -> None:
    """``bench.py --memory-child KEY NAME``: one variant's peak memory, as a JSON line on stdout.

    ``baseline_kib`` is the peak RSS after the imports and the data (before the
    model is built), ``peak_kib`` the peak after the first step and
    ``MEMORY_STEPS`` more (:func:`peak_rss_kib`: the process's, framework included).
    ``make_stepper(name, kind, x, y)`` builds the variant (raising :class:`Skipped`).
    """
    configure_threads(threads)
    kind, batch_size = parse_model(key)
    x, y = make_data(kind, batch_size)
    # keras.utils.set_random_seed imports TensorFlow where it is installed, on
    # every backend (~400 MiB on torch): into the baseline, alike for all variants
    keras.utils.set_random_seed(SEED)
    baseline = peak_rss_kib()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stepper = make_stepper(name, kind, x, y)
            stepper.run(MEMORY_STEPS)
            stepper.close()
    except Skipped as reason:
        print(json.dumps(dict(skipped=str(reason))))
        return
    print(json.dumps(dict(baseline_kib=baseline, peak_kib=peak_rss_kib())))


def measure_memory(key: str, name: str, args) -> dict:
    """Runs :func:`memory_child` in a fresh process (same backend and options)."""
    command = [sys.executable, BENCH, "--memory-child", key, name, "--threads", str(args.threads)]
    if args.malloc_tuning:
        command.append("--malloc-tuning")
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.memory_timeout)
    except subprocess.TimeoutExpired:
        return dict(failed=f"memory subprocess over {args.memory_timeout:g} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:120]
        return dict(failed=f"memory subprocess exit {done.returncode}: {tail}")
    return json.loads(lines[-1])


def measure_model(key, names, memory_names, args, log, make_stepper, own_plain) -> list[dict]:
    """The rows of model ``key``: each variant of ``names`` timed (unless ``args.memory_only``),
    the peak memory of ``memory_names`` (with ``args.memory``).

    ``make_stepper(name, kind, x, y)`` builds a variant's :class:`Steps` (raising
    :class:`Skipped` where it does not apply); ``own_plain`` maps a variant to the
    row of its own baseline (``ratio_own``), where that is not the Keras plain step.
    """
    kind, batch_size = parse_model(key)
    x, y = make_data(kind, batch_size)
    memory = {}
    if args.memory:
        for name in memory_names:
            memory[name] = measure_memory(key, name, args)
            shown = {k: v for k, v in memory[name].items() if k != "baseline_kib"}
            log(f"  {key} {name}: memory {shown}")
    steppers, failures, skipped = {}, {}, {}
    for name in [] if args.memory_only else names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stepper = make_stepper(name, kind, x, y)
                for _ in range(args.warmup):
                    stepper.run(1)
            steppers[name] = stepper
        except Skipped as reason:
            skipped[name] = str(reason)
            log(f"  {key} {name}: skipped ({reason})")
        except Exception as error:  # report and go on with the other variants
            failures[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
            log(f"  {key} {name}: FAILED {failures[name]}")
    if args.memory_only:
        samples, faults, block, slow = {}, {}, {}, set()
    else:
        if "plain" not in steppers:
            raise RuntimeError(f"plain step failed on {key}: {failures.get('plain')}")
        samples, faults, block, slow = time_steppers(key, steppers, args, log)

    rows = []
    plain = samples.get("plain", {})
    plain_peak = memory.get("plain", {}).get("peak_kib")
    for name in names:
        row = dict(model=key, variant=name)
        if name == "plain":  # the model's sizes, for memory bounds in B x its largest variable
            row.update(model_sizes(key))
        if name in skipped:
            row["skipped"] = skipped[name]
        elif name in failures:
            row["failed"] = failures[name]
        elif name in samples:
            times = samples[name]
            row.update(
                ms=1e3 * statistics.median(times.values()),
                ratio=median_ratio(times, plain),
                steps=sum(block[name] for _ in times),
                slow=name in slow,
                first_step_s=steppers[name].first_step_s,
                faults=statistics.median(faults[name]),
            )
            own = own_plain.get(name)
            if own in samples:  # e.g. opacus clip / opacus-plain, round by round
                row["ratio_own"] = median_ratio(times, samples[own])
        cell = memory.get(name)
        if cell is not None:
            if "peak_kib" in cell:
                row.update(peak_mib=cell["peak_kib"] / 1024,
                           step_mib=(cell["peak_kib"] - cell["baseline_kib"]) / 1024)
                if plain_peak:
                    row["peak_ratio"] = cell["peak_kib"] / plain_peak
            elif "skipped" in cell:
                row.setdefault("skipped", cell["skipped"])
            else:
                row["memory_failed"] = cell["failed"]
        rows.append(row)
    return rows


def median_ratio(times: dict, reference: dict) -> float:
    """The median over rounds of ``times[round] / reference[round]`` (rounds both have)."""
    return statistics.median(t / reference[r] for r, t in times.items() if r in reference)
