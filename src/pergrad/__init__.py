"""pergrad: per-example gradients and custom aggregation inside Keras 3 ``fit()``."""

from pergrad import aggregators
from pergrad.engine import per_example_gradients
from pergrad.model import PerExampleModel

__all__ = [
    "PerExampleModel",
    "aggregators",
    "per_example_gradients",
]
__version__ = "0.1.0"
