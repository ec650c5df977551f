"""Scores for a data set: one number per example (or per train/test pair) from its gradient.

``pergrad.scores(model, data, kind=...)`` runs over a data set in batches (anything
``fit()`` takes: arrays, ``tf.data``, generators, ``keras.utils.PyDataset``, a torch
``DataLoader``) and returns NumPy arrays aligned with it:

- ``"loss"``: each example's loss ``L_i``;
- ``"el2n"``: the L2 norm of the error, ``||softmax(logits) - onehot(y)||`` (EL2N);
- ``"grand"``: the gradient norm ``||g_i||`` (GraNd);
- ``"self_influence"``: TracIn's self-influence ``sum_c lr_c ||g_i(w_c)||^2``;
- ``"influence"``: TracIn's influence of every example on chosen test examples,
  ``sum_c lr_c <g_i(w_c), g'_j(w_c)>``, an ``(N, T)`` array.

Gradient scores come from the statistics path (:func:`pergrad.per_example_statistics`):
norms and Gram matrices from each layer's input ``A`` and output gradient ``D``, never a
``B x P`` tensor for layers with rules. The influence on the test examples is the
off-diagonal block of the Gram matrix of the batch joined with them, computed alone (each
layer rule's ``cross_gram``), as "In-Run Data Shapley" (Wang et al., 2024) computes its
gradient dot products from ``A`` and ``D``.

Example ``i``'s gradient is that of its own loss as on a batch of one (its sample weight
included): a ``"sum"`` reduction's batch factor is removed, so that scores do not depend
on ``batch_size``.

References:
    Paul, Ganguli, Dziugaite, "Deep Learning on a Data Diet: Finding Important Examples
    Early in Training", NeurIPS 2021 (GraNd, EL2N).
    Pruthi, Liu, Kale, Sundararajan, "Estimating Training Data Influence by Tracing
    Gradient Descent", NeurIPS 2020 (TracIn, TracInCP over checkpoints).
    Wang, Mittal, Song, Jia, "Data Shapley in One Training Run", 2024 (gradient dot
    products from each layer's activations and output gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import keras
import numpy as np
from keras import ops, tree

from pergrad import compat
from pergrad.backend import adapter
from pergrad.engine.capture import has_convolutions
from pergrad.engine.materialized import per_example_gradients
from pergrad.engine.problem import cached_problem, check_model, compiled_once, map_optional
from pergrad.engine.statistics import layers_of, per_example_statistics, statistics_or_materialized
from pergrad.tensors import example_rows

__all__ = ["KINDS", "scores"]

#: The score kinds, cheapest first.
KINDS = ("loss", "el2n", "grand", "self_influence", "influence")
_TRACIN_KINDS = ("self_influence", "influence")


def _loss_function(problem):
    """Each example's ``L_i`` and prediction, one vectorized forward pass, compiled once per
    (trainable variables, non-trainable variables)."""
    model = problem.model

    def pure(trainable_values, non_trainable_values, x, y, sample_weight):
        batched, _, non_trainable_values, _ = problem.batched_inputs(
            non_trainable_values, x, y, sample_weight)
        shared = {"non_trainable": non_trainable_values, "loss_scale": None}
        losses, aux = adapter().vectorized_call(
            lambda example, shared: problem.example_loss(trainable_values, example, shared),
            batched, shared, layout_hints=has_convolutions(model),
        )
        return losses, aux["y_pred"]

    return compiled_once(problem, "scores", pure)


def _cross_gram_function(problem, split: int):
    """``<g_i, g_j>`` for the first ``split`` examples of a batch against the others (the
    off-diagonal block of its Gram matrix, each layer rule's ``cross_gram``: ``split x T``
    dot products, not ``(split + T)^2``), and the advanced seeds; compiled once per
    (trainable variables, non-trainable variables, split)."""
    def pure(trainable_values, non_trainable_values, x, y, sample_weight):
        batched, batch_size, non_trainable, _ = problem.batched_inputs(
            non_trainable_values, x, y, sample_weight)
        shared = {"non_trainable": non_trainable, "loss_scale": None}
        layers, aux = layers_of(problem, trainable_values, batched, shared, batch_size, None)
        return layers.cross_gram(split), problem.advanced_seeds(non_trainable, aux["seeds"])

    return compiled_once(problem, "cross_gram", pure, split)


def _cross_gram(model, problem, loss, training, split, x, y, sample_weight) -> np.ndarray:
    """``(split, T)`` float64: :func:`_cross_gram_function`, or from the materialized
    per-example gradients for a model the statistics path cannot take (logged once)."""
    x, y, sample_weight = (map_optional(ops.convert_to_tensor, t) for t in (x, y, sample_weight))
    values = [v.value for v in model.trainable_variables]
    states = [v.value for v in model.non_trainable_variables]

    def on_statistics_path():
        cross, seeds = _cross_gram_function(problem, split)(values, states, x, y, sample_weight)
        for position, state in zip(problem.seed_positions, seeds):
            model.non_trainable_variables[position].assign(state)
        return _numpy(cross).astype("float64")

    def on_materialized_path():  # (per_example_gradients advances the seed states)
        grads = per_example_gradients(model, x, y, sample_weight, loss=loss, training=training)
        rows = [_numpy(example_rows(g)).astype("float64") for g in grads]
        return sum(r[:split] @ r[split:].T for r in rows)

    return statistics_or_materialized(on_statistics_path, on_materialized_path, problem,
                                      "scores use the materialized path")


def _error_kind(loss) -> tuple[str, bool]:
    """``(target kind, from_logits)`` of the one loss: ``"sparse"`` (integer labels),
    ``"categorical"`` (one-hot), ``"binary"`` (probabilities of 1), or ``"regression"``
    (the error is ``y_pred - y``)."""
    losses = [item for item in tree.flatten(loss) if item is not None]
    if len(losses) != 1:
        raise NotImplementedError("kind='el2n' needs a model with one output and one loss.")
    loss = losses[0]
    if isinstance(loss, str):
        name, from_logits = loss, False
    elif isinstance(loss, keras.losses.Loss):
        name = getattr(getattr(loss, "fn", None), "__name__", type(loss).__name__)
        from_logits = bool(loss.get_config().get("from_logits", False))
    else:
        name, from_logits = getattr(loss, "__name__", ""), False
    name = name.lower().replace("_", "")
    for kind in ("sparse", "categorical", "binary"):
        if kind in name and "crossentropy" in name:
            return kind, from_logits
    return "regression", False


def _el2n(y_pred, y, kind: str, from_logits: bool) -> np.ndarray:
    """``||p_i - y_i||``: ``p`` the predicted probabilities (or values), ``y`` one-hot."""
    y_pred = np.asarray(y_pred, "float64")
    y = np.asarray(y)
    if kind in ("sparse", "categorical"):
        if from_logits:
            shifted = y_pred - y_pred.max(axis=-1, keepdims=True)
            y_pred = np.exp(shifted) / np.exp(shifted).sum(axis=-1, keepdims=True)
        if kind == "sparse":
            labels = y.reshape(y_pred.shape[:-1]).astype("int64")
            y = np.eye(y_pred.shape[-1])[labels]
    elif kind == "binary" and from_logits:
        y_pred = 1.0 / (1.0 + np.exp(-y_pred))
    error = (y_pred - np.asarray(y, "float64").reshape(y_pred.shape)).reshape(len(y_pred), -1)
    return np.sqrt(np.sum(error**2, axis=1))


def _checkpoint_weights(model, checkpoints) -> list[list[np.ndarray]]:
    """Every checkpoint as ``model.get_weights()`` lists (files loaded once, in memory)."""
    current = model.get_weights()
    weights = []
    try:
        for checkpoint in checkpoints:
            if isinstance(checkpoint, (str, bytes)) or hasattr(checkpoint, "__fspath__"):
                model.load_weights(checkpoint)
                weights.append(model.get_weights())
            else:
                checkpoint = [np.asarray(w) for w in checkpoint]
                if [w.shape for w in checkpoint] != [w.shape for w in current]:
                    raise ValueError("A checkpoint's weights do not match the model's (model.get_weights()).")
                weights.append(checkpoint)
    finally:
        model.set_weights(current)
    return weights


def _learning_rates(learning_rates, count: int) -> list[float]:
    if learning_rates is None:
        return [1.0] * count
    if np.ndim(learning_rates) == 0:
        return [float(learning_rates)] * count
    rates = [float(r) for r in learning_rates]
    if len(rates) != count:
        raise ValueError(f"{len(rates)} learning rates for {count} checkpoints.")
    return rates


def _concatenate(first, second):
    return tree.map_structure(lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)]), first, second)


def _padded(array, size: int):
    """``array`` (batch first) with its rows repeated in turn up to ``size`` rows."""
    array = np.asarray(array)
    return array if len(array) >= size else np.take(array, np.arange(size) % len(array), axis=0)


def _numpy(value):
    return None if value is None else np.asarray(ops.convert_to_numpy(value))


class _Scorer:
    """One kind of score for the batches of a data set, at the current weights."""

    def __init__(self, model, kind, loss, training, test):
        self.model, self.kind, self.loss, self.training = model, kind, loss, training
        self.problem = cached_problem(model, loss, training)
        self.test = test
        if kind == "el2n":
            self.error_kind = _error_kind(model.loss if loss is None else loss)

    def gradient_factor(self, batch_size):
        """The factor that turns the engine's ``c_i g_i`` into the batch-of-one ``g_i``."""
        return 1.0 / batch_size if self.problem.sum_reduction else 1.0

    def __call__(self, x, y, sample_weight) -> np.ndarray:
        batch_size = len(tree.flatten(x)[0])
        if self.kind == "el2n" and y is None:
            raise ValueError("kind='el2n' needs the targets: pass y= or data that yields (x, y).")
        if self.kind in ("loss", "el2n"):
            values = [v.value for v in self.model.trainable_variables]
            states = [v.value for v in self.model.non_trainable_variables]
            tensors = (map_optional(ops.convert_to_tensor, t) for t in (x, y, sample_weight))
            losses, y_pred = _loss_function(self.problem)(values, states, *tensors)
            if self.kind == "loss":
                return _numpy(losses).astype("float64")
            return _el2n(_numpy(y_pred), y, *self.error_kind)
        factor = self.gradient_factor(batch_size)
        if self.kind != "influence":
            stats = per_example_statistics(self.model, x, y, sample_weight, loss=self.loss,
                                           training=self.training)
            norms = _numpy(stats.flat_norms).astype("float64") * factor
            return norms if self.kind == "grand" else norms**2
        test_x, test_y, test_weight = self.test
        test_size = len(tree.flatten(test_x)[0])
        if (sample_weight is None) != (test_weight is None):
            sample_weight = np.ones(batch_size, "float32") if sample_weight is None else sample_weight
            test_weight = np.ones(test_size, "float32") if test_weight is None else test_weight
        joined = [x, y, sample_weight]
        joined = [None if a is None else _concatenate(a, b)
                  for a, b in zip(joined, (test_x, test_y, test_weight))]
        self.problem.check_once(*joined[:2])
        cross = _cross_gram(self.model, self.problem, self.loss, self.training, batch_size, *joined)
        # (a sum reduction's factor is the joined batch's size, on both sides)
        factor = self.gradient_factor(batch_size + test_size)
        return cross * factor**2


