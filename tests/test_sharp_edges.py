"""Sharp edges: a failed batch check moves no weight, constructor arguments are validated,
user functions' results are type-checked, unloadable saves are announced, TensorFlow's
pfor noise is silenced.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/test_sharp_edges.py``. One batch
shape (3, and the failing last batch of 1) for every fit in this file.
"""

from __future__ import annotations

import logging
import math
import re
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems
from pergrad import aggregators as agg

BACKEND = keras.backend.backend()


def _fit(model, aggregator, x, y, **kwargs):
    wrapper = pergrad.PerExampleModel(model, aggregator, **kwargs)
    wrapper.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return wrapper, wrapper.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)


# --- a failed batch-size check applies no update ------------------------------------------------


def test_failed_batch_check_moves_no_weight():
    """7 examples in batches of 3 with Krum (needs 3), from a source fit() cannot size up
    front: the last batch of 1 fails in its step. On TF the check runs in the graph (unknown
    batch size); the update used to run anyway and move the weights. Now the weights and the
    optimizer's step count are those after the first two batches, on every backend."""
    problem = problems.dense_mlp(batch=7)
    wrapper = pergrad.PerExampleModel(problem.model, agg.krum(0.2))
    problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="needs batches of at least 3 examples"):
        wrapper.fit(problems.UnsizedBatches(problem.x, problem.y, 3), shuffle=False, verbose=0)

    reference = problems.dense_mlp(batch=7)
    expected = pergrad.PerExampleModel(reference.model, agg.krum(0.2))
    reference.compile(expected, optimizer=keras.optimizers.SGD(0.1))
    expected.fit(problem.x[:6], problem.y[:6], batch_size=3, shuffle=False, verbose=0)
    oracle.assert_weights_close(problem.model, reference.model, atol=0, rtol=0)
    assert int(ops.convert_to_numpy(wrapper.optimizer.iterations)) == 2


# --- constructor arguments ------------------------------------------------------------------------

INF, NAN = math.inf, math.nan

INVALID = [
    ("clip", lambda v: agg.clip(v), "l2_norm", [INF, NAN, 0.0, -1.0, "1", None]),
    ("automatic_clip", lambda v: agg.automatic_clip(v), "gamma", [INF, NAN, -0.1]),
    ("trimmed_mean", lambda v: agg.trimmed_mean(v), "trim", [INF, NAN, -0.1, 0.5]),
    ("meamed", lambda v: agg.meamed(v), "byzantine", [INF, NAN, -0.1, 0.5]),
    ("krum", lambda v: agg.krum(v), "byzantine", [INF, NAN, 0.5]),
    ("krum", lambda v: agg.krum(select=v), "select", [INF, NAN, 0, 1.5, True]),
    ("geometric_median", lambda v: agg.geometric_median(eps=v), "eps", [INF, NAN, 0.0, -1e-6]),
    ("geometric_median", lambda v: agg.geometric_median(max_iter=v), "max_iter", [INF, 0, 2.5]),
    ("centered_clip", lambda v: agg.centered_clip(v), "tau", [INF, NAN, 0.0, -1.0]),
    ("centered_clip", lambda v: agg.centered_clip(1.0, iters=v), "iters", [INF, NAN, 0, 1.5]),
    ("norm_filter", lambda v: agg.norm_filter(factor=v), "factor", [INF, NAN, 0.5]),
    ("norm_filter", lambda v: agg.norm_filter(drop_fraction=v), "drop_fraction", [INF, NAN, -0.1, 1.0]),
    ("bucketing", lambda v: agg.bucketing(v, agg.median()), "size", [INF, NAN, 0, 2.5, True]),
]


@pytest.mark.parametrize(
    "owner, make, name, value",
    [(owner, make, name, value) for owner, make, name, values in INVALID for value in values],
    ids=lambda item: item if isinstance(item, str) else None,
)
def test_invalid_constructor_argument_names_the_argument_and_the_value(owner, make, name, value):
    """``clip(inf)`` and friends used to be accepted and to produce NaN weights."""
    with pytest.raises(ValueError, match=rf"^{owner}: {name} must be .*, got {re.escape(repr(value))}"):
        make(value)


def test_valid_boundary_arguments_are_accepted():
    assert agg.trimmed_mean(0.0).trim == 0.0
    assert agg.automatic_clip(0.0).gamma == 0.0
    assert agg.norm_filter(factor=1.0).factor == 1.0
    assert agg.norm_filter(drop_fraction=0.0).drop_fraction == 0.0
    assert agg.clip(np.float32(0.5)).l2_norm == 0.5
    assert agg.krum(0.1, select=np.int64(2)).select == 2
    assert agg.centered_clip(1.0, iters=2.0).iters == 2
    assert agg.bucketing(2, agg.median()).size == 2


# --- what a user function returns -----------------------------------------------------------------


def _one_tensor(grads):
    return ops.mean(grads[0], axis=0)


def _a_dict(grads):
    return {"kernel": ops.mean(grads[0], axis=0)}


def _python_floats(grads):
    return [0.0 for _ in grads]


def _integers(grads):
    return [ops.cast(ops.sign(ops.mean(g, axis=0)), "int32") for g in grads]


def _booleans(grads):
    return [ops.mean(g, axis=0) > 0 for g in grads]


class ReturnsATensor(pergrad.aggregators.Aggregator):
    def aggregate(self, gradients):
        return ops.mean(gradients[0], axis=0)


ONE_TENSOR = (r"must return a list with one tensor per trainable variable \(4 float tensors, of shapes "
              r"\(5, 4\), \(4,\), \(4, 3\), \(3,\).*got a float32 tensor of shape \(5, 4\)")
