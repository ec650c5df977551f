"""Composition: pre-processing steps before a final rule, and bucketing.

A pre-processing step maps per-example gradients ``(B, ...)`` to ``(B', ...)``
(a list aligned with the trainable variables, like the aggregator's input):
clipping and automatic clipping rescale each example (``B' = B``),
``norm_filter(drop_fraction=...)`` keeps the examples with the smallest norms,
``bucketing(size)`` averages random buckets (``B' = ceil(B / size)``).
:func:`chain` runs such steps in order and hands the result to its last rule::

    chain(clip(1.0), bucketing(2), median())

:func:`two_level` is a rule of rules: one rule on each contiguous group of the
batch (a replica's shard), another across the groups' results.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from pergrad import compat
from pergrad.aggregators.base import (
    COORDINATE,
    STATISTICS,
    Aggregation,
    Aggregator,
    CoordinateAggregator,
    ExampleStatistics,
    RowMap,
    RowMapStep,
    ScaledMean,
    WeightedAggregator,
    serializable,
)
from pergrad.aggregators.batch import row_range
from pergrad.aggregators.registry import get
from pergrad.arguments import check_integer
from pergrad.backend import adapter


def _refuse_private(rule: Aggregator, wrapper: str) -> None:
    """A DP rule's guarantee holds only for the rule applied to the raw per-example gradients."""
    if getattr(rule, "differentially_private", False):
        raise ValueError(
            f"{type(rule).__name__} is a differentially private rule and cannot be used "
            f"inside {wrapper}: its guarantee bounds one example's influence on the "
            "per-example gradients it receives, and a wrapper's pre-processing (bucketing "
            "averages random groups, filtering depends on the other examples) can make one "
            "example change several of them. Use the DP rule alone as the model's "
            "aggregator (it clips each example itself)."
        )


def _multiply_weights(first, second):
    if len(first.shape) == len(second.shape):
        return first * second
    if len(first.shape) == 1:
        return first[:, None] * second
    return first * second[:, None]


def _composed(rule: Aggregator, step_reports: list, final: Aggregation) -> Aggregation:
    """``final`` (the last rule's aggregation) with ``rule``'s diagnostics: its steps'
    (``step_reports``, in order) and the last rule's, as ``rule`` names them."""
    reports = rule.steps_reports([*step_reports, final.reports])
    return Aggregation(final.gradients, reports, final.batch_term, final.batch_totals)


def _chain_class(steps) -> type:
    """The class a chain of ``steps`` is, from its final rule's kind.

    :class:`WeightedChain` (kind ``"statistics"``) when the final rule is a statistics
    rule and every step before it rescales examples (clipping, automatic clipping),
    flat ones if the final rule reads the Gram matrix: then ``s_i g_i`` has squared
    norms ``s_i^2 ||g_i||^2`` and Gram matrix ``s_i s_j G_ij``, and the result is
    ``sum_i s_i w_i g_i``. :class:`CoordinateChain` (kind ``"coordinate"``) when the
    final rule is a coordinate rule. :class:`Chain` (kind ``"arbitrary"``) otherwise.
    """
    if not steps:
        return Chain  # which refuses an empty chain
    final, before = steps[-1], steps[:-1]
    scalings = all(isinstance(step, ScaledMean) for step in before)
    flat = not any(getattr(step, "per_layer", False) for step in before)
    if isinstance(final, WeightedAggregator) and final.kind == STATISTICS and scalings and (
        flat or not final.needs_gram
    ):
        return WeightedChain
    if final.kind == COORDINATE:
        return CoordinateChain
    return Chain


