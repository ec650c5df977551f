"""The main job: robust aggregation on scikit-learn's bundled digits.

Trains the same small network with several aggregators, once on clean data and
once on data where a fraction of the training examples is corrupted (inputs
scaled up, labels changed), and reports test accuracy and time per epoch. The
numbers are whatever they honestly are: a robust rule that does worse than the
mean on some data shows it here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import keras
import numpy as np

import pergrad
from pergrad import aggregators

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


#: Canaries of the DP row's audit (pergrad.privacy.audit): a stronger audit with more, at more cost.
AUDIT_CANARIES = 500


@dataclass
class RunResult:
    rule: str
    data: str
    accuracy: float
    seconds_per_epoch: float
    curve: list


def load_digits_split(seed: int = 0):
    """Digits (1797 images of 8x8), scaled to [0, 1], 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def corrupt(x, y, fraction: float, scale: float = 10.0, seed: int = 1):
    """Corrupts ``fraction`` of the examples: inputs times ``scale``, labels shifted.

    Returns copies and the boolean mask of corrupted rows.
    """
    rng = np.random.default_rng(seed)
    rows = rng.random(len(x)) < fraction
    x, y = x.copy(), y.copy()
    x[rows] *= scale
    y[rows] = (y[rows] + 1 + rng.integers(0, 9, rows.sum())) % 10
    return x, y, rows


def digits_mlp(features: int = 64, classes: int = 10) -> keras.Model:
    """The demo's network: Dense(64, relu), Dense(classes, softmax) on ``features`` inputs."""
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(classes, activation="softmax"),
        ]
    )


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return digits_mlp()


class _EpochTimer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def _compiled(aggregator, seed, learning_rate):
    model = pergrad.PerExampleModel(build_model(seed), aggregator)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def train(rule_factory, train_data, test_data, epochs, batch_size, seed, learning_rate=3e-3):
    """Returns the test-accuracy curve and the median seconds per epoch."""
    model = _compiled(rule_factory(), seed, learning_rate)
    timer = _EpochTimer()
    keras.utils.set_random_seed(seed)  # the same shuffling for every rule
    history = model.fit(
        *train_data,
        batch_size=batch_size,
        epochs=epochs,
        validation_data=test_data,
        callbacks=[timer],
        verbose=0,
    )
    # The first epoch includes tracing and compilation: report the median epoch.
    return [float(a) for a in history.history["val_accuracy"]], float(np.median(timer.seconds))


def train_dp(
    train_data,
    test_data,
    epochs,
    batch_size,
    seed,
    l2_norm_clip=1.0,
    noise_multiplier=1.0,
    delta=1e-5,
    learning_rate=3e-3,
):
    """DP-SGD on clean digits with Poisson sampling; returns (curve, epsilon, s/epoch)."""
    from pergrad import privacy

    x, y = train_data
    rate = batch_size / len(x)
    sampler = privacy.PoissonSampler(x, y, sampling_rate=rate, seed=seed)
    rule = privacy.dp_gaussian(
        l2_norm_clip, noise_multiplier, expected_batch_size=sampler.expected_batch_size, seed=seed
    )
    model = _compiled(rule, seed, learning_rate)
    timer = _EpochTimer()
    accountant = privacy.PrivacyAccountant(noise_multiplier, rate, delta)
    history = model.fit(
        sampler, epochs=epochs, validation_data=test_data, callbacks=[timer, accountant], verbose=0
    )
    curve = [float(a) for a in history.history["val_accuracy"]]
    return curve, float(history.history["epsilon"][-1]), float(np.median(timer.seconds))


def run(
    rules=None,
    epochs: int = 10,
    batch_size: int = 64,
    corrupted_fraction: float = 0.2,
    seed: int = 0,
    out_dir: str = "demo_output",
    dp: bool = True,
    echo=print,
) -> list[RunResult]:
    rules = rules or DEFAULT_RULES
    train_data, test_data = load_digits_split(seed)
    x_bad, y_bad, rows = corrupt(*train_data, corrupted_fraction)
    datasets = [("clean", train_data), ("corrupted", (x_bad, y_bad))]
    echo(
        f"pergrad demo on the '{keras.backend.backend()}' backend: digits, "
        f"{len(train_data[0])} train / {len(test_data[0])} test examples, "
        f"{rows.mean():.0%} of the corrupted set's training examples corrupted "
        f"(inputs x10, labels changed); {epochs} epochs, batch {batch_size}."
    )
    results = []
    for label, factory in rules:
        for data_name, data in datasets:
            curve, seconds = train(factory, data, test_data, epochs, batch_size, seed)
            results.append(RunResult(label, data_name, curve[-1], seconds, curve))
            echo(f"  {label:<32} {data_name:<9} test accuracy {curve[-1]:.3f}  ({seconds:.2f} s/epoch)")
    dp_line = None
    if dp:
        from pergrad import privacy

        delta = 1e-5
        curve, eps, seconds = train_dp(train_data, test_data, epochs, batch_size, seed, delta=delta)
        results.append(RunResult("dp_gaussian(C=1, z=1)", "clean", curve[-1], seconds, curve))
        dp_line = (
            f"DP-SGD (dp_gaussian, C=1.0, noise multiplier 1.0, Poisson sampling q={batch_size}/"
            f"{len(train_data[0])}, {epochs} epochs) on clean data: test accuracy {curve[-1]:.3f} "
            f"at (epsilon={eps:.2f}, delta={delta:g})."
        )
        echo(
            f"  {'dp_gaussian(C=1, z=1)':<32} {'clean':<9} test accuracy {curve[-1]:.3f}  "
            f"({seconds:.2f} s/epoch), epsilon={eps:.2f}"
        )
        # The same rule, sampling rate and steps, trained once more with canaries.
        audited = privacy.audit(
            data=train_data,
            noise_multiplier=1.0,
            sampling_rate=batch_size / len(train_data[0]),
            epochs=epochs,
            canaries=AUDIT_CANARIES,
            delta=delta,
            seed=seed,
        )
        echo(f"  {'':<32} {audited}")
        dp_line += f" Audited with {AUDIT_CANARIES} canaries in one more run: {audited}."
    echo("")
    echo(table(results))
    if dp_line:
        echo("")
        echo(dp_line)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = plot(results, os.path.join(out_dir, "learning_curves.png"))
        echo(f"\nLearning curves written to {path}")
    return results


def table(results: list[RunResult]) -> str:
    by_rule: dict[str, dict[str, RunResult]] = {}
    for r in results:
        by_rule.setdefault(r.rule, {})[r.data] = r
    lines = [
        "| aggregator | clean accuracy | corrupted accuracy | s/epoch (clean) |",
        "|---|---|---|---|",
    ]
    for rule, runs in by_rule.items():
        clean, bad = runs.get("clean"), runs.get("corrupted")
        bad_accuracy = f"{bad.accuracy:.3f}" if bad else "–"
        lines.append(f"| {rule} | {clean.accuracy:.3f} | {bad_accuracy} | {clean.seconds_per_epoch:.2f} |")
    return "\n".join(lines)


def plot(results: list[RunResult], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, data_name in zip(axes, ("clean", "corrupted")):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
        for r in results:
            if r.data == data_name:
                style = "--" if "bucketing" in r.rule else "-"
                ax.plot(range(1, len(r.curve) + 1), r.curve, style, label=r.rule, marker=".")
        ax.set_title(f"{data_name} training data")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"pergrad on digits ({keras.backend.backend()} backend)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
