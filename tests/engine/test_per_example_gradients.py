"""``pergrad.per_example_gradients`` against the batch-of-one oracle, on every problem.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/engine/test_per_example_gradients.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems

BACKEND = keras.backend.backend()
NAMES = list(problems.PROBLEMS) + [
    pytest.param(name, marks=problems.needs_keras_hub) for name in problems.KERAS_HUB_PROBLEMS
]


def _numpy(grads):
    return [ops.convert_to_numpy(g) for g in grads]


def _assert_informative(grads):
    """The comparison must be able to fail: gradients are not all zero and examples differ."""
    flat = np.concatenate([g.reshape(len(g), -1) for g in _numpy(grads)], axis=1)
    assert np.all(np.isfinite(flat))
    assert np.abs(flat).max() > 1e-3
    assert np.abs(flat - flat[:1]).max() > 1e-4, "all examples have the same gradient"


@pytest.mark.parametrize("name", NAMES)
def test_matches_batch_of_one_oracle_and_mean_is_the_batch_gradient(name):
    """Each g_i equals the batch-of-one oracle, without and with sample weights, and
    ``mean_i g_i`` equals the gradient Keras computes for the whole batch (what fit() uses).

    The mean identity checks pergrad's normalization (DESIGN §1) independently of the
    oracle's ``scale``: masks, temporal weights, several outputs with loss weights.
    """
    problem = problems.make(name)
    problem.compile()
    model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
    ones = np.ones_like(weights)  # the oracle's unweighted reference: one trace for both

    grads = pergrad.per_example_gradients(model, x, y)
    shapes = [tuple(g.shape) for g in grads]
    assert shapes == [(problem.batch_size,) + tuple(v.shape) for v in model.trainable_variables]
    _assert_informative(grads)
    expected = oracle.batch_of_one_gradients(model, x, y, ones, scale=problem.scale())
    oracle.assert_gradients_close(grads, expected, what="per-example gradient")
    batch = oracle.batch_gradient(model, x, y, ones)
    oracle.assert_gradients_close([g.mean(axis=0) for g in _numpy(grads)], batch, what="mean")

    weighted = pergrad.per_example_gradients(model, x, y, weights)
    expected = oracle.batch_of_one_gradients(model, x, y, weights, scale=problem.scale())
    oracle.assert_gradients_close(weighted, expected, what="weighted per-example gradient")
    batch = oracle.batch_gradient(model, x, y, weights)
    oracle.assert_gradients_close([g.mean(axis=0) for g in _numpy(weighted)], batch, what="weighted mean")


def test_the_oracle_without_sample_weight_equals_the_oracle_with_ones():
    """Justifies the shortcut above (one oracle trace per problem)."""
    problem = problems.make("masked_dense")
    problem.compile()
    model, x, y = problem.model, problem.x, problem.y
    ones = np.ones_like(problem.sample_weight)
    oracle.assert_gradients_close(
        oracle.batch_gradient(model, x, y), oracle.batch_gradient(model, x, y, ones)
    )
    oracle.assert_gradients_close(
        oracle.batch_of_one_gradients(model, x[:2], y[:2]),
        oracle.batch_of_one_gradients(model, x[:2], y[:2], ones[:2]),
    )


def test_sample_weight_shapes_b_and_b1_agree():
    problem = problems.make("dense_mlp")
    problem.compile()
    weights = problem.sample_weight
    flat = pergrad.per_example_gradients(problem.model, problem.x, problem.y, weights)
    column = pergrad.per_example_gradients(problem.model, problem.x, problem.y, weights[:, None])
    oracle.assert_gradients_close(column, _numpy(flat), rtol=1e-6, atol=1e-7)
    unweighted = pergrad.per_example_gradients(problem.model, problem.x, problem.y)
    # Example i's gradient is linear in its own weight.
    scaled = [g * weights.reshape((-1,) + (1,) * (g.ndim - 1)) for g in _numpy(unweighted)]
    oracle.assert_gradients_close(flat, scaled)


# --- losses: objects with other reductions, functions, strings, `loss=` ---------------------


def _regression_problem():
    return problems.make("conv1d")


def _mean_squared_error(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


@pytest.mark.parametrize(
    "loss",
    [
        "mse",
        "mean_absolute_error",
        "huber",
        "log_cosh",
        _mean_squared_error,
        keras.losses.MeanSquaredError(reduction="sum"),
        keras.losses.MeanSquaredError(reduction="mean"),
        keras.losses.Huber(delta=0.3),
    ],
    ids=lambda loss: loss if isinstance(loss, str) else getattr(loss, "name", None) or loss.__name__,
)
def test_loss_kinds_compiled_and_passed(loss):
    """Compiled losses and `loss=` both match the oracle and the batch gradient.

    A ``"sum"`` reduction sums over the batch: pergrad's ``L_i`` is then ``B`` times the
    batch-of-one loss, so that ``mean_i g_i`` is still the gradient Keras uses.
    """
    problem = _regression_problem()
    problem.loss = loss
    problem.compile()
    model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
    is_sum = getattr(loss, "reduction", None) == "sum"
    scale = np.full(len(x), float(len(x))) if is_sum else None
    expected = oracle.batch_of_one_gradients(model, x, y, weights, scale=scale)
    batch = oracle.batch_gradient(model, x, y, weights)

    compiled = pergrad.per_example_gradients(model, x, y, weights)
    oracle.assert_gradients_close(compiled, expected, what="compiled loss")
    oracle.assert_gradients_close([g.mean(0) for g in _numpy(compiled)], batch, what="mean")

    fresh = problems.make("conv1d")  # same weights, never compiled
    passed = pergrad.per_example_gradients(fresh.model, x, y, weights, loss=loss)
    oracle.assert_gradients_close(passed, _numpy(compiled), rtol=1e-6, atol=1e-6, what="loss=")


def test_sum_reduction_on_a_sequence_output():
    """``"sum"`` over a (B, T) loss: still ``mean_i g_i`` == the batch gradient."""
    problem = problems.make("sequence_output")
    problem.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    problem.compile()
    model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
    grads = pergrad.per_example_gradients(model, x, y, weights)
    expected = oracle.batch_of_one_gradients(model, x, y, weights, scale=np.full(len(x), len(x)))
    oracle.assert_gradients_close(grads, expected)
    batch = oracle.batch_gradient(model, x, y, weights)
    oracle.assert_gradients_close([g.mean(0) for g in _numpy(grads)], batch, what="mean")


def test_string_classification_loss_and_list_of_losses():
    """A probability head with a string loss, and a multi-output model given a list of losses."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="tanh")(inputs)
    probabilities = keras.layers.Dense(3, activation="softmax")(hidden)
    scores = keras.layers.Dense(1)(hidden)
    model = keras.Model(inputs, [probabilities, scores])
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 4)).astype("float32")
    y = [rng.integers(0, 3, size=(5,)).astype("int32"), rng.normal(size=(5, 1)).astype("float32")]
    model.compile(optimizer="sgd", loss=["sparse_categorical_crossentropy", "mae"], loss_weights=[1.0, 0.5])
    grads = pergrad.per_example_gradients(model, x, y)
    expected = oracle.batch_of_one_gradients(model, x, y)
    oracle.assert_gradients_close(grads, expected)
    batch = oracle.batch_gradient(model, x, y)
    oracle.assert_gradients_close([g.mean(0) for g in _numpy(grads)], batch, what="mean")


