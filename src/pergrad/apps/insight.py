"""What per-example scores are for, shown on scikit-learn's bundled digits (``pergrad insight``).

- **The mislabeled-example finder**: 10% of the training labels are flipped; the
  training examples are ranked by TracIn self-influence over the epochs' checkpoints
  (Pruthi et al., NeurIPS 2020), by EL2N and by GraNd (Paul et al., NeurIPS 2021), and
  by the loss alone; precision@k at k = the number of flipped labels, against a
  random ranking, for several seeds.
- **The data-pruning curve**: keep the fraction of the clean training set with the
  highest EL2N early in training (Paul et al.'s recipe), retrain from scratch, and
  compare test accuracy with keeping a random subset (and the lowest EL2N).
- Plots a person can read at a glance: score histograms (flipped vs clean),
  precision@k, the pruning curve.

The numbers are whatever they honestly are.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import keras
import numpy as np

from pergrad.apps.digits import build_model, load_digits_split, pyplot
from pergrad.insight.scoring import scores

#: The rankings of the finder, in the plots' order; "random" is the baseline.
RANKINGS = ("self_influence", "el2n", "grand", "loss", "random")
_LABELS = {
    "self_influence": "TracIn self-influence",
    "el2n": "EL2N",
    "grand": "GraNd",
    "loss": "loss only",
    "random": "random",
}


#: Class-dependent noise (``noise="pairs"``): a look-alike digit's label for another.
PAIRS = {3: 8, 1: 7}
NOISES = ("uniform", "pairs")


def flip_labels(y, fraction: float, seed: int, classes: int = 10, noise: str = "uniform"):
    """Copies of ``y`` with exactly ``round(fraction * N)`` labels changed, and the boolean
    mask of the flipped rows. ``"uniform"``: random rows, each to a random other class;
    ``"pairs"``: rows of the classes in :data:`PAIRS` only, each to its look-alike (3 to 8, 1
    to 7: class-dependent noise, as a labeller's confusions are)."""
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}; got {noise!r}.")
    rng = np.random.default_rng(seed)
    candidates = np.arange(len(y)) if noise == "uniform" else np.flatnonzero(np.isin(y, list(PAIRS)))
    rows = np.zeros(len(y), bool)
    rows[rng.choice(candidates, int(round(fraction * len(y))), replace=False)] = True
    y = y.copy()
    if noise == "uniform":
        y[rows] = (y[rows] + 1 + rng.integers(0, classes - 1, rows.sum())) % classes
    else:
        y[rows] = [PAIRS[int(label)] for label in y[rows]]
    return y, rows


class _Checkpoints(keras.callbacks.Callback):
    """The weights after every epoch, in memory (what TracIn sums over)."""

    def on_train_begin(self, logs=None):
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


def train(x, y, seed: int, epochs: int, learning_rate: float, batch_size: int = 32, checkpoints=None):
    """The demo's network trained by plain Keras SGD (TracIn's ``lr_c`` is its learning rate)."""
    model = build_model(seed)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    keras.utils.set_random_seed(seed)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[] if checkpoints is None else [checkpoints])
    return model


def precision_at_k(score, flipped, k: int) -> float:
    """The fraction of flipped labels among the ``k`` highest scores."""
    return float(flipped[np.argsort(-score, kind="stable")[:k]].mean())


@dataclass
class FinderResult:
    seed: int
    flipped: np.ndarray
    scores: dict
    precision: dict = field(default_factory=dict)  # ranking -> precision@k, k = flipped count
    seconds: dict = field(default_factory=dict)  # score kind -> seconds to compute it


def find_mislabeled(seed: int, fraction: float = 0.1, epochs: int = 10, learning_rate: float = 0.1,
                    noise: str = "uniform"):
    """Trains on digits with ``fraction`` flipped labels (:func:`flip_labels`'s ``noise``) and
    ranks the training examples."""
    (x, y), _ = load_digits_split(seed)
    y_noisy, flipped = flip_labels(y, fraction, seed, noise=noise)
    checkpoints = _Checkpoints()
    model = train(x, y_noisy, seed, epochs, learning_rate, checkpoints=checkpoints)
    found, seconds = {}, {}
    for kind in ("el2n", "grand", "loss"):
        start = time.perf_counter()
        found[kind] = scores(model, x, y_noisy, kind=kind, batch_size=256, verbose=0)
        seconds[kind] = time.perf_counter() - start
    start = time.perf_counter()
    found["self_influence"] = scores(model, x, y_noisy, kind="self_influence", batch_size=256,
                                     checkpoints=checkpoints.weights, learning_rates=learning_rate,
                                     verbose=0)
    seconds[f"self_influence ({epochs} checkpoints)"] = time.perf_counter() - start
    found["random"] = np.random.default_rng(seed + 1000).random(len(x))
    k = int(flipped.sum())
    result = FinderResult(seed, flipped, found, seconds=seconds)
    result.precision = {name: precision_at_k(found[name], flipped, k) for name in RANKINGS}
    return result


