"""Order statistics over the batch axis: median, trimmed mean, MeaMed.

The coordinate-wise rules need, for each coordinate of a ``(B, ...)``
per-example gradient, a few ranks of its ``B`` values. A full comparator sort
over the batch axis is slow on XLA:CPU (``ops.sort``), so each backend selects
the needed ranks with what it does fast (see ``benchmarks/selection.py`` for
the measurements behind ``_strategy``):

- ``"unrolled"`` (JAX and TensorFlow up to B = 128): a bitonic sorting network
  on the ``B`` rows as separate tensors of the variable's shape; XLA (JAX's
  jit, TensorFlow's ``jit_compile``) fuses it and what follows into passes over
  the coordinates, and drops the compare-exchanges no needed rank depends on
  (64 x 200k median: 27 ms against 223 ms for ``"network"``).
- ``"network"``: a bitonic sorting network over axis 0 (``minimum`` and
  ``maximum`` only, vectorized over the coordinates), whose last merge keeps
  only the blocks that hold the needed ranks; processed in column blocks so
  that each block stays in cache.
- ``"top_k"``: ``ops.top_k`` over the transposed ``(N, B)`` block (a partial
  selection on the last axis).
- ``"backend"`` (torch): the adapter's ``rank_sums`` / ``sorted_ranks`` (NumPy's sort
  over axis 0 of a CPU tensor, about 5x faster than ``torch.topk``; ``rank_sums`` sums
  the ranks in its blocks) and ``meamed_columns`` (MeaMed in those blocks), else ``"top_k"``.
- ``"sort"``: ``ops.sort`` over axis 0; also the path when ``B`` is unknown
  while tracing (TensorFlow retraces a partial last batch with a ``None``
  batch size).

Non-finite values, the same on every path and as ``numpy``:

- a coordinate with a NaN among its ``B`` values gives NaN;
- ``+inf`` and ``-inf`` are ordinary values of the order: the median of
  ``[-inf, 1, inf]`` is 1; an even ``B`` whose two middle values are ``-inf``
  and ``inf`` gives NaN (their mean); a trimmed mean or MeaMed that keeps an
  infinite value is infinite (NaN if it keeps both signs);
- in MeaMed, a value equal to the median is at distance 0 from it, also when
  both are infinite; where the median is NaN, so is the result.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

from pergrad.backend import adapter, eager, optional_kernel

# The fastest strategy, from benchmarks/selection.py: where the backend runs the step eagerly
# (torch) its adapter's kernels; where a compiler (XLA: JAX, TensorFlow) fuses the step, the
# unrolled network up to this batch (its size grows as B log^2 B; measured faster up to B = 128
# on JAX), the blocked network above it.
_UNROLLED_BATCH = 128
# Values per column block of the sorting network (1 MiB of float32: stays in cache).
_BLOCK = 1 << 18
# Up to this batch size the network runs in one block (measured faster on JAX and TF).
_UNBLOCKED_BATCH = 16


def _strategy(x=None) -> str:
    if eager():
        return "backend"
    b = None if x is None else _static_batch(x)
    return "unrolled" if b is not None and b <= _UNROLLED_BATCH else "network"


def _static_batch(x):
    size = x.shape[0]
    return size if isinstance(size, int) else None


def _with_nan(x, result, has_nan=None):
    """``result`` with NaN wherever a coordinate of ``x`` has a NaN over axis 0
    (``has_nan``, where the selection found them already)."""
    if has_nan is None:
        has_nan = ops.any(ops.isnan(x), axis=0)
    return ops.where(has_nan, ops.cast(float("nan"), result.dtype), result)


# --------------------------------------------------------------------------------------
# Selection of the ascending ranks [lo, hi) of a (B, N) tensor, B static. Each returns
# those rows in some order (the callers only sum them or read a single one).


def _rows_sort(x, lo, hi):
    return ops.sort(x, axis=0)[lo:hi]


def _rows_top_k(x, lo, hi):
    # Two unsorted selections (faster than a sorted one on torch and TensorFlow): the
    # ranks below hi (or from lo up), then among those the ranks [lo, hi).
    b = x.shape[0]
    transposed = ops.transpose(x)
    if hi <= b - lo:  # the hi smallest values, then their hi - lo largest
        values = -ops.top_k(-transposed, hi, sorted=False)[0]
        if lo:
            values = ops.top_k(values, hi - lo, sorted=False)[0]
    else:  # the b - lo largest values, then their hi - lo smallest
        values = ops.top_k(transposed, b - lo, sorted=False)[0]
        if hi < b:
            values = -ops.top_k(-values, hi - lo, sorted=False)[0]
    return ops.transpose(values)


def _rows_backend(x, lo, hi):
    ranks = optional_kernel("sorted_ranks")  # (torch's adapter has one)
    rows = None if ranks is None else ranks(x, lo, hi)
    return _rows_top_k(x, lo, hi) if rows is None else rows


def _compare(x, n, j, mirrored):
    """One layer of compare-exchanges on ``n`` rows: row ``i`` of each block of
    ``2j`` against row ``i + j`` (``mirrored``: against row ``2j - 1 - i``),
    minimum first."""
    y = ops.reshape(x, (n // (2 * j), 2, j, -1))
    first, second = y[:, 0], y[:, 1]
    if mirrored:
        second = ops.flip(second, axis=1)
    # The maxima stay in mirrored order: a reversed bitonic sequence is still bitonic,
    # and the half-cleaners that follow sort either.
    return ops.reshape(ops.stack([ops.minimum(first, second), ops.maximum(first, second)], 1), (n, -1))


def _network_block(x, lo, hi):
    """Ranks ``[lo, hi)`` of a ``(B, N)`` block by a bitonic network."""
    b = x.shape[0]
    n = 1 << (b - 1).bit_length()
    if n > b:  # +inf rows sort last and leave the first B ranks alone
        x = ops.concatenate([x, ops.full((n - b, x.shape[1]), float("inf"), dtype=x.dtype)], 0)
    # Sort blocks of 2, 4, ..., n / 2 rows ascending (the "mirrored" bitonic sort: each
    # merge starts by comparing a block's first half with its reversed second half).
    k = 2
    while k < n:
        x = _compare(x, n, k // 2, mirrored=True)
        j = k // 4
        while j >= 1:
            x = _compare(x, n, j, mirrored=False)
            j //= 2
        k *= 2
    if n == 1:
        return x[lo:hi]
    # The last merge, pruned: after each half-cleaner only the blocks that hold ranks in
    # [lo, hi) go on (about n compare-exchanges for a median instead of n / 2 * log2 n).
    x = _compare(x, n, n // 2, mirrored=True)
    start, j = 0, n // 2
    while True:
        first = (lo - start) // j
        last = (hi - 1 - start) // j
        x = x[first * j : (last + 1) * j]
        start += first * j
        size = (last - first + 1) * j
        if j == 1:
            break
        j //= 2
        x = _compare(x, size, j, mirrored=False)
    return x[lo - start : hi - start]


def _rows_network(x, lo, hi, block=None):
    """``block``: values per column block (``None``: ``_BLOCK``; 0: one block)."""
    b, size = x.shape[0], x.shape[1]
    budget = _BLOCK if block is None else block
    # A small batch has few layers: the copies into and out of blocks would cost more.
    columns = max(1, budget // b) if budget and b > _UNBLOCKED_BATCH else size
    key = (keras.backend.backend(), lo, hi, columns)
    if key not in _FUSED:
        # TensorFlow's graph runs each of the network's many small ops as its own pass over
        # memory; XLA fuses them (jax.jit does already, torch has nothing comparable).
        fused = optional_kernel("fused")
        network = functools.partial(_network_blocks, lo=lo, hi=hi, columns=columns)
        _FUSED[key] = fused(network) if fused else network
    return _FUSED[key](x)


_FUSED = {}


def _network_blocks(x, lo, hi, columns):
    b, size = x.shape[0], x.shape[1]
    if size <= columns:
        return _network_block(x, lo, hi)
    backend = adapter()
    if eager():  # torch: a Python loop over column blocks
        parts = [_network_block(x[:, s : s + columns], lo, hi) for s in range(0, size, columns)]
        return ops.concatenate(parts, axis=1)
    # In a graph: one loop over the column blocks (a block's intermediates stay in cache).
    count = -(-size // columns)
    padded = ops.pad(x, ((0, 0), (0, count * columns - size)))
    blocks = ops.transpose(ops.reshape(padded, (b, count, columns)), (1, 0, 2))
    _, result = backend.scan(lambda carry, xb: (carry, _network_block(xb, lo, hi)), 0, blocks)
    result = ops.reshape(ops.transpose(result, (1, 0, 2)), (hi - lo, count * columns))
    return result[:, :size]


_ROWS = {"sort": _rows_sort, "top_k": _rows_top_k, "network": _rows_network, "backend": _rows_backend}


# --------------------------------------------------------------------------------------
# "unrolled": the network on the B rows as separate tensors. A compiler (XLA: JAX's jit,
# TensorFlow's jit_compile) then fuses the whole network, and everything after it, into
# passes over the columns, and drops the compare-exchanges no needed rank depends on;
# the reshaped network above materializes every layer (measured on JAX, B = 64 x 200k
# values: 33 ms vs 230 ms).


@functools.cache
def _bitonic_pairs(n):
    """The compare-exchanges ``(low, high)`` of a bitonic sorting network on ``n`` (a power
    of two) wires, in order: wire ``low`` gets the minimum."""
    pairs, k = [], 2
    while k <= n:
        j = k // 2
        while j >= 1:
            for i in range(n):
                partner = i ^ j
                if partner > i:
                    pairs.append((i, partner) if i & k == 0 else (partner, i))
            j //= 2
        k *= 2
    return tuple(pairs)


def _sorted_rows(rows):
    """The rows (equal-shaped tensors) sorted elementwise: ``out[k]`` holds the rank-k values."""
    n = 1 << (len(rows) - 1).bit_length()
    padding = [ops.full(ops.shape(rows[0]), float("inf"), dtype=rows[0].dtype)] * (n - len(rows))
    rows = list(rows) + padding  # +inf sorts last and leaves the first B ranks alone
    for low, high in _bitonic_pairs(n):
        first, second = rows[low], rows[high]
        rows[low], rows[high] = ops.minimum(first, second), ops.maximum(first, second)
    return rows


def _tree(op, values):
    """``op`` over the values pairwise: a tree of depth log2(n). XLA:CPU fuses a long
    chain of adds over network outputs into a computation 15x slower to run and 7x
    slower to compile (trimmed mean of 64 x 200k: 345 ms vs 23 ms)."""
    values = list(values)
    while len(values) > 1:
        pairs = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(values) - len(values) % 2 :]
    return values[0]


def _any_nan(rows):
    return _tree(ops.logical_or, [ops.isnan(r) for r in rows])


def _unrolled_median(x):
    rows = [x[i] for i in range(x.shape[0])]
    ranks = _sorted_rows(rows)
    b = len(rows)
    middle = (ranks[(b - 1) // 2] + ranks[b // 2]) / 2
    return ops.where(_any_nan(rows), ops.cast(float("nan"), x.dtype), middle)


def _unrolled_trimmed_mean(x, dropped):
    rows = [x[i] for i in range(x.shape[0])]
    kept = _sorted_rows(rows)[dropped : len(rows) - dropped]
    total = _tree(ops.add, kept) / len(kept)
    return ops.where(_any_nan(rows), ops.cast(float("nan"), x.dtype), total)


def _unrolled_meamed(x, kept):
    rows = [x[i] for i in range(x.shape[0])]
    middle = _unrolled_median(x)
    # Distance 0 for a value equal to the median, also an infinite one (inf - inf is NaN).
    distances = [ops.where(r == middle, ops.zeros_like(r), ops.abs(r - middle)) for r in rows]
    threshold = _sorted_rows(distances)[kept - 1]
    # The values nearer than the kept-th nearest distance, then the first ones by batch
    # position among those at exactly that distance (a stable argsort's).
    nearer = [ops.cast(d < threshold, x.dtype) for d in distances]
    missing = kept - _tree(ops.add, nearer)
    total, tied_before = ops.zeros_like(middle), ops.zeros_like(middle)
    for r, d, near in zip(rows, distances, nearer):
        tied = ops.cast(d == threshold, x.dtype)
        tied_before = tied_before + tied
        taken = ops.maximum(near, tied * ops.cast(tied_before <= missing, x.dtype))
        total = total + ops.where(taken > 0, r, ops.zeros_like(r))
    return ops.where(ops.isnan(middle), middle, total / kept)


_UNROLLED = {"median": _unrolled_median, "trimmed_mean": _unrolled_trimmed_mean, "meamed": _unrolled_meamed}


def _call_with(x, function, args):
    return function(x, *args)


def _unrolled(name, x, *args):
    """``_UNROLLED[name](x, *args)``, compiled by XLA on TensorFlow. The rows keep their
    shape: XLA:CPU fuses a network on slices of a reshaped tensor 5x worse."""
    key = (keras.backend.backend(), name, x.shape[0]) + args
    if key not in _FUSED:
        fused = optional_kernel("fused")
        function = functools.partial(_call_with, function=_UNROLLED[name], args=args)
        _FUSED[key] = fused(function) if fused else function
    return _FUSED[key](x)


def _rank_sum(x, lo, hi, strategy):
    """Sum of the ascending ranks ``[lo, hi)`` over axis 0 of ``(B, ...)``; B static."""
    return _rank_sum_and_nan(x, lo, hi, strategy)[0]


def _rank_sum_and_nan(x, lo, hi, strategy):
    """``(sum of the ranks [lo, hi), whether each coordinate has a NaN or None)``: the
    adapter's sort (``"backend"``) tells the NaN coordinates as it sorts, sparing
    :func:`_with_nan` a pass over ``x``, and sums the ranks as it selects them
    (``rank_sums``) where it can."""
    flat = ops.reshape(x, (x.shape[0], -1))
    shape = ops.shape(x)[1:]
    backend = strategy == "backend"
    summed = optional_kernel("rank_sums") if backend else None
    found = None if summed is None else summed(flat, lo, hi)
    if found is not None:
        return ops.reshape(found[0], shape), ops.reshape(found[1], shape)
    has_nan = None
    ranks = optional_kernel("sorted_ranks") if backend else None
    found = None if ranks is None else ranks(flat, lo, hi, with_nan=True)
    if found is not None:
        rows, has_nan = found
        has_nan = ops.reshape(has_nan, shape)
    else:
        rows = _ROWS[strategy](flat, lo, hi)
    total = rows[0] if hi - lo == 1 else ops.sum(rows, axis=0)
    return ops.reshape(total, shape), has_nan


# --------------------------------------------------------------------------------------
# The public functions and their strategy-explicit versions (benchmarks/selection.py).


def _median(x, strategy):
    b = _static_batch(x)
    if b is None:
        size = ops.shape(x)[0]
        ordered = ops.sort(x, axis=0)
        low = ops.take(ordered, (size - 1) // 2, axis=0)
        high = ops.take(ordered, size // 2, axis=0)
        # Odd B: the middle value itself (twice it could overflow).
        return _with_nan(x, ops.where(size % 2 == 1, high, (low + high) / 2))
    if b == 1:
        return x[0]
    if strategy == "unrolled":
        return _unrolled("median", x)
    total, has_nan = _rank_sum_and_nan(x, (b - 1) // 2, b // 2 + 1, strategy)
    return _with_nan(x, total if b % 2 else total / 2, has_nan)


def _trimmed_mean(x, dropped, strategy):
    b = _static_batch(x)
    if b is None or not isinstance(dropped, int):
        size = ops.shape(x)[0]
        kept = ops.sort(x, axis=0)[dropped : size - dropped]
        return _with_nan(x, ops.mean(kept, axis=0))
    if not 0 <= 2 * dropped < b:
        raise ValueError(f"trimmed_mean: cannot drop {dropped} values at each end of {b}.")
    if dropped == 0:
        return ops.mean(x, axis=0)
    if strategy == "unrolled":
        return _unrolled("trimmed_mean", x, dropped)
    total, has_nan = _rank_sum_and_nan(x, dropped, b - dropped, strategy)
    return _with_nan(x, total / (b - 2 * dropped), has_nan)


def _outer_rank_sums(a, d, lo, hi):
    """The adapter's ``outer_rank_sums`` of the rows ``a_j ⊗ d_j`` (torch) or ``None``."""
    ranks = optional_kernel("outer_rank_sums")
    if ranks is None or _strategy(a) != "backend":
        return None
    return ranks(a, d, lo, hi)


