"""Training diagnostics from per-example gradients, during ``fit()`` (docs/diagnostics.md).

Three families of quantities, computed inside the train step from one statistics
pass (each layer's input ``A`` and output gradient ``D``: no ``B x P`` tensor for
layers with rules) whatever the model's aggregator, ``mean`` included:

- the distribution of the per-example gradient norms ``||g_i||`` (quantiles, the
  fraction above a threshold);
- the gradient noise scale ``B_simple = tr(Σ) / |G|^2`` (McCandlish, Kaplan,
  Amodei et al. 2018, "An empirical model of large-batch training", App. A), from
  the unbiased estimators of ``|G|^2`` and ``tr(Σ)`` that the per-example squared
  norms and the squared norm of the batch mean give within one batch, smoothed by
  exponential moving averages of the two separately;
- the gradient signal-to-noise ratio per variable (Liu et al. 2020,
  "Understanding why neural networks generalize well through GSNR of
  parameters"): ``mean_i(g)^2 / var_i(g)`` per coordinate, averaged over the
  variable's coordinates, from ``sum_i g_i`` and the layer rules' per-coordinate
  ``sum_i g_i^2`` (:meth:`pergrad.layer_rules.LayerRule.sum_grad_squared`).

:class:`GradientDiagnostics` is the Keras callback; :func:`batch_diagnostics`
computes the same values on one batch outside ``fit()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import keras
from keras import ops, tree

from pergrad.engine.problem import cached_problem, check_model, compiled_once, map_optional
from pergrad.engine.statistics import layers_of, statistics_or_materialized
from pergrad.layer_rules.base import replaced_attribute
from pergrad.tensors import example_rows

__all__ = [
    "AggregateProgbar",
    "DiagnosticsRequest",
    "GradientDiagnostics",
    "batch_diagnostics",
    "diagnostics_first",
    "noise_scale_estimates",
]

#: The GSNR's default schedule: every this many diagnostic steps.
GSNR_EVERY = 10

#: The raw keys of the noise-scale estimators (one batch), and the batch size.
SQUARED_NORM, TRACE, EXAMPLES = "gradient_sq_norm", "gradient_variance", "examples"
NOISE_SCALE = "noise_scale"


@dataclass(frozen=True)
class DiagnosticsRequest:
    """Which per-batch diagnostics a train step computes (``GradientDiagnostics`` sets one).

    Args:
        quantiles: quantiles of the per-example gradient norms, in ``[0, 1]``.
        threshold: also the fraction of examples whose gradient norm exceeds it
            (``None``: not computed).
        noise_scale: the estimators of ``|G|^2`` and ``tr(Σ)``.
        gsnr: the gradient signal-to-noise ratio of every trainable variable.
    """

    quantiles: tuple = (0.1, 0.5, 0.9)
    threshold: float | None = None
    noise_scale: bool = True
    gsnr: bool = True

    def __post_init__(self):
        quantiles = tuple(float(q) for q in self.quantiles)
        if any(not 0.0 <= q <= 1.0 for q in quantiles):
            raise ValueError(f"quantiles must lie in [0, 1]; got {self.quantiles!r}.")
        object.__setattr__(self, "quantiles", quantiles)
        if self.threshold is not None and not (self.threshold >= 0 and math.isfinite(self.threshold)):
            raise ValueError(f"threshold must be a finite number >= 0 or None; got {self.threshold!r}.")

    def quantile_key(self, q: float) -> str:
        return f"grad_norm_p{100 * q:g}"

    def threshold_key(self) -> str:
        return f"grad_norm_above_{self.threshold:g}"

    def values(self, per_example_squared_norms, means, sum_squares, variables) -> dict:
        """The diagnostics of one batch (scalar tensors by key) from ``(B,)`` squared norms,
        each variable's ``mean_i g_i`` (float32) and (for ``gsnr``) ``sum_i g_i^2``."""
        squared = ops.cast(per_example_squared_norms, "float32")
        size = ops.cast(ops.shape(squared)[0], "float32")
        out = {EXAMPLES: size}
        norms = ops.sqrt(squared)
        out.update(zip(map(self.quantile_key, self.quantiles), _quantiles(norms, self.quantiles)))
        if self.threshold is not None:
            out[self.threshold_key()] = ops.mean(ops.cast(norms > self.threshold, "float32"))
        if self.noise_scale:
            mean_squared = ops.mean(squared)
            batch_squared = sum(_squared_sum(m) for m in means)  # ||G_B||^2
            out[SQUARED_NORM], out[TRACE] = noise_scale_estimates(mean_squared, batch_squared, size)
        if self.gsnr:
            sum_squares = [ops.cast(q, "float32") for q in sum_squares]
            largest = ops.max(ops.stack([ops.max(q) for q in sum_squares]))
            ratios, counts = 0.0, 0.0
            for name, m, q in zip(variable_keys(variables), means, sum_squares):
                ratio, count = _gsnr_parts(m, q, size, largest)
                out[f"gsnr/{name}"] = ratio / count
                ratios, counts = ratios + ratio, counts + count
            out["gsnr"] = ops.convert_to_tensor(ratios, "float32") / counts
        return out


