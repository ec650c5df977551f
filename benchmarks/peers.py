"""The DP peers of ``bench.py``: TF Privacy's fast gradient clipping and jax-privacy's Keras API.

Rows beside ``opacus clip`` (each where its package imports, else a
"skipped: why" row), on the benchmark's own models, weights and batch:

- ``tf-privacy clip`` / ``tf-privacy dp`` (TensorFlow run; ``tensorflow-privacy``
  and ``tf_keras``): the model rebuilt in ``tf_keras`` (Keras 2) with the
  Keras 3 model's weights, as TF Privacy's ``DPSequential`` / ``DPModel``
  (``l2_norm_clip=1``, ``noise_multiplier`` 0 or 1, ``use_xla=True``, its
  default) with a layer registry of every registry function TF Privacy 0.9
  ships for core layers (Dense, Embedding, EinsumDense, LayerNormalization,
  MultiHeadAttention): fast gradient clipping (the norms from the registry,
  then one backward pass of the clip-weighted loss) where every trainable
  layer is registered (the MLP, the transformer); the CNN (no Conv2D
  function) takes its ``tf.vectorized_map`` per-example path.
  ``tf-privacy-plain`` is the same ``tf_keras`` model's plain step, the rows'
  own baseline (``x own plain``).
- ``jax-privacy clip`` / ``jax-privacy dp`` (JAX run; ``jax-privacy``):
  ``keras_api.make_private(model, DPKerasConfig(clipping_norm=1,
  noise_multiplier=1, batch_size=B, rescale_to_unit_norm=False, ...))`` on the
  Keras 3 model itself: ``vmap`` per-example gradients (materialized).
  ``jax-privacy-mb1 <agg>``: ``microbatch_size=1`` (a scan over single
  examples, its low-memory setting). ``DPKerasConfig`` refuses a noise
  multiplier of 0; the ``clip`` rows set it to 0 after validation (the noise's
  standard deviation is then 0: the same step, noise-free).

Both peers take the plain mean over the batch (TF Privacy divides the clipped
sum by B, as ``clip``; jax-privacy by ``batch_size = B``), so their noise-free
update is pergrad's ``clip(1.0)``. Before a peer is timed, :func:`check` runs
one SGD(1) step of it with noise 0 and one of ``PerExampleModel(model,
clip(1.0))`` from the same weights on the same batch: the weight changes (the
clipped mean) must agree to :data:`CHECK_TOLERANCE` (largest difference over
the largest entry). The results are printed under the table (and saved with
``--json``); a peer that fails is a "failed: ..." row, not timed.

TensorFlow Privacy needs ``tf.keras`` to be ``tf_keras``, set before TensorFlow is
imported (``process.use_tf_keras_for_tf_privacy``, part of
``process.before_backend_import``). ``make install`` installs them (the tests check
them: ``tests/test_benchmarks.py``): the ``bench`` extra (Opacus, jax-privacy), then
without dependencies ``tf-keras`` of the installed TensorFlow's minor version (it
requires the package ``tensorflow``, which would land beside ``tensorflow-cpu``) and
TF Privacy (``requirements-peers.txt``; its pins would move TensorFlow, NumPy and
dp-accounting). By hand, in another environment::

    pip install -e ".[bench]"
    pip install --no-deps "tensorflow-privacy==0.9.0" "tf-keras~=2.21.0"
"""

from __future__ import annotations

import importlib.util
import time

import keras
import numpy as np

import models
from process import tf_privacy_installed
from runner import Stepper, Steps

#: the recipes this module adds, with the backend each runs on
RECIPES = {
    "tf-privacy": "tensorflow",
    "tf-privacy-plain": "tensorflow",
    "jax-privacy": "jax",
    "jax-privacy-mb1": "jax",
}
AGGREGATIONS = ("clip", "dp")
#: largest |peer update - pergrad clip update| / largest |pergrad clip update| accepted
CHECK_TOLERANCE = 1e-4
#: the check's results, one dict per (model, recipe), in the order made
CHECKS: list[dict] = []


def installed(recipe: str) -> bool:
    if recipe.startswith("tf-privacy"):
        return tf_privacy_installed()
    return importlib.util.find_spec("jax_privacy") is not None


