"""pfor conversions of matrix products (and softmaxes) that TensorFlow's oneDNN kernels compute correctly.

TensorFlow 2.21 on x86 runs ``BatchMatMulV2`` and ``Einsum`` with oneDNN's
matmul (on by default; ``TF_ENABLE_ONEDNN_OPTS=0`` turns it off). Its x64
``brgemm`` matmul corrupts the heap when the left operand is 4-D with a second
axis of size 1 and the right operand is broadcast over every batch axis, such
as ``(8, 1, T, d) @ (d, u)`` (the shape of oneDNN issue 4396; oneDNN PR 4632
fixes such a source; TF issues 117700 and 123109): the process aborts later
(``free(): invalid pointer``, ``malloc(): unaligned tcache chunk``, a
segfault) or hangs.

pergrad's vectorized pass makes exactly that shape. The single-example loss
gives Keras a batch of one, ``(1, T, d)``, and pfor stacks the examples in
front, ``(B, 1, T, d)``; a ``Dense`` or ``EinsumDense`` kernel is the same for
every example, so pfor multiplies the stacked ``(B, 1, T, d)`` by the
broadcast ``(d, u)``: every sequence model (attention projections, a
transformer's feed-forward ``Dense`` layers) in the forward and the backward
pass.

While pergrad converts its own functions (:func:`converting`), the converters
of ``BatchMatMulV2`` and ``Einsum`` drop every axis of size 1 in all operands
(the example's batch of one, a single head) before the product and restore it
after: the same values, computed on ``(B, T, d)``, and no 4-D operand with a
unit second axis is left. Elsewhere TensorFlow's own converters run.

oneDNN's ``Softmax`` also refuses an operand of more than 5 dimensions ("Input dims must
be <= 5 and >=1"): keras-hub Gemma's attention scores are 5-D for one example, 6-D once
pfor stacks the examples. While pergrad converts its functions, ``Softmax`` and
``LogSoftmax`` run on the operand flattened to a matrix (:func:`softmax_in_two_dims`).

pfor has no public hook for this: the converters are replaced in its registry
(``tensorflow.python.ops.parallel_for.pfor``). :data:`INSTALLED` says whether
that worked; if a TensorFlow release moves the registry, the adapter refuses
to run the vectorized pass with oneDNN on instead of risking the corruption.
"""

from __future__ import annotations

import contextlib
import os
import string
import threading

import tensorflow as tf

_STATE = threading.local()


@contextlib.contextmanager
def converting():
    """pergrad's conversions for the ``tf.vectorized_map`` calls traced in this context."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def in_our_maps() -> bool:
    """Whether this thread is inside pergrad's own vectorized maps (where our converters apply)."""
    return getattr(_STATE, "depth", 0) > 0


def matmul_without_unit_batch_axes(x, y, adjoint_a=False, adjoint_b=False):
    """``tf.matmul(x, y)`` with the batch axes that are 1 in both operands squeezed
    before the product and restored after (the batch axes broadcast as in ``tf.matmul``)."""
    if x.shape.rank is None or y.shape.rank is None:
        return tf.matmul(x, y, adjoint_a=adjoint_a, adjoint_b=adjoint_b)
    rank = max(x.shape.rank, y.shape.rank)

    def batch_dims(t):
        dims = t.shape.as_list()[:-2]
        return [1] * (rank - 2 - len(dims)) + dims

    unit = [i for i, (a, b) in enumerate(zip(batch_dims(x), batch_dims(y))) if a == 1 and b == 1]

    def squeezed(t):
        offset = rank - t.shape.rank  # t's batch axes are the last ones of the broadcast batch
        axes = [i - offset for i in unit if i >= offset]
        return tf.squeeze(t, axes) if axes else t

    out = tf.matmul(squeezed(x), squeezed(y), adjoint_a=adjoint_a, adjoint_b=adjoint_b)
    for axis in unit:
        out = tf.expand_dims(out, axis)
    return out


