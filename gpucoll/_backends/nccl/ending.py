"""Whether a backend is over, and why: aborted (by a caller, a failed op, an
asynchronous NCCL error, a shrink), shut down, or both.

The reasons are plain attributes that anyone reads (the issue path reads :attr:`Ending.over`,
one field, before every op) and only this object's methods write. An abort sets its
reason and empties the queue of outstanding ops in one step, under the queue's lock,
so that an op is either in the snapshot the abort fails or issued after the reason
was set (and then refused, or failed when polled).
"""

from __future__ import annotations

from typing import Any

from .outstanding import Outstanding

__all__ = ["Ending"]


class Ending:
    """One backend's end: :attr:`aborted` (why it was aborted, or None), :attr:`closed`
    (why it was shut down, or None), :attr:`over` (the abort's reason, else the
    shutdown's: None while ops may still be issued). Read-only outside this class."""

    __slots__ = ("aborted", "closed", "over", "_queue")

    def __init__(self, queue: Outstanding) -> None:
        self.aborted: str | None = None
        self.closed: str | None = None
        self.over: str | None = None
        self._queue = queue

    def abort(self, reason: str) -> list[Any] | None:
        """Mark aborted for ``reason`` and take every outstanding op (for the caller to
        fail); None, changing nothing, when it was aborted already."""
        with self._queue.lock:  # the reason and the queue change together
            if self.aborted is not None:
                return None
            self.aborted = self.over = reason
            return self._queue.take_all_locked()

    def add_reason(self, why: str) -> None:
        """Append ``why`` (NCCL's abort failed too) to the abort's reason."""
        self.aborted = self.over = f"{self.aborted} (and {why})"

    def close(self, reason: str) -> bool:
        """Mark shut down for ``reason``; False, changing nothing, when it was already."""
        with self._queue.lock:  # not between an abort's two writes
            if self.closed is not None:
                return False
            self.closed = reason
            if self.over is None:
                self.over = reason
            return True
