"""The contract between rules and the engine: what an aggregator is and declares.

An aggregator maps per-example gradients ``g_1..g_B`` (a list aligned with the
model's trainable variables, entry k of shape ``(B,) + variable_k.shape``) to
one gradient (a list of the variables' shapes). Any callable with that
signature is an aggregator. The classes here add what the engine can use to
pick a cheaper path (docs/architecture.md, 'Aggregator kinds'). A rule is a
subclass of one protocol, which fixes its *kind* and the methods it implements:

- :class:`WeightedAggregator`, kind ``"statistics"``: the result is
  ``sum_i w_i g_i`` (plus, optionally, noise) with weights computed from
  per-example statistics only (:class:`ExampleStatistics`: squared norms and,
  if asked, the Gram matrix). Implements ``example_weights`` (and ``finalize``).
- :class:`CoordinateAggregator`, kind ``"coordinate"``: works one variable at a
  time and needs all B values of each coordinate (median, trimmed mean).
  Implements ``aggregate_variable``.
- :class:`Aggregator` itself, kind ``"arbitrary"``: anything else (the user's
  own function). Implements ``aggregate``.

A rule that can also come before another in ``chain`` is a :class:`RowMapStep`:
a linear map of the batch (:class:`RowMap`), from ``row_map``.

Every rule declares, as class attributes, how it splits over the batch's parts
(:attr:`Aggregator.distribution`), the smallest batch it is defined for,
whether it is differentially private and whether it keeps per-variable state;
the engine and the replica policy read these declarations and never a rule's
class. This module, with the statistics and the row maps it re-exports, is all
the engine imports of the rules.

Aggregators are Keras layers so that stateful rules keep their state as Keras
variables: tracked by the model, carried through JAX's stateless train step,
saved by ``model.save()`` and restored by ``keras.models.load_model()``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import keras
from keras import ops

from pergrad import compat
from pergrad.aggregators.batch import (
    batch_size_of,
    batch_sum,
    finite_examples,
    scale_examples,
    static_batch_size,
    weighted_sum,
    zero_examples,
    zero_non_finite_examples,
)
from pergrad.aggregators.row_map import RowMap
from pergrad.aggregators.statistics import (
    ExampleStatistics,
    example_squared_norms,
    example_weighted_sum,
    overflow_safe,
    row_scales,
    row_squared_norms,
    scaled_squared_norms_of_rows,
    squared_norms_of_rows,
    stack_columns,
)
from pergrad.tensors import cast, float_count, is_float

__all__ = [
    "ARBITRARY",
    "COORDINATE",
    "DISTRIBUTIONS",
    "KINDS",
    "LOCAL_MEAN",
    "LOCAL_SUM",
    "STATISTICS",
    "UNIT_IDS",
    "UNIT_INPUTS",
    "WHOLE_BATCH",
    "Aggregator",
    "CoordinateAggregator",
    "ExampleStatistics",
    "RowMap",
    "RowMapStep",
    "ScaledMean",
    "WeightedAggregator",
    "batch_size_of",
    "batch_sum",
    "example_squared_norms",
    "example_weighted_sum",
    "check_result",
    "check_structure",
    "finite_examples",
    "overflow_safe",
    "protocol_form",
    "row_scales",
    "row_squared_norms",
    "scale_examples",
    "scaled_squared_norms_of_rows",
    "serializable",
    "split_units",
    "takes_outer_rows",
    "squared_norms_of_rows",
    "stack_columns",
    "static_batch_size",
    "weighted_sum",
    "zero_examples",
    "zero_non_finite_examples",
]

STATISTICS = "statistics"
COORDINATE = "coordinate"
ARBITRARY = "arbitrary"
KINDS = (STATISTICS, COORDINATE, ARBITRARY)

# How a rule's result over a batch follows from its results over parts of the batch
# (``Aggregator.distribution``; each replica's shard: docs/architecture.md,
# 'Multi-device training').
#: The parts' results weighted by their share of the examples: each example's weight
#: needs no other example's gradient, and the rule divides by the batch size (mean, clip).
LOCAL_MEAN = "local-mean"
#: The parts' results summed: zero-weight padding rows change nothing (sum;
#: ``dp_gaussian`` with ``expected_batch_size``).
LOCAL_SUM = "local-sum"
#: Neither (order statistics, norms compared across examples): on several replicas the
#: rule runs on the whole batch, gathered.
WHOLE_BATCH = "whole-batch"
DISTRIBUTIONS = (LOCAL_MEAN, LOCAL_SUM, WHOLE_BATCH)


#: The keys of a batch's ``x`` that carries each example's privacy unit (its user, for
#: a rule that :attr:`~Aggregator.reads_units`): ``{UNIT_INPUTS: inputs, UNIT_IDS: (B,)
#: integer ids}`` (``pergrad.privacy.UserSampler`` yields it). The train step takes the
#: ids out before anything reads ``x`` (:func:`split_units`): the network sees ``inputs``.
UNIT_INPUTS, UNIT_IDS = "pergrad_inputs", "pergrad_units"


def split_units(x):
    """``(inputs, ids)`` of a batch's ``x`` that carries unit ids (:data:`UNIT_IDS`), else
    ``(x, None)``."""
    if isinstance(x, dict) and set(x) == {UNIT_INPUTS, UNIT_IDS}:
        return x[UNIT_INPUTS], x[UNIT_IDS]
    return x, None


def serializable(cls):
    """Registers an aggregator class for saving (``pergrad>ClassName``)."""
    return keras.saving.register_keras_serializable(package="pergrad")(cls)


def protocol_form(method):
    """Marks an ``aggregate`` or ``preprocess`` as the one the rule's protocol derives from
    its parts, perhaps computed faster: a statistics rule's ``finalize`` of
    ``sum_i w_i g_i`` with its ``example_weights``, a coordinate rule's
    ``aggregate_variable`` on each variable, a step's :meth:`~Aggregator.row_map` applied.
    The engine may then use the parts instead (:meth:`Aggregator.in_protocol_form`). A
    subclass that defines its own method is not marked unless it says so, and the
    engine then calls that method."""
    method.protocol_form = True
    return method


def takes_outer_rows(method):
    """Marks a coordinate rule's ``aggregate_variable`` as taking a ``Dense`` kernel's rows as
    their factors (:class:`pergrad.layer_rules.dense.OuterRows`: the median, trimmed mean
    and MeaMed of :mod:`pergrad.aggregators.selection` select over them a block at a time,
    without the formed kernel). The streaming path then hands such rows to it where the
    adapter selects over factors. A subclass that defines its own method is not marked
    unless it says so, and gets formed rows."""
    method.takes_outer_rows = True
    return method


@serializable
class Aggregator(keras.layers.Layer):
    """Base class: ``aggregate(gradients) -> list`` of the variables' shapes (kind arbitrary).

    A subclass implements :meth:`aggregate` (or derives from a protocol below that
    implements it from its parts) and may set the class attributes below. Rules that
    report what they did (fraction clipped, examples rejected) name the values in
    ``diagnostics`` and call :meth:`report` during ``aggregate``; the model logs them
    in ``History`` and the progress bar.
    """

    #: Set by the protocol class (:data:`STATISTICS`, :data:`COORDINATE`,
    #: :data:`ARBITRARY`): what the rule needs of the per-example gradients.
    kind: str = ARBITRARY
    diagnostics: tuple[str, ...] = ()
    #: The smallest batch the rule is defined for.
    min_batch_size: int = 1
    #: Whether the rule carries a differential-privacy guarantee (DP-SGD).
    differentially_private: bool = False
    #: Whether the rule keeps state shaped like the trainable variables it was
    #: built for (centered clipping's center): it cannot follow a freeze.
    state_per_variable: bool = False
    #: How the result splits over parts of the batch (:data:`LOCAL_MEAN`,
    #: :data:`LOCAL_SUM` or :data:`WHOLE_BATCH`): whether each replica may aggregate its
    #: own shard (``pergrad.step``), and whether padding rows matter. A subclass
    #: inherits its parent's; one whose weights read other examples must set
    #: ``WHOLE_BATCH``.
    distribution: str = WHOLE_BATCH
    #: Whether the rule reads each example's unit id (user-level DP,
    #: ``pergrad.privacy.user_level_dp_gaussian``): the step then hands it the batch's
    #: ids (``set_units``) and refuses a batch without them; every other rule refuses
    #: a batch that has them.
    reads_units: bool = False

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        self._reports: dict = {}
        self._batch_terms: dict = {}
        self._batch_totals: dict = {}

    def call(self, gradients, batch_term: bool = True):
        """The rule's result on ``gradients``; with ``batch_term=False`` without the term
        its :meth:`finalize` set aside for the batch to hold once (:meth:`pop_batch_term`)."""
        gradients = list(gradients)
        size = static_batch_size(gradients)
        if size is not None:
            self.check_batch_size(size)
        result = self.aggregate(gradients)
        if not batch_term:
            return result
        totals = self.pop_batch_totals()
        if totals is not None:  # the batch is this call's: its totals are its own sums
            totals[1](totals[0])
        term = self.pop_batch_term()
        return result if term is None else [g + t for g, t in zip(result, term)]

    def check_batch_size(self, batch_size: int) -> None:
        """Raises a ``ValueError`` naming the rule if it is undefined for this batch size."""
        if batch_size < self.min_batch_size:
            raise ValueError(
                f"Aggregator {self.name!r} ({type(self).__name__}) needs a batch of at least "
                f"{self.min_batch_size} examples, got {batch_size}.{self.batch_size_requirement()}"
            )

    def batch_size_requirement(self) -> str:
        """Why ``min_batch_size`` is what it is, appended to the batch size error."""
        return ""

    def aggregate(self, gradients: list) -> list:
        raise NotImplementedError

    def in_protocol_form(self, method: str) -> bool:
        """Whether this rule's ``method`` (``"aggregate"``, ``"preprocess"``) is the one its
        protocol derives from its parts (:func:`protocol_form`), so that the engine may
        compute it from them: the statistics path from ``example_weights`` and
        ``finalize``, the streaming path variable by variable and from ``row_map``."""
        return getattr(getattr(type(self), method), "protocol_form", False)

    def steps_and_rule(self):
        """``(steps, rule)`` when this rule is pre-processing steps followed by another
        rule (``chain``, ``bucketing(size, rule)``), which the streaming path may apply to
        each layer's ``A`` and ``D``; ``None`` (the default) when it is one rule."""
        return None

    def update_allowed(self):
        """A scalar boolean tensor, read before each train step: ``False`` makes the step
        apply no update (a DP rule's budget); ``None`` (the default): always allowed."""
        return None

    # -- as a step of ``chain`` (the protocol: RowMapStep) ------------------------------

    def preprocess(self, gradients: list) -> list:
        """Maps per-example gradients ``(B, ...)`` to ``(B', ...)`` for the next step of a chain.

        Only rules that have a natural per-example form (clipping, bucketing,
        filtering: :class:`RowMapStep`) implement it.
        """
        raise TypeError(
            f"{type(self).__name__} is not a pre-processing step: only its aggregate is "
            "defined. Put it last in chain(...)."
        )

    def can_preprocess(self) -> bool:
        """Whether this rule can be a pre-processing step (not last) of a chain."""
        return type(self).preprocess is not Aggregator.preprocess

    def output_batch_size(self, batch_size: int) -> int:
        """``B'``: how many rows :meth:`preprocess` returns for ``batch_size`` examples."""
        return batch_size

    # -- saving: Keras does not save SeedGenerator states; aggregators do -------------

    def save_own_variables(self, store):
        super().save_own_variables(store)
        for index, generator in enumerate(compat.seed_generators(self)):
            store[f"seed_generator_{index}"] = generator.state

    def load_own_variables(self, store):
        seeds = {key for key in store.keys() if str(key).startswith("seed_generator_")}
        own = {key: store[key] for key in store.keys() if key not in seeds}
        super().load_own_variables(own)
        for index, generator in enumerate(compat.seed_generators(self)):
            key = f"seed_generator_{index}"
            if key in seeds:
                generator.state.assign(store[key])

    def report(self, name: str, value, count=None) -> None:
        """Records a diagnostic of the current call: the scalar ``value``, or with ``count``
        the mean ``value / count`` of a sum over ``count`` examples (0 for none).

        A sum and a count are local quantities: where each replica aggregates its own
        shard, the model's train step sums both over the replicas before dividing
        (:meth:`pop_reports`), so that the diagnostic describes the whole batch.
        """
        if name not in self.diagnostics:
            raise ValueError(f"{name!r} is not one of {type(self).__name__}.diagnostics.")
        # Per thread: tf.distribute traces each replica's step in its own thread,
        # and they take turns at every collective between a report and its pop.
        self._reports.setdefault(threading.get_ident(), {})[name] = (value, count)

    def pop_reports(self, total=None) -> dict:
        """The current call's diagnostics by name, forgotten here.

        Args:
            total: a function that sums a tensor over the replicas whose shards this
                rule aggregated on its own (the train step's), applied once to all
                the ``(sum, count)`` reports; ``None``: this call's own values.
        """
        reports = self._reports.pop(threading.get_ident(), {})
        counted = [name for name, (_, count) in reports.items() if count is not None]
        if counted and total is not None:
            sums = total(ops.stack([ops.cast(x, "float32") for name in counted for x in reports[name]]))
            reports.update({name: (sums[2 * k], sums[2 * k + 1]) for k, name in enumerate(counted)})
        def mean(value, count):
            if isinstance(count, int):  # (static: no maximum op)
                return cast(value, "float32") / float(max(count, 1))
            return value / ops.maximum(ops.cast(count, "float32"), 1.0)

        return {name: value if count is None else mean(value, count)
                for name, (value, count) in reports.items()}

    def set_batch_term(self, term: list) -> None:
        """Sets aside ``term`` (aligned with the result) as part of the current call's result
        that the batch holds once however its examples are split (DP noise).
        :meth:`finalize` calls it and returns the result without the term: ``__call__``
        adds it back; the model's train step adds it on one replica of several whose
        results it sums."""
        self._batch_terms[threading.get_ident()] = term

    def pop_batch_term(self) -> list | None:
        """The term :meth:`set_batch_term` set aside in the current call, or ``None``."""
        return self._batch_terms.pop(threading.get_ident(), None)

    def set_batch_totals(self, sums, update) -> None:
        """Sets aside ``sums`` (a float tensor of sums over the current call's examples) and
        ``update``, a function of their totals over the whole batch that updates the rule's
        state (adaptive clipping's norm, from its count). ``__call__`` calls ``update(sums)``;
        where each replica aggregates its shard, the model's train step calls it with the
        sums added over the replicas, so that every replica updates alike."""
        self._batch_totals[threading.get_ident()] = (sums, update)

    def pop_batch_totals(self):
        """``(sums, update)`` of :meth:`set_batch_totals` in the current call, or ``None``."""
        return self._batch_totals.pop(threading.get_ident(), None)

    def group_count(self) -> int | None:
        """How many contiguous groups of the batch this rule aggregates each on its own before
        combining the groups' results (``two_level``), or ``None`` (the default).

        A rule that has a count defines ``aggregate_group(gradients)`` (one group's result)
        and ``combine_groups(rows, sizes)`` (the result from the groups' results stacked
        in order and their example counts): with one group per replica, the train step
        exchanges only the groups' results.
        """
        return None

    def compute_output_spec(self, gradients):
        return [keras.KerasTensor(g.shape[1:], g.dtype) for g in gradients]


