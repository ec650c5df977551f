"""DP-SGD's Gaussian noise: 128 secret-keyed random bits per coordinate, one float32 normal each.

The construction, and why each of its parts is there, is in docs/architecture.md
("Privacy", "Noise generator"). In short:

- **Key.** 256 bits, eight 32-bit words ``K = (K_a, K_b)``. Step ``t`` draws with its own
  128-bit key ``k_t = F_{K_a}(t, 0, 0, 1) xor K_b``.
- **Bits.** Coordinate ``i`` of step ``t`` gets the 128-bit block ``F_{k_t}(i, t, 0, 0)``:
  no two coordinates, steps or keys share a bit. ``F`` is a counter-based block
  function of Salmon et al. (2011): Threefry-4x32-20 written here in ``keras.ops`` (XLA
  fuses it on JAX, and on TensorFlow through the adapter's ``fused``), Philox-4x64-10 (NumPy's)
  on torch, which has no compiler to fuse ~200 integer ops (the adapter's ``noise_words``; the
  transform then runs in NumPy too).
- **Transform.** ``n = s * sqrt(-2 ln U) * sin(Psi)``: ``U`` uniform on ``2^96`` points of
  ``(0, 1]`` (four 24-bit digits, so that in float32 it has a full mantissa at every scale
  down to ``2^-72``), ``Psi`` uniform on ``2^24`` points of ``(0, pi/2)``, ``s`` a fair sign. It is
  Box-Muller's ``R cos(Theta)`` with ``|cos(Theta)|`` replaced by the equal-in-law
  ``sin(Psi)``: one coordinate per transform, no pairs. The support reaches
  ``sqrt(192 ln 2) = 11.54`` standard deviations.

References:
    Salmon, Moraes, Dror and Shaw, 2011, "Parallel random numbers: as easy as 1, 2, 3",
    SC'11. https://doi.org/10.1145/2063384.2063405
    Box and Muller, 1958, "A note on the generation of random normal deviates", Ann. Math.
    Statist. 29(2).
"""

from __future__ import annotations

import functools
import math
import types

import keras
import numpy as np
from keras import ops

from pergrad.backend import optional_kernel
from pergrad.distributed import processes

#: 32-bit words in a key: 256 bits (the two 128-bit halves ``K_a``, ``K_b``).
KEY_WORDS = 8

#: The largest value the transform returns, in standard deviations: ``U = 2^-96``.
SUPPORT = math.sqrt(2 * 96 * math.log(2))

# Threefry-4x32's rotation constants and key-schedule parity (Random123).
_ROTATIONS = ((10, 26), (11, 21), (13, 27), (23, 5), (6, 20), (17, 11), (25, 10), (18, 20))
_PARITY = 0x1BD11BDA
_ROUNDS = 20
# sin(x) / x on [0, pi/2] as a polynomial in x^2: least squares in the relative error
# (largest 1.5e-8, 1.8e-7 evaluated in float32: a few float32 ulps).
_SINE = (0.999999996264332, -0.1666665893587081, 0.008333075044006677, -0.00019810930104060065,
         2.609566501405381e-06)
# XLA:CPU vectorizes a fused loop only when its length is a multiple of the vector width.
_ALIGN = 16


def key_words(seed: int | None, spawn: int) -> np.ndarray:
    """``KEY_WORDS`` random 32-bit words as int32 bit patterns: from :mod:`secrets` with
    ``seed=None`` (on several JAX processes drawn on process 0 and broadcast:
    :func:`pergrad.distributed.processes.secret_words`), else derived from ``(seed, spawn)``
    (``numpy.random.SeedSequence``)."""
    if seed is None:
        words = processes.secret_words(KEY_WORDS)
    else:
        words = np.random.SeedSequence(seed, spawn_key=(spawn,)).generate_state(KEY_WORDS, np.uint32)
    return words.view(np.int32)


def _rotate_left(x, bits):
    """Rotation of uint32 words (XLA emits one vector instruction where the CPU has one)."""
    return ops.bitwise_or(ops.left_shift(x, bits), ops.right_shift(x, 32 - bits))


def threefry4x32(counter, key):
    """Threefry-4x32-20 (Salmon et al., 2011) on uint32 tensors: 4 counter words of one shape
    and 4 key words (scalars) to 4 output words, the block function of JAX's own generator
    widened from 2 to 4 words (a 128-bit key and block)."""
    parity = ops.convert_to_tensor(_PARITY, "uint32")
    schedule = list(key) + [ops.bitwise_xor(ops.bitwise_xor(key[0], key[1]), ops.bitwise_xor(key[2], key[3]))]
    schedule[4] = ops.bitwise_xor(schedule[4], parity)
    x = [ops.add(counter[i], schedule[i]) for i in range(4)]
    for r in range(_ROUNDS):
        first, second = _ROTATIONS[r % 8]
        # Even rounds mix (0, 1) and (2, 3), odd rounds (0, 3) and (2, 1): Threefry's permutation.
        b, d = (1, 3) if r % 2 == 0 else (3, 1)
        x[0] = ops.add(x[0], x[b])
        x[b] = ops.bitwise_xor(_rotate_left(x[b], first), x[0])
        x[2] = ops.add(x[2], x[d])
        x[d] = ops.bitwise_xor(_rotate_left(x[d], second), x[2])
        if r % 4 == 3:
            injection = r // 4 + 1
            x = [ops.add(x[i], schedule[(injection + i) % 5]) for i in range(4)]
            x[3] = ops.add(x[3], ops.convert_to_tensor(injection, "uint32"))
    return x


