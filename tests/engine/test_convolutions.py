"""The convolution rules (``pergrad.layer_rules.conv``) against the batch-of-one oracle.

Each rule is called directly on one layer's input ``A`` and output gradient ``D``
(the loss is a squared error, whose ``D`` is known in closed form), in float64,
over a grid of shapes: strides, dilation, padding, data format, groups, depth
multiplier, transposed and separable. Its per-example gradients, squared norms
(formed and ghost, each forced), Gram matrix and blocks, and weighted sums must
equal the oracle's to 1e-10. Then through the engine: every convolution class in one
model (and ConvNeXt's ``LayerScale``), per-example norms, Gram matrix and a clip step
against the oracle, the ghost formulas forced and not.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops
from keras.src.applications.convnext import LayerScale

import oracle
import pergrad
from pergrad.aggregators import clip
from pergrad.backend import adapter
from pergrad.layer_rules import conv, rule_for
from pergrad.layer_rules.base import PreActivationRule

B = 3
CF = "channels_first"
GRID = [
    ("Conv2D", (7, 6, 4), dict(filters=3, kernel_size=3)),
    ("Conv2D", (7, 6, 4), dict(filters=4, kernel_size=3, strides=2, padding="same", groups=2)),
    ("Conv2D", (4, 7, 6), dict(filters=3, kernel_size=(2, 3), dilation_rate=2, padding="same",
                               data_format=CF)),
    ("Conv1D", (9, 2), dict(filters=3, kernel_size=3, padding="causal", dilation_rate=2)),
    ("Conv1D", (9, 4), dict(filters=4, kernel_size=2, strides=2, groups=4, padding="same")),
    ("Conv3D", (4, 5, 3, 2), dict(filters=2, kernel_size=2, padding="same", strides=(1, 2, 1))),
    ("Conv2D", (5, 5, 3), dict(filters=2, kernel_size=1, use_bias=False)),
    ("DepthwiseConv2D", (7, 6, 3), dict(kernel_size=3, depth_multiplier=2, padding="same", strides=2)),
    ("DepthwiseConv1D", (3, 9), dict(kernel_size=3, dilation_rate=2, data_format=CF)),
    ("SeparableConv2D", (7, 6, 3), dict(filters=4, kernel_size=3, depth_multiplier=2, padding="same")),
    ("SeparableConv1D", (9, 2), dict(filters=3, kernel_size=2, strides=2)),
    ("Conv2DTranspose", (4, 3, 3), dict(filters=2, kernel_size=3, strides=2, padding="same")),
    ("Conv1DTranspose", (5, 2), dict(filters=3, kernel_size=3, strides=2, padding="same", output_padding=1)),
    ("Conv1DTranspose", (5, 2), dict(filters=3, kernel_size=4, strides=3, output_padding=2)),
    ("Conv3DTranspose", (2, 3, 2, 2), dict(filters=2, kernel_size=2, strides=(1, 2, 1), padding="same")),
    ("Conv2DTranspose", (2, 4, 3), dict(filters=2, kernel_size=3, padding="same", data_format=CF,
                                        dilation_rate=2)),
]


def _id(case):
    cls, _, options = case
    return cls + "-" + "-".join(f"{k}={v}" for k, v in options.items() if k not in ("filters", "kernel_size"))


@pytest.fixture
def float64():
    """float64 everywhere, the compiled loss included (Keras casts the loss to floatx);
    JAX computes in float64 only where 64-bit types are enabled."""
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")  # (conftest restores the policy)
    try:
        if keras.backend.backend() != "jax":
            yield
            return
        import jax

        with jax.enable_x64(True):
            yield
    finally:
        keras.config.set_floatx(floatx)


def _squared_error(target, output):
    """Each example's summed squared error (not Keras's mean: on JAX it reduces float64 in
    float32 unless 64-bit types were enabled before Keras's import)."""
    error = output - ops.cast(target, output.dtype)
    return ops.sum(ops.square(error), axis=tuple(range(1, len(output.shape))))


