#!/usr/bin/env python
"""The benchmark tables (``benchmarks/README.md``) from ``bench.py --json`` outputs.

One ``bench.py`` run per backend (and suite) writes its rows with ``--json``;
this script reads any number of such files and prints the markdown tables:
the speed table (the statistics rules, ratios to the plain step), the
peak-memory table, the coordinate-rules table, the median's memory beside
plain's peak + 2 x B x the largest variable's floats, the DP peers' table
(milliseconds of pergrad's clip and DP steps beside TF Privacy's, jax-privacy's
and Opacus's, ``benchmarks/peers.py``), the language models' table (``--suite
lm``: speed and memory) and the recurrent models' (``--suite rnn``, the same columns)::

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/bench.py --json tf.json
    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/bench.py --suite coordinate \\
        --memory --json tf-coordinate.json
    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/bench.py --suite lm --memory --json tf-lm.json
    ... (jax, torch)
    .venv/bin/python benchmarks/table.py tf.json jax.json torch.json tf-coordinate.json ...

A table is printed when some file has its rows, and a model's line when it has
at least one cell besides the plain step. Where several files hold the same
(backend, model), each line takes its cells from the file with the most of that
table's cells first (its plain step with them: every ratio is against the plain
step of its own run), then from the others. Ratios are shown as ``57x`` from 10
up, ``1.27x`` below; ``–`` is a cell no file has (or a skipped variant).
No backend is imported: this runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

BACKENDS = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}

#: (column title, variant) of the speed table: ratios to the plain step
SPEED_COLUMNS = (
    ("jacobian clip", "jacobian clip"),
    ("materialized clip", "pergrad-mat clip"),
    ("mean", "pergrad mean"),
    ("clip", "pergrad clip"),
    ("dp_gaussian", "pergrad dp"),
    ("krum(0.1)", "pergrad krum"),
    ("geometric_median", "pergrad geomed"),
    ("norm_filter", "pergrad normfilter"),
)
OPACUS_TITLE = "Opacus ghost clip (ms)"
#: (column title, variant) of the memory table: peaks over the plain step's
MEMORY_COLUMNS = (
    ("mean", "pergrad mean"),
    ("clip", "pergrad clip"),
    ("dp_gaussian", "pergrad dp"),
    ("materialized clip", "pergrad-mat clip"),
)
#: (column title, variant) of the coordinate-rules table: ratios to the plain step
COORDINATE_COLUMNS = (
    ("jacobian median", "jacobian median"),
    ("materialized median", "pergrad-mat median"),
    ("median", "pergrad median"),
    ("trimmed mean", "pergrad trimmed"),
    ("MeaMed", "pergrad meamed"),
    ("sign majority", "pergrad signs"),
    ("bucketing(8, median)", "pergrad bucketmedian"),
    ("chain(clip, median)", "pergrad clipmedian"),
)
#: (column title, variant) of the DP peers' table (benchmarks/peers.py): milliseconds per step
PEER_COLUMNS = (
    ("pergrad clip", "pergrad clip"),
    ("pergrad dp_gaussian", "pergrad dp"),
    ("TF Privacy clip", "tf-privacy clip"),
    ("TF Privacy dp", "tf-privacy dp"),
    ("jax-privacy dp (vmap)", "jax-privacy dp"),
    ("jax-privacy dp (microbatch 1)", "jax-privacy-mb1 dp"),
    ("Opacus ghost clip", "opacus clip"),
)
PEERS = {"tf-privacy clip", "tf-privacy dp", "jax-privacy dp", "jax-privacy-mb1 dp", "opacus clip"}
#: (column title, variant, field) of the language models' table: ratios to the plain step's time / peak
LM_COLUMNS = (
    ("mean", "pergrad mean", "ratio"),
    ("clip", "pergrad clip", "ratio"),
    ("dp_gaussian", "pergrad dp", "ratio"),
    ("materialized clip", "pergrad-mat clip", "ratio"),
    ("peak: clip", "pergrad clip", "peak_ratio"),
    ("peak: dp_gaussian", "pergrad dp", "peak_ratio"),
)
LM_KINDS = ("gpt", "lora", "llama", "bert")  # models.HUB_KINDS (this file imports no backend)
RNN_KINDS = ("lstm", "gru")  # models.RNN_KINDS
#: a model key: its kind and batch size
MODEL_KEY = re.compile(r"(mlp|cnn|tfm|gpt|lora|llama|bert|lstm|gru)(\d+)")
#: the median's memory beside plain's peak + this many x B x the largest variable's floats
MEDIAN_MEMORY_COPIES = 2


def load(paths):
    """``{(backend, model): [{variant: row}, ...]}`` in file order, and the runs' descriptions."""
    models, runs = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        backend = data["backend"]
        per_model = {}
        for row in data["rows"]:
            per_model.setdefault(row["model"], {})[row["variant"]] = row
        for model, variants in per_model.items():
            models.setdefault((backend, model), []).append(variants)
        runs.append((path, data))
    return models, runs


