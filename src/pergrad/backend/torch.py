"""PyTorch adapter: ``torch.func.vmap(torch.func.grad(...))``."""

import torch

from pergrad.backend._single_replica import all_gather, all_reduce_sum, replica_id, unscale_loss  # noqa: F401

_LAYOUT_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


class _IgnoreMemoryLayout(torch.overrides.TorchFunctionMode):
    """Drops memory-layout requests, which vmap cannot answer (keras#23587).

    Keras's torch convolutions ask ``is_contiguous(memory_format=channels_last)``
    and copy to channels-last; inside ``torch.func.vmap`` both raise "NYI". A
    memory layout is a performance hint that never changes a value, so inside
    our vectorized map we answer "already contiguous" and keep the layout. This
    relies on torch's public function-mode hook, not on Keras internals.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.is_contiguous:
            return True
        if func in (torch.Tensor.contiguous, torch.Tensor.clone, torch.clone):
            if kwargs.get("memory_format") not in _LAYOUT_FORMATS:
                kwargs.pop("memory_format")
                if func is torch.Tensor.contiguous:
                    return args[0]
        return func(*args, **kwargs)


def vectorized_grad(fn, params, batched, shared, microbatch_size=None):
    single_grad = torch.func.grad(fn, has_aux=True)

    def single(example):
        return single_grad(params, example, shared)

    vectorized = torch.func.vmap(single, randomness="different", chunk_size=microbatch_size)
    with torch.enable_grad(), _IgnoreMemoryLayout():
        try:
            return vectorized(batched)
        except RuntimeError as error:
            if "vmap" not in str(error) or ".item()" not in str(error):
                raise
            raise NotImplementedError(
                "torch.func.vmap cannot compute per-example gradients of this model: its "
                "forward pass turns a tensor into a Python number. Keras on torch does "
                "this for every random layer that draws from a seed "
                "(Dropout(seed=...), GaussianNoise, GaussianDropout, ...): it builds a "
                "torch.Generator from the seed's value. Use Dropout without a seed "
                "(keras.utils.set_random_seed seeds it), run the pass with "
                "training=False, or use the TensorFlow or JAX backend."
            ) from error


def assert_at_least(value, minimum, message, guarded=None):
    """Shapes are always known here (JAX retraces per shape, torch runs eagerly):
    raises at once, before anything is computed, and returns ``guarded``."""
    if int(value) < minimum:
        raise ValueError(message)
    return guarded


def check_known_problems(layers):
    """No known backend problem with any layer."""


def no_grad(after=None):
    """The optimizer's update context: no autograd recording (eager: nothing to order)."""
    return torch.no_grad()


def _detach(structure):
    if isinstance(structure, torch.Tensor):
        return structure.detach()
    if isinstance(structure, (list, tuple)):
        return type(structure)(_detach(item) for item in structure)
    if isinstance(structure, dict):
        return {key: _detach(item) for key, item in structure.items()}
    return structure


def compile(fn):
    """Nothing to compile (eager); ``fn`` runs on detached inputs and returns
    detached outputs, so results carry no autograd graph (``np.asarray`` works)."""

    def detached(*args):
        return _detach(fn(*_detach(args)))

    return detached


def grad(fn, params):
    """Value and gradient of the scalar ``fn(params)``; zeros where unconnected."""
    with torch.enable_grad():
        params = [p.detach().requires_grad_(True) for p in params]
        value = fn(params)
        grads = torch.autograd.grad(value, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return value.detach(), grads


#: ``pergrad.engine.chunked`` loops in Python over chunks of known sizes.
EAGER_LOOPS = True


def random_state():
    """The global generators' states: unseeded random layers draw from them."""
    state = [torch.random.get_rng_state()]
    if torch.cuda.is_available():
        state.append(torch.cuda.get_rng_state_all())
    return state


def set_random_state(state):
    torch.random.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state_all(state[1])


def vectorized_call(fn, batched, shared, layout_hints=True):
    """``fn(example, shared)`` for every example at once (``torch.func.vmap``).

    ``layout_hints=False`` (no convolution in the model) skips the function mode
    that answers memory-layout requests: it costs a Python call per torch call.
    """
    vectorized = torch.func.vmap(lambda example: fn(example, shared), randomness="different")
    if not layout_hints:
        return vectorized(batched)
    with _IgnoreMemoryLayout():
        return vectorized(batched)


def grad_with_aux(fn, params):
    """Gradient of the scalar ``fn(params)[0]`` and ``fn``'s auxiliary outputs (detached)."""
    with torch.enable_grad():
        params = [p.detach().requires_grad_(True) for p in params]
        value, aux = fn(params)
        grads = torch.autograd.grad(value, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return grads, _detach(aux)


def replicas(model=None):
    """The world size of an initialized ``torch.distributed`` process group, else 1.

    Keras's torch ``fit()`` never synchronizes gradients across processes: with
    several, each would train on its own data.
    """
    del model
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    return 1
