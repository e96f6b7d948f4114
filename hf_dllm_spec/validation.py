"""One error format for bad input: the argument, its value, the rule and the fix.

Every user-facing check in the library goes through :func:`invalid`, so messages read the same everywhere::

    `confidence_threshold` (=1.5) must lie in (0, 1]; pass a probability such as 0.85.
"""

from __future__ import annotations

import math
from typing import Any


def invalid(name: str, value: Any, rule: str, fix: str, *, error: type[Exception] = ValueError) -> Exception:
    """Build (not raise) the exception for a bad argument.

    Args:
        name (`str`): the argument as the user spells it.
        value (`Any`): the value that was given.
        rule (`str`): what the value must satisfy, phrased to follow "must".
        fix (`str`): what to do instead.
        error (`type[Exception]`, defaults to `ValueError`): the exception class.

    Returns:
        `Exception`: ``error("`name` (=value) must <rule>; <fix>.")``, for the caller to ``raise``; its `param`
        attribute is `name` (the server answers with the request field it names).
    """
    err = error(f"`{name}` (={value!r}) must {rule}; {fix}.")
    err.param = name
    return err


def check_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    fix: str,
) -> None:
    """Raise `ValueError` unless ``value`` is a finite number in the interval given by ``low``/``high``.

    The bounds are closed unless ``low_open``/``high_open``; ``None`` means unbounded on that side. NaN and
    infinities are always refused (NaN passes every comparison, so a range test alone would accept it).

    Raises:
        ValueError: with the interval written in the message, e.g. "must lie in (0, 1]".
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, value, "be a number", fix)
    if not math.isfinite(value):
        raise invalid(name, value, "be a finite number", fix)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        left = ("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}")
        right = ("inf" if high is None else f"{high:g}") + (")" if high_open else "]")
        raise invalid(name, value, f"lie in {left}, {right}", fix)


def check_choice(name: str, value: Any, choices: tuple[str, ...] | list[str], fix: str | None = None) -> None:
    """Raise `ValueError` unless ``value`` is one of ``choices``; the message lists them."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise invalid(name, value, f"be one of {listed}", fix or f"pick one of {listed}")


def check_int(name: str, value: Any, low: int, fix: str) -> None:
    """Raise `ValueError` unless ``value`` is an integer (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(name, value, f"be an integer >= {low}", fix)


def check_bool(name: str, value: Any) -> None:
    """Raise `ValueError` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise invalid(name, value, "be a bool", "pass True or False")
