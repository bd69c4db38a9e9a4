"""FileStore: processes of one host, or of several hosts on a shared filesystem.

The file is an append-only log of records (the TCP wire's frame encoding) behind a
short header. Every process replays the log into its own :class:`KVState`; writers
hold an exclusive ``flock`` while they catch up, decide and append, so
read-modify-write operations (``add``, ``compare_set``, ``queue_pop``) are atomic
across processes. A file cannot wake a waiter, so ``get``/``wait``/``queue_pop``
poll the file's size with a short backoff (0.5 ms growing to 10 ms) and re-read only
when it grew.

Each store counts itself in on open and out on close; the file is removed when
``world_size`` stores have closed it (or, with no ``world_size``, when the last
store open on it closes).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from .._timeouts import DEFAULT_TIMEOUT
from ..errors import DistStoreError
from . import _wire as w
from ._kv import HIDDEN_PREFIX, KVState
from .base import Store, Timeout, timeout_error

__all__ = ["FileStore"]

_HEADER: Final = b"gpucoll-filestore-1\n"
_USERS: Final = HIDDEN_PREFIX + b"filestore/users"
_CLOSED: Final = HIDDEN_PREFIX + b"filestore/closed"
_POLL_MIN = 0.0005
_POLL_MAX = 0.01


class FileStore(Store):
    """A store kept in a file that several processes open.

    Args:
        file_name: path of the log file (created if absent). Use a fresh path per job:
            a file left by an earlier job that crashed still holds its keys.
        world_size: number of stores that will open this file, or None. With it, the
            file is removed when that many have closed; without, when the last open
            one closes.
        timeout: default timeout of blocking calls, seconds or ``timedelta``.

    Raises:
        DistStoreError: the file cannot be opened or is not a FileStore log.

    Example:
        >>> store = FileStore("/tmp/job42.store", world_size=2)
        >>> store.set("addr/0", b"10.0.0.1:5000")
    """

    def __init__(self, file_name: str | os.PathLike[str], world_size: int | None = None,
                 timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                       or world_size < 1):
            raise ValueError(f"world_size must be None or an int >= 1; got {world_size!r}")
        self._path = os.fspath(file_name)
        self.world_size = world_size
        self._tlock = threading.RLock()
        self._kv = KVState()
        self._offset = 0
        self._fd = -1
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DistStoreError(f"FileStore cannot open {self._path!r}: {e}") from e
        try:
            with self._locked(exclusive=True):
                self._write_add(_USERS, 1)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    @property
    def path(self) -> str:
        """The log file's path."""
        return self._path

    def __repr__(self) -> str:
        return f"FileStore({self._path!r})"

    def close(self) -> None:
        """Count this store out; the last one (see ``world_size``) removes the file."""
        with self._tlock:
            if self._fd < 0:
                return
            try:
                with self._locked(exclusive=True):
                    users = self._write_add(_USERS, -1)
                    closed = self._write_add(_CLOSED, 1)
                    if (closed >= self.world_size) if self.world_size else users <= 0:
                        try:
                            os.unlink(self._path)
                        except FileNotFoundError:
                            pass
            finally:
                os.close(self._fd)
                self._fd = -1

    # -- the log --------------------------------------------------------------------------

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        with self._tlock:
            if self._fd < 0:
                raise DistStoreError(f"FileStore {self._path!r} is closed")
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            except OSError as e:
                raise DistStoreError(f"FileStore cannot lock {self._path!r}: {e}") from e
            try:
                self._sync(exclusive)
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _sync(self, exclusive: bool) -> None:
        """Replay what other processes appended since the last read."""
        try:
            size = os.fstat(self._fd).st_size
            if size <= self._offset:
                if size == 0 and exclusive:
                    os.write(self._fd, _HEADER)
                    self._offset = len(_HEADER)
                return
            data = os.pread(self._fd, size - self._offset, self._offset)
        except OSError as e:
            raise DistStoreError(f"FileStore cannot read {self._path!r}: {e}") from e
        pos = 0
        if self._offset == 0:
            if not data.startswith(_HEADER):
                if len(data) < len(_HEADER) and _HEADER.startswith(data):
                    return  # a header still being written (only seen without a lock)
                raise DistStoreError(f"{self._path!r} is not a gpucoll FileStore log "
                                     f"(it starts with {data[:24]!r})")
            pos = len(_HEADER)
        n = len(data)
        kv = self._kv
        try:
            while n - pos >= 5:
                (length,) = w.U32.unpack_from(data, pos)
                end = pos + 4 + length
                if length == 0 or end > n:
                    break
                code = data[pos + 4]
                f = w.decode_fields(data, pos + 5, end)
                if code == w.SET:
                    kv.set(f[0], f[1])
                elif code == w.APPEND:
                    kv.append(f[0], f[1])
                elif code == w.QPUSH:
                    kv.queue_push(f[0], f[1])
                elif code == w.REC_QPOP:
                    kv.queue_pop_now(f[0])
                elif code == w.REC_DELETE:
                    kv.delete(f[0])
                else:
                    raise w.ProtocolError(f"unknown record code {code}")
                pos = end
        except (w.ProtocolError, IndexError) as e:
            raise DistStoreError(f"FileStore {self._path!r} is corrupt at byte "
                                 f"{self._offset + pos}: {e}") from e
        if pos < n and exclusive:
            # A writer died mid-record: cut the torn tail so the log stays parseable.
            os.ftruncate(self._fd, self._offset + pos)
        self._offset += pos

    def _append_records(self, records: list[bytes]) -> None:
        data = b"".join(records)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            raise DistStoreError(f"FileStore cannot write {self._path!r}: {e}") from e
        # We hold the exclusive lock and were caught up, so the records landed at _offset.
        self._offset += len(data)

    def _write_set(self, key: bytes, value: bytes) -> None:
        self._append_records([w.encode_frame(w.SET, [key, value])])
        self._kv.set(key, value)

    def _write_add(self, key: bytes, amount: int) -> int:
        current = self._kv.data.get(key)
        total = self._kv.add(key, amount)  # raises before anything is written
        try:
            self._append_records([w.encode_frame(w.SET, [key, str(total).encode()])])
        except BaseException:
            if current is None:
                self._kv.delete(key)
            else:
                self._kv.set(key, current)
            raise
        return total

    def _poll(self, ready: Callable[[], "bytes | list[bytes] | None"], timeout: float, exclusive: bool = False) -> bytes | list[bytes]:
        """Call ``ready`` under the lock each time the file grew, until it returns non-None."""
        deadline = time.monotonic() + timeout
        delay = _POLL_MIN
        seen = -1
        while True:
            try:
                size = os.fstat(self._fd).st_size
            except OSError as e:
                raise DistStoreError(f"FileStore {self._path!r}: {e}") from e
            if size != seen:
                seen = size
                with self._locked(exclusive):
                    got = ready()
                if got is not None:
                    return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)

    # -- the operations -------------------------------------------------------------------

    def _set(self, key: str, value: bytes) -> None:
        with self._locked(exclusive=True):
            self._write_set(key.encode(), value)

    def _get(self, keys: list[str], timeout: float, op: str = "get") -> list[bytes]:
        if not keys:
            return []
        bkeys = [k.encode() for k in keys]
        data = self._kv.data

        def ready() -> list[bytes] | None:
            try:
                return [data[k] for k in bkeys]
            except KeyError:
                return None

        try:
            got = self._poll(ready, timeout)
        except TimeoutError:
            with self._locked(exclusive=False):
                missing = [k.decode() for k in self._kv.missing(bkeys)]
            raise timeout_error(op, keys, missing, timeout, f"FileStore {self._path!r}") from None
        assert isinstance(got, list)
        return got

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._get(keys, timeout, "wait")

    def _add(self, key: str, amount: int) -> int:
        with self._locked(exclusive=True):
            return self._write_add(key.encode(), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        bkey = key.encode()
        with self._locked(exclusive=True):
            current = self._kv.data.get(bkey)
            if (current is None and not expected) or current == expected:
                self._write_set(bkey, desired)
                return desired
            return expected if current is None else current

    def _check(self, keys: list[str]) -> bool:
        with self._locked(exclusive=False):
            return self._kv.check([k.encode() for k in keys])

    def _delete_key(self, key: str) -> bool:
        bkey = key.encode()
        with self._locked(exclusive=True):
            if bkey not in self._kv.data and not self._kv.queue_len(bkey):
                return False
            self._append_records([w.encode_frame(w.REC_DELETE, [bkey])])
            return self._kv.delete(bkey)

    def _num_keys(self) -> int:
        with self._locked(exclusive=False):
            return self._kv.num_keys()

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        bkeys = [k.encode() for k in keys]
        with self._locked(exclusive=True):
            self._append_records([w.encode_frame(w.SET, [k, v]) for k, v in zip(bkeys, values)])
            for k, v in zip(bkeys, values):
                self._kv.set(k, v)

    def _append(self, key: str, value: bytes) -> None:
        bkey = key.encode()
        with self._locked(exclusive=True):
            self._append_records([w.encode_frame(w.APPEND, [bkey, value])])
            self._kv.append(bkey, value)

    def _queue_push(self, key: str, value: bytes) -> None:
        bkey = key.encode()
        with self._locked(exclusive=True):
            self._append_records([w.encode_frame(w.QPUSH, [bkey, value])])
            self._kv.queue_push(bkey, value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        bkey = key.encode()

        def pop() -> bytes | None:
            if not self._kv.queue_len(bkey):
                return None
            self._append_records([w.encode_frame(w.REC_QPOP, [bkey])])
            return self._kv.queue_pop_now(bkey)

        if timeout is None:
            with self._locked(exclusive=True):
                got = pop()
            if got is None:
                raise DistStoreError(f"queue_pop({key!r}, block=False): the queue is empty")
            return got
        try:
            value = self._poll(pop, timeout, exclusive=True)
        except TimeoutError:
            raise timeout_error("queue_pop", [key], [key], timeout,
                                f"FileStore {self._path!r}") from None
        assert isinstance(value, bytes)
        return value

    def _queue_len(self, key: str) -> int:
        with self._locked(exclusive=False):
            return self._kv.queue_len(key.encode())

    def _list_keys(self) -> list[str]:
        with self._locked(exclusive=False):
            return [k.decode() for k in self._kv.list_keys()]

