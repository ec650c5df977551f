"""``train_step`` glue of ``PerExampleModel``, one mixin per kind of Keras trainer.

Keras picks a trainer base class per backend (``keras/src/backend/<name>/trainer.py``):
JAX's ``train_step(state, data)`` is stateless (variable values go in and out),
TensorFlow's and torch's ``train_step(data)`` assign variables. Each mixin calls
the backend-neutral step (``PerExampleModel._aggregated_gradients``, i.e.
``pergrad.training.step.aggregated_gradients``) and hands its gradients to the optimizer
the way its trainer expects. ``keras`` only: no backend is imported here.
"""

from __future__ import annotations

import keras
from keras import ops, tree

from pergrad import compat
from pergrad.aggregators.base import split_units
from pergrad.backend import adapter, optional_kernel
from pergrad.distributed import training


def update_mean(metric, value, sample_weight=None) -> None:
    """``metric.update_state(value, sample_weight=sample_weight)`` for a Keras ``Mean`` and
    a scalar ``value``: by the adapter's in-place ``add_to_mean`` where it has one (eager
    torch: a few microseconds where Keras's update costs ~40 a step) and it computes the
    same (Keras's own ``update_state``, a Python number or no ``sample_weight``, no mask,
    outside a ``StatelessScope``), else by ``update_state``."""
    fast = optional_kernel("add_to_mean")
    weight = 1 if sample_weight is None else sample_weight
    if (fast is None or type(metric).update_state is not keras.metrics.Mean.update_state
            or not isinstance(weight, (int, float)) or tuple(getattr(value, "shape", (None,))) != ()
            or compat.get_mask(value) is not None or compat.in_stateless_scope()):
        metric.update_state(value, sample_weight=sample_weight)
        return
    fast(metric.total, metric.count, value, weight)


class StepMean(keras.metrics.Mean):
    """The ``Mean`` that logs a rule's diagnostic (one scalar a step, :func:`update_mean`),
    its result read by the adapter's ``mean_result`` where it has one (eager torch: Keras
    reads every metric's result every step)."""

    def result(self):
        fast = optional_kernel("mean_result")
        if fast is None or compat.in_stateless_scope():
            return super().result()
        return fast(self.total, self.count)


class _StepLimit:
    def _update_allowed(self):
        """The rule's ``update_allowed()``, read before the step counts itself, where Keras runs
        several steps without calling back (``steps_per_execution > 1``; between single
        steps ``PrivacyAccountant`` stops training itself); ``None`` otherwise."""
        if getattr(self, "steps_per_execution", 1) <= 1 or not training.may_skip_updates(self):
            return None
        return self.aggregator.update_allowed()


class StatelessTrainStep(_StepLimit):
    """JAX: ``train_step(state, data)`` over the state's arrays."""

    def make_train_function(self, force=False):
        # fit() calls this once it has built the optimizer, before it empties the variables.
        self.__dict__["_held_values"] = compat.held_values(
            self.trainable_variables + self.non_trainable_variables
            + list(self.optimizer.variables) + self.metrics_variables
        )
        return super().make_train_function(force)

    def fit(self, *args, **kwargs):
        # Keras's JAX fit() empties the variables while its steps run and puts the latest
        # state back at the end; when the first step fails (a refusal, raised while the
        # step is traced) there is none, and the model could no longer predict. The
        # variables get back the arrays they held (the same buffers as the steps' state:
        # no extra memory; a step that ran consumed them).
        try:
            return super().fit(*args, **kwargs)
        except BaseException:
            compat.refill_emptied(self.__dict__.get("_held_values", ()))
            raise
        finally:
            self.__dict__.pop("_held_values", None)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, units = split_units(x)  # the ids reach the rule only
        # Keras's JAX fit() empties the variables: the check's forward pass reads
        # the values of the state instead (and any assignment is dropped).
        values = list(zip(self.trainable_variables, trainable))
        values += list(zip(self.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=values):
            self._check_batch(x, y)
        inner = self._inner_non_trainable_positions()
        mapping = list(zip(self.non_trainable_variables, non_trainable))
        # The optimizer's too: a LossScaleOptimizer's scale is read from its state.
        mapping += list(zip(self.optimizer.variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            allowed = self._update_allowed()
            grads, y_pred, seeds, _ = self._aggregated_gradients(
                trainable, [non_trainable[i] for i in inner], x, y, sample_weight, units
            )
        non_trainable = [
            scope.get_current_value(v) if scope.get_current_value(v) is not None else value
            for v, value in zip(self.non_trainable_variables, non_trainable)
        ]
        for position, state_value in zip(self.per_example_problem().seed_positions, seeds):
            non_trainable[inner[position]] = state_value
        loss, (_, non_trainable, metrics_variables) = self.stateless_compute_loss(
            trainable,
            non_trainable,
            metrics_variables,
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=True,
        )
        updated = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        if allowed is not None:  # a refused step leaves the weights and the optimizer as they were
            updated = tree.map_structure(lambda new, old: ops.where(allowed, new, old), updated,
                                         (trainable, optimizer_variables))
        trainable, optimizer_variables = updated
        logs, metrics_variables = compat.update_metrics_variables(
            self, metrics_variables, loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    def _inner_non_trainable_positions(self) -> list[int]:
        """Positions of the wrapped model's non-trainable variables among the wrapper's."""
        ids = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        return [ids[id(v)] for v in self.model.non_trainable_variables]


class StatefulTrainStep(_StepLimit):
    """TensorFlow and torch: ``train_step(data)`` that assigns the variables."""

    def train_step(self, data):
        with compat.one_read_per_step():  # (eager torch: a dozen reads of each list a step)
            return self._train_step(data)

    def _train_step(self, data):
        # Also here for custom loops (a replica context of `strategy.run`).
        training.check_replicas(self)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, units = split_units(x)  # the ids reach the rule only
        x = self._check_batch(x, y)
        allowed = self._update_allowed()
        variables = compat.non_trainable_variables(self.model)
        grads, y_pred, seeds, loss = self._aggregated_gradients(
            [v.value for v in compat.trainable_variables(self.model)],
            [v.value for v in variables],
            x,
            y,
            sample_weight,
            units,
        )
        # Each replica's own (kept per thread).
        reports = self.take_reports()
        if seeds:  # (a pass that draws no random numbers advances none)
            for position, state_value in zip(self.per_example_problem().seed_positions, seeds):
                variables[position].assign(state_value)
        # The logged loss is the one plain Keras reports for this batch
        # (before the update, with the same predictions; without the 1 / R
        # Keras's losses carry under a strategy with R replicas, as Keras logs it).
        if loss is None:  # (else the engine's pass computed this same number)
            loss = adapter().unscale_loss(
                self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
            )
        update_mean(compat.loss_tracker(self), loss, sample_weight=ops.shape(tree.flatten(x)[0])[0])
        with adapter().no_grad(after=x):  # after the batch check (TF graphs)
            self._apply(grads, allowed)
        if reports is not None:
            self.keep_reports(reports)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _apply(self, grads, allowed):
        variables = compat.trainable_variables(self.model)
        if allowed is None:
            self.optimizer.apply(grads, variables)
            return
        if not self.optimizer.built:  # (TF: no variable may be created inside the cond)
            self.optimizer.build(variables)

        def apply():
            self.optimizer.apply(grads, variables)

        ops.cond(allowed, apply, lambda: None)


def for_backend(name: str) -> type:
    """The mixin that implements ``train_step`` for Keras backend ``name``."""
    return StatelessTrainStep if name == "jax" else StatefulTrainStep