@serializable
class RowMapStep(Aggregator):
    """A pre-processing step that is a linear map of the batch (:class:`RowMap`).

    Steps whose output rows are weighted sums of input rows (clipping, filtering,
    bucketing) implement :meth:`row_map`; their :meth:`preprocess` is its
    application, and the streaming path applies the map (composed with the next
    steps' maps) to each layer's input and output gradient instead. A step may be a
    rule of its own too (``clip`` is the mean of the clipped examples).
    """

    #: Whether :meth:`row_map` reads per-example statistics (squared norms).
    map_reads_statistics: bool = False
    #: Whether an output row of :meth:`row_map` combines several examples (bucketing):
    #: its statistics then do not follow from theirs.
    mixes_examples: bool = False

    def row_map(self, stats: ExampleStatistics | None, batch_size) -> RowMap:
        """The step as a linear map of a batch of ``batch_size`` examples; ``stats`` are
        their statistics (``None`` unless :attr:`map_reads_statistics`)."""
        raise NotImplementedError

    @protocol_form
    def preprocess(self, gradients):
        stats = ExampleStatistics.from_gradients(gradients) if self.map_reads_statistics else None
        rows = self.row_map(stats, batch_size_of(gradients))
        return [rows.apply(g, k) for k, g in enumerate(gradients)]


