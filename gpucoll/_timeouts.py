"""One unit for time: seconds as float; ``timedelta`` is accepted at the API edge."""

from __future__ import annotations

import math
from datetime import timedelta

DEFAULT_TIMEOUT: float = 300.0
"""Default timeout of stores and process groups, in seconds (torch uses 30 min; a hang
should surface sooner)."""


def to_seconds(timeout: float | int | timedelta | None, *, name: str = "timeout",
               default: float | None = DEFAULT_TIMEOUT, allow_zero: bool = False) -> float:
    """Normalise a timeout given as seconds or ``timedelta`` to positive float seconds.

    Args:
        timeout: seconds (int or float), a ``datetime.timedelta``, or None for ``default``.
        name: the argument's name, used in error messages.
        default: value used when ``timeout`` is None.
        allow_zero: accept 0 ("do not wait": monitored_barrier's check-once).

    Returns:
        The timeout in seconds, a finite float > 0 (>= 0 with ``allow_zero``).

    Raises:
        TypeError: ``timeout`` is not a number or timedelta.
        ValueError: ``timeout`` is not positive and finite.
    """
    if timeout is None:
        if default is None:
            raise ValueError(f"{name} is required; got None")
        return float(default)
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{name} must be seconds (int/float) or datetime.timedelta; got {type(timeout).__name__} {timeout!r}"
        )
    if not ((seconds > 0 or (allow_zero and seconds == 0)) and math.isfinite(seconds)):
        sign = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {sign}, finite number of seconds; got {timeout!r}")
    return seconds
