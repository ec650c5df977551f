"""Validation of user-given numbers: a clear error at construction, never NaN weights later.

Every error names the owner (``"clip"``), the argument, what it must be and the
value that came, e.g. ``clip: l2_norm must be a finite number > 0, got inf``.
"""

from __future__ import annotations

import math
import numbers


def _shown(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return f"{value!r} ({type(value).__name__})"


def check_number(
    owner: str,
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Returns ``value`` as a float after checking it is a finite real number in range.

    Args:
        owner: who takes the argument (a rule's name), for the message.
        name: the argument's name.
        value: what the user passed.
        low, high: the bounds (``None``: unbounded on that side).
        low_open, high_open: whether a bound itself is excluded.

    Raises:
        ValueError: for a non-number (a string, a bool, ``None``), NaN, an
            infinity or a value out of range.
    """
    if low is None and high is None:
        wanted = "a finite number"
    elif high is None:
        wanted = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif low is None:
        wanted = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        wanted = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    message = f"{owner}: {name} must be {wanted}, got {_shown(value)}."
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(message)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(message)
    if low is not None and (number < low or (low_open and number == low)):
        raise ValueError(message)
    if high is not None and (number > high or (high_open and number == high)):
        raise ValueError(message)
    return number


def check_integer(owner: str, name: str, value, *, low: int = 1) -> int:
    """Returns ``value`` as an int after checking it is an integer ``>= low``.

    A float with an integral value (``3.0``) is accepted; ``3.5``, a bool, a
    string, NaN and infinities are not.
    """
    positive = "a positive integer" if low == 1 else f"an integer >= {low}"
    message = f"{owner}: {name} must be {positive}, got {_shown(value)}."
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(message)
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif math.isfinite(float(value)) and float(value).is_integer():
        number = int(value)
    else:
        raise ValueError(message)
    if number < low:
        raise ValueError(message)
    return number


def check_microbatch_size(value) -> int | None:
    """``microbatch_size`` of ``PerExampleModel`` and ``per_example_gradients``: ``None``
    or a positive int (an int, not ``4.0``, ``"4"`` or ``True``: it sets tensor shapes)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"microbatch_size must be a positive integer or None, got {_shown(value)}."
        )
    return int(value)
