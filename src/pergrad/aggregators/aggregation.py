"""What a rule returns for a batch (:class:`Aggregation`): its result, and what the train step
does with it once per batch (diagnostics, DP noise, the sums its state follows).

Re-exported by ``pergrad.aggregators.base`` (the engine's one import of the rules) and
``pergrad.aggregators``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from keras import ops

from pergrad.tensors import cast

__all__ = ["Aggregation", "BatchTotals", "MeanOf", "report_values"]


class MeanOf(NamedTuple):
    """A diagnostic that is a mean over the batch's examples, ``total / count`` (0 for no
    example), reported as its sum and count: where each replica aggregates its own shard,
    the train step sums both over the replicas before dividing, so that the value describes
    the whole batch."""

    total: object
    count: object


class BatchTotals(NamedTuple):
    """Sums over the examples a call aggregated, and how the rule's state follows from their
    totals over the whole batch (adaptive clipping's count): ``update(totals)`` assigns the
    state and returns the diagnostics it makes (a dict, perhaps empty). On one device
    ``update(sums)``; where each replica aggregates its shard, the train step calls it with
    the sums added over the replicas, so that every replica updates alike."""

    sums: object
    update: Callable


def report_values(reports: dict, total=None) -> dict:
    """The logged value of each report: a :class:`MeanOf` divided out, after ``total`` (a
    function that sums a tensor over the replicas whose shards the rule aggregated on its
    own; ``None``: this call's own values) is applied once to all the sums and counts."""
    counted = [name for name, value in reports.items() if isinstance(value, MeanOf)]
    if counted and total is not None:
        sums = total(ops.stack([ops.cast(x, "float32") for name in counted for x in reports[name]]))
        totals = {name: MeanOf(sums[2 * k], sums[2 * k + 1]) for k, name in enumerate(counted)}
        reports = {**reports, **totals}

    def mean(value, count):
        if isinstance(count, int):  # (static: no maximum op)
            return cast(value, "float32") / float(max(count, 1))
        return value / ops.maximum(ops.cast(count, "float32"), 1.0)

    return {name: mean(*value) if isinstance(value, MeanOf) else value for name, value in reports.items()}


class Aggregation:
    """What a rule returns for a batch: the result and what the batch does with it once.

    ``aggregate`` (and a statistics rule's ``finalize``, a step's ``preprocess``) return
    either the result alone (a list, one tensor per variable) or an ``Aggregation`` of it;
    nothing is set on the rule for the train step to collect.

    Attributes:
        gradients: the result, one tensor per variable (without ``batch_term``).
        reports: diagnostics by name (each one of the rule's ``diagnostics``): a scalar,
            or a :class:`MeanOf` (a mean over the examples: its sum and count).
        batch_term: a part of the result the batch holds once however its examples are
            split (DP noise), aligned with ``gradients``, or ``None``: calling the rule
            adds it; on several replicas whose results are summed the train step adds it
            on replica 0 only.
        batch_totals: :class:`BatchTotals` (state that follows from the whole batch's
            sums), or ``None``.
    """

    __slots__ = ("gradients", "reports", "batch_term", "batch_totals")

    def __init__(self, gradients, reports: dict | None = None, batch_term: list | None = None,
                 batch_totals: BatchTotals | None = None):
        self.gradients = gradients
        self.reports = dict(reports or {})
        self.batch_term = batch_term
        self.batch_totals = batch_totals

    @classmethod
    def of(cls, value) -> Aggregation:
        """``value`` if it is an ``Aggregation``, else the aggregation of that result alone."""
        return value if isinstance(value, Aggregation) else cls(value)

    def with_gradients(self, gradients) -> Aggregation:
        """This aggregation with ``gradients`` as its result."""
        return Aggregation(gradients, self.reports, self.batch_term, self.batch_totals)

    def finish(self, total=None, once=None) -> tuple[list, dict]:
        """``(gradients, reports)`` of the batch: the batch term added (through ``once``,
        which keeps it on one replica of several), the state updated from the batch totals
        (their sums through ``total``, which adds them over the replicas) and the
        diagnostics' logged values (:func:`report_values`). Without arguments: one call's."""
        result, reports = self.gradients, dict(self.reports)
        if self.batch_term is not None:
            once = once or (lambda value: value)
            result = [g + once(t) for g, t in zip(result, self.batch_term)]
        if self.batch_totals is not None:  # the same totals, hence the same state, everywhere
            sums, update = self.batch_totals
            reports.update(update(sums if total is None else total(sums)) or {})
        return result, report_values(reports, total)
