#!/usr/bin/env python
"""Per-example-gradient training steps: pergrad against the usual recipes.

Run once per backend (the backend is chosen at import, one process each)::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/bench.py
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/bench.py --quick
    KERAS_BACKEND=torch      .venv/bin/python benchmarks/bench.py --models mlp64,cnn64 --repeats 9
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/bench.py --variants "plain,vmap clip,pergrad clip"
    KERAS_BACKEND=torch      .venv/bin/python benchmarks/bench.py --memory --models mlp256 \
        --variants "plain,pergrad clip,pergrad dp,opacus clip"
    KERAS_BACKEND=jax        .venv/bin/python benchmarks/bench.py --suite coordinate --memory \
        --json jax-coordinate.json

``benchmarks/table.py`` turns the ``--json`` files of the three backends into
the README's tables.

Models (random data, fixed seed, sparse categorical cross-entropy from logits,
SGD(0.01)); ``mlp<B>`` / ``cnn<B>`` / ``tfm<B>`` at any batch size B:

- ``mlp64`` / ``mlp256`` (default): MLP 784-256-256-10 at batch 64 / 256;
- ``cnn64`` (default): 28x28x1 -> Conv 3x3x16 relu -> Conv 3x3x32 relu ->
  MaxPool 2 -> Flatten -> Dense 10, at batch 64;
- ``tfm64`` (default): a one-block transformer classifier on token ids (B, 64)
  from a vocabulary of 1000: Embedding(1000, 64) + a learned position
  Embedding(64, 64) -> MultiHeadAttention(2 heads, key_dim 32) + residual ->
  LayerNormalization -> Dense(128, relu) -> Dense(64) + residual ->
  LayerNormalization -> GlobalAveragePooling1D -> Dense(10), at batch 64.
- ``gpt8`` (``--suite lm``): a GPT-2-style language model, keras-hub's
  ``GPT2CausalLM`` (``GPT2Backbone``, no preprocessor) from constructor arguments:
  vocabulary 8192, T = 128, hidden 64, 2 layers of 2 heads, MLP 256, no
  dropout; the LM head is the token embedding, tied (``ReversibleEmbedding``);
  per-token loss, at batch 8;
- ``lora8`` (``--suite lm``): the same model after ``backbone.enable_lora(4)``
  (only the LoRA factors of the query and value projections are trained).
  Both need keras-hub (a dev requirement); the hand-written recipes and Opacus
  have no rows for them.
  On TensorFlow the run sets ``TF_ENABLE_ONEDNN_OPTS=0`` (unless already set)
  whenever a ``tfm``, ``gpt`` or ``lora`` model is in it: TF 2.21's oneDNN
  kernels corrupt memory in the hand-written recipes' vectorized attention
  (README, Limitations; pergrad's own passes avoid it). The header says which.

``--quick`` (smoke test): ``mlp16``, ``cnn16`` and ``tfm8``, the variants plain,
vmap clip, pergrad median, pergrad clip and pergrad krum (and the Opacus pair
on torch), 2 rounds (others with ``--variants``).

Suites (``--suite``): ``default`` is the list above (the recipes x
``--aggregations``); ``lm`` is ``gpt8`` and ``lora8`` with plain, pergrad mean,
clip and dp, and pergrad-mat clip (``--quick``: ``gpt2`` and ``lora2``);
``coordinate`` is issue 10's coordinate rules on ``mlp64``, ``mlp256`` and
``cnn64`` (``--quick``: ``mlp16``, ``cnn16``): plain, jacobian median (the CNN
and MLPs up to B=64: on mlp256 it took 4-9 s per step),
pergrad-mat median, and pergrad median, trimmed, meamed, signs, bucketmedian,
clipmedian on the default path; with ``--memory`` only plain and the two median
rows are measured for memory (``--memory-variants`` chooses others).
``--models`` and ``--variants`` override a suite's choice.

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
  ``stateless_call``, torch ``torch.func.jacrev`` through ``stateless_call``
  (default list: ``jacobian clip`` only; ``jacobian median`` / ``mean`` on request);
- ``vmap <agg>``: a custom ``train_step`` vectorizing the single-example
  gradient: TF a hand-written ``tf.vectorized_map`` around a ``GradientTape``,
  JAX ``jax.vmap(jax.grad)`` through ``stateless_call``, torch
  ``torch.func.vmap(torch.func.grad)`` through ``stateless_call``;
- ``pergrad <agg>``: ``pergrad.PerExampleModel(model, agg)``: the default path
  (``path="auto"`` where the checkout's ``PerExampleModel`` has ``path=``: the
  statistics fast path for statistics rules; otherwise the materialized engine);
- ``pergrad-mat <agg>``: ``PerExampleModel(..., path="materialized")``, the
  materialized (vmap) engine beside the fast path, for the statistics rules
  (mean, clip, dp, krum, geomed, normfilter) and, in ``--suite coordinate``,
  the median (beside the streaming path). Only where ``path=`` exists
  (checked with ``inspect.signature``); ``pergrad-stats <agg>`` (not in the
  default list) forces ``path="statistics"``;
- ``opacus-plain`` and ``opacus clip`` (torch run, if ``opacus`` imports; MLP and
  CNN only): the same MLP / CNN written in ``torch.nn`` (NCHW), trained by a plain
  torch loop, and made private by Opacus ghost clipping
  (``PrivacyEngine().make_private(..., grad_sample_mode="ghost",
  noise_multiplier=0, max_grad_norm=1.0, poisson_sampling=False)``, the
  returned ``DPLossFastGradientClipping`` criterion: two backward passes). Their
  ``x plain`` is against the Keras plain step; the goals also give
  ``opacus clip / opacus-plain`` and compare absolute times with pergrad clip.
  Without Opacus the run says "opacus not installed" and has no such rows.
- ``tf-privacy-plain``, ``tf-privacy clip|dp`` (TensorFlow run) and ``jax-privacy clip|dp``,
  ``jax-privacy-mb1 clip|dp`` (JAX run): TF Privacy's fast gradient clipping (on
  ``tf_keras``) and jax-privacy's ``keras_api.make_private``, where installed
  (``make bench-peers``), each checked against pergrad clip before it is timed;
  see ``benchmarks/peers.py``. Without them, "skipped: ... not installed" rows.

Aggregations: ``mean``; ``median`` (coordinate-wise); ``clip`` = per-example
flat L2 clipping to 1.0 then the mean (``pergrad.aggregators.clip(1.0)``);
``dp`` = ``pergrad.privacy.dp_gaussian(1.0, 1.0)`` (clip to 1.0, sum, Gaussian
noise of std 1.0, divide by B); ``krum`` = ``krum(0.1)``; ``geomed`` =
``geometric_median()``; ``normfilter`` = ``norm_filter()`` (drops norms above 3x
the median); issue 10's coordinate rules ``trimmed`` = ``trimmed_mean(0.1)``,
``meamed`` = ``meamed(0.1)``, ``signs`` = ``sign_majority()``, ``bucketmedian`` =
``bucketing(8, median())``, ``clipmedian`` = ``chain(clip(1.0), median())`` (not
in the default ``--aggregations``). The jacobian and vmap recipes aggregate mean, median and clip with
hand-written ``keras.ops`` code doing the same thing; the other aggregations are
pergrad-only (a variant that does not apply is a "skipped: why" row).

Timing: variants are interleaved in rounds (the order rotates each round) so
that load on a shared machine hits all of them alike. Each round times a block
of steps per variant; the reported time is the median over rounds and the ratio
is the median over rounds of (variant / plain in the same round). Variants
slower than ``--slow-factor`` x plain (on one calibration step; two if under
1 s) are timed one step at a time on at most ``--slow-steps`` rounds (marked in
the table). The table also gives the minor page faults per step: on Linux, glibc serves every
block above its mmap threshold (32 MiB at most) with fresh pages, so a step
that builds large per-example tensors pays one fault per 4 KiB touched, which
is most of its time on some machines (``--malloc-tuning`` shows the
difference).

Memory (``--memory``, or ``--memory-only`` without the timing rounds): each
(model, variant) runs again in a fresh subprocess of this script, same backend
and options (``--memory-child``): the first step and 2 more, then its peak
resident set size. That is ``VmHWM`` from ``/proc/self/status`` on Linux (the
process's own peak; ``ru_maxrss`` would not do: ``execve`` carries the spawning
parent's peak into the child's) and ``ru_maxrss`` elsewhere. The table gives the
peak (framework included), its ratio to the plain step's peak, and the step's
share: the peak minus the peak after the imports and the data, before the
model is built. One subprocess costs the backend's import and compile time
(5-15 s), so ``--memory`` on the default list adds several minutes; narrow it
with ``--variants`` or ``--memory-variants`` (the variants measured for memory;
plain always).

Goals (printed under the table, issue 9 section 4; pergrad = the default
path): ``clip`` and ``dp`` <= 1.3x plain on the MLP and the CNN (stretch 1.1x on
the MLP), <= 1.5x on the transformer; ``krum``, ``geomed``, ``normfilter`` <=
1.5x on the MLP (stated at B=256); ``mean`` <= 1.1x everywhere; pergrad clip
faster than Opacus ghost clipping in absolute time (torch); peak memory of
clip / dp <= 1.2x plain's. Issue 10's, where the rows exist: ``pergrad
median`` <= 20x plain on the MLP and <= 2x on the CNN (stated at B=64);
``jacobian median`` >= 30x slower than ``pergrad median`` (stated on cnn64);
``pergrad bucketmedian`` <= 5x plain on the MLP (stated at B=256); the peak of
``pergrad median`` <= plain's peak + 2 x B x the model's largest trainable
variable x 4 bytes (the bound is computed from the model and printed with the
measured peak; ``pergrad-mat median`` is shown beside it). Then the default
path against the materialized one (``pergrad-mat``) for every rule with both
rows, and the earlier pergrad / raw vmap comparison.

The language models' goals (issue 17): clip and dp <= 1.5x plain on TensorFlow
and JAX, <= 2x on torch, and their peak memory <= 1.2x plain's, with no
``B x vocabulary x hidden`` tensor (the goals print that tensor's size beside
the step's share over plain's).

``--json FILE`` writes the rows (the plain row also carries the model's
``batch``, ``parameters`` and ``largest_variable``) with the header's facts
(``backend``, ``versions``, ``options``, ``source`` commit, ``suite``,
``repeats``), for ``benchmarks/table.py``.

``--replicas R`` (e.g. ``2`` or ``2,4``) runs ``benchmarks/replicas.py`` instead
(its options pass through; ``--threads`` does not apply): the communication per
step of each rule kind on R logical CPU devices (JAX ``DataParallel``,
TensorFlow ``MirroredStrategy``; both unless ``KERAS_BACKEND`` is set), measured
from the compiled program / traced graph, beside the formulas of
docs/architecture.md ('Communication per step').
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
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
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--malloc-tuning", action="store_true")
    parser.add_argument("--models", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--suite", default="default")
    parser.add_argument("--memory-child", nargs=2, default=None)
    parser.add_argument("--replicas", default=None)
    return parser.parse_known_args(argv)[0]


def disable_onednn_for_attention(options):
    """TensorFlow: oneDNN off (unless the user set it) when a transformer is benchmarked.

    TF 2.21's oneDNN matmul corrupts memory on the products that a vectorized map
    makes of a sequence model's kernels (README, Limitations); pergrad converts
    them in a form oneDNN computes correctly, the hand-written ``jacobian`` and
    ``vmap`` recipes do not, and the process aborts. It must be decided before
    TensorFlow is imported.
    """
    if options.memory_child:
        models = [options.memory_child[0]]
    elif options.models:
        models = options.models.split(",")
    else:
        models = suite_models(options.suite, options.quick)
    if any(m.strip().startswith(("tfm", "gpt", "lora")) for m in models):
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


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


DEFAULT_MODELS = ("mlp64", "mlp256", "cnn64", "tfm64")
QUICK_MODELS = ("mlp16", "cnn16", "tfm8")
#: ``--suite coordinate``: issue 10's coordinate rules (quick: the second tuple)
COORDINATE_MODELS = ("mlp64", "mlp256", "cnn64")
COORDINATE_QUICK_MODELS = ("mlp16", "cnn16")
#: ``--suite lm``: issue 17's language models (keras-hub)
LM_MODELS = ("gpt8", "lora8")
LM_QUICK_MODELS = ("gpt2", "lora2")
SUITES = ("default", "coordinate", "lm")


def suite_models(suite: str, quick: bool) -> tuple[str, ...]:
    """The models a run takes when ``--models`` is not given."""
    if suite == "coordinate":
        return COORDINATE_QUICK_MODELS if quick else COORDINATE_MODELS
    if suite == "lm":
        return LM_QUICK_MODELS if quick else LM_MODELS
    return QUICK_MODELS if quick else DEFAULT_MODELS

PROCESS = process_options() if __name__ == "__main__" else process_options([])
if PROCESS.replicas:  # communication per step on R logical devices: benchmarks/replicas.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import replicas

    sys.exit(replicas.main(sys.argv[1:]))
limit_threads(PROCESS.threads)
disable_onednn_for_attention(PROCESS)
if PROCESS.malloc_tuning:
    tune_malloc()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (TF Privacy and jax-privacy rows, benchmarks/peers.py)

peers.before_backend_import()  # TF Privacy's tf.keras must be tf_keras

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

QUICK_VARIANTS = ("plain", "vmap clip", "pergrad median", "pergrad clip", "pergrad krum")
QUICK_OPACUS = ("opacus clip", "opacus-plain")


def parse_model(key: str):
    """``"mlp64"`` -> ``("mlp", 64)``: the architecture and the batch size."""
    match = re.fullmatch(r"(mlp|cnn|tfm|gpt|lora)(\d+)", key)
    if not match:
        raise ValueError(
            f"unknown model {key!r}: use mlp<batch>, cnn<batch>, tfm<batch>, gpt<batch> or "
            "lora<batch>, e.g. mlp64, tfm64, gpt8"
        )
    return match.group(1), int(match.group(2))


#: aggregations of the rows; the recipes implement only RECIPE_AGGREGATE's
AGGREGATIONS = ("mean", "median", "clip", "dp", "krum", "geomed", "normfilter", "trimmed",
                "meamed", "signs", "bucketmedian", "clipmedian")
#: the default ``--aggregations`` (the default suite's rows)
DEFAULT_AGGREGATIONS = ("mean", "median", "clip", "dp", "krum", "geomed", "normfilter")
#: the statistics rules: the ones with a fast path, shown again as ``pergrad-mat``
STATISTICS_AGGREGATIONS = ("mean", "clip", "dp", "krum", "geomed", "normfilter")
#: the coordinate rules of issue 10 (and the compositions ending in one)
COORDINATE_AGGREGATIONS = ("median", "trimmed", "meamed", "signs", "bucketmedian", "clipmedian")
TRIM = 0.1  # trimmed_mean(TRIM), meamed(TRIM)
BUCKET_SIZE = 8  # bucketing(BUCKET_SIZE, median())
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
KRUM_BYZANTINE = 0.1
SEED = 0
LEARNING_RATE = 0.01
# the transformer classifier
VOCAB, SEQUENCE, WIDTH, HEADS, KEY_DIM, FFN, CLASSES = 1000, 64, 64, 2, 32, 128, 10
# the GPT-2-style language model (keras-hub) and its LoRA variant
LM_KINDS = ("gpt", "lora")
LM_VOCAB, LM_SEQUENCE, LM_WIDTH, LM_LAYERS, LM_HEADS, LM_FFN, LORA_RANK = 8192, 128, 64, 2, 2, 256, 4
#: ``--suite lm``'s rows: the aggregations the language models' goals are about
LM_VARIANTS = ("plain", "pergrad mean", "pergrad clip", "pergrad dp", "pergrad-mat clip")

#: whether this checkout's PerExampleModel can be told which engine path to take
HAS_PATH = "path" in inspect.signature(pergrad.PerExampleModel.__init__).parameters

# --------------------------------------------------------------------------------------
# models and data


def build_model(kind: str) -> keras.Model:
    keras.utils.set_random_seed(SEED)  # every variant starts from the same weights
    if kind == "tfm":
        return build_transformer()
    if kind in LM_KINDS:
        return build_language_model(lora=kind == "lora")
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


def build_transformer() -> keras.Model:
    """A one-block transformer classifier on token ids (B, 64), post-LayerNorm.

    The learned position embedding is an ``Embedding(64, 64)`` of the position
    ids, built inside the graph from the token ids' shape (no custom layer).
    """
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    positions = ops.zeros_like(tokens) + ops.arange(SEQUENCE, dtype="int32")[None, :]
    h = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")(tokens)
    h = h + keras.layers.Embedding(SEQUENCE, WIDTH, name="positions")(positions)
    attended = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm1")(h + attended)
    f = keras.layers.Dense(FFN, activation="relu", name="ffn1")(h)
    f = keras.layers.Dense(WIDTH, name="ffn2")(f)
    h = keras.layers.LayerNormalization(name="norm2")(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    logits = keras.layers.Dense(CLASSES, name="logits")(h)
    return keras.Model(tokens, logits, name="tfm")


def build_language_model(lora: bool) -> keras.Model:
    """keras-hub's GPT-2 causal LM (its head the tied token embedding), from constructor
    arguments; with ``lora``, ``backbone.enable_lora(LORA_RANK)``."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=LM_VOCAB, num_layers=LM_LAYERS, num_heads=LM_HEADS, hidden_dim=LM_WIDTH,
        intermediate_dim=LM_FFN, max_sequence_length=LM_SEQUENCE, dropout=0.0,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None,
                                          name="lora" if lora else "gpt")
    if lora:
        backbone.enable_lora(LORA_RANK)
    return model


