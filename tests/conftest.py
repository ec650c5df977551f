"""Shared fixtures. The Keras backend is fixed at import: run pytest once per backend."""

from __future__ import annotations

import keras
import pytest

import oracle

BACKEND = keras.backend.backend()


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}"


@pytest.fixture(autouse=True)
def _isolated_keras_state():
    """Every test starts from the same seed and float32 policy, and leaves them so."""
    policy = keras.config.dtype_policy()
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy(policy)
    oracle._JAX_GRADS.clear()
