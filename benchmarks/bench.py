#!/usr/bin/env python
"""Per-example-gradient training steps: pergrad against the usual recipes.

Run once per backend (the backend is chosen at import, one process each)::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/bench.py
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/bench.py --quick
    KERAS_BACKEND=torch      .venv/bin/python benchmarks/bench.py --models mlp64,cnn64 --repeats 9
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/bench.py --variants "plain,vmap clip,pergrad clip"

Models (random data, fixed seed, sparse categorical cross-entropy from logits,
SGD(0.01)); ``mlp<B>`` / ``cnn<B>`` at any batch size B:

- ``mlp64`` / ``mlp256`` (default): MLP 784-256-256-10 at batch 64 / 256;
- ``cnn64`` (default): 28x28x1 -> Conv 3x3x16 relu -> Conv 3x3x32 relu ->
  MaxPool 2 -> Flatten -> Dense 10, at batch 64.

``--quick`` (smoke test): ``mlp16`` and ``cnn16``, the variants plain, vmap
clip, pergrad median and pergrad clip, 2 rounds (add others with ``--variants``).

Threads: every backend runs on ``--threads 1`` by default. On a small shared
machine, multi-threaded pools (torch's OpenMP above all) get descheduled and a
plain step can slow down 10-40x from one run to the next; one thread keeps the
ratios meaningful. ``--threads 0`` leaves the backends' defaults.

Variants, all trained through the same mechanism: the model's compiled train
function called the way ``fit()`` calls it (TF: Keras's default ``tf.function``
train function, ``jit_compile`` resolved by Keras; JAX: Keras's jitted,
state-donating train step, state kept between steps as ``fit()`` does; torch:
eager). Tracing/compilation is excluded (warm-up steps are run first).

- ``plain``: the wrapped Keras model itself (``model.compile`` + Keras's step);
- ``jacobian <agg>``: a custom ``train_step`` that takes the Jacobian of the
  unreduced per-example loss vector w.r.t. the trainable variables, then
  aggregates: TF ``tape.jacobian`` (pfor), JAX ``jax.jacrev`` through
  ``stateless_call``, torch ``torch.func.jacrev`` through ``stateless_call``;
- ``vmap <agg>``: a custom ``train_step`` vectorizing the single-example
  gradient: TF a hand-written ``tf.vectorized_map`` around a ``GradientTape``,
  JAX ``jax.vmap(jax.grad)`` through ``stateless_call``, torch
  ``torch.func.vmap(torch.func.grad)`` through ``stateless_call``;
- ``pergrad <agg>``: ``pergrad.PerExampleModel(model, agg)``.

Aggregations: ``mean``; ``median`` (coordinate-wise); ``clip`` = per-example
flat L2 clipping to 1.0 then the mean (``pergrad.aggregators.clip(1.0)``). The
recipes aggregate with hand-written ``keras.ops`` code doing the same thing.

Timing: variants are interleaved in rounds (the order rotates each round) so
that load on a shared machine hits all of them alike. Each round times a block
of steps per variant; the reported time is the median over rounds and the ratio
is the median over rounds of (variant / plain in the same round). Variants
slower than ``--slow-factor`` x plain are timed one step at a time on at most
``--slow-steps`` rounds (marked in the table). The table also gives the minor
page faults per step: on Linux, glibc serves every block above its mmap
threshold (32 MiB at most) with fresh pages, so a step that builds large
per-example tensors pays one fault per 4 KiB touched, which is most of its time
on some machines (``--malloc-tuning`` shows the difference).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def process_options(argv=None):
    """Options that must act before the backend is imported."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--malloc-tuning", action="store_true")
    return parser.parse_known_args(argv)[0]