def make_data(kind: str, batch_size: int):
    rng = np.random.default_rng(SEED)
    if kind in LM_KINDS:  # next-token prediction on random tokens
        tokens = rng.integers(0, LM_VOCAB, size=(batch_size, LM_SEQUENCE + 1)).astype("int32")
        x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch_size, LM_SEQUENCE), "int32")}
        return keras.tree.map_structure(ops.convert_to_tensor, x), ops.convert_to_tensor(tokens[:, 1:])
    if kind == "tfm":
        x = rng.integers(0, VOCAB, size=(batch_size, SEQUENCE)).astype("int32")
    else:
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
    """The pergrad aggregator of a row's aggregation name."""
    if name == "clip":
        return pergrad.aggregators.clip(CLIP_NORM)
    if name == "dp":
        return pergrad.privacy.dp_gaussian(CLIP_NORM, NOISE_MULTIPLIER)
    if name == "krum":
        return pergrad.aggregators.krum(KRUM_BYZANTINE)
    if name == "geomed":
        return pergrad.aggregators.geometric_median()
    if name == "normfilter":
        return pergrad.aggregators.norm_filter()  # factor=3 x the median norm
    if name == "trimmed":
        return pergrad.aggregators.trimmed_mean(TRIM)
    if name == "meamed":
        return pergrad.aggregators.meamed(TRIM)
    if name == "signs":
        return pergrad.aggregators.sign_majority()
    if name == "bucketmedian":
        return pergrad.aggregators.bucketing(BUCKET_SIZE, pergrad.aggregators.median())
    if name == "clipmedian":
        return pergrad.aggregators.chain(
            pergrad.aggregators.clip(CLIP_NORM), pergrad.aggregators.median()
        )
    return name


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


