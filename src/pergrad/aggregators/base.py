"""The aggregator protocol.

An aggregator maps per-example gradients ``g_1..g_B`` (a list aligned with the
model's trainable variables, entry k of shape ``(B,) + variable_k.shape``) to
one gradient (a list of the variables' shapes). Any callable with that
signature is an aggregator. The classes here add what the engine can use to
pick a cheaper path (docs/architecture.md, 'Aggregator kinds'): the aggregator's *kind*.

- ``"statistics"`` (:class:`WeightedAggregator`): the result is
  ``sum_i w_i g_i`` (plus, optionally, noise) with weights computed from
  per-example statistics only: squared norms and, if asked, the Gram matrix.
- ``"coordinate"`` (:class:`CoordinateAggregator`): works one variable at a
  time and needs all B values of each coordinate (median, trimmed mean).
- ``"arbitrary"``: anything else; the user's own function.

Aggregators are Keras layers so that stateful rules keep their state as Keras
variables: tracked by the model, carried through JAX's stateless train step,
saved by ``model.save()`` and restored by ``keras.models.load_model()``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

import keras
from keras import ops

from pergrad import compat

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

_REGISTERED: dict[str, Callable[[], Aggregator]] = {}


def register(name: str):
    """Registers a factory under a string name (``"median"``) and for saving."""

    def decorate(factory):
        _REGISTERED[name] = factory
        return factory

    return decorate


def _serializable(cls):
    return keras.saving.register_keras_serializable(package="pergrad")(cls)


def batch_size_of(gradients) -> int:
    return ops.shape(gradients[0])[0]


def batch_sum(values):
    """``(B, ...) -> (...)``: the sum over the batch axis; on JAX as one matrix product.

    XLA:CPU reduces over a leading axis of a fused expression ~20x slower than it
    multiplies the transposed rows by a vector of ones (a 64 x 270k sign sum in a
    JAX step: 366 ms vs 16 ms; ones on the left: 78 ms).
    """
    if keras.backend.backend() != "jax":  # TensorFlow's reduction is the faster one (2x)
        return ops.sum(values, axis=0)
    rows = ops.reshape(values, (ops.shape(values)[0], -1))
    total = ops.matmul(ops.transpose(rows), ops.ones((ops.shape(values)[0],), rows.dtype))
    return ops.reshape(total, ops.shape(values)[1:])


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


def static_batch_size(gradients) -> int | None:
    size = gradients[0].shape[0]
    return int(size) if size is not None else None


@_serializable
class Aggregator(keras.layers.Layer):
    """Base class: ``aggregate(gradients) -> list`` of the variables' shapes.

    Subclasses set ``kind`` and implement :meth:`aggregate`. Rules that report
    what they did (fraction clipped, examples rejected) name the values in
    ``diagnostics`` and call :meth:`report` during ``aggregate``; the model
    logs them in ``History`` and the progress bar.
    """

    kind: str = ARBITRARY
    diagnostics: tuple[str, ...] = ()
    #: The smallest batch the rule is defined for.
    min_batch_size: int = 1
    #: Whether the rule carries a differential-privacy guarantee (DP-SGD).
    differentially_private: bool = False
    #: Whether the rule keeps state shaped like the trainable variables it was
    #: built for (centered clipping's center): it cannot follow a freeze.
    state_per_variable: bool = False
    #: Whether each coordinate's result depends on that coordinate's ``B`` values
    #: only (median, trimmed mean): the streaming path may then aggregate a
    #: variable in parts to bound memory (``microbatch_size``).
    coordinatewise: bool = False
    #: How the result splits over parts of the batch (:data:`LOCAL_MEAN`,
    #: :data:`LOCAL_SUM` or :data:`WHOLE_BATCH`): whether each replica may aggregate its
    #: own shard (``pergrad.step``), and whether padding rows matter. A subclass
    #: inherits its parent's; one whose weights read other examples must set
    #: ``WHOLE_BATCH``.
    distribution: str = WHOLE_BATCH

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        self._reports: dict = {}
        self._batch_terms: dict = {}

    def call(self, gradients, batch_term: bool = True):
        """The rule's result on ``gradients``; with ``batch_term=False`` without the term
        its :meth:`finalize` set aside for the batch to hold once (:meth:`pop_batch_term`)."""
        gradients = list(gradients)
        size = static_batch_size(gradients)
        if size is not None:
            self.check_batch_size(size)
        result = self.aggregate(gradients)
        term = self.pop_batch_term() if batch_term else None
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

    # -- use as a pre-processing step of ``chain`` -------------------------------------

    def preprocess(self, gradients: list) -> list:
        """Maps per-example gradients ``(B, ...)`` to ``(B', ...)`` for the next step of a chain.

        Only rules that have a natural per-example form (clipping, bucketing,
        filtering) implement it.
        """
        raise TypeError(
            f"{type(self).__name__} is not a pre-processing step: only its aggregate is "
            "defined. Put it last in chain(...)."
        )

    def can_preprocess(self) -> bool:
        """Whether this rule can be a pre-processing step (not last) of a chain."""
        return type(self).preprocess is not Aggregator.preprocess

    #: Whether :meth:`row_map` reads per-example statistics (squared norms).
    map_reads_statistics: bool = False
    #: Whether an output row of :meth:`row_map` combines several examples (bucketing):
    #: its statistics then do not follow from theirs.
    mixes_examples: bool = False

    def row_map(self, stats: ExampleStatistics | None, batch_size) -> RowMap:
        """The pre-processing step as a linear map of the batch (:class:`RowMap`).

        Steps whose output rows are weighted sums of input rows (clipping,
        filtering, bucketing) implement it, and their :meth:`preprocess` is its
        application; ``stats`` are the input rows' statistics (``None`` unless
        :attr:`map_reads_statistics`). The streaming path uses it instead of
        :meth:`preprocess`. Other steps raise ``NotImplementedError``.
        """
        raise NotImplementedError

    def apply_row_map(self, gradients: list) -> list:
        """:meth:`preprocess` of a step that has a :meth:`row_map`."""
        stats = ExampleStatistics.from_gradients(gradients) if self.map_reads_statistics else None
        rows = self.row_map(stats, batch_size_of(gradients))
        return [rows.apply(g, k) for k, g in enumerate(gradients)]

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
        return {
            name: value if count is None else value / ops.maximum(ops.cast(count, "float32"), 1.0)
            for name, (value, count) in reports.items()
        }

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


class ExampleStatistics:
    """Per-example statistics of a batch of per-example gradients.

    A squared norm overflows float32 long before the gradient does (entries
    above ~1e19 suffice), so the engine may keep each squared norm divided by
    the square of a ``scale`` (the largest entry of that example's gradient of
    that variable, say): the norms themselves (:attr:`norms`,
    :attr:`flat_norms`) are then right for every finite gradient whose norm is
    below float32's largest value. Rules should read those;
    :attr:`squared_norms` multiplies the scales back in.

    Args:
        squared_norms: ``(B, V)``, squared L2 norm of example i's gradient of
            variable k, divided by ``scale[i, k] ** 2`` when ``scale`` is given.
        gram: ``(B, B)`` Gram matrix ``<g_i, g_j>`` over all variables, or
            ``None`` when the aggregator did not ask for it (not rescaled: an
            example whose squared norm overflows has infinite entries).
        scale: ``(B, V)`` positive factors, or ``None`` (all one).
    """

    def __init__(self, squared_norms, gram=None, *, scale=None):
        self.scaled_squared_norms = squared_norms
        self.gram = gram
        self.scale = scale

    @property
    def batch_size(self):
        return ops.shape(self.scaled_squared_norms)[0]

    @property
    def squared_norms(self):
        """``(B, V)`` squared norms (infinite where one overflows float32)."""
        if self.scale is None:
            return self.scaled_squared_norms
        return self.scaled_squared_norms * ops.square(self.scale)

    @property
    def flat_squared_norms(self):
        """``(B,)`` squared norms of the flat gradients (infinite where one overflows)."""
        return ops.sum(self.squared_norms, axis=1)

    @property
    def norms(self):
        """``(B, V)`` L2 norms of example i's gradient of variable k, without overflow."""
        norms = ops.sqrt(self.scaled_squared_norms)
        return norms if self.scale is None else norms * self.scale

    @property
    def flat_norms(self):
        """``(B,)`` L2 norms of the flat gradients, without overflow."""
        if self.scale is None:
            return ops.sqrt(ops.sum(self.scaled_squared_norms, axis=1))
        largest = ops.max(self.scale, axis=1)
        relative = ops.square(self.scale / largest[:, None])
        return ops.sqrt(ops.sum(self.scaled_squared_norms * relative, axis=1)) * largest

    @property
    def finite(self):
        """``(B,)`` booleans: whether example i's statistics are finite (a gradient with a
        NaN or an infinity has a non-finite norm; an overflowing squared norm alone is not)."""
        finite = ops.all(ops.isfinite(self.scaled_squared_norms), axis=1)
        return finite if self.scale is None else finite & ops.all(ops.isfinite(self.scale), axis=1)

    def rows(self, rows) -> ExampleStatistics:
        """The statistics of the examples ``rows`` (``(J,)`` indices), in that order."""
        gram = self.gram
        if gram is not None:
            gram = ops.take(ops.take(gram, rows, axis=0), rows, axis=1)
        scale = None if self.scale is None else ops.take(self.scale, rows, axis=0)
        return ExampleStatistics(ops.take(self.scaled_squared_norms, rows, axis=0), gram, scale=scale)

    def scaled_by(self, factors) -> ExampleStatistics:
        """The statistics of ``f_i g_i`` (``(B,)`` factors, Gram matrix kept) or of
        ``f_ik g_ik`` (``(B, V)``: the Gram matrix is not known then)."""
        factors = ops.cast(factors, "float32")
        gram = None
        if len(factors.shape) == 1:
            if self.gram is not None:
                gram = factors[:, None] * self.gram * factors[None, :]
            factors = factors[:, None]
        # Into the scale, not the squared norms: a clip factor of 1e-19 squared underflows.
        scale = ops.ones_like(self.scaled_squared_norms) if self.scale is None else self.scale
        return ExampleStatistics(self.scaled_squared_norms, gram, scale=scale * ops.abs(factors))

    @classmethod
    def from_gradients(cls, gradients, gram: bool = False) -> ExampleStatistics:
        flat = [ops.reshape(g, (ops.shape(g)[0], -1)) for g in gradients]
        squared_norms, scale = squared_norms_of_rows(flat)
        gram_matrix = None
        if gram:
            gram_matrix = sum(ops.matmul(f, ops.transpose(f)) for f in flat)
        return cls(squared_norms, gram_matrix, scale=scale)


