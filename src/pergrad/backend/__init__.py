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
  on JAX and torch (``pergrad.distributed.replicas`` makes TensorFlow's exact).
- ``replica_id()``, ``all_reduce_sum(value)``, ``all_gather(value)``: this
  replica's index (an int where static), a sum over the replicas in sync, and
  their values concatenated along axis 0 in replica order (0, ``value`` and
  ``value`` outside ``strategy.run``, and on JAX and torch);
  ``unscale_loss(loss)``: undoes the ``1 / R`` that Keras's mean-reduced losses
  carry under a TF strategy with R replicas.
- ``process_count()``, ``process_index()`` (JAX, TF): the processes of the run
  (``jax.distributed``; TF: the ``TF_CONFIG`` cluster's workers); ``broadcast_from_first``,
  ``gather_processes`` and ``data_part(layout)`` (JAX only): host-level collectives over them
  and the part of every global batch this process feeds (``pergrad.distributed.processes``).
- ``random_state()`` / ``set_random_state(state)``: the global generators that
  torch's unseeded random layers draw from (``None`` elsewhere), so that a
  chunk recomputed by ``pergrad.engine.chunked`` draws the same dropout masks.

Some adapters also define *optional kernels*: functions only some backends have (torch's
raw-torch fast paths, TensorFlow's ``fused``, JAX's multi-host collectives). They are all
declared in :data:`OPTIONAL_KERNELS`, and code outside this package asks for one with
:func:`optional_kernel`, which returns the active adapter's function or ``None`` where that backend
has none (the caller then runs its ``keras.ops`` version).
"""

import importlib

import keras


class NotVectorizable(NotImplementedError):
    """The backend's vectorizing transform cannot run this model's forward pass, on any
    engine path (the statistics path does not hand such a model to the materialized one)."""


#: Every optional kernel an adapter may define: ``name -> what it computes (which backends
#: have it)``. :func:`optional_kernel` returns the active adapter's one or ``None``; an adapter
#: defines it under this name, with its full documentation at the definition.
OPTIONAL_KERNELS = {
    # -- the statistics path and the aggregators' norms (raw torch: a Keras op's dispatch,
    #    5-35 us, costs more than its arithmetic at these sizes)
    "row_squared_norms_2d": "``(B,)``: each row's squared norm of a 2-D tensor (torch).",
    "stack_columns": "``(B, V)`` from ``V`` tensors of shape ``(B,)`` (torch).",
    "all_finite": (
        "Whether every entry of a tensor is finite, as a Python bool (torch; only called "
        "where :func:`eager`)."
    ),
    "flat_norms_2d": "``(B,)``: ``sqrt(sum_k squared_norms[:, k])`` (torch).",
    "clip_factors": (
        "``min(1, threshold / norms)`` and how many norms exceed ``threshold`` (torch)."
    ),
    "example_squared_norms": (
        "``(B,)``: each formed per-example gradient's squared norm, any rank (torch)."
    ),
    "example_weighted_sum": "``sum_i w_i g_i`` of formed per-example gradients (torch).",
    # -- layer rules' formulas (torch)
    "outer_per_example": (
        "``(B, d_in, d_out)``: every example's ``A_i^T D_i``, one batched matmul (torch)."
    ),
    "outer_weighted_sum_2d": "``(d_in, d_out)``: ``A^T diag(w) D`` (torch).",
    "weighted_row_sum_2d": "``(d,)``: ``sum_i w_i d_i`` (torch).",
    "token_squared_norms": (
        "``(B,)``: an embedding's per-example squared gradient norm from sorted ids (torch)."
    ),
    "conv_patches": (
        "``(B, T, k, C)``: a convolution's patches by one strided view of the padded "
        "input (torch)."
    ),
    "segment_sum_rows": (
        "``(count, ...)``: rows summed by their ids, as ``keras.ops.segment_sum`` (torch)."
    ),
    # -- the trainer's metrics (torch)
    "add_to_mean": "A Keras ``Mean`` metric's update, in place (torch).",
    "mean_result": "A ``Mean`` metric's result, ``divide_no_nan(total, count)`` (torch).",
    # -- the coordinate-wise selection rules (pergrad.aggregators.selection)
    "sorted_ranks": (
        "Ranks ``[lo, hi)`` over axis 0 of a ``(B, N)`` tensor by NumPy's sort where it "
        "applies (CPU), else ``None`` (torch)."
    ),
    "rank_sums": (
        "The sums of the ranks ``[lo, hi)`` over axis 0 of a ``(B, N)`` tensor and its "
        "columns' NaN flags, where ``sorted_ranks``'s sort applies, else ``None`` "
        "(torch)."
    ),
    "meamed_columns": (
        "``(N,)``: MeaMed per column of a ``(B, N)`` CPU tensor, else ``None`` (torch)."
    ),
    "outer_rank_sums": (
        "Rank sums and NaN flags of per-example outer products ``a_i ⊗ d_i`` without "
        "forming them, else ``None`` (torch)."
    ),
    "outer_meamed": (
        "``(p, q)``: MeaMed of per-example outer products without forming them, else "
        "``None`` (torch)."
    ),
    "batch_sum": (
        "``(...)``: the sum over the batch axis of ``(B, ...)`` as one matrix product: XLA:CPU "
        "reduces over a leading axis of a fused expression ~20x slower (JAX)."
    ),
    "fused": (
        "``fn`` compiled by XLA (``jit_compile``), for long elementwise chains: the "
        "selection rules' sorting network, DP noise's draw (TensorFlow)."
    ),
    # -- DP noise (pergrad.privacy.noise)
    "noise_words": (
        "NumPy's Philox-4x64-10 random words for DP noise, a chunk at a time (torch)."
    ),
    "assign_slot": (
        "``variable[index] = value`` along the first axis, in place, returning ``value``; "
        "``None`` where it cannot (under a ``tf.distribute`` strategy) (TensorFlow, torch; "
        ":func:`assign_slot`)."
    ),
    # -- the engine
    "grad_with_aux_at_outputs": (
        "Gradients with respect to the parameters and to intermediate outputs in one "
        "backward pass (torch)."
    ),
    "traced_apart": (
        "``fn()``'s Python result, its ops traced in a graph of their own, for the dry runs "
        "a step's trace would otherwise keep (TensorFlow; see :func:`traced_apart`)."
    ),
    # -- several processes (pergrad.distributed.processes)
    "process_count": "The processes of the run (JAX, TensorFlow; else 1 is assumed).",
    "process_index": "This process's index (JAX, TensorFlow; else 0 is assumed).",
    "broadcast_from_first": "Process 0's NumPy ``values`` on every process (JAX).",
    "gather_processes": "Every process's NumPy ``values``, stacked in process order (JAX).",
    "data_part": (
        "``(part, parts)``: the part of every global batch this process feeds under a "
        "data layout, or ``None`` (JAX)."
    ),
}


def optional_kernel(name):
    """The active adapter's optional kernel ``name`` (a key of :data:`OPTIONAL_KERNELS`),
    or ``None`` where the backend has none; an undeclared ``name`` raises ``KeyError``."""
    if name not in OPTIONAL_KERNELS:
        raise KeyError(f"{name!r} is not an optional backend kernel (OPTIONAL_KERNELS)")
    return getattr(adapter(), name, None)


def traced_apart(fn):
    """``fn()``, whose result holds no tensors, run by the adapter's ``traced_apart`` where
    it has one (TensorFlow), else called (JAX's compiler drops what nothing uses; torch
    runs eagerly)."""
    apart = optional_kernel("traced_apart")
    return fn() if apart is None else apart(fn)


def assign_slot(variable, index, value):
    """``variable[index] = value`` on the first axis of a Keras variable (``index`` a scalar
    tensor, ``value`` of the shape of one slot): a ring buffer's write of one slot
    (:class:`~pergrad.privacy.BandedMFGaussian`). Returns the slot's new value, for the caller
    to use instead of ``value``.

    In place where the adapter's kernel is (TensorFlow's scatter update, torch's
    ``index_copy_``), which returns ``value`` itself: on TensorFlow a variable written by a
    scatter copies itself at every dense read, so the slot is not read back. Elsewhere the
    variable is assigned ``keras.ops.slice_update`` of its value, which XLA updates in place on
    JAX because the train step donates its state, and the slot is read back from it: XLA
    would otherwise compute ``value`` again in each of its two consumers."""
    kernel = optional_kernel("assign_slot")
    stored = None if kernel is None else kernel(variable, index, value)
    if stored is None:
        start = [index] + [0] * (len(variable.shape) - 1)
        variable.assign(keras.ops.slice_update(variable.value, start, keras.ops.expand_dims(value, 0)))
        stored = keras.ops.take(keras.ops.convert_to_tensor(variable.value), index, axis=0)
    return stored


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