@serializable
class WeightedAggregator(Aggregator):
    """Rules whose result is ``sum_i w_i g_i`` with weights from statistics.

    Subclasses implement :meth:`example_weights` and may override
    :meth:`finalize` (e.g. to set aside noise, :meth:`~Aggregator.set_batch_term`), which
    receives the weighted sum and the same statistics, so that no state passes between
    the two calls. With only statistics needed, a fast
    engine can compute the result without materializing per-example gradients:
    ``sum_i w_i g_i`` is the gradient of ``sum_i w_i L_i`` with ``w`` fixed.
    """

    kind = STATISTICS
    #: Whether :meth:`example_weights` reads ``stats.gram``.
    needs_gram: bool = False
    #: Whether the weights depend on the statistics at all. ``False`` (``mean``,
    #: ``sum``) declares that every example weighs the same, ``1 / B`` or ``1`` as
    #: :attr:`distribution` (:data:`LOCAL_MEAN` or :data:`LOCAL_SUM`) says: the result is
    #: then the gradient of the batch loss, one ordinary backward pass.
    reads_statistics: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.reads_statistics and cls.needs_gram:
            raise TypeError(
                f"{cls.__name__} sets reads_statistics = False (every example weighs the "
                "same) and needs_gram = True (its weights read the Gram matrix): at most one "
                "can hold."
            )
        if not cls.reads_statistics and cls.distribution not in (LOCAL_MEAN, LOCAL_SUM):
            raise TypeError(
                f"{cls.__name__} sets reads_statistics = False, which declares that every "
                "example weighs the same (1 / B or 1), but its distribution is "
                f"{cls.distribution!r}: set distribution to LOCAL_MEAN (weights 1 / B) or "
                "LOCAL_SUM (weights 1), or leave reads_statistics True."
            )

    def example_weights(self, stats: ExampleStatistics):
        """Returns weights of shape ``(B,)`` or ``(B, V)`` (one per variable)."""
        raise NotImplementedError

    def finalize(self, result: list, stats: ExampleStatistics) -> list:
        """The result from ``sum_i w_i g_i`` and the statistics the weights came from."""
        return result

    @protocol_form
    def aggregate(self, gradients):
        stats = ExampleStatistics.from_gradients(gradients, gram=self.needs_gram)
        return self.finalize(weighted_sum(gradients, self.example_weights(stats)), stats)