def row_scales(tensor):
    """``(B,)``: the largest absolute entry of each example's part of ``tensor`` (batch
    first), 1 where that is zero or not finite. Divided by it, no square overflows."""
    tensor = ops.cast(tensor, "float32")
    largest = ops.max(ops.abs(tensor), axis=tuple(range(1, len(tensor.shape))))
    return ops.where(ops.isfinite(largest) & (largest > 0), largest, ops.ones_like(largest))


def overflow_safe(plain, rescaled):
    """``(squared norms, scale)``: ``(plain, ones)`` when every entry of ``plain`` (``(B, V)``
    squared norms) is finite, else ``rescaled()``, which computes them divided by the
    square of a ``(B, V)`` scale. One branch runs (``keras.ops.cond``): the rescaling costs
    nothing unless a squared norm overflowed (or a gradient is not finite)."""
    plain = ops.cast(plain, "float32")

    def unscaled():
        return plain, ops.ones_like(plain)

    return ops.cond(ops.all(ops.isfinite(plain)), unscaled, rescaled)


def squared_norms_of_rows(rows: list):
    """``((B, V), (B, V))``: the squared norms of ``(B, n_k)`` gradient rows of ``V`` variables,
    without overflow (:func:`overflow_safe`; scaled by each row's largest entry)."""
    rows = [ops.cast(r, "float32") for r in rows]
    plain = ops.stack([ops.sum(r * r, axis=1) for r in rows], axis=1)

    def rescaled():
        norms, scales = scaled_squared_norms_of_rows(rows)
        return ops.stack(norms, axis=1), ops.stack(scales, axis=1)

    return overflow_safe(plain, rescaled)


