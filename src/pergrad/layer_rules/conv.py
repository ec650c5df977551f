"""Convolutions: per-example kernel gradients from the input's patches, or ghost norms.

A convolution's output at position t is its kernel applied to the patch of input
around t: with example i's patches ``A_i`` (``T x k C_in``: one row per output
position, the ``k`` kernel offsets times the input channels) and its output
gradient ``D_i`` (``T x C_out``), the kernel's per-example gradient is
``A_iᵀ D_i`` — a ``Dense`` layer over ``T`` positions — and the bias's is
``sum_t D_it``. So every statistic has the sequence ``Dense`` formulas
(``pergrad.layer_rules.dense``), group by group for a grouped convolution (each
group's output channels read only its input channels):

- formed: ``A_iᵀ D_i`` by one batched matmul (``B T k C_in C_out``, the FLOPs of the
  plain backward pass's kernel gradient); its squares and weighted sum from it;
- ghost (Goodfellow 2015; Li et al. 2022): ``||A_iᵀ D_i||² = <A_i A_iᵀ, D_i D_iᵀ>``,
  ``B T² (k C_in + C_out)``, and ``sum_i w_i g_i = Aᵀ diag(w) D`` — the layer's
  batched kernel gradient with ``D`` scaled, one matmul, no per-example tensor.

Per layer and group the choice is static, from shapes, as ``Dense``'s
(:func:`pergrad.layer_rules.dense.outer_materializes`): formed where the gradients
hold no more than the ghost norm's ``3 T²`` per example, ghost otherwise — mixed
ghost clipping (Bu et al., "Scalable and Efficient Training of Large Convolutional
Neural Networks with Differential Privacy", NeurIPS 2022: ghost when
``2 T² < k C_in C_out``; pergrad counts the Gram matrices' product too): the early,
high-resolution layers form their gradients, the late, wide ones take the ghost
norm.

The other convolutions are the same products of other tensors:

- ``DepthwiseConv``: a convolution with one group per input channel (``k`` by
  ``depth_multiplier`` per channel: always formed, ``B T k C_in m``);
- ``SeparableConv``: that depthwise convolution, whose output gradient is ``D``
  times the pointwise kernel's transpose, then a pointwise (``1 x 1``) one, a
  ``Dense`` over positions whose input is the depthwise output (recomputed from the
  patches);
- ``ConvTranspose``: the adjoint of a convolution, so its kernel's gradient is that
  convolution's with the roles swapped: patches of ``D``, times the input.

Patches come from :func:`patches` (a strided slice per kernel offset in
``keras.ops``, or the backend adapter's ``conv_patches``: torch's one strided
view). A layer whose patches cannot be known from static shapes (an unknown
spatial size, a padding this module does not know) takes the layer's vectorized
vjp.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import keras
from keras import ops

from pergrad import compat
from pergrad.aggregators.example_statistics import example_squared_norms
from pergrad.backend import optional_kernel
from pergrad.layer_rules.base import PreActivationRule, register_rule
from pergrad.layer_rules.dense import (
    outer_materializes,
    outer_per_example,
    variable_value,
)
from pergrad.tensors import batch_size_of, example_rows, gram_block


class Geometry(NamedTuple):
    """One convolution's static shape: per spatial axis the kernel size, stride,
    dilation, ``(left, right)`` zero padding of the input and output size."""

    kernel_size: tuple
    strides: tuple
    dilation: tuple
    pads: tuple
    out_sizes: tuple

    @property
    def offsets(self) -> int:
        """``k``: the kernel's positions."""
        return math.prod(self.kernel_size)

    @property
    def positions(self) -> int:
        """``T``: the output's positions."""
        return math.prod(self.out_sizes)


def geometry(kernel_size, strides, dilation, left_pads, in_sizes, out_sizes) -> Geometry | None:
    """The :class:`Geometry` of a convolution of inputs of spatial sizes ``in_sizes`` into
    ``out_sizes`` with ``left_pads`` zeros before each axis (``None``: not static)."""
    sizes = (in_sizes, out_sizes, left_pads)
    if any(s is None for group in sizes for s in group):
        return None
    pads = []
    for n, m, k, s, d, left in zip(in_sizes, out_sizes, kernel_size, strides, dilation, left_pads):
        needed = (m - 1) * s + (k - 1) * d + 1  # the padded input's entries the last patch reaches
        pads.append((left, max(0, needed - n - left)))
    return Geometry(*(tuple(int(v) for v in t) for t in (kernel_size, strides, dilation)), tuple(pads),
                    tuple(int(m) for m in out_sizes))