def _squared_sum(tensor):
    """``sum(tensor ** 2)`` as one dot product (one kernel on an eager backend, not two)."""
    flat = ops.reshape(tensor, (-1,))
    return ops.vdot(flat, flat)


def _quantiles(values, quantiles) -> list:
    """The ``quantiles`` of a ``(B,)`` tensor, as ``numpy.quantile`` (linear interpolation):
    one sort for all of them where ``B`` is static (``ops.quantile`` sorts once per quantile)."""
    size = values.shape[0]
    if not quantiles:
        return []
    if size is None:
        return [ops.quantile(values, q) for q in quantiles]
    ordered = ops.sort(values)
    positions = [q * (size - 1) for q in quantiles]
    low = [min(int(math.floor(p)), size - 1) for p in positions]
    high = [min(k + 1, size - 1) for k in low]
    below = ops.take(ordered, low)
    above = ops.take(ordered, high)
    fractions = ops.convert_to_tensor([p - k for p, k in zip(positions, low)], values.dtype)
    found = below + fractions * (above - below)
    return [found[k] for k in range(len(quantiles))]


def noise_scale_estimates(mean_squared_norm, batch_squared_norm, batch_size):
    """``(|G|^2, tr(Σ))`` estimated without bias from one batch of ``B`` examples.

    With ``E ||g_i||^2 = |G|^2 + tr(Σ)`` (batch of one) and
    ``E ||mean_i g_i||^2 = |G|^2 + tr(Σ) / B`` (McCandlish et al. 2018, App. A.1,
    ``B_small = 1``, ``B_big = B``):
    ``|G|^2 ≈ (B ||G_B||^2 - mean_i ||g_i||^2) / (B - 1)`` and
    ``tr(Σ) ≈ (mean_i ||g_i||^2 - ||G_B||^2) B / (B - 1)``. NaN for ``B = 1``.
    """
    size = ops.cast(batch_size, "float32")
    denominator = size - 1.0
    squared = (size * batch_squared_norm - mean_squared_norm) / denominator
    trace = (mean_squared_norm - batch_squared_norm) * size / denominator
    return squared, trace


#: Coordinates whose root-mean-square gradient is below this fraction of the model's largest
#: are zero to float32 precision (the bias of attention keys, which softmax ignores): their
#: mean and variance are rounding noise, and they have no GSNR.
NEGLIGIBLE_GRADIENT = 1e-5


