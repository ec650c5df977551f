"""``pergrad.privacy.audit``: one-run privacy auditing of DP-SGD (Steinke, Nasr and Jagielski, 2023).

It trains a :class:`~pergrad.PerExampleModel` on the data it is given (``pergrad demo``
audits on scikit-learn's digits, :mod:`pergrad.apps.demo`). The statistics are in
:mod:`pergrad.privacy.auditing`.

A DP implementation can be wrong in ways no unit test sees: noise of the wrong
scale, a clip applied after the sum, a leak through the denominator. An audit
measures what a training run actually leaks. :func:`audit` inserts ``m``
canaries into the training data, each included independently with
probability 1/2, trains once with DP-SGD (:class:`PoissonSampler`,
:func:`dp_gaussian`), scores each canary, guesses "included" for the ``k+``
highest scores and "excluded" for the ``k-`` lowest, and turns the number of
correct guesses into a lower bound on ``epsilon`` that holds with the requested
confidence. If the run is ``(epsilon, delta)``-DP, the bound exceeds
``epsilon`` with probability at most ``1 - confidence``; a bound above the
accountant's ``epsilon`` is evidence of a bug.

**Canaries** ("Dirac" input canaries, white-box scores): the input gets ``m``
extra features, zero for every real example; canary ``i`` is the indicator of
feature ``i`` (zero elsewhere) with a random label. Only canary ``i`` ever
moves row ``i`` of the first Dense kernel by its gradient; every other row of
the canaries' block moves by noise alone. Canary ``i``'s score is how much the
final movement of its row lowers its own loss: its loss with the row reset to
its initial value minus its loss with the trained row (one forward pass each:
a canary's input touches only its own row). Without noise an excluded canary's
row never moves (score exactly 0), so the audit shows the lack of noise with
near-perfect guesses. These are white-box canaries (the auditor reads the
first layer's weights before and after training), as in Steinke et al.'s
white-box experiments; a black-box audit that only sees the final model's
losses is weaker.

**What the bound is.** A lower bound: a bound far below the accountant's
``epsilon`` does not mean the run is more private than accounted; one-run
audits are loose for small ``epsilon`` (their strength grows with the number of
canaries, about ``log(m)`` at most) and for DP-SGD's realistic threat model,
where an adversary sees only the final model.

References:
    Steinke, Nasr and Jagielski, 2023, "Privacy auditing with one (1) training
    run", NeurIPS. https://arxiv.org/abs/2305.08846
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import numpy as np

from pergrad.arguments import check_integer, check_number
from pergrad.privacy.accounting import epsilon
from pergrad.privacy.auditing import AuditResult, best_guesses
from pergrad.privacy.banded_accounting import banded_mf_epsilon
from pergrad.privacy.cyclic import CyclicPoissonSampler
from pergrad.privacy.dp_sgd import dp_gaussian, steps_taken
from pergrad.privacy.sampling import PoissonSampler
from pergrad.training.model import PerExampleModel

#: The numbers of guesses tried by default, as fractions of the canaries (each
#: at ``(1 - confidence) / 5``, Bonferroni): few guesses win under noise, many
#: without it.
DEFAULT_GUESS_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75)


def default_network(features: int, classes: int) -> keras.Model:
    """Dense(64, relu), Dense(classes, softmax) on ``features`` inputs: the audit's default
    network, and the demo's (``pergrad.apps.digits``)."""
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(classes, activation="softmax"),
        ]
    )


def _first_dense_kernel(model: keras.Model, features: int):
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    first = layers[0] if layers else None
    if not isinstance(first, keras.layers.Dense) or tuple(first.kernel.shape)[0] != features:
        raise ValueError(
            "audit's canaries are extra input features that only the first layer's kernel "
            f"reads: the model's first layer must be a Dense layer on the {features} input "
            f"features (the data's and the canaries'), got {first!r}."
        )
    return first.kernel


def _per_example_loss(loss):
    if isinstance(loss, keras.losses.Loss):
        return loss.call
    return keras.losses.get(loss)


