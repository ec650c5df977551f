"""Privacy auditing with one training run (Steinke, Nasr and Jagielski, NeurIPS 2023).

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
near-perfect guesses. This is the white-box "input-space" canary of Steinke
et al.'s Section 6; scoring random-label digits by their loss (black-box)
gives far weaker audits at the same number of runs.

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
from dataclasses import dataclass, field

import keras
import numpy as np

from pergrad.arguments import check_integer, check_number

#: The numbers of guesses tried by default, as fractions of the canaries (each
#: at ``(1 - confidence) / 5``, Bonferroni): few guesses win under noise, many
#: without it.
DEFAULT_GUESS_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75)


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"Need 0 <= correct <= guesses <= canaries, got correct={correct}, guesses={guesses}, "
            f"canaries={canaries}."
        )


def _check_delta(delta: float) -> None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}.")


def audit_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float = 0.0) -> float:
    """An upper bound on the probability of ``correct`` or more right guesses under ``(epsilon, delta)``-DP.

    Steinke et al.'s Theorem 5.2 (their Algorithm in Appendix D, as a closed
    form): with ``r = guesses``, ``v = correct`` and
    ``W ~ Binomial(r, e^epsilon / (1 + e^epsilon))`` (the right-guess count of
    ``epsilon``-DP randomized response),
    ``P[correct >= v] <= P[W >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= W < v] / i``,
    ``m`` the number of canaries. With ``delta = 0`` it is the binomial tail.

    Args:
        canaries: ``m``, each included independently with probability 1/2.
        guesses: ``r``, the number of canaries guessed (the others abstained on).
        correct: ``v``, the number of right guesses.
        epsilon: the ``epsilon`` of the null hypothesis (>= 0).
        delta: its ``delta``.

    Returns:
        The p-value, at most 1.
    """
    from scipy import special, stats

    _check_counts(canaries, guesses, correct)
    _check_delta(delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be non-negative, got {epsilon}.")
    right = special.expit(epsilon)  # e^eps / (1 + e^eps)
    tail = stats.binom.sf(correct - 1, guesses, right)  # P[W >= v]
    if delta == 0 or correct == 0:
        return float(min(tail, 1.0))
    shortfall = np.arange(1, correct + 1)
    below = stats.binom.sf(correct - shortfall - 1, guesses, right) - tail  # P[v - i <= W < v]
    return float(min(tail + 2 * canaries * delta * np.max(below / shortfall), 1.0))


def epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float = 0.0, confidence: float = 0.95
) -> float:
    """The largest ``epsilon`` that ``correct`` right guesses out of ``guesses`` refute.

    The supremum of the ``epsilon`` whose :func:`audit_p_value` is below
    ``1 - confidence`` (0 when even ``epsilon = 0`` is not refuted): if the
    training run is ``(epsilon, delta)``-DP, the bound exceeds ``epsilon`` with
    probability at most ``1 - confidence``.

    Args:
        canaries: ``m``, each included independently with probability 1/2.
        guesses: ``r``, the number of canaries guessed.
        correct: ``v``, the number of right guesses.
        delta: the ``delta`` of the guarantee audited.
        confidence: ``1 - beta`` (in (0, 1)).
    """
    from scipy import optimize

    _check_counts(canaries, guesses, correct)
    _check_delta(delta)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}.")
    significance = 1.0 - confidence

    def excess(epsilon: float) -> float:  # increasing in epsilon; > 0 where epsilon is not refuted
        return audit_p_value(canaries, guesses, correct, epsilon, delta) - significance

    if excess(0.0) >= 0:
        return 0.0
    high = 1.0
    while excess(high) < 0:
        high *= 2.0
    return float(optimize.brentq(excess, high / 2 if high > 1 else 0.0, high, xtol=1e-9, rtol=1e-12))


@dataclass(frozen=True)
class AuditResult:
    """What :func:`audit` found; ``str()`` gives the one-line summary.

    Attributes:
        epsilon_lower_bound: the empirical lower bound on ``epsilon``.
        epsilon: the accountant's ``epsilon`` for the run (``inf`` without noise).
        delta: the ``delta`` of both.
        confidence: the bound's confidence.
        canaries: ``m``, the canaries drawn.
        included: how many of them were in the training data.
        guesses: ``r``, the guesses of the best-scoring number of guesses.
        correct: how many of those were right.
        noise_multiplier: the noise multiplier the accountant was given.
        sampling_rate: ``q`` of the run's Poisson sampling.
        steps: the DP steps taken.
        scores: every canary's score (higher: more likely included).
        membership: every canary's inclusion (the truth the guesses are scored on).
    """

    epsilon_lower_bound: float
    epsilon: float
    delta: float
    confidence: float
    canaries: int
    included: int
    guesses: int
    correct: int
    noise_multiplier: float
    sampling_rate: float
    steps: int
    scores: np.ndarray = field(repr=False)
    membership: np.ndarray = field(repr=False)

    def __str__(self) -> str:
        return (
            f"one-run audit: epsilon >= {self.epsilon_lower_bound:.2f} at {self.confidence:.0%} "
            f"confidence ({self.correct}/{self.guesses} right guesses on {self.canaries} canaries) "
            f"vs accountant epsilon = {self.epsilon:.2f} (delta={self.delta:g})"
        )


def best_guesses(
    scores, membership, guesses: Sequence[int], delta: float, confidence: float
) -> tuple[float, int, int]:
    """The largest bound over several numbers of guesses, Bonferroni-corrected.

    For each ``r`` in ``guesses``, guesses "included" for the ``r / 2``
    highest scores and "excluded" for the ``r / 2`` lowest, and computes
    :func:`epsilon_lower_bound` at confidence ``1 - (1 - confidence) /
    len(guesses)``, so that the largest of them holds at ``confidence``.

    Returns:
        ``(bound, r, right guesses)`` of the best ``r``.
    """
    scores, membership = np.asarray(scores, dtype="float64"), np.asarray(membership, dtype=bool)
    canaries = len(scores)
    each = 1.0 - (1.0 - confidence) / len(guesses)
    # A stable sort: tied scores (all 0 for the excluded canaries of a run without noise)
    # keep an order that does not depend on membership.
    order = np.argsort(scores, kind="stable")
    best = (0.0, 0, 0)
    for count in guesses:
        half = int(count) // 2
        if half == 0:
            continue
        right = int(membership[order[-half:]].sum() + (~membership[order[:half]]).sum())
        bound = epsilon_lower_bound(canaries, 2 * half, right, delta, each)
        if bound > best[0] or best[1] == 0:
            best = (bound, 2 * half, right)
    return best


def digits_mlp(features: int, classes: int = 10) -> keras.Model:
    """The demo's network on ``features`` inputs: Dense(64, relu), Dense(classes, softmax)."""
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
            a Dense layer on them. Default :func:`digits_mlp`.
        data: ``(x, y)``: flat float features ``(n, d)`` and integer class labels
            (the canaries' labels are drawn from ``y``'s classes). Default: the
            demo's training split of scikit-learn's digits.
        noise_multiplier: ``z``: the accountant's, and the default rule's.
        l2_norm_clip: ``C`` of the default rule.
        rule: ``rule(expected_batch_size)`` returns the aggregator to audit;
            default ``dp_gaussian(l2_norm_clip, noise_multiplier, ...)``. The
            accountant still uses ``noise_multiplier``: a rule that adds less
            noise than it claims is what an audit catches.
        canaries: ``m``. More canaries make a stronger audit (the bound cannot
            exceed about ``log(m)``) and a wider first layer.
        sampling_rate: ``q``; default ``64 / (n + canaries)`` (at most 1).
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
    from pergrad.model import PerExampleModel
    from pergrad.privacy.accounting import epsilon
    from pergrad.privacy.dp_sgd import dp_gaussian, steps_taken
    from pergrad.privacy.sampling import PoissonSampler

    canaries = check_integer("audit", "canaries", canaries, low=2)
    epochs = check_integer("audit", "epochs", epochs)
    check_number("audit", "confidence", confidence, low=0, high=1, low_open=True, high_open=True)
    check_number("audit", "noise_multiplier", noise_multiplier, low=0)
    if data is None:
        from pergrad.demo import load_digits_split

        data = load_digits_split(0)[0]
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
    network = (model_factory or digits_mlp)(features + canaries)
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
        epsilon=epsilon(noise_multiplier, rate, steps, delta, accountant),
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