def scaled_squared_norms_of_rows(rows: list):
    """``(norms, scales)``: for each ``(B, n)`` rows tensor, the ``(B,)`` squared norms of its
    rows divided by their largest entry, and those entries (:func:`row_scales`)."""
    scales = [row_scales(r) for r in rows]
    return [ops.sum(ops.square(r / s[:, None]), axis=1) for r, s in zip(rows, scales)], scales


def weighted_sum(gradients, weights) -> list:
    """``sum_i w_i g_i`` per variable; ``weights`` is ``(B,)`` or ``(B, V)``."""
    out = []
    for k, g in enumerate(gradients):
        w = weights if len(weights.shape) == 1 else weights[:, k]
        flat = ops.reshape(g, (ops.shape(g)[0], -1))
        out.append(ops.reshape(ops.matmul(ops.cast(w, g.dtype)[None, :], flat)[0], g.shape[1:]))
    return out


def finite_examples(gradients) -> object:
    """``(B,)`` booleans: whether example i's gradient is finite in every variable."""
    rows = [ops.reshape(g, (ops.shape(g)[0], -1)) for g in gradients]
    return ops.all(ops.stack([ops.all(ops.isfinite(r), axis=1) for r in rows], axis=1), axis=1)


def zero_non_finite_examples(gradients) -> list:
    """Sets to zero the gradient of every example that has a NaN or an infinity.

    ``PerExampleModel`` applies it before a differentially private rule,
    whatever wraps it and on every engine path: the example then contributes
    nothing, which the sensitivity bound allows, whereas a NaN update would
    reveal without noise that it was in the batch.
    """
    return zero_examples(finite_examples(gradients), list(gradients))


