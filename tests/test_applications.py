"""keras.applications backbones through pergrad, as keras.io's transfer-learning guide uses them.

The backbones come from Keras's own list (every public constructor of ``keras.applications``,
grouped into families by the module that defines it), so a new family or model is covered
without a new test. Each is built with ``weights=None``, ``include_top=False`` at the smallest
input it accepts, under a small head, with ``B = 2`` examples:

- **transfer learning** (``base.trainable = False``, ``base(x, training=False)``, pooling,
  ``Dropout(0.2)``, ``Dense(1)``, ``BinaryCrossentropy(from_logits=True)``: the keras.io recipe):
  the per-example gradients and the statistics path's norms equal the batch-of-one oracle,
  ``clip`` trains on the statistics path as on the materialized path (the same dropout draws,
  the frozen base's drop-connect included: Keras 3 runs it in training mode), and ``mean``
  trains like plain ``fit()`` (without dropout: pergrad gives each example its own draws,
  Keras one mask for the batch);
- **full fine-tuning** with the BatchNormalization layers frozen, or converted by
  ``pergrad.layers.replace_batch_normalization``: the per-example gradients and the
  statistics path's norms equal the oracle, and no layer takes the per-layer fallback (every
  layer with weights in keras.applications has a rule: ConvNeXt's LayerScale included).

Comparisons with the oracle run in training mode, or in inference mode where the model
draws random numbers (EfficientNet's drop-connect: no oracle can replay per-example draws;
tests/engine/test_per_example_gradients.py checks them against a kept and a dropped branch).

The suite runs ``FAST`` (a few small models that cover the mechanisms) by default; the whole
sweep (every constructor, both fine-tuning variants) is marked ``applications`` and deselected
by default: ``pytest -m applications tests/test_applications.py`` (tens of minutes per
backend). Models whose per-example gradients would not fit in ``MEMORY_LIMIT`` are skipped
for full fine-tuning.
"""

from __future__ import annotations

import functools
import logging
import re

import keras
import numpy as np
import pytest

import oracle
import pergrad
from pergrad import compat
from pergrad.aggregators import clip
from pergrad.layers import replace_batch_normalization

BACKEND = keras.backend.backend()
B = 2
#: bytes a full fine-tuning test may hold in per-example gradients and their oracle
MEMORY_LIMIT = 2 << 30

#: Every public constructor of keras.applications, by name.
CONSTRUCTORS = {
    name: getattr(keras.applications, name)
    for name in sorted(dir(keras.applications))
    if name[:1].isupper() and callable(getattr(keras.applications, name))
}


def family(name: str) -> str:
    """The module that defines the constructor: ``resnet``, ``resnet_v2``, ``mobilenet_v3``..."""
    return CONSTRUCTORS[name].__module__.rsplit(".", 1)[-1]


def _size_order(name: str):
    """Smallest first, by the names' conventions: Tiny, Small, Mobile, B0, then the depth."""
    tags = ("Tiny", "Small", "Mobile", "B0")
    rank = next((i for i, tag in enumerate(tags) if name.endswith(tag)), len(tags))
    depth = re.search(r"\d+", name.replace("V2", "").replace("V3", ""))
    return (rank, int(depth.group()) if depth else 0, name)


FAMILIES = {}
for _name in sorted(CONSTRUCTORS, key=_size_order):
    FAMILIES.setdefault(family(_name), []).append(_name)
#: the smallest model of each family
SMALLEST = [names[0] for names in FAMILIES.values()]
#: run by default, within about a minute a backend on two cores (measured: the sweep costs
#: 20-120 s of CPU a model and test): the keras.io recipe and fine-tuning with BatchNorm
#: converted on MobileNet (the family with the fewest layers), and on torch the frozen base
#: with drop-connect that failed there (EfficientNetB0; tests/engine covers drop-connect on
#: every backend)
FAST = {("MobileNet", "transfer"), ("MobileNet", "converted")} | (
    {("EfficientNetB0", "transfer")} if BACKEND == "torch" else set())


