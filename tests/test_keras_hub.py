"""keras-hub's architectures through pergrad, built from constructor arguments (tiny configs,
random weights, nothing downloaded), and keras.io's transformer.

Per architecture: the per-example gradients equal the batch-of-one oracle and their mean
the batch gradient; the statistics path's norms equal theirs with no layer on the fallback;
clipping trains on the statistics path (never the model's per-example gradients) as on the
materialized path. ``mean`` trains as plain ``fit()``; LoRA fine-tuning with DP-SGD takes
the statistics path. (keras-hub's layers alone are among the shared problems.)
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest

import oracle
import pergrad
import problems
from pergrad.aggregators import ExampleStatistics, clip
from pergrad.engine import PerExampleProblem
from pergrad.layer_rules.embedding import ReversibleEmbeddingRule
from pergrad.privacy import dp_gaussian

pytest.importorskip("keras_hub")

B = problems.BATCH
ARCHITECTURES = ["bert_classifier", "gpt2_lm", "llama_lm", "vit_classifier"]


def _refuse(*args, **kwargs):
    raise AssertionError("the statistics path built the materialized per-example gradients")


def _fit(problem, aggregator, path, epochs=1):
    wrapper = pergrad.PerExampleModel(problem.model, aggregator, path=path)
    problem.compile(wrapper, optimizer=keras.optimizers.SGD(0.5))
    wrapper.fit(problem.x, problem.y, sample_weight=problem.sample_weight, batch_size=B, epochs=epochs,
                shuffle=False, verbose=0)
    return wrapper


def _refuse_tables(*args, **kwargs):
    raise AssertionError("the statistics path formed a per-example embedding table (B x vocabulary x d)")


def _trains_on_the_statistics_path_as_on_the_materialized_path(make, aggregator, monkeypatch, caplog):
    reference = _fit(make(), aggregator(), "materialized")
    problem = make()
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="pergrad"):
        patch.setattr(PerExampleProblem, "compute", _refuse)
        # Token embeddings and LM heads (GPT-2's tied) take their formulas at these shapes.
        patch.setattr(ReversibleEmbeddingRule, "per_example", _refuse_tables)
        wrapper = _fit(problem, aggregator(), "statistics")
    assert "no layer rule" not in caplog.text, caplog.text
    oracle.assert_weights_close(wrapper.model, reference.model, atol=1e-5, rtol=1e-5)
    start = make().model.get_weights()
    moved = max(float(np.abs(a - b).max()) for a, b in zip(wrapper.model.get_weights(), start))
    assert moved > 1e-4, "training did not move the weights: the comparison is vacuous"
    return wrapper


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_layer_takes_the_statistics_path_exactly(name, monkeypatch, caplog):
    problem = problems.make(name)
    problem.compile()
    model, x, y, weights = problem.model, problem.x, problem.y, problem.sample_weight
    grads = pergrad.per_example_gradients(model, x, y, weights)
    oracle.assert_gradients_close(grads, oracle.batch_of_one_gradients(model, x, y, weights),
                                  what="per-example gradient")
    oracle.assert_gradients_close([oracle.to_numpy(g).mean(axis=0) for g in grads],
                                  oracle.batch_gradient(model, x, y, weights), what="mean")
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        stats = pergrad.per_example_statistics(model, x, y, weights)
    assert "no layer rule" not in caplog.text and "materialized path" not in caplog.text, caplog.text
    reference = oracle.to_numpy(ExampleStatistics.from_gradients(grads).squared_norms)
    np.testing.assert_allclose(oracle.to_numpy(stats.squared_norms), reference, rtol=1e-5,
                               atol=1e-5 * max(1.0, float(np.abs(reference).max())))
    _trains_on_the_statistics_path_as_on_the_materialized_path(
        problems.KERAS_HUB_MODELS[name], lambda: clip(0.05), monkeypatch, caplog
    )


def test_mean_trains_like_plain_fit():
    """GPT-2: a per-token loss with weights, padded examples, the tied head."""
    factory = problems.gpt2_lm
    _, plain, _, wrapper, _ = oracle.fit_both(
        factory, fit_kwargs={"batch_size": B, "epochs": 1, "sample_weight": factory().sample_weight}
    )
    oracle.assert_weights_close(wrapper.model, plain, atol=1e-5, rtol=1e-5)


def _lora_lm():
    problem = problems.gpt2_lm()
    problem.model.backbone.enable_lora(2)
    rng = np.random.default_rng(5)
    for variable in problem.model.trainable_variables:  # B starts at zero: make A's gradient count
        if variable.path.endswith("lora_kernel_b"):
            variable.assign(rng.normal(size=variable.shape).astype("float32"))
    return problem


def test_lora_fine_tuning_with_dp_sgd_takes_the_statistics_path(monkeypatch, caplog):
    """Only the LoRA factors (and the layers keras-hub leaves trainable) are trained; without
    noise DP-SGD equals the materialized path, with noise it runs there too."""
    problem = _lora_lm()
    names = [v.path for v in problem.model.trainable_variables]
    assert any(n.endswith("lora_kernel_a") for n in names), names
    assert not any(n.endswith("query/kernel") for n in names), names  # frozen by enable_lora
    _trains_on_the_statistics_path_as_on_the_materialized_path(
        _lora_lm, lambda: dp_gaussian(0.05, 0.0, expected_batch_size=B), monkeypatch, caplog
    )
    problem = _lora_lm()
    frozen = {v.path: v.numpy() for v in problem.model.non_trainable_variables}
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="pergrad"):
        patch.setattr(PerExampleProblem, "compute", _refuse)
        wrapper = _fit(problem, dp_gaussian(0.05, 1.0, expected_batch_size=B), "statistics")
    assert "no layer rule" not in caplog.text, caplog.text
    assert all(np.all(np.isfinite(w)) for w in wrapper.model.get_weights())
    for v in wrapper.model.non_trainable_variables:
        np.testing.assert_array_equal(v.numpy(), frozen[v.path], err_msg=v.path)


def test_the_keras_io_transformer_with_dropout_takes_the_statistics_path(monkeypatch, caplog):
    """As published (dropout 0.1): every example keeps its own dropout stream on both paths."""
    _trains_on_the_statistics_path_as_on_the_materialized_path(
        lambda: problems.text_transformer(rate=0.1), lambda: clip(0.05), monkeypatch, caplog
    )