def zero_examples(keep, structure):
    """``structure`` (tensors with a leading batch axis) with example i's rows set to zero in
    every floating-point tensor where ``keep[i]`` is false.

    The zeroing runs only when some example is not kept (``keras.ops.cond``): a batch of
    finite examples costs one reduction, not a pass over every tensor (on eager torch that
    pass was a sixth of a DP step of a language model, whose LM head's output gradient is
    B x T x vocabulary). The step's duration then shows whether a batch held a non-finite
    example, as it shows anything else the data changes; only the released update is covered
    by the guarantee.
    """

    def zeroed():
        def where(t):
            if not _is_float_tensor(t):
                return t
            return ops.where(ops.reshape(keep, (-1,) + (1,) * (len(t.shape) - 1)), t, ops.zeros_like(t))

        return keras.tree.map_structure(where, structure)

    return ops.cond(ops.all(keep), lambda: structure, zeroed)


class RowMap:
    """A linear map of the batch of per-example gradients: what pre-processing steps do.

    Output row ``j`` of variable ``k`` is ``sum_t weights[j, t, k] g_{order[j, t]}``:
    clipping scales each row (``order`` the identity), ``norm_filter`` keeps some
    rows, ``bucketing`` averages groups of rows. Because the map is linear, the
    streaming path (``pergrad.engine.streaming``) can apply it to a layer's
    input and output gradient before any per-example gradient is formed, and
    the maps of consecutive steps compose into one.

    Attributes:
        order: ``(J, s)`` int32 row indices, or ``None``: the identity (``s = 1``).
        weights: ``(J, s, 1)`` (the same for every variable) or ``(J, s, V)``
            float32, or ``None`` (all one).
    """

    def __init__(self, order=None, weights=None):
        self.order, self.weights = order, weights

    @classmethod
    def scaling(cls, scales) -> RowMap:
        """Row i times ``scales[i]`` (``(B,)``) or ``scales[i, k]`` (``(B, V)``)."""
        scales = ops.cast(scales, "float32")
        return cls(None, scales[:, None, None] if len(scales.shape) == 1 else scales[:, None, :])

    @property
    def per_variable(self) -> bool:
        """Whether the weights differ between variables."""
        return self.weights is not None and self.weights.shape[2] != 1

    def variable_weights(self, k):
        """``(J, s)`` weights of variable ``k``, or ``None`` (all one)."""
        if self.weights is None:
            return None
        return self.weights[:, :, k if self.per_variable else 0]

    def then(self, second: RowMap) -> RowMap:
        """The map applying ``self``, then ``second`` to ``self``'s output rows."""
        if second.order is None:
            if self.weights is None or second.weights is None:
                return RowMap(self.order, second.weights if self.weights is None else self.weights)
            return RowMap(self.order, self.weights * second.weights)
        if self.order is None:  # s = 1: the second map's rows, reweighted
            weights = second.weights
            if self.weights is not None:
                first = ops.take(self.weights[:, 0], second.order, axis=0)  # (J2, s2, V)
                weights = first if weights is None else first * weights
            return RowMap(second.order, weights)
        order = ops.take(self.order, second.order, axis=0)  # (J2, s2, s1)
        size = ops.shape(order)
        weights = None
        if self.weights is not None:
            weights = ops.take(self.weights, second.order, axis=0)  # (J2, s2, s1, V)
        if second.weights is not None:
            outer = second.weights[:, :, None, :]
            weights = ops.repeat(outer, size[2], axis=2) if weights is None else weights * outer
        if weights is not None:
            weights = ops.reshape(weights, (size[0], size[1] * size[2], weights.shape[3]))
        return RowMap(ops.reshape(order, (size[0], size[1] * size[2])), weights)

    def statistics(self, stats: ExampleStatistics) -> ExampleStatistics | None:
        """The statistics of the output rows, where they follow from ``stats``: with one
        input row per output row (``s = 1``); the Gram matrix only with flat weights.
        ``None`` otherwise (a bucket mean's norm needs the Gram matrix of its rows)."""
        if self.order is not None and self.order.shape[1] != 1:
            return None
        if self.order is not None:
            stats = stats.rows(self.order[:, 0])
        if self.weights is None:
            return stats
        weights = self.weights[:, 0]  # (J, 1) or (J, V)
        return stats.scaled_by(weights if self.per_variable else weights[:, 0])

    def apply(self, gradient, k=0):
        """The map applied to variable ``k``'s per-example gradients ``(B, ...)``: ``(J, ...)``."""
        weights = self.variable_weights(k)
        if self.order is None:
            if weights is None:
                return gradient
            return gradient * _row_column(ops.cast(weights[:, 0], gradient.dtype), gradient)
        rows = ops.take(gradient, ops.reshape(self.order, (-1,)), axis=0)
        if weights is not None:
            rows = rows * _row_column(ops.cast(ops.reshape(weights, (-1,)), rows.dtype), rows)
        size = ops.shape(self.order)
        return ops.sum(ops.reshape(rows, (size[0], size[1]) + tuple(gradient.shape[1:])), axis=1)