@functools.cache
def smallest_input(name: str) -> int:
    """The smallest square input the constructor accepts, from what it says when refusing a
    1x1 input before building anything ("at least 75x75"); 32 (five halvings) otherwise."""
    try:
        CONSTRUCTORS[name](weights=None, include_top=False, input_shape=(1, 1, 3))
    except Exception as error:  # (a model without the check fails in its first layers)
        found = re.search(r"at least (\d+)x\d+", str(error))
        if found:
            return int(found.group(1))
    return 32


def _backbone(name: str, mode: str, seed: int = 0):
    """keras.io's recipe on ``name``: ``mode`` ``"transfer"`` (frozen base, Dropout head),
    ``"frozen"`` (all trainable but BatchNormalization) or ``"converted"`` (BatchNormalization
    replaced by GroupNormalization)."""
    size = smallest_input(name)
    keras.utils.set_random_seed(seed)
    try:
        base = CONSTRUCTORS[name](weights=None, include_top=False, input_shape=(size, size, 3))
    except ValueError as error:  # "NASNetMobile is not available with the torch backend ..."
        if "not available with the" in str(error):
            pytest.skip(str(error).split(". ")[0])
        raise
    inputs = keras.Input((size, size, 3))
    hidden = keras.layers.GlobalAveragePooling2D()(base(inputs, training=False))
    if mode == "transfer":
        base.trainable = False
        hidden = keras.layers.Dropout(0.2)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden), name=f"{name}_{mode}")
    if mode == "frozen":
        for layer in compat.flatten_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False
    if mode == "converted":
        model = replace_batch_normalization(model)
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 255.0, size=(B, size, size, 3)).astype("float32")
    x = np.asarray(getattr(keras.applications, family(name)).preprocess_input(images), "float32")
    # One label for both: at a random base's near-zero logits, the two examples' bias gradients
    # (sigmoid(0) - y) would otherwise cancel in every rule. The label the logits are not on:
    # a random base's features can be large (EfficientNetV2L's logits pass 17), where
    # sigmoid(z) - 1 is exactly 0 in float32 and there would be no gradient to compare.
    label = float(np.mean(keras.ops.convert_to_numpy(model(x, training=False))) < 0)
    return model, x, np.full((B, 1), label, "float32")


def _draws_random(model) -> bool:
    return any(compat.seed_generators(layer) for layer in compat.flatten_layers(model))


def _fallback_classes(model, caplog) -> set:
    """The classes of the layers the statistics path logged as taking the fallback."""
    names = set()
    for record in caplog.records:
        found = re.search(r"no layer rule for (\[.*?\])", record.getMessage())
        if found:
            names |= set(re.findall(r"'([^']+)'", found.group(1)))
    by_name = {layer.name: type(layer).__name__ for layer in compat.flatten_layers(model)}
    return {by_name.get(name, name) for name in names}


def _assert_exact(model, x, y, caplog):
    """Per-example gradients and statistics-path norms against the batch-of-one oracle;
    returns the classes of the layers that took the fallback and the oracle's norms."""
    training = not _draws_random(model)
    expected = oracle.batch_of_one_gradients(model, x, y, training=training)
    assert max(float(np.abs(e).max()) for e in expected) > 0, "no gradient to compare"
    grads = pergrad.per_example_gradients(model, x, y, training=training)
    oracle.assert_gradients_close(grads, expected, rtol=1e-4, atol=1e-5, what="per-example gradient")
    del grads
    norms = np.stack([np.sum(np.reshape(e, (B, -1)).astype("float64") ** 2, axis=1) for e in expected], 1)
    with caplog.at_level(logging.INFO, logger="pergrad"):
        stats = pergrad.per_example_statistics(model, x, y, training=training)
    np.testing.assert_allclose(oracle.to_numpy(stats.squared_norms), norms, rtol=1e-4,
                               atol=1e-6 * float(norms.max()))
    assert "materialized path" not in caplog.text, caplog.text
    return _fallback_classes(model, caplog), np.sqrt(norms.sum(axis=1))


