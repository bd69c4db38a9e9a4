"""A backend's queue of outstanding ops: issued, not yet seen complete, in issue order.

The issue path appends without a lock (a deque's append is atomic, and only
:meth:`Outstanding.drop_finished` and :meth:`Outstanding.take_all` remove, under
:attr:`Outstanding.lock`, from the other end); a snapshot taken meanwhile may miss an
op appended at that moment, as it may miss one issued a moment later. The issue path
completes finished ops itself in batches: :meth:`add` says when the next batch is due.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator, Sequence

__all__ = ["Outstanding", "PRUNE_AT", "PRUNE_WORKS_AT"]

# Outstanding ops kept before the issue path completes finished ones itself (one event
# query settles the batch when the GPU keeps up): the rest is the watchdog's timer's.
PRUNE_AT = 256
# Works (async ops, ops under a hook) since the last batch before the next one: a Work
# kept outstanding longer survives into Python's oldest GC generation, and full
# collections then cost more per op than the batch's query.
PRUNE_WORKS_AT = 64


class Outstanding:
    """Ops (Works, Work-less records) issued and not yet seen complete, oldest first."""

    __slots__ = ("lock", "_ops", "_next_batch", "_works")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._ops: deque[Any] = deque()
        self._next_batch = PRUNE_AT
        self._works = 0

    def add(self, op: Any) -> bool:
        """Append ``op``, a Work-less record; True when the issue path should complete
        a batch now (then call :meth:`batch_done`)."""
        ops = self._ops
        ops.append(op)
        return len(ops) > self._next_batch

    def add_work(self, work: Any) -> bool:
        """:meth:`add` for a Work: True once more than PRUNE_WORKS_AT Works came since the
        last batch. (The queue's length is :meth:`add`'s to watch: Work-less records past
        PRUNE_AT make the next of them due; Works alone make a batch due far sooner.)"""
        self._ops.append(work)
        works = self._works = self._works + 1
        return works > PRUNE_WORKS_AT

    def add_all(self, works: Sequence[Any]) -> bool:
        """:meth:`add_work` for several Works at once."""
        ops = self._ops
        ops.extend(works)
        self._works += len(works)
        return self._works > PRUNE_WORKS_AT or len(ops) > self._next_batch

    def batch_done(self) -> None:
        """The next batch comes PRUNE_AT ops (PRUNE_WORKS_AT Works) from now, whatever
        this one left."""
        self._next_batch = len(self._ops) + PRUNE_AT
        self._works = 0

    def snapshot(self) -> list[Any]:
        with self.lock:
            return list(self._ops)

    def take_all_locked(self) -> list[Any]:
        """Every op, the queue emptied (the caller holds :attr:`lock`)."""
        ops = list(self._ops)
        self._ops.clear()
        return ops

    def drop_finished(self, ops: Sequence[Any]) -> None:
        """Remove ``ops``, a completed prefix of a snapshot, from the head."""
        mine = self._ops
        with self.lock:
            for op in ops:
                if mine and mine[0] is op:
                    mine.popleft()

    def oldest(self) -> Any:
        """The oldest op, or None."""
        try:
            return self._ops[0]
        except IndexError:
            return None

    def __len__(self) -> int:
        return len(self._ops)

    def __bool__(self) -> bool:
        return bool(self._ops)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._ops))