def recipes_for(backend: str) -> list[str]:
    """The peer recipes of a default run on ``backend`` (rows "skipped: ... not installed"
    where the package is missing)."""
    return [r for r, b in RECIPES.items() if b == backend]


def unsupported(recipe: str, aggregation: str, backend: str) -> str | None:
    """Why peer variant ``recipe aggregation`` cannot run here, or None."""
    if RECIPES[recipe] != backend:
        return f"{recipe} rows run in the {RECIPES[recipe]} run only"
    if not installed(recipe):
        package = "tensorflow-privacy and tf_keras" if recipe.startswith("tf-") else "jax-privacy"
        return f"{package} not installed (make install, see benchmarks/README.md)"
    if recipe == "tf-privacy-plain":
        return None if aggregation == "" else "tf-privacy-plain takes no aggregation"
    if aggregation not in AGGREGATIONS:
        return f"{recipe} rows: {' and '.join(AGGREGATIONS)} only"
    return None


def versions(backend: str) -> str:
    """``", name version"`` for each installed peer of ``backend``."""
    from importlib.metadata import version

    names = {"tensorflow": ("tensorflow-privacy", "tf-keras"), "jax": ("jax-privacy",)}.get(backend, ())
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except Exception:  # not installed
            found.append(f"{name} not installed")
    return "".join(f", {v}" for v in found)


# --------------------------------------------------------------------------------------
# TensorFlow Privacy (tf_keras)


def tf_privacy_registry():
    """A layer registry with every core-layer registry function TF Privacy ships."""
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        einsum_dense,
        layer_normalization,
        multi_head_attention,
    )

    registry = layer_registry.make_default_layer_registry()  # Dense, Embedding
    registry.insert(tf.keras.layers.EinsumDense, einsum_dense.einsum_layer_computation)
    registry.insert(tf.keras.layers.LayerNormalization, layer_normalization.layer_normalization_computation)
    registry.insert(tf.keras.layers.MultiHeadAttention,
                    multi_head_attention.multi_head_attention_layer_computation)
    return registry


def tf_keras_layers(kind: str):
    """The benchmark's model ``kind`` in tf_keras: ``(inputs, outputs)`` or a layer list."""
    import tensorflow as tf
    import tf_keras

    layers = tf_keras.layers
    if kind == "mlp":
        return [layers.InputLayer((784,)), layers.Dense(256, activation="relu"),
                layers.Dense(256, activation="relu"), layers.Dense(10)]
    if kind == "cnn":
        return [layers.InputLayer((28, 28, 1)), layers.Conv2D(16, 3, activation="relu"),
                layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(2), layers.Flatten(),
                layers.Dense(10)]
    tokens = tf_keras.Input((models.SEQUENCE,), dtype="int32")
    positions = layers.Lambda(lambda t: tf.zeros_like(t) + tf.range(models.SEQUENCE)[None, :])(tokens)
    h = layers.Embedding(models.VOCAB, models.WIDTH)(tokens)
    h = h + layers.Embedding(models.SEQUENCE, models.WIDTH)(positions)
    attended = layers.MultiHeadAttention(models.HEADS, models.KEY_DIM)(h, h)
    h = layers.LayerNormalization(epsilon=1e-3)(h + attended)
    f = layers.Dense(models.FFN, activation="relu")(h)
    f = layers.Dense(models.WIDTH)(f)
    h = layers.LayerNormalization(epsilon=1e-3)(h + f)
    h = layers.GlobalAveragePooling1D()(h)
    return tokens, layers.Dense(models.CLASSES)(h)


