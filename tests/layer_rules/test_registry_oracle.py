"""Every registered layer rule against the batch-of-one oracle, driven by the registry.

The registry (:func:`pergrad.layer_rules.registered_rules`) is the list of what is tested:
every layer class pergrad registers a rule for (Keras's, keras-hub's by dotted path) must
have cases in :data:`CASES`, a few tiny shapes each; a new rule gets its test by being
registered (:func:`test_every_registered_rule_has_cases` fails until its cases are written).

A case is one layer (a LoRA-enabled one, a layer called twice) on an input of its own. The
cases of one rule module (``conv``, ``normalization``, ...) are branches of one model, their
outputs flattened and concatenated under a squared error with sample weights, so that each
module's model is compiled once per backend; each case then checks its own variables: each
example's squared norms from the statistics path and its gradients from the materialized path
equal the oracle's (float32, to 1e-5 of each variable's largest entry: float32's rounding is
below 1e-6 of it here on every backend), every variable's gradient is not zero, the case's
layer took the rule registered for its class, and no layer of the case took the per-layer
fallback (nor the model the materialized path). The cases of one module share a worker under
``pytest -n --dist loadgroup`` (``make test``): each worker that runs one of them builds the model.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from collections.abc import Callable

import keras
import numpy as np
import pytest
from keras import layers

import oracle
import pergrad
from pergrad.layer_rules import registered_rules, rule_for

B = 3
RTOL, ATOL = 1e-5, 1e-5
CF = "channels_first"
TENSORFLOW = keras.backend.backend() == "tensorflow"


@dataclasses.dataclass
class Case:
    """One layer on its own input: ``make(name)`` builds the layer, ``call(layer, x)`` applies it
    (by default ``layer(x)``), ``prepare(layer)`` runs once it is built (``enable_lora``)."""

    name: str
    shape: tuple
    make: Callable
    call: Callable | None = None
    prepare: Callable | None = None
    vocab: int | None = None  # integer ids in [0, vocab) instead of floats
    skip: str | None = None
    xfail: str | None = None  # a known mismatch with the oracle: the reason (strict)
    ruled: Callable | None = None  # the layer that takes the rule, of the one made (default: it)


def _lora(rank):
    return lambda layer: layer.enable_lora(rank)


def _twice(layer, x):
    return layer(layer(x), reverse=True)  # a tied table: ids -> embeddings -> logits


def _hub(module, name, *args, **kwargs):
    """A keras-hub class, imported when the case runs (keras-hub is optional)."""
    def make(_):
        return getattr(importlib.import_module(f"keras_hub.src.{module}"), name)(*args, **kwargs)
    return make


def _hub_norm(module, name, *args, flat=False):
    """A keras-hub norm on a sequence (and on a flat input)."""
    cases = [Case("sequence", (3, 6), _hub(module, name, *args))]
    return cases + [Case("flat", (6,), _hub(module, name, *args))] * flat


_CF_2D = "TensorFlow's 2-D convolutions run channels-last only on CPU" if TENSORFLOW else None


def _path(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


#: The cases of every registered class, by the class's dotted path.
CASES = {
    _path(layers.Dense): [
        Case("flat", (4,), lambda n: layers.Dense(3, activation="tanh", name=n)),
        Case("sequence_ghost", (3, 8), lambda n: layers.Dense(8, use_bias=False, name=n)),  # Gram norms
        Case("sequence_formed", (3, 4), lambda n: layers.Dense(2, activation="relu", name=n)),
        Case("lora_sequence", (3, 4), lambda n: layers.Dense(5, name=n), prepare=_lora(2)),
        Case("lora_flat", (4,), lambda n: layers.Dense(3, name=n), prepare=_lora(1)),
    ],
    _path(layers.EinsumDense): [
        Case("flat", (4,), lambda n: layers.EinsumDense("ab,bc->ac", (3,), bias_axes="c", name=n)),
        Case("heads", (3, 4), lambda n: layers.EinsumDense("btd,dnh->btnh", (3, 2, 2), bias_axes="nh",
                                                            name=n)),
        Case("output", (3, 2, 2), lambda n: layers.EinsumDense("btnh,nhd->btd", (3, 4), name=n)),
        Case("ellipsis", (3, 4), lambda n: layers.EinsumDense("...b,bc->...c", (3,), bias_axes="c", name=n)),
        Case("lora_heads", (3, 4), lambda n: layers.EinsumDense("btd,dnh->btnh", (3, 2, 2), bias_axes="nh",
                                                                 name=n), prepare=_lora(2)),
        Case("attention", (3, 4), lambda n: layers.MultiHeadAttention(2, 2, use_bias=False, name=n),
             call=lambda layer, x: layer(x, x, use_causal_mask=True),  # (a key bias has no gradient)
             ruled=lambda layer: layer.query_dense),
    ],
    _path(layers.Embedding): [
        Case("formed", (5,), lambda n: layers.Embedding(7, 3, name=n), vocab=7),  # 21 <= 3 T^2
        Case("token_pairs", (5,), lambda n: layers.Embedding(40, 4, name=n), vocab=40),  # 160 > 3 T^2
        Case("grid", (2, 3), lambda n: layers.Embedding(6, 2, name=n), vocab=6),
    ],
    _path(layers.ReversibleEmbedding): [
        Case("tied", (5,), lambda n: layers.ReversibleEmbedding(11, 4, logit_soft_cap=3.0, name=n),
             call=_twice, vocab=11),
        Case("untied", (5,), lambda n: layers.ReversibleEmbedding(9, 3, tie_weights=False, name=n),
             call=_twice, vocab=9),
    ],
    _path(layers.Conv1D): [
        Case("causal_dilated", (9, 2), lambda n: layers.Conv1D(3, 3, padding="causal", dilation_rate=2,
                                                               name=n)),
        Case("grouped_strided", (9, 4), lambda n: layers.Conv1D(4, 2, strides=2, groups=4, padding="same",
                                                                name=n)),
    ],
    _path(layers.Conv2D): [
        Case("valid", (5, 4, 3), lambda n: layers.Conv2D(3, 3, activation="tanh", name=n)),
        Case("grouped_strided", (5, 4, 4), lambda n: layers.Conv2D(4, 3, strides=2, padding="same", groups=2,
                                                                   use_bias=False, name=n)),
        Case("dilated_channels_first", (2, 5, 4), lambda n: layers.Conv2D(
            2, (2, 3), dilation_rate=2, padding="same", data_format=CF, name=n), skip=_CF_2D),
        Case("pointwise_ghost", (2, 2, 8), lambda n: layers.Conv2D(8, 1, name=n)),  # 3 T^2 < C_in C_out
    ],
    _path(layers.Conv3D): [
        Case("strided", (4, 3, 3, 2), lambda n: layers.Conv3D(2, 2, padding="same", strides=(1, 2, 1),
                                                              name=n)),
    ],
    _path(layers.DepthwiseConv1D): [
        Case("channels_first_dilated", (3, 9), lambda n: layers.DepthwiseConv1D(
            3, dilation_rate=2, data_format=CF, name=n)),
        Case("multiplier_strided", (9, 2), lambda n: layers.DepthwiseConv1D(
            2, strides=2, depth_multiplier=2, padding="same", use_bias=False, name=n)),
    ],
    _path(layers.DepthwiseConv2D): [
        Case("multiplier_strided", (5, 4, 3), lambda n: layers.DepthwiseConv2D(
            3, depth_multiplier=2, padding="same", strides=2, name=n)),
        Case("valid", (4, 4, 2), lambda n: layers.DepthwiseConv2D(2, use_bias=False, name=n)),
    ],
    _path(layers.SeparableConv1D): [
        Case("strided", (9, 2), lambda n: layers.SeparableConv1D(3, 2, strides=2, name=n)),
        Case("multiplier_same", (7, 3), lambda n: layers.SeparableConv1D(2, 3, depth_multiplier=2,
                                                                         padding="same", name=n)),
    ],
    _path(layers.SeparableConv2D): [
        Case("multiplier_same", (5, 4, 3), lambda n: layers.SeparableConv2D(
            4, 3, depth_multiplier=2, padding="same", activation="tanh", name=n)),
        Case("valid", (4, 4, 2), lambda n: layers.SeparableConv2D(2, 2, use_bias=False, name=n)),
    ],
    _path(layers.Conv1DTranspose): [
        Case("same_output_padding", (5, 2), lambda n: layers.Conv1DTranspose(
            3, 3, strides=2, padding="same", output_padding=1, name=n)),
        Case("valid_output_padding", (5, 2), lambda n: layers.Conv1DTranspose(
            3, 4, strides=3, output_padding=2, name=n)),
    ],
    _path(layers.Conv2DTranspose): [
        Case("strided_same", (4, 3, 3), lambda n: layers.Conv2DTranspose(2, 3, strides=2, padding="same",
                                                                         name=n)),
        Case("dilated_channels_first", (2, 4, 3), lambda n: layers.Conv2DTranspose(
            2, 3, padding="same", data_format=CF, dilation_rate=2, use_bias=False, name=n), skip=_CF_2D),
    ],
    _path(layers.Conv3DTranspose): [
        Case("strided_same", (2, 3, 2, 2), lambda n: layers.Conv3DTranspose(
            2, 2, strides=(1, 2, 1), padding="same", name=n)),
    ],
    _path(layers.GroupNormalization): [
        Case("image", (3, 3, 4), lambda n: layers.GroupNormalization(2, name=n)),
        Case("sequence_uncentered", (3, 6), lambda n: layers.GroupNormalization(3, center=False, name=n)),
        Case("channels_first", (4, 5), lambda n: layers.GroupNormalization(2, axis=1, name=n)),  # layer vjp
    ],
    _path(layers.LayerNormalization): [
        Case("sequence", (3, 6), lambda n: layers.LayerNormalization(name=n)),
        Case("two_axes", (3, 2, 4), lambda n: layers.LayerNormalization(axis=[-2, -1], name=n)),
        Case("flat_unscaled", (6,), lambda n: layers.LayerNormalization(scale=False, name=n)),
        Case("rms_scaling", (3, 6), lambda n: layers.LayerNormalization(rms_scaling=True, name=n)),
    ],
    _path(layers.RMSNormalization): [
        Case("sequence", (3, 6), lambda n: layers.RMSNormalization(name=n)),
        Case("flat", (6,), lambda n: layers.RMSNormalization(epsilon=0.5, name=n)),
    ],
    "keras.src.applications.convnext.LayerScale": [
        Case("image", (3, 3, 4), lambda n: _layer_scale(0.5, 4, name=n)),
        Case("sequence", (3, 5), lambda n: _layer_scale(1.0, 5, name=n)),
    ],
    _path(layers.RNN): [
        Case("lstm_sequences", (4, 3), lambda n: layers.LSTM(3, return_sequences=True, name=n)),
        Case("gru", (4, 3), lambda n: layers.GRU(3, name=n)),
        Case("simple_rnn", (4, 3), lambda n: layers.SimpleRNN(3, use_bias=False, name=n)),
        Case("gru_cell_reset_before", (4, 3), lambda n: layers.RNN(  # (each loop costs ~4 s on TensorFlow)
            layers.GRUCell(2, reset_after=False), return_sequences=True, go_backwards=True, name=n)),
    ],
    # keras-hub's (registered by dotted path)
    "keras_hub.src.layers.modeling.position_embedding.PositionEmbedding": [
        Case("longer_table", (5, 4), _hub("layers.modeling.position_embedding", "PositionEmbedding", 7)),
        Case("exact_table", (3, 2, 4), _hub("layers.modeling.position_embedding", "PositionEmbedding", 2)),
    ],
    "keras_hub.src.models.vit.vit_layers.ViTPatchingAndEmbedding": [
        Case("patches", (4, 4, 3), _hub("models.vit.vit_layers", "ViTPatchingAndEmbedding",
                                        image_size=(4, 4), patch_size=(2, 2), hidden_dim=4)),
    ],
    "keras_hub.src.layers.modeling.rms_normalization.RMSNormalization":
        _hub_norm("layers.modeling.rms_normalization", "RMSNormalization", 6, flat=True),
    "keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm":
        _hub_norm("models.llama.llama_layernorm", "LlamaLayerNorm"),
    "keras_hub.src.models.mistral.mistral_layer_norm.MistralLayerNormalization":
        _hub_norm("models.mistral.mistral_layer_norm", "MistralLayerNormalization"),
    "keras_hub.src.models.mixtral.mixtral_layer_norm.MixtralLayerNormalization":
        _hub_norm("models.mixtral.mixtral_layer_norm", "MixtralLayerNormalization"),
    "keras_hub.src.models.phi3.phi3_layernorm.Phi3LayerNorm":
        _hub_norm("models.phi3.phi3_layernorm", "Phi3LayerNorm"),
    "keras_hub.src.models.qwen.qwen_layernorm.QwenLayerNorm":
        _hub_norm("models.qwen.qwen_layernorm", "QwenLayerNorm"),
    "keras_hub.src.models.qwen3.qwen3_layernorm.Qwen3LayerNorm":
        _hub_norm("models.qwen3.qwen3_layernorm", "Qwen3LayerNorm"),
    "keras_hub.src.models.t5.t5_layer_norm.T5LayerNorm":
        _hub_norm("models.t5.t5_layer_norm", "T5LayerNorm"),
    "keras_hub.src.models.gemma.rms_normalization.RMSNormalization":
        _hub_norm("models.gemma.rms_normalization", "RMSNormalization", flat=True),
    "keras_hub.src.models.gemma3.gemma3_layers.RMSNormalization":
        _hub_norm("models.gemma3.gemma3_layers", "RMSNormalization"),
}


def _layer_scale(*args, **kwargs):
    from keras.src.applications.convnext import LayerScale

    return LayerScale(*args, **kwargs)


def _pergrads_rules():
    """pergrad's own registrations (a test module's rules for its own classes are not its)."""
    return {path: rule for path, rule in registered_rules().items() if rule.__module__.startswith("pergrad.")}


RULES = _pergrads_rules()


def _family(path):
    """The rule's module: the cases of one module are one model."""
    return RULES[path].__module__.rsplit(".", 1)[1]


