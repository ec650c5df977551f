"""Operations on a batch of per-example gradients (a list aligned with the trainable
variables, entry k of shape ``(B,) + variable_k.shape``): sizes, sums over the batch
axis, weighted sums and the zeroing of non-finite examples."""

from __future__ import annotations

import keras
from keras import ops

from pergrad.backend import optional_kernel
from pergrad.tensors import example_rows, is_float, row_column, scale_rows


def batch_size_of(gradients) -> int:
    return ops.shape(gradients[0])[0]


def static_batch_size(gradients) -> int | None:
    size = gradients[0].shape[0]
    return int(size) if size is not None else None


def row_range(values, start, size):
    """``values[start : start + size]`` along the batch axis, for tensor bounds too."""
    return ops.slice(values, (start,) + (0,) * (len(values.shape) - 1), (size,) + tuple(values.shape[1:]))


def batch_sum(values):
    """``(B, ...) -> (...)``: the sum over the batch axis (on JAX as one matrix product, the
    adapter's ``batch_sum``; TensorFlow's reduction is the faster one there, 2x)."""
    kernel = optional_kernel("batch_sum")
    return ops.sum(values, axis=0) if kernel is None else kernel(values)


def weighted_sum(gradients, weights) -> list:
    """``sum_i w_i g_i`` per variable; ``weights`` is ``(B,)`` or ``(B, V)``."""
    out = []
    for k, g in enumerate(gradients):
        w = weights if len(weights.shape) == 1 else weights[:, k]
        out.append(ops.reshape(ops.matmul(ops.cast(w, g.dtype)[None, :], example_rows(g))[0], g.shape[1:]))
    return out



def scale_examples(gradients, scales) -> list:
    """Multiplies example i's gradient by ``scales[i]`` (``(B,)``) or ``scales[i, k]`` (``(B, V)``)."""
    out = []
    for k, g in enumerate(gradients):
        s = scales if len(scales.shape) == 1 else scales[:, k]
        out.append(scale_rows(g, s))
    return out


def finite_examples(gradients) -> object:
    """``(B,)`` booleans: whether example i's gradient is finite in every variable."""
    rows = [example_rows(g) for g in gradients]
    return ops.all(ops.stack([ops.all(ops.isfinite(r), axis=1) for r in rows], axis=1), axis=1)


def zero_non_finite_examples(gradients) -> list:
    """Sets to zero the gradient of every example that has a NaN or an infinity.

    ``PerExampleModel`` applies it before a differentially private rule,
    whatever wraps it and on every engine path: the example then contributes
    nothing, which the sensitivity bound allows, whereas a NaN update would
    reveal without noise that it was in the batch.
    """
    return zero_examples(finite_examples(gradients), list(gradients))


def zero_examples(keep, structure):
    """``structure`` (tensors with a leading batch axis) with example i's rows set to zero in
    every floating-point tensor where ``keep[i]`` is false.

    The zeroing runs only when some example is not kept (``keras.ops.cond``): a batch of
    finite examples costs one reduction, not a pass over every tensor (on eager torch that
    pass was a sixth of a DP step of a language model, whose LM head's output gradient is
    B x T x vocabulary). The step's duration then shows whether a batch held a non-finite
    example, as it shows anything else the data changes; only the released update is covered
    by the guarantee.
    """

    def zeroed():
        def where(t):
            if not is_float(t):
                return t
            return ops.where(row_column(keep, t), t, ops.zeros_like(t))

        return keras.tree.map_structure(where, structure)

    return ops.cond(ops.all(keep), lambda: structure, zeroed)
