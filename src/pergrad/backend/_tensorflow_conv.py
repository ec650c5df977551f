"""pfor conversions of a convolution's backward pass per example, grouped ones included.

pfor vectorizes ``Conv2DBackpropFilter`` (the kernel gradient of ``Conv1D`` and
``Conv2D``) over stacked inputs with a ``while_loop`` of one backward pass per
example ("Conv2DBackpropFilter uses a while_loop. Fix that!"), and
``Conv2DBackpropInput`` (the input gradient) as one op over the examples. Both run
TensorFlow's own CPU kernels, which reject grouped convolutions (``groups > 1``:
"filter_size does not have enough elements", "Gradients for grouped convolutions
are not supported on CPU") wherever oneDNN does not take the op
(``TF_ENABLE_ONEDNN_OPTS=0``, float64). Keras runs a grouped convolution with XLA
for that reason, which pfor's inlined ops do not get.

While pergrad converts its own functions (``_tensorflow_onednn.converting``), the
two ops are converted here instead: each example's kernel gradient is its input
patches (``tf.image.extract_patches``) times its output gradient, group by group —
one batched product for the whole batch, the formula of ``pergrad.layer_rules.conv``
(also for ungrouped convolutions: no loop) — and a grouped input gradient is one
ungrouped op per group. Elsewhere, and for the forms this does not know (an unknown
kernel size, inputs not stacked, a kernel that differs by example), TensorFlow's
converters run. :data:`INSTALLED` says whether the converters are in pfor's registry
(a private one; a TensorFlow release that moves it leaves TensorFlow's).
"""

from __future__ import annotations

import tensorflow as tf

from pergrad.backend._tensorflow_onednn import converter_registry, in_our_maps


def _nhwc(tensor, data_format):
    """A stacked ``(N, b, ...)`` 4-D-per-example tensor with its channels last."""
    return tf.transpose(tensor, (0, 1, 3, 4, 2)) if data_format == "NCHW" else tensor


def per_example_filter_gradients(inputs, grads, filter_shape, strides, padding, explicit_paddings,
                                 dilations, data_format):
    """``(N,) + filter_shape``: the kernel gradient of each of ``N`` stacked convolutions.

    ``inputs`` and ``grads`` are ``(N, b, ...)`` (each example's own batch of ``b``, in
    ``data_format``); the op's attributes as ``Conv2DBackpropFilter`` has them."""
    channels_axis = 1 if data_format == "NCHW" else 3
    spatial = (2, 3) if data_format == "NCHW" else (1, 2)
    x, d = _nhwc(inputs, data_format), _nhwc(grads, data_format)
    kh, kw, group_channels, filters = (int(v) for v in filter_shape)
    channels = x.shape[-1]
    if channels is None or d.shape[-1] is None:
        return None
    groups = channels // group_channels
    images = tf.reshape(x, tf.concat([[-1], tf.shape(x)[2:]], axis=0))  # (N b, H, W, C)
    if padding == "EXPLICIT":
        pads = [explicit_paddings[2 * a:2 * a + 2] for a in range(4)]
        images = tf.pad(images, [pads[0]] + [pads[a] for a in spatial] + [pads[channels_axis]])
        padding = "VALID"
    patches = tf.image.extract_patches(
        images, [1, kh, kw, 1], [1] + [strides[a] for a in spatial] + [1],
        [1] + [dilations[a] for a in spatial] + [1], padding)  # (N b, oh, ow, kh kw C)
    count = tf.shape(x)[0]
    if groups == 1:
        a = tf.reshape(patches, [count, -1, kh * kw * channels])
        grad = tf.matmul(a, tf.reshape(d, [count, -1, filters]), transpose_a=True)
    else:
        a = tf.reshape(patches, [count, -1, kh * kw, groups, group_channels])
        grad = tf.einsum("ntkgc,ntgq->nkcgq", a, tf.reshape(d, [count, -1, groups, filters // groups]))
    return tf.reshape(grad, [count, kh, kw, group_channels, filters])


def grouped_input_gradients(input_sizes, kernel, grads, groups, attributes):
    """``Conv2DBackpropInput`` of a convolution in ``groups`` groups (one example's
    ``input_sizes``, the stacked ``grads``) as one ungrouped op per group, the examples
    folded into the batch as pfor's converter does."""
    channels_axis = 1 if attributes["data_format"] == "NCHW" else 3
    group_channels, filters = kernel.shape[2], kernel.shape[3]
    count = tf.shape(grads)[0]
    flat = tf.reshape(grads, tf.concat([[-1], tf.shape(grads)[2:]], axis=0))
    sizes = tf.unstack(tf.cast(input_sizes, tf.int32), num=4)
    sizes[0], sizes[channels_axis] = tf.shape(flat)[0], tf.constant(group_channels, tf.int32)
    width = filters // groups
    parts = []
    for start in range(0, filters, width):
        picked = [slice(None)] * 4
        picked[channels_axis] = slice(start, start + width)
        parts.append(tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.stack(sizes), filter=kernel[..., start:start + width],
            out_backprop=flat[tuple(picked)], **attributes))
    out = tf.concat(parts, axis=channels_axis)
    return tf.reshape(out, tf.concat([[count, -1], tf.shape(out)[1:]], axis=0))


def _attributes(pfor_input) -> dict:
    """The convolution op's attributes, strings decoded."""
    out = {}
    for name in ("strides", "padding", "explicit_paddings", "data_format", "dilations", "use_cudnn_on_gpu"):
        value = pfor_input.get_attr(name)
        out[name] = value.decode("utf-8") if isinstance(value, bytes) else value
    return out


def _install() -> bool:
    found = converter_registry(("Conv2DBackpropFilter", "Conv2DBackpropInput"))
    if found is None:
        return False
    registry, wrap, (original_filter, original_input) = found
    if getattr(original_filter, "pergrad", False):  # installed already (a reloaded module)
        return True

    def conv2d_backprop_filter(pfor_input):
        filter_shape = tf.get_static_value(pfor_input.unstacked_input(1)) if in_our_maps() else None
        if filter_shape is None or not pfor_input.input(0)[1]:
            return original_filter(pfor_input)
        pfor_input.stack_inputs(stack_indices=[2])
        a = _attributes(pfor_input)
        out = per_example_filter_gradients(
            pfor_input.stacked_input(0), pfor_input.stacked_input(2), filter_shape, a["strides"],
            a["padding"], a["explicit_paddings"], a["dilations"], a["data_format"])
        return original_filter(pfor_input) if out is None else wrap(out, True)

    def conv2d_backprop_input(pfor_input):
        (kernel, kernel_stacked, _), output = pfor_input.input(1), pfor_input.op.outputs[0]
        channels = output.shape[1 if pfor_input.get_attr("data_format") == b"NCHW" else 3]
        # (not grouped: TensorFlow's)
        if (not in_our_maps() or kernel_stacked or kernel.shape.rank != 4
                or None in (kernel.shape[2], channels) or channels == kernel.shape[2]):
            return original_input(pfor_input)
        pfor_input.stack_inputs(stack_indices=[2])
        grads = pfor_input.stacked_input(2)
        return wrap(grouped_input_gradients(pfor_input.unstacked_input(0), kernel, grads,
                                            channels // kernel.shape[2], _attributes(pfor_input)), True)

    conv2d_backprop_filter.pergrad = conv2d_backprop_input.pergrad = True
    registry["Conv2DBackpropFilter"] = conv2d_backprop_filter
    registry["Conv2DBackpropInput"] = conv2d_backprop_input
    return True


#: Whether pergrad's converters replaced TensorFlow's (see the module's docstring).
INSTALLED = _install()