@dataclass
class PruningResult:
    fractions: list
    accuracy: dict  # strategy -> test accuracy per fraction


def pruning_curve(seed: int = 0, fractions=(1.0, 0.8, 0.6, 0.4, 0.2), score_epochs: int = 2,
                  epochs: int = 20, learning_rate: float = 0.1) -> PruningResult:
    """Test accuracy after retraining on the kept fraction of clean digits.

    EL2N after ``score_epochs`` epochs of training, averaged over the checkpoints of two
    runs from different initializations (Paul et al. score early and average over
    runs); ``"highest EL2N"`` keeps the hardest examples (the paper's rule), ``"lowest
    EL2N"`` the easiest, ``"random"`` a random subset. Every retraining runs ``epochs``
    epochs from the same initialization.
    """
    (x, y), (x_test, y_test) = load_digits_split(seed)
    runs = [train(x, y, seed + run, score_epochs, learning_rate) for run in range(2)]
    el2n = np.mean([scores(model, x, y, kind="el2n", batch_size=256, verbose=0) for model in runs], axis=0)
    hardest_first = np.argsort(-el2n, kind="stable")
    orders = {
        "highest EL2N": hardest_first,
        "random": np.random.default_rng(seed + 2000).permutation(len(x)),
        "lowest EL2N": hardest_first[::-1],
    }
    accuracy = {name: [] for name in orders}
    for fraction in fractions:
        kept = int(round(fraction * len(x)))
        for name, order in orders.items():
            rows = np.sort(order[:kept])  # (in the data's order: all of it is one training run)
            model = train(x[rows], y[rows], seed, epochs, learning_rate)
            accuracy[name].append(float(model.evaluate(x_test, y_test, verbose=0)[1]))
    return PruningResult(list(fractions), accuracy)


# -- plots -----------------------------------------------------------------------------