def outer_median(a, d):
    """:func:`median` of the ``(B, p, q)`` outer products ``a_j ⊗ d_j`` of ``a`` ``(B, p)``
    and ``d`` ``(B, q)``, the same bits, without forming them (the torch adapter forms,
    sorts and sums them a block at a time), or ``None`` where the backend has no such
    way (the caller forms them)."""
    b = _static_batch(a)
    if b is None or b < 2:
        return None
    found = _outer_rank_sums(a, d, (b - 1) // 2, b // 2 + 1)
    if found is None:
        return None
    total, has_nan = found
    return _with_nan(None, total if b % 2 else total / 2, has_nan)


def outer_trimmed_mean(a, d, dropped):
    """:func:`trimmed_mean` of the outer products ``a_j ⊗ d_j``, as :func:`outer_median`
    (``None`` also where ``dropped`` is 0, a plain mean, or out of range)."""
    b = _static_batch(a)
    if b is None or not isinstance(dropped, int) or not 0 < 2 * dropped < b:
        return None
    found = _outer_rank_sums(a, d, dropped, b - dropped)
    if found is None:
        return None
    total, has_nan = found
    return _with_nan(None, total / (b - 2 * dropped), has_nan)


def outer_meamed(a, d, kept):
    """:func:`meamed` of the outer products ``a_j ⊗ d_j``, as :func:`outer_median` (``None``
    also where ``kept`` is not a Python int in ``[1, B]``)."""
    b = _static_batch(a)
    function = optional_kernel("outer_meamed")
    if function is None or _strategy(a) != "backend" or b is None or not isinstance(kept, int):
        return None
    return function(a, d, kept) if 0 < kept <= b else None


def _factored(x, outer, formed):
    """``outer(a, d)`` of rows given as factors (``x.outer_factors``: ``OuterRows``), else
    ``formed`` of each of their formed parts (``x.formed_parts()``), joined."""
    result = outer(*x.outer_factors)
    if result is not None:
        return result
    parts = [formed(part) for part in x.formed_parts()]
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)