def _row_column(values, like):
    """``(N,)`` values shaped to multiply the rows of ``like``."""
    return ops.reshape(values, (-1,) + (1,) * (len(like.shape) - 1))


@_serializable
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


def scale_examples(gradients, scales) -> list:
    """Multiplies example i's gradient by ``scales[i]`` (``(B,)``) or ``scales[i, k]`` (``(B, V)``)."""
    out = []
    for k, g in enumerate(gradients):
        s = scales if len(scales.shape) == 1 else scales[:, k]
        out.append(g * ops.reshape(ops.cast(s, g.dtype), (-1,) + (1,) * (len(g.shape) - 1)))
    return out


@_serializable
class ScaledMean(WeightedAggregator):
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
        return self.example_scales(stats) / ops.cast(stats.batch_size, "float32")

    map_reads_statistics = True

    def row_map(self, stats, batch_size):
        return RowMap.scaling(self.example_scales(stats))

    @protocol_form
    def preprocess(self, gradients):
        return self.apply_row_map(gradients)


@_serializable
class CoordinateAggregator(Aggregator):
    """Rules applied to one variable at a time: ``(B, ...) -> (...)``."""

    kind = COORDINATE

    def aggregate_variable(self, gradient):
        raise NotImplementedError

    @protocol_form
    def aggregate(self, gradients):
        return [self.aggregate_variable(g) for g in gradients]


