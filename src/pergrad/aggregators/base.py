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

What a rule hands to the train step is returned, never set on the rule: its
``aggregate`` (a statistics rule's ``finalize``, a step's ``preprocess``) returns the
gradients or an :class:`Aggregation` of them with its diagnostics, its DP noise (the
batch term) and the sums its state follows (the batch totals); unit ids come in as an
argument (:attr:`ExampleStatistics.units`).

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

from collections.abc import Sequence

import keras

from pergrad import compat
from pergrad.aggregators.aggregation import Aggregation, BatchTotals, MeanOf, report_values
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
from pergrad.aggregators.example_statistics import (
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
from pergrad.aggregators.row_map import RowMap
from pergrad.tensors import float_count, is_float

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
    "Aggregation",
    "Aggregator",
    "BatchTotals",
    "CoordinateAggregator",
    "ExampleStatistics",
    "MeanOf",
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
    "report_values",
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
    """Base class of the rules: per-example gradients in, one gradient out (kind arbitrary).

    A rule maps ``gradients``, a list aligned with the model's trainable variables (entry
    ``k`` of shape ``(B,) + variable_k.shape``), to one gradient per variable. A subclass
    of this class (kind ``"arbitrary"``: it sees every per-example gradient at once)
    overrides:

    - :meth:`aggregate` ``(gradients) -> list`` (required), or an :class:`Aggregation`
      of that list with the rule's diagnostics (``reports``), a term the batch holds once
      (``batch_term``: DP noise) or sums its state follows from (``batch_totals``);
    - ``__init__`` and ``get_config`` for its arguments, ``build(shapes)`` for Keras
      variables (state: tracked, saved and restored with the model);
    - optionally :meth:`batch_size_requirement` (why ``min_batch_size`` is what it is).

    and may set the class attributes below. Everything else is the engine's: the
    protocols (:class:`WeightedAggregator`, kind ``"statistics"``;
    :class:`CoordinateAggregator`, kind ``"coordinate"``; :class:`RowMapStep`, a step of
    ``chain``) implement ``aggregate`` from the parts they list, which the engine then
    computes on a cheaper path.

    Calling a rule, ``rule(gradients)``, returns the list (batch term added, state
    updated); :meth:`aggregation` returns the whole :class:`Aggregation`, diagnostics
    included (the train step's).

    Example: a rule that averages the examples whose gradient norm is below a threshold
    and reports how many it kept::

        import keras
        from keras import ops
        from pergrad.aggregators import Aggregation, Aggregator, MeanOf

        @keras.saving.register_keras_serializable()
        class BelowNorm(Aggregator):
            diagnostics = ("kept_fraction",)

            def __init__(self, threshold, **kwargs):
                super().__init__(**kwargs)
                self.threshold = threshold

            def aggregate(self, gradients):
                flat = ops.concatenate(
                    [ops.reshape(g, (ops.shape(g)[0], -1)) for g in gradients], axis=1)
                kept = ops.cast(ops.norm(flat, axis=1) <= self.threshold, "float32")
                count = ops.maximum(ops.sum(kept), 1.0)
                result = [ops.tensordot(kept, g, axes=1) / count for g in gradients]
                return Aggregation(result, reports={
                    "kept_fraction": MeanOf(ops.sum(kept), ops.shape(kept)[0])})

            def get_config(self):
                return {**super().get_config(), "threshold": self.threshold}

        model = pergrad.PerExampleModel(network, BelowNorm(1.0))
    """

    #: Set by the protocol class (:data:`STATISTICS`, :data:`COORDINATE`,
    #: :data:`ARBITRARY`): what the rule needs of the per-example gradients.
    kind: str = ARBITRARY
    #: The names of the diagnostics the rule reports (:attr:`Aggregation.reports`): the
    #: model logs them in ``History`` and the progress bar.
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
    #: own shard (``pergrad.training.step``), and whether padding rows matter. A subclass
    #: inherits its parent's; one whose weights read other examples must set
    #: ``WHOLE_BATCH``.
    distribution: str = WHOLE_BATCH
    #: Whether the rule reads each example's unit id (user-level DP,
    #: ``pergrad.privacy.user_level_dp_gaussian``): the step then passes the batch's ids
    #: (``aggregate(gradients, units=ids)``; the statistics' :attr:`ExampleStatistics.units`)
    #: and refuses a batch without them; every other rule refuses a batch that has them.
    reads_units: bool = False

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)

    def aggregate(self, gradients: list) -> list | Aggregation:
        """The rule's result on ``gradients``: a list of the variables' shapes, or an
        :class:`Aggregation` of it (diagnostics, batch term, batch totals)."""
        raise NotImplementedError

    def batch_size_requirement(self) -> str:
        """Why ``min_batch_size`` is what it is, appended to the batch size error."""
        return ""

    def aggregation(self, gradients, units=None) -> Aggregation:
        """The rule's :class:`Aggregation` of ``gradients`` (built on first use), of
        examples whose unit ids are ``units`` (``(B,)``, for a rule that
        :attr:`reads_units`); its reports are checked against :attr:`diagnostics`."""
        gradients = list(gradients)
        if not self.built:
            self.build([tuple(g.shape) for g in gradients])
        size = static_batch_size(gradients)
        if size is not None:
            self.check_batch_size(size)
        if self.reads_units and units is None:
            raise ValueError(
                f"{type(self).__name__} needs each example's user id: call it as "
                "rule(gradients, units=ids), or train on pergrad.privacy.UserSampler."
            )
        if units is not None and not self.reads_units:
            raise ValueError(f"{type(self).__name__} reads no unit ids: call it without units=.")
        outcome = Aggregation.of(
            self.aggregate(gradients) if units is None else self.aggregate(gradients, units=units)
        )
        unknown = [name for name in outcome.reports if name not in self.diagnostics]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not one of {type(self).__name__}.diagnostics.")
        return outcome

    def call(self, gradients, units=None):
        """The rule's result on ``gradients`` (:meth:`aggregation`, its batch term added and
        its state updated from its batch totals; its reports dropped)."""
        return self.aggregation(gradients, units=units).finish()[0]

    def check_batch_size(self, batch_size: int) -> None:
        """Raises a ``ValueError`` naming the rule if it is undefined for this batch size."""
        if batch_size < self.min_batch_size:
            raise ValueError(
                f"Aggregator {self.name!r} ({type(self).__name__}) needs a batch of at least "
                f"{self.min_batch_size} examples, got {batch_size}.{self.batch_size_requirement()}"
            )

    # -- declarations the engine reads (the protocols and composition set them) --------

    def in_protocol_form(self, method: str) -> bool:
        """Whether this rule's ``method`` (``"aggregate"``, a step's ``"preprocess"``) is the
        one its protocol derives from its parts (:func:`protocol_form`), so that the engine
        may compute it from them: the statistics path from ``example_weights`` and
        ``finalize``, the streaming path variable by variable and from ``row_map``."""
        return getattr(getattr(type(self), method, None), "protocol_form", False)

    def steps_and_rule(self):
        """``(steps, rule)`` when this rule is pre-processing steps followed by another
        rule (``chain``, ``bucketing(size, rule)``), which the streaming path may apply to
        each layer's ``A`` and ``D``; ``None`` (the default) when it is one rule."""
        return None

    def steps_reports(self, reports: list) -> dict:
        """This composite rule's diagnostics from those of :meth:`steps_and_rule`'s steps and
        rule (``reports``: one dict each, in order): merged, unless the rule renames them."""
        return {name: value for part in reports for name, value in part.items()}

    def update_allowed(self):
        """A scalar boolean tensor, read before each train step: ``False`` makes the step
        apply no update (a DP rule's budget); ``None`` (the default): always allowed."""
        return None

    def group_count(self) -> int | None:
        """How many contiguous groups of the batch this rule aggregates each on its own before
        combining the groups' results (``two_level``), or ``None`` (the default).

        A rule that has a count defines ``aggregate_group(gradients)`` (one group's result)
        and ``combine_groups(rows, sizes)`` (the result from the groups' results stacked
        in order and their example counts): with one group per replica, the train step
        exchanges only the groups' results.
        """
        return None

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

    def compute_output_spec(self, gradients, units=None):
        return [keras.KerasTensor(g.shape[1:], g.dtype) for g in gradients]


