"""Backend kernels that the vectorized pass must not use (docs/architecture.md, 'Known traps').

TensorFlow 2.21's oneDNN matmul corrupts the heap on a 4-D left operand with a unit
second axis times a right operand broadcast over every batch axis, the product pfor
makes of a sequence model's kernels: ``(B, 1, T, d) @ (d, u)``. pergrad converts those
products without the unit axes (``pergrad.backend._tensorflow_onednn``). The graph test
checks the products themselves, whatever the oneDNN setting of the session; the
subprocess test trains attention models with oneDNN on (a crash cannot kill pytest).
On torch, attention under ``vmap`` runs the math kernel: the fused CPU kernel has no
batching rule (torch warns of a "performance drop" and loops over the examples).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import pergrad
import problems
from conftest import BACKEND

TESTS = pathlib.Path(__file__).resolve().parents[1]  # tests/, where oracle.py and problems.py lie
SOURCE = TESTS.parent / "src"

tensorflow_only = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's oneDNN kernels")


@tensorflow_only
def test_products_without_unit_axes_equal_tensorflows():
    import tensorflow as tf

    from pergrad.backend._tensorflow_onednn import einsum_without_unit_labels, matmul_without_unit_batch_axes

    rng = np.random.default_rng(0)

    def normal(*shape):
        return tf.constant(rng.normal(size=shape).astype("float32"))

    products = [  # (x, y, adjoint_a, adjoint_b)
        (normal(5, 1, 3, 4), normal(4, 2), False, False),  # the corrupted product, as pfor makes it
        (normal(5, 1, 3, 4), normal(1, 1, 4, 2), False, False),
        (normal(5, 1, 3, 4), normal(2, 4), False, True),
        (normal(5, 1, 4, 3), normal(1, 4, 2), True, False),
        (normal(1, 1, 3, 4), normal(4, 2), False, False),  # a batch of one example
        (normal(5, 1, 1, 3, 4), normal(5, 1, 1, 4, 2), False, False),
        (normal(5, 1, 3, 4), normal(5, 2, 4, 2), False, False),  # x broadcast over axis 1: kept
        (normal(3, 4), normal(5, 1, 4, 2), False, False),
    ]
    for x, y, adjoint_a, adjoint_b in products:
        expected = tf.matmul(x, y, adjoint_a=adjoint_a, adjoint_b=adjoint_b)
        actual = matmul_without_unit_batch_axes(x, y, adjoint_a, adjoint_b)
        assert actual.shape == expected.shape
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    einsums = [
        ("Fabc,cde->Fabde", normal(5, 1, 3, 4), normal(4, 2, 3)),  # EinsumDense, vectorized
        ("Faecd,Fabcd->Facbe", normal(5, 1, 3, 1, 2), normal(5, 1, 4, 1, 2)),  # one head
        ("Fabcd,cde->Fabe", normal(5, 1, 3, 2, 4), normal(2, 4, 3)),
        ("ab,b->a", normal(1, 1), normal(1)),  # every label of size 1: a (1,) result
        ("Fab,Fab->F", normal(5, 1, 3), normal(5, 1, 3)),  # a unit label summed over
    ]
    for equation, *operands in einsums:
        expected = tf.einsum(equation, *operands)
        actual = einsum_without_unit_labels(equation, *operands)
        assert actual.shape == expected.shape, equation
        np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


def _products(graph):
    """The matrix products ``graph`` runs (the ops its outputs need: the loop body pfor
    traced before converting it is not run), and those that oneDNN computes with a 4-D
    operand whose second axis is 1 against one broadcast over the batch axes
    (``BatchMatMulV2``) or with an axis of size 1 (``Einsum``, which oneDNN runs as such
    a product without flattening it)."""
    products, pending, seen = [], [t.op for t in graph.outputs], set()
    while pending:
        op = pending.pop()
        if op.name not in seen:
            seen.add(op.name)
            pending += [t.op for t in op.inputs] + list(op.control_inputs)
            if op.type in ("BatchMatMulV2", "Einsum"):
                products.append(op)
    corrupting = []
    for op in products:
        shapes = [t.shape.as_list() for t in op.inputs]
        if op.type == "BatchMatMulV2":
            x, y = shapes
            if len(x) == 4 and x[1] == 1 and all(size == 1 for size in y[:-2]):
                corrupting.append((op.type, shapes))
        elif any(1 in shape for shape in shapes):
            corrupting.append((op.type, op.get_attr("equation").decode(), shapes))
    return len(products), corrupting


@tensorflow_only
def test_vectorized_pass_makes_no_product_that_onednn_corrupts():
    """The materialized path's forward and backward pass of an attention model (and a Dense
    layer on its sequence), converted as pergrad converts them: no such product left."""
    import tensorflow as tf

    from pergrad.backend import adapter

    inputs = keras.Input((4, 3))
    hidden = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2)(inputs, inputs)
    hidden = keras.layers.Dense(5)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden)))
    model.compile(loss="mse")
    problem = pergrad.engine.PerExampleProblem(model)
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 4, 3)).astype("float32"))
    y = tf.zeros((6, 2))
    values = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def example_gradient(example, shared):
        with tf.GradientTape() as tape:
            tape.watch(values)
            loss, _ = problem.example_loss(values, example, shared)
        return tape.gradient(loss, values)

    batched, *_ = problem.batched_inputs(non_trainable, x, y)
    shared = {"non_trainable": non_trainable, "loss_scale": None}
    graph = tf.function(lambda batched: adapter().vectorized_call(example_gradient, batched, shared),
                        autograph=False).get_concrete_function(batched).graph
    products, corrupting = _products(graph)
    assert products >= 8, "the forward and backward products of the attention and Dense layers"
    assert corrupting == []


_ONEDNN_ON = """
import json
import keras, numpy as np
import tensorflow as tf
import oracle, pergrad
from pergrad.backend import _tensorflow_onednn

