"""TensorFlow adapter: ``tf.vectorized_map`` (pfor) over single-example gradients."""

import contextlib
import logging
import warnings

import tensorflow as tf

from pergrad.backend import _tensorflow_conv, _tensorflow_onednn  # noqa: F401 (pfor converters)


def _dense(grads, params):
    # Embedding gradients arrive as IndexedSlices, unconnected ones as None;
    # callers get dense tensors. (UnconnectedGradients.ZERO breaks pfor on RNNs.)
    return [_dense_one(g, p) for g, p in zip(grads, params)]


def _dense_one(g, p):
    if g is None:
        return tf.zeros_like(p)
    if isinstance(g, tf.IndexedSlices) and g.dense_shape is None:
        # Through a graph loop the slices may not know their dense shape: the variable's.
        return tf.math.unsorted_segment_sum(g.values, g.indices, tf.shape(p)[0])
    return tf.convert_to_tensor(g)


def _output_spec(fn, example_spec):
    """Shapes and dtypes of ``fn``'s outputs, from a trace (nothing runs)."""
    traced = tf.function(fn, autograph=False).get_concrete_function(example_spec)
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), traced.structured_outputs)


def _spec(structure, leading):
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec(leading + t.shape[1:].as_list(), t.dtype), structure
    )


@contextlib.contextmanager
def _quiet_pfor():
    """Silences TensorFlow's Python logger while pfor tries to convert our function.

    When a conversion fails (an RNN's while loop with a mask), pfor logs dozens of
    lines of graph dumps at ERROR level before raising; pergrad catches the error
    and warns once, clearly, about its fallback. Only this attempt is silenced:
    the level is restored afterwards.
    """
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _in_graph(value):
    """An eager tensor as a tensor of the graph being traced (pfor converts graph tensors
    only: a constant made eagerly, such as position ids built in a layer's ``build()``,
    raises "Tensor.op is undefined when eager execution is enabled")."""
    if isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value):
        return tf.identity(value)
    return value


def _vectorized_map(fn, elems):
    """``tf.vectorized_map`` with the matrix products converted in a form oneDNN computes
    correctly (``pergrad.backend._tensorflow_onednn``); an output that does not depend on
    the example is repeated for every example, as any loop-invariant output."""

    def example(element):
        return tf.nest.map_structure(_in_graph, fn(element))

    with _tensorflow_onednn.converting():
        return tf.vectorized_map(example, elems, fallback_to_while_loop=True)


# What pfor raises for a graph it cannot convert.
_UNCONVERTIBLE = (TypeError, ValueError, AttributeError)


def vectorized_grad(fn, params, batched, shared, microbatch_size=None):
    def single(example):
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss, aux = fn(params, example, shared)
        return _dense(tape.gradient(loss, params), params), aux

    def vectorized(examples):
        return _vectorized_map(single, examples)

    def loop(error):
        # pfor cannot differentiate some graphs (the while loop of an RNN layer
        # with a mask is one; ctc_loss's gradient, a Defun without the graph pfor asks
        # for, fails with an AttributeError); a graph-level loop over examples gives
        # the same values.
        warnings.warn(
            "tf.vectorized_map could not vectorize the per-example gradient "
            f"({type(error).__name__}: {str(error).strip().splitlines()[-1]}); "
            "falling back to tf.map_fn, which is correct but much slower.",
            stacklevel=4,
        )
        spec = _output_spec(single, _spec(batched, []))
        return tf.map_fn(single, batched, fn_output_signature=spec)

    if microbatch_size is None:
        try:
            # In a function of its own: inside fit()'s graph, a conversion that fails
            # half-way would otherwise leave its stateful ops in the caller's graph,
            # where they run (and fail) at execution time.
            with _quiet_pfor():
                return tf.function(vectorized, autograph=False)(batched)
        except _UNCONVERTIBLE as error:
            return loop(error)
    try:
        with _quiet_pfor():
            out_spec = _output_spec(vectorized, _spec(batched, [microbatch_size]))
    except _UNCONVERTIBLE as error:
        return loop(error)  # one example at a time: within any microbatch size
    leaves = tf.nest.flatten(batched)
    batch_size = tf.shape(leaves[0])[0]
    num_chunks = (batch_size + microbatch_size - 1) // microbatch_size
    padding = num_chunks * microbatch_size - batch_size

    def to_chunks(t):
        t = tf.concat([t, tf.repeat(t[:1], padding, axis=0)], axis=0)
        return tf.reshape(t, tf.concat([[num_chunks, microbatch_size], tf.shape(t)[1:]], 0))

    chunks = tf.nest.map_structure(to_chunks, batched)
    with _quiet_pfor():  # the same conversion again, which succeeded above
        out = tf.map_fn(vectorized, chunks, fn_output_signature=out_spec)

    def from_chunks(t):
        return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))[:batch_size]

    return tf.nest.map_structure(from_chunks, out)