def _layer_problem(cls, shape, options, trainable_kernel=True):
    """One float64 layer, its inputs, ``D`` of a squared error and the oracle's gradients."""
    if keras.backend.backend() == "tensorflow" and options.get("data_format") == CF and len(shape) == 3:
        pytest.skip("TensorFlow's 2-D convolutions run channels-last only on CPU")
    keras.utils.set_random_seed(0)
    layer = getattr(keras.layers, cls)(dtype="float64", bias_initializer="glorot_uniform", **options)
    model = keras.Sequential([keras.Input(shape, dtype="float64"), layer])
    model.compile(loss=_squared_error)
    if not trainable_kernel:
        next(v for v in layer.trainable_variables if "kernel" in v.path).trainable = False
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B,) + shape)
    out = oracle.to_numpy(model(x))
    target = rng.normal(size=out.shape)
    delta = 2.0 * (out - target)  # dL_i/dy_i
    expected = oracle.batch_of_one_gradients(model, x, target)
    return layer, ops.convert_to_tensor(x), ops.convert_to_tensor(delta), expected


def _close(actual, expected, what):
    actual = oracle.to_numpy(actual)
    scale = max(1e-300, float(np.max(np.abs(expected))))
    assert actual.shape == expected.shape, what
    np.testing.assert_allclose(actual / scale, expected / scale, rtol=0, atol=1e-10, err_msg=what)


def _statistics(rule, layer, x, delta, values, weights, ghost):
    """The rule's statistics, the choice forced (``ghost``: the ghost formulas where the rule
    has them), in one compiled function (eager JAX compiles every op alone)."""
    import unittest.mock

    def compute(values, x, delta, weights):
        with unittest.mock.patch.object(conv, "outer_materializes", lambda *sizes: not ghost):
            return (rule.materializes(layer, x, delta), rule.per_example(layer, values, x, delta),
                    rule.squared_norms(layer, values, x, delta), rule.gram(layer, values, x, delta),
                    rule.cross_gram(layer, values, x, delta, 1),
                    rule.weighted_sum(layer, values, x, delta, weights))

    materializes = rule.materializes  # (a Python bool: outside the compiled function)
    with unittest.mock.patch.object(conv, "outer_materializes", lambda *sizes: not ghost):
        assert materializes(layer, x, delta) is not ghost
    return adapter().compile(lambda *args: compute(*args)[1:])(values, x, delta, weights)


@pytest.mark.parametrize("case", GRID, ids=[_id(c) for c in GRID])
def test_every_statistic_of_every_convolution_matches_the_oracle(case, float64):
    layer, x, delta, expected = _layer_problem(*case)
    rule = rule_for(layer)
    assert isinstance(rule, conv.ConvolutionRule)
    values = [v.value for v in rule.variables(layer)]
    assert rule.pieces(layer, values, x, delta) is not None  # the formulas, not the layer's vjp
    rows = np.concatenate([e.reshape(B, -1) for e in expected], axis=1)
    weights = np.array([[0.3, -1.2, 2.0], [1.0, 0.5, -0.7]])
    columns = [ops.convert_to_tensor(weights[k % 2]) for k in range(len(values))]
    for ghost in (False, True):  # each choice forced
        per_example, norms, gram, block, sums = _statistics(rule, layer, x, delta, values, columns, ghost)
        for k, (g, n, s, e) in enumerate(zip(per_example, norms, sums, expected)):
            _close(g, e, f"per-example gradient {k}")
            _close(n, (e.reshape(B, -1) ** 2).sum(1), f"squared norm {k}, ghost {ghost}")
            _close(s, np.tensordot(weights[k % 2], e, axes=1), f"weighted sum {k}, ghost {ghost}")
        _close(gram, rows @ rows.T, f"Gram matrix, ghost {ghost}")
        _close(block, rows[:1] @ rows[1:].T, f"Gram block, ghost {ghost}")


@pytest.mark.parametrize("case", [GRID[1], GRID[9]], ids=["grouped", "separable"])
def test_a_frozen_kernel_leaves_the_others_to_the_formulas(case, float64):
    layer, x, delta, expected = _layer_problem(*case, trainable_kernel=False)
    rule = rule_for(layer)
    variables = rule.variables(layer)
    assert len(variables) == len(expected) < len(layer.weights)
    grads = rule.per_example(layer, [v.value for v in variables], x, delta)
    assert rule.pieces(layer, [v.value for v in variables], x, delta) is not None
    for k, (g, e) in enumerate(zip(grads, expected)):
        _close(g, e, f"per-example gradient {k}")


