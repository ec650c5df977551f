"""Models trained concurrently in Python threads: each gets exactly the update it gets alone.

The statistics path's dry run records the variables each layer reads by patching
``StatelessScope.get_current_value``; a patch restored by one thread while another's
dry run ran made that run record nothing, and its layers got zero gradients.

Run once per backend: ``KERAS_BACKEND=jax pytest tests/test_threads.py``.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import numpy as np
import pytest
from keras.src.backend.common.stateless_scope import StatelessScope

import pergrad
from pergrad import aggregators as agg
from pergrad import compat

RULES = {
    "clip": lambda: agg.clip(0.5),
    "krum": lambda: agg.krum(0.1),
    "median": agg.median,
    "geometric_median": agg.geometric_median,
}


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(48, 6)).astype("float32"), rng.integers(0, 3, 48)


def _wrapper(rule, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3),
    ])
    wrapper = pergrad.PerExampleModel(model, RULES[rule]())
    wrapper.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return wrapper


def _fit(wrapper, x, y, errors):
    try:
        wrapper.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    except Exception as error:  # noqa: BLE001 - reported by the test
        errors.append(error)


def test_models_trained_in_threads_get_the_updates_they_get_alone():
    original = StatelessScope.get_current_value
    x, y = _data()
    alone, concurrent = {}, {}
    for seed, rule in enumerate(RULES):
        alone[rule] = _wrapper(rule, seed)
        concurrent[rule] = _wrapper(rule, seed)
    start = {rule: [np.array(w) for w in w.model.get_weights()] for rule, w in alone.items()}
    for rule, wrapper in concurrent.items():  # built from the same seed: the same weights
        for a, b in zip(start[rule], wrapper.model.get_weights()):
            np.testing.assert_array_equal(a, b)

    errors = []
    for wrapper in alone.values():
        _fit(wrapper, x, y, errors)
    threads = [threading.Thread(target=_fit, args=(w, x, y, errors)) for w in concurrent.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors

    for rule in RULES:
        expected, got = alone[rule].model.get_weights(), concurrent[rule].model.get_weights()
        for e, g, s in zip(expected, got, start[rule]):
            assert np.abs(e - s).max() > 1e-4, (rule, "the model did not train")
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=rule)
    # The dry runs' patch is removed once the last one ends: Keras's own method again.
    assert StatelessScope.get_current_value is original


def test_a_dry_run_records_only_its_own_thread():
    """Reads in another thread while a dry run records go to nobody's list."""
    seen, other = [], []
    variable = keras.Variable(np.ones(2, "float32"))
    inside, release = threading.Event(), threading.Event()

    def record():
        with compat.recording_variable_reads(seen.append):
            inside.set()
            release.wait(10)
            with keras.StatelessScope(state_mapping=[(variable, np.zeros(2, "float32"))]):
                _ = variable.value

    thread = threading.Thread(target=record)
    thread.start()
    inside.wait(10)
    with compat.recording_variable_reads(other.append):
        pass  # a second recorder that starts and ends while the first still records
    with keras.StatelessScope(state_mapping=[(variable, np.zeros(2, "float32"))]):
        _ = variable.value  # this thread records nothing: not in `seen`
    release.set()
    thread.join()
    assert [id(v) for v in seen] == [id(variable)]
    assert other == []


def test_an_empty_recording_is_an_error_not_a_zero_gradient(monkeypatch):
    """Should the recording fail, the step raises instead of planning layers that read nothing."""
    monkeypatch.setattr(compat, "recording_variable_reads", lambda record: contextlib.nullcontext())
    x, y = _data()
    wrapper = _wrapper("clip", 0)
    with pytest.raises(RuntimeError, match="recorded no variable read"):
        wrapper.fit(x, y, batch_size=12, epochs=1, verbose=0)
