"""The streaming path: coordinate rules one variable at a time, from each layer's ``A`` and ``D``.

A coordinate rule (median, trimmed mean, MeaMed, sign majority, a
``per_variable`` function) needs all ``B`` values of each coordinate, but of
one variable at a time (docs/architecture.md, 'The streaming path'). After the
statistics path's forward and backward pass (each planned call's input ``A``
and output gradient ``D``), each call's per-example gradients are formed by its
layer rule, aggregated variable by variable and dropped: the ``B x P`` tensor
of every variable never exists at once.

Pre-processing steps before the coordinate rule (``chain(clip(C), median())``,
``bucketing(s, median())``, ``chain(norm_filter(drop_fraction=f), ...)``) are
linear maps of the batch (:class:`~pergrad.aggregators.base.RowMap`): their
weights come from per-example squared norms (the statistics path's, no
per-example gradient), and the composed map is applied to ``A`` and ``D`` where
the layer rule allows (``Dense``, ``Embedding``: a bucket's gradient is that of
one "example" made of its members' positions), so that only the ``J`` output
rows are formed.
"""

from __future__ import annotations

import math

from keras import ops

from pergrad.aggregators.base import COORDINATE, Aggregation, ExampleStatistics
from pergrad.backend import eager, optional_kernel
from pergrad.engine import statistics
from pergrad.engine.collectives import ONE_DEVICE
from pergrad.layer_rules.dense import OuterRows, outer_rows


def plan(aggregator):
    """``(steps, final)``: the linear pre-processing steps and the coordinate rule, or ``None``.

    Covers coordinate rules, ``bucketing(size, rule)`` and chains whose steps are
    clipping / automatic clipping / ``norm_filter(drop_fraction=...)`` /
    ``bucketing(size)`` and whose last rule is one of these. A step that reads
    statistics after a bucketing is not covered (a bucket mean's norms need more
    than per-example norms).
    """
    parts = aggregator.steps_and_rule()
    if parts is None:
        # A rule that works variable by variable (its aggregate is aggregate_variable's).
        variable_wise = aggregator.kind == COORDINATE and aggregator.in_protocol_form("aggregate")
        return ([], aggregator) if variable_wise else None
    outer, last = parts
    inner = plan(last)
    if inner is None:
        return None
    every, final = list(outer) + inner[0], inner[1]
    # Each step its row map (not a preprocess of its own).
    if not all(step.in_protocol_form("preprocess") for step in every):
        return None
    mixing = False
    for step in every:
        if mixing and step.map_reads_statistics:
            return None
        mixing = mixing or step.mixes_examples
    return every, final


#: eager backends: the most bytes of one variable's per-example gradients formed at once
#: by a coordinate-wise rule without ``microbatch_size`` (torch, MLP 784-256-256-10 at
#: B = 64: a 51 MB kernel in 7 parts of 7 MB, ~25% faster per step: a block larger than
#: glibc's largest mmap threshold (32 MiB) is fresh memory, page by page, at every step)
EAGER_PIECE_BYTES = 8 << 20


