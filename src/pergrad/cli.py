"""Command line: ``pergrad demo`` and ``pergrad insight``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pergrad", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train on scikit-learn's digits with several aggregators, clean and corrupted"
    )
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--corrupted-fraction", type=float, default=0.2)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="demo_output", help="folder for the PNG ('' for none)")
    demo.add_argument("--no-dp", action="store_true", help="skip the DP-SGD run")
    insight = commands.add_parser(
        "insight", help="per-example scores on digits with flipped labels: the mislabeled-example "
        "finder, the data-pruning curve, plots"
    )
    insight.add_argument("--seeds", type=int, default=3)
    insight.add_argument("--epochs", type=int, default=10)
    insight.add_argument("--flipped-fraction", type=float, default=0.1)
    insight.add_argument("--out", default="insight_output", help="folder for the PNGs ('' for none)")
    insight.add_argument("--no-pruning", action="store_true", help="skip the data-pruning curve")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from pergrad import demo as demo_module

        demo_module.run(
            epochs=args.epochs,
            batch_size=args.batch_size,
            corrupted_fraction=args.corrupted_fraction,
            seed=args.seed,
            out_dir=args.out,
            dp=not args.no_dp,
            echo=lambda line: print(line, flush=True),
        )
    if args.command == "insight":
        from pergrad import insight as insight_module

        insight_module.run(
            seeds=args.seeds,
            fraction=args.flipped_fraction,
            epochs=args.epochs,
            out_dir=args.out,
            pruning=not args.no_pruning,
            echo=lambda line: print(line, flush=True),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