@serializable
class ScaledMean(RowMapStep, WeightedAggregator):
    """The mean of per-example gradients, each rescaled by a factor from its norms.

    Subclasses (clipping, normalization) implement :meth:`example_scales`. As a
    pre-processing step of :func:`~pergrad.aggregators.chain` the rescaled
    gradients are passed on, one per example, instead of being averaged.
    """

    #: Whether the scales are per variable (``(B, V)``) rather than flat (``(B,)``).
    per_layer: bool = False
    # Each example's scale comes from its own norms: the mean splits over the shards.
    distribution = LOCAL_MEAN

    def example_scales(self, stats: ExampleStatistics):
        """Returns ``(B,)`` factors, or ``(B, V)`` with ``per_layer``."""
        raise NotImplementedError

    def example_weights(self, stats: ExampleStatistics):
        return self.example_scales(stats) / float_count(stats.batch_size)

    map_reads_statistics = True

    def row_map(self, stats, batch_size):
        return RowMap.scaling(self.example_scales(stats))


@serializable
class CoordinateAggregator(Aggregator):
    """Rules applied to one variable at a time: ``(B, ...) -> (...)``."""

    kind = COORDINATE
    #: Whether each coordinate's result depends on that coordinate's ``B`` values
    #: only (median, trimmed mean), not on the variable's other coordinates: the
    #: streaming path may then aggregate a variable in parts to bound memory
    #: (``microbatch_size``).
    coordinatewise: bool = False

    def aggregate_variable(self, gradient):
        """One variable's result ``(...)`` from its per-example gradients ``(B, ...)``."""
        raise NotImplementedError

    @protocol_form
    def aggregate(self, gradients):
        return [self.aggregate_variable(g) for g in gradients]


