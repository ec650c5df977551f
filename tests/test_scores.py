"""``pergrad.scores`` against NumPy references from materialized per-example gradients.

The references flatten :func:`pergrad.per_example_gradients` (itself checked against a
batch-of-one loop in tests/engine) into ``(N, P)`` rows and compute every score from them
with NumPy; the loss and EL2N references come from a Python loop of Keras's own
``compute_loss`` and predictions. Batches of 4 over 6 examples: the scores stay aligned
with the examples, and the smaller last batch (padded to 4) keeps its own.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import pergrad
import pergrad_cli as cli
import problems
from oracle import take, to_numpy
from pergrad.apps import insight
from pergrad.insight.scoring import KINDS

PROBLEMS = ["dense_mlp", "conv2d", "embedding", "layer_norm", "attention"]
RATES = [0.5, 2.0]


def _rows(model, x, y, sample_weight):
    grads = pergrad.per_example_gradients(model, x, y, sample_weight, training=False)
    flat = [to_numpy(g).reshape(len(to_numpy(g)), -1) for g in grads]
    return np.concatenate(flat, axis=1).astype("float64")


def _reference_losses(model, x, y, sample_weight):
    losses = []
    for i in range(len(keras.tree.flatten(x)[0])):
        xi, yi = take(x, i), take(y, i)
        wi = None if sample_weight is None else sample_weight[i : i + 1]
        y_pred = model(xi, training=False)
        losses.append(float(to_numpy(model.compute_loss(x=xi, y=yi, y_pred=y_pred, sample_weight=wi))))
    return np.array(losses)


def _reference_el2n(problem):
    y_pred = to_numpy(problem.model(problem.x, training=False)).astype("float64")
    y = np.asarray(problem.y)
    if isinstance(problem.loss, keras.losses.SparseCategoricalCrossentropy):
        p = np.exp(y_pred) / np.exp(y_pred).sum(axis=1, keepdims=True)
        y = np.eye(p.shape[1])[y]
    else:
        p = y_pred
    return np.linalg.norm(p - y, axis=1)


def _checkpoints(model):
    """The current weights and a perturbed copy."""
    first = model.get_weights()
    rng = np.random.default_rng(3)
    second = [w + 0.3 * rng.normal(size=w.shape).astype(w.dtype) for w in first]
    return [first, second]


@pytest.mark.parametrize("name", PROBLEMS)
def test_every_score_matches_the_materialized_reference(name):
    problem = problems.make(name)
    model = problem.compile()
    x, y, weight = problem.x, problem.y, problem.sample_weight
    train = (x, y)
    chosen = [5, 0, 2]  # the test examples: rows of the data, their gradients rows of its
    test = (keras.tree.map_structure(lambda t: t[chosen], x), y[chosen], weight[chosen])
    arguments = dict(batch_size=4, verbose=0)  # (a last batch of 2, padded)

    np.testing.assert_allclose(pergrad.scores(model, *train, weight, kind="loss", **arguments),
                               _reference_losses(model, x, y, weight), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pergrad.scores(model, *train, weight, kind="el2n", **arguments),
                               _reference_el2n(problem), rtol=1e-5, atol=1e-6)
    rows = _rows(model, x, y, weight)
    np.testing.assert_allclose(pergrad.scores(model, *train, weight, kind="grand", **arguments),
                               np.linalg.norm(rows, axis=1), rtol=1e-4, atol=1e-6)

    checkpoints = _checkpoints(model)
    self_influence, influence = 0.0, 0.0
    for rate, weights in zip(RATES, checkpoints):
        model.set_weights(weights)
        rows = _rows(model, x, y, weight)
        self_influence = self_influence + rate * np.sum(rows**2, axis=1)
        influence = influence + rate * rows @ rows[chosen].T
    model.set_weights(checkpoints[0])
    tracin = dict(checkpoints=checkpoints, learning_rates=RATES, **arguments)
    np.testing.assert_allclose(pergrad.scores(model, *train, weight, kind="self_influence", **tracin),
                               self_influence, rtol=1e-4, atol=1e-6)
    found = pergrad.scores(model, *train, weight, kind="influence", test_data=test, **tracin)
    assert found.shape == (6, 3)
    np.testing.assert_allclose(found, influence, rtol=1e-4, atol=1e-5)
    for kept, original in zip(model.get_weights(), checkpoints[0]):  # restored after the checkpoints
        np.testing.assert_array_equal(kept, original)


def _data_kinds(x, y):
    """The same 6 examples in batches of 4, as each input kind ``fit()`` takes."""

    def generator():
        for start in (0, 4):
            yield x[start : start + 4], y[start : start + 4]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return x[4 * index : 4 * index + 4], y[4 * index : 4 * index + 4]

    kinds = {"generator": generator(), "PyDataset": Batches()}
    import tensorflow as tf
    import torch

    kinds["tf.data"] = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    kinds["DataLoader"] = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    return kinds


def test_every_input_kind_gives_the_scores_of_the_arrays():
    problem = problems.dense_mlp()
    model = problem.compile()
    x, y = problem.x, problem.y
    expected = {kind: pergrad.scores(model, x, y, kind=kind, batch_size=4, verbose=0)
                for kind in ("el2n", "grand")}
    for source in ("generator", "PyDataset", "tf.data", "DataLoader"):
        for kind in ("el2n", "grand"):
            data = _data_kinds(x, y)[source]
            np.testing.assert_allclose(pergrad.scores(model, data, kind=kind, verbose=0), expected[kind],
                                       rtol=1e-6, err_msg=f"{source}, {kind}")


def test_a_sum_reduction_gives_the_scores_of_the_mean():
    """Scores are of each example's own loss: no batch-size factor."""
    problem = problems.dense_mlp()
    model = problem.compile()
    mean = [pergrad.scores(model, problem.x, problem.y, kind=k, batch_size=4, verbose=0)
            for k in ("loss", "grand")]
    summed = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    found = [pergrad.scores(model, problem.x, problem.y, kind=k, batch_size=4, verbose=0, loss=summed)
             for k in ("loss", "grand")]
    for a, b in zip(mean, found):
        np.testing.assert_allclose(b, a, rtol=1e-5)


