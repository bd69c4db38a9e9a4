"""The store's semantics in one place: a key-value map, FIFO queues and waiters.

Both :class:`HashStore` (threads wait on an Event) and the TCPStore server (a
connection waits for its reply) run on this state machine, and FileStore replays
its log into it, so every store answers ``add``, ``compare_set``, ``append`` and the
queues identically. It is not thread-safe; its owner holds a lock or is one thread.

Blocking reads are waiters, never polling: ``watch`` registers a waiter on the
keys still missing, and the write that supplies the last of them calls the
waiter's ``notify`` with the values, inside that write.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Final

from ..errors import DistStoreError

__all__ = ["KVState", "Waiter", "HIDDEN_PREFIX"]

HIDDEN_PREFIX: Final = b"\x00gpucoll/"
"""Keys the stores use internally (worker counts, reference counts). They are left
out of ``num_keys`` and ``list_keys``, unlike torch, whose counts include its own keys."""


class Waiter:
    """A pending blocking read: ``get``/``wait`` on keys, or ``queue_pop`` on a queue.

    Attributes:
        keys: the keys waited for (for a queue waiter, the queue's name).
        notify: called once with ``(waiter, values)`` when satisfied.
        ctx: the owner's data (an Event, a connection, ...).
        active: False once notified or cancelled.
    """

    __slots__ = ("keys", "missing", "notify", "ctx", "active", "queue", "result", "presence")

    def __init__(self, keys: list[bytes], notify: Callable[[Waiter, list[bytes]], None],
                 ctx: Any, queue: bool, presence: bool = False) -> None:
        self.keys = keys
        self.missing = 0
        self.notify = notify
        self.ctx = ctx
        self.active = True
        self.queue = queue
        self.result: list[bytes] | None = None
        self.presence = presence
        """A ``wait`` (not a ``get``): a non-empty queue of a key's name satisfies it too."""


class KVState:
    """Keys, queues and the waiters on them."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self._key_waiters: dict[bytes, dict[Waiter, None]] = {}
        # dicts keep insertion order: the longest-waiting pop gets the next item.
        self._queue_waiters: dict[bytes, dict[Waiter, None]] = {}
        self._hidden = 0

    # -- writes ---------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        data = self.data
        if key not in data:
            if key.startswith(HIDDEN_PREFIX):
                self._hidden += 1
            data[key] = value
            waiters = self._key_waiters.pop(key, None)
            if waiters:
                self._wake(waiters)
        else:
            data[key] = value

    def add(self, key: bytes, amount: int) -> int:
        return int(self.add_text(key, amount))

    def add_text(self, key: bytes, amount: int) -> bytes:
        """:meth:`add`, returning the new value as stored (decimal ASCII)."""
        data = self.data
        current = data.get(key)
        if current is None:
            total = b"%d" % amount
            self.set(key, total)  # wakes the waiters on a new key
            return total
        try:
            total = b"%d" % (int(current) + amount)
        except ValueError:
            raise DistStoreError(
                f"add({_show(key)}, {amount}): the key holds {current[:60]!r}, "
                f"not a decimal integer") from None
        data[key] = total  # an existing key: nobody waits on it
        return total

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        # torch's rule: an absent key counts as matching an empty ``expected``.
        current = self.data.get(key)
        if (current is None and not expected) or current == expected:
            self.set(key, desired)
            return desired
        return expected if current is None else current

    def append(self, key: bytes, value: bytes) -> None:
        current = self.data.get(key)
        self.set(key, value if current is None else current + value)

    def delete(self, key: bytes) -> bool:
        found = self.data.pop(key, None) is not None
        if found and key.startswith(HIDDEN_PREFIX):
            self._hidden -= 1
        if self.queues.pop(key, None) is not None:
            found = True
        return found

    def queue_push(self, key: bytes, value: bytes) -> None:
        waiters = self._queue_waiters.get(key)
        while waiters:
            waiter = next(iter(waiters))
            del waiters[waiter]
            if not waiters:
                del self._queue_waiters[key]
            if waiter.active:
                waiter.active = False
                waiter.notify(waiter, [value])
                return
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = deque()
        queue.append(value)
        if len(queue) == 1 and key not in self.data:
            # torch's rule: check/wait see a non-empty queue as its key being present.
            waiters2 = self._key_waiters.pop(key, None)
            if waiters2:
                self._wake(waiters2)

    def queue_pop_now(self, key: bytes) -> bytes | None:
        queue = self.queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return value

    # -- reads ----------------------------------------------------------------------------

    def check(self, keys: list[bytes]) -> bool:
        """True if every key is set or names a non-empty queue (torch's rule)."""
        data = self.data
        queues = self.queues
        return all(k in data or k in queues for k in keys)

    def missing(self, keys: list[bytes]) -> list[bytes]:
        """The keys neither set nor naming a non-empty queue."""
        data = self.data
        queues = self.queues
        return [k for k in keys if k not in data and k not in queues]

    def num_keys(self) -> int:
        return len(self.data) - self._hidden

    def list_keys(self) -> list[bytes]:
        return [k for k in self.data if not k.startswith(HIDDEN_PREFIX)]

    def queue_len(self, key: bytes) -> int:
        queue = self.queues.get(key)
        return 0 if queue is None else len(queue)

    # -- waiting --------------------------------------------------------------------------

    def get_or_watch(self, keys: list[bytes], notify: Callable[[Waiter, list[bytes]], None],
                     ctx: Any) -> list[bytes] | Waiter:
        """The values of ``keys`` if all exist, else a registered Waiter for them."""
        data = self.data
        try:
            return [data[k] for k in keys]
        except KeyError:
            pass
        waiter = Waiter(keys, notify, ctx, queue=False)
        self._register(waiter)
        return waiter

    def wait_or_watch(self, keys: list[bytes], notify: Callable[[Waiter, list[bytes]], None],
                      ctx: Any) -> Waiter | None:
        """None if every key is present (see :meth:`check`), else a registered Waiter."""
        if self.check(keys):
            return None
        waiter = Waiter(keys, notify, ctx, queue=False, presence=True)
        self._register(waiter)
        return waiter

    def queue_pop_or_watch(self, key: bytes, notify: Callable[[Waiter, list[bytes]], None],
                           ctx: Any) -> bytes | Waiter:
        """The queue's head if there is one, else a registered Waiter for the next push."""
        value = self.queue_pop_now(key)
        if value is not None:
            return value
        waiter = Waiter([key], notify, ctx, queue=True)
        self._queue_waiters.setdefault(key, {})[waiter] = None
        return waiter

    def cancel(self, waiter: Waiter) -> None:
        """Forget a waiter that will not be notified (timed out, or its owner went away)."""
        waiter.active = False
        table = self._queue_waiters if waiter.queue else self._key_waiters
        for k in waiter.keys:
            waiters = table.get(k)
            if waiters is not None:
                waiters.pop(waiter, None)
                if not waiters:
                    del table[k]

    def _register(self, waiter: Waiter) -> None:
        data = self.data
        table = self._key_waiters
        if waiter.presence:
            queues = self.queues
            missing = {k for k in waiter.keys if k not in data and k not in queues}
        else:
            missing = {k for k in waiter.keys if k not in data}
        waiter.missing = len(missing)
        for k in missing:
            waiters = table.get(k)
            if waiters is None:
                table[k] = {waiter: None}
            else:
                waiters[waiter] = None

    def _wake(self, waiters: dict[Waiter, None]) -> None:
        data = self.data
        for waiter in waiters:
            if not waiter.active:
                continue
            if waiter.presence:
                # A key can turn present twice (a queue, then a set): recount.
                if not self.check(waiter.keys):
                    self._register(waiter)
                    continue
                waiter.active = False
                waiter.notify(waiter, [])
                continue
            waiter.missing -= 1
            if waiter.missing:
                continue
            try:
                values = [data[k] for k in waiter.keys]
            except KeyError:
                # One of the keys present at registration was deleted since: wait again.
                self._register(waiter)
                continue
            waiter.active = False
            waiter.notify(waiter, values)


def _show(key: bytes) -> str:
    return repr(key.decode("utf-8", "replace"))
