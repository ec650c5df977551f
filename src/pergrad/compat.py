"""Every use of private Keras API in pergrad, in one place.

Keras keeps these names private (``keras.src...`` modules, underscore
attributes), so a Keras release may move or rename them without notice. Each
one pergrad needs is wrapped here by a small function, so that a Keras upgrade
touches this file only. Tests may still reach into Keras directly. Also here: the
reads of a model's variable lists that a training step repeats
(:func:`one_read_per_step`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import keras
from keras.src.backend.common import backend_utils
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.backend.common.stateless_scope import in_stateless_scope as _in_stateless_scope


def get_mask(tensor):
    """``keras.src...masking.get_keras_mask``: an output's mask, which JAX arrays keep in a side table."""
    return get_keras_mask(tensor)


def set_mask(tensor, mask):
    """``keras.src...masking.set_keras_mask``: gives the step's predictions the mask the forward pass had."""
    set_keras_mask(tensor, mask)


def in_stateless_scope() -> bool:
    """``keras.src...stateless_scope.in_stateless_scope``: whether variable updates go to a
    ``StatelessScope`` (and must, not to the variables themselves)."""
    return _in_stateless_scope()


def make_compile_loss(loss, loss_weights, output_names):
    """``keras.src.trainers.compile_utils.CompileLoss``: the loss container ``compile()`` builds."""
    from keras.src.trainers.compile_utils import CompileLoss

    return CompileLoss(loss, loss_weights, output_names=output_names)


def compiled_loss(model):
    """``Trainer._compile_loss``: the model's compiled loss container (``None`` before ``compile()``)."""
    return getattr(model, "_compile_loss", None)


def compiled_losses(compile_loss) -> list:
    """``CompileLoss._flat_losses``: the built container's loss objects, one per output that
    has a loss (strings and functions resolved and wrapped as Keras wraps them); ``[]``
    before it is built."""
    entries = getattr(compile_loss, "_flat_losses", None) or ()
    return [entry[1] for entry in entries]


def compiled_loss_weights(compile_loss):
    """``CompileLoss._user_loss_weights``: the ``loss_weights`` given to ``compile()``, to keep them."""
    return getattr(compile_loss, "_user_loss_weights", None)


def flatten_layers(layer, include_self: bool = True, recursive: bool = True) -> list:
    """``Layer._flatten_layers``: the layers a layer tracks, to check and freeze them all."""
    return layer._flatten_layers(include_self=include_self, recursive=recursive)


def keras_torch_random():
    """``keras.src.backend.torch.random``: Keras's torch random ops, whose
    ``torch_seed_generator`` the torch adapter wraps inside its vectorized maps (a
    ``SeedGenerator`` drawn per example there, docs/architecture.md, 'Known traps')."""
    from keras.src.backend.torch import random

    return random


def is_functional(layer) -> bool:
    """Whether ``layer`` is a ``keras.src.models.functional.Functional`` model (built from
    inputs and outputs, as ``keras.Model(inputs, outputs)`` and ``keras.applications``'
    models are; not ``Sequential``), whose graph ``keras.models.clone_model`` rebuilds."""
    from keras.src.models.functional import Functional

    return isinstance(layer, Functional)


def seed_generators(layer) -> list:
    """``Layer._seed_generators``: the SeedGenerators a layer owns, whose states Keras does not save."""
    return layer._seed_generators


def is_seed_state(variable) -> bool:
    """Whether a variable is a SeedGenerator's state, by Keras's path naming (``seed_generator_state``)."""
    return variable.path.endswith("seed_generator_state")


def loss_tracker(model):
    """``Trainer._loss_tracker``: the metric behind the ``loss`` that ``fit()`` logs."""
    return model._loss_tracker


def update_metrics_variables(model, metrics_variables, loss, x, y, y_pred, sample_weight):
    """``JAXTrainer._update_metrics_variables``: the stateless metric update of a JAX ``train_step``."""
    return model._update_metrics_variables(metrics_variables, loss, x, y, y_pred, sample_weight)


