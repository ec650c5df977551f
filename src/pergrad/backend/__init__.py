"""Backend adapters: the only modules that import TensorFlow, JAX or PyTorch.

Each adapter offers the same small set of functions:

- ``vectorized_grad(fn, params, batched, shared, microbatch_size)``: the
  gradient of ``fn(params, example, shared) -> (loss, aux)`` with respect to
  ``params`` for every example of ``batched`` (a nest whose leaves share a
  leading batch axis), vectorized with the backend's own transform. Returns
  ``(gradients, aux)`` with a leading batch axis on every leaf.
- ``value_and_grad(fn, params)``: gradient of a scalar function of ``params``
  (used for batch-level losses such as weight regularizers).
- ``compile(fn)``: ``fn`` (pure in its tensor arguments) compiled once per input
  signature: ``tf.function``, ``jax.jit``; on torch, eager with detached results.
- ``assert_at_least(value, minimum, message)``: a check of a size that may be
  unknown while tracing (TF's ``fit()`` retraces with a ``None`` batch size).
- ``assert_no_python_loop``: nothing; the adapters never loop over examples.
"""

import importlib

import keras


def adapter():
    """Returns the adapter module for the active Keras backend."""
    name = keras.backend.backend()
    if name not in ("tensorflow", "jax", "torch"):
        raise NotImplementedError(
            f"pergrad supports the tensorflow, jax and torch backends; the active "
            f"Keras backend is {name!r}."
        )
    return importlib.import_module(f"pergrad.backend.{name}")