def _gsnr_parts(mean, sum_squares, size, largest_sum_squares):
    """``(sum of mean^2 / var, count)`` over the coordinates whose gradient varies across the
    batch (``var > 0``; the batch's variance, ``1 / B``) and is not negligible
    (:data:`NEGLIGIBLE_GRADIENT`): a coordinate no example's gradient moves (an embedding
    row no token selects) has no ratio."""
    variance = ops.maximum(sum_squares / size - ops.square(mean), 0.0)
    varies = (variance > 0) & (sum_squares > NEGLIGIBLE_GRADIENT**2 * largest_sum_squares)
    ratio = ops.where(varies, ops.square(mean) / ops.where(varies, variance, 1.0), 0.0)
    return ops.sum(ratio), ops.sum(ops.cast(varies, "float32"))


def variable_keys(variables) -> list[str]:
    """The variables' paths, made unique (``name``, ``name_1``, ...) for the logs."""
    keys, seen = [], {}
    for v in variables:
        path = getattr(v, "path", None) or v.name
        count = seen.get(path, 0)
        seen[path] = count + 1
        keys.append(path if count == 0 else f"{path}_{count}")
    return keys


def _from_gradients(gradients, gsnr: bool):
    rows = [example_rows(g, "float32") for g in gradients]
    squared = sum(ops.sum(r * r, axis=1) for r in rows)
    means = [ops.mean(ops.cast(g, "float32"), axis=0) for g in gradients]
    sum_squares = [ops.sum(ops.square(ops.cast(g, "float32")), axis=0) for g in gradients] if gsnr else None
    return squared, means, sum_squares


def batch_values(request: DiagnosticsRequest, problem, trainable_values, non_trainable_values, x, y=None,
                 sample_weight=None, per_example=None, layers=None, batch_mean=None) -> dict:
    """``request``'s diagnostics of a batch (``keras.ops``; called inside the train step).

    From the statistics path's capture (every planned call's ``A`` and ``D``):
    squared norms, ``mean_i g_i`` (a weighted sum with weights ``1 / B``, unless the
    step gives it: ``batch_mean``) and ``sum_i g_i^2`` by the layer rules. The capture is
    the step's own where it made one (``layers``: a statistics rule's pass, or
    ``mean``'s backward pass with the probes), else one more forward and backward
    pass. From ``per_example`` gradients where the step materialized them, or
    materialized here for a model the statistics path cannot take (logged once).
    """
    variables = problem.model.trainable_variables
    if per_example is None and layers is None:
        batched, batch_size, non_trainable, _ = problem.batched_inputs(
            non_trainable_values, x, y, sample_weight
        )
        shared = {"non_trainable": non_trainable, "loss_scale": None}
        layers, per_example = statistics_or_materialized(
            lambda: (layers_of(problem, trainable_values, batched, shared, batch_size, None)[0], None),
            lambda: (None, problem.compute(trainable_values, non_trainable_values, x, y, sample_weight)[0]),
            problem, "diagnostics use every per-example gradient",
        )
    if layers is not None:
        batch_size = ops.shape(tree.flatten(x)[0])[0]
        # (float32 without the overflow rescaling: no conditional in the step)
        squared = ops.sum(layers.squared_norms(batch_size, rescale=False)[0], axis=1)
        means = batch_mean
        if means is None:
            weights = ops.ones_like(squared) / ops.cast(batch_size, "float32")
            means = [ops.cast(m, "float32") for m in layers.weighted_sums(weights, variables)]
        sum_squares = layers.sum_grad_squared(variables) if request.gsnr else None
        return request.values(squared, means, sum_squares, variables)
    return request.values(*_from_gradients(per_example, request.gsnr), variables)


