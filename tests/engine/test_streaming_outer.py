"""The streaming path's median, trimmed mean and MeaMed from a ``Dense`` kernel's factors.

On torch (whose adapter has ``outer_rank_sums``), a 2-D input's kernel rows
``a_j ⊗ d_j`` reach the median, the trimmed mean and MeaMed as
:class:`~pergrad.layer_rules.dense.OuterRows`, never formed whole: the result must be,
bit for bit, the one from the formed rows (the path without them), with clipping
weights, LoRA, NaN and infinite values, zeros of both signs, odd and even batches. On
the other backends nothing changes.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
import problems
from pergrad.aggregators import (
    bucketing,
    chain,
    clip,
    meamed,
    median,
    norm_filter,
    sign_majority,
    trimmed_mean,
)
from pergrad.backend import adapter
from pergrad.engine import PerExampleProblem, streaming
from pergrad.layer_rules.dense import OuterRows

TORCH = keras.backend.backend() == "torch"

RULES = {
    "median": median,
    "trimmed_mean": lambda: trimmed_mean(0.2),
    "clip_median": lambda: chain(clip(0.05), median()),
    "clip_per_layer_trimmed": lambda: chain(clip(0.05, per_layer=True), trimmed_mean(0.2)),
    "filter_median": lambda: chain(norm_filter(drop_fraction=0.2), median()),
    "meamed": lambda: meamed(0.2),
    "clip_meamed": lambda: chain(clip(0.05), meamed(0.34)),
}


def _bits(x):
    x = np.ascontiguousarray(oracle.to_numpy(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.fixture(autouse=True)
def _kernels_in_parts(monkeypatch):
    """Kernels large enough to be given in parts (below ``EAGER_PIECE_BYTES`` the layers
    give them whole, formed, without asking the rule)."""
    monkeypatch.setattr(streaming, "EAGER_PIECE_BYTES", 64)


def _aggregate(problem, rule, x=None):
    engine = PerExampleProblem(problem.model, training=True)
    trainable = [v.value for v in problem.model.trainable_variables]
    states = [v.value for v in problem.model.non_trainable_variables]
    x = problem.x if x is None else x
    outcome, aux = streaming.aggregate(engine, rule, trainable, states, x, problem.y, problem.sample_weight)
    return outcome.gradients, aux


def _counting(monkeypatch, formed=False):
    """Counts the adapter's ``outer_rank_sums`` and ``outer_meamed`` calls and forbids
    forming ``OuterRows`` (unless ``formed``)."""
    calls = []

    def counted(original):
        def function(*args, **kwargs):
            calls.append(args[0].shape)
            return original(*args, **kwargs)
        return function

    def refuse(self, *args):
        raise AssertionError("OuterRows formed")

    for name in ("outer_rank_sums", "outer_meamed"):
        monkeypatch.setattr(adapter(), name, counted(getattr(adapter(), name)))
    if not formed:
        monkeypatch.setattr(OuterRows, "formed", refuse)
    return calls


def _zeros_of_both_signs(x):
    x = np.array(x)
    x[: len(x) // 2 + 1, 0] = 0.0
    x[len(x) // 2 + 1 :, 0] = -0.0
    x[1::2, 1] = -0.0
    return x


CASES = {
    "plain": lambda problem: None,
    "signed zeros": lambda problem: _zeros_of_both_signs(problem.x),
    "non-finite": lambda problem: np.where(np.arange(problem.x.size).reshape(problem.x.shape) == 3,
                                           np.inf, problem.x).astype("float32"),
}


@pytest.mark.skipif(not TORCH, reason="the torch adapter's outer_rank_sums")
@pytest.mark.parametrize("batch", [problems.BATCH, 7])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_kernels_factors_give_the_formed_rows_result_bit_for_bit(rule, case, batch, monkeypatch):
    results = []
    for outer in (False, True):
        problem = problems.make("dense_mlp", batch=batch)
        problem.compile()
        with monkeypatch.context() as patch:
            if outer:
                calls = _counting(patch)
            else:
                patch.setattr(streaming, "_takes_factors", lambda final: False)
            results.append(_aggregate(problem, RULES[rule](), CASES[case](problem)))
    assert len(calls) == 2  # both Dense kernels, neither formed
    (expected, expected_aux), (result, aux) = results
    for r, e in zip(result, expected):
        np.testing.assert_array_equal(_bits(r), _bits(e))
    assert bool(oracle.to_numpy(aux["finite"])) == bool(oracle.to_numpy(expected_aux["finite"]))
    assert bool(oracle.to_numpy(aux["finite"])) == (case != "non-finite")
    if case == "non-finite" and rule != "filter_median":  # (the filter drops that example)
        assert any(np.isnan(oracle.to_numpy(r)).any() for r in result)


@pytest.mark.skipif(not TORCH, reason="the torch adapter's outer_rank_sums")
@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "meamed"])
def test_lora_factors_and_their_finiteness_give_the_formed_rows_result(rule, monkeypatch):
    """LoRA's ``A`` and ``B`` as factors too: the layers' checks do not cover them, their
    finiteness comes from the factors. (On torch ``A``'s ``d`` and ``B``'s ``a`` need
    gradients, from each other's values: the adapter declines them, as ``rank_sums`` the
    formed rows, and they are formed, whole as before.)"""
    for infinite in (False, True):
        results = []
        for outer in (False, True):
            problem = problems.make("lora")
            problem.compile()
            x = np.array(problem.x)
            if infinite:
                x[2, 1, 3] = np.inf
            with monkeypatch.context() as patch:
                if outer:
                    calls = _counting(patch, formed=True)
                else:
                    patch.setattr(streaming, "_takes_factors", lambda final: False)
                results.append(_aggregate(problem, RULES[rule](), x))
        assert len(calls) == 3  # the 2-D input's LoRA pair, the head's kernel
        (expected, expected_aux), (result, aux) = results
        for r, e in zip(result, expected):
            np.testing.assert_array_equal(_bits(r), _bits(e))
        assert bool(oracle.to_numpy(aux["finite"])) is bool(oracle.to_numpy(expected_aux["finite"]))
        assert bool(oracle.to_numpy(aux["finite"])) is not infinite


@pytest.mark.skipif(not TORCH, reason="the torch adapter's outer_rank_sums")
def test_factors_the_adapter_declines_are_formed_in_the_eager_parts(monkeypatch):
    """Where ``outer_rank_sums`` cannot (another device, a dtype NumPy lacks), the rows are
    formed in the parts ``EAGER_PIECE_BYTES`` gives them: the result is unchanged."""
    widths = []
    original = OuterRows.formed

    def recording(self):
        widths.append(self.a.shape[1])
        return original(self)

    results = []
    for declined in (False, True):
        problem = problems.make("dense_mlp")
        problem.compile()
        with monkeypatch.context() as patch:
            if declined:
                patch.setattr(adapter(), "outer_rank_sums", lambda *args, **kwargs: None)
                patch.setattr(OuterRows, "formed", recording)
            results.append(_aggregate(problem, median())[0])
    assert widths and max(widths) < 5, widths  # the first kernel (5 inputs) in parts
    for r, e in zip(*results):
        np.testing.assert_array_equal(_bits(r), _bits(e))


def _refuse_factors(self, *args):
    raise AssertionError("OuterRows made")


@pytest.mark.parametrize("name, rule", [("dense_mlp", "sign_majority"), ("dense_mlp", "bucketing_median"),
                                        ("dense_sequence", "median"), ("dense_mlp", "median")])
def test_other_rules_orders_and_backends_get_formed_rows(name, rule, monkeypatch):
    """Sign majority, a bucketing's order and the compiled backends get formed rows (an
    eager backend's kernels in parts); a sequence input's kernels are formed, a 2-D one's
    (the last layer) factored on torch. Each is the materialized path's result."""
    make = {"sign_majority": sign_majority, "median": median,
            "bucketing_median": lambda: bucketing(2, median(), seed=3)}
    factors = []
    if (rule != "median" or not TORCH):
        monkeypatch.setattr(OuterRows, "__init__", _refuse_factors)
    else:
        original = OuterRows.__init__

        def recording(self, a, *args):
            factors.append(a)
            original(self, a, *args)

        monkeypatch.setattr(OuterRows, "__init__", recording)
    problem = problems.make(name)
    problem.compile()
    grads = [ops.convert_to_tensor(g) for g in pergrad.per_example_gradients(
        problem.model, problem.x, problem.y, problem.sample_weight)]
    result, _ = _aggregate(problem, make[rule]())
    expected = make[rule]()(grads)
    oracle.assert_gradients_close([oracle.to_numpy(r) for r in result],
                                  [oracle.to_numpy(e) for e in expected], rtol=1e-5, atol=1e-5)
    if rule == "median" and TORCH:
        assert [a.shape[1] for a in factors] == ([5, 4] if name == "dense_mlp" else [6])


