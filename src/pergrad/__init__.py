"""pergrad: per-example gradients and custom aggregation inside Keras 3 ``fit()``."""

import importlib

from pergrad import aggregators, insight, layer_rules, layers
from pergrad.engine import per_example_gradients
from pergrad.engine.statistics import per_example_statistics
from pergrad.insight import scores
from pergrad.training.model import PerExampleModel

__all__ = [
    "PerExampleModel",
    "aggregators",
    "insight",
    "layer_rules",
    "layers",
    "per_example_gradients",
    "per_example_statistics",
    "privacy",
    "scores",
]
__version__ = "0.1.0"


def __getattr__(name):
    # PEP 562: `pergrad.privacy` is imported on first use (it builds on
    # pergrad.aggregators, which must not import it in turn).
    if name == "privacy":
        return importlib.import_module("pergrad.privacy")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
