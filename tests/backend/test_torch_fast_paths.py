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
    for block_bytes in (1, 2 * 7 * 4, 3 * 7 * 4):  # blocks of 1, 2 and 3 columns (a partial last one)
        blocked = adapter.sorted_ranks(torch.from_numpy(x), 2, 5, block_bytes=block_bytes)
        np.testing.assert_array_equal(blocked.numpy(), np.sort(x, axis=0)[2:5])
        ranks, nan = adapter.sorted_ranks(torch.from_numpy(x), 2, 5, block_bytes=block_bytes, with_nan=True)
        np.testing.assert_array_equal(ranks.numpy(), np.sort(x, axis=0)[2:5])
        np.testing.assert_array_equal(nan.numpy(), np.isnan(x).any(axis=0))
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
    for name in ("rank_sums", "sorted_ranks"):  # the adapter's two sorts, tried in turn
        monkeypatch.setattr(selection.adapter(), name,
                            lambda *a, _name=name, **k: calls.append(_name) or None)
    np.testing.assert_allclose(selection.median(x).numpy(), expected, rtol=1e-6)  # by top_k
    assert set(calls) == {"rank_sums", "sorted_ranks"}
    # a NaN coordinate: NaN, told by the sort (and by top_k's fallback, checked above)
    monkeypatch.undo()
    x[5, 4] = float("nan")
    for rule, reference in ((selection.median, np.median(x.numpy(), axis=0)),
                            (lambda t: selection.trimmed_mean(t, 2), None)):
        out = rule(x).numpy()
        assert np.isnan(out[4]) and np.isfinite(out[:4]).all()
        if reference is not None:
            np.testing.assert_allclose(out, reference, rtol=1e-6)


def test_dense_formulas_in_raw_torch_match_the_keras_ops_ones(monkeypatch):
    from keras import ops

    from pergrad.layer_rules import dense

    rng = np.random.default_rng(2)
    shapes = ((6, 4), (6, 3), (6,))
    a, d, w = (ops.convert_to_tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes)

    def formulas():
        return [ops.convert_to_numpy(t) for t in (
            dense.outer_squared_norms(a, d), dense.outer_weighted_sum(a, d, w),
            dense._bias_squared_norms(d), dense._bias_weighted_sum(d, w))]

    fast = formulas()
    monkeypatch.setattr(dense, "optional_kernel", lambda name: None)
    for mine, reference in zip(fast, formulas()):
        np.testing.assert_allclose(mine, reference, rtol=1e-6)
    # and the closed forms themselves: ||a_i||^2 ||d_i||^2, A^T diag(w) D
    a, d, w = (ops.convert_to_numpy(t) for t in (a, d, w))
    np.testing.assert_allclose(fast[0], (a * a).sum(1) * (d * d).sum(1), rtol=1e-5)
    np.testing.assert_allclose(fast[1], a.T @ (d * w[:, None]), rtol=1e-5, atol=1e-6)


def test_squared_norms_of_wide_rows_are_exact_to_float32_rounding():
    """torch's ``vector_norm`` adds a row's squares in sequence: over a per-example kernel
    gradient of 2M entries it is ~6e-5 off in float32. The adapter's norms, in blocks,
    stay within 1e-6 of the float64 sum."""
    import torch

    from pergrad.backend import torch as adapter

    rows = torch.randn(3, 2_000_003, generator=torch.Generator().manual_seed(0))
    exact = (rows.double() ** 2).sum(1)
    for norms in (adapter.row_squared_norms_2d(rows), adapter.example_squared_norms(rows.reshape(3, -1, 1))):
        assert ((norms.double() - exact).abs() / exact).max() < 1e-6
    assert ((torch.linalg.vector_norm(rows, dim=1).square().double() - exact).abs() / exact).max() > 1e-5


