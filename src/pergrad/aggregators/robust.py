"""Byzantine-robust rules: MeaMed, Krum, geometric median, centered clipping,
sign majority and a norm filter.

A rule that tolerates a fraction of bad examples takes it as ``byzantine``:
``f = floor(byzantine * B)`` examples of a batch of ``B`` may be arbitrary.
Rules that need the Gram matrix ``G_ij = <g_i, g_j>`` (Krum, geometric median)
work in B-space only (docs/architecture.md, 'Aggregator kinds'): a pairwise squared distance is
``G_ii + G_jj - 2 G_ij`` and the distance from ``g_i`` to ``z = sum_j w_j g_j``
is ``G_ii - 2 (G w)_i + w^T G w``; no ``B x B x P`` tensor is ever built.

Everything here is ``keras.ops`` and works with a batch size only known at run
time (TensorFlow retraces a partial last batch with an unknown batch size).
"""

from __future__ import annotations

import math

from keras import ops

from pergrad.aggregators import selection
from pergrad.aggregators.base import (
    Aggregation,
    Aggregator,
    CoordinateAggregator,
    ExampleStatistics,
    RowMap,
    RowMapStep,
    WeightedAggregator,
    batch_size_of,
    batch_sum,
    protocol_form,
    serializable,
    takes_outer_rows,
    weighted_sum,
)
from pergrad.aggregators.basic import clip_factors
from pergrad.aggregators.registry import register
from pergrad.arguments import check_integer, check_number


def _check_fraction(owner: str, name: str, value: float) -> float:
    return check_number(owner, name, value, low=0.0, high=0.5, high_open=True)


def _count(fraction: float, batch_size):
    """``floor(fraction * B)``: a Python int for a static batch size, else an int32 tensor."""
    if isinstance(batch_size, int):
        return math.floor(fraction * batch_size)
    return ops.cast(ops.floor(fraction * ops.cast(batch_size, "float32")), "int32")


def pairwise_squared_distances(gram):
    """``(B, B)``: ``||g_i - g_j||^2 = G_ii + G_jj - 2 G_ij`` (at least 0), infinite for a pair
    with an example whose squared norm ``G_ii`` is not finite (inf - inf would be NaN)."""
    squared = ops.diagonal(gram)
    far = ~ops.isfinite(squared)
    distances = ops.maximum(squared[:, None] + squared[None, :] - 2.0 * gram, 0.0)
    return ops.where(far[:, None] | far[None, :], math.inf, distances)


def _ranks(values):
    """Rank of each entry of a vector in ascending order (ties broken by position)."""
    return ops.argsort(ops.argsort(values))


def _float(value):
    return ops.cast(value, "float32")


