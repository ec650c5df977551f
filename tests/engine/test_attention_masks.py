"""Attention masks (padding, causal, both) through every engine path, against the batch-of-one
oracle, on every backend.

A padding mask of shape (B, T, T) leaves the padded queries no key to attend to; their outputs
still reach the loss here (the pooling averages every position). On torch, the CPU flash kernel
gets the gradient of such a row wrong (pergrad.backend.torch._exact_attention): pergrad's passes
and the oracle use the math kernel there, whose gradient a finite difference confirms.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

import oracle
import pergrad
from pergrad.aggregators import clip

BATCH, STEPS, WIDTH, VOCABULARY = 4, 5, 8, 11
CLIP = 0.05  # below most examples' norms: the clip factors matter


def _model(variant: str):
    keras.utils.set_random_seed(5)
    tokens = keras.Input((STEPS,), dtype="int32")
    if variant == "embedding_mask":  # Embedding(mask_zero=True) into a causal attention
        hidden = keras.layers.Embedding(VOCABULARY, WIDTH, mask_zero=True)(tokens)
        attended = keras.layers.MultiHeadAttention(2, 4)(hidden, hidden, use_causal_mask=True)
    else:
        hidden = keras.layers.Embedding(VOCABULARY, WIDTH)(tokens)

        def mask(t):
            valid = ops.not_equal(t, 0)
            if variant == "keys_causal":  # (B, 1, T): every query keeps a key
                return valid[:, None, :]
            return ops.logical_and(valid[:, :, None], valid[:, None, :])  # (B, T, T)

        attended = keras.layers.MultiHeadAttention(2, 4)(
            hidden, hidden, attention_mask=keras.layers.Lambda(mask)(tokens),
            use_causal_mask=variant == "keys_causal")
    pooled = keras.layers.GlobalAveragePooling1D()(attended)
    model = keras.Model(tokens, keras.layers.Dense(3)(pooled))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(3)
    x = rng.integers(1, VOCABULARY, (BATCH, STEPS)).astype("int32")
    for i in range(1, BATCH):  # example i ends with i padding steps (example 0 has none)
        x[i, STEPS - i:] = 0
    return x, rng.integers(0, 3, BATCH)


VARIANTS = ["square", "keys_causal", "embedding_mask"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_per_example_gradients_and_norms_on_every_path(variant):
    model = _model(variant)
    x, y = _data()
    expected = oracle.batch_of_one_gradients(model, x, y)
    oracle.assert_gradients_close(pergrad.per_example_gradients(model, x, y), expected)
    oracle.assert_gradients_close(pergrad.per_example_gradients(model, x, y, microbatch_size=3), expected,
                                  what="microbatches")
    norms = sum(np.sum(g.reshape(BATCH, -1) ** 2, axis=1) for g in expected)
    statistics = pergrad.per_example_statistics(model, x, y)
    np.testing.assert_allclose(oracle.to_numpy(statistics.flat_squared_norms), norms, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", ["auto", "materialized"])
def test_a_clip_step_is_the_clipped_mean_of_the_oracle_gradients(variant, path):
    model = _model(variant)
    x, y = _data()
    expected = oracle.batch_of_one_gradients(model, x, y)
    norms = np.sqrt(sum(np.sum(g.reshape(BATCH, -1) ** 2, axis=1) for g in expected))
    factors = np.minimum(1.0, CLIP / norms)
    assert factors.min() < 1.0  # the clip matters
    update = [np.tensordot(factors, g, axes=1) / BATCH for g in expected]

    before = [oracle.to_numpy(v.value) for v in model.trainable_variables]
    wrapper = pergrad.PerExampleModel(model, clip(CLIP), path=path)
    wrapper.compile(optimizer=keras.optimizers.SGD(1.0), loss=model.loss)
    wrapper.train_on_batch(x, y)
    moved = [b - oracle.to_numpy(v.value) for b, v in zip(before, model.trainable_variables)]
    oracle.assert_gradients_close(moved, update, what=f"clip step ({path})")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's attention kernels")
def test_the_math_kernel_gradient_is_the_finite_difference_of_a_fully_masked_row():
    """The reference pergrad and the oracle use on torch: its gradient is the forward pass's."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 1, 4, 3, dtype=torch.float64, generator=generator)
                         for _ in range(3))
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    keep[..., 2:] = False
    keep[..., 2:, :] = False  # queries 2 and 3 have no key
    bias = torch.where(keep, 0.0, -0.7 * 3.38953e38).to(torch.float64)
    weights = torch.randn(1, 1, 4, 3, dtype=torch.float64, generator=generator)

    def loss(v):
        output = torch.nn.functional.scaled_dot_product_attention(query, key, v, attn_mask=bias)
        return (output * weights).sum()

    with sdpa_kernel([SDPBackend.MATH]):
        value.requires_grad_(True)
        (gradient,) = torch.autograd.grad(loss(value), value)
        value = value.detach()
        step = 1e-6
        for row, column in [(0, 0), (3, 1)]:
            shifted = value.clone()
            shifted[0, 0, row, column] += step
            lowered = value.clone()
            lowered[0, 0, row, column] -= step
            difference = (loss(shifted) - loss(lowered)) / (2 * step)
            np.testing.assert_allclose(gradient[0, 0, row, column].item(), difference.item(), rtol=1e-6)
