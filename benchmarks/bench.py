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
the tables of ``benchmarks/README.md``, which describes the runs.

The pieces: ``models.py`` (the models, data and rule parameters), ``recipes.py``
(the variants: the plain step, pergrad, the hand-written jacobian / vmap
recipes, Opacus; ``peers.py``: TF Privacy and jax-privacy), ``runner.py``
(steps as ``fit()`` runs them, interleaved timing rounds, medians, peak memory
in fresh processes), ``report.py`` (the table, the ratios beside pergrad, the
JSON), ``process.py`` (threads, allocator and oneDNN, set before the backend's
import). This file is the command line.

Suites (``--suite``; ``--models`` and ``--variants`` override a suite's choice):

- ``default``: ``mlp64``, ``mlp256``, ``cnn64``, ``tfm64``, the recipes x
  ``--aggregations`` (``jacobian`` with clip only; ``pergrad-mat`` for the
  statistics rules); ``--quick`` (smoke test): ``mlp16``, ``cnn16``, ``tfm8``,
  the variants plain, vmap clip, pergrad median, clip and krum (and the Opacus
  pair on torch), 2 rounds;
- ``lm``: ``gpt8`` and ``lora8`` (``--quick``: ``gpt2``, ``lora2``) with plain,
  pergrad mean, clip and dp, and pergrad-mat clip (keras-hub needed);
- ``rnn``: the recurrent models ``lstm64`` and ``gru64`` (``--quick``: ``lstm8``,
  ``gru8``) with the same rows as ``lm``;
- ``conv``: ``resnet16``, ``convnext16``, ``dwconv32``, ``mobilenet16`` (``--quick``:
  B = 4) with plain, pergrad clip and dp, and pergrad-mat clip;
- ``coordinate``: the coordinate rules on ``mlp64``, ``mlp256`` and ``cnn64``
  (``--quick``: ``mlp16``, ``cnn16``): plain, jacobian median (the CNN and MLPs
  up to B=64: on mlp256 it took 4-9 s per step), pergrad-mat median, and pergrad
  median, trimmed, meamed, signs, bucketmedian, clipmedian on the default path;
  with ``--memory`` only plain and the two median rows are measured for memory
  (``--memory-variants`` chooses others).

On TensorFlow the run sets ``TF_ENABLE_ONEDNN_OPTS=0`` (unless already set)
whenever a ``tfm``, ``gpt``, ``lora``, ``llama`` or ``bert`` model is in it (``process.py``); the
header says which. Threads: one per backend by default (``--threads 0``: the
backends' defaults). ``--clock cpu`` times steps by the process's CPU time
instead of the wall clock (on a machine other processes load). ``--memory``
(or ``--memory-only``, without the timing rounds) runs each (model, variant)
again in a fresh process of this script (``--memory-child``) and reports its
peak RSS (``runner.py``): 5-15 s each.

``--json FILE`` writes the rows (the plain row also carries the model's
``batch``, ``parameters`` and ``largest_variable``) with the header's facts
(``backend``, ``versions``, ``options``, ``source`` commit, ``suite``,
``repeats``, ``memory``, ``timing``, ``peer_checks``), for ``benchmarks/table.py``.

``--replicas R`` (e.g. ``2`` or ``2,4``) runs ``benchmarks/replicas.py`` instead
(its options pass through; ``--threads`` does not apply): the communication per
step of each rule kind on R logical CPU devices, measured from the compiled
program / traced graph.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "src")]  # the benchmark's modules, this checkout's pergrad

import process  # noqa: E402  (imports no backend)

DEFAULT_MODELS = ("mlp64", "mlp256", "cnn64", "tfm64")
QUICK_MODELS = ("mlp16", "cnn16", "tfm8")
COORDINATE_MODELS = ("mlp64", "mlp256", "cnn64")
COORDINATE_QUICK_MODELS = ("mlp16", "cnn16")
LM_MODELS = ("gpt8", "lora8")  # keras-hub
LM_QUICK_MODELS = ("gpt2", "lora2")
RNN_MODELS = ("lstm64", "gru64")
RNN_QUICK_MODELS = ("lstm8", "gru8")
CONV_MODELS = ("resnet16", "convnext16", "dwconv32", "mobilenet16")
CONV_QUICK_MODELS = ("resnet4", "convnext4", "dwconv4", "mobilenet4")
SUITES = ("default", "coordinate", "lm", "rnn", "conv")


def suite_models(suite: str, quick: bool) -> tuple[str, ...]:
    """The models a run takes when ``--models`` is not given."""
    if suite == "coordinate":
        return COORDINATE_QUICK_MODELS if quick else COORDINATE_MODELS
    if suite == "lm":
        return LM_QUICK_MODELS if quick else LM_MODELS
    if suite == "rnn":
        return RNN_QUICK_MODELS if quick else RNN_MODELS
    if suite == "conv":
        return CONV_QUICK_MODELS if quick else CONV_MODELS
    return QUICK_MODELS if quick else DEFAULT_MODELS


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