def _check_masks(model, x, kind):
    """Scores other than the loss of masked outputs are refused: example i's gradient
    would carry its share of the batch's unmasked steps (the other examples')."""
    values = [(v, v.value) for v in model.variables]
    first = map_optional(lambda t: ops.convert_to_tensor(np.asarray(t)[:1]), x)
    with keras.StatelessScope(state_mapping=values):
        y_pred = model(first, training=False)
    if any(compat.get_mask(out) is not None for out in tree.flatten(y_pred)):
        raise NotImplementedError(
            f"kind={kind!r} of a model with masked outputs is not supported yet (each example's "
            "gradient would carry its share of the batch's unmasked steps); kind='loss' works."
        )


def scores(
    model,
    x,
    y=None,
    sample_weight=None,
    *,
    kind: str = "el2n",
    batch_size: int | None = None,
    test_data=None,
    checkpoints: Sequence | None = None,
    learning_rates: float | Sequence[float] | None = None,
    loss=None,
    training: bool = False,
    verbose: str | int = "auto",
) -> np.ndarray:
    """One score per example of a data set (per train/test pair for ``"influence"``).

    Args:
        model: a built Keras model (compiled with a loss, or pass ``loss``).
        x: the data, as ``fit()`` takes it: arrays (then ``y`` and ``sample_weight``
            too), a ``tf.data.Dataset``, a generator, a ``keras.utils.PyDataset`` or a
            torch ``DataLoader`` yielding ``(x, y)`` or ``(x, y, sample_weight)``.
            Iterated once, in order, without shuffling.
        y: the targets, with array ``x``.
        sample_weight: per-example weights, with array ``x``; they multiply ``L_i``.
        kind: one of :data:`KINDS`:
            ``"loss"``, example i's loss ``L_i``;
            ``"el2n"``, ``||p_i - y_i||`` with ``p_i`` the predicted probabilities
            (softmax of logits for a ``from_logits`` cross-entropy) and ``y_i`` one-hot;
            for a regression loss, the error ``||y_pred_i - y_i||`` (Paul et al. 2021);
            ``"grand"``, ``||g_i||``, the flat norm of example i's gradient (Paul et al.
            2021); ``"self_influence"``, ``sum_c lr_c ||g_i(w_c)||^2`` (TracIn, Pruthi
            et al. 2020); ``"influence"``, ``sum_c lr_c <g_i(w_c), g_j(w_c)>`` for each
            test example j of ``test_data``.
        batch_size: examples per batch for array data (default 32, as ``predict``).
        test_data: ``(x, y)`` or ``(x, y, sample_weight)`` arrays of the test examples
            (``kind="influence"`` only); joined to every batch, so keep it small (its
            cost per batch is that of ``T`` more examples).
        checkpoints: weights to score at: paths of ``model.save_weights`` files, or
            ``model.get_weights()`` lists. TracIn sums over them; the other kinds
            average over them (Paul et al. average over several runs). Default: the
            current weights. The model's weights are restored afterwards.
        learning_rates: TracIn's ``lr_c``, one per checkpoint or one for all (default 1).
        loss: the loss; defaults to the model's compiled loss.
        training: the forward pass's mode (default inference: no dropout).
        verbose: ``"auto"`` or 1 shows a progress bar, 0 none.

    Returns:
        ``(N,)`` float64 scores aligned with the data, or ``(N, T)`` for ``"influence"``.

    Gradient scores (``"grand"``, TracIn) cost one statistics pass (a forward and a
    backward pass) per batch and checkpoint, with no ``B x P`` tensor for layers with a
    rule; ``"loss"`` and ``"el2n"`` one vectorized forward pass.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}.")
    if (kind == "influence") != (test_data is not None):
        raise ValueError("test_data= is needed by kind='influence' and by no other kind.")
    if learning_rates is not None and kind not in _TRACIN_KINDS:
        raise ValueError("learning_rates= weighs checkpoints for TracIn (kind='self_influence' or "
                         "'influence') only.")
    check_model(model, training)
    test = None
    if test_data is not None:
        if not isinstance(test_data, (tuple, list)) or len(test_data) not in (2, 3):
            raise ValueError("test_data must be (x, y) or (x, y, sample_weight) arrays.")
        test = tuple(test_data) + (None,) * (3 - len(test_data))
    weights = None if checkpoints is None else _checkpoint_weights(model, checkpoints)
    if weights is not None and not weights:
        raise ValueError("checkpoints= is empty.")
    rates = _learning_rates(learning_rates, 1 if weights is None else len(weights))
    if weights is not None and kind not in _TRACIN_KINDS:
        rates = [1.0 / len(weights)] * len(weights)  # the mean over checkpoints
    scorer = _Scorer(model, kind, loss, training, test)
    data = compat.data_adapter(x, y, sample_weight, batch_size=batch_size or 32)
    progress = keras.utils.Progbar(data.num_batches, verbose=1 if verbose == "auto" else int(verbose),
                                   unit_name="batch")
    current = model.get_weights() if weights is not None else None
    chunks, checked, padded = [], False, 0
    try:
        for step, batch in enumerate(data.get_numpy_iterator(), start=1):
            batch_x, batch_y, batch_weight = keras.utils.unpack_x_y_sample_weight(batch)
            size = len(tree.flatten(batch_x)[0])
            padded = padded if step > 1 else size
            # A smaller last batch is padded to the first's size (repeated rows, dropped
            # again): every example's score is its own, and no second compilation.
            batch_x, batch_y, batch_weight = (map_optional(functools.partial(_padded, size=padded), t)
                                              for t in (batch_x, batch_y, batch_weight))
            if kind != "loss" and not checked:
                _check_masks(model, batch_x, kind)
                checked = True
            total = 0.0
            for c, rate in enumerate(rates):
                if weights is not None:
                    model.set_weights(weights[c])
                total = total + rate * scorer(batch_x, batch_y, batch_weight)
            chunks.append(total[:size])
            progress.update(step)
    finally:
        if current is not None:
            model.set_weights(current)
    if not chunks:
        raise ValueError("The data set is empty.")
    return np.concatenate(chunks, axis=0)
