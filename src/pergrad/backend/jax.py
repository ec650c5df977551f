"""JAX adapter: ``jax.vmap(jax.grad(...))``; microbatches with ``jax.lax.map``."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from pergrad.backend._single_replica import (  # noqa: F401
    all_gather,
    all_reduce_sum,
    assert_at_least,
    check_known_problems,
    replica_id,
    unscale_loss,
)


def vectorized_grad(fn, params, batched, shared, microbatch_size=None):
    single_grad = jax.grad(fn, has_aux=True)

    def single(example):
        return single_grad(params, example, shared)

    if microbatch_size is None:
        return jax.vmap(single)(batched)
    return jax.lax.map(single, batched, batch_size=microbatch_size)



def outside_trace():
    """Ops in this context run at once on concrete values, also while a step is traced."""
    return jax.ensure_compile_time_eval()

def no_grad(after=None):
    """The optimizer's update context (JAX's step is a pure function: nothing to order)."""
    return contextlib.nullcontext()


def compile(fn):
    """``fn`` (pure in its arguments) jitted: traced once per input shape."""
    return jax.jit(fn)


def grad(fn, params):
    value, grads = jax.value_and_grad(fn)(params)
    return value, grads


def scan(f, init, xs):
    """``jax.lax.scan``: one chunk's intermediates alive at a time."""
    return jax.lax.scan(f, init, xs)


def random_state():
    """Nothing: every random draw comes from an explicit seed state."""
    return None


def set_random_state(state):
    del state


def vectorized_call(fn, batched, shared, layout_hints=True):
    """``fn(example, shared)`` for every example at once (``jax.vmap``)."""
    del layout_hints  # torch's concern
    return jax.vmap(lambda example: fn(example, shared))(batched)


def grad_with_aux(fn, params):
    """Gradient of the scalar ``fn(params)[0]`` and ``fn``'s auxiliary outputs."""
    return jax.grad(fn, has_aux=True)(params)


def replicas(model=None):
    """1: ``keras.distribution`` (``DataParallel``, ``ModelParallel``) partitions one
    global program (XLA's SPMD partitioner), which keeps single-device semantics;
    no replica runs the step on its own part of the batch."""
    del model
    return 1


def process_count():
    """The JAX processes of this run (``jax.distributed``, which ``keras.distribution.initialize``
    starts): 1 unless it was initialized with several."""
    return jax.process_count()


def process_index():
    """This process's index, ``0 .. process_count() - 1``."""
    return jax.process_index()


def broadcast_from_first(values):
    """Process 0's ``values`` (a NumPy array of the same shape on every process), on every process."""
    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def gather_processes(values):
    """Every process's ``values`` (a NumPy array of the same shape on each), stacked in
    process order: shape ``(process_count(), *values.shape)``."""
    return np.asarray(multihost_utils.process_allgather(values, tiled=False))


def data_part(layout):
    """``(part, parts)``: under the data ``layout`` (a ``keras.distribution.TensorLayout`` of a
    1-D batch), every global batch is ``parts`` equal contiguous parts and this process feeds
    part ``part`` (``jax.make_array_from_process_local_data``, which Keras's trainer calls);
    ``None`` when the layout's devices are not those of every process (each process then runs
    its own program on its own devices)."""
    sharding = layout.backend_layout
    if {device.process_index for device in sharding.device_set} != set(range(jax.process_count())):
        return None
    size = jax.device_count()  # a multiple of the batch axis's devices: whole rows on each
    rows = set()
    for device, index in sharding.devices_indices_map((size,)).items():
        if device.process_index == jax.process_index():
            rows.update(range(size)[index[0]])
    start, count = min(rows), len(rows)
    if rows != set(range(start, start + count)) or size % count or start % count:
        raise ValueError(
            f"This process's devices hold rows {sorted(rows)} of a batch of {size} under the "
            "keras.distribution's data layout: not one contiguous part of equal parts. Order the "
            "mesh's devices by process (keras.distribution.list_devices())."
        )
    return start // count, size // count


def batch_sum(values):
    """``(B, ...) -> (...)``: the sum over the batch axis as the transposed rows times a vector
    of ones. XLA:CPU reduces over a leading axis of a fused expression ~20x slower than this
    product (a 64 x 270k sign sum in a JAX step: 366 ms against 16 ms; ones on the left: 78 ms)."""
    rows = jnp.reshape(values, (values.shape[0], -1))
    return jnp.reshape(rows.T @ jnp.ones((values.shape[0],), rows.dtype), values.shape[1:])
