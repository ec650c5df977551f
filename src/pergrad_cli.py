"""The ``pergrad`` command: ``pergrad demo`` and ``pergrad insight``.

A top-level module of its own, outside the ``pergrad`` package: importing the package
imports Keras and its backend (seconds, and TensorFlow's log lines), which ``--help``
and ``--version`` do not need. A command imports them when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = (
    "pergrad: per-example gradients and custom gradient aggregation inside Keras 3 fit(). "
    "The commands train on scikit-learn's bundled digits (no download; pip install "
    "'pergrad[demo]' brings scikit-learn and matplotlib) on the backend KERAS_BACKEND names "
    "(default tensorflow)."
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pergrad")
    except PackageNotFoundError:  # (run from a source tree that is not installed)
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """The command line's parser (help text on every option)."""
    main_parser = argparse.ArgumentParser(prog="pergrad", description=DESCRIPTION)
    main_parser.add_argument("--version", action="version", version=f"pergrad {_version()}")
    commands = main_parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    defaults = argparse.ArgumentDefaultsHelpFormatter
    demo = commands.add_parser(
        "demo", formatter_class=defaults,
        help="robust aggregation on digits: several rules, clean and corrupted data, DP-SGD",
        description="Trains a 64-64-10 network on digits with each aggregator, on clean data and on "
        "data with corrupted examples (inputs x10, labels changed), over several seeds; prints one "
        "table (test accuracy, mean and spread over the seeds, and the wall time of each row, "
        "compilation included) and writes the learning curves.",
    )
    demo.add_argument("--seeds", type=int, default=3, help="seeds per row (split, corruption, "
                      "initialization and shuffling all change with the seed)")
    demo.add_argument("--epochs", type=int, default=10, help="training epochs per run")
    demo.add_argument("--batch-size", type=int, default=64, help="examples per batch")
    demo.add_argument("--corrupted-fraction", type=float, default=0.2,
                      help="probability that a training example of the corrupted set is corrupted")
    demo.add_argument("--out", default="demo_output",
                      help="folder for the table (results_<backend>.md) and the learning curves "
                      "(learning_curves_<backend>.png); '' for none")
    demo.add_argument("--no-dp", action="store_true", help="skip the DP-SGD row and its audit")
    insight = commands.add_parser(
        "insight", formatter_class=defaults,
        help="per-example scores on digits with flipped labels: the mislabeled-example finder, "
        "the data-pruning curve, plots",
        description="Ranks digits' training examples by TracIn self-influence, EL2N, GraNd and the "
        "loss to find flipped labels (precision@k over several seeds), draws the data-pruning "
        "curve and writes the plots.",
    )
    insight.add_argument("--seeds", type=int, default=3, help="seeds of the mislabeled-example finder")
    insight.add_argument("--epochs", type=int, default=10, help="training epochs per run")
    insight.add_argument("--flipped-fraction", type=float, default=0.1,
                         help="fraction of the training labels changed")
    insight.add_argument("--noise", choices=("uniform", "pairs"), default="uniform",
                         help="uniform: a flipped label becomes any other class; pairs: "
                         "class-dependent, 3s labelled 8 and 1s labelled 7")
    insight.add_argument("--out", default="insight_output", help="folder for the PNGs ('' for none)")
    insight.add_argument("--no-pruning", action="store_true", help="skip the data-pruning curve")
    return main_parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # TensorFlow's C++ info and warning lines (not the few it writes before its logging starts).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    echo = lambda line: print(line, flush=True)  # noqa: E731
    if args.command == "demo":
        from pergrad.apps import demo

        demo.run(seeds=args.seeds, epochs=args.epochs, batch_size=args.batch_size,
                 corrupted_fraction=args.corrupted_fraction, out_dir=args.out, dp=not args.no_dp,
                 echo=echo)
    if args.command == "insight":
        from pergrad.apps import insight

        insight.run(seeds=args.seeds, fraction=args.flipped_fraction, epochs=args.epochs,
                    noise=args.noise, out_dir=args.out, pruning=not args.no_pruning, echo=echo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