def _describe(value) -> str:
    """What an aggregator returned, in words: ``a dict with keys ['a']``, ``an int32 tensor ...``."""
    if isinstance(value, dict):
        return f"a dict with keys {list(value)[:5]}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = keras.backend.standardize_dtype(value.dtype)
        article = "an" if dtype[0] in "aeiou" else "a"
        return f"{article} {dtype} tensor of shape {tuple(value.shape)}"
    where = "Python " if type(value).__module__ == "builtins" else ""
    return f"a {where}{type(value).__name__} ({value!r:.40})"


def check_structure(result, shapes: Sequence, names: Sequence, who: str, check_shapes=True) -> list:
    """Raises a clear error unless ``result`` is a list or tuple of float tensors of ``shapes``."""
    expected = (
        f"a list with one tensor per trainable variable ({len(shapes)} float tensors, of "
        f"shapes {', '.join(str(s) for s in shapes)}; a tuple will do)"
    )
    if not isinstance(result, (list, tuple)):
        raise ValueError(f"{who} must return {expected}; got {_describe(result)}.")
    result = list(result)
    if len(result) != len(shapes):
        raise ValueError(
            f"{who} returned {len(result)} tensors for {len(shapes)} trainable variables; "
            f"expected {expected}."
        )
    for value, shape, name in zip(result, shapes, names):
        if not is_float(value):
            raise ValueError(
                f"{who} returned {_describe(value)} for variable {name} of shape {shape}; "
                "expected a float tensor of that shape (a gradient: cast integer or bool "
                "results with keras.ops.cast(value, 'float32'))."
            )
        if check_shapes and tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"{who} returned shape {tuple(value.shape)} for variable {name} of shape "
                f"{tuple(shape)}."
            )
    return result


def check_result(result, variables: Sequence, aggregator_name: str) -> list:
    """Raises a clear error when an aggregator returns the wrong structure.

    Expected: a list or tuple of float tensors, one per trainable variable, of
    the variables' shapes; the error says what came instead.
    """
    return check_structure(
        result,
        [tuple(v.shape) for v in variables],
        [repr(v.path) for v in variables],
        f"Aggregator {aggregator_name!r}",
    )