def einsum_without_unit_labels(equation, *operands):
    """``tf.einsum(equation, *operands)`` with every label whose axes are all of size 1
    dropped before the product and restored in the output after (no ellipsis)."""
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    sizes = {}
    for term, operand in zip(terms, operands):
        for label, size in zip(term, operand.shape.as_list()):
            sizes.setdefault(label, []).append(size)
    unit = {label for label, found in sizes.items() if all(size == 1 for size in found)}
    if not unit:
        return tf.einsum(equation, *operands)
    squeezed = [
        tf.squeeze(operand, [k for k, label in enumerate(term) if label in unit])
        if any(label in unit for label in term) else operand
        for term, operand in zip(terms, operands)
    ]
    kept = [("".join(label for label in term if label not in unit)) for term in terms]
    out = tf.einsum(f"{','.join(kept)}->{''.join(l for l in output if l not in unit)}", *squeezed)
    for axis, label in enumerate(output):
        if label in unit:
            out = tf.expand_dims(out, axis)
    return out


def softmax_in_two_dims(x, log=False):
    """``tf.nn.softmax(x)`` (``log_softmax`` with ``log``) over the last axis, computed on
    ``x`` flattened to a matrix and reshaped back: the same values, and no operand of
    more than 5 dimensions for oneDNN's softmax, which refuses one ("Input dims must be
    <= 5 and >=1"; pfor stacks the examples in front of an attention's 5-D scores)."""
    op = tf.nn.log_softmax if log else tf.nn.softmax
    if x.shape.rank is not None and x.shape.rank <= 2:
        return op(x)
    shape = tf.shape(x)
    return tf.reshape(op(tf.reshape(x, tf.stack([-1, shape[-1]]))), shape)


def enabled() -> bool:
    """Whether this process runs TensorFlow's oneDNN kernels (fixed when TensorFlow loads)."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):  # TensorFlow's default on x86 is on
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower() not in ("0", "false")


def converter_registry(names):
    """``(registry, wrap, converters)``: pfor's private converter registry, its ``wrap`` and
    TensorFlow's converters of the ops ``names``; ``None`` where a TensorFlow release moved
    them."""
    try:
        from tensorflow.python.ops.parallel_for import pfor
    except ImportError:
        return None
    registry = getattr(pfor, "_pfor_converter_registry", None)
    wrap = getattr(pfor, "wrap", None)
    if not isinstance(registry, dict) or wrap is None or any(registry.get(n) is None for n in names):
        return None
    return registry, wrap, [registry[n] for n in names]


def _install() -> bool:
    found = converter_registry(("BatchMatMulV2", "Einsum"))
    if found is None:
        return False
    registry, wrap, (original_matmul, original_einsum) = found
    if getattr(original_einsum, "pergrad", False):  # installed already (a reloaded module)
        return True

    def batch_matmul_v2(pfor_input):
        if not in_our_maps():
            return original_matmul(pfor_input)
        pfor_input.expanddim_inputs_for_broadcast()  # as TensorFlow's converter
        out = matmul_without_unit_batch_axes(
            pfor_input.input(0)[0], pfor_input.input(1)[0],
            adjoint_a=pfor_input.get_attr("adj_x"), adjoint_b=pfor_input.get_attr("adj_y"),
        )
        return wrap(out, True)

    def einsum(pfor_input):
        equation = pfor_input.get_attr("equation").decode("utf-8")
        inputs = [pfor_input.input(i) for i in range(pfor_input.num_inputs)]
        if not in_our_maps() or "." in equation or any(t.shape.rank is None for t, *_ in inputs):
            return original_einsum(pfor_input)
        terms, output = equation.split("->")
        loop = next((s for s in string.ascii_letters if s not in equation), None)  # the examples' axis
        if loop is None:
            return original_einsum(pfor_input)
        terms = [loop + term if stacked else term for term, (_, stacked, _) in zip(terms.split(","), inputs)]
        return wrap(einsum_without_unit_labels(f"{','.join(terms)}->{loop}{output}",
                                               *[t for t, *_ in inputs]), True)

    def softmax_converter(original, log):
        def convert(pfor_input):
            if not in_our_maps():
                return original(pfor_input)
            return wrap(softmax_in_two_dims(pfor_input.stacked_input(0), log=log), True)

        convert.pergrad = True
        return convert

    softmaxes = {name: registry.get(name) for name in ("Softmax", "LogSoftmax")}
    batch_matmul_v2.pergrad = einsum.pergrad = True
    registry["BatchMatMulV2"], registry["Einsum"] = batch_matmul_v2, einsum
    for name, original in softmaxes.items():
        if original is not None:  # (without it, TensorFlow's: a model of fewer dimensions runs)
            registry[name] = softmax_converter(original, log=name == "LogSoftmax")
    return True


#: Whether pergrad's converters replaced TensorFlow's (see the module's docstring).
INSTALLED = _install()