def _bits(xp, word, shift, width):
    """Bits ``[shift, shift + width)`` of 32-bit words. The mask makes this right for uint32
    words and for int32 bit patterns (whose right shift is arithmetic) alike."""
    return xp.bitwise_and(xp.right_shift(word, shift), (1 << width) - 1)


#: The operations of the transform on NumPy arrays, for torch's words (they come from NumPy):
#: a torch op costs a Python dispatch through Keras and a fresh tensor each, NumPy's less.
_NUMPY = types.SimpleNamespace(
    bitwise_and=np.bitwise_and, bitwise_or=np.bitwise_or, left_shift=np.left_shift,
    right_shift=np.right_shift, log=np.log, sqrt=np.sqrt, cast=lambda x, dtype: x.astype(dtype),
)


def normal_from_words(words, scale, xp=ops):
    """``scale`` times a standard normal value per coordinate, from 4 words of 32 bits each.

    ``words``: 4 integer tensors of one shape (uint32, or int32 bit patterns); ``scale``:
    a float32 scalar; ``xp``: ``keras.ops``, or NumPy's equivalents for NumPy words. The 96
    bits of ``words[0:3]`` are the four 24-bit digits of ``U`` (exact in float32; the last
    one offset by one so that ``U > 0``), the top 24 bits of ``words[3]`` give ``Psi`` and
    its lowest bit the sign. ``scale`` multiplies the radius, so that the last rounding is
    the product ``radius * sin(Psi)``: it rounds many (radius, angle) pairs into every
    float32, whatever the scale.
    """
    first, second, third, fourth = words
    digits = [
        _bits(xp, first, 8, 24),
        xp.bitwise_or(xp.left_shift(xp.bitwise_and(first, 0xFF), 16), _bits(xp, second, 16, 16)),
        xp.bitwise_or(xp.left_shift(xp.bitwise_and(second, 0xFFFF), 8), _bits(xp, third, 24, 8)),
        xp.bitwise_and(third, 0xFFFFFF),
    ]
    digits = [xp.cast(digit, "float32") for digit in digits]
    uniform = digits[3] + 1.0
    for digit in reversed(digits[:3]):
        uniform = digit + uniform * 2.0**-24
    signed_scale = scale * (1.0 - 2.0 * xp.cast(xp.bitwise_and(fourth, 1), "float32"))  # exact
    radius = xp.sqrt(-2.0 * xp.log(uniform * 2.0**-24)) * signed_scale
    angle = (xp.cast(_bits(xp, fourth, 8, 24), "float32") + 0.5) * (math.pi / 2**25)
    squared = angle * angle
    sine = _SINE[-1]
    for coefficient in reversed(_SINE[:-1]):
        sine = sine * squared + coefficient
    return radius * (angle * sine)


def random_words(key, step, count: int):
    """The 4 random words of each of ``count`` coordinates at step ``step``: 4 uint32
    tensors of shape ``(count,)`` (on torch NumPy arrays of int32 bit patterns).

    ``key``: ``KEY_WORDS`` int32 words; ``step``: an int32 scalar (tensor or int).
    """
    noise_words = optional_kernel("noise_words")
    if noise_words is not None:
        return list(np.concatenate(list(noise_words(key, step, count)), axis=1).reshape(4, count))
    key = ops.cast(key, "uint32")
    step = ops.cast(step, "uint32")
    zero = ops.zeros((), "uint32")
    derived = threefry4x32([step, zero, zero, zero + 1], [key[i] for i in range(4)])
    step_key = [ops.bitwise_xor(derived[i], key[4 + i]) for i in range(4)]
    index = ops.cast(ops.arange(count, dtype="int32"), "uint32")
    zeros = ops.zeros((count,), "uint32")
    return threefry4x32([index, zeros + step, zeros, zeros], step_key)


def _noise(key, step, scale, size):
    noise_words = optional_kernel("noise_words")
    if noise_words is not None:  # torch: NumPy words, transformed in NumPy chunk by chunk
        scale, values, start = np.float32(ops.convert_to_numpy(scale)), np.empty(size, np.float32), 0
        for words in noise_words(key, step, size):
            values[start : start + words.shape[1]] = normal_from_words(words, scale, _NUMPY)
            start += words.shape[1]
        return ops.convert_to_tensor(values)
    # Drawn for a multiple of _ALIGN coordinates, then cut: every value is computed by the
    # same vectorized code whatever the size.
    padded = -(-size // _ALIGN) * _ALIGN
    values = normal_from_words(random_words(key, step, padded), scale)
    return values[:size] if padded > size else values


_COMPILED = {}


def gaussian_noise(key, step, size: int, scale):
    """``scale`` times ``size`` independent N(0, 1) values: a pure function of (key, step).

    Args:
        key: ``KEY_WORDS`` int32 words (a tensor): the secret key's bit patterns.
        step: the step (an int32 scalar tensor or int); each step draws other bits.
        size: how many values (static).
        scale: the standard deviation (a float32 scalar tensor or float).
    """
    cache_key = (keras.backend.backend(), size)
    if cache_key not in _COMPILED:
        # TensorFlow's graph runs each of the ~200 integer ops as its own pass over memory;
        # XLA fuses them (jax.jit does already; torch draws its words in NumPy).
        fused = optional_kernel("fused")
        function = functools.partial(_noise, size=size)
        _COMPILED[cache_key] = fused(function) if fused else function
    return _COMPILED[cache_key](ops.cast(key, "int32"), ops.cast(step, "int32"), ops.cast(scale, "float32"))
