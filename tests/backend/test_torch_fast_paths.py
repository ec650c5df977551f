"""The torch adapter's fast paths and their fallbacks (torch only): each gives what the
backend-neutral code gives."""

from __future__ import annotations

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch adapter")


def _values(batch=7, size=5, seed=0):
    x = np.random.default_rng(seed).standard_normal((batch, size)).astype(np.float32)
    x[2, 1], x[0, 3], x[-1, 4] = np.nan, np.inf, -np.inf
    return x


def test_sorted_ranks_match_numpy_and_decline_what_they_cannot_sort():
    import torch

    from pergrad.backend import torch as adapter

    x = _values()
    ranks = adapter.sorted_ranks(torch.from_numpy(x), 2, 5)
    np.testing.assert_array_equal(ranks.numpy(), np.sort(x, axis=0)[2:5])
    assert adapter.sorted_ranks(torch.from_numpy(x).requires_grad_(True), 2, 5) is None
    assert adapter.sorted_ranks(torch.from_numpy(x).to(torch.bfloat16), 2, 5) is None


def test_default_strategy_falls_back_to_top_k(monkeypatch):
    import torch

    from pergrad.aggregators import selection

    x = torch.from_numpy(_values(batch=8, size=6, seed=1))
    x[2, 1] = 0.0  # a finite median in every column
    assert selection._strategy(x) == "backend"
    expected = np.median(x.numpy(), axis=0)
    np.testing.assert_allclose(selection.median(x).numpy(), expected, rtol=1e-6)
    calls = []
    monkeypatch.setattr(selection.adapter(), "sorted_ranks", lambda *a: calls.append(a) or None)
    np.testing.assert_allclose(selection.median(x).numpy(), expected, rtol=1e-6)  # by top_k
    assert calls
