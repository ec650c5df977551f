"""What the engine and the train step ask of the devices that share a step: on one, nothing.

A step is handed one :class:`Collectives` object and calls its methods where a step
split over several devices would exchange something. This class is the one-device
answer: every method is the identity, every flag its one-device value, so that the
single-device code reads straight through. ``pergrad.distributed`` subclasses it
for several devices (docs/multi-device.md); the engine never asks how many there are.
"""

from __future__ import annotations


class Collectives:
    """The collectives of a step on one device: none."""

    #: Whether this device forms every per-example row and coordinate of its batch by
    #: itself, so that it may form them in eager blocks or from their factors.
    works_alone = True
    #: How many devices a coordinate rule's variables are split over (round robin).
    parts = 1
    #: Sums a tensor over the parts of the batch that the rule aggregated one by one,
    #: or ``None`` where the rule saw the whole batch (``Aggregation.finish``'s ``total``).
    part_sum = None

    # -- the engine ------------------------------------------------------------------

    def first_example(self, batch_size):
        """Where this batch starts in the whole batch (each example's random stream)."""
        return 0

    def whole_size(self, batch_size):
        """The size of the batch the rule sees."""
        return batch_size

    def gather(self, value):
        """``value`` (examples first) over the batch the rule sees."""
        return value

    def whole_batch(self, layers):
        """``layers`` (:class:`~pergrad.engine.layers.Layers`) over the batch the rule sees."""
        return layers

    def own_rows(self, values, batch_size):
        """The rows of this batch's examples in ``values``, rows of :meth:`whole_size`."""
        return values

    def owns(self, piece: int):
        """Whether this device aggregates part number ``piece`` of a split result (a bool
        or a scalar boolean tensor)."""
        return True

    def all_true(self, flag):
        """``flag`` (a scalar boolean), true where every device's is."""
        return flag

    def by_example(self, layers):
        """``layers`` laid out by example over the devices (a layout, same values)."""
        return layers

    def spread_coordinates(self, gradients):
        """One variable's per-example rows laid out by coordinate (a layout, same values)."""
        return gradients

    # -- the train step ----------------------------------------------------------------

    def engine_loss_scale(self, loss_scale):
        """The loss scale the backward pass uses (``None`` without one)."""
        return loss_scale

    def apply_rule(self, aggregator, per_example, units=None):
        """The rule's :class:`~pergrad.aggregators.base.Aggregation` of the per-example
        gradients (``units``: each example's unit id, for a rule that reads them)."""
        return aggregator.aggregation(per_example, units=units)

    def once(self, value):
        """``value``, to be counted once in the result of every device."""
        return value

    def check_masked_output(self) -> None:
        """Raises where a masked output cannot be trained exactly."""

    def own_part(self, result, loss_scaled: bool) -> list:
        """This device's part of the step's ``result`` (``loss_scaled``: under a
        ``LossScaleOptimizer``)."""
        return result

    def logged_loss(self, loss):
        """``loss`` (the engine's whole-batch loss) as Keras logs the batch, or ``None``
        where the train step must compute it."""
        return loss


#: The collectives of a step on one device.
ONE_DEVICE = Collectives()