RESULTS = {
    "one_tensor": (_one_tensor, ONE_TENSOR),
    "subclass_one_tensor": (ReturnsATensor(), ONE_TENSOR),
    "dict": (_a_dict, r"must return a list .*; got a dict with keys \['kernel'\]"),
    "python_floats": (_python_floats, r"returned a Python float \(0.0\) for variable #0 .*of shape "
                      r"\(5, 4\); expected a float tensor"),
    "integers": (_integers, r"returned an int32 tensor of shape \(5, 4\) for variable #0 .*expected "
                 r"a float tensor"),
    "booleans": (_booleans, r"returned a bool tensor of shape \(5, 4\).*expected a float tensor"),
    "per_variable_integers": (
        agg.per_variable(lambda g: ops.cast(ops.mean(g, axis=0), "int32")),
        r"returned an int32 tensor",
    ),
}


@pytest.mark.parametrize("case", list(RESULTS))
def test_user_function_result_is_type_checked(case):
    """One tensor or a dict used to fail with "Iterating over a symbolic tf.Tensor" (TF) or an
    AttributeError; integer and bool results were silently accepted."""
    function, message = RESULTS[case]
    problem = problems.dense_mlp(batch=6)
    with pytest.raises(ValueError, match=message):
        _fit(problem.model, function, problem.x, problem.y)


class ReturnsIntegers(pergrad.aggregators.Aggregator):
    def aggregate(self, gradients):
        return [ops.cast(ops.mean(g, axis=0), "int32") for g in gradients]


def test_aggregator_subclass_returning_integers_names_the_variable():
    problem = problems.dense_mlp(batch=6)
    path = problem.model.trainable_variables[0].path
    with pytest.raises(ValueError, match=rf"returned an int32 tensor .* for variable '{path}'"):
        _fit(problem.model, ReturnsIntegers(), problem.x, problem.y)


@pytest.mark.parametrize("size", [3.5, "4", True, 0, -1, -2, 2.0])
def test_microbatch_size_must_be_a_positive_int(size):
    """3.5 was accepted on TF (and a TypeError on JAX), "4" a TypeError, True taken as 1."""
    problem = problems.dense_mlp(batch=6)
    problem.compile()
    message = rf"microbatch_size must be a positive integer or None, got {re.escape(repr(size))}"
    with pytest.raises(ValueError, match=message):
        pergrad.per_example_gradients(problem.model, problem.x, problem.y, microbatch_size=size)
    with pytest.raises(ValueError, match=message):
        pergrad.PerExampleModel(problem.model, microbatch_size=size)


def test_an_aggregator_class_is_instantiated_not_wrapped_as_a_function():
    """``aggregator=Median`` (the class) used to be wrapped as a function of the gradients."""
    assert type(agg.get(agg.basic.Median)) is agg.basic.Median


def test_microbatch_size_accepts_numpy_integers():
    wrapper = pergrad.PerExampleModel(problems.dense_mlp().model, microbatch_size=np.int64(4))
    assert wrapper.microbatch_size == 4 and type(wrapper.microbatch_size) is int


# --- saving a model that uses a user function --------------------------------------------------


def _unregistered_mean(grads):
    return [ops.mean(g, axis=0) for g in grads]


@keras.saving.register_keras_serializable(package="pergrad_tests")
def registered_mean(grads):
    return [ops.mean(g, axis=0) for g in grads]


@pytest.mark.parametrize("function", [_unregistered_mean, lambda grads: grads], ids=["function", "lambda"])
def test_saving_an_unregistered_function_warns(tmp_path, function):
    """The model saved, then could not be loaded, without a word."""
    wrapper = pergrad.PerExampleModel(problems.dense_mlp().model, function)
    # Anchored: Keras's own warning about lambdas quotes this test's source.
    message = r"^The aggregator function .*not registered .*cannot be loaded .*register_keras_serializable"
    with pytest.warns(UserWarning, match=message):
        wrapper.save(tmp_path / "model.keras")


def test_saving_a_registered_function_does_not_warn(tmp_path):
    problem = problems.dense_mlp()
    wrapper = pergrad.PerExampleModel(problem.model, registered_mean)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        wrapper.save(tmp_path / "model.keras")
        restored = keras.models.load_model(tmp_path / "model.keras")
    assert restored.aggregator.function is registered_mean
    np.testing.assert_allclose(restored.predict(problem.x, verbose=0), wrapper.predict(problem.x, verbose=0))


# --- TensorFlow's pfor noise ------------------------------------------------------------------------


@pytest.mark.skipif(BACKEND != "tensorflow", reason="pfor and its log are TensorFlow's")
def test_pfor_conversion_errors_are_silenced_and_the_fallback_warning_remains(caplog, capfd):
    """An LSTM over a mask cannot be vectorized by pfor: TF used to log ~60 lines of
    ``ERROR:tensorflow: ... pfor was converting op ...`` before pergrad's own warning."""
    tf_logger = logging.getLogger("tensorflow")
    problem = problems.masked()
    problem.compile()
    caplog.set_level(logging.DEBUG, logger="tensorflow")
    with pytest.warns(UserWarning, match="falling back to tf.map_fn"):
        grads = pergrad.per_example_gradients(problem.model, problem.x, problem.y)
    assert len(grads) == len(problem.model.trainable_variables)
    noise = [r for r in caplog.records if r.name.startswith("tensorflow") and r.levelno >= logging.WARNING]
    assert not noise, noise[0].getMessage()[:300]
    assert "pfor" not in capfd.readouterr().err
    assert tf_logger.level == logging.DEBUG  # restored (to what caplog set)
