"""TensorFlow adapter: ``tf.vectorized_map`` (pfor) over single-example gradients."""

import contextlib
import warnings

import tensorflow as tf


def _dense(grads, params):
    # Embedding gradients arrive as IndexedSlices, unconnected ones as None;
    # callers get dense tensors. (UnconnectedGradients.ZERO breaks pfor on RNNs.)
    return [
        tf.zeros_like(p) if g is None else tf.convert_to_tensor(g) for g, p in zip(grads, params)
    ]


def _output_spec(fn, example_spec):
    """Shapes and dtypes of ``fn``'s outputs, from a trace (nothing runs)."""
    traced = tf.function(fn).get_concrete_function(example_spec)
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), traced.structured_outputs)


def _spec(structure, leading):
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec(leading + t.shape[1:].as_list(), t.dtype), structure
    )


def vectorized_grad(fn, params, batched, shared, microbatch_size=None):
    def single(example):
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss, aux = fn(params, example, shared)
        return _dense(tape.gradient(loss, params), params), aux

    def vectorized(examples):
        return tf.vectorized_map(single, examples, fallback_to_while_loop=True)

    def loop(error):
        # pfor cannot differentiate some graphs (the while loop of an RNN layer
        # with a mask is one); a graph-level loop over examples gives the same values.
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
            return tf.function(vectorized, autograph=False)(batched)
        except (TypeError, ValueError) as error:
            return loop(error)
    try:
        out_spec = _output_spec(vectorized, _spec(batched, [microbatch_size]))
    except (TypeError, ValueError) as error:
        return loop(error)  # one example at a time: within any microbatch size
    leaves = tf.nest.flatten(batched)
    batch_size = tf.shape(leaves[0])[0]
    num_chunks = (batch_size + microbatch_size - 1) // microbatch_size
    padding = num_chunks * microbatch_size - batch_size

    def to_chunks(t):
        t = tf.concat([t, tf.repeat(t[:1], padding, axis=0)], axis=0)
        return tf.reshape(t, tf.concat([[num_chunks, microbatch_size], tf.shape(t)[1:]], 0))

    chunks = tf.nest.map_structure(to_chunks, batched)
    out = tf.map_fn(vectorized, chunks, fn_output_signature=out_spec)

    def from_chunks(t):
        return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))[:batch_size]

    return tf.nest.map_structure(from_chunks, out)


def no_grad():
    return contextlib.nullcontext()


def compile(fn):
    """``fn`` as a graph function, traced once per input signature (shapes and dtypes,
    as ``jax.jit``). Not ``reduce_retracing``: it relaxes a sample weight of shape
    ``(B,)`` then ``(B, 1)`` to an unknown rank, which the ``map_fn`` fallback cannot
    take."""
    return tf.function(fn, autograph=False)


def assert_at_least(value, minimum, message):
    """Fails at run time (``InvalidArgumentError``) when ``value < minimum``; for
    sizes unknown while tracing."""
    tf.debugging.assert_greater_equal(value, tf.cast(minimum, value.dtype), message=message)


def grad(fn, params):
    """Value and gradient of the scalar ``fn(params)``; zeros where unconnected."""
    with tf.GradientTape() as tape:
        tape.watch(params)
        value = fn(params)
    return value, _dense(tape.gradient(value, params), params)
