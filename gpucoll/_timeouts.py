"""One unit for time: seconds as float; ``timedelta`` is accepted at the API edge. And the
one backoff of every poll loop (:class:`Backoff`)."""

from __future__ import annotations

import math
import time
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


class Backoff:
    """The one poll loop's clock: sleeps that double from ``first`` up to ``cap``, never
    past the deadline ``timeout`` seconds from now (None: no deadline).

    Example:
        >>> wait = Backoff(timeout, first=0.001, cap=0.1)
        >>> while not ready():
        ...     if not wait.sleep():
        ...         raise DistStoreTimeoutError(f"... not ready within {timeout:g} s")
    """

    __slots__ = ("deadline", "delay", "cap")

    def __init__(self, timeout: float | None, *, first: float, cap: float) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"need 0 < first <= cap; got first={first!r}, cap={cap!r}")
        self.deadline = math.inf if timeout is None else time.monotonic() + timeout
        self.delay = first
        self.cap = cap

    def left(self) -> float:
        """Seconds until the deadline (inf without one; <= 0 once it passed)."""
        return self.deadline - time.monotonic()

    def sleep(self) -> bool:
        """Sleep the next delay, cut at the deadline, and double the delay (up to the cap).
        False, without sleeping, once the deadline has passed: the caller gives up."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.delay, left))
        self.delay = min(self.delay * 2, self.cap)
        return True