def plot_histograms(result: FinderResult, path: str) -> str:
    plt = pyplot()
    kinds = ("self_influence", "el2n", "grand", "loss")
    fig, axes = plt.subplots(1, len(kinds), figsize=(16, 4))
    for ax, kind in zip(axes, kinds):
        values = result.scores[kind]
        logarithmic = kind in ("self_influence", "grand", "loss")
        shown = np.log10(np.maximum(values, 1e-12)) if logarithmic else values
        bins = np.linspace(shown.min(), shown.max(), 40)
        ax.hist(shown[~result.flipped], bins=bins, alpha=0.6, density=True, label="clean labels")
        ax.hist(shown[result.flipped], bins=bins, alpha=0.6, density=True, label="flipped labels")
        ax.set_title(_LABELS[kind])
        ax.set_xlabel(f"log10 {_LABELS[kind]}" if logarithmic else _LABELS[kind])
        ax.set_ylabel("density")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Scores of digits' training examples, {result.flipped.mean():.0%} labels flipped "
                 f"(seed {result.seed})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_precision(results: list[FinderResult], path: str) -> str:
    plt = pyplot()
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(13, 4.5))
    first = results[0]
    flipped_count = int(first.flipped.sum())
    ks = np.arange(1, 3 * flipped_count + 1)
    for name in RANKINGS:
        order = np.argsort(-first.scores[name], kind="stable")
        hits = np.cumsum(first.flipped[order][: len(ks)])
        curve.plot(ks, hits / ks, label=_LABELS[name])
    curve.axvline(flipped_count, color="gray", linestyle="--", label=f"k = {flipped_count} flipped")
    curve.set_xlabel("k (examples inspected, highest score first)")
    curve.set_ylabel("precision@k (fraction flipped)")
    curve.set_title(f"Precision@k, seed {first.seed}")
    curve.set_ylim(0, 1.02)
    curve.grid(alpha=0.3)
    curve.legend()
    positions = np.arange(len(RANKINGS))
    means = [np.mean([r.precision[name] for r in results]) for name in RANKINGS]
    bars.bar(positions, means, color=[f"C{i}" for i in range(len(RANKINGS))], alpha=0.7)
    for i, name in enumerate(RANKINGS):
        bars.scatter([i] * len(results), [r.precision[name] for r in results], color="black", s=12,
                     zorder=3, label="one seed" if i == 0 else None)
    bars.axhline(0.8, color="gray", linestyle=":", label="goal 0.8")
    bars.set_xticks(positions, [_LABELS[name] for name in RANKINGS], rotation=15)
    bars.set_ylabel("precision@k at k = flipped count")
    bars.set_ylim(0, 1.02)
    bars.set_title(f"Mislabeled-example finder, mean over {len(results)} seeds")
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_pruning(result: PruningResult, path: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    percent = [100 * f for f in result.fractions]
    for name, accuracy in result.accuracy.items():
        ax.plot(percent, accuracy, marker="o", label=f"keep {name}" if name != "random" else "keep random")
    ax.set_xlabel("training data kept (%)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Data pruning on digits: retrained on the kept examples")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the command -----------------------------------------------------------------------


def _diagnostics(out_dir: str, seed: int, echo) -> None:
    """The training diagnostics' plots (norm quantiles, noise scale over training, GSNR)."""
    from pergrad.apps.insight_diagnostics import diagnostics_report

    echo("Training diagnostics (pergrad.insight.diagnostics.GradientDiagnostics) written:")
    for path in diagnostics_report(out_dir, seed):
        echo(f"  {path}")


def run(seeds: int = 3, fraction: float = 0.1, epochs: int = 10, out_dir: str = "insight_output",
        pruning: bool = True, noise: str = "uniform", echo=print) -> dict:
    """The finder over ``seeds`` seeds, the pruning curve, and the plots in ``out_dir``."""
    started = time.perf_counter()
    flips = "to random other classes" if noise == "uniform" else "3 to 8 and 1 to 7"
    echo(f"pergrad insight on the '{keras.backend.backend()}' backend: digits, {fraction:.0%} of the "
         f"training labels flipped ({flips}), {epochs} epochs of SGD, {seeds} seed(s).")
    results = []
    for seed in range(seeds):
        result = find_mislabeled(seed, fraction, epochs, noise=noise)
        results.append(result)
        shown = ", ".join(f"{_LABELS[name]} {result.precision[name]:.3f}" for name in RANKINGS)
        echo(f"  seed {seed}: precision@{int(result.flipped.sum())}: {shown}")
    echo("")
    echo("| ranking | precision@k, k = flipped count (mean over seeds) | per seed |")
    echo("|---|---|---|")
    for name in RANKINGS:
        values = [r.precision[name] for r in results]
        echo(f"| {_LABELS[name]} | {np.mean(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    echo("")
    timing = ", ".join(f"{kind} {1e3 * s:.0f} ms" for kind, s in results[-1].seconds.items())
    echo(f"Scoring time for {len(results[-1].flipped)} examples (last seed): {timing}")
    report = {"finder": results}
    if pruning:
        curve = pruning_curve(0)
        report["pruning"] = curve
        echo("")
        echo("| kept | " + " | ".join(curve.accuracy) + " |")
        echo("|---|" + "---|" * len(curve.accuracy))
        for i, fraction_kept in enumerate(curve.fractions):
            cells = " | ".join(f"{a[i]:.3f}" for a in curve.accuracy.values())
            echo(f"| {fraction_kept:.0%} | {cells} |")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        paths = [plot_histograms(results[0], os.path.join(out_dir, "score_histograms.png")),
                 plot_precision(results, os.path.join(out_dir, "mislabeled_precision.png"))]
        if pruning:
            paths.append(plot_pruning(report["pruning"], os.path.join(out_dir, "pruning_curve.png")))
        echo("")
        echo("Plots written:")
        for path in paths:
            echo(f"  {path}")
        _diagnostics(out_dir, 0, echo)
    echo(f"\npergrad insight took {time.perf_counter() - started:.1f} s.")
    return report