def _eager_pieces(variables, rows) -> int:
    """How many parts a ``Dense`` kernel is formed in on an eager backend (1 elsewhere):
    enough that the largest variable's ``rows`` gradients (the batch's, or its buckets')
    stay under ``EAGER_PIECE_BYTES`` (its coordinates' results do not depend on it)."""
    if not eager() or not isinstance(rows, int):
        return 1
    largest = max((math.prod(v.shape) for v in variables), default=0)
    return max(1, -(-rows * largest * 4 // EAGER_PIECE_BYTES))


def _takes_factors(final) -> bool:
    """Whether ``final`` gets a 2-D input's kernel rows as factors: its own
    ``aggregate_variable`` says it takes them
    (:func:`~pergrad.aggregators.base.takes_outer_rows`), on a backend whose adapter
    selects over them (torch: ``outer_rank_sums``)."""
    method = getattr(type(final), "aggregate_variable", None)
    return (getattr(method, "takes_outer_rows", False)
            and optional_kernel("outer_rank_sums") is not None)


def _reports(aggregator, step_reports: list) -> dict:
    """``aggregator``'s diagnostics from those of :func:`plan`'s steps (``step_reports``, in
    order), as each composite rule names its steps' (``steps_reports``)."""
    parts = aggregator.steps_and_rule()
    if parts is None:  # the final rule: a coordinate rule reports nothing variable by variable
        return {}
    outer, last = parts
    inner = _reports(last, step_reports[len(outer):])
    return aggregator.steps_reports([*step_reports[:len(outer)], inner])


def supports(aggregator) -> bool:
    """Whether the streaming path can run ``aggregator`` (see :func:`plan`)."""
    return plan(aggregator) is not None


def aggregate(problem, aggregator, trainable_values, non_trainable_values, x, y=None,
              sample_weight=None, loss_scale=None, microbatch_size=None, collectives=ONE_DEVICE):
    """A coordinate rule's result over the batch, one variable at a time.

    With ``microbatch_size`` ``m`` and a coordinate-wise final rule (median, trimmed
    mean, MeaMed, sign majority; not a ``per_variable`` function, which may mix a
    variable's coordinates), a ``Dense`` kernel is formed and aggregated in
    ``ceil(B / m)`` blocks of input features: about ``m`` x its size at once.

    Returns ``(result, aux)`` as :func:`pergrad.engine.statistics.aggregate` (the steps'
    diagnostics in ``result.reports``), with
    ``aux["finite"]``: whether every per-example gradient was finite (the step
    makes the update NaN otherwise, as on the materialized path). ``collectives``
    (:class:`~pergrad.engine.collectives.Collectives`): each layer's ``A`` and ``D`` over
    the batch the rule sees (``whole_batch``), of which this device aggregates its own
    parts of the variables (``owns``; zeros elsewhere): the devices' sum is the result.
    Raises
    :class:`~pergrad.engine.statistics.Unsupported` when the model needs the
    materialized path.
    """
    steps, final = plan(aggregator)
    batched, batch_size, non_trainable, shared, inverse = statistics.prepare(
        problem, aggregator, non_trainable_values, x, y, sample_weight, loss_scale, collectives
    )
    variables = problem.model.trainable_variables
    layers, aux = statistics.layers_of(problem, trainable_values, batched, shared, batch_size, inverse)
    pieces = 1
    if microbatch_size is not None and final.coordinatewise and isinstance(batch_size, int):
        pieces = -(-batch_size // microbatch_size)
    eager = microbatch_size is None and final.coordinatewise and collectives.works_alone
    layers = collectives.whole_batch(collectives.by_example(layers))
    batch_size = collectives.whole_size(batch_size)
    if final.coordinatewise:  # a Dense kernel in at least one part per device
        pieces = max(pieces, collectives.parts)
    finite = []
    stats, rows, size, step_reports = None, None, batch_size, []
    if any(step.map_reads_statistics for step in steps):
        norms, scale = layers.squared_norms(batch_size)
        stats = ExampleStatistics(norms, scale=scale)
        # Every example counts, also those a step drops or scales to zero: its gradient
        # is finite if its norms are.
        finite.append(ops.all(stats.finite))
    for step in steps:
        mapping = step.row_map(stats, size)
        step_reports.append(step.map_reports(stats, size))
        stats = None if stats is None else mapping.statistics(stats)
        rows = mapping if rows is None else rows.then(mapping)
        if mapping.order is not None:
            size = mapping.order.shape[0] or ops.shape(mapping.order)[0]
    if eager:  # the rows the rule gets: J buckets, or the B examples
        pieces = _eager_pieces(variables, size)
    flags, covered = layers.finite_from_layers()
    finite.extend(flags)
    parts = [[] for _ in variables]
    # A 2-D input's Dense kernel rows as factors: torch selects over them a block at a time
    # (the products formed in cache, straight into the sort's layout; with microbatch_size
    # too: less memory than its blocks).
    factored = collectives.works_alone and _takes_factors(final)
    with outer_rows(factored):
        for piece, (k, gradients) in enumerate(layers.mapped(rows, variables, size, pieces)):
            _aggregate_part(final, variables, piece, k, gradients, collectives, covered, finite, parts)
    result = [p[0] if len(p) == 1 else ops.concatenate(p, axis=0) for p in parts]
    aux = statistics.finish_aux(problem, aux, non_trainable)
    aux["finite"] = collectives.all_true(ops.all(ops.stack(finite)))
    return Aggregation(result, reports=_reports(aggregator, step_reports)), aux


def _aggregate_part(final, variables, piece, k, gradients, collectives, covered, finite, parts):
    """Aggregates one part of variable ``k``'s rows into ``parts[k]`` (its finiteness into
    ``finite`` where the layers' checks do not cover it)."""
    dtype = variables[k].dtype
    if isinstance(gradients, OuterRows):  # (only where this device works alone)
        if k not in covered:
            finite.append(gradients.all_finite())
        parts[k].append(ops.cast(final.aggregate_variable(gradients), dtype))
        return
    mine = collectives.owns(piece)
    if mine is False:  # another device's part
        parts[k].append(ops.zeros(tuple(gradients.shape[1:]), dtype))
        return
    if k not in covered:
        finite.append(ops.all(ops.isfinite(gradients)))
    value = ops.cast(final.aggregate_variable(collectives.spread_coordinates(gradients)), dtype)
    if mine is not True:
        value = ops.where(mine, value, ops.zeros_like(value))
    parts[k].append(value)