def tf_keras_model(kind: str, noise_multiplier: float | None, learning_rate: float):
    """The tf_keras twin of ``models.build_model(kind)`` with its weights; a TF Privacy
    ``DPSequential`` / ``DPModel`` unless ``noise_multiplier`` is None (the plain model)."""
    import tf_keras
    from tensorflow_privacy.privacy.keras_models import dp_keras_model

    built = tf_keras_layers(kind)
    private = {} if noise_multiplier is None else dict(
        l2_norm_clip=models.CLIP_NORM, noise_multiplier=noise_multiplier,
        layer_registry=tf_privacy_registry())
    if isinstance(built, list):
        model = (dp_keras_model.DPSequential(layers=built, **private) if private
                 else tf_keras.Sequential(built))
    else:
        inputs, outputs = built
        model = (dp_keras_model.DPModel(inputs=inputs, outputs=outputs, **private) if private
                 else tf_keras.Model(inputs, outputs))
    source = [np.asarray(w) for w in models.build_model(kind).get_weights()]
    shapes = [tuple(w.shape) for w in model.get_weights()]
    if shapes != [w.shape for w in source]:
        raise RuntimeError(f"tf_keras twin of {kind}: weights {shapes} differ from Keras 3's")
    model.set_weights(source)
    model.compile(optimizer=tf_keras.optimizers.SGD(learning_rate),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class TFKerasStepper(Steps):
    """Runs a tf_keras model's train function as Keras 2's ``fit()`` does (a ``tf.data``
    iterator over the one batch)."""

    def __init__(self, model, x, y):
        import tensorflow as tf

        self.model = model
        self.iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        self.function = model.make_train_function()
        start = time.perf_counter()
        self.run(1)  # traces (and XLA-compiles TF Privacy's step)
        self.first_step_s = time.perf_counter() - start

    def steps(self, count: int) -> None:
        import tensorflow as tf

        for _ in range(count):
            logs = self.function(self.iterator)
        [t.numpy() for t in tf.nest.flatten(logs)]


def tf_privacy_uses_fast_clipping(model) -> bool:
    return bool(getattr(model, "_enable_fast_peg_computation", False))


# --------------------------------------------------------------------------------------
# jax-privacy (Keras 3 on JAX)


def jax_privacy_model(kind: str, batch_size: int, noise_multiplier: float, learning_rate: float,
                      microbatch_size: int | None = None):
    """``models.build_model(kind)`` made private by jax-privacy's ``keras_api.make_private``."""
    from jax_privacy import keras_api

    model = models.build_model(kind)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=models.new_loss())
    params = keras_api.DPKerasConfig(
        epsilon=1e6, delta=1e-5, clipping_norm=models.CLIP_NORM, batch_size=batch_size,
        gradient_accumulation_steps=1, train_steps=100, train_size=100 * batch_size,
        noise_multiplier=max(noise_multiplier, 1.0), rescale_to_unit_norm=False,
        microbatch_size=microbatch_size, seed=models.SEED,
    )
    if noise_multiplier == 0:  # refused by the config's validation: the noise's std is then 0
        object.__setattr__(params, "noise_multiplier", 0.0)
    return keras_api.make_private(model, params)


# --------------------------------------------------------------------------------------
# the rows


def noise_of(aggregation: str) -> float:
    return models.NOISE_MULTIPLIER if aggregation == "dp" else 0.0


def build(recipe: str, aggregation: str, kind: str, batch_size: int, *, noise_multiplier=None,
          learning_rate=None):
    """The peer's model for a row (``noise_multiplier`` / ``learning_rate``: the row's by default)."""
    noise = noise_of(aggregation) if noise_multiplier is None else noise_multiplier
    learning_rate = models.LEARNING_RATE if learning_rate is None else learning_rate
    if recipe == "tf-privacy-plain":
        return tf_keras_model(kind, None, learning_rate)
    if recipe == "tf-privacy":
        return tf_keras_model(kind, noise, learning_rate)
    microbatch = 1 if recipe == "jax-privacy-mb1" else None
    return jax_privacy_model(kind, batch_size, noise, learning_rate, microbatch)


def weight_change(model, x, y) -> list[np.ndarray]:
    """``before - after`` of the trainable weights in one ``train_on_batch`` (with SGD(1):
    the update's gradient; jax-privacy adds non-trainable weights of its own)."""
    before = [np.array(w, "float64") for w in model.trainable_weights]
    model.train_on_batch(x, y)
    return [b - np.array(a, "float64") for b, a in zip(before, model.trainable_weights)]


_REFERENCES: dict = {}


def reference_update(kind: str, x, y) -> list[np.ndarray]:
    """pergrad ``clip(C)``'s SGD(1) update from ``models.build_model(kind)`` on ``(x, y)``
    (once per model kind and batch)."""
    import pergrad

    key = (kind, len(y))
    if key not in _REFERENCES:
        model = pergrad.PerExampleModel(models.build_model(kind),
                                        pergrad.aggregators.clip(models.CLIP_NORM))
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=models.new_loss())
        _REFERENCES[key] = weight_change(model, x, y)
    return _REFERENCES[key]


