"""``pergrad demo``: robust aggregation on scikit-learn's bundled digits.

Trains the same small network with several aggregators, on clean data and on
data where some training examples are corrupted (inputs scaled up, labels
changed), over several seeds, and prints one table: test accuracy (mean and
standard deviation over the seeds) and the wall time of each row, compilation
included. The numbers are whatever they honestly are: a robust rule that does
worse than the mean on some data shows it here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import keras
import numpy as np

import pergrad
from pergrad import aggregators
from pergrad.apps.digits import build_model, digits_mlp, load_digits_split, pyplot

#: (label, factory) pairs; factories so that each run gets a fresh aggregator.
#: Robust rules come alone and after bucketing (Karimireddy et al., 2022):
#: per-example gradients are far more heterogeneous than workers' means.
DEFAULT_RULES = [
    ("mean", lambda: aggregators.mean()),
    ("clip(1.0)", lambda: aggregators.clip(1.0)),
    ("median", lambda: aggregators.median()),
    ("bucketing(8, median)", lambda: aggregators.bucketing(8, aggregators.median(), seed=0)),
    ("trimmed_mean(0.2)", lambda: aggregators.trimmed_mean(0.2)),
    (
        "bucketing(8, trimmed_mean(0.2))",
        lambda: aggregators.bucketing(8, aggregators.trimmed_mean(0.2), seed=0),
    ),
    ("krum(0.2)", lambda: aggregators.krum(0.2)),
    ("bucketing(8, krum(0.2))", lambda: aggregators.bucketing(8, aggregators.krum(0.2), seed=0)),
    ("geometric_median", lambda: aggregators.geometric_median()),
    ("centered_clip(1.0)", lambda: aggregators.centered_clip(1.0)),
    ("norm_filter(3)", lambda: aggregators.norm_filter(3.0)),
]


def corrupt(x, y, fraction: float, scale: float = 10.0, seed: int = 1):
    """Corrupts each example with probability ``fraction``: inputs times ``scale``, label changed.

    Returns copies and the boolean mask of corrupted rows.
    """
    rng = np.random.default_rng(seed)
    rows = rng.random(len(x)) < fraction
    x, y = x.copy(), y.copy()
    x[rows] *= scale
    y[rows] = (y[rows] + 1 + rng.integers(0, 9, rows.sum())) % 10
    return x, y, rows


@dataclass
class RowResult:
    """One row of the demo's table: a rule's final test accuracy on each data set, one
    value per seed, and the row's wall time (every run of it, compilation included)."""

    rule: str
    accuracy: dict = field(default_factory=dict)  # data set name -> [accuracy per seed]
    curves: dict = field(default_factory=dict)  # data set name -> [[accuracy per epoch] per seed]
    seconds: float = 0.0
    epsilon: float | None = None

    def add(self, data: str, curve: list) -> None:
        self.curves.setdefault(data, []).append(curve)
        self.accuracy.setdefault(data, []).append(curve[-1])


def _mean_spread(values: list) -> str:
    if not values:
        return "–"
    spread = f" ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else ""
    return f"{np.mean(values):.3f}{spread}"


TABLE_HEADER = ("| aggregator | clean | corrupted | wall s |", "|---|---:|---:|---:|")


def table_row(row: RowResult) -> str:
    """The row as the printed table shows it (accuracy mean ± standard deviation over the seeds)."""
    clean = _mean_spread(row.accuracy.get("clean", []))
    if row.epsilon is not None:
        clean += f" (ε = {row.epsilon:.2f})"
    return f"| {row.rule} | {clean} | {_mean_spread(row.accuracy.get('corrupted', []))} | {row.seconds:.0f} |"


def _compiled(aggregator, learning_rate: float):
    model = pergrad.PerExampleModel(digits_mlp(), aggregator)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    return model