def _cases(modes, names):
    for mode in modes:
        for name in names:
            marks = [] if (name, mode) in FAST else [pytest.mark.applications]
            yield pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


def _refuse(*args, **kwargs):
    raise AssertionError("the statistics path built the materialized per-example gradients")


class _Snapshot:
    """Every variable's value (weights, seed states), to train the same model again from them."""

    def __init__(self, model):
        self.model, self.values = model, [oracle.to_numpy(v.value).copy() for v in model.variables]

    def restore(self):
        for variable, value in zip(self.model.variables, self.values):
            variable.assign(value)
        return self.model


def _fit(model, rule, optimizer, **options):
    """``model`` (``rule=None``) or ``PerExampleModel(model, rule)``, compiled."""
    trained = model if rule is None else pergrad.PerExampleModel(model, rule, **options)
    trained.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return trained


def _assert_same_update(actual, expected, start):
    """Two trainings' weight changes equal (relative to the larger change), and not zero."""
    actual = [a - s for a, s in zip(actual, start)]
    expected = [e - s for e, s in zip(expected, start)]
    largest = max(float(np.abs(e).max()) for e in expected)
    assert largest > 1e-4, "training did not move the weights: the comparison is vacuous"
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4 * largest)


@pytest.mark.parametrize("name, mode", list(_cases(["transfer"], CONSTRUCTORS)))
def test_transfer_learning_is_exact(name, mode, caplog, monkeypatch):
    model, x, y = _backbone(name, mode)
    start, initial = _Snapshot(model), model.get_weights()
    fallback, norms = _assert_exact(model, x, y, caplog)
    assert fallback == set()
    # Steps scaled to the gradients (a randomly initialized base may give tiny features): a
    # threshold that clips every example, a learning rate that moves a weight by up to ~0.1.
    assert np.all(norms > 0), norms
    threshold = float(np.min(norms)) / 2
    learning_rate = 0.1 / threshold

    def trained(rule, **options):
        wrapper = _fit(start.restore(), rule, keras.optimizers.SGD(learning_rate), **options)
        keras.utils.set_random_seed(3)  # the same draws on every path (torch's generator)
        wrapper.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False)
        return model.get_weights()

    materialized = trained(clip(threshold), path="materialized")
    with monkeypatch.context() as patch:
        patch.setattr(pergrad.engine.PerExampleProblem, "compute", _refuse)
        statistics = trained(clip(threshold), path="statistics")
    _assert_same_update(statistics, materialized, initial)
    # With dropout, pergrad's mean gives each example its own draws, where Keras draws one
    # mask for the batch: the two agree on the same model without it.
    for layer in compat.flatten_layers(model):
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    _assert_same_update(trained("mean"), trained(None), initial)


@pytest.mark.parametrize("name, mode", list(_cases(["frozen", "converted"], CONSTRUCTORS)))
def test_full_fine_tuning_is_exact(name, mode, caplog, record_property):
    if mode == "frozen" and name not in SMALLEST and (name, mode) not in FAST:
        pytest.skip("the larger models of a family: converted only")
    model, x, y = _backbone(name, mode)
    needed = 2 * B * 4 * model.count_params()  # per-example gradients and their oracle, float32
    if needed > MEMORY_LIMIT:
        pytest.skip(f"{name}'s per-example gradients and oracle: {needed / 2**30:.1f} GiB")
    assert not pergrad.layers.mixing_batch_normalization(model)
    fallback, _ = _assert_exact(model, x, y, caplog)
    record_property("fallback", ",".join(sorted(fallback)))  # (in --junitxml's report)
    assert not fallback, fallback
