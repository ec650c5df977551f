"""Gradient diagnostics (``pergrad.insight.diagnostics``) against a NumPy reference.

The reference is computed in float64 from the materialized per-example gradients
(``pergrad.per_example_gradients``, itself checked against the batch-of-one
oracle), on the shared test problems: every quantile, the fraction above a
threshold, the noise scale's estimators and every variable's GSNR (which reads the
layer rules' ``sum_grad_squared``). Through ``fit()``: the values logged by the
train step are those of the batch at the step's weights, they reach ``History``,
and the update is bit for bit the one without the callback.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
import problems
from pergrad.insight import diagnostics
from pergrad.insight.diagnostics import NEGLIGIBLE_GRADIENT, GradientDiagnostics, batch_diagnostics

QUANTILES = (0.0, 0.25, 0.5, 0.9, 1.0)
# dense, conv, embedding (a repeated token), layer norm, attention (EinsumDense on
# sequences), and a Dense layer called twice with a layer without a rule and a tied
# table (shared variables, the fallback).
NAMES = ["dense_mlp", "conv1d", "embedding", "layer_norm", "attention", "shared_and_fallback"]


def reference(gradients, quantiles, threshold):
    """The diagnostics in NumPy (float64) from per-example gradients."""
    grads = [np.asarray(keras.ops.convert_to_numpy(g), "float64") for g in gradients]
    size = grads[0].shape[0]
    rows = [g.reshape(size, -1) for g in grads]
    norms = np.sqrt(sum((r * r).sum(axis=1) for r in rows))
    out = {f"grad_norm_p{100 * q:g}": np.quantile(norms, q) for q in quantiles}
    out[f"grad_norm_above_{threshold:g}"] = np.mean(norms > threshold)
    mean_squared = np.mean(norms**2)
    batch_squared = sum((r.mean(axis=0) ** 2).sum() for r in rows)
    out["gradient_sq_norm"] = (size * batch_squared - mean_squared) / (size - 1)
    out["gradient_variance"] = (mean_squared - batch_squared) * size / (size - 1)
    ratios = []
    largest = max((r * r).sum(axis=0).max() for r in rows)
    for r in rows:
        mean, variance = r.mean(axis=0), r.var(axis=0)
        varies = (variance > 0) & ((r * r).sum(axis=0) > NEGLIGIBLE_GRADIENT**2 * largest)
        ratios.append(mean[varies] ** 2 / variance[varies])
    out["gsnr"] = np.concatenate(ratios).mean()
    return out, [ratio.mean() if ratio.size else np.nan for ratio in ratios]


def _compiled(name):
    problem = problems.make(name)
    problem.compile()
    return problem


@pytest.mark.parametrize("name", NAMES)
def test_batch_diagnostics_match_numpy(name):
    problem = _compiled(name)
    model = problem.model
    gradients = pergrad.per_example_gradients(model, problem.x, problem.y, problem.sample_weight)
    threshold = float(np.mean(reference(gradients, QUANTILES, 0.0)[0]["grad_norm_p50"]))
    threshold = round(threshold, 3) + 5e-4  # (the key shows it with 6 digits) not a norm
    values = batch_diagnostics(model, problem.x, problem.y, problem.sample_weight, quantiles=QUANTILES,
                               threshold=threshold)
    expected, per_variable = reference(gradients, QUANTILES, threshold)
    assert 0 < expected[f"grad_norm_above_{threshold:g}"] < 1  # the threshold splits the batch
    for key, value in expected.items():
        np.testing.assert_allclose(values[key], value, rtol=2e-4, atol=1e-6, err_msg=key)
    paths = [v.path for v in model.trainable_variables]
    for path, value in zip(paths, per_variable):
        np.testing.assert_allclose(values[f"gsnr/{path}"], value, rtol=2e-4, atol=1e-6, err_msg=path)
    assert values["examples"] == problem.batch_size


def _fit(problem, aggregator="mean", callbacks=(), path="auto", epochs=2):
    wrapper = pergrad.PerExampleModel(problem.model, aggregator, path=path)
    wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss=problem.loss)
    history = wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=3,
                          epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return wrapper, history


def test_fit_logs_the_step_batch_diagnostics():
    problem = _compiled("dense_mlp")
    first = problem.x[:3], problem.y[:3], problem.sample_weight[:3]
    expected = batch_diagnostics(problem.model, *first, threshold=3.0)
    # The GSNR on a sparser schedule than the norms: steps 0 and 2 of 0..3.
    callback = GradientDiagnostics(threshold=3.0, smoothing=0.5, gsnr_every_n_steps=2)
    _, history = _fit(problem, "mean", [keras.callbacks.CSVLogger("/dev/null"), callback])
    # Before the first update: the first batch at the initial weights.
    for key, value in expected.items():
        np.testing.assert_allclose(callback.history[key][0], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert callback.history["step"] == [0, 1, 2, 3]
    assert callback.history["gsnr_step"] == [0, 2]
    assert all(len(v) == 2 for k, v in callback.history.items() if k.startswith("gsnr"))
    assert len(callback.history["grad_norm_p50"]) == 4
    # The noise scale: the EMAs of the two estimators, each batch's weight 1 - 0.5.
    trace = np.array(callback.history["gradient_variance"])
    squared = np.array(callback.history["gradient_sq_norm"])
    weights = 0.5 ** np.arange(len(trace))[::-1]
    np.testing.assert_allclose(callback.history["noise_scale"][-1], (weights @ trace) / (weights @ squared),
                               rtol=1e-6)
    logs = history.history
    kernel = problem.model.trainable_variables[0].path
    for key in ("loss", "grad_norm_p50", "grad_norm_above_3", "noise_scale", "gsnr", f"gsnr/{kernel}"):
        assert len(logs[key]) == 2, key
    assert "gradient_variance" not in logs and "examples" not in logs  # raw values stay in .history
    np.testing.assert_allclose(logs["grad_norm_p50"][1], np.mean(callback.history["grad_norm_p50"][2:]),
                               rtol=1e-6)
    np.testing.assert_allclose(logs["noise_scale"][1], callback.history["noise_scale"][-1], rtol=1e-6)
    np.testing.assert_allclose(logs["gsnr"], callback.history["gsnr"], rtol=1e-6)  # one GSNR step each


def test_the_progress_bar_shows_aggregates_and_history_every_variable(capsys):
    problem = _compiled("dense_mlp")
    wrapper = pergrad.PerExampleModel(problem.model, "mean")
    wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss=problem.loss)
    history = wrapper.fit(problem.x, problem.y, batch_size=3, epochs=2, verbose=2,
                          callbacks=[GradientDiagnostics(progress_bar=True)])
    shown = capsys.readouterr().out
    assert "gsnr:" in shown and "noise_scale:" in shown and "gsnr/" not in shown, shown
    kernel = problem.model.trainable_variables[0].path
    assert len(history.history[f"gsnr/{kernel}"]) == 2


def test_tensorboard_writes_every_variable(tmp_path):
    pytest.importorskip("tensorboard", reason="Keras's TensorBoard callback needs the tensorboard package")
    pytest.importorskip("tensorflow", reason="Keras's TensorBoard callback writes with tf.summary")
    problem = _compiled("dense_mlp")
    _fit(problem, "mean", [keras.callbacks.TensorBoard(str(tmp_path)), GradientDiagnostics()])
    written = b"".join(path.read_bytes() for path in (tmp_path / "train").glob("events.out.tfevents.*"))
    kernel = problem.model.trainable_variables[0].path
    assert f"epoch_gsnr/{kernel}".encode() in written and b"epoch_noise_scale" in written


@pytest.mark.parametrize("aggregator", ["mean", "clip", "median"])
def test_training_is_unchanged(aggregator, monkeypatch):
    rule = (lambda: pergrad.aggregators.clip(1.0)) if aggregator == "clip" else lambda: aggregator
    # median on the materialized path: the diagnostics from the step's per-example gradients.
    path = "materialized" if aggregator == "median" else "auto"
    plain, _ = _fit(_compiled("dense_mlp"), rule(), path=path)
    # mean's backward pass (with the probes) and clip's capture serve the diagnostics:
    # no capture of their own.
    def second_pass(*args, **kwargs):
        raise AssertionError("the diagnostics ran a capture of their own")

    monkeypatch.setattr(diagnostics, "layers_of", second_pass)
    problem = _compiled("dense_mlp")
    if aggregator == "median":
        monkeypatch.undo()
        first = problem.x[:3], problem.y[:3], problem.sample_weight[:3]
        expected = batch_diagnostics(problem.model, *first, threshold=1.0)
        monkeypatch.setattr(diagnostics, "layers_of", second_pass)
    callback = GradientDiagnostics(every_n_steps=3, threshold=1.0, gsnr_every_n_steps=3)
    watched, _ = _fit(problem, rule(), [callback], path=path)
    for a, b in zip(plain.model.get_weights(), watched.model.get_weights()):
        if keras.backend.backend() == "tensorflow":
            # TensorFlow (oneDNN on, its default) rounds the joint backward graph of the
            # variables and the probes differently in the last bit: equal to float32 rounding.
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert np.array_equal(a, b)  # bit for bit
    assert callback.history["step"] == [0, 3]
    if aggregator == "median":
        for key, value in expected.items():
            np.testing.assert_allclose(callback.history[key][0], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_refuses_a_plain_keras_model():
    problem = _compiled("dense_mlp")
    with pytest.raises(TypeError, match="PerExampleModel"):
        problem.model.fit(problem.x, problem.y, epochs=1, verbose=0, callbacks=[GradientDiagnostics()])


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="every_n_steps"):
        GradientDiagnostics(every_n_steps=0)
    with pytest.raises(ValueError, match="quantiles"):
        GradientDiagnostics(quantiles=(0.5, 2.0))
    with pytest.raises(ValueError, match="smoothing"):
        GradientDiagnostics(smoothing=1.0)
    with pytest.raises(ValueError, match="gsnr_every_n_steps"):
        GradientDiagnostics(every_n_steps=2, gsnr_every_n_steps=3)
    assert GradientDiagnostics(every_n_steps=3).gsnr_every_n_steps == 30


def test_the_diagnostics_plots_draw_what_the_callback_logged(tmp_path):
    """``pergrad insight``'s plots (apps/insight_diagnostics.py): one epoch of the digits network, the
    three pictures written as PNG files of the callback's series."""
    from pergrad.apps import insight_diagnostics as plots

    callback, history = plots.train_with_diagnostics(epochs=1)
    per_epoch = plots._steps_per_epoch(history, callback)
    assert per_epoch == len(callback.history["step"]) > 0
    paths = [plots.plot_norms(callback, str(tmp_path / "norms.png"), per_epoch),
             plots.plot_noise_scale(callback, str(tmp_path / "noise.png"), plots.BATCH_SIZE, per_epoch),
             plots.plot_gsnr(callback, str(tmp_path / "gsnr.png"), per_epoch)]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert plots.pyplot().get_fignums() == []  # every figure closed