def test_the_factor_rules_are_the_median_and_the_trimmed_mean_by_their_own_method():
    """The median, trimmed mean and MeaMed declare that their ``aggregate_variable`` takes
    factors; a subclass with its own ``aggregate_variable`` and other rules do not."""
    class Lowered(type(median())):
        def aggregate_variable(self, gradient):
            return super().aggregate_variable(gradient) - 1.0

    class Renamed(type(trimmed_mean())):
        pass

    assert streaming._takes_factors(median()) is TORCH
    assert streaming._takes_factors(trimmed_mean(0.1)) is TORCH
    assert streaming._takes_factors(Renamed(0.1)) is TORCH  # its parent's method
    assert streaming._takes_factors(meamed(0.2)) is TORCH
    assert not streaming._takes_factors(Lowered())
    assert not streaming._takes_factors(sign_majority())


@pytest.mark.skipif(not TORCH, reason="the torch adapter's outer_rank_sums")
def test_microbatches_get_the_factors_too(monkeypatch):
    """With ``microbatch_size`` (blocks of the formed kernel elsewhere) torch's median also
    selects from the factors: the result is the formed blocks' (the materialized path's)."""
    results = []
    for path, microbatch in (("materialized", None), ("auto", 2)):
        problem = problems.make("dense_mlp")
        wrapper = pergrad.PerExampleModel(problem.model, chain(clip(0.05), median()), path=path,
                                          microbatch_size=microbatch)
        problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.3))
        with monkeypatch.context() as patch:
            if path == "auto":
                calls = _counting(patch)
                patch.setattr(PerExampleProblem, "compute", _refuse)
            wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=problems.BATCH,
                        epochs=2, shuffle=False, verbose=0)
        results.append(wrapper.model)
    assert len(calls) == 2 * 2  # two kernels, two steps
    oracle.assert_weights_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def _refuse(*args, **kwargs):
    raise AssertionError("the streaming path built the model's materialized per-example gradients")
