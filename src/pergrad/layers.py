"""Batch normalization and per-example gradients: the one check, and a conversion.

A trainable ``BatchNormalization`` normalizes with the statistics of the whole batch in
training mode, so example i's loss depends on the other examples: per-example gradients
are undefined and clipping no longer bounds one example's influence (DP-SGD's guarantee).
:func:`mixing_batch_normalization` finds such layers and :func:`batch_normalization_refusal`
says so; the engine (``engine.problem.check_model``) and the privacy checks
(``privacy.validate_model_for_dp``) both read them. The ways out: freeze the layers (a
frozen ``BatchNormalization`` runs in inference mode, with its moving statistics), or
replace them by ``GroupNormalization`` with :func:`replace_batch_normalization`, as the DP
literature does (Opacus's ``ModuleValidator.fix``; De et al., "Unlocking High-Accuracy
Differentially Private Image Classification through Scale", 2022). docs/backbones.md
compares the two on a small example.
"""

from __future__ import annotations

import keras

from pergrad import compat

#: the layer names a refusal shows (the count says how many more there are)
_SHOWN = 3


def mixing_batch_normalization(model) -> list:
    """The trainable ``BatchNormalization`` layers of ``model``, nested ones included:
    those that mix the examples of a batch in training mode."""
    return [
        layer
        for layer in compat.flatten_layers(model, include_self=False, recursive=True)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]


def batch_normalization_refusal(model, consequence: str) -> str | None:
    """``None``, or one sentence that counts and names (the first few) trainable
    ``BatchNormalization`` layers of ``model``, says why they are a problem
    (``consequence``, after "so one example's loss depends on the other examples and")
    and gives the ways out."""
    mixing = mixing_batch_normalization(model)
    if not mixing:
        return None
    names = ", ".join(repr(layer.name) for layer in mixing[:_SHOWN])
    if len(mixing) > _SHOWN:
        names += f" and {len(mixing) - _SHOWN} more"
    count, verb = ("1 trainable BatchNormalization layer", "normalizes") if len(mixing) == 1 else (
        f"{len(mixing)} trainable BatchNormalization layers", "normalize")
    direct = {id(layer) for layer in compat.flatten_layers(model, include_self=False, recursive=False)}
    nested = any(id(layer) not in direct for layer in mixing)
    # keras-team/keras#20285: Functional.call hands its own `training` to every layer it
    # runs, replacing the training=False a nested model was called with (Keras 3.15 too).
    nested_note = (
        " Calling a nested model with training=False does not help: Keras 3's fit() runs it "
        "in training mode (keras-team/keras#20285)." if nested else ""
    )
    return (
        f"{names} ({count}) {verb} with the statistics of the whole batch in training mode, "
        f"so one example's loss depends on the other examples and {consequence}. Freeze them "
        "(layer.trainable = False runs a BatchNormalization in inference mode) or replace them "
        "with a copy of the model: "
        "pergrad.layers.replace_batch_normalization(model) (GroupNormalization; "
        f"LayerNormalization also works).{nested_note}"
    )


def _is_graph_model(layer) -> bool:
    return isinstance(layer, keras.Sequential) or compat.is_functional(layer)


