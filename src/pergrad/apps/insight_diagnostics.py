"""Training diagnostics on bundled data, as pictures (docs/diagnostics.md, 'Plots').

:func:`diagnostics_report` trains the digits network of ``pergrad.apps.demo`` with
``mean`` and a :class:`~pergrad.insight.diagnostics.GradientDiagnostics` callback every
step, and draws what it logged: the per-example gradient norm quantiles over
training, the gradient noise scale next to the batch size used, and the GSNR of
every layer's variables. Needs scikit-learn (the data) and matplotlib.
"""

from __future__ import annotations

import os

import keras
import numpy as np

import pergrad
from pergrad.apps.digits import build_model, load_digits_split, pyplot
from pergrad.insight.diagnostics import GradientDiagnostics

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
BATCH_SIZE, EPOCHS, LEARNING_RATE = 64, 12, 3e-3
#: The noise scale's EMA factor: near convergence |G|^2 is small and one batch's estimate
#: noisy, so the ratio needs a long average (McCandlish et al. average over many steps).
SMOOTHING = 0.97


def train_with_diagnostics(seed: int = 0, epochs: int = EPOCHS, batch_size: int = BATCH_SIZE):
    """``(callback, history)``: the digits network trained with ``mean`` and diagnostics."""
    (x_train, y_train), test = load_digits_split(seed)
    model = pergrad.PerExampleModel(build_model(seed), "mean")
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    callback = GradientDiagnostics(quantiles=QUANTILES, threshold=1.0, smoothing=SMOOTHING,
                                   gsnr_every_n_steps=1)  # (the plot: GSNR every step)
    keras.utils.set_random_seed(seed)
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_data=test,
                        callbacks=[callback], verbose=0)
    return callback, history


def _steps_per_epoch(history, callback) -> float:
    return len(callback.history["step"]) / max(len(history.history["loss"]), 1)


def _save(plt, fig, ax, path: str, steps_per_epoch: float, ylabel: str, title: str, legend: str) -> str:
    """A log-scale plot over the training steps, labelled and written to ``path``."""
    ax.set_yscale("log")
    ax.set_xlabel(f"training step ({steps_per_epoch:.0f} per epoch)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc=legend, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_norms(callback, path: str, steps_per_epoch: float) -> str:
    plt = pyplot()
    series = callback.history
    steps = np.array(series["step"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    low, high = series["grad_norm_p10"], series["grad_norm_p90"]
    ax.fill_between(steps, low, high, alpha=0.2, color="tab:blue", label="10th-90th percentile")
    ax.fill_between(steps, series["grad_norm_p25"], series["grad_norm_p75"], alpha=0.35, color="tab:blue",
                    label="25th-75th percentile")
    ax.plot(steps, series["grad_norm_p50"], color="tab:blue", label="median")
    ax.plot(steps, series["grad_norm_p100"], color="tab:red", lw=0.8, label="largest in the batch")
    return _save(plt, fig, ax, path, steps_per_epoch, ylabel="per-example gradient norm ||g_i||",
                 title="Per-example gradient norms over training (digits MLP, mean)", legend="upper right")


def plot_noise_scale(callback, path: str, batch_size: int, steps_per_epoch: float) -> str:
    plt = pyplot()
    series = callback.history
    steps = np.array(series["step"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    per_batch = np.array(series["noise_scale_batch"], dtype=float)
    shown = np.where(per_batch > 0, per_batch, np.nan)  # a negative |G|^2 estimate has no log
    ax.plot(steps, shown, ".", ms=2.5, color="tab:gray", alpha=0.5, label="one batch's estimate")
    ax.plot(steps, series["noise_scale"], color="tab:purple", lw=2,
            label=f"B_simple (EMA {callback.smoothing:g} of tr(Σ) and |G|²)")
    ax.axhline(batch_size, color="black", ls="--", label=f"batch size used ({batch_size})")
    return _save(plt, fig, ax, path, steps_per_epoch, ylabel="examples", legend="upper left",
                 title="Gradient noise scale B_simple = tr(Σ) / |G|²  (McCandlish et al. 2018)")


def plot_gsnr(callback, path: str, steps_per_epoch: float) -> str:
    plt = pyplot()
    series = callback.history
    steps = np.array(series["gsnr_step"])  # (the GSNR's steps)
    names = [k for k in series if k.startswith("gsnr/")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = 10  # a moving average: one batch's GSNR is noisy
    kernel = np.ones(window) / window
    for name in names:
        values = np.array(series[name], dtype=float)
        smooth = np.convolve(values, kernel, mode="valid")
        ax.plot(steps[window - 1:], smooth, label=name[len("gsnr/"):])
    ax.plot(steps[window - 1:], np.convolve(np.array(series["gsnr"], dtype=float), kernel, mode="valid"),
            color="black", lw=2, ls="--", label="all parameters")
    # E[mean^2] / var = GSNR + 1 / B for one batch: the level of a gradient without signal.
    size = float(np.median(series["examples"]))
    ax.axhline(1.0 / size, color="gray", ls=":", label=f"1/B = 1/{size:.0f}: no signal")
    return _save(plt, fig, ax, path, steps_per_epoch, legend="upper right",
                 ylabel=f"mean GSNR over the variable (moving average of {window} steps)",
                 title="Gradient signal-to-noise ratio per variable (Liu et al. 2020)")


def diagnostics_report(output_dir: str, seed: int = 0) -> list[str]:
    """Trains the digits network with diagnostics and writes the plots into ``output_dir``.

    Returns:
        The paths of the PNG files written: the gradient norm quantiles over
        training, the noise scale next to the batch size used, the GSNR per variable.
    """
    os.makedirs(output_dir, exist_ok=True)
    callback, history = train_with_diagnostics(seed)
    per_epoch = _steps_per_epoch(history, callback)
    return [
        plot_norms(callback, os.path.join(output_dir, "diagnostics_norms.png"), per_epoch),
        plot_noise_scale(callback, os.path.join(output_dir, "diagnostics_noise_scale.png"), BATCH_SIZE,
                         per_epoch),
        plot_gsnr(callback, os.path.join(output_dir, "diagnostics_gsnr.png"), per_epoch),
    ]