class TokenAndPositionEmbedding(keras.layers.Layer):
    # keras.io's "Text classification with Transformer"
    def __init__(self, maxlen, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocab, dim)
        self.positions = keras.layers.Embedding(maxlen, dim)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(0, keras.ops.shape(x)[-1], 1))

def transformer(batch=6, steps=5, vocab=11, dim=8):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((steps,), dtype="int32")
    h = TokenAndPositionEmbedding(steps, vocab, dim)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=dim)(h, h)
    h = keras.layers.LayerNormalization(epsilon=1e-6)(h + attended)
    fed = keras.layers.Dense(dim)(keras.layers.Dense(16, activation="relu")(h))
    h = keras.layers.LayerNormalization(epsilon=1e-6)(h + fed)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch, steps)).astype("int32")
    return model, x, rng.integers(0, 2, batch).astype("int32")

def largest(arrays):
    return max(float(np.max(np.abs(a))) for a in arrays)

def relative(actual, expected):
    return max(float(np.max(np.abs(np.asarray(a) - e))) for a, e in zip(actual, expected)) / largest(expected)

report = {"onednn": _tensorflow_onednn.enabled()}
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
for name, (model, x, y) in {"transformer": transformer()}.items():
    model.compile(optimizer="sgd", loss=loss)
    start = [w.copy() for w in model.get_weights()]
    grads = pergrad.per_example_gradients(model, x, y)
    report[name + " materialized"] = relative(grads, oracle.batch_of_one_gradients(model, x, y))
    stats = pergrad.per_example_statistics(model, x, y)
    norms = np.stack([np.sum(np.reshape(g, (len(x), -1)) ** 2, axis=1) for g in grads], axis=1)
    report[name + " statistics"] = relative([stats.squared_norms], [norms])
    updates = {}  # the change of the weights in two steps (compared, not the weights)
    # (`mean` without microbatches differentiates the batch loss: no vectorized pass.)
    runs = {"clip": (pergrad.aggregators.clip(0.1), {}),
            "clip materialized": (pergrad.aggregators.clip(0.1), {"path": "materialized"}),
            "mean microbatch": ("mean", {"microbatch_size": 4}),
            "median": ("median", {})}
    for run, (rule, options) in runs.items():
        model.set_weights(start)
        wrapper = pergrad.PerExampleModel(model, rule, **options)
        wrapper.compile(optimizer="sgd", loss=loss)
        wrapper.fit(x, y, batch_size=len(x), epochs=2, verbose=0, shuffle=False)
        updates[run] = [w - s for w, s in zip(model.get_weights(), start)]
    model.set_weights(start)
    model.compile(optimizer="sgd", loss=loss)
    model.fit(x, y, batch_size=len(x), epochs=2, verbose=0, shuffle=False)
    plain = [w - s for w, s in zip(model.get_weights(), start)]
    report[name + " microbatch mean vs plain fit"] = relative(updates["mean microbatch"], plain)
    report[name + " clip vs materialized"] = relative(updates["clip"], updates["clip materialized"])
    report[name + " moved"] = {run: largest(update) for run, update in updates.items()}
print(json.dumps(report))
"""


def _run_with_onednn(script):
    """The JSON report ``script`` prints last, run in a fresh TensorFlow process with oneDNN
    on (a crash cannot kill pytest)."""
    environment = dict(os.environ, KERAS_BACKEND="tensorflow", TF_ENABLE_ONEDNN_OPTS="1")
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(SOURCE), str(TESTS), os.environ.get("PYTHONPATH")])
    )
    completed = subprocess.run([sys.executable, "-c", script], env=environment,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, (
        f"exit status {completed.returncode} (negative: killed by a signal)\n{completed.stderr[-3000:]}"
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


@tensorflow_only
def test_attention_models_train_exactly_with_onednn_on():
    """oneDNN on (TensorFlow's default on x86): the keras.io transformer (token and position
    embeddings, multi-head attention, a feed-forward block, layer norms) on every path
    (materialized, statistics, chunked, streaming) in a fresh process, exact to the
    batch-of-one oracle and to plain ``fit()``; before pergrad's conversions the process
    aborted (``free(): invalid pointer``) or segfaulted here."""
    report = _run_with_onednn(_ONEDNN_ON)
    assert report.pop("onednn") is True
    moved = {key: report.pop(key) for key in list(report) if key.endswith(" moved")}
    assert all(change > 1e-5 for runs in moved.values() for change in runs.values()), moved
    bad = {key: error for key, error in report.items() if not error <= 1e-5}
    assert not bad, report


_GEMMA_ONEDNN_ON = """
import json
import numpy as np
import oracle, pergrad, problems
from pergrad.backend import _tensorflow_onednn

