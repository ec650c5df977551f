"""Backend adapters: the only modules that import TensorFlow, JAX or PyTorch.

Each adapter offers the same small set of functions (none loops over examples in
Python, except torch's chunk loop of ``pergrad.engine.chunked``, over chunks):

- ``vectorized_grad(fn, params, batched, shared, microbatch_size)``: the
  gradient of ``fn(params, example, shared) -> (loss, aux)`` with respect to
  ``params`` for every example of ``batched`` (a nest whose leaves share a
  leading batch axis), vectorized with the backend's own transform. Returns
  ``(gradients, aux)`` with a leading batch axis on every leaf.
- ``vectorized_call(fn, batched, shared)``: ``fn(example, shared)`` for every
  example, vectorized (the statistics path's forward pass, differentiable).
- ``grad_with_aux(fn, params)``: gradient of ``fn(params) -> (scalar, aux)``
  and ``aux`` (the statistics path's one backward pass).
- ``grad(fn, params)``: value and gradient of a scalar function of ``params``
  (used for batch-level losses such as weight regularizers).
- ``assert_at_least(value, minimum, message, guarded)``: a check of a size that
  may be unknown while tracing (TF's ``fit()`` retraces with a ``None`` batch
  size); returns ``guarded`` made to depend on it.
- ``no_grad(after)``: the context of the optimizer's update (no autograd on
  torch; on TF its ops run after the tensors ``after``).
- ``check_known_problems(layers)``: raises, before anything runs, for layers the
  backend is known to break in the vectorized pass (TensorFlow's oneDNN matmul,
  where pergrad's pfor conversions that avoid it are missing).
- ``outside_trace()``: a context whose ops run at once on concrete values, also
  while a step is traced (``tf.init_scope``, ``jax.ensure_compile_time_eval``).
- ``compile(fn)``: ``fn`` (pure in its tensor arguments) compiled once per input
  signature: ``tf.function``, ``jax.jit``; on torch, eager with detached results.
- ``scan(f, init, xs)`` (TF, JAX): ``jax.lax.scan`` in the graph, for
  ``pergrad.engine.chunked``; torch sets ``EAGER_LOOPS`` and is looped in Python.
- ``replicas(model)``: how many replicas each run the train step on their own
  part of the batch (a ``tf.distribute`` strategy's replicas in sync, a
  ``torch.distributed`` world size; 1 on JAX, whose ``keras.distribution``
  partitions one global program); ``PerExampleModel`` refuses more than 1
  on JAX and torch (``pergrad.replicas`` makes TensorFlow's exact).
- ``replica_id()``, ``all_reduce_sum(value)``, ``all_gather(value)``: this
  replica's index (an int where static), a sum over the replicas in sync, and
  their values concatenated along axis 0 in replica order (0, ``value`` and
  ``value`` outside ``strategy.run``, and on JAX and torch);
  ``unscale_loss(loss)``: undoes the ``1 / R`` that Keras's mean-reduced losses
  carry under a TF strategy with R replicas.
- ``process_count()``, ``process_index()`` (JAX, TF): the processes of the run
  (``jax.distributed``; TF: the ``TF_CONFIG`` cluster's workers); ``broadcast_from_first``,
  ``gather_processes`` and ``data_part(layout)`` (JAX only): host-level collectives over them
  and the part of every global batch this process feeds (``pergrad.processes``).
- ``fused(fn)`` (TF only): ``fn`` compiled by XLA, for
  ``pergrad.aggregators.selection``'s sorting network.
- ``traced_apart(fn)`` (TF only; :func:`traced_apart` elsewhere calls ``fn``): ``fn()``'s
  Python result, its ops traced in a graph of their own, for the dry runs (the
  statistics path's plan, the model checks) that a step's trace would otherwise keep.
- ``sorted_ranks(x, lo, hi)`` (torch only): ranks ``[lo, hi)`` over axis 0 of a
  ``(B, N)`` tensor by NumPy's sort where it applies (CPU), else ``None``, for
  ``pergrad.aggregators.selection``.
- ``random_state()`` / ``set_random_state(state)``: the global generators that
  torch's unseeded random layers draw from (``None`` elsewhere), so that a
  chunk recomputed by ``pergrad.engine.chunked`` draws the same dropout masks.
"""

import importlib

import keras


class NotVectorizable(NotImplementedError):
    """The backend's vectorizing transform cannot run this model's forward pass, on any
    engine path (the statistics path does not hand such a model to the materialized one)."""


def traced_apart(fn):
    """``fn()``, whose result holds no tensors, run by the adapter's ``traced_apart`` where
    it has one (TensorFlow), else called (JAX's compiler drops what nothing uses; torch
    runs eagerly)."""
    apart = getattr(adapter(), "traced_apart", None)
    return fn() if apart is None else apart(fn)


def adapter():
    """Returns the adapter module for the active Keras backend."""
    name = keras.backend.backend()
    module = _ADAPTERS.get(name)  # (keyed on the backend: called many times a step)
    if module is None:
        if name not in ("tensorflow", "jax", "torch"):
            raise NotImplementedError(
                f"pergrad supports the tensorflow, jax and torch backends; the active "
                f"Keras backend is {name!r}."
            )
        module = _ADAPTERS[name] = importlib.import_module(f"pergrad.backend.{name}")
    return module


_ADAPTERS = {}


def eager():
    """Whether the active backend runs pergrad's loops in Python (torch's
    ``EAGER_LOOPS``: no graph, so a loop over known sizes costs nothing to trace)."""
    return getattr(adapter(), "EAGER_LOOPS", False)
