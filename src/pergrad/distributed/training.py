"""The hand-off between pergrad's training and ``pergrad.distributed``.

``PerExampleModel``, its trainers and its train step ask this module what several
devices change, and nothing else of the package (the samplers and the DP key ask
``processes``, the hosts): the collectives a step calls (:func:`collectives`: the
identity on one device), what is refused before a fit or a step, and how many parts
``fit()`` splits a batch into (docs/multi-device.md).
"""

from __future__ import annotations

import keras
from keras import ops, tree

from pergrad.aggregators.base import LOCAL_MEAN, WHOLE_BATCH
from pergrad.distributed import layouts, processes, replicas
from pergrad.distributed.replicas import batch_shards
from pergrad.engine.collectives import ONE_DEVICE, Collectives
from pergrad.engine.paths import CHUNKED_PATH, engine_path

__all__ = ["batch_shards", "check_fit", "check_replicas", "collectives", "may_skip_updates", "refusal",
           "replicated", "whole_batch_size"]

#: What runs several replicas of the train step, per backend (for error messages).
_REPLICA_ENGINES = {
    "tensorflow": "a tf.distribute strategy",
    "torch": "a torch.distributed process group (Keras's torch fit() does not "
    "synchronize gradients across processes)",
}


def collectives(wrapper, x, loss_scale) -> Collectives:
    """The collectives of ``wrapper``'s step on batch ``x`` (``loss_scale``: the optimizer's,
    or ``None``), as its rule's ``distribution`` says: on several replicas each aggregates
    its shard, scaled by its share of the batch unless the rule sums, or the rule runs on
    the whole batch, gathered; one program over several devices lays rows out; one device
    calls none."""
    if replicas.count(wrapper) <= 1:
        return ONE_DEVICE if layouts.data_parallel() is None else layouts.DataParallel()
    distribution = wrapper.aggregator.distribution
    divides = distribution == LOCAL_MEAN
    fraction = None
    if divides or loss_scale is not None:
        fraction = replicas.local_fraction(ops.shape(tree.flatten(x)[0])[0])  # B_r / B
    kind = replicas.GatheredReplicas if distribution == WHOLE_BATCH else replicas.Replicas
    return kind(fraction, divides)


def replicated(model) -> bool:
    """Whether several replicas each run ``model``'s train step (``tf.distribute``)."""
    return replicas.count(model) > 1


def may_skip_updates(model) -> bool:
    """Whether ``model``'s step may leave its optimizer update out (a ``cond``): not on
    several replicas, whose optimizer's all-reduce cannot run in one
    (``PrivacyAccountant`` refuses a budget with ``steps_per_execution > 1`` there)."""
    return not replicated(model)


def refusal(wrapper) -> str | None:
    """Why ``wrapper`` (a ``PerExampleModel``) cannot train exactly on several replicas
    that each run the step, or ``None``."""
    chunked = engine_path(wrapper.aggregator, wrapper.engine_path, wrapper.microbatch_size) == CHUNKED_PATH
    return replicas.refusal(wrapper, chunked)


def check_replicas(model) -> None:
    """Refuses a step that each of several replicas would run on its own part of the
    batch where its result would not be the single-device one."""
    count = replicas.count(model)
    if count <= 1:
        return
    reason = refusal(model)
    if reason is None:  # exact on TF
        return
    engine = _REPLICA_ENGINES.get(keras.backend.backend(), "a distribution")
    raise ValueError(
        f"PerExampleModel cannot train under {engine} with {count} replicas: "
        f"{reason}. Train on one device (or a single-replica strategy), or use the JAX "
        "backend with keras.distribution.DataParallel, which keeps single-device results "
        "exactly."
    )


def whole_batch_size(model, x):
    """The size of the batch ``model``'s rule sees where several replicas each run the
    step on their shard of ``x`` (the shards' sizes summed, a tensor), else ``None``."""
    if not replicated(model):
        return None
    return replicas.global_size(ops.shape(tree.flatten(x)[0])[0])


def check_fit(model, sampled: bool, callbacks) -> None:
    """Raises, before the first step, for a ``fit`` of ``model`` on several hosts or
    replicas that could not keep the single-device result or the privacy guarantee
    (``sampled``: whether the data is a ``pergrad.privacy.PoissonSampler``)."""
    processes.check_fit(model, sampled)
    if replicated(model):
        from pergrad.privacy.callbacks import check_budget_on_replicas

        check_budget_on_replicas(model, callbacks)
