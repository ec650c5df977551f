"""Small tensor helpers that the engine, the layer rules and the aggregators share.

Backend-neutral (``keras.ops``); this module imports nothing else of pergrad.
"""

from __future__ import annotations

import functools

import keras
from keras import ops


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype) -> str:
    return keras.backend.standardize_dtype(dtype)


def dtype_name(dtype) -> str:
    """``keras.backend.standardize_dtype(dtype)``, remembered per dtype object: the
    statistics path asks it of every tensor it touches, and Keras's answer costs
    microseconds (eager torch steps run it hundreds of times)."""
    try:
        return _dtype_name(dtype)
    except TypeError:  # an unhashable dtype
        return keras.backend.standardize_dtype(dtype)


def is_float(value) -> bool:
    """Whether ``value`` is a tensor (it has a shape and a dtype) of a floating-point dtype."""
    if isinstance(value, (bool, int, float, complex)) or not hasattr(value, "dtype"):
        return False
    return hasattr(value, "shape") and "float" in dtype_name(value.dtype)


def cast(tensor, dtype):
    """``tensor`` in ``dtype``, without an op where it already is (each op costs on torch)."""
    if dtype_name(tensor.dtype) == dtype_name(dtype):
        return tensor
    return ops.cast(tensor, dtype)


def float_count(count):
    """A count (a batch size: a Python int where the shape is static, else a tensor) for
    float32 arithmetic: a Python float where static (no op, exact below 2**24; each op
    costs on an eager backend), else the count cast to float32."""
    return float(count) if isinstance(count, int) else ops.cast(count, "float32")


def as_float32(tensor):
    """Float tensors in float32 (the statistics' dtype), without an op where they are
    already; integer ones (token ids) as they are."""
    return cast(tensor, "float32") if is_float(tensor) else tensor


def gram_block(rows, split=None):
    """``rows rowsᵀ`` of a ``(B, N)`` matrix, or only its block ``[:split, split:]`` (the
    first ``split`` rows against the others) when ``split`` is given. An einsum: Keras's
    torch ``matmul`` returns float32 for float64 operands."""
    first, second = (rows, rows) if split is None else (rows[:split], rows[split:])
    return ops.einsum("in,jn->ij", first, second)


def batch_size_of(tensor):
    """The leading axis's size: static where known, else the tensor's run-time shape."""
    size = tensor.shape[0]
    return ops.shape(tensor)[0] if size is None else size


def example_rows(tensor, dtype=None):
    """``(B, ...) -> (B, size)``: example i's entries as row i (cast to ``dtype`` when given).
    No op where the tensor already is (each costs on an eager backend)."""
    if dtype is not None:
        tensor = cast(tensor, dtype)
    if len(tensor.shape) == 2:
        return tensor
    return ops.reshape(tensor, (batch_size_of(tensor), -1))


def row_column(values, like):
    """``(N,)`` values shaped to broadcast over the rows of ``like`` (``(N, ...)``)."""
    return ops.reshape(values, (-1,) + (1,) * (len(like.shape) - 1))


def all_finite(tensors):
    """A scalar boolean: every entry of every tensor in ``tensors`` is finite."""
    return ops.all(ops.stack([ops.all(ops.isfinite(t)) for t in tensors]))


def scale_rows(tensor, scale):
    """Example i's rows of ``tensor`` (batch first) times ``scale[i]`` (``(B,)``), or times a scalar."""
    scale = ops.cast(scale, tensor.dtype)
    if len(scale.shape) == 0:
        return tensor * scale
    return tensor * row_column(scale, tensor)