def batch_diagnostics(model, x, y=None, sample_weight=None, *, loss=None, quantiles=(0.1, 0.5, 0.9),
                      threshold: float | None = None, noise_scale: bool = True, gsnr: bool = True,
                      training: bool = True) -> dict[str, float]:
    """The diagnostics of one batch at the model's current weights, as floats by key.

    The values a :class:`GradientDiagnostics` step logs before smoothing (same
    loss definition and arguments as :func:`pergrad.per_example_gradients`):
    ``grad_norm_p<100 q>`` per quantile, ``grad_norm_above_<threshold>``,
    ``gradient_sq_norm`` and ``gradient_variance`` (the unbiased estimators of
    ``|G|^2`` and ``tr(Σ)``, :func:`noise_scale_estimates`), ``gsnr`` (every
    coordinate) and ``gsnr/<variable path>``, and ``examples`` (the batch size).
    """
    request = DiagnosticsRequest(tuple(quantiles), threshold, noise_scale, gsnr)
    check_model(model, training)
    problem = cached_problem(model, loss, training)
    problem.check_once(x, y)
    x, y, sample_weight = (map_optional(ops.convert_to_tensor, t) for t in (x, y, sample_weight))

    def pure(trainable_values, non_trainable_values, x, y, sample_weight):
        return batch_values(request, problem, trainable_values, non_trainable_values, x, y, sample_weight)

    function = compiled_once(problem, "diagnostics", pure, request)
    trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
    values = function([v.value for v in trainable], [v.value for v in non_trainable], x, y, sample_weight)
    return {k: float(ops.convert_to_numpy(v)) for k, v in values.items()}


def diagnostics_first(callbacks):
    """``callbacks`` (a list or tuple; anything else as it is) with the
    :class:`GradientDiagnostics` first, in their order, so that the other callbacks
    (TensorBoard, CSVLogger) see the values they put into the logs; and, unless the list
    has a progress bar of its own, one that leaves out the per-variable values."""
    if not isinstance(callbacks, (list, tuple)):
        return callbacks
    ours = [c for c in callbacks if isinstance(c, GradientDiagnostics)]
    others = [c for c in callbacks if not isinstance(c, GradientDiagnostics)]
    if ours and not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in others):
        others.append(AggregateProgbar())
    return ours + others


def _aggregates(logs):
    """``logs`` without the per-variable diagnostics (``gsnr/<variable path>``)."""
    return logs if logs is None else {k: v for k, v in logs.items() if not k.startswith("gsnr/")}


