"""Adapter functions shared by the backends where one process runs one replica (JAX, torch)."""


def replica_id():
    """0: no replica runs the train step on its own part of the batch."""
    return 0


def all_gather(value):
    """``value``: a single replica."""
    return value


def all_reduce_sum(value):
    """``value``: a single replica."""
    return value


def unscale_loss(loss):
    """``loss``: Keras scales losses for replicas on TensorFlow only."""
    return loss
