"""Order statistics over the batch axis (pergrad.aggregators.selection) against NumPy.

Each array packs the adversarial cases side by side as columns (ties, equal values,
+-inf, NaN), so that one call per batch size checks all of them; every strategy is
checked on every backend, whichever the backend uses by default.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from pergrad.aggregators import selection

BACKEND = keras.backend.backend()
STRATEGIES = ("sort", "top_k", "network", "unrolled", "backend")
BATCHES = (1, 2, 3, 4, 5, 8, 13, 20)


def cases(batch: int, seed: int = 0) -> np.ndarray:
    """A ``(batch, 9, 2)`` float32 array, one kind of column per row of axis 1."""
    rng = np.random.default_rng(seed + batch)
    normal = rng.standard_normal((batch, 9, 2)).astype(np.float32)
    x = normal.copy()
    x[:, 1] = rng.integers(0, 3, (batch, 2))  # many ties, in values and in distances
    x[:, 2] = 0.5  # all equal
    x[0, 3, 0] = np.inf  # one +inf
    x[-1, 3, 1] = -np.inf  # one -inf
    x[: batch // 2 + 1, 4, 0] = np.inf  # a majority of +inf: an infinite median
    x[:, 4, 1] = np.where(np.arange(batch) % 2 == 0, -np.inf, np.inf)  # -inf and +inf only
    x[batch // 2, 5, 0] = np.nan  # one NaN
    x[:, 5, 1] = np.nan  # all NaN
    x[0, 6, 0], x[-1, 6, 0] = np.nan, np.inf  # NaN and inf
    x[:, 6, 1] = rng.choice([-np.inf, 1.0, np.inf], batch)
    x[:, 7] = -normal[:, 7]  # the rest random
    return x


def ref_median(x):
    with np.errstate(invalid="ignore"):
        return np.median(x, axis=0)


def ref_trimmed_mean(x, dropped):
    with np.errstate(invalid="ignore"):
        kept = np.sort(x, axis=0)[dropped : x.shape[0] - dropped].mean(axis=0)
    return np.where(np.isnan(x).any(axis=0), np.nan, kept)


def ref_meamed(x, kept):
    """The definition: mean of the first ``kept`` values by a stable argsort of the
    distances to the median (0 for a value equal to it); NaN where the median is."""
    median = ref_median(x)
    with np.errstate(invalid="ignore"):
        distances = np.where(x == median, 0.0, np.abs(x - median))
        order = np.argsort(distances, axis=0, kind="stable")
        result = np.take_along_axis(x, order, axis=0)[:kept].mean(axis=0)
    return np.where(np.isnan(median), np.nan, result)


def assert_matches(actual, expected):
    actual = ops.convert_to_numpy(actual)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected.astype(np.float32), rtol=2e-6, atol=1e-6)


def run_all(function, x, parameters, reference, strategy):
    tensor = ops.convert_to_tensor(x)
    for parameter in parameters:
        assert_matches(function(tensor, parameter, strategy), reference(x, parameter))


@pytest.fixture(params=STRATEGIES)
def strategy(request, monkeypatch):
    # Blocks of 32 values for the network: the 18 columns take the blocked path, padding
    # included, from B = 3 on.
    monkeypatch.setattr(selection, "_BLOCK", 32)
    monkeypatch.setattr(selection, "_UNBLOCKED_BATCH", 2)
    return request.param


@pytest.mark.parametrize("batch", BATCHES)
def test_median(batch, strategy):
    x = cases(batch)
    assert_matches(selection._median(ops.convert_to_tensor(x), strategy), ref_median(x))


@pytest.mark.parametrize("batch", BATCHES)
def test_trimmed_mean(batch, strategy):
    dropped = sorted({0, 1, batch // 4, (batch - 1) // 2} & set(range((batch + 1) // 2)))
    run_all(selection._trimmed_mean, cases(batch), dropped, ref_trimmed_mean, strategy)


@pytest.mark.parametrize("batch", BATCHES)
def test_meamed(batch, strategy):
    kept = sorted({1, 2, batch // 2, batch - 1, batch} & set(range(1, batch + 1)))
    run_all(selection._meamed, cases(batch), kept, ref_meamed, strategy)


def test_known_values():
    inf = np.inf
    assert float(selection.median(ops.convert_to_tensor(np.float32([inf, 1, -inf])))) == 1.0
    assert np.isnan(float(selection.median(ops.convert_to_tensor(np.float32([-inf, inf])))))
    assert float(selection.trimmed_mean(ops.convert_to_tensor(np.float32([100, 0, 1, 2, -100])), 1)) == 1.0
    # The 4 values nearest to the median 2 of [100, 0, 2, 1, 3] are 0, 1, 2, 3.
    assert float(selection.meamed(ops.convert_to_tensor(np.float32([100, 0, 2, 1, 3])), 4)) == 1.5
    # 1 and 3 are both at distance 1 from 2: the first in batch order is kept.
    assert float(selection.meamed(ops.convert_to_tensor(np.float32([3, 2, 1])), 2)) == 2.5


def test_public_functions_multidimensional_and_bad_arguments():
    x = np.random.default_rng(3).standard_normal((6, 4, 3, 2)).astype(np.float32)
    tensor = ops.convert_to_tensor(x)
    assert_matches(selection.median(tensor), ref_median(x))
    assert_matches(selection.trimmed_mean(tensor, 2), ref_trimmed_mean(x, 2))
    assert_matches(selection.meamed(tensor, 4), ref_meamed(x, 4))
    with pytest.raises(ValueError, match="drop 3 values at each end of 6"):
        selection.trimmed_mean(tensor, 3)
    with pytest.raises(ValueError, match="keep 0 of 6"):
        selection.meamed(tensor, 0)


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit")
def test_under_jax_jit(monkeypatch):
    import jax

    monkeypatch.setattr(selection, "_BLOCK", 16)
    monkeypatch.setattr(selection, "_UNBLOCKED_BATCH", 2)
    x = cases(6)
    median = jax.jit(selection.median)
    trimmed = jax.jit(selection.trimmed_mean, static_argnums=1)
    meamed = jax.jit(selection.meamed, static_argnums=1)
    assert_matches(median(x), ref_median(x))
    assert_matches(trimmed(x, 1), ref_trimmed_mean(x, 1))
    assert_matches(meamed(x, 4), ref_meamed(x, 4))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.function with an unknown batch size")
def test_unknown_batch_size_under_tf_function():
    import tensorflow as tf

    spec = [tf.TensorSpec((None, 9, 2), tf.float32)]

    @tf.function(input_signature=spec, autograph=False)
    def all_three(x):
        size = tf.shape(x)[0]
        return selection.median(x), selection.trimmed_mean(x, size // 4), selection.meamed(x, size - 1)

    for batch in (2, 4, 5):
        x = cases(batch)
        median, trimmed, meamed = all_three(tf.constant(x))
        assert_matches(median, ref_median(x))
        assert_matches(trimmed, ref_trimmed_mean(x, batch // 4))
        assert_matches(meamed, ref_meamed(x, batch - 1))


@pytest.mark.skipif(BACKEND != "torch", reason="torch's adapter")
@pytest.mark.parametrize("batch", (1, 2, 3, 4, 5, 8, 13, 20, 64))
def test_torch_rank_sums_match_numpy_in_every_block_and_layout(batch):
    """``rank_sums`` (the torch adapter's summed selection) against NumPy's sort: every
    rank range, blocks of 1 column to all of them (a last block shorter than the
    others), the batch axis strided or contiguous, float16/32/64, NaN columns flagged."""
    import torch

    from pergrad.backend import torch as adapter

    x = cases(batch).reshape(batch, -1)
    columns = x.shape[1]
    ranges = {(0, batch), (0, 1), (batch - 1, batch), ((batch - 1) // 2, batch // 2 + 1),
              (batch // 4, batch - batch // 4)}
    for dtype in (np.float32, np.float64, np.float16):
        values = x.astype(dtype)
        ordered = np.sort(values.astype(np.float64), axis=0)
        for tensor in (torch.from_numpy(values), torch.from_numpy(values.T.copy()).T):
            for block in (1, 7, columns, columns + 5):
                for lo, hi in ranges:
                    size = block * batch * values.itemsize
                    total, nan = adapter.rank_sums(tensor, lo, hi, block_bytes=size)
                    assert total.dtype == tensor.dtype and total.shape == (columns,)
                    np.testing.assert_array_equal(nan.numpy(), np.isnan(values).any(axis=0))
                    with np.errstate(invalid="ignore"):
                        expected = ordered[lo:hi].sum(axis=0).astype(dtype)
                    tolerance = 2e-3 if dtype == np.float16 else 2e-6
                    np.testing.assert_allclose(total.numpy(), expected, rtol=tolerance, atol=tolerance)
    assert adapter.rank_sums(torch.zeros(3, 2, requires_grad=True), 0, 1) is None
    assert adapter.rank_sums(torch.zeros(3, 2, dtype=torch.int32), 0, 1) is None


@pytest.mark.skipif(BACKEND != "torch", reason="torch's adapter")
@pytest.mark.parametrize("batch", (1, 2, 5, 8, 13, 64))
def test_torch_meamed_columns_match_the_definition_in_every_block_and_layout(batch):
    """``meamed_columns`` (the torch adapter's MeaMed in blocks) against the stable-argsort
    definition: blocks of 1 column to all of them, the batch axis strided or contiguous."""
    import torch

    from pergrad.backend import torch as adapter

    x = cases(batch, seed=1).reshape(batch, -1)
    columns = x.shape[1]
    for tensor in (torch.from_numpy(x), torch.from_numpy(x.T.copy()).T):
        for block in (1, 7, columns):
            for kept in sorted({1, 2, batch // 2, batch - 1, batch} & set(range(1, batch + 1))):
                actual = adapter.meamed_columns(tensor, kept, block_bytes=block * batch * 4)
                assert_matches(actual, ref_meamed(x, kept))
    assert adapter.meamed_columns(torch.zeros(3, 2), 4) is None
