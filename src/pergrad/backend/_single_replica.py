"""Adapter functions shared by the backends where one process runs one replica and a step's
shapes are known when it runs (JAX, torch)."""


def replica_id():
    """0: no replica runs the train step on its own part of the batch."""
    return 0


def all_gather(value):
    """``value``: a single replica."""
    return value


def all_reduce_sum(value):
    """``value``: a single replica."""
    return value


def assert_at_least(value, minimum, message, guarded=None):
    """Shapes are always known here (JAX retraces per shape, torch runs eagerly):
    raises at once, before anything is computed, and returns ``guarded``."""
    if int(value) < minimum:
        raise ValueError(message)
    return guarded


def check_known_problems(layers):
    """No known backend problem with any layer."""


def unscale_loss(loss):
    """``loss``: Keras scales losses for replicas on TensorFlow only."""
    return loss
