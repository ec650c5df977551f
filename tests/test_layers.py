"""``pergrad.layers``: the one BatchNormalization check and ``replace_batch_normalization``.

The refusal counts the layers, names a few and gives one line of advice (the engine's
``ValueError`` and DP validation's ``NotPrivateError`` alike); the conversion gives a new
model with the original's weights and a GroupNormalization in place of every trainable
BatchNormalization, nested models too, whose per-example gradients equal the batch-of-one
oracle and whose ``mean`` trains like plain ``fit()``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import oracle
import pergrad
from pergrad.layers import group_count, replace_batch_normalization
from pergrad.privacy import NotPrivateError, validate_model_for_dp

B = 4


def _randomized_batch_normalization(model, rng):
    """Non-default gamma, beta and moving statistics: a copy that ignored them would differ."""
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.BatchNormalization):
            for variable in (v for v in (layer.gamma, layer.beta, layer.moving_mean) if v is not None):
                variable.assign(rng.normal(size=variable.shape).astype("float32"))
            variance = rng.uniform(0.5, 2.0, size=layer.moving_variance.shape)
            layer.moving_variance.assign(variance.astype("float32"))


def _convnet(seed=0, nested=True):
    """A base model (conv -> BN -> conv -> BN, 12 channels) called with ``training=False``
    inside a functional model with a dense BN in its head, as keras.io fine-tunes."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(12, 3, padding="same", name="conv_a")(inputs)
    h = keras.layers.BatchNormalization(name="bn_a")(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2D(12, 3, name="conv_b")(h)
    h = keras.layers.BatchNormalization(name="bn_b", epsilon=1e-5, center=False)(h)
    base = keras.Model(inputs, h, name="base")
    outer = keras.Input((6, 6, 3))
    h = base(outer, training=False) if nested else base(outer)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(8, name="hidden")(h)
    h = keras.layers.BatchNormalization(name="bn_dense")(h)
    model = keras.Model(outer, keras.layers.Dense(3, name="head")(h), name="finetune")
    _randomized_batch_normalization(model, np.random.default_rng(seed))
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, 6, 6, 3)).astype("float32"), rng.integers(0, 3, size=(B,)).astype("int32")


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _layers(model, kind):
    return [layer for layer in model._flatten_layers() if type(layer) is kind]


def test_group_count():
    assert group_count(12, 4, 8) == 6  # the largest divisor of 12 not above 8
    assert group_count(144, 4, 32) == 24
    assert group_count(32, 4, 32) == 32
    assert group_count(7, 4, 32) == 7
    assert group_count(7, 4, 3) == 1
    assert group_count(16, 2, 32) == 1  # after a Dense layer: a layer normalization