def seed_data(seed: int, corrupted_fraction: float):
    """``(train, test, corrupted train)`` of a seed: its split, and its corrupted examples."""
    train_data, test_data = load_digits_split(seed)
    x_bad, y_bad, _ = corrupt(*train_data, corrupted_fraction, seed=seed + 1)
    return train_data, test_data, (x_bad, y_bad)


def _runs(row: RowResult, rule, runs: list, learning_rate: float) -> RowResult:
    """``row`` with the curve of every run, ``(seed, data set name, train)`` with ``train(model)``
    a run's test-accuracy curve, each from its seed's initial weights; and the row's wall time.

    One model serves every run (one compilation per shape): the weights, the optimizer's
    and the rule's state are set back before each run.
    """
    started = time.perf_counter()
    model = _compiled(rule, learning_rate)
    variables = list(model.optimizer.variables) + list(model.aggregator.variables)
    initial = [keras.ops.convert_to_numpy(v) for v in variables]
    for seed, name, train in runs:
        model.model.set_weights(build_model(seed).get_weights())
        for variable, value in zip(variables, initial):
            variable.assign(value)
        if getattr(model.aggregator, "differentially_private", False):
            # The seed's noise: the key's variable half drawn from it (a demo's key, not
            # secret, as with dp_gaussian's seed).
            from pergrad.privacy import noise

            model.aggregator.noise_key.assign(noise.key_words(seed, spawn=1))
        row.add(name, train(model))
    row.seconds = time.perf_counter() - started
    return row


def _fit(model, data, test_data, epochs: int, batch_size: int, seed: int) -> list:
    """Test accuracy after every epoch of ``fit`` on ``data``."""
    keras.utils.set_random_seed(seed)  # the same shuffling for every rule
    history = model.fit(*data, batch_size=batch_size, epochs=epochs, validation_data=test_data, verbose=0)
    return [float(a) for a in history.history["val_accuracy"]]


def train_rule(label: str, rule, seeds: list, epochs: int, batch_size: int, corrupted_fraction: float,
               learning_rate: float = 3e-3) -> RowResult:
    """One row: the rule on each seed's clean and corrupted data."""
    runs = []
    for seed in seeds:
        train_data, test_data, corrupted = seed_data(seed, corrupted_fraction)
        for name, data in (("clean", train_data), ("corrupted", corrupted)):
            runs.append((seed, name, lambda model, data=data, test=test_data, seed=seed:
                         _fit(model, data, test, epochs, batch_size, seed)))
    return _runs(RowResult(label), rule, runs, learning_rate)


#: The DP row's mechanism: clip norm, noise multiplier, delta.
DP_CLIP, DP_NOISE, DP_DELTA = 1.0, 1.0, 1e-5


def train_dp(seeds: list, epochs: int, batch_size: int, learning_rate: float = 3e-3) -> RowResult:
    """DP-SGD on each seed's clean digits, Poisson-sampled, the noise drawn from the seed."""
    from pergrad import privacy

    row = RowResult(f"dp_gaussian(C={DP_CLIP:g}, z={DP_NOISE:g}), Poisson sampling")

    def run(seed):
        (x, y), test_data = load_digits_split(seed)
        rate = batch_size / len(x)
        sampler = privacy.PoissonSampler(x, y, sampling_rate=rate, seed=seed)

        def train(model):
            accountant = privacy.PrivacyAccountant(DP_NOISE, rate, DP_DELTA)
            history = model.fit(sampler, epochs=epochs, validation_data=test_data, callbacks=[accountant],
                                verbose=0)
            row.epsilon = float(history.history["epsilon"][-1])
            return [float(a) for a in history.history["val_accuracy"]]

        return seed, "clean", train, sampler.expected_batch_size

    runs = [run(seed) for seed in seeds]
    rule = privacy.dp_gaussian(DP_CLIP, DP_NOISE, expected_batch_size=runs[0][3], seed=0)
    return _runs(row, rule, [r[:3] for r in runs], learning_rate)


