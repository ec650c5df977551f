"""Aggregation in chunks: the memory that ``microbatch_size`` bounds.

For ``mean``, ``sum`` and every rule of kind ``"statistics"`` (a
:class:`~pergrad.aggregators.WeightedAggregator`: the result is
``sum_i w_i g_i`` with weights from per-example statistics), the aggregate is
accumulated one chunk of ``microbatch_size`` examples at a time, in a graph
loop, so that at most one chunk's per-example gradients (two for the Gram
matrix) are alive at once:

- ``mean``/``sum``: one pass, accumulating ``sum_i g_i``.
- statistics rules: pass 1 computes each example's squared norms (and the
  Gram matrix when the rule reads it), ``example_weights`` runs once on the
  whole batch's statistics, pass 2 recomputes each chunk's gradients and
  accumulates ``sum_i w_i g_i``, and ``finalize`` (DP noise) runs once.
- The Gram matrix's block (a, b) needs chunks a and b together: pass 1 runs,
  for each chunk a, a loop over every chunk b that recomputes b's gradients.
  That is ``C + C^2`` chunk passes (``C = ceil(B / m)``) instead of ``C``, for
  peak memory of two chunks; pass 2 adds ``C``.

Every example's scale is the whole batch's (``B`` for a sum reduction,
``B valid_i / sum_j valid_j`` for masks, the loss scale of mixed precision),
and its dropout seeds are those of the unchunked call: results equal the
unchunked path up to float rounding. The last chunk is padded with copies of
the first example; padded rows get weight 0 and are left out of every
statistic. Coordinate and arbitrary rules need all ``B`` per-example gradients
of a variable at once and do not use this module.
"""

from __future__ import annotations

import math

from keras import ops, tree

from pergrad.aggregators.base import (
    LOCAL_MEAN,
    STATISTICS,
    Aggregation,
    ExampleStatistics,
    WeightedAggregator,
    squared_norms_of_rows,
    zero_non_finite_examples,
)
from pergrad.backend import adapter, eager
from pergrad.engine.collectives import ONE_DEVICE
from pergrad.tensors import example_rows


def supports(aggregator) -> bool:
    """Whether ``aggregator``'s result can be accumulated chunk by chunk.

    A statistics rule whose ``aggregate`` is the protocol's (``example_weights``
    then ``finalize``: :meth:`~pergrad.aggregators.Aggregator.in_protocol_form`). A
    subclass that overrides ``aggregate`` gets all ``B`` per-example gradients.
    """
    if not isinstance(aggregator, WeightedAggregator) or aggregator.kind != STATISTICS:
        return False
    return aggregator.in_protocol_form("aggregate")


class _Chunks:
    """The batch in chunks of ``chunk`` examples, and loops over them.

    Where loops run eagerly (torch), chunks are slices and the last one is
    smaller; torch's unseeded random layers draw from its global generator, so
    its state before each chunk of the first pass is recorded and every later
    pass over that chunk replays it (the same dropout masks). In a traced loop
    (TF graph, JAX jit) the batch is padded to ``C * chunk`` rows with copies of
    the first example, weighted 0; examples draw from their own seed states.
    """

    def __init__(self, batched, batch_size, chunk):
        self.batch_size, self.chunk = batch_size, chunk
        self.eager = eager()
        self.tokens, self.end = [], None
        if self.eager:
            self.batched = batched
            return
        self.count = (batch_size + chunk - 1) // chunk
        self.padded = self.count * chunk
        position = ops.arange(self.padded)
        self.present = position < batch_size
        rows = ops.where(self.present, position, ops.zeros_like(position))

        def pad(t):
            if t.shape[0] is not None and isinstance(self.padded, int) and t.shape[0] == self.padded:
                return t  # the seed states, made for the padded batch
            return ops.take(t, rows, axis=0)

        self.xs = tree.map_structure(lambda t: self._split(pad(t)), batched)

    def _split(self, t):
        return ops.reshape(t, (self.count, self.chunk) + tuple(ops.shape(t)[1:]))

    def _join(self, t):
        """``(C, m, ...) -> (B, ...)``."""
        return ops.reshape(t, (self.padded,) + tuple(ops.shape(t)[2:]))[: self.batch_size]

    def loop(self, f, init, extra=None, record=False):
        """Runs ``f(carry, item) -> (carry, out)`` over the chunks.

        ``item`` holds the chunk's ``batch``, ``present`` (1 for real rows, 0 for
        padding) and its rows of ``extra`` (a ``(B, ...)`` tensor). Every leaf
        of ``out`` has one row per example of the chunk; the rows of all chunks
        are returned in batch order, ``(B, ...)``.
        """
        if self.eager:
            carry, outs = init, []
            for index, start in enumerate(range(0, self.batch_size, self.chunk)):
                rows = slice(start, min(start + self.chunk, self.batch_size))
                item = {
                    "batch": tree.map_structure(lambda t, rows=rows: t[rows], self.batched),
                    "present": ops.ones((rows.stop - start,), "float32"),
                }
                if extra is not None:
                    item["extra"] = extra[rows]
                if record:
                    self.tokens.append(adapter().random_state())
                else:
                    adapter().set_random_state(self.tokens[index])
                carry, out = f(carry, item)
                outs.append(out)
            if record:
                self.end = adapter().random_state()
            else:
                adapter().set_random_state(self.end)
            return carry, tree.map_structure(lambda *ts: ops.concatenate(ts, axis=0), *outs)
        xs = {"batch": self.xs, "present": self._split(ops.cast(self.present, "float32"))}
        if extra is not None:
            missing = self.padded - self.batch_size
            zeros = ops.zeros((missing,) + tuple(extra.shape[1:]), extra.dtype)
            xs["extra"] = self._split(ops.concatenate([extra, zeros], axis=0))
        carry, outs = adapter().scan(f, init, xs)
        return carry, tree.map_structure(self._join, outs)


