"""PyTorch adapter: ``torch.func.vmap(torch.func.grad(...))``."""

import contextlib
import os
import threading
import traceback

import keras
import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pergrad import compat
from pergrad.backend import NotVectorizable
from pergrad.backend._single_replica import (  # noqa: F401
    all_gather,
    all_reduce_sum,
    assert_at_least,
    check_known_problems,
    replica_id,
    unscale_loss,
)

_LAYOUT_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


class _VmapWorkarounds(torch.overrides.TorchFunctionMode):
    """Answers, inside our vectorized maps, the calls ``torch.func.vmap`` cannot batch
    with equal ones that it can. Relies on torch's public function-mode hook, not on
    Keras internals.

    - Memory layouts (keras#23587): Keras's torch convolutions ask
      ``is_contiguous(memory_format=channels_last)`` and copy to channels-last;
      inside ``torch.func.vmap`` both raise "NYI". A layout is a performance hint
      that never changes a value: we answer "already contiguous" and keep it.
    - ``one_hot`` (a mixture-of-experts router's ``one_hot(argmax(...))``): under
      ``vmap(grad(...))`` torch checks the indices' values (``.item()``), which
      vmap cannot batch; a comparison with ``arange`` gives the same tensor for
      indices in range (Keras clamps negative ones first).
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
        if func is torch.nn.functional.one_hot:
            indices, classes = args[0], (args[1] if len(args) > 1 else kwargs.get("num_classes", -1))
            if classes > 0:
                classes = torch.arange(classes, device=indices.device, dtype=indices.dtype)
                return (indices.unsqueeze(-1) == classes).to(torch.long)
        return func(*args, **kwargs)


def _per_example_cond(cond):
    """Keras's torch ``cond`` (``if pred:``), which also takes a predicate with one value per
    example inside ``torch.func.vmap`` (Keras's hinge losses ask whether the batch's labels
    are 0/1): both branches then run and each example takes its own branch's values."""

    def per_example(pred, true_fn, false_fn):
        try:
            return cond(pred, true_fn, false_fn)
        except RuntimeError as error:
            if "vmap:" not in str(error):
                raise
        taken, other = true_fn(), false_fn()
        return keras.tree.map_structure(
            lambda a, b: torch.where(pred, torch.as_tensor(a), torch.as_tensor(b)), taken, other)

    return per_example


# How many of pergrad's passes this thread is in (:func:`_exact_attention`).
_PASSES = threading.local()


def _has_fully_masked_row(mask) -> bool:
    """Whether an attention mask leaves some query with no key to attend to; ``False``
    inside ``torch.func.vmap``, where the answer differs per example (and our maps run the
    math kernel anyway)."""
    try:
        return bool((~torch.as_tensor(mask).to(torch.bool)).all(dim=-1).any())
    except RuntimeError as error:
        if "vmap:" not in str(error):
            raise
        return False


def _exact_attention(dot_product_attention):
    """Keras's torch ``dot_product_attention``, which in pergrad's passes runs torch's math
    kernel where the mask leaves a query with no key to attend to.

    There torch's CPU flash kernel (what ``scaled_dot_product_attention`` picks on CPU)
    gets the gradient wrong: the row's logsumexp is a huge negative number (Keras masks
    with -2.4e38) to which log(keys) adds nothing in float32, so the backward pass weighs
    every key by 1 instead of 1/keys (torch 2.13; the forward pass is right). The math
    kernel's gradient is the forward pass's (a finite difference agrees), as TensorFlow's
    and JAX's are. Elsewhere (no mask, a causal one, every query with a key) the two
    kernels agree and the faster one runs (docs/architecture.md, 'Known traps').
    """

    def attention(query, key, value, bias=None, mask=None, *args, **kwargs):
        if mask is not None and getattr(_PASSES, "depth", 0) and _has_fully_masked_row(mask):
            with sdpa_kernel([SDPBackend.MATH]):
                return dot_product_attention(query, key, value, bias, mask, *args, **kwargs)
        return dot_product_attention(query, key, value, bias, mask, *args, **kwargs)

    return attention


@contextlib.contextmanager
def _pass():
    """The context of each of pergrad's gradient passes (:func:`_exact_attention`)."""
    compat.wrap_backend_function("nn", "dot_product_attention", _exact_attention)
    _PASSES.depth = getattr(_PASSES, "depth", 0) + 1
    try:
        yield
    finally:
        _PASSES.depth -= 1


