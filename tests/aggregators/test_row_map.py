"""``RowMap``, the linear map of the batch that pre-processing steps are: its application
and its composition (``then``) against the map written as one NumPy matrix per variable.

Output row ``j`` of variable ``k`` is ``sum_t weights[j, t, k] g_{order[j, t]}``: the
matrix ``M_k`` with ``M_k[j, order[j, t]] += weights[j, t, k]``. Composing two maps is
multiplying their matrices, ``then(first, second) = M2 @ M1``.
"""

from __future__ import annotations

import numpy as np
import pytest
from keras import ops

from pergrad.aggregators import ExampleStatistics
from pergrad.aggregators.row_map import RowMap

B = 6
SHAPES = [(3,), (2, 2)]  # V = 2 variables


def _gradients(rows, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(rows,) + shape).astype("float32") for shape in SHAPES]


def _map(form: str, rows: int, seed: int):
    """``(RowMap, output rows)``: a map of ``form`` from ``rows`` input rows."""
    rng = np.random.default_rng(seed)
    V = len(SHAPES)
    f = ops.convert_to_tensor

    def uniform(low, high, size):
        return f(rng.uniform(low, high, size).astype("float32"))

    kept = np.sort(rng.permutation(rows)[: rows - 2]).astype("int32")[:, None]
    if form == "identity":
        return RowMap(), rows
    if form == "flat_scaling":
        return RowMap.scaling(uniform(0.1, 2.0, rows)), rows
    if form == "per_variable_scaling":
        return RowMap.scaling(uniform(0.1, 2.0, (rows, V))), rows
    if form == "selection":
        return RowMap(f(kept)), len(kept)
    if form == "weighted_selection":
        return RowMap(f(kept), uniform(0.1, 2.0, (len(kept), 1, V))), len(kept)
    if form == "buckets":  # bucket means, the last bucket padded with a weight-0 row
        buckets = -(-rows // 2)
        order = np.zeros(2 * buckets, "int32")
        order[:rows] = rng.permutation(rows)
        valid = (np.arange(2 * buckets) < rows).astype("float32")
        return RowMap(f(order.reshape(buckets, 2)), f((valid / 2.0).reshape(buckets, 2, 1))), buckets
    assert form == "per_variable_triples"  # three rows each, repeats allowed
    triples = rng.integers(0, rows, size=(rows, 3)).astype("int32")
    return RowMap(f(triples), uniform(-1.0, 1.0, (rows, 3, V))), rows


def _matrix(rows_map: RowMap, rows: int, k: int) -> np.ndarray:
    """Variable ``k``'s map as a ``(J, rows)`` NumPy matrix."""
    order = None if rows_map.order is None else ops.convert_to_numpy(rows_map.order)
    weights = rows_map.variable_weights(k)
    weights = None if weights is None else ops.convert_to_numpy(weights)
    if order is None:
        scales = np.ones(rows, "float32") if weights is None else weights[:, 0]
        return np.diag(scales)
    matrix = np.zeros((order.shape[0], rows), "float64")
    for j in range(order.shape[0]):
        for t in range(order.shape[1]):
            matrix[j, order[j, t]] += 1.0 if weights is None else weights[j, t]
    return matrix


def _applied(rows_map: RowMap, gradients) -> list:
    return [
        ops.convert_to_numpy(rows_map.apply(ops.convert_to_tensor(g), k)) for k, g in enumerate(gradients)
    ]


def _reference(matrix: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    rows = gradient.reshape(gradient.shape[0], -1)
    return (matrix @ rows).reshape((matrix.shape[0],) + gradient.shape[1:])


FORMS = ["identity", "flat_scaling", "per_variable_scaling", "selection", "weighted_selection",
         "buckets", "per_variable_triples"]


@pytest.mark.parametrize("form", FORMS)
def test_a_map_applies_as_its_matrix(form):
    rows_map, _ = _map(form, B, 1)
    gradients = _gradients(B)
    for k, (got, gradient) in enumerate(zip(_applied(rows_map, gradients), gradients)):
        np.testing.assert_allclose(got, _reference(_matrix(rows_map, B, k), gradient), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("second", FORMS[1:])  # with the identity: the next test
@pytest.mark.parametrize("first", FORMS[1:])
def test_then_is_applying_both(first, second):
    """``first.then(second)`` applied once equals ``first`` then ``second`` applied, and the
    product of their matrices."""
    first_map, middle = _map(first, B, 2)
    second_map, _ = _map(second, middle, 3)
    gradients = _gradients(B, seed=4)
    composed = _applied(first_map.then(second_map), gradients)
    one_by_one = _applied(second_map, _applied(first_map, gradients))
    for k, gradient in enumerate(gradients):
        product = _matrix(second_map, middle, k) @ _matrix(first_map, B, k)
        np.testing.assert_allclose(composed[k], one_by_one[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(composed[k], _reference(product, gradient), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_the_identity_is_neutral(form):
    rows_map, _ = _map(form, B, 5)
    gradients = _gradients(B, seed=6)
    expected = _applied(rows_map, gradients)
    for composed in (RowMap().then(rows_map), rows_map.then(RowMap())):
        for got, want in zip(_applied(composed, gradients), expected):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    identity = RowMap()
    for gradient, got in zip(gradients, _applied(identity, gradients)):
        np.testing.assert_array_equal(got, gradient)


@pytest.mark.parametrize("form", FORMS)
def test_the_output_statistics_follow_where_each_output_row_is_one_example(form):
    """``statistics`` gives the output rows' norms (and, for flat weights, the Gram matrix)
    when each output row is one input row scaled; ``None`` when rows are mixed."""
    rows_map, _ = _map(form, B, 7)
    gradients = _gradients(B, seed=8)
    stats = ExampleStatistics.from_gradients([ops.convert_to_tensor(g) for g in gradients], gram=True)
    got = rows_map.statistics(stats)
    if rows_map.order is not None and rows_map.order.shape[1] != 1:
        assert got is None
        return
    output = [ops.convert_to_tensor(g) for g in _applied(rows_map, gradients)]
    expected = ExampleStatistics.from_gradients(output, gram=True)
    np.testing.assert_allclose(
        ops.convert_to_numpy(got.squared_norms), ops.convert_to_numpy(expected.squared_norms), rtol=1e-5
    )
    if rows_map.per_variable:
        assert got.gram is None  # the Gram matrix of per-variable weights is not known
    else:
        np.testing.assert_allclose(
            ops.convert_to_numpy(got.gram), ops.convert_to_numpy(expected.gram), rtol=1e-5, atol=1e-5
        )