def _running_count(mask):
    """How many entries are true up to each position along axis 0 (an inclusive prefix sum)."""
    counts = ops.cast(mask, "int32")
    size = counts.shape[0]
    if size is None:
        return ops.cumsum(counts, axis=0)
    # log2(B) shifted additions: XLA:CPU's cumsum over a short axis is slower than a sort.
    shift = 1
    while shift < size:
        counts = counts + ops.concatenate([ops.zeros_like(counts[:shift]), counts[:-shift]], 0)
        shift *= 2
    return counts


def _meamed(x, kept, strategy):
    b = _static_batch(x)
    columns = optional_kernel("meamed_columns") if strategy == "backend" else None
    if columns is not None and b is not None and isinstance(kept, int) and 0 < kept <= b:
        found = columns(ops.reshape(x, (b, -1)), kept)  # torch: all of it in one pass of blocks
        if found is not None:
            return ops.reshape(found, ops.shape(x)[1:])
    if strategy == "unrolled" and b is not None and isinstance(kept, int):
        if not 0 < kept <= b:
            raise ValueError(f"meamed: cannot keep {kept} of {b} values.")
        return _unrolled("meamed", x, kept)
    middle = _median(x, strategy)
    # Distance 0 for a value equal to the median, also an infinite one (inf - inf is NaN).
    distances = ops.where(x == middle[None], ops.zeros_like(x), ops.abs(x - middle[None]))
    if b is None or not isinstance(kept, int):
        threshold = ops.take(ops.sort(distances, axis=0), kept - 1, axis=0)
    else:
        if not 0 < kept <= b:
            raise ValueError(f"meamed: cannot keep {kept} of {b} values.")
        threshold = _rank_sum(distances, kept - 1, kept, strategy)
    # The kept values are those nearer than the kept-th nearest distance, then the first
    # ones by batch position among those at exactly that distance (a stable argsort's).
    nearer = distances < threshold[None]
    tied = distances == threshold[None]
    missing = kept - ops.sum(ops.cast(nearer, "int32"), axis=0)
    taken = ops.logical_or(nearer, ops.logical_and(tied, _running_count(tied) <= missing[None]))
    total = ops.sum(ops.where(taken, x, ops.zeros_like(x)), axis=0)
    # NaN where the median is (a NaN among the values, or middle values -inf and +inf).
    return ops.where(ops.isnan(middle), middle, total / ops.cast(kept, x.dtype))


