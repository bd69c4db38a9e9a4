"""One unit for time: seconds as float; ``timedelta`` is accepted at the API edge. And the
one backoff of every poll loop (:class:`Backoff`), and the one rule that says when a waiter's
poll before it sleeps stops paying (:func:`skip_spins`)."""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

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


SPIN_BACKOFF_MIN = 8
SPIN_BACKOFF_MAX = 512


def skip_spins(waiter: Any) -> None:
    """After a reply that missed the poll ``waiter`` made for it before sleeping, or came
    in the poll's second half (a busy server, more threads than cores): the waiter (a
    store client's connection, an RPC connection, with fields ``skip_spin`` and
    ``backoff``) sleeps at once for its next ``backoff`` waits, and twice as many after
    each further such reply, up to :data:`SPIN_BACKOFF_MAX`; a reply well within the
    poll sets ``backoff`` back to :data:`SPIN_BACKOFF_MIN` (the waiter does that)."""
    waiter.skip_spin = waiter.backoff
    waiter.backoff = min(2 * waiter.backoff, SPIN_BACKOFF_MAX)
