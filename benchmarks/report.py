"""What a ``bench.py`` run prints and writes: the header's facts, the table, the ratios, the JSON.

The table has a row per (model, variant): the median time per step and its
ratio to the plain step (timing), the peak memory, its ratio to the plain
step's and the step's share (``--memory``). Under it, the peers' checks
(``benchmarks/peers.py``) and every timed variant beside pergrad's row of the
same aggregation, in milliseconds of the same run. ``--json`` writes the rows
and the header's facts for ``benchmarks/table.py``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess

import keras

import peers
import pergrad
import recipes
from models import LM_KINDS, LM_VOCAB, LM_WIDTH, parse_model
from runner import MEMORY_STEPS

BACKEND = keras.backend.backend()


def source_state() -> str:
    """The commit of the checkout the benchmark ran on, ``-dirty`` with local changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip() or "an unknown commit"
    except (OSError, subprocess.SubprocessError):
        return "an unknown commit"


#: read when the code was imported: a commit made while the benchmark runs is not the code it timed
SOURCE_STATE = source_state()


def versions() -> str:
    """Keras's, the backend's and the peers' versions."""
    text = f"keras {keras.__version__}"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        text += f", tensorflow {tf.__version__}"
    elif BACKEND == "jax":
        import jax

        text += f", jax {jax.__version__}"
    else:
        import torch

        text += f", torch {torch.__version__}"
        text += f", opacus {recipes.opacus.__version__}" if recipes.opacus else ", opacus not installed"
    return text + peers.versions(BACKEND)


def run_options(args) -> list[str]:
    """The options that change what a run measures (the header's and the JSON's)."""
    options = [f"{os.cpu_count()} CPUs"]
    if args.threads:
        options.append(f"--threads {args.threads}")
    if getattr(args, "clock", "wall") != "wall":
        options.append(f"--clock {args.clock}")
    if args.malloc_tuning:
        options.append("--malloc-tuning")
    if args.quick:
        options.append("--quick")
    if args.suite != "default":
        options.append(f"--suite {args.suite}")
    if BACKEND == "tensorflow":
        onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "TF's default")
        options.append(f"TF_ENABLE_ONEDNN_OPTS={onednn}")
    return options


def header(args, versions_text: str, options: list[str]) -> str:
    """What the run measured and how, above the table."""
    lines = [f"## {BACKEND} ({versions_text}; {platform.machine()}, {'; '.join(options)})\n",
             f"pergrad {pergrad.__version__} at {SOURCE_STATE}."]
    if recipes.HAS_PATH:
        lines.append("pergrad <agg> = PerExampleModel(..., path=\"auto\") (the statistics path for "
                     "statistics rules); pergrad-mat <agg> = path=\"materialized\" (the vmap engine).")
    else:
        lines.append("pergrad <agg> = PerExampleModel(model, agg): this checkout has no path= "
                     "argument (the materialized engine only).")
    lines += [recipes.describe_aggregations(), f"Recipes: {recipes.describe_recipes()}."]
    if BACKEND == "torch":
        lines.append(recipes.describe_opacus())
    if peers.describe(BACKEND):
        lines.append(peers.describe(BACKEND))
    if BACKEND == "tensorflow":
        lines.append(f"TF train function jit_compile: {recipes.make_variant('plain', 'mlp').jit_compile} "
                     "(Keras's default on this machine).")
    if BACKEND == "torch" and recipes.Recipe.needed_layout_workaround:
        lines.append("The raw torch.vmap recipe raised keras#23587 ('NYI: ... inside vmap') on a "
                     "Conv2D; it was rerun with pergrad's layout workaround (pergrad.backend.torch).")
    if not args.memory_only:
        lines.append(f"{args.repeats} interleaved rounds; time = median over rounds, x plain = median "
                     f"of per-round ratios. † = slower than {args.slow_factor:g}x plain: timed one step "
                     f"per round on at most {args.slow_steps} rounds. Page faults: minor faults of the "
                     "process per step (first touches of freshly mapped memory).")
    if args.memory:
        measured = ["plain"] + [v for v in args.memory_variants or () if v != "plain"]
        lines.append(f"Memory: a fresh process per variant (first step + {MEMORY_STEPS} steps); peak "
                     "= its peak RSS (VmHWM on Linux, else ru_maxrss; framework included), x plain "
                     "peak = over the plain step's; step = peak minus the peak after imports and data, "
                     "before the model is built."
                     + (f" Measured for {', '.join(measured)} only." if args.memory_variants else ""))
    return "\n".join(lines)


def table(rows, args) -> str:
    timing, memory = not args.memory_only, args.memory
    titles, align = ["model", "variant"], ["---", "---"]
    if timing:
        titles += ["ms/step (median)", "x plain", "steps timed", "page faults/step", "first step s"]
        align += ["---:"] * 5
    if memory:
        titles += ["peak MiB", "x plain peak", "step MiB"]
        align += ["---:"] * 3
    lines = ["| " + " | ".join(titles) + " |", "|" + "|".join(align) + "|"]
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


def comparisons(rows) -> list[str]:
    """Every timed variant beside pergrad's row of the same aggregation (default path), in ms;
    the language model's memory beside the size of a B x vocabulary x hidden tensor."""
    out = []
    for row in rows:
        recipe, aggregation = recipes.split_variant(row["variant"])
        pg = find(rows, row["model"], f"pergrad {aggregation}", "ms")
        if recipe not in ("plain", "pergrad") and "ms" in row and pg:
            own = recipes.OWN_PLAIN.get(row["variant"])
            own = f"; {row['ratio_own']:.2f}x {own}" if "ratio_own" in row else ""
            out.append(f"- {row['model']} {row['variant']} {row['ms']:.2f} ms / pergrad {aggregation} "
                       f"{pg['ms']:.2f} ms = {row['ms'] / pg['ms']:.2f}x{own}")
    for row in rows:
        kind, batch_size = parse_model(row["model"])
        plain = find(rows, row["model"], "plain", "step_mib")
        if kind in LM_KINDS and row["variant"] != "plain" and "step_mib" in row and plain:
            tensor_mib = batch_size * LM_VOCAB * LM_WIDTH * 4 / 2**20
            out.append(f"- {row['model']} {row['variant']}: the step takes "
                       f"{row['step_mib'] - plain['step_mib']:.0f} MiB more than plain's (a B x "
                       f"vocabulary x hidden float32 tensor: {tensor_mib:.0f} MiB)")
    return out


def print_report(rows, args, seconds: float) -> None:
    """The header, the table, the peers' checks and the comparisons; the JSON with ``--json``."""
    versions_text, options = versions(), run_options(args)
    print(header(args, versions_text, options) + "\n")
    print(table(rows, args))
    if peers.CHECKS:
        print("\nPeer checks (benchmarks/peers.py, before timing):\n" + "\n".join(peers.check_lines()))
    lines = comparisons(rows)
    if lines:
        print("\nBeside pergrad (ms per step, same run):\n" + "\n".join(lines))
    print(f"\n(total {seconds:.0f} s)")
    if args.json:  # the header's facts too, for benchmarks/table.py
        with open(args.json, "w") as f:
            json.dump(dict(backend=BACKEND, versions=versions_text, options=options,
                           source=SOURCE_STATE, suite=args.suite, repeats=args.repeats,
                           memory=args.memory, timing=not args.memory_only, rows=rows,
                           peer_checks=peers.CHECKS), f, indent=1)