@serializable
class Chain(Aggregator):
    """Pre-processing steps, then a final rule.

    Every step but the last must be a pre-processing step (``clip``,
    ``automatic_clip``, ``norm_filter(drop_fraction=...)``, ``bucketing(size)``);
    the last is any aggregator. Diagnostics of all steps are reported (a name
    reported by two steps becomes ``step<i>_<name>``).

    :func:`chain` returns the class the steps' kind implies: a
    :class:`WeightedChain` when the chain is a statistics rule, a
    :class:`CoordinateChain` when its final rule is a coordinate rule, this class
    (kind ``"arbitrary"``: the steps run on the gradients, then the final rule)
    otherwise. A saved chain of any kind loads as that class.

    A differentially private rule (``pergrad.privacy.dp_gaussian``) is
    refused at any position: its guarantee holds only as the model's
    outermost aggregator.

    Args:
        steps: the steps, in order; aggregators or their names.
    """

    def __init__(self, steps, **kwargs):
        super().__init__(**kwargs)
        steps = [get(step) for step in steps]
        if not steps:
            raise ValueError("chain needs at least one step.")
        for step in steps:
            _refuse_private(step, "chain(...)")
        # So a chain is never private (Aggregator.differentially_private = False).
        for step in steps[:-1]:
            if not (isinstance(step, RowMapStep) and step.can_preprocess()):
                raise ValueError(
                    f"{type(step).__name__} cannot be a pre-processing step of chain: only "
                    "clip, automatic_clip, norm_filter(drop_fraction=...) and bucketing(size) "
                    "(without an aggregator) can come before the last rule."
                )
        self.steps = steps
        names = [name for step in steps for name in step.diagnostics]
        self._report_names = [
            {name: name if names.count(name) == 1 else f"step{i}_{name}" for name in step.diagnostics}
            for i, step in enumerate(steps)
        ]
        self.diagnostics = tuple(n for renames in self._report_names for n in renames.values())
        self.min_batch_size = self._smallest_batch()

    def _check_kind(self) -> None:
        """Raises unless the steps make this class's kind (a variant built directly)."""
        made = _chain_class(self.steps)
        if not isinstance(self, made):
            raise ValueError(
                f"These steps make a {made.__name__} (kind {made.kind!r}), not a "
                f"{type(self).__name__}: build chains with pergrad.aggregators.chain(...)."
            )

    def _smallest_batch(self, limit: int = 1_000_000) -> int:
        for batch_size in range(1, limit):
            size = batch_size
            for step in self.steps[:-1]:
                if size < step.min_batch_size:
                    break
                size = step.output_batch_size(size)
            else:
                if size >= self.steps[-1].min_batch_size:
                    return batch_size
        raise ValueError(f"No batch size below {limit} satisfies every step of the chain.")

    def batch_size_requirement(self):
        return " " + ", ".join(
            f"{type(step).__name__} needs {step.min_batch_size}" for step in self.steps
        ) + " (after the previous steps)."

    def build(self, shapes):
        for step in self.steps:
            if not step.built:
                step.build(shapes)
        self.built = True

    def steps_and_rule(self):
        return list(self.steps[:-1]), self.steps[-1]

    def aggregate(self, gradients):
        reports = []
        for step in self.steps[:-1]:
            mapped = Aggregation.of(step.preprocess(gradients))
            gradients = mapped.gradients
            reports.append(mapped.reports)
        return _composed(self, reports, self.steps[-1].aggregation(gradients))

    def steps_reports(self, reports):
        # One dict per step, in order: a name two steps report is step<i>_<name>.
        return {renames[name]: value for renames, part in zip(self._report_names, reports)
                for name, value in part.items()}

    def get_config(self):
        return {
            **super().get_config(),
            "steps": [keras.saving.serialize_keras_object(step) for step in self.steps],
        }

    @classmethod
    def from_config(cls, config):
        if cls is not Chain:
            return super().from_config(config)
        # Saved as "Chain" (every kind was, once): loaded as the class its steps make.
        steps = [get(step) for step in config["steps"]]
        return super(Chain, _chain_class(steps)).from_config({**config, "steps": steps})


