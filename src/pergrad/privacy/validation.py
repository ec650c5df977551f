"""Checks that a model and its data fit DP-SGD's privacy analysis.

DP-SGD's guarantee covers what flows through the noisy aggregated gradient.
It is void when

- one example's output depends on the other examples of the batch (batch
  normalization in training mode): an example then influences every other
  example's gradient, and clipping no longer bounds its influence;
- the model keeps state computed from the data outside the gradient
  (stateful RNNs carrying states across batches, moving statistics updated in
  the forward pass): that state is released without noise;
- the batches are not Poisson samples while the accountant assumes they are.

:func:`validate_model_for_dp` refuses the first two;
:func:`pergrad.privacy.callbacks.check_dp_fit` adds the third as a warning, for
``PerExampleModel.fit`` to call.
"""

from __future__ import annotations

import math

import keras
from keras import tree

from pergrad import compat
from pergrad.layers import batch_normalization_refusal
from pergrad.privacy.banded_accounting import separation_of


class NotPrivateError(ValueError):
    """The model cannot be trained with a differential-privacy guarantee."""


class NotPoissonSampledWarning(UserWarning):
    """A DP model is trained on batches that are not Poisson samples."""


def _layers(model):
    return compat.flatten_layers(model, include_self=False, recursive=True)


_is_seed_state = compat.is_seed_state


def validate_model_for_dp(model, x=None) -> None:
    """Raises :class:`NotPrivateError` for models DP-SGD cannot protect.

    Refused: ``BatchNormalization`` that normalizes with batch statistics
    (a trainable one; a frozen one runs in inference mode and is fine), RNN
    layers with ``stateful=True``, layers with an ``activity_regularizer``
    (a data-dependent loss outside the per-example losses). Layers written by
    users that mix examples cannot be recognized by type; given a sample
    input ``x``, a training-mode forward pass is also run to find non-trainable
    variables the forward pass updates from the data (other than random seed
    states), which would be released without noise.

    Args:
        model: the Keras model (the one wrapped by ``PerExampleModel``).
        x: optional sample inputs for the forward-pass check.
    """
    problems = []
    mixing = batch_normalization_refusal(model, "clipping no longer bounds its influence")
    for layer in _layers(model):
        if getattr(layer, "stateful", False):
            problems.append(
                f"{layer.name!r} is stateful: its state carries data across batches "
                "outside the noisy gradient"
            )
        if getattr(layer, "activity_regularizer", None) is not None:
            problems.append(
                f"{layer.name!r} has an activity_regularizer: a data-dependent loss outside "
                "the per-example losses"
            )
    if x is not None and not problems and not mixing:
        variables = [v for v in model.non_trainable_variables if not _is_seed_state(v)]
        with keras.StatelessScope() as scope:
            model(tree.map_structure(keras.ops.convert_to_tensor, x), training=True)
        for variable in variables:
            if scope.get_current_value(variable) is not None:
                problems.append(
                    f"the forward pass updates {variable.path!r} from the data; it would be "
                    "released without noise"
                )
    if problems or mixing:
        found = " ".join(filter(None, [("; ".join(problems) + ".") if problems else "", mixing]))
        raise NotPrivateError(f"Model {model.name!r} cannot be trained with differential privacy: {found}")


def check_units_match(aggregator, sampler) -> None:
    """The sampler must sample the unit the rule bounds: examples for ``dp_gaussian``
    (``PoissonSampler``), users for ``user_level_dp_gaussian`` (``UserSampler``)."""
    rule_unit = getattr(aggregator, "privacy_unit", "example")
    sampler_unit = getattr(sampler, "privacy_unit", "example")
    if rule_unit != sampler_unit:
        fix = ("pergrad.privacy.UserSampler(x, y, users=ids, ...)" if rule_unit == "user"
               else "pergrad.privacy.user_level_dp_gaussian (or a PoissonSampler)")
        raise ValueError(
            f"{type(aggregator).__name__} bounds the influence of one {rule_unit}, but "
            f"{type(sampler).__name__} samples {sampler_unit}s: the accounting at the "
            f"sampler's rate would not describe the rule's guarantee. Use {fix}."
        )


def check_separation_matches(aggregator, sampler) -> None:
    """A rule with correlated noise over ``b`` bands (``banded_mf_gaussian``) needs every
    example's participations at least ``b`` steps apart: ``sampler`` must guarantee it
    (:func:`~pergrad.privacy.banded_accounting.separation_of`)."""
    bands = getattr(aggregator, "bands", 1)
    separation = separation_of(sampler)
    if separation >= bands:
        return
    rate = sampler.sampling_rate * bands / separation  # the same expected batch
    same = "the same expected batch" if rate <= 1 else "a smaller expected batch: the rate is at most 1"
    raise ValueError(
        f"banded_mf_gaussian(bands={bands}) needs each example's participations at least {bands} "
        f"steps apart, and {type(sampler).__name__} separates them by {separation} step(s): train "
        f"on pergrad.privacy.CyclicPoissonSampler(x, y, sampling_rate={min(rate, 1.0):g}, "
        f"cycle_length={bands}) ({same}), or use at most bands={separation}."
    )


def check_accountant_matches(accountant, aggregator, sampler=None) -> None:
    """An accountant must describe the mechanism that runs: the rule's ``z``, privacy unit and
    bands, the sampler's ``q`` and ``cycle_length``."""
    rule_unit = getattr(aggregator, "privacy_unit", "example")
    if accountant.unit != rule_unit:
        raise ValueError(
            f"PrivacyAccountant(unit={accountant.unit!r}) does not match the model's "
            f"aggregator, which bounds the influence of one {rule_unit}: pass "
            f"unit={rule_unit!r}."
        )
    if not math.isclose(accountant.noise_multiplier, aggregator.noise_multiplier, rel_tol=1e-9):
        raise ValueError(
            f"PrivacyAccountant(noise_multiplier={accountant.noise_multiplier}) does not "
            f"match the model's aggregator (noise_multiplier={aggregator.noise_multiplier})."
        )
    if sampler is not None and not math.isclose(
        accountant.sampling_rate, sampler.sampling_rate, rel_tol=1e-9
    ):
        raise ValueError(
            f"PrivacyAccountant(sampling_rate={accountant.sampling_rate}) does not match "
            f"the PoissonSampler (sampling_rate={sampler.sampling_rate}): the logged "
            "epsilon would describe another mechanism. Pass "
            f"sampling_rate={sampler.sampling_rate} to the accountant."
        )
    bands, cycle_length = getattr(aggregator, "bands", 1), accountant.cycle_length
    if cycle_length is None and bands > 1:
        raise ValueError(
            f"The model's rule is banded_mf_gaussian(bands={bands}), whose epsilon counts each "
            "example's participations, one per cycle of its CyclicPoissonSampler: pass "
            f"PrivacyAccountant(..., cycle_length=k) with the sampler's cycle_length (>= {bands})."
        )
    if cycle_length is not None and cycle_length < bands:
        raise ValueError(
            f"PrivacyAccountant(cycle_length={cycle_length}) is below the rule's bands={bands}: "
            "the amplified BandMF accounting needs participations at least as far apart as the "
            f"bands. Sample with CyclicPoissonSampler(cycle_length={bands}) (or more) and pass it."
        )
    if cycle_length is not None and sampler is not None and separation_of(sampler) != cycle_length:
        raise ValueError(
            f"PrivacyAccountant(cycle_length={cycle_length}) does not match the sampler, which "
            f"separates participations by {separation_of(sampler)} step(s): pass "
            f"cycle_length={separation_of(sampler)}."
        )
