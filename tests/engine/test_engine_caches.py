"""The engine's caches are pergrad's own objects: nothing in the user's model, nothing kept alive.

Run once per backend: ``KERAS_BACKEND=torch pytest tests/engine/test_engine_caches.py``.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pergrad
import problems


def test_the_standalone_functions_write_nothing_into_the_model_and_do_not_keep_it_alive():
    problem = problems.dense_mlp()
    problem.compile()
    model = problem.model
    before = set(vars(model))
    first = pergrad.per_example_gradients(model, problem.x, problem.y)
    pergrad.per_example_statistics(model, problem.x, problem.y)
    again = pergrad.per_example_gradients(model, problem.x, problem.y)  # served by the cache
    assert set(vars(model)) == before
    for a, b in zip(first, again):
        assert tuple(a.shape) == tuple(b.shape)
    alive = weakref.ref(model)
    del model, problem, first, again
    gc.collect()
    assert alive() is None


def test_fallback_warnings_are_logged_once_per_problem(caplog):
    from pergrad.log import warn_once

    class Owner:
        pass

    one, other = Owner(), Owner()
    with caplog.at_level(logging.WARNING, logger="pergrad"):
        for _ in range(2):
            warn_once(one, "a reason")
            warn_once(other, "a reason")
        warn_once(one, "another reason")
    assert caplog.text.count("pergrad: a reason.") == 2
    assert caplog.text.count("pergrad: another reason.") == 1


def test_compiled_functions_are_keyed_on_the_variables_the_problem_and_their_options():
    """``engine.problem.compiled_once``, the cache of every standalone function: a freeze
    selects another function and an unfreeze the first again; a recompile another problem."""
    from pergrad.engine.problem import cached_problem, compiled_once

    problem = problems.dense_mlp()
    problem.compile()
    model = problem.model
    owner = cached_problem(model, None, True)

    def pure(trainable_values, non_trainable_values, x, y, sample_weight):
        return trainable_values

    first = compiled_once(owner, "kind", pure, 1)
    assert compiled_once(owner, "kind", lambda *args: None, 1) is first  # the key's first
    assert compiled_once(owner, "kind", pure, 2) is not first
    assert compiled_once(owner, "other kind", pure, 1) is not first
    model.layers[0].trainable = False
    assert compiled_once(owner, "kind", pure, 1) is not first
    statistics = pergrad.per_example_statistics(model, problem.x, problem.y)
    assert statistics.squared_norms.shape[1] == len(model.trainable_variables)
    model.layers[0].trainable = True
    assert compiled_once(owner, "kind", pure, 1) is first
    problem.compile()
    assert cached_problem(model, None, True) is not owner