def check_known_problems(layers):
    """Refuses, before anything runs, a vectorized pass that oneDNN could corrupt.

    TensorFlow's oneDNN matmul corrupts the heap on the products pfor makes of a
    sequence model's kernels (``pergrad.backend._tensorflow_onednn``); pergrad's own
    pfor conversions avoid them. Where they could not be installed (a TensorFlow
    release that moved pfor's registry) and oneDNN is on, no model is run.
    """
    del layers
    if _tensorflow_onednn.INSTALLED or not _tensorflow_onednn.enabled():
        return
    raise NotImplementedError(
        f"pergrad cannot vectorize per-example passes safely with this TensorFlow "
        f"({tf.__version__}) while its oneDNN kernels are on: TensorFlow 2.21's oneDNN matmul "
        "corrupts memory on products the vectorized pass makes, and pergrad could not install "
        "its pfor conversions that avoid them (tensorflow.python.ops.parallel_for.pfor has no "
        "converter registry). Set the environment variable TF_ENABLE_ONEDNN_OPTS=0 before "
        "TensorFlow is imported, or use the JAX or PyTorch backend."
    )



def outside_trace():
    """Ops in this context run eagerly on concrete values, also while a ``tf.function`` is traced."""
    return tf.init_scope()

def no_grad(after=None):
    """The optimizer's update context: its ops run after the tensors ``after`` (in a
    graph, a variable update that reads no gradient, such as the optimizer's
    iteration count, would otherwise not wait for a check that ``after`` depends on)."""
    if after is None or tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.control_dependencies(tf.nest.flatten(after))


def compile(fn):
    """``fn`` as a graph function, traced once per input signature (shapes and dtypes,
    as ``jax.jit``). Not ``reduce_retracing``: it relaxes a sample weight of shape
    ``(B,)`` then ``(B, 1)`` to an unknown rank, which the ``map_fn`` fallback cannot
    take."""
    return tf.function(fn, autograph=False)


def assert_at_least(value, minimum, message, guarded=None):
    """Fails at run time (``InvalidArgumentError``) when ``value < minimum``; for
    sizes unknown while tracing.

    Returns ``guarded`` (a nest of tensors) made to depend on the check: in a
    graph, ops that nothing orders after the assertion may run before it fails
    (the optimizer's update did), so callers compute from the returned tensors.
    """
    check = tf.debugging.assert_greater_equal(
        value, tf.cast(minimum, value.dtype), message=message
    )
    with tf.control_dependencies([check] if check is not None else []):
        return tf.nest.map_structure(tf.identity, guarded)


def grad(fn, params):
    """Value and gradient of the scalar ``fn(params)``; zeros where unconnected."""
    with tf.GradientTape() as tape:
        tape.watch(params)
        value = fn(params)
    return value, _dense(tape.gradient(value, params), params)


def scan(f, init, xs):
    """``jax.lax.scan``: ``f(carry, x) -> (carry, y)`` over the leading axis of ``xs``.

    The loop's length may be unknown while tracing (TF's ``fit()`` retraces with
    a ``None`` batch size). Iterations run one at a time, so that at most one
    chunk's intermediates are alive: that is the point of the loop.
    """
    if tf.executing_eagerly():  # one trace for the whole loop, not one per iteration
        return tf.function(lambda init, xs: scan(f, init, xs), autograph=False)(init, xs)
    init = tf.nest.map_structure(tf.convert_to_tensor, init)
    length = tf.shape(tf.nest.flatten(xs)[0])[0]
    specs = (
        tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), init),
        tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), xs),
    )
    # The outputs' dtypes and shapes, from a trace (nothing runs): TensorArrays need them.
    traced = tf.function(f, autograph=False).get_concrete_function(*specs)
    out_specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), traced.structured_outputs[1]
    )
    arrays = [
        tf.TensorArray(s.dtype, size=length, element_shape=s.shape)
        for s in tf.nest.flatten(out_specs)
    ]

    def body(i, carry, arrays):
        carry, out = f(carry, tf.nest.map_structure(lambda t: t[i], xs))
        arrays = [a.write(i, v) for a, v in zip(arrays, tf.nest.flatten(out))]
        return i + 1, carry, arrays

    _, carry, arrays = tf.while_loop(
        lambda i, *_: i < length, body, (tf.constant(0), init, arrays), parallel_iterations=1
    )
    return carry, tf.nest.pack_sequence_as(out_specs, [a.stack() for a in arrays])


def random_state():
    """Nothing: every random draw comes from an explicit seed state."""
    return None


def set_random_state(state):
    del state


def vectorized_call(fn, batched, shared, layout_hints=True):
    """``fn(example, shared)`` for every example at once (``tf.vectorized_map``)."""
    del layout_hints  # torch's concern
    return _vectorized_map(lambda example: fn(example, shared), batched)