def model_order(key):
    """Backends in the tables' order, then MLPs, CNNs, transformers by batch size."""
    backend, model = key
    match = MODEL_KEY.fullmatch(model)
    kind, batch = (match.group(1), int(match.group(2))) if match else (model, 0)
    kinds = ("mlp", "cnn", "tfm") + LM_KINDS + RNN_KINDS
    return (list(BACKENDS).index(backend) if backend in BACKENDS else len(BACKENDS),
            kinds.index(kind) if kind in kinds else len(kinds), batch, model)


def row_label(backend: str, model: str, seen: set) -> str:
    """:func:`model_label` of a table row, the first of its kind per backend in full
    (``seen``: the ``(backend, kind)`` pairs labelled so far, updated)."""
    kind = model.rstrip("0123456789")
    first = (backend, kind) not in seen
    seen.add((backend, kind))
    return model_label(model, first)


def model_label(model: str, first: bool) -> str:
    """``mlp64`` -> ``MLP 784-256-256-10, B=64`` (the first of its kind per backend) or ``MLP, B=64``."""
    match = MODEL_KEY.fullmatch(model)
    if not match:
        return model
    kind, batch = match.group(1), match.group(2)
    if kind == "gpt":
        return f"GPT-2 style LM, B={batch}, T=128"
    if kind == "lora":
        return f"GPT-2 style LM + LoRA rank 4, B={batch}"
    if kind == "llama":
        return f"Llama style LM, B={batch}, T=128"
    if kind == "bert":
        return f"BERT classifier, B={batch}, T=128"
    if kind == "lstm":
        return f"Bidirectional LSTM(32) text classifier, B={batch}, T=64"
    if kind == "gru":
        return f"GRU(32) regressor, B={batch}, T=64"
    if kind == "mlp":
        return f"MLP 784-256-256-10, B={batch}" if first else f"MLP, B={batch}"
    if kind == "cnn":
        return f"CNN 28x28x1, B={batch}" if first else f"CNN, B={batch}"
    return f"Transformer, B={batch}, T=64"


def ratio(value: float) -> str:
    return f"{value:.0f}x" if value >= 10 else f"{value:.2f}x"


def pick(sources, variant, field):
    """The first source's row of ``variant`` that has ``field``, or None."""
    for variants in sources:
        row = variants.get(variant)
        if row is not None and field in row:
            return row
    return None


def ranked(sources, variants, field):
    """The sources with the most of ``variants`` measured (``field``) first."""
    return sorted(sources, key=lambda s: -sum(field in s.get(v, {}) for v in variants))


def markdown(header, lines):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])