# --- microbatching ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["dense_mlp", "conv2d", "embedding", "multi_output", "sequence_output", "masked_dense"]
)
def test_microbatches_give_identical_results(name):
    """Chunks of 4 for a batch of 6 (the last chunk is short), with weights and masks."""
    problem = problems.make(name)
    problem.compile()
    model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
    whole = pergrad.per_example_gradients(model, x, y, weights)
    chunked = pergrad.per_example_gradients(model, x, y, weights, microbatch_size=4)
    oracle.assert_gradients_close(chunked, _numpy(whole), rtol=1e-6, atol=1e-6, what="microbatched")


@pytest.mark.parametrize("microbatch_size", [1, 6, 50])
def test_microbatch_sizes_one_exact_and_larger_than_the_batch(microbatch_size):
    problem = problems.make("dense_mlp")
    problem.compile()
    model, x, y = problem.model, problem.x, problem.y
    expected = oracle.batch_of_one_gradients(model, x, y)
    grads = pergrad.per_example_gradients(model, x, y, microbatch_size=microbatch_size)
    oracle.assert_gradients_close(grads, expected)


# --- dropout and randomness ------------------------------------------------------------------


def _identical_examples(seed=0, rate=0.5, batch=6):
    # 16 hidden units: two examples share a dropout mask with probability 2**-16.
    problem = problems.dense_mlp(batch=batch, seed=seed, dropout=rate, hidden=16)
    problem.compile()
    x = np.repeat(problem.x[:1], batch, axis=0)
    y = np.repeat(problem.y[:1], batch, axis=0)
    return problem.model, x, y