def grad_with_aux(fn, params):
    """Gradient of the scalar ``fn(params)[0]`` and ``fn``'s auxiliary outputs.

    In a function of its own, so that a gradient TensorFlow cannot build (the
    while loop that pfor falls back to for a masked RNN) leaves nothing in the
    caller's graph; it raises ``NotImplementedError`` (the statistics path then
    hands the model to the materialized path, which loops with ``tf.map_fn``).
    """

    def run(params):
        with tf.GradientTape() as tape:
            tape.watch(params)
            value, aux = fn(params)
        grads = _dense(tape.gradient(value, params), params)
        # Through a vectorized map whose batch size is unknown, the gradient of a
        # variable loses its static shape, which is the variable's.
        return [tf.ensure_shape(g, p.shape) for g, p in zip(grads, params)], aux

    try:
        with _quiet_pfor():
            return tf.function(run, autograph=False)(list(params))
    # What pfor raises when it cannot convert or differentiate a loop (an RNN's).
    except (TypeError, ValueError, LookupError, NameError, NotImplementedError) as error:
        raise NotImplementedError(
            "TensorFlow cannot differentiate the vectorized forward pass of this model "
            f"({type(error).__name__}: {str(error).strip().splitlines()[-1]})"
        ) from error


def replicas(model=None):
    """Replicas that each run the train step on their own part of the batch.

    ``num_replicas_in_sync`` of the replica context when in one (a custom loop's
    ``strategy.run``), else of the strategy ``fit()`` runs under (the model's,
    Keras's ``distribute_strategy``, or the current one); 1 without a strategy.
    ``MultiWorkerMirroredStrategy`` counts the replicas of every worker.
    """
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        return int(context.num_replicas_in_sync)
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    return int(strategy.num_replicas_in_sync)


def traced_apart(fn):
    """``fn()`` for its Python result only: traced in a graph of its own where it would be
    traced into a ``tf.function``'s (eagerly, run as it is). A dry run's ops stay out of the
    step's graph, where TensorFlow keeps some that nothing uses (a while loop, an RNN's) and
    runs them at every step."""
    if tf.executing_eagerly():
        return fn()
    result = []

    def traced():
        result.append(fn())
        return tf.constant(0)

    tf.function(traced, autograph=False).get_concrete_function()
    return result[0]


def fused(fn):
    """``fn`` compiled by XLA (``jit_compile``): for long chains of small elementwise ops
    (``pergrad.aggregators.selection``'s sorting network), which a plain graph runs one
    kernel at a time, each a pass over memory."""
    return tf.function(fn, jit_compile=True, autograph=False)


def _replica_context():
    """The replica context of a step that runs once per replica (``strategy.run``), else ``None``."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return None
    return context


def replica_id():
    """This replica's index in its sync group under ``strategy.run`` (a Python int where the
    strategy traces each replica apart, as ``MirroredStrategy`` does; else a scalar tensor), else 0."""
    context = _replica_context()
    if context is None:
        return 0
    index = context.replica_id_in_sync_group
    static = tf.get_static_value(index)
    return index if static is None else int(static)


def all_gather(value):
    """The replicas' ``value`` concatenated along axis 0 in replica order (shards of any
    size), on every replica; ``value`` alone."""
    context = _replica_context()
    if context is None:
        return value
    # The result loses the static shape of the other axes, which the layer rules read.
    return tf.ensure_shape(context.all_gather(value, axis=0), [None] + value.shape[1:])


def all_reduce_sum(value):
    """``value`` summed over the replicas in sync (every replica gets the sum); ``value`` alone."""
    context = _replica_context()
    if context is None:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def unscale_loss(loss):
    """Undoes Keras's ``scale_loss_for_distribution`` (the factor ``1 / R`` that Keras's
    mean-reduced losses carry under a strategy with ``R`` replicas in sync)."""
    count = tf.distribute.get_strategy().num_replicas_in_sync
    if count <= 1:
        return loss
    return loss * tf.cast(count, loss.dtype)


def _cluster():
    """``(task types in order, this task's index)`` of the ``TF_CONFIG`` cluster, ``None`` without one."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    jobs = resolver.cluster_spec().as_dict()
    if not jobs:
        return None
    # MultiWorkerMirroredStrategy's order: the chief (if any), then the workers.
    spec = resolver.cluster_spec()
    tasks = [(job, i) for job in ("chief", "worker") if job in jobs for i in range(spec.num_tasks(job))]
    mine = (resolver.task_type, resolver.task_id)
    return tasks, tasks.index(mine) if mine in tasks else 0


def process_count():
    """The worker processes of the ``TF_CONFIG`` cluster (the chief included), as
    ``MultiWorkerMirroredStrategy`` reads them through its cluster resolver; 1 without one."""
    cluster = _cluster()
    return 1 if cluster is None else max(1, len(cluster[0]))


def process_index():
    """This worker's index in the ``TF_CONFIG`` cluster (the chief first), 0 without one."""
    cluster = _cluster()
    return 0 if cluster is None else cluster[1]


def assign_slot(variable, index, value):
    """``variable[index] = value`` on the first axis, in place (one ``ResourceScatterUpdate``,
    not a new tensor of the variable's size); returns ``value``. ``None`` under a
    ``tf.distribute`` strategy, whose mirrored variables take the generic assignment."""
    if tf.distribute.has_strategy():
        return None
    index = tf.reshape(tf.cast(index, "int32"), (1,))
    variable.value.scatter_update(tf.IndexedSlices(tf.expand_dims(value, 0), index))
    return value
