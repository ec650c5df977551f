"""The torch adapter's ranks of outer-product rows (``outer_rank_sums``, ``outer_meamed``,
torch only): the products formed and sorted a block at a time must give, bit for bit,
what ``rank_sums`` / ``meamed_columns`` give for the formed ``(B, p, q)`` tensor, and the
selection's ``outer_median`` / ``outer_trimmed_mean`` / ``outer_meamed`` what
``median`` / ``trimmed_mean`` / ``meamed`` give for it."""

from __future__ import annotations

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch adapter")


def _factors(batch, p, q, dtype="float32", special=True, seed=0):
    """``(a, d)``: with zeros of both signs, NaN, infinities (a NaN product from inf x 0)
    and ties, where ``special``."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, p))
    d = rng.standard_normal((batch, q))
    if special:
        a[rng.random((batch, p)) < 0.3] = 0.0
        d[rng.random((batch, q)) < 0.15] = -0.0
        a[:, 1] = np.round(a[:, 1])  # ties
        a[0, 0], d[1 % batch, 1] = np.nan, np.inf
        a[-1, 3], a[-1, 2], d[-1, 2] = -np.inf, 0.0, np.inf  # inf x 0: NaN
    return a.astype(dtype), d.astype(dtype)


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("batch", [2, 3, 4, 7, 16, 64, 65])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_outer_rank_sums_are_the_formed_products_rank_sums(batch, dtype):
    import torch

    from pergrad.backend import torch as adapter

    a, d = _factors(batch, 13, 11, dtype, seed=batch)
    a, d = torch.from_numpy(a), torch.from_numpy(d)
    formed = (a[:, :, None] * d[:, None, :]).reshape(batch, -1)
    item = a.element_size()
    ranges = {((batch - 1) // 2, batch // 2 + 1), (batch // 4, batch - batch // 4), (0, batch)}
    # blocks: whole rows of q (several rows, a partial last block), one coordinate, parts of rows
    for block_bytes in (1 << 20, 3 * 11 * batch * item, 1, 4 * batch * item):
        for lo, hi in ranges:
            expected_total, expected_nan = adapter.rank_sums(formed, lo, hi)
            total, nan = adapter.outer_rank_sums(a, d, lo, hi, block_bytes=block_bytes)
            assert total.shape == nan.shape == (13, 11)
            np.testing.assert_array_equal(_bits(total.numpy()).reshape(-1), _bits(expected_total.numpy()))
            np.testing.assert_array_equal(nan.numpy().reshape(-1), expected_nan.numpy())
    assert expected_nan.numpy().any() and not expected_nan.numpy().all()  # both kinds checked


def test_outer_rank_sums_decline_what_rank_sums_cannot_sort():
    import torch

    from pergrad.backend import torch as adapter

    a, d = (torch.from_numpy(x) for x in _factors(4, 5, 4))
    assert adapter.outer_rank_sums(a.requires_grad_(True), d, 1, 3) is None
    assert adapter.outer_rank_sums(a.detach().to(torch.bfloat16), d.to(torch.bfloat16), 1, 3) is None
    assert adapter.outer_rank_sums(a.detach(), d.double(), 1, 3) is None  # mixed dtypes
    assert adapter.outer_rank_sums(a.detach(), d[:3], 1, 3) is None  # different batches


@pytest.mark.parametrize("batch", [1, 2, 5, 6, 64])
def test_outer_median_and_trimmed_mean_are_those_of_the_formed_products(batch):
    import torch

    from pergrad.aggregators import selection

    a, d = (torch.from_numpy(x) for x in _factors(batch, 9, 7, seed=batch + 1))
    formed = a[:, :, None] * d[:, None, :]
    pairs = [(selection.outer_median(a, d), selection.median(formed))]
    for dropped in range(0, (batch + 1) // 2 + 1):
        outer = selection.outer_trimmed_mean(a, d, dropped)
        if not 0 < 2 * dropped < batch:  # a plain mean, or nothing left: the caller forms them
            assert outer is None
            continue
        pairs.append((outer, selection.trimmed_mean(formed, dropped)))
    if batch == 1:  # the median of one row is the row itself: formed
        assert pairs[0][0] is None
        pairs = pairs[1:]
    for outer, expected in pairs:
        np.testing.assert_array_equal(_bits(outer.numpy()), _bits(expected.numpy()))
        assert np.isnan(expected.numpy()).any()


def test_outer_median_declines_where_the_adapter_does():
    import torch

    from pergrad.aggregators import selection

    a, d = (torch.from_numpy(x).to(torch.bfloat16) for x in _factors(4, 5, 4))
    assert selection.outer_median(a, d) is None
    assert selection.outer_trimmed_mean(a, d, 1) is None


@pytest.mark.parametrize("batch", [1, 4])
def test_median_and_trimmed_mean_of_factors_the_adapter_declines_are_those_of_the_formed_parts(batch):
    import torch

    from pergrad.aggregators import selection
    from pergrad.layer_rules.dense import OuterRows

    a, d = (torch.from_numpy(x).to(torch.bfloat16) for x in _factors(batch, 7, 3, seed=4))
    formed = a[:, :, None] * d[:, None, :]
    pairs = [(selection.median(OuterRows(a, d, 3)), selection.median(formed))]
    if batch > 2:
        pairs.append((selection.trimmed_mean(OuterRows(a, d, 3), 1), selection.trimmed_mean(formed, 1)))
    for outer, expected in pairs:
        assert outer.shape == (7, 3)
        np.testing.assert_array_equal(_bits(outer.float().numpy()), _bits(expected.float().numpy()))
    a, d = a.float(), d.float()  # and as the adapter gives them, where it does not decline
    formed = a[:, :, None] * d[:, None, :]
    np.testing.assert_array_equal(_bits(selection.median(OuterRows(a, d, 3)).numpy()),
                                  _bits(selection.median(formed).numpy()))


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_outer_meamed_is_the_formed_products_meamed(batch, dtype):
    import torch

    from pergrad.aggregators import selection
    from pergrad.backend import torch as adapter

    a, d = _factors(batch, 13, 11, dtype, seed=batch + 2)
    a[:, 4] = 1.0  # every example's products of row 4 tie at the kept-th distance somewhere
    a, d = torch.from_numpy(a), torch.from_numpy(d)
    formed = a[:, :, None] * d[:, None, :]
    item = a.element_size()
    for kept in sorted({1, max(1, batch // 2), batch}):
        expected = adapter.meamed_columns(formed.reshape(batch, -1), kept)
        for block_bytes in (1 << 19, 3 * 11 * batch * item, 1, 4 * batch * item):
            outer = adapter.outer_meamed(a, d, kept, block_bytes=block_bytes)
            np.testing.assert_array_equal(_bits(outer.numpy()).reshape(-1), _bits(expected.numpy()))
        through = selection.outer_meamed(a, d, kept)
        np.testing.assert_array_equal(_bits(through.numpy()), _bits(selection.meamed(formed, kept).numpy()))
    assert selection.outer_meamed(a, d, 0) is None and selection.outer_meamed(a, d, batch + 1) is None
    assert adapter.outer_meamed(a.requires_grad_(True), d, 1) is None