opacus = None  # torch only, imported below

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

    try:  # the optional Opacus anchor (pip install opacus)
        import opacus
    except ImportError:
        opacus = None

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
            from pergrad.backend.torch import _VmapWorkarounds  # answers vmap's layout requests

            return _VmapWorkarounds()


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


class TorchStepper:
    """The Opacus anchor: a torch-native model, trained by a plain torch loop
    (``opacus-plain``) or made private with Opacus ghost clipping (``opacus clip``:
    ``grad_sample_mode="ghost"``, flat clipping to ``CLIP_NORM``, noise 0, mean
    loss reduction, the fixed batch instead of Poisson sampling). Same interface
    as :class:`Stepper`."""

    def __init__(self, kind, x, y, private: bool):
        torch.manual_seed(SEED)
        nn = torch.nn
        if kind == "mlp":
            net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                nn.Linear(256, 10))
        else:  # NCHW: Conv 3x3x16 relu, Conv 3x3x32 relu, MaxPool 2, Flatten, Dense 10
            net = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                                nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 12 * 12, 10))
            x = x.permute(0, 3, 1, 2).contiguous()
        self.x, self.y = x.detach(), y.detach().long()
        optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
        criterion = nn.CrossEntropyLoss()
        if private:
            loader = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(self.x, self.y), batch_size=len(self.x)
            )
            net, optimizer, criterion, _ = opacus.PrivacyEngine(accountant="rdp").make_private(
                module=net, optimizer=optimizer, criterion=criterion, data_loader=loader,
                noise_multiplier=0.0, max_grad_norm=CLIP_NORM, poisson_sampling=False,
                grad_sample_mode="ghost",
            )
        net.train()
        # Opacus's hooks on the first layer (whose input needs no gradient): harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.net, self.optimizer, self.criterion = net, optimizer, criterion
        start = time.perf_counter()
        self._step()
        self.first_step_s = time.perf_counter() - start

    def _step(self):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.criterion(self.net(self.x), self.y)
        loss.backward()  # Opacus ghost: two backward passes (norms, then clipped sum)
        self.optimizer.step()

    def run(self, steps: int) -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(steps):
            self._step()
        seconds = time.perf_counter() - start
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def close(self):
        pass


