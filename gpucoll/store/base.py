"""The Store API shared by every store: torch.distributed's surface, checked at the edge.

:class:`Store` validates and normalises arguments (keys are ``str``; values are
bytes-like or ``str``, which is UTF-8 encoded; timeouts are seconds or
``timedelta``) and hands them to a small set of protected methods that each store
implements. Differences from torch, on purpose:

* ``timeout`` is seconds as a float (``timedelta`` is still accepted when setting it).
* ``get``, ``multi_get``, ``wait`` and ``queue_pop`` take an optional per-call ``timeout``.
* ``list_keys`` lists only the caller's keys; ``num_keys`` counts as torch does (a
  FileStore's and a waiting TCPStore's one bookkeeping key included).
* Timeouts raise :class:`~gpucoll.errors.DistStoreTimeoutError` ("Wait timeout ...",
  torch's words, then the keys still missing); stores support ``close()`` and ``with``.

A subclass may implement the protected methods (``_set``, ``_get``, ...; arguments
arrive checked), or, torch's way, override the public ones (``set``, ``get``, ``add``,
...) with plain methods; either kind works under PrefixStore and as
``init_process_group(store=...)``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Callable, Union, cast

from .._timeouts import Backoff, DEFAULT_TIMEOUT, to_seconds
from ..errors import DistStoreTimeoutError, QueueEmptyError

__all__ = ["Store", "ValueLike", "Timeout"]

ValueLike = Union[bytes, bytearray, memoryview, str]
"""What a store accepts as a value; it always returns ``bytes``."""
Timeout = Union[float, int, timedelta]


class Store(abc.ABC):
    """A key-value store for rendezvous and control messages between processes.

    Values are bytes (``str`` is UTF-8 encoded on the way in); ``get`` and ``wait``
    block until the keys exist or the timeout passes.

    Args:
        timeout: default timeout of blocking calls, seconds or ``timedelta``.
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        self._timeout = to_seconds(timeout)

    # -- timeouts -------------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        """Default timeout of blocking calls, in seconds."""
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default timeout of blocking calls.

        Args:
            timeout: seconds (int/float) or ``datetime.timedelta``, > 0.
        """
        self._timeout = to_seconds(timeout)

    def _call_timeout(self, timeout: Timeout | None) -> float:
        return self._timeout if timeout is None else to_seconds(timeout)

    # -- the API --------------------------------------------------------------------------

    def set(self, key: str, value: ValueLike) -> None:
        """Set ``key`` to ``value``, waking every ``get``/``wait`` blocked on it.

        Raises:
            TypeError: ``key`` is not a str or ``value`` not bytes-like/str.
        """
        self._set(check_key(key), check_value(value))

    def get(self, key: str, *, timeout: Timeout | None = None) -> bytes:
        """Return the value of ``key``, waiting until it is set.

        Args:
            key: the key.
            timeout: how long to wait; the store's timeout when None.

        Raises:
            DistStoreTimeoutError: the key was not set within the timeout.
        """
        return self._get([check_key(key)], self._call_timeout(timeout))[0]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent counts as 0) and return the sum.

        The value is stored as decimal ASCII, so ``get`` returns e.g. ``b"3"``.

        Raises:
            TypeError: ``amount`` is not an int.
            DistStoreError: the key holds something that is not a decimal integer.
        """
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise TypeError(f"amount must be an int; got {type(amount).__name__} {amount!r}")
        return self._add(check_key(key), amount)

    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        """Atomically set ``key`` to ``desired_value`` if it holds ``expected_value``.

        An absent key matches an empty ``expected_value`` (torch's rule).

        Returns:
            ``desired_value`` if the swap happened; otherwise the current value, or
            ``expected_value`` when the key is absent.
        """
        return self._compare_set(check_key(key), check_value(expected_value, "expected_value"),
                                 check_value(desired_value, "desired_value"))

    def wait(self, keys: str | Sequence[str], timeout: Timeout | None = None) -> None:
        """Block until every key in ``keys`` exists.

        Args:
            keys: a list of keys (a single str is taken as one key).
            timeout: how long to wait; the store's timeout when None.

        Raises:
            DistStoreTimeoutError: some keys were still missing at the timeout; the
                message names them.
        """
        self._wait(check_keys(keys), self._call_timeout(timeout))

    def check(self, keys: str | Sequence[str]) -> bool:
        """Return True if every key in ``keys`` exists now (never blocks)."""
        return self._check(check_keys(keys))

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` (and a queue of that name); return True if anything was deleted."""
        return self._delete_key(check_key(key))

    def num_keys(self) -> int:
        """Return the number of keys set (queues and the store's own keys not counted)."""
        return self._num_keys()

    def multi_get(self, keys: Sequence[str], *, timeout: Timeout | None = None) -> list[bytes]:
        """Return the values of ``keys`` in one request, waiting until all exist.

        Raises:
            DistStoreTimeoutError: some keys were still missing at the timeout.
        """
        return self._get(check_keys(keys), self._call_timeout(timeout))

    def multi_set(self, keys: Sequence[str], values: Sequence[ValueLike]) -> None:
        """Set several keys in one request.

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.
        """
        ks = check_keys(keys)
        if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
            raise TypeError(f"values must be a sequence of bytes/str; got {type(values).__name__}")
        if len(ks) != len(values):
            raise ValueError(f"multi_set needs as many values as keys; got {len(ks)} keys "
                             f"and {len(values)} values")
        self._multi_set(ks, [check_value(v, "values") for v in values])

    def append(self, key: str, value: ValueLike) -> None:
        """Append ``value`` to the value of ``key`` (setting it if absent)."""
        self._append(check_key(key), check_value(value))

    def queue_push(self, key: str, value: ValueLike) -> None:
        """Push ``value`` onto the FIFO queue ``key``, waking one blocked ``queue_pop``."""
        self._queue_push(check_key(key), check_value(value))

    def queue_pop(self, key: str, block: bool = True, *, timeout: Timeout | None = None) -> bytes:
        """Pop the oldest value of the queue ``key``; each value is delivered exactly once.

        Args:
            key: the queue.
            block: wait for a push when the queue is empty; if False, raise instead.
            timeout: how long to block; the store's timeout when None.

        Raises:
            QueueEmptyError: ``block`` is False and the queue is empty (a DistStoreError).
            DistStoreTimeoutError: nothing was pushed within the timeout.
        """
        return self._queue_pop(check_key(key), self._call_timeout(timeout) if block else None)

    def queue_len(self, key: str) -> int:
        """Return the number of values in the queue ``key``."""
        return self._queue_len(check_key(key))

    def list_keys(self) -> list[str]:
        """Return every key set (queues and the store's own keys not included)."""
        return self._list_keys()

    def close(self) -> None:
        """Release the store's resources (connections, files, a server it hosts)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- torch's extras -------------------------------------------------------------------

    def barrier(self, key: str, world_size: int, timeout: Timeout | None = None) -> None:
        """Block until ``world_size`` callers have entered the barrier named ``key``
        (torch's ``Store.barrier``; one use per key).

        Raises:
            DistStoreTimeoutError: not all arrived within the timeout.
        """
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
        key = check_key(key)
        if self.add(f"{key}/num_members", 1) == world_size:
            self.set(f"{key}/last_member", b"1")
        self.wait([f"{key}/last_member"], timeout)

    def clone(self) -> Store:
        """Return a store on the same data that another thread may use (torch's ``clone``)."""
        raise NotImplementedError(f"Not implemented. {type(self).__name__} does not support clone()")

    def has_extended_api(self) -> bool:
        """Whether this store implements ``append``, ``multi_get`` and ``multi_set`` itself
        (torch's name). True for gpucoll's stores; False for a subclass that implements
        none of them, whose calls then fall back to ``compare_set``, ``get`` and ``set``."""
        return (any(self._overrides(name) for name in ("append", "multi_get", "multi_set"))
                or any(getattr(type(self), name) is not getattr(Store, name) for name in ("_append", "_multi_set")))

    # -- what each store implements -------------------------------------------------------
    # Arguments arrive validated: keys are str, values bytes, timeouts float seconds.
    # A subclass written torch's way overrides the public methods instead (set, get, add,
    # ...); these defaults then call them, so that PrefixStore and the process groups,
    # which call the protected methods, work on it too.

    def _public(self, name: str, protected: str) -> Callable[..., Any]:
        method = getattr(type(self), name)
        if method is getattr(Store, name):
            # torch's words ("Not implemented."), then which methods are missing
            raise NotImplementedError(f"Not implemented. {type(self).__name__} implements neither "
                                      f"{name}() nor {protected}()")
        return cast(Callable[..., Any], getattr(self, name))

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(Store, name)

    def _set(self, key: str, value: bytes) -> None:
        self._public("set", "_set")(key, value)

    def _get(self, keys: list[str], timeout: float) -> list[bytes]:
        if len(keys) != 1 and self._overrides("multi_get"):
            return list(self.multi_get(keys))
        get = self._public("get", "_get")
        if self._overrides("wait"):
            self.wait(keys, timeout)
        return [_as_bytes(get(k)) for k in keys]

    def _wait(self, keys: list[str], timeout: float) -> None:
        if self._overrides("wait"):
            self.wait(keys, timeout)
            return
        if self._overrides("check"):
            wait = Backoff(timeout, first=0.001, cap=0.1)
            while not self.check(keys):
                if not wait.sleep():
                    raise timeout_error("wait", keys, keys, timeout, type(self).__name__)
            return
        get = self._public("get", "_wait")
        for k in keys:
            get(k)

    def _add(self, key: str, amount: int) -> int:
        return int(self._public("add", "_add")(key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return _as_bytes(self._public("compare_set", "_compare_set")(key, expected, desired))

    def _check(self, keys: list[str]) -> bool:
        return bool(self._public("check", "_check")(keys))

    def _delete_key(self, key: str) -> bool:
        return bool(self._public("delete_key", "_delete_key")(key))

    def _num_keys(self) -> int:
        return int(self._public("num_keys", "_num_keys")())

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if self._overrides("multi_set"):
            self.multi_set(keys, values)
            return
        for k, v in zip(keys, values):
            self._set(k, v)

    def _append(self, key: str, value: bytes) -> None:
        if self._overrides("append") or not self._overrides("compare_set"):
            self._public("append", "_append")(key, value)
            return
        # torch's fallback: compare_set until no other writer got in between (an absent
        # key matches the empty expected value)
        current = self._compare_set(key, b"", value)
        expected = value
        while current != expected:
            expected = current + value
            current = self._compare_set(key, current, expected)

    def _queue_push(self, key: str, value: bytes) -> None:
        self._public("queue_push", "_queue_push")(key, value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        """Pop; ``timeout`` None means do not block (raise QueueEmptyError when empty)."""
        return _as_bytes(self._public("queue_pop", "_queue_pop")(key, timeout is not None))

    def _queue_len(self, key: str) -> int:
        return int(self._public("queue_len", "_queue_len")(key))

    def _list_keys(self) -> list[str]:
        return list(self._public("list_keys", "_list_keys")())


def _as_bytes(value: object) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)  # type: ignore[call-overload]


def check_key(key: object, name: str = "key") -> str:
    """Return ``key`` if it is a str, else raise TypeError naming ``name``."""
    if type(key) is str or isinstance(key, str):
        return key
    raise TypeError(f"{name} must be a str; got {type(key).__name__} {key!r:.80}")


def check_keys(keys: object, name: str = "keys") -> list[str]:
    """Return ``keys`` as a list of str (one str is one key), else raise TypeError."""
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, (bytes, bytearray, memoryview)) or not isinstance(keys, Sequence):
        raise TypeError(f"{name} must be a list of str; got {type(keys).__name__} {keys!r:.80}")
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"{name} must be a list of str; got an element of type "
                            f"{type(k).__name__}: {k!r:.80}")
    return list(keys)


def check_value(value: object, name: str = "value") -> bytes:
    """Return ``value`` as bytes (str is UTF-8 encoded), else raise TypeError naming ``name``."""
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be bytes, bytearray, memoryview or str; got "
                    f"{type(value).__name__} {value!r:.80}")


def timeout_error(op: str, keys: Sequence[str], missing: Sequence[str], timeout: float,
                  where: str) -> DistStoreTimeoutError:
    """The error a blocking call raises when it runs out of time: torch's words first
    ("Wait timeout after 250ms"), then what timed out, where, and the keys still missing."""
    shown = list(keys)[:8]
    more = f" (+{len(keys) - 8} more)" if len(keys) > 8 else ""
    miss = list(missing)[:8]
    mmore = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
    return DistStoreTimeoutError(
        f"Wait timeout after {timeout * 1000:.0f}ms: {op} of {shown}{more} timed out after "
        f"{timeout:g} s on {where}; still missing: {miss}{mmore}")


def queue_empty_error(key: str, where: str) -> QueueEmptyError:
    """What a non-blocking ``queue_pop`` of an empty queue raises (torch's words first)."""
    return QueueEmptyError(f"queue is empty: queue_pop({key!r}, block=False) on {where}")