class AggregateProgbar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, showing the diagnostics' aggregates only: the per-variable
    values (one ``gsnr/<variable path>`` per variable) go to ``History``, TensorBoard and
    CSVLogger, not onto the bar's line. ``PerExampleModel.fit`` adds it beside a
    :class:`GradientDiagnostics` (Keras then adds no bar of its own; none is shown with
    ``verbose=0``)."""

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, _aggregates(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _aggregates(logs))


class GradientDiagnostics(keras.callbacks.Callback):
    """Logs per-example gradient diagnostics of a ``PerExampleModel`` during ``fit()``.

    Every ``every_n_steps`` train steps, the step computes the norm quantiles and the
    noise scale of its batch (and every ``gsnr_every_n_steps`` steps the GSNR too),
    at its weights before the update and whatever the aggregator, from a capture of
    the statistics path (every layer's ``A`` and ``D``: no ``B x P``
    tensor for layers with rules): the one its update made (statistics rules;
    ``mean`` and ``sum``, whose backward pass then takes the probes too), else one
    more forward and backward pass. The update is computed as without the callback
    (with ``mean``, bit for bit on JAX and torch, to float32 rounding on TensorFlow).
    Steps in between run the model's plain train function (no cost). By default the
    norms and the noise scale are computed every step and the GSNR every 10th step
    (steps 0, 10, 20, ...): its per-coordinate second moments cost one more product
    of each kernel gradient's size (``gsnr_every_n_steps=1``: every step).

    What is logged (docs/diagnostics.md):

    - ``grad_norm_p<100 q>`` for each quantile ``q`` of ``||g_i||``, and
      ``grad_norm_above_<threshold>`` (the fraction of the batch above it);
    - ``noise_scale``: ``B_simple = EMA(tr Σ) / EMA(|G|^2)`` (McCandlish et al.
      2018), the two unbiased one-batch estimators smoothed separately with
      factor ``smoothing`` (the ratio needs no bias correction: both EMAs carry
      the same factor);
    - ``gsnr`` and ``gsnr/<variable path>``: the mean over coordinates of
      ``mean_i(g)^2 / var_i(g)`` (Liu et al. 2020), on the GSNR steps
      (``history["gsnr_step"]`` their global steps).

    ``History`` (and TensorBoard, CSVLogger...) get per epoch the mean of each value
    over the epoch's diagnostic steps (for the GSNR, over its GSNR steps; NaN in an
    epoch without one) and the ``noise_scale`` at the epoch's end.
    With ``progress_bar=True`` the batch logs carry the latest values too
    (TensorBoard with ``update_freq="batch"`` writes them). The progress bar shows the
    aggregates only (:class:`AggregateProgbar`), not one ``gsnr/<variable path>`` per variable.
    ``history`` holds every diagnostic step's values (``history["step"]`` the
    global step, ``history["examples"]`` the batch size), across ``fit()`` calls.

    ``PerExampleModel.fit`` runs these callbacks before the others, so that every
    callback sees their values.

    Args:
        every_n_steps: compute the diagnostics every this many train steps
            (calls of the train function, with ``steps_per_execution``).
        quantiles: quantiles of the per-example gradient norms.
        threshold: also log the fraction of examples above this norm.
        noise_scale: log the gradient noise scale.
        gsnr: log the gradient signal-to-noise ratios (one more product per
            layer: ``(A^2)^T (D^2)`` for a Dense layer).
        gsnr_every_n_steps: compute the GSNR every this many train steps, a
            multiple of ``every_n_steps`` (default ``10 * every_n_steps``).
        smoothing: the EMA factor of the noise scale's numerator and denominator.
        progress_bar: also put the latest values into the batch logs.
    """

    def __init__(self, every_n_steps: int = 1, quantiles=(0.1, 0.5, 0.9), threshold: float | None = None,
                 noise_scale: bool = True, gsnr: bool = True, smoothing: float = 0.9,
                 progress_bar: bool = False, gsnr_every_n_steps: int | None = None):
        super().__init__()
        if not (isinstance(every_n_steps, int) and every_n_steps >= 1):
            raise ValueError(f"every_n_steps must be an integer >= 1; got {every_n_steps!r}.")
        if gsnr_every_n_steps is None:
            gsnr_every_n_steps = GSNR_EVERY * every_n_steps
        if not (isinstance(gsnr_every_n_steps, int) and gsnr_every_n_steps >= 1
                and gsnr_every_n_steps % every_n_steps == 0):
            raise ValueError(
                "gsnr_every_n_steps must be a positive multiple of every_n_steps "
                f"({every_n_steps}); got {gsnr_every_n_steps!r}."
            )
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must lie in [0, 1); got {smoothing!r}.")
        self.request = DiagnosticsRequest(tuple(quantiles), threshold, noise_scale, gsnr)
        # The requests of a step without and with the GSNR (the same when gsnr is off).
        self._requests = (DiagnosticsRequest(tuple(quantiles), threshold, noise_scale, False), self.request)
        self.every_n_steps, self.smoothing, self.progress_bar = every_n_steps, smoothing, progress_bar
        self.gsnr_every_n_steps = gsnr_every_n_steps
        self.history: dict[str, list] = {}
        self._calls = 0
        self._moving = [0.0, 0.0]  # EMA of tr(Σ), of |G|^2
        self._functions = None
        self._epoch: dict[str, list] = {}

    # -- which train function each step runs ---------------------------------------------

    def on_train_begin(self, logs=None):
        from pergrad.distributed.training import replicated

        model = self.model
        if not hasattr(model, "set_diagnostics_request"):  # (pergrad.training.model imports this module)
            raise TypeError(
                "GradientDiagnostics needs a pergrad.PerExampleModel (its train step computes "
                f"the per-example statistics); got {type(model).__name__}. Wrap the model: "
                "pergrad.PerExampleModel(model, 'mean')."
            )
        if replicated(model):
            raise ValueError(
                "GradientDiagnostics does not support several replicas yet: train on one device."
            )
        # fit() made the plain function; the diagnostic one is traced on its first call
        # (on TF and JAX the request is read when the step is traced, on torch when it runs).
        plain = model.train_function
        step = type(model).train_step

        def diagnostic_function():
            def diagnostic_step(*args):
                # Its own function object: jax.jit would share another step's traces.
                return step(model, *args)

            with replaced_attribute(model, "train_step", diagnostic_step):
                model.make_train_function(force=True)  # (Keras's returns nothing on some backends)
            return model.train_function

        # plain, the norms and noise scale, and with the GSNR (made only if it is asked for)
        without = diagnostic_function()
        with_gsnr = diagnostic_function() if self.request.gsnr and self.gsnr_every_n_steps > 1 else without
        model.train_function = plain
        self._functions = (plain, without, with_gsnr)

    def _kind(self, call: int) -> int:
        """Which function step ``call`` runs: 0 plain, 1 without the GSNR, 2 with it."""
        if call % self.every_n_steps:
            return 0
        return 2 if call % self.gsnr_every_n_steps == 0 else 1

    def on_train_batch_begin(self, batch, logs=None):
        kind = self._kind(self._calls)
        self._calls += 1
        model = self.model
        model.set_diagnostics_request(None if kind == 0 else self._requests[kind - 1])
        model.train_function = self._functions[kind]

    def on_train_end(self, logs=None):
        if self._functions is not None:
            self.model.set_diagnostics_request(None)
            self.model.train_function = self._functions[0]
            self._functions = None

    # -- the logs -------------------------------------------------------------------------

    def _raw_keys(self, logs) -> list[str]:
        names = {EXAMPLES, SQUARED_NORM, TRACE, *map(self.request.quantile_key, self.request.quantiles)}
        if self.request.threshold is not None:
            names.add(self.request.threshold_key())
        return [k for k in logs if k in names or k == "gsnr" or k.startswith("gsnr/")]

    def on_train_batch_end(self, batch, logs=None):
        if logs is None:
            return
        raw = {k: float(logs.pop(k)) for k in self._raw_keys(logs)}
        if raw:
            values = dict(raw)
            if self.request.noise_scale:
                beta = self.smoothing
                trace, squared = values.pop(TRACE), values.pop(SQUARED_NORM)
                self._moving = [beta * self._moving[0] + (1 - beta) * trace,
                                beta * self._moving[1] + (1 - beta) * squared]
                values[NOISE_SCALE] = self._moving[0] / self._moving[1] if self._moving[1] else math.nan
                values["noise_scale_batch"] = trace / squared if squared else math.nan
                values[TRACE], values[SQUARED_NORM] = trace, squared
            self.history.setdefault("step", []).append(self._calls - 1)
            if "gsnr" in values:
                self.history.setdefault("gsnr_step", []).append(self._calls - 1)
            for k, v in values.items():
                self.history.setdefault(k, []).append(v)
                self._epoch.setdefault(k, []).append(v)
            self._latest = values
        if self.progress_bar and getattr(self, "_latest", None):
            logs.update({k: v for k, v in self._latest.items() if k not in (EXAMPLES, TRACE, SQUARED_NORM)})

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = {}

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        for k in self._raw_keys(logs):
            logs.pop(k)
        for k, series in self._epoch.items():
            if k in (EXAMPLES, TRACE, SQUARED_NORM, "noise_scale_batch"):
                continue
            logs[k] = series[-1] if k == NOISE_SCALE else sum(series) / len(series)
        # An epoch without a GSNR step (gsnr_every_n_steps > its steps): NaN, so that every
        # epoch has each key.
        for k in self.history:
            if (k == "gsnr" or k.startswith("gsnr/")) and k not in self._epoch:
                logs[k] = math.nan