class Skipped(Exception):
    """A variant that does not apply to this model or checkout (a row saying why)."""


#: recipes whose train step aggregates with RECIPE_AGGREGATE (hand-written keras.ops)
HAND_AGGREGATED = ("jacobian", "vmap")
#: the Opacus anchor: torch-native equivalents of these model kinds only
OPACUS_KINDS = ("mlp", "cnn")


def split_variant(name: str) -> tuple[str, str]:
    """``"pergrad clip"`` -> ``("pergrad", "clip")``; ``"plain"`` -> ``("plain", "")``."""
    recipe, _, aggregation = name.partition(" ")
    return recipe, aggregation


def unsupported(name: str, kind: str) -> str | None:
    """Why variant ``name`` cannot run on a ``kind`` model here, or None."""
    recipe, aggregation = split_variant(name)
    if recipe in peers.RECIPES:
        return peers.unsupported(recipe, aggregation, BACKEND)
    if recipe in ("opacus", "opacus-plain"):
        if BACKEND != "torch":
            return "Opacus rows run in the torch run only"
        if opacus is None:
            return "opacus not installed"
        if kind not in OPACUS_KINDS:
            return f"no torch-native {kind} model for Opacus (MLP and CNN only)"
        if recipe == "opacus" and aggregation != "clip":
            return "Opacus rows: clip only"
        return None
    if recipe == "plain":
        return None
    if aggregation not in AGGREGATIONS:
        return f"unknown aggregation {aggregation!r}"
    if recipe in HAND_AGGREGATED and aggregation not in RECIPE_AGGREGATE:
        return f"no {recipe} recipe for {aggregation}"
    if recipe in HAND_AGGREGATED and kind in LM_KINDS:
        return f"the {recipe} recipe is written for one label per example"
    if recipe in ("pergrad-mat", "pergrad-stats") and not HAS_PATH:
        return "this checkout's PerExampleModel has no path= argument"
    if recipe not in HAND_AGGREGATED + ("pergrad", "pergrad-mat", "pergrad-stats"):
        return f"unknown recipe {recipe!r}"
    return None


def make_variant(name: str, kind: str):
    inner = build_model(kind)
    if name == "plain":
        model = inner
    else:
        recipe, aggregation = split_variant(name)
        if recipe in ("pergrad", "pergrad-mat", "pergrad-stats"):
            # path= only where this checkout has it: "auto" picks the statistics
            # path for statistics rules; the materialized engine is the reference
            path = {"pergrad": "auto", "pergrad-mat": "materialized", "pergrad-stats": "statistics"}
            kwargs = {"path": path[recipe]} if HAS_PATH else {}
            model = pergrad.PerExampleModel(inner, pergrad_aggregator(aggregation), **kwargs)
        else:
            model = Recipe(inner, recipe, aggregation)
    model.compile(optimizer=new_optimizer(), loss=new_loss())
    return model


