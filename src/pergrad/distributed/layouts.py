"""One program over several devices (``keras.distribution``, JAX): where tensors lie.

Under a ``keras.distribution.DataParallel`` every train step is one global program:
XLA inserts the collectives and every rule gives the single-device result. What
pergrad adds is layout: how many parts ``fit()`` splits a batch into, and, on the
streaming path, each variable's per-example rows laid out by coordinate so that
each device selects over its own coordinates (docs/multi-device.md, 'Communication
per step'). Values never change.
"""

from __future__ import annotations

import math

import keras

from pergrad.engine.collectives import Collectives


def batch_devices() -> int:
    """How many devices the current ``keras.distribution`` splits the batch over
    (``DataParallel``: all of its devices; ``ModelParallel``: its mesh's batch axis);
    1 without one."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    layout = distribution.get_data_layout((1,))
    axis = layout.axes[0]
    names = () if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    mesh = layout.device_mesh
    return math.prod(int(mesh.shape[list(mesh.axis_names).index(name)]) for name in names)


def data_parallel():
    """``(mesh, batch axis name, devices on it)`` of a ``keras.distribution.DataParallel``
    with several devices, else ``None``."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.DataParallel) or batch_devices() <= 1:
        return None
    return distribution.device_mesh, distribution.batch_dim_name, batch_devices()


def _laid_out(tensor, axis, mesh, name):
    spec = [None] * len(tensor.shape)
    spec[axis] = name
    return keras.distribution.distribute_tensor(tensor, keras.distribution.TensorLayout(spec, mesh))


def by_example(tensor):
    """``tensor`` (examples first) split by example over a ``DataParallel``'s devices,
    as Keras lays out the batch; ``tensor`` itself in any other setting."""
    found = data_parallel()
    if found is None or not tensor.shape or tensor.shape[0] is None or tensor.shape[0] % found[2]:
        return tensor
    return _laid_out(tensor, 0, found[0], found[1])


def spread_coordinates(gradients):
    """``gradients`` (``(J, ...)`` rows of one variable) laid out over the devices of a
    ``keras.distribution.DataParallel`` by coordinate instead of by example.

    A coordinate rule compares every example's value of a coordinate: with the rows
    split by example, XLA's partitioner brings all ``J`` rows to every device; split
    by coordinate (the largest axis the device count divides), each device forms and
    selects over its own coordinates only (XLA gathers the layers' input and
    output-gradient rows it needs: docs/architecture.md, 'Communication per step').
    Values are unchanged; any other setting returns ``gradients``.
    """
    found = data_parallel()
    if found is None:
        return gradients
    mesh, name, devices = found
    shape = tuple(gradients.shape)
    axes = [k for k in range(1, len(shape)) if shape[k] and shape[k] % devices == 0]
    if not axes:
        return gradients
    return _laid_out(gradients, max(axes, key=lambda k: shape[k]), mesh, name)


class DataParallel(Collectives):
    """The collectives of a step that one program runs over a ``DataParallel``'s devices:
    none (XLA's), the streaming path's rows laid out over the devices."""

    works_alone = False

    def by_example(self, layers):
        # Each example's A and D rows stay where the model's own pass left them, so that
        # the coordinate layout below does not propagate into the model's pass (which
        # would split its matmuls differently from one device: other float16 roundings).
        return layers.with_tensors(by_example)

    def spread_coordinates(self, gradients):
        return spread_coordinates(gradients)
