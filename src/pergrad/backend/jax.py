"""JAX adapter: ``jax.vmap(jax.grad(...))``; microbatches with ``jax.lax.map``."""

import contextlib

import jax


def vectorized_grad(fn, params, batched, shared, microbatch_size=None):
    single_grad = jax.grad(fn, has_aux=True)

    def single(example):
        return single_grad(params, example, shared)

    if microbatch_size is None:
        return jax.vmap(single)(batched)
    return jax.lax.map(single, batched, batch_size=microbatch_size)


def assert_at_least(value, minimum, message):
    """Shapes are always known here (JAX retraces per shape, torch runs eagerly)."""
    if int(value) < minimum:
        raise ValueError(message)


def no_grad():
    return contextlib.nullcontext()


def compile(fn):
    """``fn`` (pure in its arguments) jitted: traced once per input shape."""
    return jax.jit(fn)


def grad(fn, params):
    value, grads = jax.value_and_grad(fn)(params)
    return value, grads
