"""Automatic clipping: per-example normalization instead of clipping."""

from __future__ import annotations

from keras import ops

from pergrad.aggregators.base import ExampleStatistics, ScaledMean, serializable
from pergrad.aggregators.registry import register
from pergrad.arguments import check_number


@serializable
class AutomaticClip(ScaledMean):
    """Automatic clipping: each example's gradient normalized, then averaged.

    Example i's gradient is scaled by ``1 / (||g_i|| + gamma)`` instead of
    ``min(1, C / ||g_i||)``: no threshold to tune, since the clipping norm
    ``C`` only rescales the result and is absorbed in the learning rate.
    ``gamma > 0`` is AUTO-S (stable), ``gamma = 0`` AUTO-V. The norm is flat, or
    taken per variable with ``per_layer=True``.

    In :func:`~pergrad.aggregators.chain`, a pre-processing step that passes the
    normalized examples on.

    Args:
        gamma: the stability constant, ``>= 0``; the paper uses 0.01.
        per_layer: normalize each variable's gradient separately.

    References:
        Bu, Wang, Zha, Karypis, 2023, "Automatic clipping: differentially
        private deep learning made easier and stronger", NeurIPS.
    """

    def __init__(self, gamma: float = 0.01, per_layer: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.gamma = check_number("automatic_clip", "gamma", gamma, low=0.0)
        self.per_layer = per_layer

    def example_scales(self, stats: ExampleStatistics):
        norms = (stats.norms if self.per_layer else stats.flat_norms) + self.gamma
        # A zero gradient stays zero (also for gamma = 0): its scale does not matter.
        return 1.0 / ops.where(norms > 0, norms, 1.0)

    def get_config(self):
        return {**super().get_config(), "gamma": self.gamma, "per_layer": self.per_layer}


register("automatic_clip")(AutomaticClip)


def automatic_clip(gamma: float = 0.01, per_layer: bool = False) -> AutomaticClip:
    """The mean of ``g_i / (||g_i|| + gamma)`` (flat or per-variable norms)."""
    return AutomaticClip(gamma, per_layer=per_layer)
