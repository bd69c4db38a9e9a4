"""FileStore: processes of one host, or of several hosts on a shared filesystem.

The file is an append-only log of records (the TCP wire's frame encoding) behind a
header naming the format and this log's creation (see ``_filelog``). Every process
replays the log into its own :class:`KVState`; writers hold an exclusive ``flock``
while they catch up, decide and append, so read-modify-write operations (``add``,
``compare_set``, ``queue_pop``) are atomic across processes. A file cannot wake a
waiter, so ``get``/``wait``/``queue_pop`` poll the file's size with a short backoff
(0.5 ms growing to 10 ms) and re-read only when it grew.

Only a regular file owned by the current user is used (never a link or a device); a
new one is created with ``O_EXCL`` and mode 0600. Each store registers itself in the
log on open and deregisters on close (or when garbage-collected); the file is removed
when no store has it open any more and, with ``world_size``, that many have closed it.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable

from .._timeouts import Backoff, DEFAULT_TIMEOUT
from ..errors import DistStoreError
from . import _wire as w
from ._filelog import FileLog, finalize
from .base import Store, Timeout, queue_empty_error, timeout_error

__all__ = ["FileStore"]

_POLL_MIN = 0.0005
_POLL_MAX = 0.01


class FileStore(Store):
    """A store kept in a file that several processes open.

    Args:
        file_name: path of the log file: created (mode 0600) if absent, else a regular
            file owned by the current user that is empty or a FileStore log. A log
            left by a killed job (its processes all gone without closing it) is
            started afresh, with a ``RuntimeWarning``; the log of a job that
            finished (and somehow was not removed) is refused.
        world_size: number of processes of the job that opens this file, or None.
            With it, the file is removed when no store has it open and that many
            stores have closed it; without, when the last open store closes. A store
            of another job on the same path (another ``world_size``, more live
            processes than ``world_size``, or a process that is not one of the
            ``world_size`` that have joined) is refused.
        timeout: default timeout of blocking calls, seconds or ``timedelta``.

    Raises:
        DistStoreError: the path is not a regular file of this user (a link, a
            device, another user's file), not a FileStore log, corrupt (the message
            names the byte offset), or in use by another job.

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
        self._log = FileLog(self._path, world_size, self._timeout)
        if self._log.fresh_start:
            warnings.warn(self._log.fresh_start, RuntimeWarning, stacklevel=2)
        # Closes the log when the store is garbage-collected or the interpreter exits
        # (torch's FileStore does so in its destructor).
        self._finalizer = weakref.finalize(self, finalize, self._log)

    def set_timeout(self, timeout: Timeout) -> None:
        super().set_timeout(timeout)
        self._log.lock_timeout = self._timeout  # waiting for the file lock is bounded too

    @property
    def path(self) -> str:
        """The log file's path."""
        return self._path

    def __repr__(self) -> str:
        return f"FileStore({self._path!r})"

    def clone(self) -> FileStore:
        """Another store on the same file, for another thread (torch's ``clone``); it
        counts as one more open store of this process (close it too).
        """
        return FileStore(self._path, self.world_size, self._timeout)

    def close(self) -> None:
        """Count this store out; the last one (see ``world_size``) removes the file.

        Garbage collection of an unclosed store closes it the same way.
        """
        self._finalizer.detach()
        self._log.close()

    def _poll(self, ready: Callable[[], "bytes | list[bytes] | None"], timeout: float,
              exclusive: bool = False) -> bytes | list[bytes]:
        """Call ``ready`` under the lock each time the file grew, until it returns non-None."""
        wait = Backoff(timeout, first=_POLL_MIN, cap=_POLL_MAX)
        seen = -1
        log = self._log
        while True:
            try:
                size = os.fstat(log.fd).st_size
            except OSError as e:
                raise DistStoreError(f"FileStore {self._path!r}: {e}") from e
            if size != seen:
                seen = size
                with log.locked(exclusive):
                    got = ready()
                if got is not None:
                    return got
            if not wait.sleep():
                raise TimeoutError

    # -- the operations -------------------------------------------------------------------

    def _set(self, key: str, value: bytes) -> None:
        with self._log.locked(exclusive=True):
            self._log.write_set(key.encode(), value)

    def _get(self, keys: list[str], timeout: float, op: str = "get") -> list[bytes]:
        if not keys:
            return []
        bkeys = [k.encode() for k in keys]
        data = self._log.kv.data

        def ready() -> list[bytes] | None:
            try:
                return [data[k] for k in bkeys]
            except KeyError:
                return None

        try:
            got = self._poll(ready, timeout)
        except TimeoutError:
            with self._log.locked(exclusive=False):
                missing = [k.decode() for k in self._log.kv.missing(bkeys)]
            raise timeout_error(op, keys, missing, timeout, f"FileStore {self._path!r}") from None
        assert isinstance(got, list)
        return got

    def _wait(self, keys: list[str], timeout: float) -> None:
        if not keys:
            return
        bkeys = [k.encode() for k in keys]
        kv = self._log.kv
        # a key is present when set or when it names a non-empty queue (torch's rule,
        # as check() and the other stores answer)
        try:
            self._poll(lambda: [] if kv.check(bkeys) else None, timeout)
        except TimeoutError:
            with self._log.locked(exclusive=False):
                missing = [k.decode() for k in kv.missing(bkeys)]
            raise timeout_error("wait", keys, missing, timeout, f"FileStore {self._path!r}") from None

    def _add(self, key: str, amount: int) -> int:
        with self._log.locked(exclusive=True):
            return self._log.write_add(key.encode(), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        bkey = key.encode()
        with self._log.locked(exclusive=True):
            current = self._log.kv.data.get(bkey)
            if (current is None and not expected) or current == expected:
                self._log.write_set(bkey, desired)
                return desired
            return expected if current is None else current

    def _check(self, keys: list[str]) -> bool:
        with self._log.locked(exclusive=False):
            return self._log.kv.check([k.encode() for k in keys])

    def _delete_key(self, key: str) -> bool:
        bkey = key.encode()
        with self._log.locked(exclusive=True):
            if bkey not in self._log.kv.data and not self._log.kv.queue_len(bkey):
                return False
            self._log.append([w.encode_frame(w.REC_DELETE, [bkey])])
            return self._log.kv.delete(bkey)

    def _num_keys(self) -> int:
        # + 1: torch's FileStore counts its own bookkeeping key (the open/close count,
        # which this log keeps as records), and ported code compares with that count
        with self._log.locked(exclusive=False):
            return self._log.kv.num_keys() + 1

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        bkeys = [k.encode() for k in keys]
        with self._log.locked(exclusive=True):
            self._log.append([w.encode_frame(w.SET, [k, v]) for k, v in zip(bkeys, values)])
            for k, v in zip(bkeys, values):
                self._log.kv.set(k, v)

    def _append(self, key: str, value: bytes) -> None:
        bkey = key.encode()
        with self._log.locked(exclusive=True):
            self._log.append([w.encode_frame(w.APPEND, [bkey, value])])
            self._log.kv.append(bkey, value)

    def _queue_push(self, key: str, value: bytes) -> None:
        bkey = key.encode()
        with self._log.locked(exclusive=True):
            self._log.append([w.encode_frame(w.QPUSH, [bkey, value])])
            self._log.kv.queue_push(bkey, value)

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        bkey = key.encode()

        def pop() -> bytes | None:
            if not self._log.kv.queue_len(bkey):
                return None
            self._log.append([w.encode_frame(w.REC_QPOP, [bkey])])
            return self._log.kv.queue_pop_now(bkey)

        if timeout is None:
            with self._log.locked(exclusive=True):
                got = pop()
            if got is None:
                raise queue_empty_error(key, f"FileStore {self._path!r}")
            return got
        try:
            value = self._poll(pop, timeout, exclusive=True)
        except TimeoutError:
            raise timeout_error("queue_pop", [key], [key], timeout,
                                f"FileStore {self._path!r}") from None
        assert isinstance(value, bytes)
        return value

    def _queue_len(self, key: str) -> int:
        with self._log.locked(exclusive=False):
            return self._log.kv.queue_len(key.encode())

    def _list_keys(self) -> list[str]:
        with self._log.locked(exclusive=False):
            return [k.decode() for k in self._log.kv.list_keys()]