def aggregate(
    problem,
    aggregator: WeightedAggregator,
    trainable_values,
    non_trainable_values,
    x,
    y=None,
    sample_weight=None,
    microbatch_size: int = 1,
    loss_scale=None,
    collectives=ONE_DEVICE,
    units=None,
):
    """``aggregator``'s result over the batch, computed ``microbatch_size`` examples at a time.

    Args:
        problem: the :class:`~pergrad.engine.PerExampleProblem`.
        aggregator: a rule for which :func:`supports` holds.
        trainable_values, non_trainable_values: the model's variable values.
        x, y, sample_weight: the batch.
        microbatch_size: examples per chunk.
        loss_scale: a ``LossScaleOptimizer``'s scale, or ``None``.
        collectives: where the batch starts in the whole batch (each example's random stream).
        units: each example's unit id, for a rule that reads them (the statistics'
            ``units``), or ``None``.

    Returns:
        ``(result, aux)`` as :meth:`PerExampleProblem.compute` would give with
        ``aggregator`` applied to its gradients: ``result`` the rule's
        :class:`~pergrad.aggregators.base.Aggregation` (its gradients aligned with the
        trainable variables, unscaled), ``aux`` with the whole batch's ``loss``,
        ``y_pred``, ``mask`` (masked outputs) and advanced ``seeds``.
    """
    if not supports(aggregator):
        raise TypeError(f"{type(aggregator).__name__} is not a statistics rule.")
    chunk = int(microbatch_size)
    # Constants here: on torch, values that require grad would make every chunk's
    # per-example gradients part of an autograd graph kept alive by the sums.
    trainable_values = [ops.stop_gradient(v) for v in trainable_values]
    batch_size = ops.shape(ops.convert_to_tensor(tree.flatten(x)[0]))[0]
    if isinstance(batch_size, int):
        aggregator.check_batch_size(batch_size)
    padded = (batch_size + chunk - 1) // chunk * chunk
    batched, batch_size, non_trainable, example_loss_scale = problem.batched_inputs(
        non_trainable_values, x, y, sample_weight, loss_scale, padded_size=padded,
        collectives=collectives,
    )
    shared = {"non_trainable": non_trainable, "loss_scale": example_loss_scale}
    chunks = _Chunks(batched, batch_size, chunk)
    private = getattr(aggregator, "differentially_private", False)
    one_pass = not aggregator.reads_statistics  # every weight 1 / B or 1
    shapes = [tuple(v.shape) for v in trainable_values]

    def gradients(inputs):
        if "sample_weight" in inputs:
            # Keras's loss scales the weights by the mask in place: each pass its own copy.
            inputs = {**inputs, "sample_weight": tree.map_structure(ops.copy, inputs["sample_weight"])}
        grads, aux = adapter().vectorized_grad(
            problem.example_loss, trainable_values, inputs, shared, None
        )
        if private:
            grads = zero_non_finite_examples(grads)
        return [example_rows(g) for g in grads], aux

    def accumulate(sums, rows, weights):
        return [
            s + ops.matmul(ops.cast(w, r.dtype)[None, :], r)[0]
            for s, r, w in zip(sums, rows, weights)
        ]

    def first_pass(sums, item):
        rows, aux = gradients(item["batch"])
        # Example i's share of the batch normalization known from its own pass
        # (its valid steps); the whole batch's constants are applied after the loop.
        partial = item["present"]
        if "valid" in aux:
            partial = partial * ops.cast(aux["valid"], "float32")
        out = {"loss": aux["loss"], "y_pred": aux["y_pred"], "partial": partial,
               "seeds": aux["seeds"]}
        if "mask" in aux:
            out["mask"] = aux["mask"]
        if one_pass:
            sums = accumulate(sums, rows, [partial] * len(rows))
        else:
            norms, scale = squared_norms_of_rows(rows)
            # (every chunk's scale a tensor: one chunk's may be None on torch, another's not)
            out["squared_norms"], out["scale"] = norms, ops.ones_like(norms) if scale is None else scale
        return sums, out

    zeros = [ops.zeros((math.prod(s),), dtype=v.dtype) for s, v in zip(shapes, trainable_values)]
    sums, out = chunks.loop(first_pass, zeros, record=True)

    partial = out["partial"]
    # The whole batch's constant (docs/architecture.md, 'Per-example gradients'), the
    # same for every example: B for a sum reduction, B / sum_j valid_j for masks
    # (valid_i is in `partial`).
    masked = "mask" in out or problem.loss_masks
    constant = problem.scale_constant(partial if masked else None, batch_size)
    if constant is None:
        constant = ops.convert_to_tensor(1.0, "float32")
    example_scale = partial * constant
    # Gradients were computed times the loss scale; callers get unscaled ones.
    gradient_constant = constant
    if example_loss_scale is not None:
        gradient_constant = gradient_constant / ops.cast(example_loss_scale, "float32")
    gradient_scale = partial * gradient_constant

    if one_pass:
        if aggregator.distribution == LOCAL_MEAN:  # 1 / B
            gradient_constant = gradient_constant / ops.cast(batch_size, "float32")
        result = Aggregation([
            ops.reshape(s * ops.cast(gradient_constant, s.dtype), shape)
            for s, shape in zip(sums, shapes)
        ])
    else:
        gram = None
        if aggregator.needs_gram:

            def gram_rows(unused, item):
                rows = gradients(item["batch"])[0]

                def block(unused, other):
                    other_rows = gradients(other["batch"])[0]
                    return unused, sum(ops.matmul(o, ops.transpose(r)) for r, o in zip(rows, other_rows))

                return unused, ops.transpose(chunks.loop(block, ops.zeros(()))[1])

            gram = chunks.loop(gram_rows, ops.zeros(()))[1]
            gram = gram * gradient_scale[:, None] * gradient_scale[None, :]
        stats = ExampleStatistics(out["squared_norms"], gram, scale=out["scale"] * gradient_scale[:, None],
                                  units=units)
        weights = ops.cast(aggregator.example_weights(stats), "float32")
        if len(weights.shape) == 1:
            weights = weights * gradient_scale
        else:
            weights = weights * gradient_scale[:, None]

        def second_pass(sums, item):
            rows = gradients(item["batch"])[0]
            w = item["extra"]
            per_variable = [w] * len(rows) if len(w.shape) == 1 else [w[:, k] for k in range(len(rows))]
            return accumulate(sums, rows, per_variable), ops.zeros_like(item["present"])

        sums = chunks.loop(second_pass, zeros, extra=weights)[0]
        result = Aggregation.of(
            aggregator.finalize([ops.reshape(s, shape) for s, shape in zip(sums, shapes)], stats)
        )

    aux = {
        "loss": out["loss"] * ops.cast(example_scale, out["loss"].dtype),
        "y_pred": out["y_pred"],
        # Every example advanced its own copy of each seed state by the same count.
        "seeds": problem.advanced_seeds(non_trainable, out["seeds"]),
    }
    if "mask" in out:
        aux["mask"] = out["mask"]
    return result, aux