def run_models(options) -> list[str]:
    """The models of this process (a memory child: its one model)."""
    if options.memory_child:
        return [options.memory_child[0]]
    if options.models:
        return options.models.split(",")
    return list(suite_models(options.suite, options.quick))


PROCESS = process_options() if __name__ == "__main__" else process_options([])
if PROCESS.replicas:  # communication per step on R logical devices: benchmarks/replicas.py
    import replicas

    sys.exit(replicas.main(sys.argv[1:]))
process.before_backend_import(PROCESS.threads, run_models(PROCESS), PROCESS.malloc_tuning)

import keras  # noqa: E402

BACKEND = keras.backend.backend()
if BACKEND not in ("tensorflow", "jax", "torch"):
    sys.exit(f"bench.py supports tensorflow, jax and torch; KERAS_BACKEND is {BACKEND!r}.")

import recipes  # noqa: E402
import report  # noqa: E402  (reads the checkout's commit now: the code that is timed)
import runner  # noqa: E402
from models import parse_model  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: " + ",".join(QUICK_MODELS) + ", 2 rounds, short blocks")
    parser.add_argument("--suite", choices=SUITES, default="default",
                        help="default: the recipes x --aggregations on " + ",".join(DEFAULT_MODELS)
                        + "; coordinate: the coordinate rules (plain, jacobian median, "
                        "pergrad-mat median, pergrad " + "/".join(recipes.COORDINATE_AGGREGATIONS)
                        + ") on " + ",".join(COORDINATE_MODELS) + " (quick: "
                        + ",".join(COORDINATE_QUICK_MODELS) + "); lm: the language models "
                        + ",".join(LM_MODELS) + " (keras-hub; quick: " + ",".join(LM_QUICK_MODELS)
                        + "); rnn: the recurrent models " + ",".join(RNN_MODELS) + " (quick: "
                        + ",".join(RNN_QUICK_MODELS) + "); conv: the convolution models "
                        + ",".join(CONV_MODELS) + " (quick: " + ",".join(CONV_QUICK_MODELS) + ")")
    parser.add_argument("--models", default=None,
                        help="comma list of mlp<B>/cnn<B>/tfm<B>/gpt<B>/lora<B>/llama<B>/bert<B>/"
                        "lstm<B>/gru<B>/resnet<B>/convnext<B>/dwconv<B>/mobilenet<B> (default: the suite's)")
    parser.add_argument("--aggregations", default=",".join(recipes.DEFAULT_AGGREGATIONS),
                        help="the default suite's aggregations (default %(default)s; also "
                        + ",".join(a for a in recipes.AGGREGATIONS
                                   if a not in recipes.DEFAULT_AGGREGATIONS) + ")")
    parser.add_argument("--recipes", default=",".join(recipes.default_recipes()),
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
                        f"(first step + {runner.MEMORY_STEPS} steps)")
    parser.add_argument("--memory-only", action="store_true",
                        help="--memory without the timing rounds")
    parser.add_argument("--memory-variants", default=None,
                        help="comma list: measure memory for these variants only (plain always; "
                        "default all, --suite coordinate: "
                        + ",".join(recipes.COORDINATE_MEMORY_VARIANTS) + ")")
    parser.add_argument("--memory-timeout", type=float, default=600.0,
                        help="seconds allowed per memory subprocess")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--replicas", default=None,  # handled before the backend's import
                        help="R or a list (2,4): communication per step on R logical CPU "
                        "devices instead (benchmarks/replicas.py --help)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads per backend (default 1: stable on a shared machine; "
                        "0 = the backends' own defaults)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock (default) or by this process's CPU "
                        "time (its threads'), which a loaded machine's other processes do not "
                        "inflate")
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
        args.memory_variants = list(recipes.COORDINATE_MEMORY_VARIANTS)
    if args.variants:
        args.variants = [v.strip() for v in args.variants.split(",")]
    elif quick and args.suite == "default":
        args.variants = recipes.quick_variants()
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
        if a not in recipes.AGGREGATIONS:
            parser.error(f"unknown aggregation {a!r}; choose from {', '.join(recipes.AGGREGATIONS)}")
    return args


def log(message):
    print(message, file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    if BACKEND == "torch" and recipes.opacus is None:
        log("opacus not installed: no Opacus rows (pip install opacus to add them)")
    process.configure_threads(args.threads)
    if args.clock == "cpu":
        runner.CLOCK = time.process_time
    start = time.perf_counter()
    rows = []
    for key in args.models:
        log(f"{BACKEND}: {key} ...")
        names, memory_names = recipes.row_names(key, args)
        rows.extend(runner.measure_model(key, names, memory_names, args, log,
                                         recipes.make_stepper, recipes.OWN_PLAIN))
    report.print_report(rows, args, time.perf_counter() - start)
    return rows


if __name__ == "__main__":
    if PROCESS.memory_child:  # the peers' check is the timing run's, not repeated here
        runner.memory_child(*PROCESS.memory_child, functools.partial(recipes.make_stepper, checked=False),
                            PROCESS.threads)
    else:
        main()
