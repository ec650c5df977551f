"""Obviously-correct, slow references that never go through pergrad.

- :func:`batch_of_one_gradients`: for each example i, the ordinary Keras gradient of
  ``model.compute_loss`` on the batch ``x[i:i+1]`` (a Python loop over examples),
  with each backend's plain autodiff: ``tf.GradientTape``, ``jax.grad`` through
  ``model.stateless_call``, ``loss.backward()`` in torch.
- :func:`batch_gradient`: the ordinary gradient Keras computes for the whole batch,
  i.e. the gradient plain ``fit()`` hands to the optimizer.
- :func:`fit_both`: the same problem trained by plain ``model.fit`` and by
  ``PerExampleModel.fit``, from identical weights.

pergrad's definition (DESIGN §1) is ``g_i = scale_i * (batch-of-one gradient of
example i)`` where ``scale_i`` is 1 for the Keras default reduction, ``B`` for a
``"sum"`` reduction, and ``B * n_i / sum_j n_j`` for masked outputs with ``n_i``
valid steps (Keras normalizes a masked loss by the batch's count of valid steps).
The tests pass that factor explicitly.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import tree

BACKEND = keras.backend.backend()


def take(structure, i):
    return None if structure is None else tree.map_structure(lambda t: t[i : i + 1], structure)


def _fresh(structure):
    """New backend tensors holding copies: Keras multiplies sample weights by the mask in
    place (``keras.losses.loss.apply_mask``), which on torch writes through to the tensor
    it was given, and to the NumPy array that tensor shares memory with."""
    if structure is None:
        return None
    return tree.map_structure(lambda t: keras.ops.convert_to_tensor(np.array(t, copy=True)), structure)


def to_numpy(value):
    return keras.ops.convert_to_numpy(value)


# --- one gradient of model.compute_loss, per backend --------------------------------


def _tf_gradient(model, x, y, sample_weight, training):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        y_pred = model(x, training=training)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    grads = tape.gradient(loss, model.trainable_variables)
    return [
        np.zeros(v.shape, "float32") if g is None else tf.convert_to_tensor(g).numpy()
        for g, v in zip(grads, model.trainable_variables)
    ]


_JAX_GRADS = {}


def _jax_gradient(model, x, y, sample_weight, training):
    import jax

    key = (id(model), training)
    if key not in _JAX_GRADS:

        def loss_fn(trainable, non_trainable, x, y, sample_weight):
            # As Keras's JAX trainer: `training` only goes to a `call` that takes it.
            kwargs = {"training": training} if model._call_has_training_arg else {}
            y_pred, _ = model.stateless_call(trainable, non_trainable, x, **kwargs)
            mapping = list(zip(model.trainable_variables, trainable))
            # The scope swallows the loss trackers' updates (and reads the traced
            # weights for regularizers, if any).
            with keras.StatelessScope(state_mapping=mapping):
                return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)

        _JAX_GRADS[key] = (model, jax.jit(jax.grad(loss_fn)))
    grad_fn = _JAX_GRADS[key][1]
    grads = grad_fn(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        x,
        y,
        sample_weight,
    )
    return [np.asarray(g) for g in grads]


def _torch_gradient(model, x, y, sample_weight, training):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    variables = model.trainable_variables
    for v in variables:
        v.value.grad = None
    # Attention by torch's math kernel: the CPU flash kernel it picks otherwise has a wrong
    # gradient for a query that the mask leaves no key (pergrad.backend.torch._exact_attention;
    # tests/engine/test_attention_masks.py checks the math kernel by finite differences).
    with sdpa_kernel([SDPBackend.MATH]):
        y_pred = model(x, training=training)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        loss.backward()
    grads = [
        np.zeros(v.shape, "float32") if v.value.grad is None else v.value.grad.detach().cpu().numpy()
        for v in variables
    ]
    for v in variables:
        v.value.grad = None
    return grads


_GRADIENT = {"tensorflow": _tf_gradient, "jax": _jax_gradient, "torch": _torch_gradient}


def _prepare(model, x, y, sample_weight):
    """Builds the compiled loss eagerly, outside any trace (first call builds it)."""
    if getattr(model, "_compile_loss", None) is None:
        raise ValueError("The oracle differentiates model.compute_loss: compile the model first.")
    with keras.StatelessScope():
        model.compute_loss(x=x, y=y, y_pred=model(x, training=False), sample_weight=sample_weight)


def _numpy(structure):
    return None if structure is None else tree.map_structure(lambda t: np.asarray(to_numpy(t)), structure)


def _gradient(model, x, y, sample_weight, training):
    return _GRADIENT[BACKEND](model, _fresh(x), _fresh(y), _fresh(sample_weight), training)


def batch_gradient(model, x, y, sample_weight=None, training=True):
    """The ordinary Keras gradient of ``model.compute_loss`` on the whole batch."""
    x, y, sample_weight = _numpy(x), _numpy(y), _numpy(sample_weight)
    _prepare(model, _fresh(x), _fresh(y), _fresh(sample_weight))
    return _gradient(model, x, y, sample_weight, training)


def batch_of_one_gradients(model, x, y, sample_weight=None, training=True, scale=None):
    """``scale[i]`` times the ordinary Keras gradient on batch ``[i]``, stacked: ``(B,) + shape``."""
    x, y, sample_weight = _numpy(x), _numpy(y), _numpy(sample_weight)
    _prepare(model, _fresh(take(x, 0)), _fresh(take(y, 0)), _fresh(take(sample_weight, 0)))
    size = len(tree.flatten(x)[0])
    per_example = []
    for i in range(size):
        grads = _gradient(model, take(x, i), take(y, i), take(sample_weight, i), training)
        factor = 1.0 if scale is None else float(scale[i])
        per_example.append([factor * g for g in grads])
    return [np.stack(column) for column in zip(*per_example)]


# --- comparisons -----------------------------------------------------------------------


def assert_gradients_close(actual, expected, rtol=1e-5, atol=1e-5, what="gradient"):
    """Lists of arrays equal up to ``atol`` relative to the largest expected entry."""
    actual = [to_numpy(a) for a in actual]
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    scale = max(1.0, max(float(np.max(np.abs(e))) if np.size(e) else 0.0 for e in expected))
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, f"{what} {k}: shape {a.shape}, expected {e.shape}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale, err_msg=f"{what} {k}")


def assert_weights_close(model_a, model_b, atol=1e-6, rtol=1e-6):
    weights_a, weights_b = model_a.get_weights(), model_b.get_weights()
    assert len(weights_a) == len(weights_b)
    for k, (a, b) in enumerate(zip(weights_a, weights_b)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"weight {k}")


# --- plain fit vs pergrad fit -------------------------------------------------------------


def fit_both(
    factory,
    aggregator="mean",
    optimizer=lambda: keras.optimizers.SGD(0.1),
    fit_kwargs=None,
    compile_kwargs=None,
    wrapper_kwargs=None,
    **problem_kwargs,
):
    """Trains one problem with plain ``model.fit`` and with ``PerExampleModel.fit``.

    Both start from identical weights (copied), use fresh optimizers built by
    ``optimizer()``, and see the data in the same order (``shuffle=False``).
    Returns ``(problem, plain_model, plain_history, wrapper, wrapper_history)``.
    """
    import pergrad

    fit_kwargs = {"epochs": 2, "batch_size": 4, "shuffle": False, "verbose": 0, **(fit_kwargs or {})}
    compile_kwargs = compile_kwargs or {}
    plain_problem = factory(**problem_kwargs)
    problem = factory(**problem_kwargs)
    problem.model.set_weights(plain_problem.model.get_weights())

    plain = plain_problem.compile(optimizer=optimizer(), **compile_kwargs)
    plain_history = plain.fit(plain_problem.x, plain_problem.y, **fit_kwargs)

    wrapper = pergrad.PerExampleModel(problem.model, aggregator, **(wrapper_kwargs or {}))
    problem.compile(wrapper, optimizer=optimizer(), **compile_kwargs)
    wrapper_history = wrapper.fit(problem.x, problem.y, **fit_kwargs)
    return problem, plain, plain_history, wrapper, wrapper_history