def held_values(variables) -> list:
    """``Variable._value`` of each variable: the arrays they hold, to refill them after
    Keras's JAX ``fit()`` emptied them (:func:`refill_emptied`)."""
    return [(v, v._value) for v in variables]


def refill_emptied(held) -> None:
    """Gives every variable of ``held`` that Keras's JAX ``fit()`` left empty
    (``Variable._value`` is ``None``) its held array back, unless a step consumed that
    array (JAX deletes the buffers a jitted step was donated)."""
    for variable, value in held:
        deleted = getattr(value, "is_deleted", lambda: False)()
        if variable._value is None and value is not None and not deleted:
            variable.assign(value)


_STEP_READS = contextvars.ContextVar("pergrad_step_variable_reads", default=None)


@contextlib.contextmanager
def one_read_per_step():
    """Within it (one training step), :func:`trainable_variables` and
    :func:`non_trainable_variables` walk each model's layers once: ``Layer.trainable_variables``
    walks the whole layer tree at every read (~80 us on a two-layer BERT, a dozen reads a
    step), and nothing can change a model's variables or their ``trainable`` flags inside
    a step. Outside it, every call reads them again."""
    token = _STEP_READS.set({})
    try:
        yield
    finally:
        _STEP_READS.reset(token)


def once_per_step(owner, name: str, compute):
    """``compute()``, computed once per ``(owner, name)`` within :func:`one_read_per_step`
    (for what nothing inside a step can change); outside it, every call computes it."""
    reads = _STEP_READS.get()
    if reads is None:
        return compute()
    key = (id(owner), name)
    if key not in reads:
        reads[key] = (owner, compute())  # (the owner held: its id stays its own)
    return reads[key][1]


def _read_once(model, name: str) -> list:
    return list(once_per_step(model, name, lambda: getattr(model, name)))


def trainable_variables(model) -> list:
    """``model.trainable_variables``, read once per step within :func:`one_read_per_step`."""
    return _read_once(model, "trainable_variables")


def non_trainable_variables(model) -> list:
    """``model.non_trainable_variables``, read once per step within :func:`one_read_per_step`."""
    return _read_once(model, "non_trainable_variables")