def left_pads(padding, kernel_size, strides, dilation, in_sizes, out_sizes):
    """The zeros Keras pads before each spatial axis of a convolution's input (the same
    on every backend: TensorFlow's "SAME", the odd one at the end), or ``None``."""
    if padding not in ("valid", "same", "causal") or None in tuple(in_sizes) + tuple(out_sizes):
        return None
    pads = []
    for n, m, k, s, d in zip(in_sizes, out_sizes, kernel_size, strides, dilation):
        span = (k - 1) * d + 1
        if padding == "valid":
            pads.append(0)
        elif padding == "same":
            pads.append(max(0, (m - 1) * s + span - n) // 2)
        else:  # causal (Conv1D): the layer pads the input on the left
            pads.append(span - 1)
    return pads


def channels_last(tensor, layer):
    """``tensor`` (batch first, in ``layer.data_format``) with its channels last."""
    if getattr(layer, "data_format", "channels_last") == "channels_last":
        return tensor
    return ops.moveaxis(tensor, 1, -1)


def spatial_sizes(tensor) -> tuple:
    """The static spatial sizes of a channels-last tensor (``None`` where unknown)."""
    return tuple(tensor.shape[1:-1])


class Patches(NamedTuple):
    """The rows a convolution multiplies by its kernel, one kernel offset at a time.

    ``x`` is the channels-last input, ``shape`` its :class:`Geometry`. At offset ``j``
    (in the kernel's order), row ``t`` of example i is the input at output position
    ``t``'s patch, shifted by ``j``: one strided slice of the padded input, ``(B, T, C)``.
    The statistics are sums over the offsets of products of these slices, so the patches
    themselves (``k`` times the input: ``im2col``) are never formed; per offset, ``XLA``
    and TensorFlow fuse the slice into its product (3-10x faster than a product of the
    formed patches on CPU, and a depthwise kernel's per-example gradient is then a
    multiply-and-sum per offset instead of ``B C`` tiny matmuls).
    """

    x: object
    shape: Geometry

    @classmethod
    def of_positions(cls, rows):
        """A ``(B, T, C)`` tensor as the patches of a ``1 x 1`` convolution over ``T`` positions."""
        positions = rows.shape[1]
        return cls(rows, Geometry((1,), (1,), (1,), ((0, 0),), (positions,)))

    @property
    def channels(self) -> int:
        return self.x.shape[-1]

    def __iter__(self):
        shape = self.shape
        flat = (batch_size_of(self.x), shape.positions, self.channels)
        if shape.offsets == 1 and all(s == 1 for s in shape.strides) and not any(map(any, shape.pads)):
            yield ops.reshape(self.x, flat)  # a 1 x 1 convolution: the input itself
            return
        # Strides as phases: each spatial axis padded to a multiple of its stride s and split
        # into (length / s, s), the phases moved first, so that offset o's positions o + s t
        # are a contiguous slice at phase o % s (TensorFlow's strided slices cost 10-20x
        # their copy on CPU).
        rank = len(shape.strides)
        sizes, pads = self.x.shape[1:-1], []
        for n, (left, right), s in zip(sizes, shape.pads, shape.strides):
            pads.append([left, right + (-(n + left + right)) % s])
        x = ops.pad(self.x, [[0, 0]] + pads + [[0, 0]]) if any(map(any, pads)) else self.x
        strided = any(s > 1 for s in shape.strides)
        if strided:
            split = [batch_size_of(x)]
            for n, s in zip(x.shape[1:-1], shape.strides):
                split += [n // s, s]
            x = ops.reshape(x, split + [self.channels])
            x = ops.transpose(x, [0] + [2 + 2 * a for a in range(rank)] + [1 + 2 * a for a in range(rank)]
                              + [1 + 2 * rank])  # (B, s_1 .. s_r, n_1 / s_1 .. n_r / s_r, C)
        for offset in itertools.product(*(range(k) for k in shape.kernel_size)):
            starts = [o * d for o, d in zip(offset, shape.dilation)]
            strides = shape.strides if strided else [1] * rank
            index = [slice(None)] + ([o % s for o, s in zip(starts, strides)] if strided else [])
            index += [slice(o // s, o // s + m) for o, s, m in zip(starts, strides, shape.out_sizes)]
            yield ops.reshape(x[tuple(index)], flat)


class Product(NamedTuple):
    """Example i's gradient of one variable as ``sum_t a_it ⊗ d_it`` in ``g`` groups.

    ``a`` are :class:`Patches` (``k`` offsets of ``C`` channels, ``c = C / g`` per group;
    a ``Dense``-like product has ``k = 1``), ``d`` is ``(B, T, g, q)``; the gradient is
    the ``(k, c, g, q)`` array in the variable's ``shape`` (Keras's kernel layouts: a
    grouped kernel's output channels are group-major, a depthwise kernel's input
    channels are the groups).
    """

    a: Patches
    d: object
    shape: tuple

    @property
    def groups(self) -> int:
        return self.d.shape[2]

    def sizes(self):
        """``(T, k c, q)``: a group's positions and product sizes (static)."""
        return self.d.shape[1], self.a.shape.offsets * self.a.channels // self.groups, self.d.shape[3]

    def _rows(self):
        """The patches as ``(B, T, k', g, c)`` tensors whose ``k'`` offsets, concatenated, are
        the kernel's: one per offset (``k' = 1``, slices the backend fuses into their
        products), or, where the adapter forms the patches at once (``conv_patches``: torch,
        where each op costs its dispatch; 49 offsets of a 7 x 7 kernel), one of all ``k``."""
        patches, groups = self.a, self.groups
        fast = optional_kernel("conv_patches")
        if fast is None or patches.shape.offsets == 1:
            tensors = list(patches)
        else:
            shape = patches.shape
            tensors = [fast(patches.x, shape.kernel_size, shape.strides, shape.dilation, shape.pads,
                            shape.out_sizes)]
        channels = patches.channels // groups
        return [ops.reshape(t, tuple(t.shape[:2]) + (-1, groups, channels)) for t in tensors]

    def formed(self):
        """``(B,) + shape``: every example's gradient."""
        d, groups = self.d, self.groups
        parts = []
        for rows in self._rows():
            batch, positions, offsets, _, channels = rows.shape
            if groups == 1:  # a batched matmul
                flat = ops.reshape(rows, (batch, positions, offsets * channels))
                product = outer_per_example(flat, d[:, :, 0])  # (B, k' c, q)
                parts.append(ops.reshape(product, (batch, offsets, channels, 1, -1)))
            elif channels == 1:  # depthwise: per channel, sum_t x_t d_t
                product = ops.sum(rows[:, :, :, :, 0, None] * d[:, :, None], axis=1)  # (B, k', g, q)
                parts.append(product[:, :, None])
            else:
                parts.append(ops.einsum("btkgc,btgq->bkcgq", rows, d))
        grads = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)
        return ops.reshape(grads, (batch_size_of(d),) + tuple(self.shape))

    def _position_products(self, pattern, first=slice(None), second=slice(None)):
        """``A Aᵀ`` and ``D Dᵀ`` per group, by the einsum ``pattern`` of the examples ``first``
        and ``second``."""
        aa = 0.0
        for rows in self._rows():
            aa = aa + ops.einsum(pattern, rows[first], rows[second])
        return aa, ops.einsum(pattern.replace("k", "").replace("c", "q"), self.d[first], self.d[second])

    def squared_norms(self):
        """``(B,)``: ``||A_iᵀ D_i||² = <A_i A_iᵀ, D_i D_iᵀ>`` summed over the groups."""
        aa, dd = self._position_products("btkgc,bskgc->bgts")
        return ops.sum(aa * dd, axis=(1, 2, 3))

    def weighted_sum(self, weights):
        """``sum_i w_i g_i``: ``Aᵀ diag(w) D``, one matmul per offset over every example's
        positions (an einsum: Keras's torch ``matmul`` returns float32 for float64)."""
        scaled = self.d * ops.cast(weights[:, None, None, None], self.d.dtype)
        parts = [ops.einsum("btkgc,btgq->kcgq", rows, scaled) for rows in self._rows()]
        return ops.reshape(parts[0] if len(parts) == 1 else ops.concatenate(parts), self.shape)

    def gram(self, split=None):
        """``sum_g (A_g A_gᵀ) ∘ (D_g D_gᵀ)`` over example pairs, summed over positions
        (``B² g T²`` entries; or its block ``[:split, split:]``)."""
        first, second = (slice(None), slice(None)) if split is None else (slice(split), slice(split, None))
        aa, dd = self._position_products("itkgc,jskgc->ijgts", first, second)
        return ops.sum(aa * dd, axis=(2, 3, 4))

    def pairs_fit(self, batch) -> bool:
        """Whether :meth:`gram`'s pair matrices hold no more per example than its formed
        gradient (``2 B g T²`` against ``k c g q``), with a static batch size."""
        positions, size, q = self.sizes()
        return isinstance(batch, int) and 2 * batch * positions * positions <= size * q


class Summed(NamedTuple):
    """A bias: example i's gradient is ``sum_t d_it`` (``d``: ``(B, T, q)``)."""

    d: object
    shape: tuple

    def formed(self):
        return ops.reshape(ops.sum(self.d, axis=1), (batch_size_of(self.d),) + tuple(self.shape))

    def weighted_sum(self, weights):
        total = ops.sum(self.d * ops.cast(weights[:, None, None], self.d.dtype), axis=(0, 1))
        return ops.reshape(total, self.shape)


class ConvolutionRule(PreActivationRule):
    """A convolution's kernel and bias from :class:`Product` and :class:`Summed` pieces.

    Subclasses give :meth:`pieces` (``None``: the layer's vjp) and :meth:`sizes`, the
    pieces' static sizes (``None`` where they cannot be known)."""

    def geometry(self, layer, inputs, delta) -> Geometry | None:
        """The patches' :class:`Geometry` of the layer's convolution of ``inputs``."""
        x, d = channels_last(inputs, layer), channels_last(delta, layer)
        rank = len(x.shape) - 2
        kernel_size = tuple(layer.kernel_size)
        strides, dilation = tuple(layer.strides), tuple(layer.dilation_rate)
        if len(kernel_size) != rank:
            return None
        in_sizes, out_sizes = spatial_sizes(x), spatial_sizes(d)
        pads = left_pads(layer.padding, kernel_size, strides, dilation, in_sizes, out_sizes)
        if pads is None:
            return None
        return geometry(kernel_size, strides, dilation, pads, in_sizes, out_sizes)

    def pieces(self, layer, values, inputs, delta) -> list | None:
        raise NotImplementedError

    def sizes(self, layer, inputs, delta) -> list | None:
        """``(T, p, q)`` of each variable's product (``None`` for a bias), or ``None``."""
        raise NotImplementedError

    def _bias_piece(self, layer, delta):
        d = channels_last(delta, layer)
        return Summed(ops.reshape(d, (batch_size_of(d), -1, d.shape[-1])), tuple(layer.bias.shape))

    def _part(self, layer, v):
        bias = getattr(layer, "bias", None)
        return "bias" if v is bias else next(name for name in self.parts if getattr(layer, name, None) is v)

    def _covered(self, layer) -> bool:
        """Whether every variable of the rule is one of the layer's kernels or its bias."""
        known = [getattr(layer, name, None) for name in self.parts + ("bias",)]
        return all(any(v is k for k in known) for v in self.variables(layer))

    #: the layer's kernel attributes the pieces cover
    parts: tuple = ("kernel",)

    def _ghosts(self, layer, inputs, delta):
        """Per variable whether its statistics take the ghost formula (static)."""
        sizes = self.sizes(layer, inputs, delta) if self._covered(layer) else None
        if sizes is None:
            return None
        return [size is not None and not outer_materializes(*size) for size in sizes]

    def materializes(self, layer, inputs, delta) -> bool:
        ghosts = self._ghosts(layer, inputs, delta)
        return ghosts is None or not any(ghosts)

    def _pieces(self, layer, values, inputs, delta):
        return self.pieces(layer, values, inputs, delta) if self._covered(layer) else None

    def per_example(self, layer, values, inputs, delta) -> list:
        pieces = self._pieces(layer, values, inputs, delta)
        if pieces is None:
            return super().per_example(layer, values, inputs, delta)
        return [piece.formed() for piece in pieces]

    def squared_norms(self, layer, values, inputs, delta) -> list:
        pieces = self._pieces(layer, values, inputs, delta)
        ghosts = self._ghosts(layer, inputs, delta)
        if pieces is None or ghosts is None:
            return super().squared_norms(layer, values, inputs, delta)
        return [piece.squared_norms() if ghost else example_squared_norms(piece.formed())
                for piece, ghost in zip(pieces, ghosts)]

    def weighted_sum(self, layer, values, inputs, delta, weights) -> list:
        pieces = self._pieces(layer, values, inputs, delta)
        if pieces is None:
            return super().weighted_sum(layer, values, inputs, delta, weights)
        return [piece.weighted_sum(w) for piece, w in zip(pieces, weights)]

    def gram(self, layer, values, inputs, delta):
        return self._gram(layer, values, inputs, delta, None)

    def cross_gram(self, layer, values, inputs, delta, split: int):
        return self._gram(layer, values, inputs, delta, split)

    def _gram(self, layer, values, inputs, delta, split):
        """The ghost layers' pair formula where its matrices hold no more than the
        formed gradients (:meth:`Product.pairs_fit`), else the formed gradients' rows."""
        pieces = self._pieces(layer, values, inputs, delta)
        ghosts = self._ghosts(layer, inputs, delta)
        if pieces is None or ghosts is None:
            return self.cross_gram_of_rows(layer, values, inputs, delta, split)
        batch = batch_size_of(delta)
        total = 0.0
        for piece, ghost in zip(pieces, ghosts):
            if ghost and piece.pairs_fit(batch):
                total = total + piece.gram(split)
            else:
                total = total + gram_block(example_rows(piece.formed()), split)
        return total


def _split_channels(tensor, groups: int):
    """``(B, T, C)`` as ``(B, T, groups, C / groups)``."""
    return ops.reshape(tensor, (batch_size_of(tensor), tensor.shape[1], groups, tensor.shape[2] // groups))


def _positions(tensor):
    """A channels-last ``(B, *spatial, C)`` tensor as ``(B, T, C)``."""
    return ops.reshape(tensor, (batch_size_of(tensor), -1, tensor.shape[-1]))


class GroupedConvolutionRule(ConvolutionRule):
    """``Conv1D`` / ``Conv2D`` / ``Conv3D`` (grouped too): kernel ``(*k, C_in / g, C_out)``;
    ``DepthwiseConv`` subclasses it with one group per input channel."""

    def groups(self, layer, channels: int) -> int:
        return getattr(layer, "groups", 1)

    def sizes(self, layer, inputs, delta):
        shape = self.geometry(layer, inputs, delta)
        if shape is None:
            return None
        channels, filters = channels_last(inputs, layer).shape[-1], channels_last(delta, layer).shape[-1]
        groups = self.groups(layer, channels)
        size = (shape.positions, shape.offsets * channels // groups, filters // groups)
        return [None if self._part(layer, v) == "bias" else size for v in self.variables(layer)]

    def pieces(self, layer, values, inputs, delta):
        shape = self.geometry(layer, inputs, delta)
        if shape is None:
            return None
        x, d = channels_last(inputs, layer), _positions(channels_last(delta, layer))
        groups = self.groups(layer, x.shape[-1])
        return [self._bias_piece(layer, delta) if self._part(layer, v) == "bias" else
                Product(Patches(x, shape), _split_channels(d, groups), tuple(v.shape))
                for v in self.variables(layer)]


class DepthwiseConvolutionRule(GroupedConvolutionRule):
    """``DepthwiseConv1D`` / ``DepthwiseConv2D``: kernel ``(*k, C_in, m)``, one group per input
    channel, output channel ``c m + j``."""

    def groups(self, layer, channels: int) -> int:
        return channels


class SeparableConvolutionRule(ConvolutionRule):
    """``SeparableConv1D`` / ``SeparableConv2D``: a depthwise convolution (strides, padding,
    dilation) into ``C m`` channels ``H``, then a pointwise one into ``F``."""

    parts = ("depthwise_kernel", "pointwise_kernel")

    def sizes(self, layer, inputs, delta):
        shape = self.geometry(layer, inputs, delta)
        if shape is None:
            return None
        sizes = {"depthwise_kernel": (shape.positions, shape.offsets, layer.depthwise_kernel.shape[-1]),
                 "pointwise_kernel": (shape.positions,) + tuple(layer.pointwise_kernel.shape[-2:]),
                 "bias": None}
        return [sizes[self._part(layer, v)] for v in self.variables(layer)]

    def pieces(self, layer, values, inputs, delta):
        shape = self.geometry(layer, inputs, delta)
        if shape is None:
            return None
        x, d = channels_last(inputs, layer), _positions(channels_last(delta, layer))
        variables = self.variables(layer)
        depthwise = ops.cast(variable_value(layer.depthwise_kernel, variables, values), x.dtype)
        pointwise = ops.cast(variable_value(layer.pointwise_kernel, variables, values), x.dtype)
        channels, multiplier = depthwise.shape[-2], depthwise.shape[-1]
        pointwise = ops.reshape(pointwise, tuple(pointwise.shape[-2:]))  # (C m, F)
        patches = Patches(x, shape)
        out = []
        for v in variables:
            part = self._part(layer, v)
            if part == "bias":
                out.append(self._bias_piece(layer, delta))
            elif part == "depthwise_kernel":  # its output gradient: D times the pointwise kernel's transpose
                d_depthwise = ops.einsum("btf,cf->btc", d, pointwise)
                out.append(Product(patches, _split_channels(d_depthwise, channels), tuple(v.shape)))
            else:  # a Dense over positions whose input is the depthwise output, from the same patches
                kernel = ops.reshape(depthwise, (shape.offsets, channels, multiplier))
                hidden = sum(rows[..., None] * kernel[j] for j, rows in enumerate(patches))  # (B, T, C, m)
                hidden = ops.reshape(hidden, (batch_size_of(x), shape.positions, channels * multiplier))
                out.append(Product(Patches.of_positions(hidden), _split_channels(d, 1), tuple(v.shape)))
        return out


class TransposedConvolutionRule(ConvolutionRule):
    """``Conv1DTranspose`` / ``Conv2DTranspose`` / ``Conv3DTranspose``: kernel ``(*k, F, C_in)``.

    The layer is the adjoint of the convolution from its output (``F`` channels) to its
    input: ``<conv_transpose(x, W), D> = <x, conv(D, W)>``, so example i's kernel
    gradient is that convolution's, with ``D``'s patches (one per input position) as
    its input and ``x`` as its output gradient. Where the backends pad differently
    (Keras's torch ``"same"`` when ``k - s`` is odd), the padding is the backend's own
    (:func:`pergrad.compat.conv_transpose_left_pads`).
    """

    def geometry(self, layer, inputs, delta):
        x, d = channels_last(inputs, layer), channels_last(delta, layer)
        kernel_size, strides = tuple(layer.kernel_size), tuple(layer.strides)
        dilation = tuple(layer.dilation_rate)
        if len(kernel_size) != len(x.shape) - 2:
            return None
        out_sizes, in_sizes = spatial_sizes(x), spatial_sizes(d)
        if None in out_sizes + in_sizes:
            return None
        pads = compat.conv_transpose_left_pads(layer.padding, kernel_size, strides, dilation,
                                               layer.output_padding, out_sizes, in_sizes)
        if pads is None:
            return None
        return geometry(kernel_size, strides, dilation, pads, in_sizes, out_sizes)

    def sizes(self, layer, inputs, delta):
        shape = self.geometry(layer, inputs, delta)
        if shape is None:
            return None
        filters, channels = layer.kernel.shape[-2:]
        size = (shape.positions, shape.offsets * filters, channels)
        return [None if self._part(layer, v) == "bias" else size for v in self.variables(layer)]

    def pieces(self, layer, values, inputs, delta):
        shape = self.geometry(layer, inputs, delta)
        if shape is None:
            return None
        x, d = _positions(channels_last(inputs, layer)), channels_last(delta, layer)
        return [self._bias_piece(layer, delta) if self._part(layer, v) == "bias" else
                Product(Patches(d, shape), _split_channels(x, 1), tuple(v.shape))
                for v in self.variables(layer)]


for _classes, _rule in (
    ((keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D), GroupedConvolutionRule),
    ((keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D), DepthwiseConvolutionRule),
    ((keras.layers.SeparableConv1D, keras.layers.SeparableConv2D), SeparableConvolutionRule),
    ((keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose),
     TransposedConvolutionRule),
):
    for _cls in _classes:
        register_rule(_cls)(type(_rule.__name__, (_rule,), {}))