def test_segment_sum_rows_matches_keras_segment_sum():
    import torch
    from keras import ops

    from pergrad.backend import torch as adapter

    rng = np.random.default_rng(5)
    rows = torch.from_numpy(rng.standard_normal((9, 3, 2)).astype(np.float32))
    ids = torch.tensor([0, 4, 4, -1, 2, 5, 0, 7, 4], dtype=torch.int32)  # -1, 5, 7: dropped
    mine = adapter.segment_sum_rows(rows, ids, 5)
    np.testing.assert_allclose(mine.numpy(), ops.segment_sum(rows, ids, num_segments=5).numpy(), rtol=1e-6)
    expected = np.zeros((5, 3, 2), np.float32)
    for row, i in zip(rows.numpy(), ids.tolist()):
        if 0 <= i < 5:
            expected[i] += row
    np.testing.assert_allclose(mine.numpy(), expected, rtol=1e-6)


def test_statistics_helpers_in_raw_torch_match_the_keras_ops_ones(monkeypatch):
    """The torch adapter's example_squared_norms, example_weighted_sum, stack_columns,
    all_finite, flat_norms_2d and clip_factors against the backend-neutral code (the
    adapter's function removed) and a NumPy closed form."""
    import torch
    from keras import ops

    from pergrad.aggregators import basic
    from pergrad.aggregators import example_statistics as statistics
    from pergrad.aggregators.base import report_values
    from pergrad.backend import torch as adapter

    rng = np.random.default_rng(3)
    weights = torch.from_numpy(rng.random(6).astype(np.float32))
    shapes = ((6,), (6, 4), (6, 2, 3, 2))
    grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    squared = torch.from_numpy(rng.random((6, 3)).astype(np.float32) * 4)
    norms = torch.tensor([0.5, 1.0, 2.0, np.inf, np.nan, 0.0])
    stats = statistics.ExampleStatistics(squared)
    clip = basic.Clip(1.0)

    def computed():
        out = [statistics.example_squared_norms(g) for g in grads]
        out += [statistics.example_weighted_sum(g, weights) for g in grads]
        out += [statistics.example_weighted_sum(grads[1].to(torch.bfloat16), weights)]  # promoted
        out += [statistics.stack_columns([g.reshape(6, -1)[:, 0] for g in grads]), stats.flat_norms]
        out += list(basic._factors_and_count(norms, 1.0)) + [clip.clip_factors(stats)]
        reports = report_values(clip.map_reports(stats, 6))
        finite = statistics.overflow_safe(squared, lambda: "rescaled")
        infinite = statistics.overflow_safe(squared * np.inf, lambda: "rescaled")
        return [ops.convert_to_numpy(t) for t in out] + [reports["clipped_fraction"], finite[1], infinite]

    fast = computed()
    for name in ("example_squared_norms", "example_weighted_sum", "stack_columns", "flat_norms_2d",
                 "clip_factors"):
        monkeypatch.delattr(adapter, name)
    monkeypatch.setattr(statistics, "eager", lambda: False)  # overflow_safe by ops.cond
    reference = computed()
    for mine, theirs in zip(fast[:-3], reference[:-3]):
        assert mine.dtype == theirs.dtype
        np.testing.assert_allclose(mine, theirs, rtol=1e-6)
    assert float(fast[-3]) == pytest.approx(float(reference[-3]))
    assert fast[-2] is None and fast[-1] == "rescaled" == reference[-1]
    # the closed forms
    g = [t.numpy() for t in grads]
    for k, t in enumerate(g):
        np.testing.assert_allclose(fast[k], (t.reshape(6, -1) ** 2).sum(1), rtol=1e-5)
        np.testing.assert_allclose(fast[3 + k], np.tensordot(weights.numpy(), t, axes=1), rtol=1e-5)
    np.testing.assert_allclose(fast[8], np.sqrt(squared.numpy().sum(1)), rtol=1e-6)
    np.testing.assert_allclose(fast[9], [1.0, 1.0, 0.5, 0.0, np.nan, 1.0])
    assert float(fast[10]) == 2.0  # 2 and inf exceed 1 (NaN does not)
    clipped = np.sqrt(squared.numpy().sum(1)) > 1.0
    assert float(fast[-3]) == pytest.approx(clipped.mean())