_VECTORIZING = threading.local()


def _install_per_example_seed_draws() -> bool:
    """Wraps Keras's ``torch_seed_generator`` so that, inside our vectorized maps, a draw
    from a per-example seed state comes from torch's default generator; returns whether
    the wrapper is in place.

    Keras's torch random ops (``Dropout`` with a ``seed`` or a ``noise_shape``, such as
    EfficientNet's drop-connect; ``GaussianNoise``; ``GaussianDropout``) build a
    ``torch.Generator`` from ``int(seed state)``. pergrad gives every example its own seed
    state (docs/architecture.md, 'Randomness'), batched under ``torch.func.vmap``, which
    cannot turn it into one Python number. There the draw takes no generator: under
    ``vmap(randomness="different")`` torch's default generator gives every example its
    own draw, as for unseeded ``Dropout`` (reproducible with ``keras.utils.set_random_seed``,
    and restored with it when a chunk is recomputed). The layer's seed state still
    advances as Keras's draw advances it. A seed that is the same for every example (an
    ``int``) keeps Keras's seeded generator, the same draw for every example, as in a
    batch of one. Outside our maps, or in another thread, Keras's function runs as is.
    """
    module = compat.keras_torch_random()
    original = getattr(module, "torch_seed_generator", None)
    draw_seed = getattr(module, "draw_seed", None)
    if original is None or draw_seed is None:
        return False
    if getattr(original, "pergrad", False):  # installed already (a reloaded module)
        return True

    def torch_seed_generator(seed):
        if not getattr(_VECTORIZING, "depth", 0):
            return original(seed)
        first, second = draw_seed(seed)
        try:
            value = int(first + second)
        except RuntimeError:  # batched: a per-example seed state
            return None
        generator = torch.Generator(device=first.device)
        generator.manual_seed(value & 0xFFFFFFFF)  # as Keras's
        return generator

    torch_seed_generator.pergrad = True
    torch_seed_generator.original = original
    module.torch_seed_generator = torch_seed_generator
    return True


#: Whether seeded random layers draw per example inside our vectorized maps.
PER_EXAMPLE_SEED_DRAWS = _install_per_example_seed_draws()


@contextlib.contextmanager
def _vectorizing(workarounds=True):
    """The context of our vectorized maps: :class:`_VmapWorkarounds` (unless
    ``workarounds`` is false), scaled dot-product attention by its math kernel, and
    vmap's errors said as :class:`NotVectorizable` (:func:`_not_vectorizable`).

    ``torch.func.vmap`` batches the math kernel's matmuls and softmax; the fused CPU
    kernel torch picks otherwise (``_scaled_dot_product_flash_attention_for_cpu``)
    has no batching rule, so vmap runs it example by example, forward and backward
    ("There is a performance drop ..."). The two compute the same attention.
    """
    compat.wrap_backend_function("core", "cond", _per_example_cond)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_pass())
        stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        if workarounds:
            stack.enter_context(_VmapWorkarounds())
        _VECTORIZING.depth = getattr(_VECTORIZING, "depth", 0) + 1
        try:
            yield
        except RuntimeError as error:
            cause = _not_vectorizable(error)
            if cause is None:
                raise
            raise cause from error
        finally:
            _VECTORIZING.depth -= 1


def _frames(error):
    """The traceback frames of ``error`` and of the errors it was raised from (Keras
    re-raises a layer's error, with the original as its context)."""
    frames, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames += traceback.extract_tb(error.__traceback__)
        error = error.__cause__ or error.__context__
    return frames