def median(x):
    """The median over axis 0, as ``numpy.median`` (even B: the mean of the two middle values).

    Args:
        x: a ``(B, ...)`` tensor, or a ``Dense`` kernel's rows as their factors
            (``pergrad.layer_rules.dense.OuterRows``: :func:`outer_median`).

    Returns:
        The ``(...)`` medians.
    """
    if hasattr(x, "outer_factors"):
        return _factored(x, outer_median, median)
    return _median(x, _strategy(x))


def trimmed_mean(x, dropped):
    """The mean over axis 0 of the sorted values ``[dropped : B - dropped]``.

    Args:
        x: a ``(B, ...)`` tensor, or a ``Dense`` kernel's rows as their factors
            (``OuterRows``: :func:`outer_trimmed_mean`).
        dropped: how many values to drop at each end: a Python int, or an int32
            scalar tensor when B is not static.

    Returns:
        The ``(...)`` trimmed means.
    """
    if hasattr(x, "outer_factors"):
        return _factored(x, lambda a, d: outer_trimmed_mean(a, d, dropped),
                         lambda part: trimmed_mean(part, dropped))
    return _trimmed_mean(x, dropped, _strategy(x))


def meamed(x, kept):
    """Per coordinate, the mean of the ``kept`` values nearest to the median over axis 0.

    Values at the same distance from the median are taken in batch order (as a
    stable argsort of the distances would).

    Args:
        x: a ``(B, ...)`` tensor.
        kept: how many values to average: a Python int, or an int32 scalar
            tensor when B is not static.

    Returns:
        The ``(...)`` means around the median.
    """
    if hasattr(x, "outer_factors"):  # a Dense kernel's rows as factors (OuterRows)
        return _factored(x, lambda a, d: outer_meamed(a, d, kept), lambda part: meamed(part, kept))
    return _meamed(x, kept, _strategy(x))