def make_stepper(name: str, kind: str, x, y):
    """A built, compiled, once-stepped variant; raises :class:`Skipped` where it does not apply."""
    reason = unsupported(name, kind)
    if reason:
        raise Skipped(reason)
    recipe, aggregation = split_variant(name)
    if recipe in ("opacus", "opacus-plain"):
        return TorchStepper(kind, x, y, private=recipe == "opacus")
    if recipe in peers.RECIPES:  # checked against pergrad clip first (not in memory children)
        return peers.make_stepper(recipe, aggregation, kind, x, y, sys.modules[__name__],
                                  checked=not PROCESS.memory_child)
    return Stepper(make_variant(name, kind), x, y)


def default_recipes() -> list[str]:
    recipes = ["jacobian", "vmap", "pergrad"]
    if HAS_PATH:
        recipes.append("pergrad-mat")
    if BACKEND == "torch" and opacus is not None:
        recipes.append("opacus")
    return recipes + peers.recipes_for(BACKEND)


def variant_names(selected_aggregations, recipes, kind):
    """The default rows of a ``kind`` model: every recipe x aggregation that applies."""
    names = ["plain"]
    for recipe in recipes:
        if recipe == "opacus":
            if "clip" in selected_aggregations and not unsupported("opacus clip", kind):
                names += ["opacus-plain", "opacus clip"]
            continue
        if recipe in peers.RECIPES:  # a peer not installed: a "skipped: not installed" row
            names += [n for n in peers.variant_names(recipe, selected_aggregations)
                      if not unsupported(n, kind) or not peers.installed(recipe)]
            continue
        for aggregation in selected_aggregations:
            if recipe == "jacobian" and aggregation != "clip":
                # the jacobian costs ~B backward passes whatever follows; its median
                # row took minutes per backend (ask for it with --variants)
                continue
            if recipe == "pergrad-mat" and aggregation not in STATISTICS_AGGREGATIONS:
                continue  # the coordinate rules' materialized rows: --suite coordinate
            name = f"{recipe} {aggregation}"
            if not unsupported(name, kind):
                names.append(name)
    return names


#: the largest MLP batch with a ``jacobian median`` row in ``--suite coordinate``: that row
#: took 0.6-1.6 s per step on mlp64 and 4.4-9.3 s on mlp256 (2-core machine, today's code)
COORDINATE_JACOBIAN_MLP_BATCH = 64
#: ``--suite coordinate --memory``: the variants measured for memory (plus plain)
COORDINATE_MEMORY_VARIANTS = ("plain", "pergrad-mat median", "pergrad median")


def coordinate_variants(key: str) -> list[str]:
    """``--suite coordinate``: issue 10's rows of model ``key``.

    The plain step, the jacobian median recipe (the CNN, and MLPs up to
    ``COORDINATE_JACOBIAN_MLP_BATCH``), the materialized median beside the
    default path's, and every coordinate rule on the default path.
    """
    kind, batch_size = parse_model(key)
    names = ["plain"]
    if kind != "mlp" or batch_size <= COORDINATE_JACOBIAN_MLP_BATCH:
        names.append("jacobian median")
    if HAS_PATH:
        names.append("pergrad-mat median")
    return names + [f"pergrad {a}" for a in COORDINATE_AGGREGATIONS]


def model_sizes(key: str) -> dict:
    """The batch size, parameter count and largest trainable variable (elements) of ``key``."""
    kind, batch_size = parse_model(key)
    sizes = [int(np.prod(v.shape)) for v in build_model(kind).trainable_variables]
    return dict(batch=batch_size, parameters=sum(sizes), largest_variable=max(sizes))


MEMORY_STEPS = 2  # steps after the first (compiling) one in a memory subprocess


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


def memory_child(key: str, name: str) -> None:
    """``--memory-child KEY NAME``: one variant's peak memory, as a JSON line on stdout.

    ``baseline_kib`` is the peak RSS after the imports and the data (before the
    model is built), ``peak_kib`` the peak after the first step and
    ``MEMORY_STEPS`` more (:func:`peak_rss_kib`: the process's, framework included).
    """
    configure_threads(PROCESS.threads)
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
    import subprocess

    command = [sys.executable, os.path.abspath(__file__), "--memory-child", key, name,
               "--threads", str(args.threads)]
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


def bench_model(key, args, log):
    kind, batch_size = parse_model(key)
    x, y = make_data(kind, batch_size)
    if args.variants:
        names = args.variants
    elif args.suite == "coordinate":
        names = coordinate_variants(key)
    elif kind in LM_KINDS:
        names = [name for name in LM_VARIANTS if not unsupported(name, kind)]
    else:
        names = variant_names(args.aggregations, args.recipes, kind)
    if "plain" not in names:
        names.insert(0, "plain")
    if args.memory_variants:  # plain always: the peaks' reference
        measured = [n for n in names if n == "plain" or n in args.memory_variants]
        names = measured if args.memory_only else names
    else:
        measured = names
    memory = {}
    if args.memory:
        for name in measured:
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
        samples, block, slow = {}, {}, set()
    else:
        if "plain" not in steppers:
            raise RuntimeError(f"plain step failed on {key}: {failures.get('plain')}")
        samples, faults, block, slow = time_steppers(key, steppers, args, log)

    rows = []
    plain = samples.get("plain", {})
    plain_peak = memory.get("plain", {}).get("peak_kib")
    for name in names:
        row = dict(model=key, variant=name)
        if name == "plain":  # for the memory bound of issue 10 (peak <= plain + 2 B x largest)
            row.update(model_sizes(key))
        if name in skipped:
            row["skipped"] = skipped[name]
        elif name in failures:
            row["failed"] = failures[name]
        elif name in samples:
            times = samples[name]
            ratios = [t / plain[r] for r, t in times.items() if r in plain]
            row.update(
                ms=1e3 * statistics.median(times.values()),
                ratio=statistics.median(ratios),
                steps=sum(block[name] for _ in times),
                slow=name in slow,
                first_step_s=steppers[name].first_step_s,
                faults=statistics.median(faults[name]),
            )
            own = OWN_PLAIN.get(name)
            if own in samples:  # e.g. opacus clip / opacus-plain, round by round
                own_times = samples[own]
                row["ratio_own"] = statistics.median(
                    t / own_times[r] for r, t in times.items() if r in own_times
                )
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