def limit_threads(threads: int | None):
    if not threads:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(threads)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(threads)
    flags = f"--xla_cpu_multi_thread_eigen={'false' if threads == 1 else 'true'}"
    flags += f" intra_op_parallelism_threads={threads}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def tune_malloc():
    """glibc: serve large blocks from the heap and never give memory back.

    The same as starting Python with ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=2147483647``; done before the backend starts threads.

    By default glibc ``mmap``s every block above 32 MiB (at most) and ``munmap``s
    it on free, so a per-step buffer of per-example gradients is fresh memory on
    every step and each 4 KiB page faults on first touch. This keeps freed
    memory in the process for reuse. Diagnostic only: it is a process-wide
    allocator setting, not something a library should do behind a user's back.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    # One arena: a thread arena mmaps any block larger than its 64 MiB heap
    # whatever M_MMAP_MAX says; the main arena grows with brk and keeps it.
    libc.mallopt(m_arena_max, 1)
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


PROCESS = process_options() if __name__ == "__main__" else process_options([])
limit_threads(PROCESS.threads)
if PROCESS.malloc_tuning:
    tune_malloc()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

BACKEND = keras.backend.backend()
if BACKEND not in ("tensorflow", "jax", "torch"):
    sys.exit(f"bench.py supports tensorflow, jax and torch; KERAS_BACKEND is {BACKEND!r}.")

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, _HERE)
import pergrad  # noqa: E402

DEFAULT_MODELS = ("mlp64", "mlp256", "cnn64")
QUICK_MODELS = ("mlp16", "cnn16")
QUICK_VARIANTS = ("plain", "vmap clip", "pergrad median", "pergrad clip")


def parse_model(key: str):
    """``"mlp64"`` -> ``("mlp", 64)``: the architecture and the batch size."""
    match = re.fullmatch(r"(mlp|cnn)(\d+)", key)
    if not match:
        raise ValueError(f"unknown model {key!r}: use mlp<batch> or cnn<batch>, e.g. mlp64, cnn64")
    return match.group(1), int(match.group(2))
AGGREGATIONS = ("mean", "median", "clip")
CLIP_NORM = 1.0
SEED = 0
LEARNING_RATE = 0.01

# --------------------------------------------------------------------------------------
# models and data


def build_model(kind: str) -> keras.Model:
    keras.utils.set_random_seed(SEED)  # every variant starts from the same weights
    if kind == "mlp":
        layers = [
            keras.Input((784,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        layers = [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    return keras.Sequential(layers, name=kind)


def make_data(kind: str, batch_size: int):
    rng = np.random.default_rng(SEED)
    shape = (batch_size, 784) if kind == "mlp" else (batch_size, 28, 28, 1)
    x = rng.normal(size=shape).astype("float32")
    y = rng.integers(0, 10, size=(batch_size,)).astype("int32")
    return ops.convert_to_tensor(x), ops.convert_to_tensor(y)


def example_losses(y, logits):
    """The unreduced per-example loss vector, shape (B,)."""
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def new_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def new_optimizer():
    return keras.optimizers.SGD(LEARNING_RATE)


# --------------------------------------------------------------------------------------
# the recipes' aggregation, written by hand in keras.ops


def aggregate_mean(grads):
    return [ops.mean(g, axis=0) for g in grads]


def aggregate_median(grads):
    return [ops.median(g, axis=0) for g in grads]


def aggregate_clip(grads, l2_norm=CLIP_NORM):
    batch = ops.shape(grads[0])[0]
    flat = [ops.reshape(g, (batch, -1)) for g in grads]
    norms = ops.sqrt(sum(ops.sum(f * f, axis=1) for f in flat))
    weights = (l2_norm / ops.maximum(norms, l2_norm)) / ops.cast(batch, norms.dtype)
    return [
        ops.reshape(ops.matmul(weights[None, :], f)[0], g.shape[1:]) for f, g in zip(flat, grads)
    ]


RECIPE_AGGREGATE = {"mean": aggregate_mean, "median": aggregate_median, "clip": aggregate_clip}


def pergrad_aggregator(name):
    return pergrad.aggregators.clip(CLIP_NORM) if name == "clip" else name


# --------------------------------------------------------------------------------------
# the recipes: custom train steps, one per backend


class RecipeModel(keras.Model):
    """Wraps ``inner``; ``train_step`` computes per-example gradients by ``recipe``."""

    def __init__(self, inner, recipe: str, aggregation: str, **kwargs):
        super().__init__(name=f"{recipe}_{aggregation}", **kwargs)
        self.inner = inner
        self.recipe = recipe
        self.aggregate = RECIPE_AGGREGATE[aggregation]
        self.built = True

    def call(self, x, training=None):
        return self.inner(x, training=training)


if BACKEND == "tensorflow":
    import tensorflow as tf

    class Recipe(RecipeModel):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            variables = self.inner.trainable_variables
            if self.recipe == "jacobian":
                with tf.GradientTape() as tape:
                    losses = example_losses(y, self.inner(x, training=True))
                grads = tape.jacobian(losses, variables)
            else:

                def single(example):
                    xi, yi = example
                    with tf.GradientTape() as tape:
                        loss = example_losses(yi[None], self.inner(xi[None], training=True))[0]
                    return tape.gradient(loss, variables)

                grads = tf.vectorized_map(single, (x, y))
            self.optimizer.apply(self.aggregate(grads), variables)
            return {}

elif BACKEND == "jax":
    import jax

    class Recipe(RecipeModel):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            inner = self.inner

            if self.recipe == "jacobian":

                def losses(values):
                    logits, _ = inner.stateless_call(values, non_trainable, x, training=True)
                    return example_losses(y, logits)

                grads = jax.jacrev(losses)(trainable)
            else:

                def loss(values, xi, yi):
                    logits, _ = inner.stateless_call(values, non_trainable, xi[None], training=True)
                    return example_losses(yi[None], logits)[0]

                grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(trainable, x, y)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, self.aggregate(grads), trainable
            )
            return {}, (trainable, non_trainable, optimizer_variables, metrics_variables)

else:
    import torch

    class Recipe(RecipeModel):
        #: set when the raw torch.vmap recipe needed pergrad's keras#23587 workaround
        needed_layout_workaround = False

        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            inner = self.inner
            variables = inner.trainable_variables
            values = [v.value for v in variables]
            non_trainable = [v.value for v in inner.non_trainable_variables]

            if self.recipe == "jacobian":

                def losses(values):
                    logits, _ = inner.stateless_call(values, non_trainable, x, training=True)
                    return example_losses(y, logits)

                with torch.enable_grad():
                    grads = torch.func.jacrev(losses)(values)
            else:

                def loss(values, xi, yi):
                    logits, _ = inner.stateless_call(values, non_trainable, xi[None], training=True)
                    return example_losses(yi[None], logits)[0]

                vectorized = torch.func.vmap(
                    torch.func.grad(loss), in_dims=(None, 0, 0), randomness="different"
                )
                with torch.enable_grad(), self._layout_context():
                    try:
                        grads = vectorized(values, x, y)
                    except RuntimeError as error:
                        if "NYI" not in str(error) or Recipe.needed_layout_workaround:
                            raise
                        Recipe.needed_layout_workaround = True
                        with self._layout_context():
                            grads = vectorized(values, x, y)
            with torch.no_grad():
                self.optimizer.apply(self.aggregate(grads), variables)
            return {}

        @staticmethod
        def _layout_context():
            if not Recipe.needed_layout_workaround:
                return contextlib.nullcontext()
            from pergrad.backend.torch import _IgnoreMemoryLayout

            return _IgnoreMemoryLayout()


# --------------------------------------------------------------------------------------
# running steps the way fit() does


class Stepper:
    """Runs a compiled model's train function on one fixed batch, like ``fit()``."""

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

    def run(self, steps: int) -> tuple[float, int]:
        """Seconds and minor page faults for ``steps`` steps, to the end of the last one."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        if BACKEND == "jax":
            state = self.state
            for _ in range(steps):
                logs, state = self.function(state, iter([self.data]))
            jax.block_until_ready((logs, state))
            self.state = state
        else:
            for _ in range(steps):
                logs = self.function([self.data])
            if BACKEND == "tensorflow":
                [t.numpy() for t in tf.nest.flatten(logs)]
        seconds = time.perf_counter() - start
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def close(self):
        if BACKEND == "jax":  # hand the donated state back to the variables
            names = ("trainable_variables", "non_trainable_variables", "optimizer_variables",
                     "metrics_variables")
            self.model._jax_state = dict(zip(names, self.state))
            self.model.jax_state_sync()


def make_variant(name: str, kind: str):
    inner = build_model(kind)
    if name == "plain":
        model = inner
    else:
        recipe, aggregation = name.split(" ")
        if recipe == "pergrad":
            model = pergrad.PerExampleModel(inner, pergrad_aggregator(aggregation))
        elif recipe == "proto":  # engine changes prototyped in benchmarks/prototypes.py
            import prototypes

            model = prototypes.prototype_model(inner, aggregation)
        elif recipe == "ghost":  # the layer-rule ceiling, Dense-only (benchmarks/prototypes.py)
            import prototypes

            model = prototypes.ghost_model(inner, aggregation)
        else:
            model = Recipe(inner, recipe, aggregation)
    model.compile(optimizer=new_optimizer(), loss=new_loss())
    return model


def variant_names(selected_aggregations, recipes):
    names = ["plain"]
    for recipe in recipes:
        for aggregation in selected_aggregations:
            if recipe == "jacobian" and aggregation == "mean":
                continue  # the jacobian rows of interest are median and clip
            names.append(f"{recipe} {aggregation}")
    return names


def bench_model(key, args, log):
    kind, batch_size = parse_model(key)
    x, y = make_data(kind, batch_size)
    names = args.variants or variant_names(args.aggregations, args.recipes)
    steppers, failures = {}, {}
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stepper = Stepper(make_variant(name, kind), x, y)
                for _ in range(args.warmup):
                    stepper.run(1)
            steppers[name] = stepper
        except Exception as error:  # report and go on with the other variants
            failures[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
            log(f"  {key} {name}: FAILED {failures[name]}")
    if "plain" not in steppers:
        raise RuntimeError(f"plain step failed on {key}: {failures.get('plain')}")

    # calibration: one timed step each, to size the blocks and spot slow variants
    estimate = {name: s.run(1)[0] for name, s in steppers.items()}
    estimate["plain"] = min(estimate["plain"], steppers["plain"].run(3)[0] / 3)
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

    rows = []
    plain = samples["plain"]
    for name in names:
        if name in failures:
            rows.append(dict(model=key, variant=name, failed=failures[name]))
            continue
        times = samples[name]
        ratios = [t / plain[r] for r, t in times.items() if r in plain]
        rows.append(
            dict(
                model=key,
                variant=name,
                ms=1e3 * statistics.median(times.values()),
                ratio=statistics.median(ratios),
                steps=sum(block[name] for _ in times),
                slow=name in slow,
                first_step_s=steppers[name].first_step_s,
                faults=statistics.median(faults[name]),
            )
        )
    return rows


# --------------------------------------------------------------------------------------
# reporting


def source_state() -> str:
    """The commit of the checkout the benchmark ran on, ``-dirty`` with local changes."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=_HERE, capture_output=True, text=True,
            timeout=10,
        )
        return out.stdout.strip() or "an unknown commit"
    except (OSError, subprocess.SubprocessError):
        return "an unknown commit"