def ratio_table(models, columns, opacus=False):
    """A table of ratios to the plain step (``ratio`` of each row), plain in ms."""
    variants = [v for _, v in columns] + (["opacus clip"] if opacus else [])
    header = ["backend", "model", "plain ms"] + [t for t, _ in columns]
    header += [OPACUS_TITLE] if opacus else []
    lines, seen = [], set()
    for key in sorted(models, key=model_order):
        backend, model = key
        sources = ranked(models[key], variants, "ratio")
        cells, found = [], False
        for _, variant in columns:
            row = pick(sources, variant, "ratio")
            failed = pick(sources, variant, "failed")
            found = found or row is not None
            cells.append(ratio(row["ratio"]) if row else ("failed" if failed else "–"))
        if opacus:
            op, pg = pick(sources, "opacus clip", "ms"), pick(sources, "pergrad clip", "ms")
            found = found or op is not None
            cells.append(f"{op['ms']:.1f}" + (f" (pergrad {pg['ms']:.1f})" if pg else "")
                         if op else "–")
        if not found:
            continue
        plain = pick(sources, "plain", "ms")
        label = row_label(backend, model, seen)
        lines.append([BACKENDS.get(backend, backend), label,
                      f"{plain['ms']:.1f}" if plain else "–"] + cells)
    return markdown(header, lines) if lines else None


def peers_table(models):
    """Milliseconds per step of pergrad's clip and DP step beside the peers' (a line where some
    peer was timed); TF Privacy's own plain tf_keras step in the plain column's parentheses."""
    variants = [v for _, v in PEER_COLUMNS]
    header = ["backend", "model", "plain ms"] + [f"{t} ms" for t, _ in PEER_COLUMNS]
    lines, seen = [], set()
    for key in sorted(models, key=model_order):
        backend, model = key
        sources = ranked(models[key], variants, "ms")
        rows = [pick(sources, v, "ms") for v in variants]
        if not any(row for row, v in zip(rows, variants) if v in PEERS):
            continue
        plain, own = pick(sources, "plain", "ms"), pick(sources, "tf-privacy-plain", "ms")
        label = row_label(backend, model, seen)
        plain_cell = f"{plain['ms']:.1f}" if plain else "–"
        plain_cell += f" (tf_keras {own['ms']:.1f})" if own else ""
        lines.append([BACKENDS.get(backend, backend), label, plain_cell]
                     + [f"{r['ms']:.1f}" if r else "–" for r in rows])
    return markdown(header, lines) if lines else None


def memory_table(models):
    """Peaks over the plain step's peak (``peak_ratio``); plain's peak in MiB."""
    variants = [v for _, v in MEMORY_COLUMNS]
    header = ["backend", "model", "plain"] + [t for t, _ in MEMORY_COLUMNS]
    lines, seen = [], set()
    for key in sorted(models, key=model_order):
        backend, model = key
        sources = ranked(models[key], variants, "peak_ratio")
        rows = [pick(sources, v, "peak_ratio") for v in variants]
        if not any(rows):
            continue
        plain = pick(sources, "plain", "peak_mib")
        label = row_label(backend, model, seen)
        lines.append([BACKENDS.get(backend, backend), label,
                      f"{plain['peak_mib']:.0f} MiB" if plain else "–"]
                     + [ratio(r["peak_ratio"]) if r else "–" for r in rows])
    return markdown(header, lines) if lines else None


def lm_table(models, kinds=LM_KINDS):
    """The language models (or the recurrent models, ``kinds``): speed and peak-memory ratios
    to their plain step; plain in ms."""
    header = ["backend", "model", "plain ms"] + [t for t, _, _ in LM_COLUMNS]
    lines, seen = [], set()
    for key in sorted(models, key=model_order):
        backend, model = key
        if model.rstrip("0123456789") not in kinds:
            continue
        sources = models[key]
        cells = []
        for _, variant, field in LM_COLUMNS:
            row = pick(sources, variant, field)
            cells.append(ratio(row[field]) if row else "–")
        plain = pick(sources, "plain", "ms")
        lines.append([BACKENDS.get(backend, backend), row_label(backend, model, seen),
                      f"{plain['ms']:.0f}" if plain else "–"] + cells)
    return markdown(header, lines) if lines else None


