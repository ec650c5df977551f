"""pergrad: per-example gradients and custom aggregation inside Keras 3 ``fit()``."""

from pergrad import aggregators, layer_rules
from pergrad.engine import per_example_gradients
from pergrad.engine.statistics import per_example_statistics
from pergrad.model import PerExampleModel

__all__ = [
    "PerExampleModel",
    "aggregators",
    "layer_rules",
    "per_example_gradients",
    "per_example_statistics",
]
__version__ = "0.1.0"