def describe_recipes():
    return {
        "tensorflow": "jacobian = tape.jacobian (pfor) of the loss vector; vmap = hand-written "
        "tf.vectorized_map of a GradientTape per example",
        "jax": "jacobian = jax.jacrev of the loss vector through stateless_call; "
        "vmap = jax.vmap(jax.grad) through stateless_call",
        "torch": "jacobian = torch.func.jacrev of the loss vector through stateless_call; "
        "vmap = torch.func.vmap(torch.func.grad) through stateless_call",
    }[BACKEND]


def table(rows, args):
    lines = [
        "| model | variant | ms/step (median) | x plain | steps timed | page faults/step | first step s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['model']} | {row['variant']} | failed: {row['failed']} | | | | |")
            continue
        mark = " †" if row["slow"] else ""
        lines.append(
            f"| {row['model']} | {row['variant']}{mark} | {row['ms']:.2f} | {row['ratio']:.2f} | "
            f"{row['steps']} | {row['faults']:.0f} | {row['first_step_s']:.1f} |"
        )
    return "\n".join(lines)


def find(rows, model, variant):
    for row in rows:
        if row["model"] == model and row["variant"] == variant and "ratio" in row:
            return row
    return None


def goals(rows):
    out = []
    if BACKEND == "tensorflow":
        jac, pg = find(rows, "cnn64", "jacobian median"), find(rows, "cnn64", "pergrad median")
        if jac and pg:
            speedup = jac["ratio"] / pg["ratio"]
            out.append(
                f"- TF cnn64: pergrad median is {speedup:.1f}x faster than the jacobian median "
                f"recipe (goal >= 10x): {'MET' if speedup >= 10 else 'NOT MET'}"
            )
        pg = find(rows, "cnn64", "pergrad clip")
        if pg:
            out.append(
                f"- TF cnn64: pergrad clip is {pg['ratio']:.2f}x a plain step (goal <= 4x): "
                f"{'MET' if pg['ratio'] <= 4 else 'NOT MET'}"
            )
    for model in dict.fromkeys(row["model"] for row in rows):
        for aggregation in AGGREGATIONS:
            raw, pg = find(rows, model, f"vmap {aggregation}"), find(rows, model, f"pergrad {aggregation}")
            if raw and pg:
                ratio = pg["ratio"] / raw["ratio"]
                verdict = "MET" if ratio <= 1.0 else ("within noise (<10%)" if ratio <= 1.1 else "NOT MET")
                out.append(
                    f"- {model} {aggregation}: pergrad / raw vmap = {ratio:.2f} "
                    f"(goal <= 1): {verdict}"
                )
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: " + ",".join(QUICK_MODELS) + ", 2 rounds, short blocks")
    parser.add_argument("--models", default=None,
                        help="comma list of mlp<B>/cnn<B> (default " + ",".join(DEFAULT_MODELS) + ")")
    parser.add_argument("--aggregations", default=",".join(AGGREGATIONS))
    parser.add_argument("--recipes", default="jacobian,vmap,pergrad",
                        help="jacobian,vmap,pergrad (and proto: benchmarks/prototypes.py)")
    parser.add_argument("--variants", default=None,
                        help="explicit comma list of variants, e.g. 'plain,vmap clip,pergrad clip'")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 7, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling")
    parser.add_argument("--block-s", type=float, default=None,
                        help="target seconds per timed block (default 0.25, quick 0.05)")
    parser.add_argument("--max-block", type=int, default=50)
    parser.add_argument("--slow-factor", type=float, default=20.0)
    parser.add_argument("--slow-steps", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per backend (default 1: stable on a shared machine; "
                        "0 = the backends' own defaults)")
    parser.add_argument("--malloc-tuning", action="store_true",
                        help="diagnostic: keep freed memory in the process (glibc mallopt; starting "
                        "with MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 "
                        "is more thorough on JAX)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.models = (args.models or ",".join(QUICK_MODELS if quick else DEFAULT_MODELS)).split(",")
    args.aggregations = args.aggregations.split(",")
    args.recipes = args.recipes.split(",")
    if args.variants:
        args.variants = [v.strip() for v in args.variants.split(",")]
    elif quick:
        args.variants = list(QUICK_VARIANTS)
    if args.variants and "plain" not in args.variants:
        args.variants.insert(0, "plain")
    args.repeats = args.repeats or (2 if quick else 7)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.block_s = args.block_s or (0.05 if quick else 0.25)
    if quick:
        args.slow_steps = min(args.slow_steps, 1)
    for key in args.models:
        try:
            parse_model(key)
        except ValueError as error:
            parser.error(str(error))
    for a in args.aggregations:
        if a not in AGGREGATIONS:
            parser.error(f"unknown aggregation {a!r}; choose from {', '.join(AGGREGATIONS)}")

    def log(message):
        print(message, file=sys.stderr, flush=True)

    if args.threads and BACKEND == "torch":  # torch reads no environment variable for this
        torch.set_num_threads(args.threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(args.threads)
    if args.threads and BACKEND == "tensorflow":  # besides TF_NUM_*_THREADS, if still possible
        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
            tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    start = time.perf_counter()
    rows = []
    for key in args.models:
        log(f"{BACKEND}: {key} ...")
        rows.extend(bench_model(key, args, log))

    versions = f"keras {keras.__version__}"
    if BACKEND == "tensorflow":
        versions += f", tensorflow {tf.__version__}"
    elif BACKEND == "jax":
        versions += f", jax {jax.__version__}"
    else:
        versions += f", torch {torch.__version__}"
    options = [f"{os.cpu_count()} CPUs"]
    if args.threads:
        options.append(f"--threads {args.threads}")
    if args.malloc_tuning:
        options.append("--malloc-tuning")
    if quick:
        options.append("--quick")
    print(f"## {BACKEND} ({versions}; {platform.machine()}, {'; '.join(options)})\n")
    print(f"pergrad {pergrad.__version__} at {source_state()}.")
    print(f"Recipes: {describe_recipes()}.")
    if BACKEND == "tensorflow":
        print(f"TF train function jit_compile: {make_variant('plain', 'mlp').jit_compile} "
              "(Keras's default on this machine).")
    if BACKEND == "torch" and Recipe.needed_layout_workaround:
        print("The raw torch.vmap recipe raised keras#23587 ('NYI: ... inside vmap') on a "
              "Conv2D; it was rerun with pergrad's layout workaround (pergrad.backend.torch).")
    print(f"{args.repeats} interleaved rounds; time = median over rounds, x plain = median of "
          f"per-round ratios. † = slower than {args.slow_factor:g}x plain: timed one step per "
          f"round on at most {args.slow_steps} rounds. Page faults: minor faults of the "
          "process per step (first touches of freshly mapped memory).\n")
    print(table(rows, args))
    checks = goals(rows)
    if checks:
        print("\nGoals:\n" + checks)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=BACKEND, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