def test_bad_arguments_are_refused():
    problem = problems.dense_mlp()
    model = problem.compile()
    x, y = problem.x, problem.y
    with pytest.raises(ValueError, match="kind="):
        pergrad.scores(model, x, y, kind="tracin")
    with pytest.raises(ValueError, match="test_data"):
        pergrad.scores(model, x, y, kind="influence")
    with pytest.raises(ValueError, match="test_data"):
        pergrad.scores(model, x, y, kind="grand", test_data=(x, y))
    with pytest.raises(ValueError, match="2 learning rates for 1"):
        pergrad.scores(model, x, y, kind="self_influence", checkpoints=[model.get_weights()],
                       learning_rates=[1.0, 2.0])
    with pytest.raises(ValueError, match="needs the targets"):
        pergrad.scores(model, x, kind="el2n", verbose=0)
    with pytest.raises(ValueError, match="learning_rates"):
        pergrad.scores(model, x, y, kind="el2n", learning_rates=0.1)
    assert set(KINDS) == {"loss", "el2n", "grand", "self_influence", "influence"}


def test_the_finder_counts_flipped_labels_among_the_highest_scores():
    y, flipped = insight.flip_labels(np.arange(20) % 10, 0.1, seed=0)
    assert flipped.sum() == 2 and np.all(y[flipped] != (np.arange(20) % 10)[flipped])
    score = np.where(flipped, 5.0, 0.0)
    score[np.flatnonzero(~flipped)[0]] = 9.0  # one clean example ranked first
    assert insight.precision_at_k(score, flipped, 2) == 0.5
    assert insight.precision_at_k(score, flipped, 3) == 2 / 3


def test_pergrad_insight_runs_the_finder_and_writes_readable_plots(tmp_path, monkeypatch):
    """The command's wiring and the plots, from made-up scores (the training runs are the
    run's own: ``pergrad insight`` is measured in docs/scores.md)."""
    seen = {}
    monkeypatch.setattr(insight, "run", lambda **kwargs: seen.update(kwargs))
    cli.main(["insight", "--seeds", "2", "--epochs", "3", "--no-pruning", "--out", str(tmp_path)])
    assert {k: seen[k] for k in ("seeds", "epochs", "fraction", "pruning", "out_dir")} == {
        "seeds": 2, "epochs": 3, "fraction": 0.1, "pruning": False, "out_dir": str(tmp_path)}
    rng = np.random.default_rng(0)
    flipped = rng.random(200) < 0.1
    found = {name: rng.random(200) + flipped for name in insight.RANKINGS}
    precision = {name: insight.precision_at_k(found[name], flipped, flipped.sum()) for name in found}
    result = insight.FinderResult(0, flipped, found, precision)
    curve = insight.PruningResult([1.0, 0.5], {"highest EL2N": [0.9, 0.8], "random": [0.9, 0.85]})
    paths = [insight.plot_histograms(result, str(tmp_path / "h.png")),
             insight.plot_precision([result, result], str(tmp_path / "p.png")),
             insight.plot_pruning(curve, str(tmp_path / "c.png"))]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in ("h.png", "p.png", "c.png"))
    assert paths == [str(tmp_path / name) for name in ("h.png", "p.png", "c.png")]
