"""JAX adapter: ``jax.vmap(jax.grad(...))``; microbatches with ``jax.lax.map``."""

import contextlib

import jax

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
