"""Insight from per-example gradients: training diagnostics (a Keras callback) and
per-example scores (data valuation, mislabeled examples). docs/diagnostics.md, docs/scores.md."""

from pergrad.insight.diagnostics import GradientDiagnostics, batch_diagnostics, noise_scale_estimates
from pergrad.insight.scoring import KINDS, scores

__all__ = ["KINDS", "GradientDiagnostics", "batch_diagnostics", "noise_scale_estimates", "scores"]