@serializable
class RowMapStep(Aggregator):
    """A pre-processing step that is a linear map of the batch (:class:`RowMap`).

    Steps whose output rows are weighted sums of input rows (clipping, filtering,
    bucketing) implement :meth:`row_map`; their :meth:`preprocess` is its
    application, and the streaming path applies the map (composed with the next
    steps' maps) to each layer's input and output gradient instead. A step may be a
    rule of its own too (``clip`` is the mean of the clipped examples).

    Subclasses implement :meth:`row_map`, and :meth:`map_reports` if they report
    diagnostics, and set :attr:`map_reads_statistics` and :attr:`mixes_examples` where
    they hold.
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

    def map_reports(self, stats: ExampleStatistics | None, batch_size) -> dict:
        """The step's diagnostics on a batch with these statistics (those of
        :meth:`row_map`): ``{}`` unless the step reports any."""
        return {}

    def can_preprocess(self) -> bool:
        """Whether this rule can be a pre-processing step (not last) of a chain."""
        return True

    def output_batch_size(self, batch_size: int) -> int:
        """``B'``: how many rows :meth:`preprocess` returns for ``batch_size`` examples."""
        return batch_size

    @protocol_form
    def preprocess(self, gradients) -> list | Aggregation:
        """Maps per-example gradients ``(B, ...)`` to ``(B', ...)`` for the next step of a
        chain, with the step's reports (an :class:`Aggregation`): :meth:`row_map` applied."""
        stats = ExampleStatistics.from_gradients(gradients) if self.map_reads_statistics else None
        size = batch_size_of(gradients)
        rows = self.row_map(stats, size)
        return Aggregation([rows.apply(g, k) for k, g in enumerate(gradients)],
                           reports=self.map_reports(stats, size))


@serializable
class WeightedAggregator(Aggregator):
    """Rules whose result is ``sum_i w_i g_i`` with weights from statistics.

    Subclasses implement :meth:`example_weights` and may override
    :meth:`finalize`, which receives the weighted sum and the same statistics (so that no
    state passes between the two calls) and may return an :class:`Aggregation` of the
    result: the rule's diagnostics from the statistics, DP noise as its ``batch_term``.
    With only statistics needed, a fast
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

    def finalize(self, result: list, stats: ExampleStatistics) -> list | Aggregation:
        """The result from ``sum_i w_i g_i`` and the statistics the weights came from (or an
        :class:`Aggregation` of it)."""
        return result

    @protocol_form
    def aggregate(self, gradients, units=None):
        stats = ExampleStatistics.from_gradients(gradients, gram=self.needs_gram, units=units)
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

    def finalize(self, result, stats):
        # As the last rule, its reports are those it makes as a step.
        reports = self.map_reports(stats, stats.batch_size)
        return Aggregation(result, reports=reports) if reports else result


@serializable
class CoordinateAggregator(Aggregator):
    """Rules applied to one variable at a time: ``(B, ...) -> (...)``.

    Subclasses implement :meth:`aggregate_variable` and set :attr:`coordinatewise` where it
    holds; the streaming path then aggregates one variable at a time.
    """

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