#: variants whose own baseline is not the Keras plain step
OWN_PLAIN = {"opacus clip": "opacus-plain", **peers.OWN_PLAIN}


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


#: read when the code was imported: a commit made while the benchmark runs is not the code it timed
SOURCE_STATE = source_state()


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
    timing, memory = not args.memory_only, args.memory
    header, align = ["model", "variant"], ["---", "---"]
    if timing:
        header += ["ms/step (median)", "x plain", "steps timed", "page faults/step", "first step s"]
        align += ["---:"] * 5
    if memory:
        header += ["peak MiB", "x plain peak", "step MiB"]
        align += ["---:"] * 3
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        cells = [row["model"], row["variant"] + (" †" if row.get("slow") else "")]
        note = row.get("skipped") and f"skipped: {row['skipped']}"
        note = note or (row.get("failed") and f"failed: {row['failed']}")
        if timing:
            if "ms" in row:
                cells += [f"{row['ms']:.2f}", f"{row['ratio']:.2f}", str(row["steps"]),
                          f"{row['faults']:.0f}", f"{row['first_step_s']:.1f}"]
            else:
                cells += [note or "", "", "", "", ""]
        if memory:
            if "peak_mib" in row:
                ratio = f"{row['peak_ratio']:.2f}" if "peak_ratio" in row else ""
                cells += [f"{row['peak_mib']:.0f}", ratio, f"{row['step_mib']:.0f}"]
            else:
                cells += [("" if timing and note else note) or row.get("memory_failed", ""), "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def find(rows, model, variant, field="ratio"):
    for row in rows:
        if row["model"] == model and row["variant"] == variant and field in row:
            return row
    return None


#: issue 9 section 4: the largest ratio to a plain Keras step, per model kind
STATISTICS_GOALS = {"mlp": 1.3, "cnn": 1.3, "tfm": 1.5}
#: issue 17: the language models' largest clip / dp ratio, per backend
LM_GOALS = {"tensorflow": 1.5, "jax": 1.5, "torch": 2.0}
ROBUST_GOAL = 1.5  # krum, geomed, normfilter on the MLP (stated at B=256)
MEAN_GOAL = 1.1
MEMORY_GOAL = 1.2  # peak of clip / dp over the plain step's peak
#: issue 10: the largest ratio of ``pergrad median`` to a plain step, per model kind (B=64)
MEDIAN_GOALS = {"mlp": 20.0, "cnn": 2.0}
JACOBIAN_MEDIAN_GOAL = 30.0  # jacobian median / pergrad median on the CNN at B=64, at least
BUCKETING_GOAL = 5.0  # bucketing(8, median) on the MLP (stated at B=256), at most
MEDIAN_MEMORY_COPIES = 2  # peak of median <= plain peak + 2 x B x largest variable x 4 bytes


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def goals(rows):
    """Issue 9 section 4's goals, checked on the rows (pergrad = the default path)."""
    out = []
    models = list(dict.fromkeys(row["model"] for row in rows))
    for model in models:
        kind, batch_size = parse_model(model)
        limit = LM_GOALS[BACKEND] if kind in LM_KINDS else STATISTICS_GOALS[kind]
        for aggregation in ("clip", "dp"):
            pg = find(rows, model, f"pergrad {aggregation}")
            if pg:
                stretch = " (stretch 1.1x: met)" if kind == "mlp" and pg["ratio"] <= 1.1 else ""
                out.append(f"- {model} pergrad {aggregation}: {pg['ratio']:.2f}x plain (goal <= "
                           f"{limit}x): {verdict(pg['ratio'] <= limit)}{stretch}")
        if kind == "mlp":
            for aggregation in ("krum", "geomed", "normfilter"):
                pg = find(rows, model, f"pergrad {aggregation}")
                if pg:
                    out.append(f"- {model} pergrad {aggregation}: {pg['ratio']:.2f}x plain (goal "
                               f"<= {ROBUST_GOAL}x, stated at B=256): "
                               f"{verdict(pg['ratio'] <= ROBUST_GOAL)}")
        pg = find(rows, model, "pergrad mean")
        if pg:
            out.append(f"- {model} pergrad mean: {pg['ratio']:.2f}x plain (goal <= {MEAN_GOAL}x): "
                       f"{verdict(pg['ratio'] <= MEAN_GOAL)}")
        pg, op = find(rows, model, "pergrad clip"), find(rows, model, "opacus clip")
        if pg and op:
            own = f", {op['ratio_own']:.2f}x opacus-plain" if "ratio_own" in op else ""
            out.append(f"- {model} pergrad clip {pg['ms']:.2f} ms vs Opacus ghost clipping "
                       f"{op['ms']:.2f} ms{own} (goal: pergrad faster): "
                       f"{verdict(pg['ms'] < op['ms'])}")
        for aggregation in ("clip", "dp"):
            pg = find(rows, model, f"pergrad {aggregation}", "peak_ratio")
            plain = find(rows, model, "plain", "step_mib")
            if pg and plain:
                out.append(f"- {model} pergrad {aggregation} peak memory: {pg['peak_ratio']:.2f}x "
                           f"plain's (goal <= {MEMORY_GOAL}x): {verdict(pg['peak_ratio'] <= MEMORY_GOAL)}"
                           f"; the step's share {pg['step_mib']:.0f} MiB vs plain's "
                           f"{plain['step_mib']:.0f} MiB")
                if kind == "gpt":  # the tensor the tied head's statistics must not form
                    table_mib = batch_size * LM_VOCAB * LM_WIDTH * 4 / 2**20
                    out.append(f"  (B x vocabulary x hidden float32 = {table_mib:.0f} MiB; the step "
                               f"takes {pg['step_mib'] - plain['step_mib']:.0f} MiB more than plain's)")
    out += peers.goal_lines(rows, find)
    out += coordinate_goals(rows, models)
    # the default path against the materialized engine (where path= exists)
    for model in models:
        for aggregation in STATISTICS_AGGREGATIONS + COORDINATE_AGGREGATIONS:
            pg = find(rows, model, f"pergrad {aggregation}")
            mat = find(rows, model, f"pergrad-mat {aggregation}")
            if pg and mat:
                out.append(f"- {model} {aggregation}: default path {pg['ms']:.2f} ms, materialized "
                           f"{mat['ms']:.2f} ms (materialized / default = {mat['ms'] / pg['ms']:.2f})")
    # earlier goals, still informative: pergrad against the raw vmap recipe
    for model in models:
        for aggregation in RECIPE_AGGREGATE:
            raw, pg = find(rows, model, f"vmap {aggregation}"), find(rows, model, f"pergrad {aggregation}")
            if raw and pg:
                ratio = pg["ratio"] / raw["ratio"]
                check = "MET" if ratio <= 1.0 else ("within noise (<10%)" if ratio <= 1.1 else "NOT MET")
                out.append(f"- {model} {aggregation}: pergrad / raw vmap = {ratio:.2f} "
                           f"(earlier goal <= 1): {check}")
    return "\n".join(out)


def median_memory_bound_mib(plain) -> float:
    """Issue 10's bound on the peak of ``median``: plain's peak + 2 x B x largest variable floats."""
    extra = MEDIAN_MEMORY_COPIES * plain["batch"] * plain["largest_variable"] * 4
    return plain["peak_mib"] + extra / 2**20


def coordinate_goals(rows, models) -> list[str]:
    """Issue 10's goals (pergrad = the default path), on the models whose rows exist."""
    out = []
    for model in models:
        kind, batch_size = parse_model(model)
        pg = find(rows, model, "pergrad median")
        if pg and kind in MEDIAN_GOALS:
            limit = MEDIAN_GOALS[kind]
            stated = "" if batch_size == 64 else ", stated at B=64"
            out.append(f"- {model} pergrad median: {pg['ratio']:.2f}x plain (goal <= {limit:g}x"
                       f"{stated}): {verdict(pg['ratio'] <= limit)}")
        jac = find(rows, model, "jacobian median")
        if pg and jac:
            speedup = jac["ms"] / pg["ms"]
            goal = (f"(goal >= {JACOBIAN_MEDIAN_GOAL:g}x"
                    + ("" if kind == "cnn" and batch_size == 64 else ", stated on cnn64") + ")")
            out.append(f"- {model} jacobian median {jac['ms']:.1f} ms / pergrad median "
                       f"{pg['ms']:.1f} ms = {speedup:.1f}x {goal}: "
                       f"{verdict(speedup >= JACOBIAN_MEDIAN_GOAL)}")
        bucket = find(rows, model, "pergrad bucketmedian")
        if bucket and kind == "mlp":
            stated = "" if batch_size == 256 else ", stated at B=256"
            out.append(f"- {model} pergrad bucketing({BUCKET_SIZE}, median): "
                       f"{bucket['ratio']:.2f}x plain (goal <= {BUCKETING_GOAL:g}x{stated}): "
                       f"{verdict(bucket['ratio'] <= BUCKETING_GOAL)}")
        plain = find(rows, model, "plain", "peak_mib")
        if plain and "largest_variable" in plain:
            bound = median_memory_bound_mib(plain)
            for variant in ("pergrad median", "pergrad-mat median"):
                row = find(rows, model, variant, "peak_mib")
                if row is None:
                    continue
                check = (f" (goal: <= plain {plain['peak_mib']:.0f} MiB + "
                         f"{MEDIAN_MEMORY_COPIES} x B={plain['batch']} x largest variable "
                         f"{plain['largest_variable']:,} x 4 B = {bound:.0f} MiB): "
                         f"{verdict(row['peak_mib'] <= bound)}")
                if variant != "pergrad median":
                    check = f" (the materialized path, for comparison; bound {bound:.0f} MiB)"
                out.append(f"- {model} {variant} peak memory: {row['peak_mib']:.0f} MiB{check}")
    return out


def configure_threads(threads: int) -> None:
    """The thread counts that must be set through the backends' APIs."""
    if threads and BACKEND == "torch":  # torch reads no environment variable for this
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    if threads and BACKEND == "tensorflow":  # besides TF_NUM_*_THREADS, if still possible
        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: " + ",".join(QUICK_MODELS) + ", 2 rounds, short blocks")
    parser.add_argument("--suite", choices=SUITES, default="default",
                        help="default: the recipes x --aggregations on " + ",".join(DEFAULT_MODELS)
                        + "; coordinate: issue 10's coordinate rules (plain, jacobian median, "
                        "pergrad-mat median, pergrad " + "/".join(COORDINATE_AGGREGATIONS)
                        + ") on " + ",".join(COORDINATE_MODELS) + " (quick: "
                        + ",".join(COORDINATE_QUICK_MODELS) + "); lm: issue 17's language models "
                        + ",".join(LM_MODELS) + " (keras-hub; quick: " + ",".join(LM_QUICK_MODELS) + ")")
    parser.add_argument("--models", default=None,
                        help="comma list of mlp<B>/cnn<B>/tfm<B>/gpt<B>/lora<B> (default: the suite's)")
    parser.add_argument("--aggregations", default=",".join(DEFAULT_AGGREGATIONS),
                        help="the default suite's aggregations (default %(default)s; also "
                        + ",".join(a for a in AGGREGATIONS if a not in DEFAULT_AGGREGATIONS) + ")")
    parser.add_argument("--recipes", default=",".join(default_recipes()),
                        help="jacobian, vmap, pergrad, pergrad-mat and pergrad-stats (where "
                        "PerExampleModel has path=), opacus (torch, if installed), tf-privacy and "
                        "tf-privacy-plain (TensorFlow), jax-privacy and jax-privacy-mb1 (JAX; "
                        "benchmarks/peers.py, if installed) (default %(default)s)")
    parser.add_argument("--variants", default=None,
                        help="explicit comma list of variants, e.g. 'plain,vmap clip,pergrad clip'")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 7, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling")
    parser.add_argument("--block-s", type=float, default=None,
                        help="target seconds per timed block (default 0.25, quick 0.05)")
    parser.add_argument("--max-block", type=int, default=50)
    parser.add_argument("--slow-factor", type=float, default=20.0)
    parser.add_argument("--slow-steps", type=int, default=3)
    parser.add_argument("--memory", action="store_true",
                        help="also measure each variant's peak RSS in a fresh subprocess "
                        f"(first step + {MEMORY_STEPS} steps)")
    parser.add_argument("--memory-only", action="store_true",
                        help="--memory without the timing rounds")
    parser.add_argument("--memory-variants", default=None,
                        help="comma list: measure memory for these variants only (plain always; "
                        "default all, --suite coordinate: " + ",".join(COORDINATE_MEMORY_VARIANTS)
                        + ")")
    parser.add_argument("--memory-timeout", type=float, default=600.0,
                        help="seconds allowed per memory subprocess")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--replicas", default=None,  # handled before the backend's import
                        help="R or a list (2,4): communication per step on R logical CPU "
                        "devices instead (benchmarks/replicas.py --help)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per backend (default 1: stable on a shared machine; "
                        "0 = the backends' own defaults)")
    parser.add_argument("--malloc-tuning", action="store_true",
                        help="diagnostic: keep freed memory in the process (glibc mallopt; starting "
                        "with MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 "
                        "is more thorough on JAX)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.memory = args.memory or args.memory_only
    args.models = (args.models or ",".join(suite_models(args.suite, quick))).split(",")
    args.aggregations = args.aggregations.split(",")
    args.recipes = args.recipes.split(",")
    if args.memory_variants:
        args.memory_variants = [v.strip() for v in args.memory_variants.split(",")]
    elif args.suite == "coordinate":
        args.memory_variants = list(COORDINATE_MEMORY_VARIANTS)
    if args.variants:
        args.variants = [v.strip() for v in args.variants.split(",")]
    elif quick and args.suite == "default":
        args.variants = list(QUICK_VARIANTS)
        if BACKEND == "torch" and opacus is not None:
            args.variants += QUICK_OPACUS
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

    if BACKEND == "torch" and opacus is None:
        log("opacus not installed: no Opacus rows (pip install opacus to add them)")
    configure_threads(args.threads)
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
        versions += f", opacus {opacus.__version__}" if opacus else ", opacus not installed"
    versions += peers.versions(BACKEND)
    options = [f"{os.cpu_count()} CPUs"]
    if args.threads:
        options.append(f"--threads {args.threads}")
    if args.malloc_tuning:
        options.append("--malloc-tuning")
    if quick:
        options.append("--quick")
    if args.suite != "default":
        options.append(f"--suite {args.suite}")
    if BACKEND == "tensorflow":
        onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "TF's default")
        options.append(f"TF_ENABLE_ONEDNN_OPTS={onednn}")
    print(f"## {BACKEND} ({versions}; {platform.machine()}, {'; '.join(options)})\n")
    print(f"pergrad {pergrad.__version__} at {SOURCE_STATE}.")
    if HAS_PATH:
        print("pergrad <agg> = PerExampleModel(..., path=\"auto\") (the statistics path for "
              "statistics rules); pergrad-mat <agg> = path=\"materialized\" (the vmap engine).")
    else:
        print("pergrad <agg> = PerExampleModel(model, agg): this checkout has no path= "
              "argument (the materialized engine only).")
    print(f"Aggregations: clip = clip({CLIP_NORM:g}); dp = privacy.dp_gaussian({CLIP_NORM:g}, "
          f"{NOISE_MULTIPLIER:g}); krum = krum({KRUM_BYZANTINE:g}); geomed = geometric_median(); "
          "normfilter = norm_filter() (factor 3); "
          f"trimmed = trimmed_mean({TRIM:g}); meamed = meamed({TRIM:g}); signs = sign_majority(); "
          f"bucketmedian = bucketing({BUCKET_SIZE}, median()); clipmedian = "
          f"chain(clip({CLIP_NORM:g}), median()).")
    print(f"Recipes: {describe_recipes()}.")
    if BACKEND == "torch":
        print("Opacus: " + (
            f"opacus {opacus.__version__}, torch-native MLP/CNN: opacus-plain = a plain torch "
            "loop; opacus clip = make_private(grad_sample_mode=\"ghost\", noise_multiplier=0, "
            f"max_grad_norm={CLIP_NORM:g}, poisson_sampling=False); its x plain is against the "
            "Keras plain step (the goals also give it against opacus-plain)."
            if opacus else "not installed (no Opacus rows)."))
    if peers.describe(BACKEND):
        print(peers.describe(BACKEND))
    if BACKEND == "tensorflow":
        print(f"TF train function jit_compile: {make_variant('plain', 'mlp').jit_compile} "
              "(Keras's default on this machine).")
    if BACKEND == "torch" and Recipe.needed_layout_workaround:
        print("The raw torch.vmap recipe raised keras#23587 ('NYI: ... inside vmap') on a "
              "Conv2D; it was rerun with pergrad's layout workaround (pergrad.backend.torch).")
    if not args.memory_only:
        print(f"{args.repeats} interleaved rounds; time = median over rounds, x plain = median of "
              f"per-round ratios. † = slower than {args.slow_factor:g}x plain: timed one step per "
              f"round on at most {args.slow_steps} rounds. Page faults: minor faults of the "
              "process per step (first touches of freshly mapped memory).")
    if args.memory:
        print(f"Memory: a fresh process per variant (first step + {MEMORY_STEPS} steps); peak = "
              "its peak RSS (VmHWM on Linux, else ru_maxrss; framework included), x plain peak = "
              "over the plain step's; step = peak minus the peak after imports and data, before "
              "the model is built."
              + (f" Measured for {', '.join(['plain'] + [v for v in args.memory_variants if v != 'plain'])}"
                 " only." if args.memory_variants else ""))
    print()
    print(table(rows, args))
    if peers.CHECKS:
        print("\nPeer checks (benchmarks/peers.py, before timing):\n" + "\n".join(peers.check_lines()))
    checks = goals(rows)
    if checks:
        print("\nGoals:\n" + checks)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    if args.json:  # the header's facts too, for benchmarks/table.py
        with open(args.json, "w") as f:
            json.dump(dict(backend=BACKEND, versions=versions, options=options,
                           source=SOURCE_STATE, suite=args.suite, repeats=args.repeats,
                           memory=args.memory, timing=not args.memory_only, rows=rows,
                           peer_checks=peers.CHECKS), f, indent=1)
    return rows


if __name__ == "__main__":
    if PROCESS.memory_child:
        memory_child(*PROCESS.memory_child)
    else:
        main()
