"""``PerExampleModel``: a Keras model whose ``fit()`` aggregates per-example gradients."""

from __future__ import annotations

import gc
import inspect
import threading

import keras
from keras import ops, tree

from pergrad import aggregators as aggregators_module
from pergrad import compat
from pergrad.aggregators.base import split_units
from pergrad.arguments import check_microbatch_size
from pergrad.backend import adapter
from pergrad.distributed import training
from pergrad.engine import PerExampleProblem, check_model, mean_reduced
from pergrad.training import step, trainers

# JAX's stateless train_step(state, data) or TF's and torch's train_step(data).
_TrainStep = trainers.for_backend(keras.backend.backend())

@keras.saving.register_keras_serializable(package="pergrad")
class PerExampleModel(_TrainStep, keras.Model):
    """Wraps a Keras model so that ``fit()`` combines per-example gradients.

    Each training step computes every example's gradient ``g_i`` of its own loss
    ``L_i`` (with ``mean_i L_i`` the loss plain Keras minimizes), hands them to
    ``aggregator`` and gives the result to the optimizer. Gradients of weight
    regularizers belong to no example: they are computed once and added after
    aggregation. ``compile``, ``fit``, ``evaluate``, ``predict``, callbacks,
    metrics and saving work as for the wrapped model.

    If any example's gradient is not finite, the aggregated gradient is made NaN
    (as the plain mean would be) rather than letting a robust rule hide it:
    training diverges loudly (use ``keras.callbacks.TerminateOnNaN``), and under
    a ``LossScaleOptimizer`` the step is skipped and the loss scale lowered.

    Args:
        model: any built or buildable Keras model (Sequential, functional,
            subclassed; several inputs and outputs allowed).
        aggregator: an aggregator, its name (``"mean"``, ``"median"``, ...) or a
            function ``list[(B, ...)] -> list[(...)]``.
        microbatch_size: work through the batch in chunks of this many
            examples; results are the same up to float rounding (docs/memory.md).
            ``mean``, ``sum`` and statistics rules then take the chunked path
            (``pergrad.engine.chunked``): at most one chunk's per-example
            gradients exist at once, which bounds the peak memory of a model the
            statistics path cannot take. On a model it can take, the default
            statistics path holds no per-example gradient at all, so setting
            ``microbatch_size`` raises the peak (and, for rules that read
            norms, doubles the backward compute). Built-in coordinate rules get
            each Dense kernel in blocks of about that many examples' worth
            (``pergrad.engine.streaming``); arbitrary rules still receive all B
            per-example gradients (only the backward pass is chunked).
        path: the engine path (docs/engine-paths.md).
            ``"auto"`` (default): statistics rules (mean, sum, clipping, DP-SGD,
            Krum, geometric median, norm filter, chains of them) take the
            statistics path (``pergrad.engine.statistics``: no ``B x P``
            per-example tensor, one backward pass) unless ``microbatch_size``
            is set or the model needs the materialized path (the reason is
            logged once); coordinate rules (median, trimmed mean, MeaMed, sign
            majority, ``per_variable`` functions, after clipping, filtering or
            bucketing) take the streaming path (``pergrad.engine.streaming``:
            one variable's per-example gradients at a time); other rules take
            the materialized path.
            ``"statistics"``: the statistics path or an error saying why not.
            ``"materialized"``: every per-example gradient, always (the reference).
    """

    PATHS = ("auto", "statistics", "materialized")

    def __init__(self, model, aggregator="mean", *, microbatch_size: int | None = None,
                 path: str = "auto", **kwargs):
        super().__init__(**kwargs)
        if isinstance(model, PerExampleModel):
            raise ValueError(
                f"Model {model.name!r} is already a PerExampleModel: wrap the Keras model once "
                "(PerExampleModel(keras_model, rule)); to change the rule, wrap its .model."
            )
        self.model = model
        self.aggregator = aggregators_module.get(aggregator)
        self.microbatch_size = check_microbatch_size(microbatch_size)
        if path not in self.PATHS:
            raise ValueError(f"path must be one of {self.PATHS}; got {path!r}.")
        if path == "statistics" and step.engine_path(self.aggregator, path, None) != step.STATISTICS_PATH:
            raise ValueError(
                f"Aggregator {self.aggregator.name!r} ({type(self.aggregator).__name__}) is not "
                "a statistics rule (its result is not a weighted sum of per-example gradients "
                "with weights from their norms and Gram matrix) nor a coordinate rule the "
                "streaming path covers (median, trimmed mean, MeaMed, sign majority, "
                "per_variable functions, after clipping, norm filtering or bucketing), so "
                "it cannot take the statistics path. Use path='auto' or 'materialized'."
            )
        self.engine_path = path  # (`path` is a Keras layer property)
        self._diagnostic_trackers = [
            trainers.StepMean(name=name) for name in self.aggregator.diagnostics
        ]
        self.__dict__["_problem_cache"] = None
        if model.built:
            self.build(None)

    # -- Keras model plumbing ------------------------------------------------------

    def build(self, input_shape=None):
        if not self.model.built:
            self.model.build(split_units(input_shape)[0])
        if not self.aggregator.built:
            shapes = [(None,) + tuple(v.shape) for v in self.model.trainable_variables]
            self.aggregator.build(shapes)
            self.__dict__["_aggregator_shapes"] = shapes
        self.built = True

    def compile(self, optimizer="rmsprop", loss=None, *args, **kwargs):
        """As ``keras.Model.compile``. An unreduced loss (``reduction=None``) is
        used like the default ``"sum_over_batch_size"`` reduction (a copy of it
        with that reduction is compiled): example i's loss is its value averaged
        over the non-batch axes times its weight, and the logged loss is the
        mean reduction's. Plain Keras cannot train an unreduced loss on JAX and
        torch, and on TensorFlow differentiates its sum (B times larger steps).

        Changes to ``trainable`` flags take effect at ``compile()``, as in Keras;
        ``fit()`` refuses to run after such a change until the model is recompiled.
        """
        super().compile(optimizer, mean_reduced(loss), *args, **kwargs)
        self.__dict__["_compiled_trainable"] = self._trainable_flags()

    def compile_from_config(self, config):
        # Keras does not compile a loaded model whose `compile` is overridden;
        # this one only converts the loss, so the stock procedure applies.
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force=False):
        # Python-level, before every fit() and train_on_batch(): on TensorFlow the
        # traced step would otherwise keep using the variables of its first trace.
        if self.model.built:
            check_model(self.model, training=True)
        self._check_trainable_unchanged()
        training.check_replicas(self)
        return super().make_train_function(force)

    def _trainable_flags(self):
        return [(layer, layer.trainable) for layer in compat.flatten_layers(self.model, include_self=True)]

    def _check_trainable_unchanged(self):
        compiled = self.__dict__.get("_compiled_trainable")
        if compiled is None:
            return
        # Layers created after compile() (built lazily) are not compared: a change of
        # theirs comes from a parent's flag, which is.
        before = {id(layer): flag for layer, flag in compiled}
        changed = [
            layer.name
            for layer, flag in self._trainable_flags()
            if before.get(id(layer), flag) != flag
        ]
        if changed:
            raise ValueError(
                f"Layer(s) {changed} changed their `trainable` flag since compile(). "
                "Keras applies such changes only at compile() (plain fit() then ignores "
                "them on TensorFlow and fails or follows them on JAX and torch): call "
                "compile() again before fit() so that the change takes effect."
            )
        shapes = self.__dict__.get("_aggregator_shapes")
        current = [(None,) + tuple(v.shape) for v in self.model.trainable_variables]
        per_variable = any(
            getattr(layer, "state_per_variable", False)
            for layer in compat.flatten_layers(self.aggregator, include_self=True)
        )
        if shapes is not None and per_variable and shapes != current:
            raise ValueError(
                f"Aggregator {self.aggregator.name!r} keeps state for the trainable "
                f"variables the model had when it was built ({len(shapes)}); it now has "
                f"{len(current)} of other shapes. Create a new aggregator and "
                "PerExampleModel after changing which layers are trainable."
            )

    # A batch of pergrad.privacy.UserSampler carries user ids beside the inputs: the
    # wrapped model never sees them (pergrad.aggregators.base.split_units).
    def call(self, inputs, training=None):
        return self.model(split_units(inputs)[0], training=training)

    def compute_output_spec(self, inputs, training=None):
        return self.model.compute_output_spec(split_units(inputs)[0])

    def get_config(self):
        config = super().get_config()
        config.update(
            model=keras.saving.serialize_keras_object(self.model),
            aggregator=keras.saving.serialize_keras_object(self.aggregator),
            microbatch_size=self.microbatch_size,
            path=self.engine_path,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # Registers the DP rules (DPGaussian, AdaptiveDPGaussian, BandedMFGaussian,
        # UserLevelDPGaussian) for keras.saving: their modules are imported on use (never by
        # `import pergrad`, so that pergrad.aggregators does not import them), by name and not
        # through the pergrad.privacy package, whose `audit` (pergrad.privacy.canary_audit) trains this model.
        import pergrad.privacy.adaptive  # noqa: F401
        import pergrad.privacy.banded_rule  # noqa: F401
        import pergrad.privacy.dp_sgd  # noqa: F401
        import pergrad.privacy.user_level  # noqa: F401

        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"), custom_objects)
        aggregator = keras.saving.deserialize_keras_object(config.pop("aggregator"), custom_objects)
        return cls(model, aggregator, **config)

    # -- internal to pergrad: what the step (pergrad.training.step, pergrad.training.trainers) and
    # pergrad.insight.diagnostics ask of the model; not a user API ----------------------------

    def keep_reports(self, reports):
        """Internal to pergrad. Keeps a train step's diagnostics for :meth:`compute_metrics`,
        per thread: ``tf.distribute`` traces each replica's step in its own thread, and the
        threads take turns at every collective."""
        self.__dict__.setdefault("_pending_reports", {})[threading.get_ident()] = reports

    def take_reports(self):
        """Internal to pergrad. The diagnostics :meth:`keep_reports` kept on this thread,
        once (``None`` when none)."""
        return self.__dict__.get("_pending_reports", {}).pop(threading.get_ident(), None)

    def diagnostics_request(self):
        """Internal to pergrad. The ``pergrad.insight.diagnostics.DiagnosticsRequest`` the train
        step computes, or ``None``."""
        return self.__dict__.get("_diagnostics")

    def set_diagnostics_request(self, request) -> None:
        """Internal to pergrad. Set by ``pergrad.insight.diagnostics.GradientDiagnostics`` around
        the steps it asks for (``None``: none); not tracked by Keras."""
        self.__dict__["_diagnostics"] = request

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        # Diagnostics come from the train step that just ran, never from evaluation.
        reports = self.take_reports()
        for tracker in self._diagnostic_trackers:
            if reports and tracker.name in reports:
                trainers.update_mean(tracker, reports[tracker.name])
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        if reports is None:
            logs = {k: v for k, v in logs.items() if k not in self.aggregator.diagnostics}
        else:  # a step's gradient diagnostics (pergrad.insight.diagnostics), as they are
            logs.update({k: v for k, v in reports.items() if k not in self.aggregator.diagnostics})
        return logs

    # -- the per-example step, written once for every backend ------------------------

    def per_example_problem(self) -> PerExampleProblem:
        """Internal to pergrad. The per-example problem of the latest compile.

        Keyed on the compiled loss container, which every ``compile()`` replaces;
        the BatchNormalization check and the seed positions are derived on use
        (``trainable`` flags may change at any time).
        """
        check_model(self.model, training=True)
        cached = self.__dict__.get("_problem_cache")
        compile_loss = compat.compiled_loss(self)
        if cached is None or cached[0] is not compile_loss:
            problem = PerExampleProblem(
                self.model, loss=self.loss, training=True, compile_loss=compile_loss
            )
            # Not tracked by Keras (a plain attribute); holds the container it is keyed on.
            self.__dict__["_problem_cache"] = (compile_loss, problem)
        return self.__dict__["_problem_cache"][1]

    def _aggregated_gradients(self, trainable_values, non_trainable_values, x, y, sample_weight,
                              units=None):
        """Returns ``(gradients, y_pred, new_seed_states, logged_loss)`` for one batch
        (``pergrad.training.step``: ``logged_loss`` is ``None`` where the step must compute it);
        ``units``: each example's user id, for a user-level rule."""
        return step.aggregated_gradients(
            self, trainable_values, non_trainable_values, x, y, sample_weight, units
        )

    def _check_batch(self, x, y):
        """Checks the batch; returns ``x``, on TF made to depend on the run-time check."""
        if not self.model.built:
            # TF's fit() builds a model without `keras.Input` when it first traces the step
            # (JAX's and torch's before it): from the batch's shapes, as plain Keras does.
            self.build(tree.map_structure(lambda t: tuple(t.shape), x))
        # The loss's per-example checks, as `per_example_gradients` makes them (once).
        self.per_example_problem().check_once(x, y)
        size = tree.flatten(x)[0].shape[0]
        minimum = self.aggregator.min_batch_size
        # Several replicas' shards: the rule sees the whole batch, its size known as the step runs.
        whole = training.whole_batch_size(self, x) if minimum > 1 else None
        message = (
            f"Aggregator {self.aggregator.name!r} needs batches of at least {minimum} "
            f"examples; got a batch of {{}}."
        )
        if size is not None and size < minimum and whole is None:
            raise ValueError(message.format(size))
        # Where the size is known only when the step runs (TF, below): fit() turns the
        # run-time assertion that carries this message into a ValueError of one line.
        self.__dict__["_batch_size_message"] = message.format("fewer")
        if whole is not None:
            x = adapter().assert_at_least(whole, minimum, message.format("fewer"), x)
        elif size is None and minimum > 1:
            # TF retraces fit()'s step with an unknown batch size once batches differ
            # (a smaller last batch): check when the step runs, and compute everything
            # from an `x` that waits for the check, so that no update runs if it fails.
            x = adapter().assert_at_least(
                ops.shape(tree.flatten(x)[0])[0], minimum, message.format("fewer"), x
            )
        return x

    def _check_batch_sizes(self, x, batch_size, validation_split, steps_per_epoch) -> None:
        """Before the first step: every batch size ``fit()`` makes of arrays ``x`` against
        the rule's minimum (other data, whose sizes show only as the batches come, are
        checked by each step)."""
        flat = tree.flatten(x) if x is not None else []
        if (self.aggregator.min_batch_size <= 1 or steps_per_epoch is not None or not flat
                or isinstance(x, keras.utils.PyDataset) or not hasattr(flat[0], "shape")
                or len(flat[0].shape) == 0 or flat[0].shape[0] is None):
            return
        examples = int(flat[0].shape[0])
        if validation_split:  # as Keras splits arrays
            examples = int(examples * (1.0 - validation_split) // 1)
        batch = batch_size or 32  # (Keras's default for arrays)
        problem = _batch_sizes_problem(self.aggregator, examples, batch)
        if problem is None:
            return
        kept = examples - examples % batch
        others = _batch_sizes_nearby(self.aggregator, examples, batch)
        instead = f"batch_size={' or '.join(map(str, others))}, " if others else ""
        raise ValueError(
            f"{problem} fit() would make batches of {batch} and a last batch of {examples % batch} "
            f"from {examples} training examples: use another batch size ({instead}whose every "
            f"batch the rule takes), or drop the last examples (x[:{kept}], y[:{kept}]; in "
            f"tf.data, .batch({batch}, drop_remainder=True))."
        )

    def fit(self, x=None, y=None, *args, **kwargs):
        from pergrad.insight.diagnostics import diagnostics_first
        from pergrad.privacy.sampling import PoissonSampler

        if len(args) > 3:  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
            args = (*args[:3], diagnostics_first(args[3]), *args[4:])
        elif "callbacks" in kwargs:
            kwargs["callbacks"] = diagnostics_first(kwargs["callbacks"])
        callbacks = args[3] if len(args) > 3 else kwargs.get("callbacks")
        # Several hosts or replicas: a DP fit needs one model, one Poisson sample, ...
        training.check_fit(self, isinstance(x, PoissonSampler), callbacks)
        if getattr(self.aggregator, "differentially_private", False):
            from pergrad.privacy.callbacks import check_dp_fit

            # Refuses example-mixing layers and an accountant that does not match the
            # sampler or the rule; warns without Poisson sampling.
            check_dp_fit(self, x, callbacks)
        given = inspect.signature(keras.Model.fit).bind(self, x, y, *args, **kwargs).arguments
        self._check_batch_sizes(x, given.get("batch_size"), given.get("validation_split"),
                                given.get("steps_per_epoch"))
        try:
            if isinstance(x, PoissonSampler):
                # Draws follow the step count restored by BackupAndRestore (after it).
                if len(args) > 3:  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
                    args = (*args[:3], x.with_step_callback(callbacks), *args[4:])
                else:
                    kwargs["callbacks"] = x.with_step_callback(callbacks)
                # On several devices: its one Poisson sample split over them, padded to divide.
                with x.split_for(self, training.batch_shards(self)):
                    return super().fit(x, y, *args, **kwargs)
            return super().fit(x, y, *args, **kwargs)
        except Exception as error:
            message = self.__dict__.get("_batch_size_message")
            # (TF's message escapes the quotes)
            if message and message in str(error).replace("\\'", "'") and not isinstance(error, ValueError):
                # TF's run-time assertion (a batch smaller than the rule takes, its size
                # unknown until it came): one line instead of the graph's trace.
                raise ValueError(
                    f"{message} These data's batch sizes show only as the batches come (arrays' "
                    "are checked before the first step): the steps of earlier batches, if any, "
                    "were taken. Drop the smaller last batch (tf.data: .batch(B, "
                    "drop_remainder=True)) or choose a batch size that leaves enough examples in it."
                ) from None
            raise
        finally:
            if getattr(self, "stop_training", False):
                # A fit stopped inside an epoch (the privacy budget) leaves its data iterator
                # in a reference cycle; collected at exit, TF's generator iterator cannot be
                # finalized and prints an error.
                gc.collect()


def _batch_sizes_problem(aggregator, examples: int, batch_size: int) -> str | None:
    """Why ``aggregator`` refuses a batch of ``examples`` split into batches of ``batch_size``
    (the last one smaller), or ``None``."""
    sizes = {min(batch_size, examples)}
    if examples % batch_size and examples > batch_size:
        sizes.add(examples % batch_size)
    for size in sorted(sizes):
        try:
            aggregator.check_batch_size(size)
        except ValueError as error:
            return str(error)
    return None


def _batch_sizes_nearby(aggregator, examples: int, batch_size: int) -> list[int]:
    """The nearest batch sizes below and above ``batch_size`` whose every batch
    ``aggregator`` takes (none that is not)."""
    below = next((b for b in range(batch_size - 1, 0, -1)
                  if _batch_sizes_problem(aggregator, examples, b) is None), None)
    above = next((b for b in range(batch_size + 1, 2 * batch_size + 1)
                  if _batch_sizes_problem(aggregator, examples, b) is None), None)
    return [b for b in (below, above) if b is not None]