def _flat(grads):
    return np.concatenate([g.reshape(len(g), -1) for g in _numpy(grads)], axis=1)


def test_dropout_masks_differ_between_identical_examples():
    model, x, y = _identical_examples()
    flat = _flat(pergrad.per_example_gradients(model, x, y, training=True))
    distinct = {tuple(np.round(row, 6)) for row in flat}
    assert len(distinct) == len(x), f"only {len(distinct)} distinct gradients for {len(x)} examples"


def test_without_training_identical_examples_have_identical_gradients():
    model, x, y = _identical_examples()
    grads = pergrad.per_example_gradients(model, x, y, training=False)
    flat = _flat(grads)
    np.testing.assert_allclose(flat, np.repeat(flat[:1], len(flat), axis=0), rtol=1e-6, atol=1e-7)
    oracle.assert_gradients_close(grads, oracle.batch_of_one_gradients(model, x, y, training=False))


def _seed_state(model):
    (state,) = [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]
    return ops.convert_to_numpy(state.value).copy()


def test_dropout_masks_change_between_calls_and_the_seed_state_advances_like_keras():
    model, x, y = _identical_examples()
    plain, _, _ = _identical_examples()
    before = _seed_state(model)
    first = _flat(pergrad.per_example_gradients(model, x, y))
    second = _flat(pergrad.per_example_gradients(model, x, y))
    assert np.abs(first - second).max() > 1e-4
    # Two plain training-mode calls advance the state as two per-example passes do (on
    # torch, Keras's unseeded Dropout draws from torch's global generator and leaves it).
    plain(x, training=True)
    plain(x, training=True)
    np.testing.assert_array_equal(_seed_state(model), _seed_state(plain))
    if BACKEND != "torch":
        assert not np.array_equal(before, _seed_state(model)), "the seed state did not advance"


def test_dropout_is_reproducible_with_set_random_seed():
    """The factory calls ``keras.utils.set_random_seed(seed)`` before building the model:
    the same seed gives the same masks; another seed (same weights) other masks."""
    weights = _identical_examples(seed=0)[0].get_weights()
    runs = []
    for seed in (5, 5, 6):
        model, x, y = _identical_examples(seed=seed)
        model.set_weights(weights)
        keras.utils.set_random_seed(seed)  # torch's global generator drives unseeded dropout
        runs.append(_flat(pergrad.per_example_gradients(model, x, y)))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert np.abs(runs[0] - runs[2]).max() > 1e-4


def test_dropout_masks_are_independent_fair_draws_per_example():
    """Over many identical examples each hidden unit is kept about half the time."""
    model, x, y = _identical_examples(batch=200, rate=0.5)
    first_kernel = _numpy(pergrad.per_example_gradients(model, x, y))[0]  # (B, 5, 16)
    # Dropout follows the first Dense layer: a dropped unit zeroes its kernel column.
    kept = np.abs(first_kernel).sum(axis=1) > 0  # (B, 16)
    assert np.all((0.3 < kept.mean(axis=0)) & (kept.mean(axis=0) < 0.7)), kept.mean(axis=0)


@pytest.mark.parametrize(
    "layer",
    [
        lambda: keras.layers.Dropout(0.5, seed=3),
        lambda: keras.layers.GaussianNoise(0.5),
        lambda: keras.layers.GaussianDropout(0.3),
    ],
    ids=["seeded_dropout", "gaussian_noise", "gaussian_dropout"],
)
def test_random_layers_with_seeds(layer):
    """Layers that draw from a seed state draw per example, on every backend. (On torch,
    Keras turns the seed into a Python int for a ``torch.Generator``, which
    ``torch.func.vmap`` cannot batch: pergrad draws from torch's generator there.)"""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), layer(), keras.layers.Dense(2)]
    )
    model.compile(loss="mse")
    x, y = np.ones((4, 5), "float32"), np.zeros((4, 2), "float32")
    flat = _flat(pergrad.per_example_gradients(model, x, y))
    assert len({tuple(np.round(row, 6)) for row in flat}) == len(x)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's seeded generators")
