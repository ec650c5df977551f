"""The engine: per-example gradients and their statistics (docs/architecture.md, 'Engine paths').

- :mod:`~pergrad.engine.problem`: the single-example loss ``L_i`` and the model checks;
- :mod:`~pergrad.engine.materialized`: every ``g_i`` by a vectorized backward pass (the reference);
- :mod:`~pergrad.engine.statistics`: norms, Gram matrix and weighted sums of the ``g_i`` from
  each layer's input and output gradient, in one backward pass (``pergrad.layer_rules``), and
  ``mean``/``sum`` as one ordinary backward pass; built on
  :mod:`~pergrad.engine.plan` (the dry run: which layer calls to probe, with which rule),
  :mod:`~pergrad.engine.capture` (the probed forward and backward pass: each call's ``A`` and ``D``)
  and :mod:`~pergrad.engine.layers` (the per-layer store and the statistics from it);
- :mod:`~pergrad.engine.streaming`: coordinate rules one variable at a time from the same ``A`` and ``D``;
- :mod:`~pergrad.engine.chunked`: a statistics rule accumulated ``microbatch_size`` examples at a time.
"""

from pergrad.engine.materialized import per_example_gradients
from pergrad.engine.problem import PerExampleProblem, check_model, mean_reduced

__all__ = ["PerExampleProblem", "check_model", "mean_reduced", "per_example_gradients"]
