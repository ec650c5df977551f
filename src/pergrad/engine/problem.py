"""The single-example loss that every engine path differentiates.

Example i's loss ``L_i`` is the model's reduced data loss evaluated on example
i alone, rescaled so that ``mean_i L_i`` equals the loss Keras reduces over the
batch (docs/architecture.md, 'Per-example gradients'). Its gradient is computed
for every example at once by the backend's vectorizing transform
(``tf.vectorized_map``, ``jax.vmap``, ``torch.func.vmap``) around a forward
pass run inside a ``keras.StatelessScope``, never by a Python loop over examples.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import OrderedDict
from typing import Any

import keras
import numpy as np
from keras import ops, tree

from pergrad import compat
from pergrad.backend import adapter, traced_apart
from pergrad.engine.collectives import ONE_DEVICE
from pergrad.layers import batch_normalization_refusal
from pergrad.tensors import scale_rows

# Per-example RNG streams: example i draws from the seed state offset by
# (i + 1) * this constant in the first seed component, so that examples never
# share a stream and never reuse the model's (distinct for B < 53,000 in int32).
_SEED_STRIDE = 40503

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
_UNREDUCED = (None, "none")

# Problems (and their compiled functions) kept per model: enough for a few losses
# and both training modes, bounded so that recompiling in a loop cannot leak.
_CACHE_SIZE = 8


def _flat_losses(loss):
    return [item for item in tree.flatten(loss) if item is not None]


def map_optional(fn, structure):
    """``tree.map_structure`` that lets ``None`` (an absent argument) through."""
    return None if structure is None else tree.map_structure(fn, structure)


def _reduction(loss) -> str | None:
    if isinstance(loss, keras.losses.Loss):
        return loss.reduction
    return "sum_over_batch_size"  # strings and functions are wrapped this way by Keras


def _nest_map(fn, structure):
    if isinstance(structure, (list, tuple)):
        return type(structure)(_nest_map(fn, item) for item in structure)
    if isinstance(structure, dict):
        return {key: _nest_map(fn, item) for key, item in structure.items()}
    return fn(structure)


def mean_reduced(loss):
    """``loss`` with every unreduced Keras loss replaced by a mean-reduced copy.

    An unreduced loss (reduction ``None`` or ``"none"``) returns each example's
    values; example i's loss ``L_i`` is then its value averaged over the non-batch
    axes times its weight, which is exactly ``L_i`` of the same loss with the
    default ``"sum_over_batch_size"`` reduction (masks included). Other losses are
    returned as they are (the same objects).
    """

    def convert(item):
        if isinstance(item, keras.losses.Loss) and _reduction(item) in _UNREDUCED:
            item = copy.copy(item)  # the caller's object keeps its reduction
            item.reduction = "sum_over_batch_size"
        return item

    return _nest_map(convert, loss)


# Examples of made-up targets and predictions, on which a loss's values for all of them
# and for each example alone are compared (:func:`probe_losses`).
_PROBE_ROWS = 4


def _probe_values(shape, dtype, rng):
    """Made-up values of one target or prediction for :data:`_PROBE_ROWS` examples: class
    ids 0 and 1 for integers (valid for every classifier; several examples share one, as
    the pairs of a contrastive loss need), else values in (0.05, 0.95) (valid
    probabilities, logits, regression targets and positive counts alike)."""
    shape = (_PROBE_ROWS,) + tuple(shape[1:])
    dtype = keras.backend.standardize_dtype(dtype)
    if "int" in dtype or dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.uniform(0.05, 0.95, size=shape).astype("float32")


def _loss_name(loss) -> str:
    fn = getattr(loss, "fn", None)
    return repr(getattr(fn, "__name__", None) or getattr(loss, "name", None) or type(loss).__name__)


def _single_loss(losses, y_true, y_pred):
    """``(loss, y_true, y_pred)`` of a single-output model with one loss, else ``None``."""
    if y_true is None or len(losses) != 1 or len(tree.flatten(y_true)) != 1 or len(tree.flatten(y_pred)) != 1:
        return None  # several outputs: their targets are matched by the container
    return losses[0], tree.flatten(y_true)[0], tree.flatten(y_pred)[0]


def loss_values(loss, y_true, y_pred):
    """The values Keras reduces for one of the container's loss objects (its ``call`` on
    the inputs cast as ``Loss.__call__`` casts them; ranks aligned by a wrapped function)."""
    dtype = getattr(loss, "dtype", None) or keras.backend.floatx()
    return loss.call(ops.cast(y_true, dtype), ops.cast(y_pred, dtype))


def probe_losses(losses, y_true, y_pred) -> bool:
    """Raises unless the loss gives each example a value computed from that example alone;
    returns whether those values carry a mask of their own (``ignore_class``).

    ``losses`` are the compiled loss container's resolved loss objects (strings and
    functions wrapped as Keras wraps them); ``y_true`` and ``y_pred`` give the shapes
    and dtypes (they may be symbolic). The loss runs outside any trace on made-up values
    for a few examples: a loss that returns a scalar for them has reduced over the batch
    (Dice with ``axis=None``, a function that averages), and one whose values for them
    differ from each example's alone mixes examples (Circle, a contrastive loss, a
    target that broadcasts against the whole batch); neither has the per-example losses
    whose mean is the batch loss. A loss that cannot run on the made-up values (it needs
    structured targets) is not judged. Single-output models only.
    """
    single = _single_loss(losses, y_true, y_pred)
    if single is None:
        return False
    loss, y_true, y_pred = single
    if any(d is None for d in tuple(y_true.shape)[1:] + tuple(y_pred.shape)[1:]):
        return False
    rng = np.random.default_rng(0)
    with adapter().outside_trace():
        target = ops.convert_to_tensor(_probe_values(y_true.shape, y_true.dtype, rng))
        prediction = ops.convert_to_tensor(_probe_values(y_pred.shape, y_pred.dtype, rng))
        try:
            values = [loss_values(loss, target[rows], prediction[rows])
                      for rows in [slice(0, _PROBE_ROWS)] + [slice(i, i + 1) for i in range(_PROBE_ROWS)]]
        except Exception:  # noqa: BLE001 (a loss that needs structured targets: not judged)
            return False
        masked = compat.get_mask(values[0]) is not None
        together, alone = ops.convert_to_numpy(values[0]), [ops.convert_to_numpy(v) for v in values[1:]]
    if np.ndim(together) == 0:
        raise ValueError(
            f"The loss {_loss_name(loss)} returns a scalar for a batch, so it has already "
            "averaged over examples and per-example losses cannot be recovered from it. "
            "Return one loss per example (shape (batch,) or (batch, ...)) and let Keras "
            "reduce it (for Dice and Tversky: pass axis=, e.g. the non-batch axes)."
        )
    together = np.reshape(together, (_PROBE_ROWS, -1))
    separate = np.concatenate([np.reshape(a, (1, -1)) for a in alone])
    if separate.shape != together.shape or not np.allclose(together, separate, rtol=1e-4, atol=1e-6):
        raise ValueError(
            f"The loss {_loss_name(loss)} computes each example's value from the other "
            "examples of the batch too (pairs or batch statistics, as Circle and contrastive "
            "losses do, or targets that broadcast against the whole batch), so an example's "
            "own loss, and its gradient, are not defined. Use a loss of each example alone "
            "(check the targets' shape)."
        )
    return masked


def _refuse_data_losses(scope) -> None:
    """Refuses the losses a forward pass added in ``scope`` (they are not per example)."""
    if scope.losses:
        raise NotImplementedError(
            "The model adds losses that depend on the data during its forward pass "
            "(`add_loss` in `call` or an `activity_regularizer`); they are not "
            "defined per example, so pergrad does not support them yet. Weight "
            "regularizers are supported."
        )


def _masks(y_pred) -> list:
    """``[]`` or the mask of the one output (several masked outputs are refused)."""
    # Not `getattr(out, "_keras_mask")`: JAX arrays cannot carry attributes, so Keras
    # keeps their masks in a side table that only `get_keras_mask` (compat.get_mask) reads.
    masks = [compat.get_mask(out) for out in tree.flatten(y_pred)]
    if not any(m is not None for m in masks):
        return []
    if len(masks) > 1:
        raise NotImplementedError(
            "Masked outputs are supported for single-output models only: with "
            "several outputs Keras normalizes each output's loss by its own "
            "count of unmasked steps, which is not known per example."
        )
    return masks


def check_model(model, training: bool = True) -> None:
    """Raises a clear error for models whose per-example gradients are undefined.

    Cheap (a walk over the layers): run on every use, since the user may change
    ``trainable`` flags at any time (once a training step: :func:`compat.one_read_per_step`).
    """
    compat.once_per_step(model, f"check_model/{training}", lambda: _check_model(model, training))


def _check_model(model, training: bool) -> bool:
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built yet: call it on a batch or build it "
            "before asking for per-example gradients."
        )
    if not compat.trainable_variables(model):
        raise ValueError(
            f"Model {model.name!r} has no trainable variables, so it has no "
            "per-example gradients."
        )
    adapter().check_known_problems(compat.flatten_layers(model, include_self=False))
    refusal = training and batch_normalization_refusal(model, "per-example gradients are undefined")
    if refusal:
        raise ValueError(f"Model {model.name!r}: {refusal}")
    return True


_is_seed_state = compat.is_seed_state


class PerExampleProblem:
    """A model and a loss, turned into a single-example loss function.

    Args:
        model: a built Keras model.
        loss: the loss; ``None`` uses the model's compiled loss. A Keras loss
            object, a string, a function, or a nest of them matching the outputs.
        training: passed to the model's forward pass.
        compile_loss: an already built Keras loss container to use (the
            compiled loss of a wrapping model); ``loss`` then names its losses.
    """

    def __init__(self, model, loss=None, training: bool = True, compile_loss=None):
        check_model(model, training)
        self.model = model
        self.training = training
        if compile_loss is None and loss is None:
            compile_loss = compat.compiled_loss(model)
            if compile_loss is None:
                raise ValueError(
                    f"Model {model.name!r} has no compiled loss: pass `loss=` or "
                    "compile the model with a loss."
                )
            loss = model.loss
        self._user_losses = _flat_losses(loss)
        unreduced = any(_reduction(item) in _UNREDUCED for item in self._user_losses)
        if compile_loss is not None and not unreduced:
            self.compile_loss = compile_loss  # the model's (or a wrapper's) compiled loss
        else:
            # Keras's own loss container: handles strings, functions, nests of
            # losses matching the outputs, like `compile` does. An unreduced loss
            # is replaced by its mean-reduced copy (same L_i, see `mean_reduced`),
            # with the compiled loss weights.
            weights = compat.compiled_loss_weights(compile_loss)
            names = getattr(compile_loss, "output_names", None) if compile_loss is not None else None
            if names is None:
                names = getattr(model, "output_names", None)
            loss = mean_reduced(loss)
            self._user_losses = _flat_losses(loss)
            self.compile_loss = compat.make_compile_loss(loss, weights, names)
        reductions = {_reduction(item) for item in self._user_losses}
        if reductions <= set(_MEAN_REDUCTIONS):
            self.sum_reduction = False
        elif reductions == {"sum"}:
            self.sum_reduction = True
        else:
            raise ValueError(
                f"Loss reductions {sorted(map(str, reductions))} cannot be split into "
                "per-example losses whose mean is the batch loss. Use "
                "'sum_over_batch_size' (the Keras default), 'sum' or None (unreduced, "
                "used like the default) for every output."
            )
        self._checked = False
        # Whether the loss masks its own values (ignore_class), from check_once's probe.
        self.loss_masks = False
        # Compiled standalone functions, keyed on what they read from the model (bounded_get).
        self.compiled_functions = OrderedDict()
        # The statistics path's dry-run plans where steps run eagerly (engine.plan.cached_plan).
        self.plans = {}

    @property
    def seed_positions(self) -> list[int]:
        """Positions of the RNG seed states among the model's non-trainable variables.

        Derived on every use: freezing or unfreezing a layer moves them.
        """
        return [i for i, v in enumerate(compat.non_trainable_variables(self.model)) if _is_seed_state(v)]

    # -- the single-example loss -------------------------------------------------

    def _forward(self, trainable_values, non_trainable_values, x, collect_losses=False):
        model = self.model
        mapping = list(zip(compat.trainable_variables(model), trainable_values)) + list(
            zip(compat.non_trainable_variables(model), non_trainable_values)
        )
        with keras.StatelessScope(state_mapping=mapping, collect_losses=collect_losses) as scope:
            y_pred = model(x, training=self.training)
        return y_pred, scope

    def example_loss(self, trainable_values, example, shared):
        """``(L_i times shared['loss_scale'], aux)`` of the example whose rows (without the
        batch axis) ``example`` holds; ``aux`` has its ``loss``, ``y_pred``, advanced
        ``seeds``, and ``valid`` and ``mask`` for a masked output."""
        non_trainable = list(shared["non_trainable"])
        for position, state in zip(self.seed_positions, example.get("seeds", ())):
            non_trainable[position] = state
        x, y, sample_weight = (
            map_optional(lambda t: ops.expand_dims(t, 0), example.get(key))
            for key in ("x", "y", "sample_weight")
        )
        loss, y_pred, masks, scope = self.batch_loss(trainable_values, non_trainable, x, y, sample_weight)
        scaled = loss if shared.get("loss_scale") is None else loss * shared["loss_scale"]
        aux = {
            "loss": loss,
            "y_pred": tree.map_structure(lambda t: ops.squeeze(t, 0), y_pred),
            # (unrecorded: a seed state only read here, a recurrent cell's without dropout,
            # draws nothing, engine.plan)
            "seeds": [compat.unrecorded_value(scope, compat.non_trainable_variables(self.model)[p])
                      for p in self.seed_positions],
        }
        # Keras normalizes the loss by the unmasked values of the whole batch: those of the
        # output's mask and of a mask the loss puts on its values (ignore_class).
        normalization = masks[0] if masks else None
        if self.loss_masks:
            values_mask = compat.get_mask(
                loss_values(compat.compiled_losses(self.compile_loss)[0], tree.flatten(y)[0],
                            tree.flatten(y_pred)[0]))
            normalization = values_mask if normalization is None else ops.logical_and(
                ops.cast(normalization, "bool"), ops.cast(values_mask, "bool"))
        if normalization is not None:
            aux["valid"] = ops.sum(ops.cast(normalization, loss.dtype))
        if masks:
            aux["mask"] = ops.squeeze(masks[0], 0)
        return scaled, aux

    def batch_loss(self, trainable_values, non_trainable, x, y, sample_weight):
        """The data loss of a batch as Keras reduces it: ``(loss, y_pred, masks, scope)``.

        Called on one example by :meth:`example_loss` (``L_i``); on the whole
        batch its value is ``mean_i L_i``. ``masks`` is empty or the one output's mask.
        """
        y_pred, scope = self._forward(trainable_values, non_trainable, x, collect_losses=True)
        _refuse_data_losses(scope)
        masks = _masks(y_pred)
        # The scope swallows the loss container's metric updates (per-output loss
        # trackers); it must also give them values to read: Keras's JAX fit()
        # empties every variable it carries in its state.
        trackers = [(v, ops.zeros(v.shape, v.dtype)) for v in getattr(self.compile_loss, "variables", ())]
        with keras.StatelessScope(state_mapping=trackers):
            loss = self.compile_loss(y, y_pred, sample_weight)
        if not self.sum_reduction:
            # Under a TF strategy Keras's mean reductions carry 1 / R (the optimizer sums
            # R parts): L_i is the single-device loss.
            loss = adapter().unscale_loss(loss)
        return loss, y_pred, masks, scope

    def check_once(self, x, y):
        """The checks that need a forward pass, on the batch, before any vectorized pass:
        what pergrad refuses is refused here, on every engine path. On the whole batch, so
        that a shape error quotes the batch's shapes, as plain Keras does."""
        if self._checked:
            return
        # Apart from a step's trace (TensorFlow), which would keep this forward pass's while
        # loops (an RNN's) and run them at every step.
        traced_apart(lambda: self._check(x, y))
        self._checked = True

    def _check(self, x, y):
        # Tensors, as Keras gives a loss: a NumPy target minus a torch tensor fails.
        inputs = map_optional(ops.convert_to_tensor, x)
        # In training mode, as the per-example pass runs, in a scope of its own: nothing
        # the pass assigns (seed states) is kept, and torch's global generator, which
        # unseeded dropout draws from, is left where it was. The variables' current
        # values (inside Keras's JAX train step, those of its state).
        values = [(v, v.value) for v in self.model.variables]
        random_state = adapter().random_state()
        try:
            with keras.StatelessScope(state_mapping=values, collect_losses=True) as scope:
                y_pred = self.model(inputs, training=self.training)
        finally:
            adapter().set_random_state(random_state)
        _refuse_data_losses(scope)
        _masks(y_pred)
        targets = map_optional(ops.convert_to_tensor, y)
        if targets is not None and not getattr(self.compile_loss, "built", True):
            with keras.StatelessScope():  # builds the loss container outside any trace
                self.compile_loss(targets, y_pred, None)
        self.loss_masks = probe_losses(compat.compiled_losses(self.compile_loss), targets, y_pred)

    # -- public entry point ---------------------------------------------------------

    def compute(
        self,
        trainable_values,
        non_trainable_values,
        x,
        y=None,
        sample_weight=None,
        microbatch_size: int | None = None,
        loss_scale=None,
        collectives=ONE_DEVICE,
    ) -> tuple[list, dict[str, Any]]:
        """Per-example gradients and auxiliary outputs, all with a batch axis.

        Returns ``(gradients, aux)``: ``aux["loss"]`` holds each example's loss
        ``L_i``, ``aux["y_pred"]`` the predictions, ``aux["seeds"]`` the advanced
        seed states (to be assigned back), all computed in the same pass. With
        ``loss_scale`` (mixed precision), each loss is differentiated times that
        scale (divided by the batch size for mean reductions, as in the batched
        backward pass) and the gradients are divided by it again: callers get
        unscaled gradients. ``collectives``: where the batch starts in the whole batch
        (:class:`~pergrad.engine.collectives.Collectives`; each example's random stream).
        """
        batched, batch_size, non_trainable_values, loss_scale = self.batched_inputs(
            non_trainable_values, x, y, sample_weight, loss_scale, collectives=collectives
        )
        grads, aux = adapter().vectorized_grad(
            self.example_loss,
            list(trainable_values),
            batched,
            {"non_trainable": non_trainable_values, "loss_scale": loss_scale},
            microbatch_size,
        )
        example_scale = self.example_scale(aux.pop("valid", None), batch_size)
        if example_scale is not None:
            aux["loss"] = aux["loss"] * ops.cast(example_scale, aux["loss"].dtype)
        grad_scale = example_scale
        if loss_scale is not None:
            inverse = 1.0 / ops.cast(loss_scale, "float32")
            grad_scale = inverse if grad_scale is None else grad_scale * inverse
        if grad_scale is not None:
            grads = [scale_rows(g, grad_scale) for g in grads]
        aux["seeds"] = self.advanced_seeds(non_trainable_values, aux["seeds"])
        return grads, aux

    def example_scale(self, valid, batch_size):
        """``c_i``, example i's factor on ``L_i`` for the batch's normalization, or ``None`` (all 1).

        ``L_i`` rescaled to the batch's normalization (docs/architecture.md,
        'Per-example gradients'): ``B`` for a sum reduction, ``B valid_i / sum_j
        valid_j`` for masks (``valid``: each example's unmasked steps). Constant in
        the parameters, so it scales the gradient as well.
        """
        if valid is None:
            return ops.full((batch_size,), batch_size, dtype="float32") if self.sum_reduction else None
        return ops.cast(valid, "float32") * self.scale_constant(valid, batch_size)

    def scale_constant(self, valid, batch_size):
        """``c_i / valid_i``, the same for every example (``c_i`` without masks), or ``None`` (1).

        ``B / sum_j valid_j`` for masks, times ``B`` for a sum reduction. The chunked
        path (``engine.chunked``) applies it once, after it has every example's ``valid``.
        """
        constant = None
        if valid is not None:
            constant = ops.cast(batch_size, "float32") / ops.sum(ops.cast(valid, "float32"))
        if self.sum_reduction:
            size = ops.cast(batch_size, "float32")
            constant = size if constant is None else constant * size
        return constant

    def advanced_seeds(self, non_trainable_values, example_seeds):
        """The model's seed states after a vectorized pass that returned ``example_seeds``.

        Every example advanced its own copy of each seed state by the same count;
        the model's state advances by that count too.
        """
        return [
            ops.stack([non_trainable_values[p][0], new[0][1]])
            for p, new in zip(self.seed_positions, example_seeds)
        ]

    def batched_inputs(self, non_trainable_values, x, y=None, sample_weight=None, loss_scale=None,
                       padded_size=None, collectives=ONE_DEVICE):
        """The per-example inputs of :meth:`compute`: ``(batched, B, non_trainable, loss_scale)``.

        ``batched`` holds the inputs, targets, weights and each example's seed
        states; ``loss_scale`` is the one each example's loss is multiplied by.
        With ``padded_size``, the seed states are made for that many examples
        (the first ``B`` are those of the batch), for a caller that pads it. Example i's
        stream is that of its position in the whole batch (``collectives.first_example``
        + i), so that it does not depend on how the batch is split.
        """
        x, y = map_optional(ops.convert_to_tensor, x), map_optional(ops.convert_to_tensor, y)
        batch_size = ops.shape(tree.flatten(x)[0])[0]
        batched = {"x": x}
        if y is not None:
            batched["y"] = y
        if sample_weight is not None:
            # A copy: Keras multiplies the weights by the mask in place
            # (`sample_weight *= float_mask` in keras.losses.loss.apply_mask), which
            # on torch would write through to the caller's tensor.
            batched["sample_weight"] = map_optional(
                lambda t: ops.copy(ops.cast(t, keras.backend.floatx())), sample_weight
            )
        non_trainable_values = list(non_trainable_values)
        if loss_scale is not None and not self.sum_reduction:
            # Example i's share of the batch's mean loss is L_i / B: scaling by
            # loss_scale / B gives the per-example backward pass the magnitudes of
            # Keras's batched one, so float16 intermediates overflow (and the
            # LossScaleOptimizer skips a step) exactly when plain fit() would.
            loss_scale = ops.cast(loss_scale, "float32") / ops.cast(batch_size, "float32")
        if self.seed_positions:
            seeds_for = batch_size if padded_size is None else padded_size
            first = collectives.first_example(batch_size)
            batched["seeds"] = [
                self._example_seeds(non_trainable_values[p], seeds_for, first)
                for p in self.seed_positions
            ]
        return batched, batch_size, non_trainable_values, loss_scale

    @staticmethod
    def _example_seeds(state, batch_size, first=0):
        positions = ops.arange(first + 1, first + batch_size + 1, dtype="int32")
        offsets = ops.cast(positions * _SEED_STRIDE, state.dtype)
        first = state[0] + offsets
        second = ops.broadcast_to(state[1], ops.shape(first))
        return ops.stack([first, second], axis=1)

    def regularization(self, trainable_values):
        """Value and gradient of the weight regularizers (batch-level, data-free)."""
        variables = compat.trainable_variables(self.model)
        if not any(getattr(v, "regularizer", None) is not None for v in variables):
            return None, None

        def total(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                losses = self.model.losses
                return ops.sum(ops.stack([ops.cast(l, "float32") for l in losses]))

        return adapter().grad(total, list(trainable_values))


def _loss_key(loss):
    """Identity of a loss argument; strings by value (an equal literal is the same loss)."""
    return _nest_map(lambda item: item if isinstance(item, str) or item is None else id(item), loss)


_CACHE_LOCK = threading.RLock()


def bounded_get(cache: OrderedDict, key, make):
    """``cache[key]``, made by ``make()`` if absent; the least recently used entry goes.

    Under a lock: ``fit`` may run in several threads (tf.distribute's replicas, or
    the user's), and an OrderedDict's move and eviction are not atomic.
    """
    with _CACHE_LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = make()  # (outside the lock: it may trace or compile)
    with _CACHE_LOCK:
        value = cache.setdefault(key, value)
        cache.move_to_end(key)
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    return value


def compiled_once(problem, name: str, pure, *options):
    """``adapter().compile(pure)``, compiled once per (``name``, the model's trainable
    variables, its non-trainable variables, ``options``) in ``problem.compiled_functions``.

    The variables are keyed in order and by identity, read on every call: a freeze, an
    unfreeze or a new layer selects another function (the loss and a recompile select
    another problem: :func:`cached_problem`). The entry holds the variables, so that their
    ids cannot be reused while it lives. ``options``: whatever else ``pure`` was made
    with (a microbatch size, a diagnostics request). ``pure(trainable_values,
    non_trainable_values, x, y, sample_weight)``; only the first ``pure`` of a key is kept.
    """
    model = problem.model
    trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
    key = (name, tuple(map(id, trainable)), tuple(map(id, non_trainable)), *options)
    return bounded_get(
        problem.compiled_functions, key, lambda: ((trainable, non_trainable), adapter().compile(pure))
    )[1]


class _CachedProblem(PerExampleProblem):
    """A problem kept for its model in :data:`_PROBLEMS`: it holds the model weakly, so
    that the cache, which lives as long as the model, does not keep the model alive."""

    @property
    def model(self):
        return self._model()

    @model.setter
    def model(self, model):
        self._model = weakref.ref(model)


# The problems of the standalone functions (per_example_gradients, per_example_statistics)
# for each model, keyed weakly: an entry goes with its model (read and written under
# _CACHE_LOCK).
_PROBLEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_problem(model, loss, training) -> PerExampleProblem:
    """The problem for ``model`` under its current loss, made once per key.

    The key holds everything the problem derives from the user's objects: the
    loss argument, or else the model's compiled loss and ``model.loss`` (a
    recompile replaces both), and ``training``. Entries keep references to the
    keyed objects, so that their ids cannot be reused while the entry lives.
    What the user can change without a compile (``trainable`` flags, hence the
    variables and the seed positions) is derived on use instead.
    """
    with _CACHE_LOCK:
        cache = _PROBLEMS.get(model)
        if cache is None:
            cache = _PROBLEMS[model] = OrderedDict()
    if loss is None:
        compiled = compat.compiled_loss(model)
        owners = (compiled, getattr(model, "loss", None))
        key = ("compiled", id(compiled), id(owners[1]), training)
    else:
        owners = (loss,)
        key = ("loss", repr(_loss_key(loss)), training)
    entry = bounded_get(cache, key, lambda: (owners, _CachedProblem(model, loss, training=training)))
    return entry[1]