@serializable
class MeaMed(CoordinateAggregator):
    """Mean around the median (MeaMed), coordinate by coordinate.

    For each coordinate, takes the median of the ``B`` values and averages the
    ``B - f`` values closest to it, ``f = floor(byzantine * B)``.

    Args:
        byzantine: the fraction of examples that may be arbitrary, in ``[0, 0.5)``.

    References:
        Xie, Koyejo, Gupta, 2018, "Generalized Byzantine-tolerant SGD",
        arXiv:1802.10116.
    """

    coordinatewise = True

    def __init__(self, byzantine: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.byzantine = _check_fraction("meamed", "byzantine", byzantine)

    @takes_outer_rows
    def aggregate_variable(self, gradient):
        batch_size = ops.shape(gradient)[0]
        return selection.meamed(gradient, batch_size - _count(self.byzantine, batch_size))

    def get_config(self):
        return {**super().get_config(), "byzantine": self.byzantine}


@serializable
class Krum(WeightedAggregator):
    """Krum and Multi-Krum: the examples closest to their neighbours.

    With ``f = floor(byzantine * B)``, example i's score is the sum of its squared
    distances to its ``B - f - 2`` nearest other examples; the result is the mean
    of the ``select`` examples with the lowest scores (``select=1``: Krum;
    ``select > 1``: Multi-Krum). Distances come from the Gram matrix.

    Needs ``B - f - 2 >= 1`` and ``B >= select``; the paper's guarantees further
    assume ``B > 2f + 2``. Reports ``selected_fraction`` (``select / B``). An
    example whose squared norm is not finite in float32 (a gradient norm above
    ~1.8e19, or a NaN) is infinitely far from every other.

    Args:
        byzantine: the fraction of examples that may be arbitrary, in ``[0, 0.5)``.
        select: how many of the best-scored examples are averaged.

    References:
        Blanchard, El Mhamdi, Guerraoui, Stainer, 2017, "Machine learning with
        adversaries: Byzantine tolerant gradient descent", NeurIPS.
    """

    needs_gram = True
    diagnostics = ("selected_fraction",)

    def __init__(self, byzantine: float = 0.1, select: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.byzantine = _check_fraction("krum", "byzantine", byzantine)
        self.select = check_integer("krum", "select", select)
        size = 3
        while size - math.floor(self.byzantine * size) - 2 < 1:
            size += 1
        self.min_batch_size = max(size, self.select)

    def batch_size_requirement(self):
        return (
            f" Krum scores each example by its n - f - 2 nearest neighbours, f = "
            f"floor({self.byzantine} * n), which needs n - f - 2 >= 1, and averages "
            f"select={self.select} of them."
        )

    def example_weights(self, stats: ExampleStatistics):
        batch_size = stats.batch_size
        index = ops.arange(batch_size)
        diagonal = index[:, None] == index[None, :]
        distances = ops.where(diagonal, -math.inf, pairwise_squared_distances(stats.gram))
        # Each row's `neighbours` nearest others are all but its f + 1 farthest, found by a
        # partial selection (top_k), not a sort of B x B values (XLA:CPU's comparator sort
        # dominated the step). Their sum is taken directly: subtracting the farthest from
        # the sum over all others cancels catastrophically when one example is far away
        # (an outlier 1e5 times larger than the rest changed which example Krum chose).
        farthest = _count(self.byzantine, batch_size) + 1
        cut = ops.min(ops.top_k(distances, farthest, sorted=False)[0], axis=1)[:, None]
        nearer = ops.sum(ops.where((distances < cut) & ~diagonal, distances, 0.0), axis=1)
        # Distances equal to the cut: as many as the f + 1 farthest do not take are neighbours.
        ties = (ops.sum(_float(distances == cut), axis=1)
                - (_float(farthest) - ops.sum(_float(distances > cut), axis=1)))
        scores = nearer + ops.where(ties > 0, cut[:, 0] * ties, 0.0)
        selected = _float(_ranks(scores) < self.select)
        return selected / float(self.select)

    def finalize(self, result, stats):
        return Aggregation(result, reports={"selected_fraction": self.select / _float(stats.batch_size)})

    def get_config(self):
        return {**super().get_config(), "byzantine": self.byzantine, "select": self.select}


@serializable
class GeometricMedian(WeightedAggregator):
    """Geometric median by the smoothed Weiszfeld algorithm (RFA).

    Starting from the mean (``w_i = 1/B``), repeats ``max_iter`` times
    ``d_i = ||g_i - z||`` with ``z = sum_j w_j g_j``, then
    ``w_i = (1 / max(eps, d_i)) / sum_j (1 / max(eps, d_j))``. The distances
    come from the Gram matrix, ``d_i^2 = G_ii - 2 (G w)_i + w^T G w``, so each
    iteration costs ``O(B^2)``; the fixed iteration count keeps the rule
    jit-friendly (at a fixed point further iterations change nothing).

    An example whose squared norm is not finite in float32 (a gradient norm above
    ~1.8e19, or a NaN) gets weight 0: the median is that of the other examples
    (a NaN example still makes the update NaN, as for every rule).

    Args:
        max_iter: Weiszfeld iterations.
        eps: the smoothing ``nu``: distances below it count as ``eps``.

    References:
        Pillutla, Kakade, Harchaoui, 2022, "Robust aggregation for federated
        learning", IEEE Transactions on Signal Processing (arXiv:1912.13445).
    """

    needs_gram = True

    def __init__(self, max_iter: int = 10, eps: float = 1e-6, **kwargs):
        super().__init__(**kwargs)
        self.max_iter = check_integer("geometric_median", "max_iter", max_iter)
        self.eps = check_number("geometric_median", "eps", eps, low=0.0, low_open=True)

    def example_weights(self, stats: ExampleStatistics):
        usable = ops.isfinite(ops.diagonal(stats.gram))  # (see the class docstring)
        gram = ops.where(usable[:, None] & usable[None, :], stats.gram, 0.0)
        squared = ops.diagonal(gram)
        weights = _float(usable) / ops.sum(_float(usable))
        for _ in range(self.max_iter):
            gram_weights = ops.matmul(gram, weights[:, None])[:, 0]
            distances = ops.sqrt(
                ops.maximum(squared - 2.0 * gram_weights + ops.sum(weights * gram_weights), 0.0)
            )
            inverse = ops.where(usable, 1.0 / ops.maximum(distances, self.eps), 0.0)
            weights = inverse / ops.sum(inverse)
        return weights

    def get_config(self):
        return {**super().get_config(), "max_iter": self.max_iter, "eps": self.eps}


@serializable
class CenteredClip(Aggregator):
    """Centered clipping, with its center kept across steps (stateful).

    Keeps a center ``v`` (one Keras variable per trainable variable, zero at
    first) and, ``iters`` times, moves it by the mean of the clipped deviations:
    ``v <- v + (1/B) sum_i (g_i - v) min(1, tau / ||g_i - v||)``, the norm taken
    over all variables. The result is the new ``v``, which the next step starts
    from: the center is model state, saved by ``model.save()`` and restored by
    ``keras.models.load_model()``. Reports ``clipped_fraction`` (last iteration).

    Kind ``"arbitrary"``: ``||g_i - v||`` needs ``<g_i, v>``, which per-example
    norms and the Gram matrix do not give.

    Args:
        tau: the clipping radius around the center, ``> 0``.
        iters: clipping iterations per step.

    References:
        Karimireddy, He, Jaggi, 2021, "Learning from history for Byzantine
        robust optimization", ICML.
    """

    diagnostics = ("clipped_fraction",)
    state_per_variable = True

    def __init__(self, tau: float, iters: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.tau = check_number("centered_clip", "tau", tau, low=0.0, low_open=True)
        self.iters = check_integer("centered_clip", "iters", iters)
        self.center = []

    def build(self, shapes):
        self.center = [
            self.add_weight(
                shape=tuple(shape[1:]), initializer="zeros", trainable=False, name=f"center_{k}"
            )
            for k, shape in enumerate(shapes)
        ]
        self.built = True

    def aggregate(self, gradients):
        center = [ops.cast(v.value, g.dtype) for v, g in zip(self.center, gradients)]
        batch_size = _float(batch_size_of(gradients))
        for _ in range(self.iters):
            deviations = [g - c[None] for g, c in zip(gradients, center)]
            factors, norms = clip_factors(ExampleStatistics.from_gradients(deviations), self.tau)
            steps = weighted_sum(deviations, factors / batch_size)
            center = [c + s for c, s in zip(center, steps)]
        for variable, value in zip(self.center, center):
            variable.assign(ops.cast(value, variable.dtype))
        return Aggregation(center, reports={"clipped_fraction": ops.mean(_float(norms > self.tau))})

    def get_config(self):
        return {**super().get_config(), "tau": self.tau, "iters": self.iters}


@serializable
class SignMajority(CoordinateAggregator):
    """Majority vote of signs: ``sign(sum_i sign(g_i))`` per coordinate.

    The result has entries in ``{-1, 0, 1}``; the optimizer's learning rate sets
    the step size (use plain SGD for signSGD).

    References:
        Bernstein, Zhao, Azizzadenesheli, Anandkumar, 2019, "signSGD with
        majority vote is communication efficient and fault tolerant", ICLR.
    """

    coordinatewise = True

    def aggregate_variable(self, gradient):
        return ops.sign(batch_sum(ops.sign(gradient)))


@serializable
class NormFilter(RowMapStep, WeightedAggregator):
    """Drops examples whose gradient norm is an outlier and averages the rest.

    The norm is the flat L2 norm over all variables. Exactly one rule:

    - ``factor``: example i is dropped when ``||g_i|| > factor * median_j ||g_j||``
      (the median is that of ``numpy.median``; with ``factor >= 1`` at least
      half the batch is kept);
    - ``drop_fraction``: the ``floor(drop_fraction * B)`` examples with the
      largest norms are dropped (ties broken by position).

    Kept examples get weight ``1 / (number kept)``, dropped ones zero. Reports
    ``rejected_fraction``. With ``drop_fraction`` (a count fixed by ``B``) it can
    also be a pre-processing step of :func:`~pergrad.aggregators.chain`, passing
    the kept examples on.

    Args:
        factor: the outlier threshold relative to the median norm, ``>= 1``.
        drop_fraction: the fraction of largest-norm examples dropped, in ``[0, 1)``.

    References:
        Gupta, Liu, Vaidya, 2021, "Byzantine fault-tolerant distributed machine
        learning with norm-based comparative gradient elimination", DSN-W
        (the ``drop_fraction`` rule; ``factor`` is its data-adaptive variant).
    """

    diagnostics = ("rejected_fraction",)

    def __init__(self, factor: float | None = None, drop_fraction: float | None = None, **kwargs):
        super().__init__(**kwargs)
        if factor is None and drop_fraction is None:
            factor = 3.0
        if factor is not None and drop_fraction is not None:
            raise ValueError("norm_filter takes either factor or drop_fraction, not both.")
        if factor is not None:
            factor = check_number("norm_filter", "factor", factor, low=1.0)
        if drop_fraction is not None:
            drop_fraction = check_number(
                "norm_filter", "drop_fraction", drop_fraction, low=0.0, high=1.0, high_open=True
            )
        self.factor = factor
        self.drop_fraction = drop_fraction

    def _kept(self, stats: ExampleStatistics):
        norms = stats.flat_norms
        if self.factor is not None:
            kept = norms <= self.factor * ops.median(norms)
        else:
            batch_size = stats.batch_size
            kept = _ranks(norms) < batch_size - _count(self.drop_fraction, batch_size)
        return kept

    def map_reports(self, stats, batch_size):
        return {"rejected_fraction": 1.0 - ops.mean(_float(self._kept(stats)))}

    def finalize(self, result, stats):
        return Aggregation(result, reports=self.map_reports(stats, stats.batch_size))

    def example_weights(self, stats: ExampleStatistics):
        kept = _float(self._kept(stats))
        return kept / ops.sum(kept)

    def can_preprocess(self) -> bool:
        return self.drop_fraction is not None

    def output_batch_size(self, batch_size: int) -> int:
        return batch_size - math.floor(self.drop_fraction * batch_size)

    @protocol_form
    def preprocess(self, gradients):
        if self.drop_fraction is None:
            raise TypeError(
                "norm_filter(factor=...) keeps a data-dependent number of examples, so it "
                "can only be the last step of chain(...); use norm_filter(drop_fraction=...) "
                "to filter before another rule."
            )
        return super().preprocess(gradients)

    map_reads_statistics = True

    def row_map(self, stats, batch_size):
        kept = ops.sort(ops.argsort(stats.flat_norms)[: batch_size - _count(self.drop_fraction, batch_size)])
        return RowMap(ops.cast(kept, "int32")[:, None])

    def get_config(self):
        return {**super().get_config(), "factor": self.factor, "drop_fraction": self.drop_fraction}


register("meamed")(MeaMed)
register("krum")(Krum)
register("geometric_median")(GeometricMedian)
register("sign_majority")(SignMajority)
register("norm_filter")(NormFilter)


def meamed(byzantine: float = 0.1) -> MeaMed:
    """Per coordinate, the mean of the ``B - floor(byzantine * B)`` values closest to the median."""
    return MeaMed(byzantine)


def krum(byzantine: float = 0.1, select: int = 1) -> Krum:
    """Krum (``select=1``) or Multi-Krum: the mean of the ``select`` best-scored examples."""
    return Krum(byzantine, select)


def geometric_median(max_iter: int = 10, eps: float = 1e-6) -> GeometricMedian:
    """The geometric median by ``max_iter`` smoothed Weiszfeld iterations."""
    return GeometricMedian(max_iter, eps)


def centered_clip(tau: float, iters: int = 1) -> CenteredClip:
    """Centered clipping around a center kept across steps (stateful)."""
    return CenteredClip(tau, iters)


def sign_majority() -> SignMajority:
    """The sign of the sum of the per-example signs, per coordinate."""
    return SignMajority()


def norm_filter(factor: float | None = None, drop_fraction: float | None = None) -> NormFilter:
    """The mean of the examples whose norm is not an outlier (default ``factor=3``)."""
    return NormFilter(factor, drop_fraction)