def conv_transpose_left_pads(padding, kernel_size, strides, dilation, output_padding, in_sizes, out_sizes):
    """Per spatial axis, the zeros before the output gradient of a transposed convolution
    (``in_sizes`` to ``out_sizes``) in its adjoint convolution (``pergrad.layer_rules.conv``):
    input position ``i`` meets output position ``i s + j d - pad`` at kernel offset ``j``.

    TensorFlow pads as its forward "SAME" convolution would; Keras converts the padding for
    JAX (``lax.conv_transpose``'s ``(left, right)``, Keras's
    ``backend_utils._convert_conv_transpose_padding_args_from_keras_to_jax``), and crops
    torch's output to JAX's window (Keras 3.15; before, torch's own symmetric padding, one
    off where ``k - s`` is odd). ``None`` for a padding other than "valid" and "same"."""
    if padding not in ("valid", "same"):
        return None
    if output_padding is None:
        output_padding = (None,) * len(kernel_size)
    backend = keras.backend.backend()
    as_jax = backend == "jax" or (
        backend == "torch" and hasattr(backend_utils, "compute_conv_transpose_output_crops_for_torch"))
    pads = []
    for k, s, d, extra, n, m in zip(kernel_size, strides, dilation, output_padding, in_sizes, out_sizes):
        span = (k - 1) * d + 1
        if as_jax:
            left, _ = backend_utils._convert_conv_transpose_padding_args_from_keras_to_jax(
                k, s, d, padding, extra)
            pads.append(span - 1 - left)
        elif backend == "torch":
            pad, _ = backend_utils._convert_conv_transpose_padding_args_from_keras_to_torch(
                k, s, d, padding, extra)
            pads.append(pad)
        else:
            pads.append(0 if padding == "valid" else max(0, (n - 1) * s + span - m) // 2)
    return pads


def own_trainable_variables(layer) -> list:
    """``Layer._trainable_variables``: the trainable variables a layer tracks itself
    (created by it or assigned to one of its attributes), not its sublayers'."""
    if not layer.trainable:
        return []
    return [v for v in layer._trainable_variables if v.trainable]


def keeps_lstm_carry(cell, cell_class) -> bool:
    """Whether ``cell`` computes its carry and output with ``cell_class``'s own private
    ``_compute_carry_and_output`` and ``_compute_carry_and_output_fused`` (Keras's
    ``LSTMCell``: a subclass may override either)."""
    names = ("_compute_carry_and_output_fused", "_compute_carry_and_output")
    return all(getattr(type(cell), name) is getattr(cell_class, name) for name in names)


_WRAPPED = set()


def wrap_backend_function(module: str, name: str, wrap) -> None:
    """Replaces ``keras.src.backend.<active backend>.<module>.<name>``, which the
    ``keras.ops`` op of that name calls, by ``wrap(original)``; once per name (later calls
    do nothing).

    For a backend adapter that must change how Keras's version runs in pergrad's passes
    (torch's ``cond`` branches on a tensor's value, which ``torch.func.vmap`` cannot;
    torch's fused attention has a wrong gradient): ``wrap`` must return a function that
    behaves as the original wherever pergrad does not ask otherwise.
    """
    import importlib

    owner = importlib.import_module(f"keras.src.backend.{keras.backend.backend()}.{module}")
    with _PATCH_LOCK:
        if (module, name) not in _WRAPPED:
            setattr(owner, name, wrap(getattr(owner, name)))
            _WRAPPED.add((module, name))


# The recorders of each thread's dry runs, innermost last, and how many dry runs
# (in any thread) have the patch installed.
_READS = threading.local()
_PATCH_LOCK = threading.Lock()
_patch = {"users": 0, "original": None}


def _recorders() -> list:
    if not hasattr(_READS, "stack"):
        _READS.stack = []
    return _READS.stack


@contextlib.contextmanager
def recording_variable_reads(record):
    """Calls ``record(variable)`` for every variable this thread reads inside a ``StatelessScope``.

    Patches ``StatelessScope.get_current_value``, through which every backend's
    ``Variable.value`` reads a variable in a stateless scope (pergrad's forward
    passes always run in one). The patch is shared by the dry runs of every
    thread: installed by the first, removed (Keras's original restored) by the
    last to finish, under a lock; each read goes to the recorder of the thread
    that makes it, so that concurrent ``fit`` calls neither record each other's
    reads nor stop each other's recording.
    """
    from keras.src.backend.common.stateless_scope import StatelessScope

    with _PATCH_LOCK:
        if _patch["users"] == 0:
            original = StatelessScope.get_current_value

            def get_current_value(self, variable):
                recorders = getattr(_READS, "stack", None)
                if recorders:
                    recorders[-1](variable)
                return original(self, variable)

            _patch["original"] = original
            StatelessScope.get_current_value = get_current_value
        _patch["users"] += 1
    recorders = _recorders()
    recorders.append(record)
    try:
        yield
    finally:
        recorders.pop()
        with _PATCH_LOCK:
            _patch["users"] -= 1
            if _patch["users"] == 0:
                StatelessScope.get_current_value = _patch["original"]
                _patch["original"] = None


def unrecorded_value(scope, variable):
    """``scope.get_current_value(variable)``, not recorded by :func:`recording_variable_reads`:
    the engine's own reads (the seed states a pass hands back), not the model's."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    return (_patch["original"] or StatelessScope.get_current_value)(scope, variable)


def rnn(step_function, inputs, initial_states, **kwargs):
    """``keras.src.backend.rnn``: the time loop Keras's recurrent layers run (its masking,
    ``go_backwards`` and unrolling), for the recurrent layer rules."""
    from keras.src import backend

    return backend.rnn(step_function, inputs, initial_states, **kwargs)


def data_adapter(x, y=None, sample_weight=None, batch_size=None):
    """``keras.src.trainers.data_adapters.get_data_adapter``: what ``fit()`` iterates
    (arrays, ``tf.data``, generators, ``PyDataset``, a torch ``DataLoader``), unshuffled."""
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(x, y, sample_weight, batch_size=batch_size, shuffle=False)