@_serializable
class FunctionAggregator(Aggregator):
    """Wraps a plain function ``list[(B, ...)] -> list[(...)]`` (kind arbitrary).

    To save a model that uses it, register the function with
    ``keras.saving.register_keras_serializable`` (``get_config``, hence
    ``model.save()``, warns when ``load_model`` could not restore it). The
    function's result is type-checked before use: a list or tuple of float
    tensors, one per variable.
    """

    def __init__(self, function: Callable, per_variable: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.function = function
        self.per_variable = per_variable
        if per_variable:
            self.kind = COORDINATE

    def aggregate_variable(self, gradient):
        """A ``per_variable`` function's result for one variable (the streaming path's unit)."""
        return self.aggregate([gradient])[0]

    @protocol_form  # with per_variable (kind coordinate); other kinds have no parts
    def aggregate(self, gradients):
        if self.per_variable:
            result = [self.function(g) for g in gradients]
        else:
            result = self.function(gradients)
        # Checked before use: iterating over a tensor or a dict fails obscurely. Shapes
        # are left to `check_result`, which knows the variables' names.
        return _check_structure(
            result,
            [tuple(g.shape[1:]) for g in gradients],
            [f"#{k} (of {len(gradients)})" for k in range(len(gradients))],
            f"Aggregator function {_function_name(self.function)!r}",
            check_shapes=False,
        )

    def get_config(self):
        function = keras.saving.serialize_keras_object(self.function)
        if not _loadable(function):
            warnings.warn(
                f"The aggregator function {_function_name(self.function)!r} is not registered "
                "with Keras: a model saved with it cannot be loaded by "
                "keras.models.load_model() (unless it is given in custom_objects). Define it "
                "as a named function decorated with "
                "@keras.saving.register_keras_serializable() before saving.",
                UserWarning,
                stacklevel=2,
            )
        config = super().get_config()
        config.update(function=function, per_variable=self.per_variable)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["function"] = keras.saving.deserialize_keras_object(config["function"])
        return cls(**config)


def _function_name(function) -> str:
    return getattr(function, "__name__", type(function).__name__)


def _loadable(serialized) -> bool:
    """Whether ``load_model`` (safe mode, no custom objects) can restore a serialized function."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            keras.saving.deserialize_keras_object(serialized, safe_mode=True)
    except Exception:  # noqa: BLE001 - any failure means the saved model cannot be loaded
        return False
    return True


def per_variable(function: Callable) -> FunctionAggregator:
    """Lifts ``function((B, ...)) -> (...)`` to an aggregator, variable by variable."""
    return FunctionAggregator(function, per_variable=True)


def get(identifier) -> Aggregator:
    """An aggregator from a name (``"median"``), an instance, or a callable."""
    if identifier is None:
        identifier = "mean"
    if isinstance(identifier, Aggregator):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Aggregator):
        return identifier()  # the class itself (`Median`), not a function of gradients
    if isinstance(identifier, str):
        if identifier not in _REGISTERED:
            raise ValueError(
                f"Unknown aggregator {identifier!r}; known names: {sorted(_REGISTERED)}. "
                "Pass an aggregator object or a function to use another rule."
            )
        return _REGISTERED[identifier]()
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if callable(identifier):
        return FunctionAggregator(identifier)
    raise TypeError(
        f"An aggregator is a name, an Aggregator or a callable; got {identifier!r}."
    )


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


def _is_float_tensor(value) -> bool:
    if isinstance(value, (bool, int, float, complex)) or not hasattr(value, "dtype"):
        return False
    return hasattr(value, "shape") and "float" in keras.backend.standardize_dtype(value.dtype)


def _check_structure(result, shapes: Sequence, names: Sequence, who: str, check_shapes=True) -> list:
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
        if not _is_float_tensor(value):
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
    return _check_structure(
        result,
        [tuple(v.shape) for v in variables],
        [repr(v.path) for v in variables],
        f"Aggregator {aggregator_name!r}",
    )