problem = problems.gemma_lm(batch=3)
problem.compile()
model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
expected = oracle.batch_of_one_gradients(model, x, y, weights)
largest = max(float(np.max(np.abs(e))) for e in expected)
grads = pergrad.per_example_gradients(model, x, y, weights)  # the materialized path
error = max(float(np.max(np.abs(np.asarray(g) - e))) for g, e in zip(grads, expected)) / largest
norms = np.stack([np.sum(np.reshape(e, (len(e), -1)) ** 2, axis=1) for e in expected], axis=1)
stats = pergrad.per_example_statistics(model, x, y, weights).squared_norms
print(json.dumps({"onednn": _tensorflow_onednn.enabled(), "materialized": error,
                  "statistics": float(np.max(np.abs(np.asarray(stats) - norms)) / np.max(norms))}))
"""


@tensorflow_only
def test_softmax_in_two_dimensions_equals_tensorflows():
    import tensorflow as tf

    from pergrad.backend._tensorflow_onednn import softmax_in_two_dims

    scores = np.random.default_rng(0).normal(size=(3, 1, 2, 1, 4, 5))
    # (NumPy's: TensorFlow's own softmax refuses 6 dimensions under oneDNN)
    log_softmax = scores - scores.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    for log, expected in ((False, np.exp(log_softmax)), (True, log_softmax)):
        for index in ((), (0, 0, 0), (0, 0, 0, 0, 0)):
            actual = softmax_in_two_dims(tf.constant(scores[index], tf.float32), log=log)
            np.testing.assert_allclose(actual.numpy(), expected[index], rtol=1e-5, atol=1e-6)


@tensorflow_only
def test_gemma_per_example_gradients_with_onednn_on():
    """keras-hub Gemma's attention scores are 5-D for one example: pfor's stacked 6-D softmax
    aborted under oneDNN ("Input dims must be <= 5"); pergrad's converter computes it on a
    matrix. The materialized path (every arbitrary rule's) and the statistics path are exact
    to the batch-of-one oracle in a fresh process with oneDNN on."""
    pytest.importorskip("keras_hub")
    report = _run_with_onednn(_GEMMA_ONEDNN_ON)
    assert report.pop("onednn") is True
    assert all(error <= 1e-5 for error in report.values()), report


@tensorflow_only
def test_without_the_conversions_oneDNN_refuses_before_anything_runs(monkeypatch):
    """Where pergrad could not install its conversions (a TensorFlow release that moved
    pfor's registry), a model is refused while oneDNN is on, never run."""
    from pergrad.backend import _tensorflow_onednn

    problem = problems.attention()
    problem.compile()
    wrapper = problem.compile(pergrad.PerExampleModel(problem.model, pergrad.aggregators.clip(1.0)))
    before = [w.copy() for w in problem.model.get_weights()]
    monkeypatch.setattr(_tensorflow_onednn, "INSTALLED", False)
    monkeypatch.setattr(_tensorflow_onednn, "enabled", lambda: True)
    for run in (lambda: pergrad.per_example_gradients(problem.model, problem.x, problem.y),
                lambda: wrapper.fit(problem.x, problem.y, batch_size=3, verbose=0)):
        with pytest.raises(NotImplementedError, match="TF_ENABLE_ONEDNN_OPTS=0"):
            run()
    monkeypatch.setattr(_tensorflow_onednn, "enabled", lambda: False)  # oneDNN off: runs
    wrapper.fit(problem.x, problem.y, batch_size=3, verbose=0)
    assert any(not np.allclose(a, b) for a, b in zip(problem.model.get_weights(), before))



_TORCH_ATTENTION = """
import keras, numpy as np
import pergrad, problems
problem = problems.attention()
problem.compile()
pergrad.per_example_gradients(problem.model, problem.x, problem.y)  # vmap(grad(...))
print("done")
"""


@pytest.mark.skipif(BACKEND != "torch", reason="torch's attention kernels")
def test_torch_attention_has_no_unbatched_kernel_under_vmap():
    """torch warns once per process: a fresh one, whose only attention runs under vmap."""
    environment = dict(os.environ, KERAS_BACKEND="torch")
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(SOURCE), str(TESTS), os.environ.get("PYTHONPATH")])
    )
    completed = subprocess.run([sys.executable, "-c", _TORCH_ATTENTION], env=environment,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().endswith("done")
    assert "batching rule" not in completed.stderr, completed.stderr[-3000:]