def coordinate_memory_table(models):
    """The peak of median beside plain's peak + 2 x B x the largest variable's floats."""
    header = ["backend", "model", "plain", "materialized median", "median",
              f"bound: plain + {MEDIAN_MEMORY_COPIES} x B x largest variable", "median within"]
    lines, seen = [], set()
    for key in sorted(models, key=model_order):
        backend, model = key
        sources = ranked(models[key], ["pergrad median", "pergrad-mat median"], "peak_mib")
        median = pick(sources, "pergrad median", "peak_mib")
        materialized = pick(sources, "pergrad-mat median", "peak_mib")
        if not (median or materialized):
            continue
        # the plain peak of the same run as the median's (the bound is against it)
        plain = pick([s for s in sources if "peak_mib" in s.get("pergrad median", {})] + sources,
                     "plain", "peak_mib")
        bound = None
        if plain and "largest_variable" in plain:
            extra = MEDIAN_MEMORY_COPIES * plain["batch"] * plain["largest_variable"] * 4
            bound = plain["peak_mib"] + extra / 2**20
        label = row_label(backend, model, seen)
        within = "–"
        if median and bound is not None:
            within = "yes" if median["peak_mib"] <= bound else "no"
        lines.append([
            BACKENDS.get(backend, backend), label,
            f"{plain['peak_mib']:.0f} MiB" if plain else "–",
            f"{materialized['peak_mib']:.0f} MiB" if materialized else "–",
            f"{median['peak_mib']:.0f} MiB" if median else "–",
            f"{bound:.0f} MiB" if bound is not None else "–",
            within,
        ])
    return markdown(header, lines) if lines else None


def jacobian_speedups(models):
    """``jacobian median`` / ``median`` per (backend, model) where both were timed."""
    out = []
    for key in sorted(models, key=model_order):
        sources = ranked(models[key], ["jacobian median", "pergrad median"], "ms")
        jac, med = pick(sources, "jacobian median", "ms"), pick(sources, "pergrad median", "ms")
        if jac and med:
            out.append(f"{BACKENDS.get(key[0], key[0])} {key[1]} {jac['ms'] / med['ms']:.1f}x")
    return out


def describe_runs(runs):
    lines = []
    for path, data in runs:
        facts = [data.get("versions"), data.get("source") and f"at {data['source']}"]
        if data.get("suite", "default") != "default":
            facts.append(f"--suite {data['suite']}")
        if data.get("timing", True) and data.get("repeats"):
            facts.append(f"{data['repeats']} rounds")
        if data.get("memory"):
            facts.append("memory")
        facts += [o for o in data.get("options", []) if "ONEDNN" in o]
        facts = [f for f in facts if f]
        lines.append(f"- {path}: {BACKENDS.get(data['backend'], data['backend'])}"
                     + (f" ({'; '.join(facts)})" if facts else ""))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="bench.py --json outputs (any backends, suites)")
    parser.add_argument("--tables", default="speed,memory,coordinate,coordinate-memory,peers,lm,rnn",
                        help="which tables, in this order (default %(default)s)")
    args = parser.parse_args(argv)
    models, runs = load(args.files)
    makers = {
        "speed": lambda: ratio_table(models, SPEED_COLUMNS, opacus=True),
        "memory": lambda: memory_table(models),
        "coordinate": lambda: ratio_table(models, COORDINATE_COLUMNS),
        "coordinate-memory": lambda: coordinate_memory_table(models),
        "peers": lambda: peers_table(models),
        "lm": lambda: lm_table(models),
        "rnn": lambda: lm_table(models, RNN_KINDS),
    }
    print("Runs:\n" + describe_runs(runs))
    for name in args.tables.split(","):
        if name not in makers:
            parser.error(f"unknown table {name!r}; choose from {', '.join(makers)}")
        text = makers[name]()
        if text:
            print(f"\n{text}")
            if name == "coordinate" and jacobian_speedups(models):
                print("\njacobian median / median: " + ", ".join(jacobian_speedups(models)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
