"""Differentially private training: DP-SGD's aggregator, Poisson sampling, accounting.

A DP-SGD recipe::

    sampler = pergrad.privacy.PoissonSampler(x, y, sampling_rate=q)
    model = pergrad.PerExampleModel(
        net, pergrad.privacy.dp_gaussian(1.0, z, expected_batch_size=sampler.expected_batch_size))
    model.compile(optimizer="sgd", loss=...)
    model.fit(sampler, epochs=..., callbacks=[
        pergrad.privacy.PrivacyAccountant(z, q, delta=1e-5, max_epsilon=3.0)])

The guarantee, what is refused to keep it, what ``seed=`` means and how
resuming works are described in :class:`DPGaussian`,
:class:`PrivacyAccountant`, :class:`PoissonSampler` and the README.

Correlated noise (banded matrix factorization, BandMF): :func:`banded_mf_gaussian` on a
:class:`CyclicPoissonSampler`, with ``PrivacyAccountant(..., cycle_length=k)``
(docs/banded-mf.md).

User-level DP (the guarantee for one user and all of their examples):
:func:`user_level_dp_gaussian` on a :class:`UserSampler`, with
``PrivacyAccountant(..., unit="user")`` (:mod:`pergrad.privacy.user_level`).

Accounting (:func:`epsilon`, :func:`noise_multiplier_for`) and the one-run
audit (:func:`audit`: an empirical lower bound on ``epsilon``) need the
``dp-accounting`` package (``pip install pergrad[privacy]``; it brings scipy).
"""

from pergrad.aggregators.base import UNIT_IDS, UNIT_INPUTS, zero_non_finite_examples
from pergrad.privacy.accounting import (
    ACCOUNTANTS,
    dp_sgd_event,
    epsilon,
    make_accountant,
    noise_multiplier_for,
    steps_within_budget,
)
from pergrad.privacy.adaptive import (
    AdaptiveDPGaussian,
    adaptive_dp_gaussian,
    gradient_noise_multiplier,
)
from pergrad.privacy.auditing import (
    AuditResult,
    audit_p_value,
    best_guesses,
    epsilon_lower_bound,
)
from pergrad.privacy.banded import BandedStrategy, correlate_step, fhu_coefficients
from pergrad.privacy.banded_accounting import banded_mf_epsilon, banded_mf_event
from pergrad.privacy.banded_rule import BandedMFGaussian, banded_mf_gaussian
from pergrad.privacy.callbacks import (
    PrivacyAccountant,
    PrivacyBudgetExhaustedError,
    check_dp_fit,
)
from pergrad.privacy.canary_audit import audit
from pergrad.privacy.cyclic import CyclicPoissonSampler
from pergrad.privacy.dp_sgd import (
    DPGaussian,
    dp_gaussian,
)
from pergrad.privacy.sampling import (
    BatchOverflowError,
    PoissonSampler,
    default_bucket_width,
    max_batch_size_for,
)
from pergrad.privacy.tuning import tuning_epsilon, tuning_event
from pergrad.privacy.user_level import (
    UserLevelDPGaussian,
    UserSampler,
    user_level_dp_gaussian,
)
from pergrad.privacy.validation import (
    NotPoissonSampledWarning,
    NotPrivateError,
    validate_model_for_dp,
)

__all__ = [
    "ACCOUNTANTS",
    "UNIT_IDS",
    "UNIT_INPUTS",
    "AdaptiveDPGaussian",
    "AuditResult",
    "BandedMFGaussian",
    "BandedStrategy",
    "BatchOverflowError",
    "CyclicPoissonSampler",
    "DPGaussian",
    "NotPoissonSampledWarning",
    "NotPrivateError",
    "PoissonSampler",
    "PrivacyAccountant",
    "PrivacyBudgetExhaustedError",
    "UserLevelDPGaussian",
    "UserSampler",
    "adaptive_dp_gaussian",
    "audit",
    "audit_p_value",
    "banded_mf_epsilon",
    "banded_mf_event",
    "banded_mf_gaussian",
    "best_guesses",
    "check_dp_fit",
    "correlate_step",
    "default_bucket_width",
    "dp_gaussian",
    "dp_sgd_event",
    "epsilon",
    "epsilon_lower_bound",
    "fhu_coefficients",
    "gradient_noise_multiplier",
    "make_accountant",
    "max_batch_size_for",
    "noise_multiplier_for",
    "steps_within_budget",
    "tuning_epsilon",
    "tuning_event",
    "user_level_dp_gaussian",
    "validate_model_for_dp",
    "zero_non_finite_examples",
]