def _not_vectorizable(error):
    """The :class:`NotVectorizable` that says what in the forward pass made
    ``torch.func.vmap`` raise ``error``, or ``None`` for another error."""
    message = str(error)
    if "vmap:" not in message:
        return None
    frames = _frames(error)
    random_ops = os.path.join("backend", "torch", "random.py")
    in_random = any(frame.filename.endswith(random_ops) for frame in frames)
    if in_random and not PER_EXAMPLE_SEED_DRAWS:
        return NotVectorizable(
            "torch.func.vmap cannot compute per-example gradients of this model: its "
            "forward pass turns a tensor into a Python number. Keras on torch does this "
            "for every random layer that draws from a seed (Dropout(seed=...) or "
            "Dropout(noise_shape=...), GaussianNoise, GaussianDropout, ...): it builds a "
            "torch.Generator from the seed's value, and pergrad could not take over those "
            "draws in this Keras (keras.src.backend.torch.random.torch_seed_generator moved). "
            "Use Dropout without a seed or noise_shape, run the pass with training=False, or "
            "use the TensorFlow or JAX backend."
        )
    # The innermost frame of the user's code, else of Keras's.
    libraries = [os.path.dirname(module.__file__) for module in (torch, os, keras)]
    libraries.append(os.path.dirname(os.path.dirname(__file__)))  # pergrad
    user = [f for f in frames if not any(f.filename.startswith(path) for path in libraries)]
    inner = user or [f for f in frames if f.filename.startswith(libraries[2])]
    where = "a layer's call"
    if inner:
        where = f"{inner[-1].name} in {inner[-1].filename}, line {inner[-1].lineno}"
    reason = message[message.index("vmap:"):].split(". ")[0].replace("\n", " ")
    return NotVectorizable(
        "torch.func.vmap cannot compute per-example gradients of this model: its forward "
        f"pass depends on a tensor's value in a way vmap cannot batch, at {where} (a Python "
        "`if` or number made from a tensor, an index taken from a value, or a shape that "
        f"depends on the values; torch: \"{reason}\"). Write that step with ops whose "
        "shapes and control flow do not depend on the values (ops.where instead of an `if` "
        "on a tensor; a comparison with ops.arange instead of indexing by a value). A Keras "
        "op that torch computes this way runs under the TensorFlow and JAX backends."
    )


def vectorized_grad(fn, params, batched, shared, microbatch_size=None):
    single_grad = torch.func.grad(fn, has_aux=True)

    def single(example):
        return single_grad(params, example, shared)

    vectorized = torch.func.vmap(single, randomness="different", chunk_size=microbatch_size)
    with torch.enable_grad(), _vectorizing():
        return vectorized(batched)