def check(recipe: str, kind: str, key: str, x, y) -> dict:
    """One noise-free SGD(1) step of the peer against ``PerExampleModel(model, clip(C))``.

    Both start from ``models.build_model(kind)``'s weights (seeded) on the same
    batch; the result (also appended to :data:`CHECKS`) gives the largest
    difference of the updates over the largest entry of pergrad's.
    """
    expected = reference_update(kind, x, y)
    peer = build(recipe, "clip", kind, len(y), noise_multiplier=0.0, learning_rate=1.0)
    found = weight_change(peer, x, y)
    scale = max(float(np.max(np.abs(e))) for e in expected)
    difference = max(float(np.max(np.abs(f - e))) for f, e in zip(found, expected))
    result = dict(model=key, recipe=recipe, relative_difference=difference / scale, largest_entry=scale,
                  ok=difference <= CHECK_TOLERANCE * scale)
    if recipe == "tf-privacy":
        result["fast_clipping"] = tf_privacy_uses_fast_clipping(peer)
    CHECKS.append(result)
    return result


def make_stepper(recipe: str, aggregation: str, kind: str, x, y, checked: bool = True) -> Steps:
    """A built, compiled, once-stepped peer row; checked first (once per model and
    recipe; not the plain row, nor where ``checked`` is False: the memory children)."""
    key = f"{kind}{len(y)}"
    if checked and recipe != "tf-privacy-plain" and not any(
        c["model"] == key and c["recipe"] == recipe for c in CHECKS
    ):
        check(recipe, kind, key, x, y)
    found = next((c for c in CHECKS if c["model"] == key and c["recipe"] == recipe), None)
    if found is not None and not found["ok"]:
        raise RuntimeError(f"check failed: noise-free update {found['relative_difference']:.1e} "
                           f"off pergrad clip (tolerance {CHECK_TOLERANCE:g})")
    model = build(recipe, aggregation, kind, len(y))
    if recipe.startswith("tf-privacy"):
        return TFKerasStepper(model, x, y)
    return Stepper(model, x, y)


def variant_names(recipe: str, selected_aggregations) -> list[str]:
    """The default rows of a peer recipe."""
    if recipe == "tf-privacy-plain":
        return [recipe] if any(a in AGGREGATIONS for a in selected_aggregations) else []
    return [f"{recipe} {a}" for a in AGGREGATIONS if a in selected_aggregations]


#: rows whose own baseline is not the Keras 3 plain step
OWN_PLAIN = {f"tf-privacy {a}": "tf-privacy-plain" for a in AGGREGATIONS}


def describe(backend: str) -> str | None:
    """The header's line on the peers of ``backend``'s run, or None."""
    if backend == "tensorflow":
        if not installed("tf-privacy"):
            return "TF Privacy: not installed (no tf-privacy rows)."
        return ("TF Privacy: the model in tf_keras with the same weights, DPSequential/DPModel("
                "l2_norm_clip=1, noise_multiplier=0 (clip) or 1 (dp), use_xla=True, a registry of "
                "Dense, Embedding, EinsumDense, LayerNormalization, MultiHeadAttention); fast gradient "
                "clipping where every trainable layer is registered (not the CNN: vectorized_map); "
                "x own plain = over tf-privacy-plain, the tf_keras plain step.")
    if backend == "jax":
        if not installed("jax-privacy"):
            return "jax-privacy: not installed (no jax-privacy rows)."
        return ("jax-privacy: keras_api.make_private(model, DPKerasConfig(clipping_norm=1, "
                "noise_multiplier=1 (dp; 0 for clip), batch_size=B, rescale_to_unit_norm=False)): vmap "
                "per-example gradients; jax-privacy-mb1 = microbatch_size=1.")
    return None


def check_lines() -> list[str]:
    """The checks, one line each, for under the table."""
    lines = []
    for c in CHECKS:
        fast = "" if "fast_clipping" not in c else (
            ", fast gradient clipping" if c["fast_clipping"] else ", per-example (vectorized_map) path")
        lines.append(f"- {c['model']} {c['recipe']}: noise-free update vs pergrad "
                     f"clip({models.CLIP_NORM:g}): largest difference {c['relative_difference']:.1e} "
                     f"of the largest entry ({c['largest_entry']:.2e}){fast}: "
                     f"{'OK' if c['ok'] else 'FAILED'}")
    return lines