def test_token_squared_norms_match_the_token_pairs_formula(monkeypatch):
    """The sorted-ids embedding norm against the token pairs' formula (the adapter function
    removed) and the formed tables' closed form, with repeated ids within and across
    examples, an id repeated at every position, and non-contiguous D."""
    import torch
    from keras import ops

    from pergrad.backend import torch as adapter
    from pergrad.layer_rules.embedding import EmbeddingRule

    rng = np.random.default_rng(4)
    ids = rng.integers(0, 5, size=(6, 9)).astype(np.int32)
    ids[3] = 2  # one id at every position
    d = rng.standard_normal((6, 4, 9)).astype(np.float32).transpose(0, 2, 1)  # (6, 9, 4), strided
    ids_t, d_t = torch.from_numpy(ids), torch.from_numpy(d)
    assert not d_t.is_contiguous()
    mine = adapter.token_squared_norms(ids_t, d_t).numpy()
    tables = np.zeros((6, 5, 4), np.float64)
    for b in range(6):
        for t in range(9):
            tables[b, ids[b, t]] += d[b, t]
    np.testing.assert_allclose(mine, (tables ** 2).sum((1, 2)), rtol=1e-5)
    layer = keras.layers.Embedding(5, 4)
    rule = EmbeddingRule()
    (fast,) = rule.squared_norms(layer, [], ids_t, d_t)
    monkeypatch.delattr(adapter, "token_squared_norms")
    (pairs,) = rule.squared_norms(layer, [], ids_t, d_t)
    np.testing.assert_allclose(ops.convert_to_numpy(fast), ops.convert_to_numpy(pairs), rtol=1e-5)


def test_outer_per_example_and_flattened_einsum_kernels_match_the_einsum(monkeypatch):
    """``A_i^T D_i`` by one batched matmul (strided and mixed-dtype operands) and the
    EinsumDense kernel gradients that reduce to it (the attention projections' equations)
    against the einsum they replace; an equation that does not reduce keeps the einsum."""
    import torch
    from keras import ops

    from pergrad.backend import torch as adapter
    from pergrad.layer_rules import einsum_dense

    rng = np.random.default_rng(6)
    a = torch.from_numpy(rng.standard_normal((3, 6, 5)).astype(np.float32)).transpose(1, 2)  # (3, 5, 6)
    d = torch.from_numpy(rng.standard_normal((3, 5, 4)).astype(np.float64))
    np.testing.assert_allclose(adapter.outer_per_example(a, d).numpy(),
                               np.einsum("bni,bno->bio", a.numpy(), d.numpy()), rtol=1e-6)
    assert einsum_dense._positions("abc", "cde", "abde") == 2  # query/key/value
    assert einsum_dense._positions("abcd", "cde", "abe") == 2  # the output projection
    assert einsum_dense._positions("ab", "bc", "ac") == 1
    assert einsum_dense._positions("abc", "dce", "abde") is None  # kernel axes out of order
    assert einsum_dense._positions("abc", "ce", "ae") is None  # a position summed over
    for equation, x_shape, output_shape in (("abc,cde->abde", (3, 5, 4), (3, 5, 2, 3)),
                                            ("abcd,cde->abe", (3, 5, 2, 3), (3, 5, 4)),
                                            ("ab,bc->ac", (3, 4), (3, 6)),
                                            ("abc,dce->abde", (3, 5, 4), (3, 5, 2, 6))):
        layer = keras.layers.EinsumDense(equation, output_shape[1:], bias_axes=None)
        layer.build(x_shape)
        x = ops.convert_to_tensor(rng.standard_normal(x_shape).astype(np.float32))
        delta = ops.convert_to_tensor(rng.standard_normal(output_shape).astype(np.float32))
        (fast,) = einsum_dense.EinsumDenseRule().per_example(layer, [], x, delta)
        with monkeypatch.context() as patch:
            patch.delattr(adapter, "outer_per_example")
            (reference,) = einsum_dense.EinsumDenseRule().per_example(layer, [], x, delta)
        assert tuple(fast.shape) == (3,) + tuple(layer.kernel.shape)
        np.testing.assert_allclose(ops.convert_to_numpy(fast), ops.convert_to_numpy(reference),
                                   rtol=1e-5, atol=1e-6)