def test_a_geometry_the_formulas_do_not_know_takes_the_layers_vjp(monkeypatch, float64):
    layer, x, delta, expected = _layer_problem(*GRID[1])
    rule = rule_for(layer)
    assert conv.left_pads("same", (3, 3), (1, 1), (1, 1), (None, 6), (7, 6)) is None  # unknown size
    assert conv.left_pads("reflect", (3,), (1,), (1,), (5,), (5,)) is None
    monkeypatch.setattr(conv, "left_pads", lambda *args: None)
    values = [v.value for v in rule.variables(layer)]
    assert rule.pieces(layer, values, x, delta) is None and rule.materializes(layer, x, delta)
    for g, e in zip(rule.per_example(layer, values, x, delta), expected):  # (the vjp: in float32)
        np.testing.assert_allclose(oracle.to_numpy(g), e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups, options", [(2, dict(strides=2, padding="same")),
                                             (4, dict(dilation_rate=2))])
def test_grouped_convolutions_on_the_materialized_path(groups, options, float64):
    """The whole model's vectorized per-example gradients (on TensorFlow, pfor's kernel
    gradient: pergrad's patches, ``backend._tensorflow_conv``; TensorFlow's own loop
    rejects groups in float64 and without oneDNN)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((7, 7, 4))
    hidden = keras.layers.Conv2D(4, 3, groups=groups, activation="tanh", **options)(inputs)
    sequence = keras.layers.Reshape((-1, 4))(hidden)
    hidden = keras.layers.Conv1D(4, 2, groups=groups, padding="causal")(sequence)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(hidden)))
    model.compile(loss=_squared_error)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(B, 7, 7, 4)), rng.normal(size=(B, 2))
    expected = oracle.batch_of_one_gradients(model, x, y)
    for k, (g, e) in enumerate(zip(pergrad.per_example_gradients(model, x, y), expected)):
        _close(g, e, f"per-example gradient {k}")


def _all_convolutions():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    layers = keras.layers
    hidden = layers.Conv2D(4, 3, padding="same", groups=2, activation="relu")(inputs)
    hidden = layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2)(hidden)
    hidden = layers.SeparableConv2D(4, 2, activation="tanh")(hidden)
    hidden = LayerScale(0.5, 4)(hidden)  # (ConvNeXt's)
    hidden = layers.Conv2DTranspose(3, 2, strides=2, padding="same")(hidden)
    hidden = layers.Conv2D(4, 1, strides=2, data_format=CF)(hidden)
    sequence = layers.Reshape((-1, 4))(hidden)
    sequence = layers.Conv1D(3, 2, padding="causal", dilation_rate=2)(sequence)
    sequence = layers.SeparableConv1D(2, 2)(sequence)
    outputs = layers.Dense(3)(layers.Flatten()(sequence))
    model = keras.Model(inputs, outputs)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(2)
    return model, rng.normal(size=(5, 8, 8, 4)).astype("float32"), rng.integers(0, 3, 5)


@pytest.mark.parametrize("ghost", [None, True], ids=["chosen", "ghost"])
def test_every_convolution_through_the_engine_matches_the_oracle(ghost, monkeypatch, caplog):
    if ghost is not None:
        monkeypatch.setattr(conv, "outer_materializes", lambda *sizes: not ghost)
    model, x, y = _all_convolutions()
    expected = oracle.batch_of_one_gradients(model, x, y)
    rows = np.concatenate([e.reshape(len(x), -1) for e in expected], axis=1)
    with caplog.at_level("WARNING", logger="pergrad"):
        stats = pergrad.per_example_statistics(model, x, y, gram=True)
    assert "no layer rule" not in caplog.text and "materialized" not in caplog.text, caplog.text
    squared = np.stack([(e.reshape(len(x), -1) ** 2).sum(1) for e in expected], axis=1)
    np.testing.assert_allclose(oracle.to_numpy(stats.squared_norms), squared, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(oracle.to_numpy(stats.gram), rows @ rows.T, rtol=1e-5, atol=1e-6)
    threshold = float(np.median(np.sqrt(squared.sum(1))))  # some examples clipped, some not
    factors = np.minimum(1.0, threshold / np.sqrt(squared.sum(1)))
    assert 0 < np.sum(factors < 1) < len(x)
    before = [oracle.to_numpy(v.value) for v in model.trainable_variables]
    wrapper = pergrad.PerExampleModel(model, clip(threshold))
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=model.loss)
    wrapper.train_on_batch(x, y)  # one clip step: w - mean_i(c_i g_i)
    steps = [b - oracle.to_numpy(v.value) for b, v in zip(before, model.trainable_variables)]
    reference = [np.tensordot(factors, e, axes=1) / len(x) for e in expected]
    oracle.assert_gradients_close(steps, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions, kernel, channels_in, channels_out, groups, ghost", [
    (256, 3, 64, 64, 1, False),  # ResNet50's first stage at 64 x 64: formed
    (64, 3, 128, 128, 1, True),  # its second: 3 T^2 < 9 C_in C_out, ghost
    (4, 1, 1024, 2048, 1, True),  # its last 1 x 1 convolutions
    (256, 7, 96, 96, 96, False),  # ConvNeXt's depthwise 7 x 7 (a grouped Conv2D)
    (4, 3, 32, 32, 32, False),  # a depthwise 3 x 3 on 2 x 2 positions: k m = 9 < 3 T^2
    (1, 3, 4, 4, 1, True),  # one position: the ghost norm is a product of two norms
])
def test_the_choice_between_formed_and_ghost_is_the_dense_one_per_group(
        positions, kernel, channels_in, channels_out, groups, ghost):
    keras.utils.set_random_seed(0)
    side = int(np.sqrt(positions))
    layer = keras.layers.Conv2D(channels_out, kernel, padding="same", groups=groups)
    x = ops.zeros((2, side, side, channels_in))
    delta = ops.zeros((2, side, side, channels_out))
    layer.build(x.shape)
    assert rule_for(layer).materializes(layer, x, delta) is not ghost


def test_the_layers_vjp_stays_the_reference_for_the_formulas(float64):
    """The rule's per-example gradients equal the layer's own vectorized vjp (the fallback
    for geometries the formulas do not know; float32 products)."""
    layer, x, delta, _ = _layer_problem(*GRID[1])
    rule = rule_for(layer)
    values = [v.value for v in rule.variables(layer)]
    for mine, vjp in zip(rule.per_example(layer, values, x, delta),
                         PreActivationRule.per_example(rule, layer, values, x, delta)):
        np.testing.assert_allclose(oracle.to_numpy(mine), oracle.to_numpy(vjp), rtol=1e-5, atol=1e-6)


class MaskedGroupNormalization(keras.layers.GroupNormalization):
    """A subclass whose ``call`` only adds a mask argument (the arithmetic is the parent's)."""

    def call(self, inputs, mask=None):
        return super().call(inputs)


def test_a_subclass_that_redefines_call_takes_its_parents_rule_only_when_registered(monkeypatch):
    from pergrad.layer_rules import base
    from pergrad.layer_rules.normalization import NormalizationRule

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 4))
    norm = MaskedGroupNormalization(2)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(norm(inputs))))
    model.compile(loss="mse")
    assert rule_for(norm) is None  # the fallback: pergrad cannot tell what the new call computes
    monkeypatch.setattr(base, "_RULES", dict(base._RULES))  # (the registration below is this test's)
    pergrad.layer_rules.register_rule(MaskedGroupNormalization)(NormalizationRule)
    assert isinstance(rule_for(norm), NormalizationRule)
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(4, 4, 4, 4)).astype("float32"), rng.normal(size=(4, 2)).astype("float32")
    expected = oracle.batch_of_one_gradients(model, x, y)
    squared = np.stack([(e.reshape(4, -1) ** 2).sum(1) for e in expected], axis=1)
    stats = pergrad.per_example_statistics(model, x, y)
    np.testing.assert_allclose(oracle.to_numpy(stats.squared_norms), squared, rtol=1e-5, atol=1e-7)