def test_conversion_keeps_the_structure_and_the_weights():
    model = _convnet()
    model.get_layer("base").get_layer("conv_b").trainable = False
    start = {v.path: v.numpy().copy() for v in model.weights}
    converted = replace_batch_normalization(model, groups=8)

    assert converted is not model
    assert not _layers(converted, keras.layers.BatchNormalization)
    norms = {layer.name: layer for layer in _layers(converted, keras.layers.GroupNormalization)}
    assert sorted(norms) == ["bn_a", "bn_b", "bn_dense"]
    assert (norms["bn_a"].groups, norms["bn_b"].groups, norms["bn_dense"].groups) == (6, 6, 1)
    assert norms["bn_b"].epsilon == 1e-5 and norms["bn_b"].center is False
    for name, original in (("bn_a", model.get_layer("base").get_layer("bn_a")),
                           ("bn_b", model.get_layer("base").get_layer("bn_b")),
                           ("bn_dense", model.get_layer("bn_dense"))):
        np.testing.assert_array_equal(norms[name].gamma.numpy(), original.gamma.numpy())
        if original.center:
            np.testing.assert_array_equal(norms[name].beta.numpy(), original.beta.numpy())
    for name in ("conv_a", "conv_b"):
        old, new = model.get_layer("base").get_layer(name), converted.get_layer("base").get_layer(name)
        assert new is not old
        for a, b in zip(old.get_weights(), new.get_weights()):
            np.testing.assert_array_equal(a, b)
    for name in ("hidden", "head"):
        for a, b in zip(model.get_layer(name).get_weights(), converted.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    # The same trainable flags (a frozen layer in a nested model), the moving statistics dropped.
    assert converted.get_layer("base").get_layer("conv_b").trainable is False
    trainable = [v.path for v in model.trainable_variables]
    assert [v.path for v in converted.trainable_variables] == trainable
    assert len(converted.weights) == len(model.weights) - 2 * 3
    # Training the copy leaves the original as it was (on JAX, a step donates the arrays it
    # trains: a copy sharing the original's would delete them), and still refused.
    x, y = _data()
    converted.compile(optimizer="sgd", loss=_loss())
    converted.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert {v.path: v.numpy() for v in model.weights}.keys() == start.keys()
    for v in model.weights:
        np.testing.assert_array_equal(v.numpy(), start[v.path])
    assert model.predict(x, verbose=0).shape == (B, 3)
    assert len(_layers(model, keras.layers.BatchNormalization)) == 3


def test_a_frozen_batch_normalization_is_kept():
    model = _convnet()
    model.get_layer("base").get_layer("bn_a").trainable = False
    converted = replace_batch_normalization(model)
    kept = converted.get_layer("base").get_layer("bn_a")
    assert type(kept) is keras.layers.BatchNormalization and not kept.trainable
    original = model.get_layer("base").get_layer("bn_a")
    np.testing.assert_array_equal(kept.moving_mean.numpy(), original.moving_mean.numpy())
    np.testing.assert_array_equal(kept.moving_variance.numpy(), original.moving_variance.numpy())


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_the_converted_model_trains_exactly_per_example(kind):
    """Per-example gradients equal the batch-of-one oracle (the original is refused), and
    ``mean`` trains like plain ``fit()``."""
    if kind == "functional":
        make = lambda: replace_batch_normalization(_convnet())  # noqa: E731
    else:
        def make():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                                      keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
                                      keras.layers.Dense(3, name="head")], name="plain")
            _randomized_batch_normalization(model, np.random.default_rng(0))
            return replace_batch_normalization(model, groups=2)
    x, y = _data()
    model = make()
    assert isinstance(model, keras.Sequential) == (kind == "sequential")
    model.compile(loss=_loss())
    grads = pergrad.per_example_gradients(model, x, y)
    expected = oracle.batch_of_one_gradients(model, x, y)
    oracle.assert_gradients_close(grads, expected)
    assert max(float(np.abs(e).max()) for e in expected) > 1e-3

    plain, inner = make(), make()
    inner.set_weights(plain.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    wrapper = pergrad.PerExampleModel(inner, "mean")
    wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    start = inner.get_weights()
    for trained in (plain, wrapper):
        trained.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    oracle.assert_weights_close(inner, plain, atol=1e-5, rtol=1e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(inner.get_weights(), start)) > 1e-4


class _Block(keras.layers.Layer):
    """A subclassed layer with a BatchNormalization inside its own ``call``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(4, 3, padding="same")
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        return self.norm(self.conv(x), training=training)


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = _Block()
        self.head = keras.layers.Dense(3)

    def call(self, x, training=None):
        return self.head(keras.ops.mean(self.block(x, training=training), axis=(1, 2)))


def test_what_cannot_be_rewired_is_refused_and_a_frozen_one_passes():
    subclassed = _Subclassed(name="mine")
    subclassed(np.zeros((1, 6, 6, 3), "float32"))
    with pytest.raises(ValueError, match=r"'mine' \(_Subclassed\).*freeze them"):
        replace_batch_normalization(subclassed)
    inputs = keras.Input((6, 6, 3))
    block = _Block(name="block")
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(block(inputs))))
    with pytest.raises(ValueError, match=r"'block' \(_Block\) holds trainable BatchNormalization"):
        replace_batch_normalization(model)
    block.norm.trainable = False  # nothing to convert there: the rest is
    assert type(replace_batch_normalization(model).get_layer("block")) is _Block
    unbuilt = keras.Sequential([keras.layers.Dense(2), keras.layers.BatchNormalization()])
    with pytest.raises(ValueError, match="not built"):
        replace_batch_normalization(unbuilt)
    with pytest.raises(ValueError, match="groups"):
        replace_batch_normalization(_convnet(), groups=0)


def _many_batch_normalizations(count=10):
    inputs = keras.Input((4,))
    h = inputs
    for i in range(count):
        h = keras.layers.BatchNormalization(name=f"norm_{i}")(keras.layers.Dense(4, name=f"dense_{i}")(h))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(h), name="deep")
    model.compile(loss="mse")
    return model


def test_the_refusal_counts_names_a_few_and_advises_once():
    model = _many_batch_normalizations()
    x, y = np.ones((3, 4), "float32"), np.zeros((3, 2), "float32")
    with pytest.raises(ValueError) as raised:
        pergrad.per_example_gradients(model, x, y)
    engine = str(raised.value)
    with pytest.raises(NotPrivateError) as raised:
        validate_model_for_dp(model)
    privacy = str(raised.value)
    for message in (engine, privacy):
        assert "'norm_0', 'norm_1', 'norm_2' and 7 more (10 trainable BatchNormalization layers)" in message
        assert "norm_3" not in message
        assert message.count("Freeze") == 1 and "replace_batch_normalization" in message
        assert "keras-team/keras#20285" not in message  # no nested model here
        assert len(message) < 600, len(message)
    assert "per-example gradients are undefined" in engine
    assert "clipping no longer bounds" in privacy
    validate_model_for_dp(replace_batch_normalization(model))  # converted: nothing refused


def test_the_keras_io_fine_tuning_recipe_is_refused_with_the_working_recipe():
    """``base.trainable = True`` and ``base(x, training=False)``: Keras 3's ``fit()`` runs the
    base's BatchNormalization in training mode anyway (its functional call hands the outer
    ``training=True`` to every layer), plain Keras too: its moving statistics move. pergrad
    refuses, says why, and the two recipes it gives train."""
    x, y = _data()
    plain = _convnet()
    plain.compile(optimizer="sgd", loss=_loss())
    moving = plain.get_layer("base").get_layer("bn_a").moving_mean
    before = moving.numpy().copy()
    plain.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert np.abs(moving.numpy() - before).max() > 1e-4, "Keras ran the nested BN in inference mode"

    model = _convnet()
    wrapper = pergrad.PerExampleModel(model, pergrad.aggregators.clip(1.0))
    wrapper.compile(optimizer="sgd", loss=_loss())
    with pytest.raises(ValueError, match=r"(?s)3 trainable BatchNormalization.*training=False does not help"):
        wrapper.fit(x, y, batch_size=B, verbose=0)

    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
    for fixed in (model, replace_batch_normalization(_convnet())):
        wrapper = pergrad.PerExampleModel(fixed, pergrad.aggregators.clip(1.0))
        wrapper.compile(optimizer="sgd", loss=_loss())
        history = wrapper.fit(x, y, batch_size=B, epochs=2, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))


def test_operations_of_the_graph_are_cloned_too():
    """A functional model holds operations that are not layers (``a + b`` on symbolic tensors,
    as ConvNeXt's residuals): they are rebuilt, with nothing to copy."""
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h) + h
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    converted = replace_batch_normalization(model, groups=2)
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype("float32")
    assert converted(x).shape == (2, 2)
    assert not _layers(converted, keras.layers.BatchNormalization)