@serializable
class WeightedChain(Chain, WeightedAggregator):
    """A chain of rescaling steps before a statistics rule: a statistics rule itself.

    Each step scales example i by a factor from its own norms, so the chain's weights
    are the steps' factors times the final rule's weights on the rescaled statistics
    (:func:`_chain_class`), and the statistics path computes it without per-example
    gradients.
    """

    aggregate = WeightedAggregator.aggregate  # the protocol's, not the steps run one by one

    def __init__(self, steps, **kwargs):
        super().__init__(steps, **kwargs)
        self._check_kind()
        final = self.steps[-1]
        self.needs_gram = final.needs_gram
        # Each step scales an example by its own norms: the chain splits as its rule.
        self.distribution = final.distribution

    def example_weights(self, stats: ExampleStatistics):
        scales = None
        for step in self.steps[:-1]:
            step_scales = step.example_scales(stats)
            stats = stats.scaled_by(step_scales)
            scales = step_scales if scales is None else _multiply_weights(scales, step_scales)
        weights = self.steps[-1].example_weights(stats)
        return weights if scales is None else _multiply_weights(scales, weights)

    def finalize(self, result, stats):
        # Each step's reports from the statistics it scales (as example_weights), the final
        # rule's from the rescaled ones (DP rules, whose noise reads them, are refused).
        reports = []
        for step in self.steps[:-1]:
            reports.append(step.map_reports(stats, stats.batch_size))
            stats = stats.scaled_by(step.example_scales(stats))
        return _composed(self, reports, Aggregation.of(self.steps[-1].finalize(result, stats)))


@serializable
class CoordinateChain(Chain, CoordinateAggregator):
    """Pre-processing steps before a coordinate rule: the steps' rows, then the final
    rule variable by variable (the streaming path runs it so, from
    :meth:`steps_and_rule`: the steps' composed row map, then the rule's
    ``aggregate_variable`` on each variable's mapped rows)."""

    def __init__(self, steps, **kwargs):
        super().__init__(steps, **kwargs)
        self._check_kind()

    def aggregate_variable(self, gradient):
        raise TypeError(
            "A chain has no aggregate_variable of its own: its steps read every variable "
            "(a flat norm, one permutation for all); steps_and_rule() gives the steps and "
            "the coordinate rule to apply to their rows."
        )