def _import(path):
    """The class at a dotted path, or ``None`` when its package is not installed."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # (a nested class's qualified name has dots too)
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name == parts[0]:
                return None
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(f"cannot import {path}")


def _id(path, case):
    return f"{path.replace('keras.src.', '').replace('keras_hub.src.', 'keras_hub.')}-{case.name}"


def _layer_name(path, case):
    return re.sub(r"\W", "_", _id(path, case))


PARAMS = [pytest.param(path, case, id=_id(path, case), marks=[pytest.mark.xdist_group(_family(path))] + (
              [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []))
          for path in RULES for case in CASES.get(path, [])]


def test_every_registered_rule_has_cases():
    """A rule registered without cases fails here: write its cases in :data:`CASES`."""
    missing = sorted(set(RULES) - set(CASES))
    assert not missing, f"registered rules without cases in CASES: {missing}"
    stale = sorted(set(CASES) - set(RULES))
    assert not stale, f"CASES for classes without a registered rule: {stale}"
    assert all(CASES[path] for path in RULES)


# --- one model per rule module, its results shared by its cases ------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@dataclasses.dataclass
class _Branch:
    layer: object
    layers: list
    columns: list  # the branch's variables' positions in model.trainable_variables


_RESULTS = {}


def _family_results(family):
    """Builds the module's model from its runnable cases, and computes the statistics path's
    norms, the materialized gradients and the oracle's (once per module and process; an error,
    once too)."""
    if family not in _RESULTS:
        try:
            _RESULTS[family] = _compute(family)
        except Exception as error:  # (every case of the module fails with it, computed once)
            _RESULTS[family] = error
    if isinstance(_RESULTS[family], Exception):
        raise _RESULTS[family]
    return _RESULTS[family]


def _compute(family):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    inputs, xs, outputs, branches = [], [], [], {}
    for path in RULES:
        if _family(path) != family or _import(path) is None:
            continue
        for case in CASES.get(path, []):
            if case.skip:
                continue
            dtype = "float32" if case.vocab is None else "int32"
            tensor = keras.Input(case.shape, dtype=dtype)
            layer = case.make(_layer_name(path, case))
            out = (case.call or (lambda layer, x: layer(x)))(layer, tensor)
            if case.prepare is not None:
                case.prepare(layer)
            branch = keras.Model(tensor, out)  # (the branch's layers and variables; never called)
            for v in branch.trainable_variables:  # away from ones and zeros (scales, LoRA's B)
                v.assign(oracle.to_numpy(v.value) + 0.3 * rng.normal(size=v.shape).astype("float32"))
            if case.vocab is None:
                x = rng.normal(size=(B,) + case.shape).astype("float32")
            else:
                x = rng.integers(0, case.vocab, size=(B,) + case.shape).astype("int32")
                x.reshape(B, -1)[:, 1] = x.reshape(B, -1)[:, 0]  # a repeated token
            inputs.append(tensor)
            xs.append(x)
            outputs.append(layers.Flatten()(out) if len(out.shape) > 2 else out)
            ruled = layer if case.ruled is None else case.ruled(layer)
            branches[(path, case.name)] = _Branch(ruled, branch._flatten_layers(include_self=False),
                                                  [v for v in branch.trainable_variables])
    model = keras.Model(inputs, layers.Concatenate()(outputs) if len(outputs) > 1 else outputs[0])
    model.compile(loss="mse")
    positions = {id(v): k for k, v in enumerate(model.trainable_variables)}
    for branch in branches.values():
        branch.columns = [positions[id(v)] for v in branch.columns]
    y = rng.normal(size=(B, model.output.shape[-1])).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=(B,)).astype("float32")

    records = _Records()
    logger = logging.getLogger("pergrad")
    logger.addHandler(records)
    try:
        norms = oracle.to_numpy(pergrad.per_example_statistics(model, xs, y, weights).squared_norms)
    finally:
        logger.removeHandler(records)
    grads = [oracle.to_numpy(g) for g in pergrad.per_example_gradients(model, xs, y, weights)]
    expected = oracle.batch_of_one_gradients(model, xs, y, weights)
    return branches, norms, grads, expected, records.messages


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
@pytest.mark.parametrize("path, case", PARAMS)
def test_every_registered_rule_meets_the_batch_of_one_oracle(path, case):
    if _import(path) is None:
        pytest.skip(f"{path.split('.')[0]} is not installed")
    if case.skip:
        pytest.skip(case.skip)
    branches, norms, grads, expected, messages = _family_results(_family(path))
    branch = branches[(path, case.name)]
    # The case's layer took the rule registered for its class; no layer of the case took the
    # per-layer fallback, nor the model the materialized path.
    assert type(rule_for(branch.layer)) is RULES[path]
    assert not any("materialized path" in m for m in messages), messages
    fallback = [m for m in messages if "no layer rule" in m]
    assert not [layer.name for layer in branch.layers if any(repr(layer.name) in m for m in fallback)], \
        fallback
    assert branch.columns, "the case has no trainable variable"
    for k in branch.columns:
        # Each variable at its own scale: a small variable's error is not hidden by a larger
        # one's values (float32's are ~4e-7 of them here).
        what = f"variable {k} of {path}, {case.name}"
        scale = float(np.abs(expected[k]).max())
        assert scale > 1e-6, f"{what}: the oracle's gradient is zero (the comparison is vacuous)"
        np.testing.assert_allclose(grads[k], expected[k], rtol=RTOL, atol=ATOL * scale,
                                   err_msg=f"materialized gradient, {what}")
        reference = (expected[k].reshape(B, -1).astype("float64") ** 2).sum(axis=1)
        np.testing.assert_allclose(norms[:, k], reference, rtol=RTOL, atol=ATOL * float(reference.max()),
                                   err_msg=f"squared norm, {what}")
