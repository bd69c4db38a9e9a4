"""HashStore: an in-process, thread-safe store (threads of one process, tests)."""

from __future__ import annotations

import threading
from typing import Callable

from .._timeouts import DEFAULT_TIMEOUT
from ._kv import KVState, Waiter
from .base import Store, Timeout, queue_empty_error, timeout_error

__all__ = ["HashStore"]


def _wake(waiter: Waiter, values: list[bytes]) -> None:
    waiter.result = values
    waiter.ctx.set()


class HashStore(Store):
    """A store held in this process's memory, shared by its threads.

    ``get``/``wait``/``queue_pop`` block on an Event that the satisfying write sets.

    Args:
        timeout: default timeout of blocking calls, seconds or ``timedelta``.

    Example:
        >>> store = HashStore()
        >>> store.add("n", 2)
        2
        >>> store.get("n")
        b'2'
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._lock = threading.Lock()
        self._kv = KVState()

    def __repr__(self) -> str:
        return f"HashStore(keys={self._kv.num_keys()})"

    def clone(self) -> HashStore:
        """This store itself: it is already safe to share between threads (torch's ``clone``)."""
        return self

    def _set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._kv.set(key.encode(), value)

    def _block(self, keys: list[str], timeout: float, op: str) -> list[bytes]:
        bkeys = [k.encode() for k in keys]
        with self._lock:
            got = self._kv.get_or_watch(bkeys, _wake, threading.Event())
        if not isinstance(got, Waiter):
            return got
        return self._await(got, timeout, op, keys, lambda: [k.decode() for k in self._kv.missing(bkeys)])

    def _await(self, got: Waiter, timeout: float, op: str, keys: list[str],
               missing: Callable[[], list[str]]) -> list[bytes]:
        """Wait for a parked request; on timeout withdraw it and raise naming ``missing()``."""
        if not got.ctx.wait(timeout):
            with self._lock:
                if got.active:
                    self._kv.cancel(got)
                    raise timeout_error(op, keys, missing(), timeout, "HashStore")
        assert got.result is not None
        return got.result

    def _get(self, keys: list[str], timeout: float) -> list[bytes]:
        if not keys:
            return []
        return self._block(keys, timeout, "get")

    def _wait(self, keys: list[str], timeout: float) -> None:
        if not keys:
            return
        bkeys = [k.encode() for k in keys]
        with self._lock:
            got = self._kv.wait_or_watch(bkeys, _wake, threading.Event())
        if got is not None:
            self._await(got, timeout, "wait", keys, lambda: [k.decode() for k in self._kv.missing(bkeys)])

    def _add(self, key: str, amount: int) -> int:
        with self._lock:
            return self._kv.add(key.encode(), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            return self._kv.compare_set(key.encode(), expected, desired)

    def _check(self, keys: list[str]) -> bool:
        with self._lock:
            return self._kv.check([k.encode() for k in keys])

    def _delete_key(self, key: str) -> bool:
        with self._lock:
            return self._kv.delete(key.encode())

    def _num_keys(self) -> int:
        with self._lock:
            return self._kv.num_keys()

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._lock:
            for k, v in zip(keys, values):
                self._kv.set(k.encode(), v)

    def _append(self, key: str, value: bytes) -> None:
        with self._lock:
            self._kv.append(key.encode(), value)

    def _queue_push(self, key: str, value: bytes) -> None:
        with self._lock:
            self._kv.queue_push(key.encode(), value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        bkey = key.encode()
        with self._lock:
            if timeout is None:
                value = self._kv.queue_pop_now(bkey)
                if value is None:
                    raise queue_empty_error(key, "HashStore")
                return value
            got = self._kv.queue_pop_or_watch(bkey, _wake, threading.Event())
        if not isinstance(got, Waiter):
            return got
        return self._await(got, timeout, "queue_pop", [key], lambda: [key])[0]

    def _queue_len(self, key: str) -> int:
        with self._lock:
            return self._kv.queue_len(key.encode())

    def _list_keys(self) -> list[str]:
        with self._lock:
            return [k.decode() for k in self._kv.list_keys()]