def audit(
    model_factory: Callable[[int], keras.Model] | None = None,
    data: tuple | None = None,
    *,
    noise_multiplier: float = 1.0,
    l2_norm_clip: float = 1.0,
    rule: Callable | None = None,
    canaries: int = 500,
    sampling_rate: float | None = None,
    cycle_length: int = 1,
    bucket_width: int | None = None,
    epochs: int = 10,
    optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
    loss="sparse_categorical_crossentropy",
    delta: float = 1e-5,
    confidence: float = 0.95,
    guesses: Sequence[int] | None = None,
    accountant: str = "rdp",
    seed: int | None = None,
) -> AuditResult:
    """Audits DP-SGD on ``data`` with one training run (Steinke, Nasr and Jagielski, 2023).

    Appends ``canaries`` zero columns to ``data``'s inputs and ``canaries``
    Dirac canaries with random labels to its rows (see the module docstring),
    includes each canary with probability 1/2, and trains
    ``model_factory(features)`` once with :class:`~pergrad.privacy.PoissonSampler`
    and the DP rule. An excluded canary is in the sampler's data with sample
    weight 0 (no loss, no gradient, as if absent), so that the dataset size and
    ``expected_batch_size = q * (n + canaries)``, the rule's denominator, do
    not depend on which canaries are in. Then scores the canaries and bounds
    ``epsilon`` with :func:`best_guesses`.

    Args:
        model_factory: builds the (uncompiled) Keras model from the number of
            input features, ``data``'s plus ``canaries``; its first layer must be
            a Dense layer on them. Default: :func:`default_network`, Dense(64, relu)
            and a softmax with one output per class of ``y`` (the demo's network).
        data: ``(x, y)``: flat float features ``(n, d)`` and integer class labels
            (the canaries' labels are drawn from ``y``'s classes). Required
            (``pergrad demo`` audits on scikit-learn's digits).
        noise_multiplier: ``z``: the accountant's, and the default rule's.
        l2_norm_clip: ``C`` of the default rule.
        rule: ``rule(expected_batch_size)`` returns the aggregator to audit;
            default ``dp_gaussian(l2_norm_clip, noise_multiplier, ...)``. The
            accountant still uses ``noise_multiplier``: a rule that adds less
            noise than it claims is what an audit catches.
        canaries: ``m``. More canaries make a stronger audit (the bound cannot
            exceed about ``log(m)``) and a wider first layer.
        sampling_rate: ``q``; default ``64 / (n + canaries)`` (at most 1).
        cycle_length: ``k > 1`` trains on a :class:`~pergrad.privacy.CyclicPoissonSampler` of
            ``k`` groups (each step samples one group at rate ``q``), as a rule with correlated
            noise over ``b <= k`` bands needs (``rule`` returning
            :func:`~pergrad.privacy.banded_mf_gaussian`), and the accountant's ``epsilon`` is
            :func:`~pergrad.privacy.banded_mf_epsilon`'s (``ceil(steps / k)`` participations).
        bucket_width: the sampler's (:class:`~pergrad.privacy.PoissonSampler`);
            ``n + canaries`` pads every batch to one shape, one compilation.
        epochs: passes of ``round(1 / q)`` steps. A canary that is never sampled
            leaves no trace: about ``exp(-epochs)`` of the included ones.
        optimizer: ``optimizer()`` returns a fresh optimizer; default Adam(3e-3).
        loss: the training loss (a name, function or ``keras.losses.Loss``),
            also the canaries' score.
        delta: the ``delta`` of the accountant and of the bound.
        confidence: the bound's confidence.
        guesses: numbers of guesses to try (Bonferroni over them); default
            :data:`DEFAULT_GUESS_FRACTIONS` of ``canaries``.
        accountant: ``"rdp"`` or ``"pld"``.
        seed: seeds the canaries, their inclusion, the model's initial weights,
            the sampler and the default rule's noise: reproducible audits (the
            audited model is thrown away). ``None``: fresh randomness.

    Returns:
        An :class:`AuditResult`; ``print(result)`` shows the bound beside the
        accountant's ``epsilon``.
    """
    canaries = check_integer("audit", "canaries", canaries, low=2)
    epochs = check_integer("audit", "epochs", epochs)
    check_number("audit", "confidence", confidence, low=0, high=1, low_open=True, high_open=True)
    check_number("audit", "noise_multiplier", noise_multiplier, low=0)
    if data is None:
        raise ValueError("audit needs data=(x, y): the examples the audited run trains on.")
    x, y = (np.asarray(part) for part in data)
    if x.ndim != 2 or len(x) != len(y):
        raise ValueError(
            "audit needs flat features x of shape (n, d) and one label per row, "
            f"got x {x.shape}, y {y.shape}."
        )
    labels = y.reshape(len(y), -1)
    if labels.shape[1] != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            "audit's canaries get random class labels: y must be integer class labels, one per row, "
            f"got dtype {y.dtype} and shape {y.shape}."
        )
    rows, features = x.shape
    rng = np.random.default_rng(seed)
    canary_labels = rng.choice(np.unique(labels), canaries).astype(labels.dtype).reshape(-1, *y.shape[1:])
    membership = rng.random(canaries) < 0.5
    canary_x = np.zeros((canaries, features + canaries), dtype="float32")
    canary_x[np.arange(canaries), features + np.arange(canaries)] = 1.0
    train_x = np.concatenate([np.pad(x.astype("float32"), ((0, 0), (0, canaries))), canary_x])
    train_y = np.concatenate([y, canary_labels])
    weights = np.concatenate([np.ones(rows, "float32"), membership.astype("float32")])

    size = rows + canaries
    rate = min(1.0, 64.0 / size) if sampling_rate is None else sampling_rate
    check_number("audit", "sampling_rate", rate, low=0, high=1, low_open=True)
    cycle_length = check_integer("audit", "cycle_length", cycle_length)
    if cycle_length > 1:
        sampler = CyclicPoissonSampler(train_x, train_y, sample_weight=weights, sampling_rate=rate,
                                       cycle_length=cycle_length, bucket_width=bucket_width, seed=seed)
    else:
        sampler = PoissonSampler(
            train_x, train_y, sample_weight=weights, sampling_rate=rate, bucket_width=bucket_width, seed=seed
        )
    if rule is None:

        def rule(expected_batch_size):
            return dp_gaussian(
                l2_norm_clip, noise_multiplier, expected_batch_size=expected_batch_size, seed=seed
            )

    if seed is not None:
        keras.utils.set_random_seed(seed)
    if model_factory is None:
        def model_factory(features):
            return default_network(features, classes=int(labels.max()) + 1)

    network = model_factory(features + canaries)
    kernel = _first_dense_kernel(network, features + canaries)
    model = PerExampleModel(network, rule(sampler.expected_batch_size))
    model.compile(optimizer=optimizer() if optimizer else keras.optimizers.Adam(3e-3), loss=loss)
    initial = keras.ops.convert_to_numpy(kernel).copy()
    model.fit(sampler, epochs=epochs, verbose=0)

    # Canary i's input reads only row `features + i`: resetting every canary row at once
    # resets, for each canary, its own row.
    per_example_loss = _per_example_loss(loss)
    trained = keras.ops.convert_to_numpy(kernel).copy()
    loss_trained = keras.ops.convert_to_numpy(per_example_loss(canary_labels, network(canary_x)))
    reset = trained.copy()
    reset[features:] = initial[features:]
    kernel.assign(reset)
    loss_reset = keras.ops.convert_to_numpy(per_example_loss(canary_labels, network(canary_x)))
    kernel.assign(trained)
    scores = np.asarray(loss_reset, "float64").reshape(canaries) - np.asarray(
        loss_trained, "float64"
    ).reshape(canaries)

    counts = guesses or [max(2, round(f * canaries)) for f in DEFAULT_GUESS_FRACTIONS]
    bound, made, right = best_guesses(scores, membership, counts, delta, confidence)
    steps = steps_taken(model)
    return AuditResult(
        epsilon_lower_bound=bound,
        epsilon=epsilon(noise_multiplier, rate, steps, delta, accountant) if cycle_length == 1 else
        banded_mf_epsilon(noise_multiplier, rate, steps, delta, bands=getattr(model.aggregator, "bands", 1),
                          cycle_length=cycle_length, accountant=accountant),
        delta=delta,
        confidence=confidence,
        canaries=canaries,
        included=int(membership.sum()),
        guesses=made,
        correct=right,
        noise_multiplier=float(noise_multiplier),
        sampling_rate=rate,
        steps=steps,
        scores=scores,
        membership=membership,
    )