def test_without_pergrads_seed_draws_torch_names_the_seeded_layer(monkeypatch):
    """Where pergrad could not wrap Keras's ``torch_seed_generator`` (a Keras that moved it),
    the error names the seeded random layers and the ways out."""
    from pergrad import compat
    from pergrad.backend import torch as torch_adapter

    module = compat.keras_torch_random()
    monkeypatch.setattr(module, "torch_seed_generator", module.torch_seed_generator.original)
    monkeypatch.setattr(torch_adapter, "PER_EXAMPLE_SEED_DRAWS", False)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                              keras.layers.Dropout(0.5, noise_shape=(None, 1)), keras.layers.Dense(2)])
    model.compile(loss="mse")
    with pytest.raises(NotImplementedError, match=r"(?s)noise_shape.*training=False"):
        pergrad.per_example_gradients(model, np.ones((4, 5), "float32"), np.zeros((4, 2), "float32"))


def _drop_connect(middle, seed=0):
    """A residual block whose branch goes through ``middle`` (EfficientNet's drop-connect:
    ``Dropout(noise_shape=(None, 1, 1, 1))`` keeps or drops an example's whole branch)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4, 4, 3))
    trunk = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="trunk")(inputs)
    branch = keras.layers.Conv2D(4, 1, name="branch")(trunk)
    hidden = keras.layers.Add()([trunk, middle(branch)])
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("seed", [None, 7], ids=["unseeded", "seeded"])
def test_drop_connect_gives_each_example_its_own_exact_mask(seed):
    """Each example's gradient is the batch-of-one gradient with its branch kept (scaled by
    ``1 / (1 - rate)``) or dropped, both occur, and clipping trains on the statistics path as
    on the materialized path (the same draws)."""
    rate = 0.5

    def make():  # (the same weights and seed states each time)
        return _drop_connect(lambda t: keras.layers.Dropout(rate, noise_shape=(None, 1, 1, 1), seed=seed)(t))

    model = make()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4, 4, 3)).astype("float32")
    y = rng.integers(0, 2, size=(8, 1)).astype("float32")
    outcomes = {}
    for name, scale in (("kept", 1 / (1 - rate)), ("dropped", 0.0)):
        reference = _drop_connect(lambda t, scale=scale: keras.layers.Rescaling(scale)(t))
        reference.set_weights(model.get_weights())
        outcomes[name] = oracle.batch_of_one_gradients(reference, x, y)
    grads = _numpy(pergrad.per_example_gradients(model, x, y))
    found = []
    for i in range(len(x)):
        for name, expected in outcomes.items():
            if all(np.allclose(g[i], e[i], rtol=1e-5, atol=1e-6) for g, e in zip(grads, expected)):
                found.append(name)
                break
        else:
            raise AssertionError(f"example {i}'s gradient is neither the kept nor the dropped branch's")
    assert set(found) == {"kept", "dropped"}, found

    start = model.get_weights()
    weights = {}
    for path in ("materialized", "statistics"):
        model = make()
        wrapper = pergrad.PerExampleModel(model, pergrad.aggregators.clip(0.05), path=path)
        wrapper.compile(optimizer=keras.optimizers.SGD(0.5), loss=model.loss)
        keras.utils.set_random_seed(3)  # the same draws on both paths
        wrapper.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights[path] = model.get_weights()
    for a, b in zip(weights["statistics"], weights["materialized"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert max(float(np.abs(a - b).max()) for a, b in zip(weights["statistics"], start)) > 1e-4


def test_sample_weight_tensor_is_not_modified():
    """Keras multiplies sample weights by the mask in place; the caller's tensor must not change."""
    problem = problems.make("masked_dense")
    problem.compile()
    weights = ops.convert_to_tensor(problem.sample_weight.copy())
    pergrad.per_example_gradients(problem.model, problem.x, problem.y, weights)
    np.testing.assert_array_equal(ops.convert_to_numpy(weights), problem.sample_weight)