#: Canaries of the DP row's audit (pergrad.privacy.audit): a stronger audit with more, at more cost.
AUDIT_CANARIES = 500


def run(rules=None, seeds: int = 3, epochs: int = 10, batch_size: int = 64,
        corrupted_fraction: float = 0.2, out_dir: str = "demo_output", dp: bool = True,
        echo=print) -> list[RowResult]:
    """Trains every rule (and DP-SGD) over ``seeds`` seeds and prints the table once, a row
    as each completes; writes ``learning_curves_<backend>.png`` and ``results_<backend>.md``
    into ``out_dir``."""
    rules = rules or DEFAULT_RULES
    backend = keras.backend.backend()
    seed_list = list(range(seeds))
    (x, _), (x_test, _) = load_digits_split(0)
    echo(f"pergrad demo on the {backend!r} backend: digits ({len(x)} training, {len(x_test)} test "
         f"examples), a 64-64-10 network, Adam, {epochs} epochs of batches of {batch_size}. In the "
         f"corrupted set each training example is corrupted with probability {corrupted_fraction:g} "
         f"(inputs x10, label changed). Test accuracy on clean test data, mean ± standard deviation "
         f"over {seeds} seed(s) (split, corruption, initialization, shuffling); wall time of the "
         "row's runs, compilation included.")
    echo("")
    lines = list(TABLE_HEADER)
    for line in lines:
        echo(line)
    rows = []
    for label, factory in rules:
        rows.append(train_rule(label, factory(), seed_list, epochs, batch_size, corrupted_fraction))
        lines.append(table_row(rows[-1]))
        echo(lines[-1])
    notes = []
    if dp:
        from pergrad import privacy

        rows.append(train_dp(seed_list, epochs, batch_size))
        lines.append(table_row(rows[-1]))
        echo(lines[-1])
        # The same rule, sampling rate and steps, trained once more with canaries (seed 0).
        audited = privacy.audit(data=load_digits_split(0)[0], noise_multiplier=DP_NOISE,
                                sampling_rate=batch_size / len(x), epochs=epochs,
                                canaries=AUDIT_CANARIES, delta=DP_DELTA, seed=0)
        notes.append(f"DP row: epsilon at delta={DP_DELTA:g} after {epochs} epochs. Audited with "
                     f"{AUDIT_CANARIES} canaries in one more run (seed 0): {audited}.")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"results_{backend}.md"), "w") as file:
            file.write("\n".join(lines + [""] + notes) + "\n")
        curves = plot(rows, os.path.join(out_dir, f"learning_curves_{backend}.png"))
        notes.append(f"Learning curves: {curves}")
    echo("")
    for note in notes:
        echo(note)
    return rows


def plot(rows: list[RowResult], path: str) -> str:
    """Mean test accuracy per epoch over the seeds, one curve per rule, on clean and corrupted
    data; one legend for both panels, beside them."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    colors = plt.cm.tab20.colors
    handles = {}
    for ax, data_name in zip(axes, ("clean", "corrupted")):
        for i, row in enumerate(rows):
            if data_name in row.curves:
                curve = np.mean(row.curves[data_name], axis=0)
                style = "--" if "bucketing" in row.rule else "-"
                (line,) = ax.plot(range(1, len(curve) + 1), curve, style, color=colors[i % len(colors)],
                                  marker=".", label=row.rule)
                handles.setdefault(row.rule, line)
        ax.set_title(f"{data_name} training data")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    seeds = len(next(iter(rows[0].curves.values()))) if rows else 0
    axes[0].set_ylabel(f"test accuracy (mean of {seeds} seeds)")
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(0.8, 0.5),
               fontsize=8)
    fig.suptitle(f"pergrad demo on digits ({keras.backend.backend()} backend)")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=100, bbox_inches="tight")  # (the legend's long labels included)
    plt.close(fig)
    return path
