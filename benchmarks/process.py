"""What a benchmark process settles before and just after the Keras backend is imported.

Thread pools, the allocator, TensorFlow's oneDNN switch and which Keras
``tf.keras`` is are read when the backend starts: :func:`before_backend_import`
(or its parts) must run before ``import keras``. This module imports no backend
itself. :func:`configure_threads` sets what the
backends only take through their APIs, once the backend is imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

#: model kinds with attention (``benchmarks/models.py``)
ATTENTION_KINDS = ("tfm", "gpt", "lora", "llama", "bert")


def limit_threads(threads: int | None) -> None:
    """One pool size for every backend (``0`` / ``None``: the backends' defaults).

    On a small shared machine multi-threaded pools (torch's OpenMP above all)
    get descheduled and a plain step can slow down 10-40x from one run to the
    next; one thread keeps ratios measured side by side meaningful.
    """
    if not threads:
        return
    for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ[name] = str(threads)
    flags = f"--xla_cpu_multi_thread_eigen={'false' if threads == 1 else 'true'}"
    flags += f" intra_op_parallelism_threads={threads}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def configure_threads(threads: int | None) -> None:
    """The thread counts that must be set through the backends' APIs (after their import)."""
    if not threads:
        return
    import keras

    backend = keras.backend.backend()
    if backend == "torch":  # torch reads no environment variable for this
        import torch

        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    elif backend == "tensorflow":  # besides TF_NUM_*_THREADS, if still possible
        import tensorflow as tf

        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)


def tune_malloc() -> None:
    """glibc: serve large blocks from the heap and never give memory back.

    The same as starting Python with ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=2147483647``; done before the backend starts threads.

    By default glibc ``mmap``s every block above 32 MiB (at most) and ``munmap``s
    it on free, so a per-step buffer of per-example gradients is fresh memory on
    every step and each 4 KiB page faults on first touch. This keeps freed
    memory in the process for reuse. Diagnostic only: it is a process-wide
    allocator setting, not something a library should do behind a user's back.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    # One arena: a thread arena mmaps any block larger than its 64 MiB heap
    # whatever M_MMAP_MAX says; the main arena grows with brk and keeps it.
    libc.mallopt(m_arena_max, 1)
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def disable_onednn_for_attention(models) -> None:
    """TensorFlow: oneDNN off (unless the user set it) when a model with attention is run.

    TF 2.21's oneDNN matmul corrupts memory on the products that a vectorized map
    makes of a sequence model's kernels; pergrad converts them in a form oneDNN
    computes correctly, the hand-written ``jacobian`` and ``vmap`` recipes do
    not, and the process aborts. It must be decided before TensorFlow is imported.
    """
    if any(m.strip().startswith(ATTENTION_KINDS) for m in models):
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def tf_privacy_installed() -> bool:
    """Whether TF Privacy and the ``tf_keras`` it trains with are installed (``make install``)."""
    return bool(importlib.util.find_spec("tensorflow_privacy") and importlib.util.find_spec("tf_keras"))


def use_tf_keras_for_tf_privacy() -> None:
    """TF Privacy's ``tf.keras`` must be ``tf_keras``: set before TensorFlow is imported.

    ``TF_USE_LEGACY_KERAS=1`` (Keras 3, which pergrad uses, never reads
    ``tf.keras``) and ``sys.skip_tf_privacy_import`` (the package's own switch: its
    ``__init__`` would import modules that need ``tensorflow-probability``).
    """
    if tf_privacy_installed():
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
        sys.skip_tf_privacy_import = True


def before_backend_import(threads: int | None = 1, models=(), malloc_tuning: bool = False) -> None:
    """Everything above, in order, for a process that will run ``models`` on ``threads``."""
    limit_threads(threads)
    disable_onednn_for_attention(models)
    if malloc_tuning:
        tune_malloc()
    use_tf_keras_for_tf_privacy()