@serializable
class Bucketing(RowMapStep):
    """Bucketing: random buckets of examples averaged, then a robust rule.

    Each call draws a random permutation of the batch (from a
    ``keras.random.SeedGenerator`` the aggregator owns: reproducible under
    ``keras.utils.set_random_seed``, usable under jit, saved with the model),
    splits it into ``ceil(B / size)`` consecutive buckets of ``size`` examples
    (the last one smaller when ``size`` does not divide ``B``) and averages each
    bucket. The bucket means go to ``aggregator``; without one, this is a
    pre-processing step of :func:`chain`. Kind ``"arbitrary"``. A
    differentially private ``aggregator`` is refused: which examples share a
    bucket depends on the whole batch, so one example can move the result by
    more than the DP rule's bound.

    Args:
        size: examples per bucket (``s`` in the paper).
        aggregator: the rule applied to the bucket means, or ``None``.
        seed: an integer for the permutation stream; ``None`` draws one from
            Python's global RNG (set by ``keras.utils.set_random_seed``).

    References:
        Karimireddy, He, Jaggi, 2022, "Byzantine-robust learning on
        heterogeneous datasets via bucketing", ICLR.
    """

    mixes_examples = True

    def __init__(self, size: int, aggregator=None, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.size = check_integer("bucketing", "size", size)
        self.aggregator = None if aggregator is None else get(aggregator)
        if self.aggregator is not None:
            _refuse_private(self.aggregator, "bucketing(...)")
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        if self.aggregator is not None:
            self.diagnostics = tuple(self.aggregator.diagnostics)
            self.min_batch_size = (self.aggregator.min_batch_size - 1) * self.size + 1

    def batch_size_requirement(self):
        return (
            f" Bucketing with size={self.size} makes ceil(B / {self.size}) buckets and "
            f"{type(self.aggregator).__name__} needs {self.aggregator.min_batch_size} of them."
        )

    def can_preprocess(self) -> bool:
        return self.aggregator is None

    def output_batch_size(self, batch_size: int) -> int:
        return math.ceil(batch_size / self.size)

    def build(self, shapes):
        if self.aggregator is not None and not self.aggregator.built:
            self.aggregator.build(shapes)
        self.built = True

    def row_map(self, stats, batch_size):
        """The buckets of a random permutation: ``(ceil(B / size), size)`` rows, the
        last bucket padded with weight-0 rows when ``size`` does not divide ``B``."""
        permutation = ops.argsort(keras.random.uniform((batch_size,), seed=self.seed_generator))
        if isinstance(batch_size, int):
            count = math.ceil(batch_size / self.size)
        else:
            count = (batch_size + self.size - 1) // self.size
        padded = count * self.size
        position = ops.arange(padded)
        valid = position < batch_size
        order = ops.where(valid, ops.take(permutation, ops.minimum(position, batch_size - 1)), 0)
        members = ops.minimum(batch_size - ops.arange(count) * self.size, self.size)
        weights = ops.cast(valid, "float32") / ops.cast(ops.repeat(members, self.size), "float32")
        return RowMap(
            ops.reshape(ops.cast(order, "int32"), (count, self.size)),
            ops.reshape(weights, (count, self.size, 1)),
        )

    def steps_and_rule(self):
        return None if self.aggregator is None else ([self], self.aggregator)

    def aggregate(self, gradients):
        if self.aggregator is None:
            raise TypeError(
                "bucketing(size) without an aggregator is a pre-processing step: use "
                "bucketing(size, aggregator) or chain(bucketing(size), aggregator)."
            )
        buckets = Aggregation.of(self.preprocess(gradients))
        return _composed(self, [buckets.reports], self.aggregator.aggregation(buckets.gradients))

    def get_config(self):
        aggregator = self.aggregator
        if aggregator is not None:
            aggregator = keras.saving.serialize_keras_object(aggregator)
        return {**super().get_config(), "size": self.size, "aggregator": aggregator, "seed": self.seed}


def _stateful(rule: Aggregator) -> bool:
    """Whether ``rule`` or a rule inside it keeps state (centered clipping's center, a
    random stream)."""
    return any(
        getattr(layer, "state_per_variable", False) or compat.seed_generators(layer)
        for layer in compat.flatten_layers(rule, include_self=True)
    )


def group_sizes(batch_size: int, groups: int) -> list[int]:
    """The sizes of ``groups`` contiguous groups of a batch, as ``tf.distribute`` splits a
    global batch over ``groups`` replicas: ``ceil(B / groups)`` rows each, in order, the
    last groups smaller or empty (``[3, 2]`` for 5 over 2, ``[2, 2, 1, 0]`` for 5 over 4)."""
    rows = -(-batch_size // groups)
    return [min(rows, max(0, batch_size - g * rows)) for g in range(groups)]


@serializable
class TwoLevel(Aggregator):
    """A two-level rule: ``local`` on each group of the batch, then ``across`` the groups.

    The batch of ``B`` examples is split into ``groups`` contiguous groups as
    ``tf.distribute.MirroredStrategy`` splits a global batch over ``groups``
    replicas: ``ceil(B / groups)`` examples each, in order, the last groups
    smaller; empty groups are skipped (5 examples over 4 groups: 2, 2, 1). ``local``
    reduces each group's per-example gradients to one gradient, and ``across``
    aggregates those ``G`` results as if they were ``G`` examples. Kind
    ``"arbitrary"``.

    This is a different aggregator from ``across`` over the whole batch: the
    default is a median of medians, not the median. Its robustness is per group:
    a group whose examples are all corrupted (a Byzantine replica, a poisoned
    data shard) is one bad "example" of ``across``, so a median across ``G``
    groups tolerates fewer than half of them bad, whatever each contains, while a
    few bad examples within a group are handled by ``local``. The definition
    does not depend on the devices; on ``groups`` TensorFlow replicas (a
    ``MirroredStrategy`` with ``R == groups``) each group is one replica's shard,
    and each replica applies ``local`` to its own shard and exchanges only its
    result (``R x P`` values instead of ``B x P``; docs/architecture.md,
    'Multi-device training'). With another number of replicas it runs on the
    gathered batch, as other rules of its kind.

    ``local`` is applied once per group, so it must keep no state (centered
    clipping, bucketing's random stream are refused there; ``across`` may).
    Differentially private rules are refused at either level. Diagnostics are
    ``across``'s (``local``'s, one per group, are dropped). A batch whose smallest
    non-empty group is too small for ``local``, or whose groups are too few for
    ``across``, raises (``ValueError``; TensorFlow's unknown batch sizes and shards:
    at run time); the sizes that work need not be contiguous (with ``groups=4``
    and a local rule needing 3 examples, 9 examples work and 10, split 3, 3, 3, 1,
    do not), and ``min_batch_size`` is the smallest.

    Args:
        groups: how many groups (the replicas of the intended setup).
        local: the rule within a group; an aggregator or its name.
        across: the rule across the groups' results; an aggregator or its name.
    """

    def __init__(self, groups: int, local="median", across="median", **kwargs):
        super().__init__(**kwargs)
        self.groups = check_integer("two_level", "groups", groups)
        self.local = get(local)
        self.across = get(across)
        for rule in (self.local, self.across):
            _refuse_private(rule, "two_level(...)")
        if _stateful(self.local):
            raise ValueError(
                f"two_level: the local rule {type(self.local).__name__} keeps state (a "
                "center, a random stream), but the local rule runs once per group (on "
                "several replicas, once per replica on its own shard), so its state would "
                "not be one well-defined sequence. Use a stateless local rule (median, "
                "trimmed_mean, mean, clip, ...); stateful rules may be the across rule."
            )
        if self.across.min_batch_size > self.groups:
            raise ValueError(
                f"two_level: the across rule {type(self.across).__name__} needs "
                f"{self.across.min_batch_size} rows and gets at most groups={self.groups} (one "
                "per group). Use more groups or another across rule."
            )
        self.diagnostics = tuple(self.across.diagnostics)
        self.min_batch_size = self._smallest_batch()

    def _problem(self, batch_size: int) -> str | None:
        """Why the rule is undefined for ``batch_size`` examples, or ``None``."""
        sizes = [n for n in group_sizes(batch_size, self.groups) if n > 0]
        small = [n for n in sizes if n < self.local.min_batch_size]
        if small:
            return (
                f" two_level splits {batch_size} examples into groups of {sizes} and the "
                f"local rule {type(self.local).__name__} needs {self.local.min_batch_size} "
                "examples in each."
            )
        if len(sizes) < self.across.min_batch_size:
            return (
                f" two_level splits {batch_size} examples into {len(sizes)} non-empty "
                f"groups and the across rule {type(self.across).__name__} needs "
                f"{self.across.min_batch_size} of them."
            )
        return None

    def _smallest_batch(self, limit: int = 100_000) -> int:
        for batch_size in range(1, limit):
            if self._problem(batch_size) is None:
                return batch_size
        raise ValueError(f"two_level: no batch size below {limit} satisfies both rules.")

    def check_batch_size(self, batch_size: int) -> None:
        super().check_batch_size(batch_size)
        # Not monotone: 10 examples in 4 groups leave a last group of 1.
        problem = self._problem(batch_size)
        if problem is not None:
            raise ValueError(
                f"Aggregator {self.name!r} (TwoLevel) is undefined for a batch of "
                f"{batch_size} examples:{problem}"
            )

    def batch_size_requirement(self):
        return self._problem(self.min_batch_size - 1) or ""

    def build(self, shapes):
        for rule in (self.local, self.across):
            if not rule.built:
                rule.build(shapes)
        self.built = True

    def _local(self, gradients) -> list:
        return self.local.aggregation(gradients).finish()[0]  # one per group: not reported

    def aggregate(self, gradients):
        batch_size = ops.shape(gradients[0])[0]
        if isinstance(batch_size, int):
            results, start = [], 0
            for size in group_sizes(batch_size, self.groups):
                if size:  # empty groups are skipped
                    results.append(self._local([g[start : start + size] for g in gradients]))
                start += size
            rows = [ops.stack([r[k] for r in results]) for k in range(len(gradients))]
            return self.across.aggregation(rows)
        # An unknown batch size (TensorFlow retraces a smaller last batch): every group
        # computed, an empty one on a stand-in row; the non-empty ones come first.
        rows_per = ops.maximum((batch_size + self.groups - 1) // self.groups, 1)
        results = []
        for g in range(self.groups):
            start = ops.minimum(g * rows_per, batch_size - 1)
            size = ops.maximum(ops.minimum(rows_per, batch_size - g * rows_per), 1)
            results.append(self._local([row_range(v, start, size) for v in gradients]))
        count = (batch_size + rows_per - 1) // rows_per
        stacked = [ops.stack([r[k] for r in results]) for k in range(len(gradients))]
        smallest = batch_size - (count - 1) * rows_per  # the last non-empty group
        return self.across.aggregation(self._checked([row_range(v, 0, count) for v in stacked], smallest,
                                                     count))

    def _checked(self, rows, smallest, count):
        """``rows`` made to wait for a run-time check that the smallest non-empty group
        and the number of groups are large enough for the rules (sizes unknown while
        tracing: ``check_batch_size`` could not run)."""
        for value, rule, what in ((smallest, self.local, "in its smallest non-empty group"),
                                  (count, self.across, "non-empty groups")):
            if rule.min_batch_size > 1:
                rows = adapter().assert_at_least(
                    value, rule.min_batch_size,
                    f"Aggregator {self.name!r} (TwoLevel): {type(rule).__name__} needs "
                    f"{rule.min_batch_size} examples; the batch has fewer {what}.",
                    rows,
                )
        return rows

    def group_count(self) -> int:
        return self.groups

    def aggregate_group(self, gradients) -> list:
        """``local`` on one group's per-example gradients (a replica's shard); an empty
        group gets a stand-in row of zeros, which :meth:`combine_groups` leaves out."""
        size = ops.shape(gradients[0])[0]
        padded = [ops.concatenate([g, ops.zeros((1,) + tuple(g.shape[1:]), g.dtype)]) for g in gradients]
        return self._local([row_range(g, 0, ops.maximum(size, 1)) for g in padded])

    def combine_groups(self, rows, sizes) -> Aggregation:
        """``across`` on the non-empty groups' results.

        Args:
            rows: per variable, the ``groups`` results of :meth:`aggregate_group` stacked
                in the groups' order (the examples' order in the batch).
            sizes: ``(groups,)`` int32, each group's number of examples.
        """
        position = ops.arange(self.groups, dtype="int32")
        nonempty = ops.greater(sizes, 0)
        order = ops.argsort(ops.where(nonempty, position, position + self.groups))
        count = ops.sum(ops.cast(nonempty, "int32"))
        smallest = ops.min(ops.where(nonempty, sizes, ops.max(sizes)))
        rows = [row_range(ops.take(r, order, axis=0), 0, count) for r in rows]
        return self.across.aggregation(self._checked(rows, smallest, count))

    def get_config(self):
        return {
            **super().get_config(),
            "groups": self.groups,
            "local": keras.saving.serialize_keras_object(self.local),
            "across": keras.saving.serialize_keras_object(self.across),
        }


def chain(*steps) -> Chain:
    """Pre-processing steps, then a final rule: ``chain(clip(1.0), bucketing(2), median())``.

    A :class:`WeightedChain`, a :class:`CoordinateChain` or a :class:`Chain`, as the steps'
    kind implies (:func:`_chain_class`).
    """
    steps = [get(step) for step in steps]
    return _chain_class(steps)(steps)


def bucketing(size: int, aggregator=None, seed: int | None = None) -> Bucketing:
    """Averages random buckets of ``size`` examples, then applies ``aggregator``."""
    return Bucketing(size, aggregator, seed=seed)


def two_level(groups: int, local="median", across="median") -> TwoLevel:
    """``local`` on each of ``groups`` contiguous groups of the batch, then ``across`` them."""
    return TwoLevel(groups, local, across)