def _unconvertible(model) -> list:
    """The layers (``model`` itself included) whose trainable ``BatchNormalization`` layers
    :func:`replace_batch_normalization` cannot reach: a layer or model that is not a
    functional or ``Sequential`` model, holding such a layer."""
    if not _is_graph_model(model):
        return [model] if mixing_batch_normalization(model) else []
    found = []
    for layer in compat.flatten_layers(model, include_self=False, recursive=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            continue
        if _is_graph_model(layer):
            found += _unconvertible(layer)
        elif mixing_batch_normalization(layer):
            found.append(layer)
    return found


def group_count(channels: int, rank: int, groups: int) -> int:
    """The groups of the ``GroupNormalization`` that replaces a ``BatchNormalization`` of
    ``channels`` channels on inputs of rank ``rank``: the largest divisor of ``channels``
    not above ``groups``; 1 (a layer normalization over the features) where the input has
    no axis besides the batch and the channels, since a group of one value per example
    would normalize it to zero."""
    if rank <= 2:
        return 1
    return max(d for d in range(1, min(groups, channels) + 1) if channels % d == 0)


def _group_normalization(layer, groups: int):
    channels = int(layer.moving_mean.shape[0])
    rank = layer.input_spec.ndim if layer.input_spec is not None else None
    return keras.layers.GroupNormalization(
        groups=group_count(channels, rank or 4, groups),
        axis=layer.axis,
        epsilon=layer.epsilon,
        center=layer.center,
        scale=layer.scale,
        beta_regularizer=layer.beta_regularizer,
        gamma_regularizer=layer.gamma_regularizer,
        beta_constraint=layer.beta_constraint,
        gamma_constraint=layer.gamma_constraint,
        name=layer.name,
        dtype=layer.dtype_policy,
    )


def replace_batch_normalization(model, groups: int = 32):
    """A copy of ``model`` with every trainable ``BatchNormalization`` replaced by a
    ``GroupNormalization``, so that per-example gradients are defined and DP-SGD applies.

    The copy is a new model (``keras.models.clone_model``, nested functional and
    ``Sequential`` models cloned too, a base model called with ``training=False`` still
    called so): every other layer is a fresh copy holding the original's weights, with the
    same ``trainable`` flags; a frozen ``BatchNormalization`` (inference mode, per example
    already) is copied as it is. Each replacement has the original's ``axis``,
    ``epsilon``, ``center``, ``scale``, regularizers, constraints, name and dtype policy;
    its ``gamma`` and ``beta`` start from the original's, and its groups are
    :func:`group_count`'s: the largest divisor of the layer's channels not above
    ``groups`` (one group, a layer normalization, after a ``Dense`` layer). The moving mean
    and variance are dropped: a ``GroupNormalization`` normalizes each example by its own
    statistics, in training and inference alike, so the copy computes another function
    than the original until it is trained (a pretrained network loses accuracy at first:
    docs/backbones.md measures how much). The original model is left as it was; the copy
    is compiled as the original was (if it was).

    Args:
        model: a built functional or ``Sequential`` Keras model (nested ones inside it
            are converted too).
        groups: the most groups of a replacement (Wu and He, "Group Normalization", 2018,
            use 32).

    Returns:
        The new model.

    Raises:
        ValueError: ``model`` is not built, ``groups`` is not a positive integer, or a
            trainable ``BatchNormalization`` lies inside a layer or model that is not a
            functional or ``Sequential`` model (a subclassed one, whose ``call`` cannot be
            rewired): freeze those layers instead.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"replace_batch_normalization: groups must be an integer >= 1, got {groups!r}.")
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built yet: build it (or call it on a batch) first.")
    unconvertible = _unconvertible(model)
    if unconvertible:
        names = ", ".join(f"{layer.name!r} ({type(layer).__name__})" for layer in unconvertible)
        raise ValueError(
            f"replace_batch_normalization rebuilds functional and Sequential models only, but "
            f"{names} holds trainable BatchNormalization layers inside its own call(), which "
            "cannot be rewired from outside: freeze them (layer.trainable = False) or replace "
            "them in that class's code."
        )
    pairs = []

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            new = _group_normalization(layer, groups)
            replacements.add(id(new))
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    replacements = set()

    def call(layer, *args, **kwargs):
        if id(layer) in replacements:  # a BatchNormalization's call also took `training`, `mask`
            kwargs.pop("training", None)
            kwargs.pop("mask", None)
        return layer(*args, **kwargs)

    # (Keras refuses a call_function for Sequential models, which call each layer on its input)
    converted = keras.models.clone_model(model, clone_function=clone, recursive=True,
                                         call_function=None if isinstance(model, keras.Sequential) else call)
    for old, new in pairs:
        if not isinstance(old, keras.layers.Layer):  # an operation of the graph (`a + b`): no weights
            continue
        if isinstance(old, keras.layers.BatchNormalization) and old.trainable:
            # Copies (NumPy): a variable assigned another's array shares it on JAX, where a
            # training step that donates it would delete the original's.
            if old.scale:
                new.gamma.assign(old.gamma.numpy())
            if old.center:
                new.beta.assign(old.beta.numpy())
        else:
            new.set_weights(old.get_weights())
    _copy_trainable_flags(model, converted)
    return converted


def _matching_layers(model, converted) -> list:
    """``(original, copy)`` for ``model``, ``converted`` and every layer in them, parents
    before their layers, matched by name within each model (names are unique there)."""
    pairs = [(model, converted)]
    if _is_graph_model(model):
        for layer in compat.flatten_layers(model, include_self=False, recursive=False):
            if not isinstance(layer, keras.layers.InputLayer):  # (clones name inputs anew)
                pairs += _matching_layers(layer, converted.get_layer(layer.name))
    return pairs


def _copy_trainable_flags(model, converted) -> None:
    """``clone_model`` gives a nested functional model the default ``trainable``: each
    model's flag, outermost first (a model's flag sets its layers'), then each layer's own."""
    pairs = _matching_layers(model, converted)
    for old, new in pairs:
        if _is_graph_model(old):
            new.trainable = old.trainable
    for old, new in pairs:
        if not _is_graph_model(old):
            new.trainable = old.trainable