def outside_trace():
    """Nothing to leave: torch runs every op eagerly."""
    return contextlib.nullcontext()

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
    with torch.enable_grad(), _pass():
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
    that answers memory-layout requests (``_VmapWorkarounds``): it costs a Python
    call per torch call, and without ``grad`` inside the map ``one_hot`` batches.
    """
    vectorized = torch.func.vmap(lambda example: fn(example, shared), randomness="different")
    with _vectorizing(workarounds=layout_hints):
        return vectorized(batched)


def grad_with_aux(fn, params):
    """Gradient of the scalar ``fn(params)[0]`` and ``fn``'s auxiliary outputs (detached)."""
    with torch.enable_grad(), _pass():
        params = [p.detach().requires_grad_(True) for p in params]
        value, aux = fn(params)
        grads = torch.autograd.grad(value, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return grads, _detach(aux)


def grad_with_aux_at_outputs(fn, params, with_params):
    """``fn(params) -> (scalar, aux, outputs)``: ``(gradients with respect to params (with
    with_params, else None), gradients with respect to the outputs (zeros for one that
    needs none: nothing trainable before it), aux (detached))``.

    ``outputs`` are tensors ``fn`` computed (``None`` where absent): autograd gives the
    gradient at an intermediate tensor directly, without adding a zero probe to it.
    """
    with torch.enable_grad(), _pass():
        params = [p.detach().requires_grad_(True) for p in params]
        value, aux, outputs = fn(params)
        wanted = [t for t in outputs if t is not None and t.requires_grad]
        targets = (params if with_params else []) + wanted
        found = iter(torch.autograd.grad(value, targets, allow_unused=True) if targets else ())
    grads = [next(found) for _ in params] if with_params else None
    if grads is not None:
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    deltas = []
    for t in outputs:
        g = next(found) if t is not None and t.requires_grad else None
        deltas.append(torch.zeros_like(t) if g is None and t is not None else g)
    return grads, deltas, _detach(aux)


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


# The Dense rule's 2-D formulas (pergrad.layer_rules.dense) in raw torch: the statistics
# path's per-layer arithmetic on a (B, d) input is a few microseconds, a Keras op's
# dispatch on torch 10-30.


def row_squared_norms_2d(delta):
    """``(B,)``: each row's squared norm (:func:`_squared_row_norms`)."""
    return _squared_row_norms(delta)


#: entries per block of :func:`_squared_row_norms`
_NORM_BLOCK = 1024


def _squared_row_norms(rows):
    """``(B,)``: the squared norms of the rows of ``(B, n)`` ``rows``, one pass over them
    (``sum(r * r)`` writes the squares and reads them again: ~10x slower on wide rows), in
    blocks of :data:`_NORM_BLOCK` entries whose squared norms are then summed.

    Blocks, because torch's ``vector_norm`` adds a float32 row's squares one after the
    other: over the 2M entries of a per-example kernel gradient it is ~6e-5 off (a sum's
    rounding grows with the number of terms it adds in sequence), ``sum`` 1e-7.
    """
    size = rows.shape[1]
    if size <= 2 * _NORM_BLOCK:
        return torch.linalg.vector_norm(rows, dim=1).square()
    head = size - size % _NORM_BLOCK
    blocks = rows[:, :head].reshape(rows.shape[0], -1, _NORM_BLOCK)
    total = torch.linalg.vector_norm(blocks, dim=2).square().sum(dim=1)
    if head < size:
        total = total + torch.linalg.vector_norm(rows[:, head:], dim=1).square()
    return total


def stack_columns(columns):
    """``(B, V)`` from ``V`` tensors of shape ``(B,)`` (a Keras ``stack`` costs ~35 us)."""
    return torch.stack(columns, dim=1)


def all_finite(tensor):
    """Whether every entry of ``tensor`` is finite, as a Python bool."""
    return bool(torch.isfinite(tensor).all())


def flat_norms_2d(squared_norms):
    """``(B,)``: ``sqrt(sum_k squared_norms[:, k])``."""
    return squared_norms.sum(dim=1).sqrt()


def clip_factors(norms, threshold):
    """``min(1, threshold / norms)`` as ``threshold / max(norms, threshold)`` (0 for an
    infinite norm, NaN for a NaN one), and how many norms exceed ``threshold`` (float32)."""
    return threshold / norms.clamp_min(threshold), (norms > threshold).sum(dtype=torch.float32)


def example_squared_norms(gradients):
    """``(B,)``: each example's squared norm over all its entries (batch first, any rank)."""
    if gradients.dim() == 1:  # a scalar variable's
        return gradients.square()
    return _squared_row_norms(gradients.reshape(gradients.shape[0], -1))


def example_weighted_sum(gradients, weights):
    """``sum_i w_i g_i``: ``(B, ...)`` gradients, ``(B,)`` weights; the variable's shape, in
    the two dtypes' promoted one (as ``keras.ops.matmul``)."""
    dtype = torch.promote_types(weights.dtype, gradients.dtype)
    return torch.tensordot(weights.to(dtype), gradients.to(dtype), dims=1)


def outer_per_example(a, d):
    """``(B, d_in, d_out)``: every example's ``A_i^T D_i`` of ``(B, n, d_in)`` and ``(B, n,
    d_out)``, one batched matmul of the transposed view (``torch.einsum`` copies an operand
    first: ~30% slower at n = 64)."""
    dtype = torch.promote_types(a.dtype, d.dtype)
    return torch.bmm(a.transpose(1, 2).to(dtype), d.to(dtype))


def token_squared_norms(ids, d):
    """``(B,)``: an embedding's ``||g_i||^2``, ``(B, T)`` ids and ``(B, T, d)`` output
    gradients: over each example's distinct ids, the squared norm of the sum of their ``D``
    rows. The ids sorted per example give each position its group, one ``index_add_`` the
    groups' sums: ``B T d`` adds, where the token pairs' formula costs ``B T^2 d``."""
    batch, positions = ids.shape
    ordered, order = torch.sort(ids, dim=1)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    offsets = torch.arange(batch, device=ids.device)[:, None] * positions
    groups = torch.empty_like(order).scatter_(1, order, torch.cumsum(first, dim=1) - 1 + offsets)
    width = d.shape[-1]
    sums = d.new_zeros((batch * positions, width)).index_add_(0, groups.reshape(-1), d.reshape(-1, width))
    return row_squared_norms_2d(sums).reshape(batch, positions).sum(dim=1)


def outer_weighted_sum_2d(inputs, delta, weights):
    """``(d_in, d_out)``: ``sum_i w_i a_i d_i^T = A^T diag(w) D``."""
    return torch.matmul(inputs.transpose(0, 1), delta * weights[:, None])


def weighted_row_sum_2d(delta, weights):
    """``(d,)``: ``sum_i w_i d_i``."""
    return torch.matmul(weights, delta)


def add_to_mean(total, count, value, weight):
    """A Keras ``Mean`` metric's update by the scalar ``value`` of weight ``weight`` (a
    Python number), in place: ``total += value * weight``, ``count += weight``, in the
    variables' dtype, as ``Mean.update_state`` computes it (~8 us where its shape
    handling and Keras's dispatch take ~40; ``Variable.assign`` copies in place too)."""
    total, count = total.value, count.value
    with torch.no_grad():
        value = value.to(total.dtype)
        total.add_(value if weight == 1 else value * weight)
        count.add_(weight)


def mean_result(total, count):
    """A ``Mean`` metric's result as ``divide_no_nan(total, count)`` computes it (0 where
    ``count`` is 0), in raw torch."""
    total, count = total.value, count.value
    return torch.where(count == 0, torch.zeros_like(total), total / count)


def conv_patches(inputs, kernel_size, strides, dilation, pads, out_sizes):
    """``(B, T, k, C)``: a convolution's patches (``pergrad.layer_rules.conv.Patches``) by
    one strided view of the padded channels-last input, copied once: a few ops where a
    slice per kernel offset costs its ops each (49 for a 7 x 7 kernel; each torch call
    ~10-30 us eagerly). ``unfold`` builds them channels-first, 5x slower."""
    pad = [0, 0]  # F.pad: the last axis (channels) first
    for left, right in reversed(pads):
        pad += [left, right]
    x = torch.nn.functional.pad(inputs, pad) if any(pad) else inputs
    x = x.contiguous()
    steps = x.stride()
    spatial = steps[1:-1]
    view = x.as_strided(
        (x.shape[0],) + tuple(out_sizes) + tuple(kernel_size) + (x.shape[-1],),
        (steps[0],) + tuple(a * s for a, s in zip(spatial, strides))
        + tuple(a * d for a, d in zip(spatial, dilation)) + (steps[-1],),
    )
    return view.reshape(x.shape[0], -1, int(np.prod(kernel_size)), x.shape[-1])


def segment_sum_rows(rows, ids, count):
    """``(count, ...)``: ``rows`` (``(N, ...)``) summed by their ``ids`` (``(N,)``), ids
    outside ``[0, count)`` dropped, as ``keras.ops.segment_sum`` gives it. One
    ``index_add_``: Keras's torch version repeats every id to the rows' full shape and
    passes the copy through two ``where`` and a ``scatter_reduce`` (an Embedding rule's
    weighted sum over ``B x T`` rows: ~4x slower)."""
    ids = ids.reshape(-1).long()
    ids = torch.where((ids >= 0) & (ids < count), ids, count)
    out = rows.new_zeros((count + 1,) + tuple(rows.shape[1:]))
    return out.index_add_(0, ids, rows)[:-1]


#: dtypes whose values NumPy sorts as torch orders them
_NUMPY_SORTED = (torch.float32, torch.float64, torch.float16)


def sorted_ranks(x, lo, hi, block_bytes=1 << 20, with_nan=False):
    """Ranks ``[lo, hi)`` over axis 0 of a ``(B, N)`` CPU tensor, ascending, or ``None``
    where this does not apply (another device, a dtype NumPy lacks, a tensor that needs
    gradients: ``pergrad.aggregators.selection`` then selects by ``top_k``). With
    ``with_nan``, ``(ranks, (N,) whether the column holds a NaN)``: NaN sorts last, so
    the column's largest rank tells, without another pass over ``x``.

    NumPy's sort of contiguous rows (its vectorized AVX-512 sort on x86) beats every torch
    selection on CPU: ``torch.topk`` and ``torch.sort`` of short rows cost ~3 us a row
    (64 x 270k: ~1 s against ~0.2 s; ``benchmarks/selection.py``). The columns are sorted
    in blocks of about ``block_bytes``, each transposed to ``(columns, B)`` rows first: a
    block stays in cache and each coordinate's ``B`` values are one contiguous row
    (1.6x-4x faster than sorting over axis 0, which gathers every column with stride ``N``).
    """
    if x.device.type != "cpu" or x.dtype not in _NUMPY_SORTED or x.requires_grad or x.dim() != 2:
        return None
    values = x.numpy()
    batch, count = values.shape
    step = max(1, block_bytes // max(1, batch * values.itemsize))
    ordered = np.empty((hi - lo, count), values.dtype)
    nan = np.empty((count,), bool) if with_nan else None
    for start in range(0, count, step):
        rows = np.sort(np.ascontiguousarray(values[:, start:start + step].T), axis=1)
        ordered[:, start:start + step] = rows[:, lo:hi].T
        if with_nan:
            np.isnan(rows[:, -1], out=nan[start:start + step])
    ordered = torch.from_numpy(ordered)
    return (ordered, torch.from_numpy(nan)) if with_nan else ordered


def assign_slot(variable, index, value):
    """``variable[index] = value`` on the first axis, in place (``index_copy_``); returns
    ``value``."""
    with torch.no_grad():
        variable.value.index_copy_(0, torch.as_tensor(index, dtype=torch.long).reshape(1), value.unsqueeze(0))
    return value


def noise_words(key, step, count, chunk=1 << 16):
    """DP noise's random words (``pergrad.privacy.noise``), ``chunk`` coordinates at a time:
    yields ``(4, n)`` int32 NumPy arrays (bit patterns: torch has no unsigned 32-bit
    shifts), ``n <= chunk``, for consecutive coordinates; they do not depend on ``chunk``.
    Chunks small enough for the cache leave the process's heap alone (a whole draw's
    arrays make glibc map and unmap fresh pages at every step).

    Eager torch has no compiler to fuse the ~200 integer ops of a counter-based block
    function per value (XLA does it for JAX and TensorFlow), and its own CPU generator
    (MT19937) is linear: outputs reveal its state. NumPy's Philox-4x64-10 (Salmon et al.,
    2011; 128-bit key, C code) is the fast keyed choice here. ``key`` holds 8 int32 words
    ``(K_a, K_b)``; step ``step`` draws under its own key ``F_{K_a}(step, 0, 0, 1) xor K_b``
    and coordinate ``i`` gets the 128 bits of outputs ``2i`` and ``2i + 1`` from counter
    ``(0, step, 0, 0)``.
    """
    if isinstance(key, torch.Tensor):
        key = key.detach().cpu().numpy()
    if isinstance(step, torch.Tensor):
        step = step.detach().cpu().numpy()
    key = np.asarray(key, np.int32).view(np.uint32)
    step = int(step)
    master, mask = (int.from_bytes(key[i : i + 4].tobytes(), "little") for i in (0, 4))
    derived = np.random.Philox(key=master, counter=[step, 0, 0, 1]).random_raw(2)
    step_key = int.from_bytes(derived.tobytes(), "little") ^ mask
    generator = np.random.Philox(key=step_key, counter=[0, step, 0, 0])
    for start in range(0, count, chunk):
        size = min(chunk, count - start)
        yield generator.random_raw(2 * size).view(np.int32).reshape(size, 4).T.copy()


# --- wt24b: the coordinate rules' ranks, summed as they are selected ---------------------


def _sortable(x):
    """``x`` as a NumPy view where :func:`sorted_ranks` applies to it, else ``None``."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_SORTED or x.requires_grad or x.dim() != 2:
        return None
    return x.numpy()


def rank_sums(x, lo, hi, block_bytes=1 << 20):
    """``((N,) sum of the ranks [lo, hi) over axis 0, (N,) whether the column holds a
    NaN)`` of a ``(B, N)`` CPU tensor, or ``None`` where :func:`sorted_ranks` does not
    apply. The same selection (NumPy's sort of each column as a contiguous row, NaN
    last), without its copies: each block of about ``block_bytes`` is copied once into a
    reused ``(columns, B)`` buffer (a plain copy where the batch axis of ``x`` is the
    contiguous one), sorted in place, and its ranks summed in the buffer (float16 in
    float32, as torch's sum) instead of written out as ``hi - lo`` rows for a sum over
    axis 0. ``x`` may be any strided view (``x.numpy()`` keeps its strides).
    """
    values = _sortable(x)
    if values is None:
        return None
    batch, count = values.shape
    step = max(1, min(count, block_bytes // max(1, batch * values.itemsize)))
    total = np.empty((count,), values.dtype)
    nan = np.empty((count,), bool)
    buffer = np.empty((step, batch), values.dtype)
    accumulate = np.float32 if values.dtype == np.float16 else values.dtype
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, float16 overflow: as torch
        _rank_sum_blocks(values, lo, hi, step, buffer, total, nan, accumulate)
    return torch.from_numpy(total), torch.from_numpy(nan)


def _rank_sum_blocks(values, lo, hi, step, buffer, total, nan, accumulate):
    count = values.shape[1]
    for start in range(0, count, step):
        end = min(start + step, count)
        rows = buffer[: end - start]
        np.copyto(rows, values[:, start:end].T)
        rows.sort(axis=1)
        if hi - lo == 1:
            total[start:end] = rows[:, lo]
        elif hi - lo == 2:
            np.add(rows[:, lo], rows[:, lo + 1], out=total[start:end])
        else:
            total[start:end] = np.sum(rows[:, lo:hi], axis=1, dtype=accumulate)
        np.isnan(rows[:, -1], out=nan[start:end])


def meamed_columns(x, kept, block_bytes=1 << 19):
    """``(N,)``: per column of a ``(B, N)`` CPU tensor, the mean of the ``kept`` values
    nearest to its median (``pergrad.aggregators.selection``'s MeaMed: distance 0 for a
    value equal to the median, ties at the kept-th distance taken in batch order, NaN
    where the median is), or ``None`` where :func:`sorted_ranks` does not apply.

    The same formulas as the backend-neutral version, on blocks of about ``block_bytes``
    copied once as ``(columns, B)`` rows: the two selections (median, kept-th distance)
    by NumPy's in-place sort, the comparisons, running count and sum along the
    contiguous rows, all in reused buffers (the Keras ops version makes ~15 passes over
    the whole ``(B, N)`` tensor, each a fresh tensor).
    """
    values = _sortable(x)
    if values is None:
        return None
    batch, count = values.shape
    if not 0 < kept <= batch:
        return None
    step = max(1, min(count, block_bytes // max(1, batch * values.itemsize)))
    out = np.empty((count,), values.dtype)
    buffers = [np.empty((step, batch), values.dtype) for _ in range(3)]
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, count, step):
            end = min(start + step, count)
            rows, ordered, distances = (b[: end - start] for b in buffers)
            np.copyto(rows, values[:, start:end].T)
            out[start:end] = _meamed_block(rows, ordered, distances, kept)
    return torch.from_numpy(out)


def _meamed_block(rows, ordered, distances, kept):
    batch = rows.shape[1]
    accumulate = np.float32 if rows.dtype == np.float16 else rows.dtype
    np.copyto(ordered, rows)
    ordered.sort(axis=1)  # NaN last
    middle = ordered[:, batch // 2].copy()
    if batch % 2 == 0:
        middle += ordered[:, batch // 2 - 1]
        middle /= 2
    middle[np.isnan(ordered[:, -1])] = np.nan
    np.subtract(rows, middle[:, None], out=distances)
    np.abs(distances, out=distances)
    np.copyto(distances, 0, where=rows == middle[:, None])  # also an infinite one
    np.copyto(ordered, distances)
    ordered.sort(axis=1)
    threshold = ordered[:, kept - 1:kept]
    nearer = distances < threshold
    tied = distances == threshold
    missing = kept - np.count_nonzero(nearer, axis=1)
    # Every tied value is taken where there are no more of them than missing (the common
    # case); elsewhere the first ``missing`` in batch order (a running count on those rows).
    taken = nearer | tied
    over = np.flatnonzero(np.count_nonzero(tied, axis=1) > missing)
    if over.size:
        first = tied[over] & (np.cumsum(tied[over], axis=1) <= missing[over, None])
        taken[over] = nearer[over] | first
    total = np.sum(np.where(taken, rows, 0), axis=1, dtype=accumulate).astype(rows.dtype)
    total /= rows.dtype.type(kept)
    return np.where(np.isnan(middle), middle, total)


# --- wt25m: the coordinate rules' ranks of outer-product rows, formed block by block ----


def outer_rank_sums(a, d, lo, hi, block_bytes=1 << 20):
    """``((p, q) sums of the ranks [lo, hi) over the batch, (p, q) whether the coordinate's
    values hold a NaN)`` of the per-example outer products ``a_i ⊗ d_i`` (``a``: ``(B, p)``,
    ``d``: ``(B, q)`` CPU tensors), as :func:`rank_sums` gives them for the formed ``(B, p,
    q)`` tensor, or ``None`` where it does not apply (:func:`sorted_ranks`'s conditions,
    or ``a`` and ``d`` of different dtypes).

    The ``B x p x q`` products never exist at once: each block of about ``block_bytes`` is
    formed by ``torch.mul`` straight into a reused ``(coordinates, B)`` buffer (each
    coordinate's ``B`` values one contiguous row, as :func:`rank_sums` copies them), then
    sorted in place and its ranks summed while it is in cache (the same products, rows,
    sort and sums: the same bits). Forming the products apart costs fresh memory and a
    transposing copy per value (MLP 784-256-256-10 at B = 64: ~15 ms of a ~65 ms median
    step).
    """
    x = _sortable(a)
    if x is None or _sortable(d) is None or a.dtype != d.dtype or d.dim() != 2:
        return None
    batch, p = a.shape
    q = d.shape[1]
    if d.shape[0] != batch:
        return None
    total = np.empty((p, q), x.dtype)
    nan = np.empty((p, q), bool)
    accumulate = np.float32 if x.dtype == np.float16 else x.dtype
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, float16 overflow: as torch
        for rows, columns, values in _outer_blocks(a, d, block_bytes):
            values.sort(axis=1)
            _ranks_into(values, lo, hi, total[rows, columns], nan[rows, columns], accumulate)
    return torch.from_numpy(total), torch.from_numpy(nan)


def _outer_blocks(a, d, block_bytes):
    """``(row slice, column slice, values)`` for each block of the ``(p, q)`` coordinates of
    the products ``a_i ⊗ d_i`` (``a``: ``(B, p)``, ``d``: ``(B, q)``): ``values`` the block's
    ``(coordinates, B)`` NumPy view of a reused buffer of about ``block_bytes``, formed by
    ``torch.mul`` straight into it (each coordinate's ``B`` values one contiguous row), valid
    until the next block."""
    batch, p = a.shape
    q = d.shape[1]
    per_value = batch * a.element_size()
    columns = max(1, min(q, block_bytes // per_value))  # a block: rows x columns coordinates
    rows = max(1, min(p, block_bytes // (per_value * columns)))
    left = a.t().contiguous()  # (p, B): a block's rows broadcast against d's columns
    right = d.t().contiguous()  # (q, B)
    buffer = torch.empty((rows * columns * batch,), dtype=a.dtype)
    for i in range(0, p, rows):
        m = min(rows, p - i)
        for j in range(0, q, columns):
            n = min(columns, q - j)
            block = buffer[: m * n * batch].view(m, n, batch)
            torch.mul(left[i:i + m, None, :], right[None, j:j + n, :], out=block)
            yield slice(i, i + m), slice(j, j + n), block.numpy().reshape(m * n, batch)  # a view


def _ranks_into(values, lo, hi, total, nan, accumulate):
    """:func:`_rank_sum_blocks`'s sums of sorted ``(m * n, B)`` rows, into ``(m, n)`` views."""
    shape = total.shape
    if hi - lo == 1:
        total[...] = values[:, lo].reshape(shape)
    elif hi - lo == 2:
        total[...] = np.add(values[:, lo], values[:, lo + 1]).reshape(shape)
    else:
        total[...] = np.sum(values[:, lo:hi], axis=1, dtype=accumulate).reshape(shape)
    nan[...] = np.isnan(values[:, -1]).reshape(shape)


def outer_meamed(a, d, kept, block_bytes=1 << 19):
    """``(p, q)``: :func:`meamed_columns` of the per-example outer products ``a_i ⊗ d_i``,
    the same bits, the products formed by ``torch.mul`` a block at a time straight into its
    ``(coordinates, B)`` rows (:func:`outer_rank_sums`), or ``None`` where it does not
    apply."""
    x = _sortable(a)
    if x is None or _sortable(d) is None or a.dtype != d.dtype or d.dim() != 2:
        return None
    batch, p = a.shape
    q = d.shape[1]
    if d.shape[0] != batch or not 0 < kept <= batch:
        return None
    out = np.empty((p, q), x.dtype)
    buffers = None
    with np.errstate(invalid="ignore", over="ignore"):
        for rows, columns, values in _outer_blocks(a, d, block_bytes):
            if buffers is None:  # (the first block is the largest)
                buffers = [np.empty(values.shape, x.dtype) for _ in range(2)]
            count = values.shape[0]
            ordered, distances = (b[:count] for b in buffers)
            block = out[rows, columns]
            block[...] = _meamed_block(values, ordered, distances, kept).reshape(block.shape)
    return torch.from_numpy(out)
