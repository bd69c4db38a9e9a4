"""FileStore's log file: opening it safely, its header, its users, replaying it.

Layout: a header, then records in the wire's frame encoding (``_wire``)::

    b"gpucoll-filestore-2\\n"           format and version
    16 bytes creation id               new for every log (and every fresh start)
    i32 world_size (-1: none)          of the job that created it
    u32 creator pid, f64 creation time (seconds since the epoch)

Every open store is registered in the log under a hidden key (its process's pid,
start time and machine) and deleted from it on close; ``closed`` counts closes. That
is what tells a second job (more live processes than the header's world_size, or
another world_size) from a job's own ranks, and a file left by a killed or finished
job (no live user) that can be started afresh.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, NamedTuple

from .._timeouts import Backoff
from ..errors import DistStoreError
from . import _wire as w
from ._fileusers import User, proven_dead
from . import _fileusers
from ._kv import HIDDEN_PREFIX, KVState

__all__ = ["FileLog"]

MAGIC: Final = b"gpucoll-filestore-"
LINE: Final = MAGIC + b"2\n"
_FIELDS: Final = struct.Struct("<16siId")
HEADER_LEN: Final = len(LINE) + _FIELDS.size
USER_PREFIX: Final = HIDDEN_PREFIX + b"filestore/user/"
CLOSED: Final = HIDDEN_PREFIX + b"filestore/closed"
# One key per process that ever joined the log (never deleted): once world_size processes
# have joined, the job is complete and a process outside it is another job.
JOINED_PREFIX: Final = HIDDEN_PREFIX + b"filestore/joined/"
# Record code -> number of fields (the only records a log holds).
_ARITY: Final = {w.SET: 2, w.APPEND: 2, w.QPUSH: 2, w.REC_QPOP: 1, w.REC_DELETE: 1}

# Per thread: how many FileStore file locks it holds. A store collected by the garbage
# collector while its thread holds another store's lock on the same file must not
# block on the file lock (two descriptions of one file exclude each other even in
# one process), so its close moves to a helper thread.
_held = threading.local()


class Header(NamedTuple):
    creation_id: bytes
    world_size: int | None
    creator_pid: int
    created: float


def _open(path: str) -> tuple[int, bool]:
    """Open ``path`` as a log: create it (0600, O_EXCL) or open an existing regular file
    owned by this user. Never follows a symbolic link; never opens a device."""
    base = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    for _ in range(10):
        try:
            return os.open(path, base | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600), True
        except FileExistsError:
            pass
        except OSError as e:
            raise DistStoreError(f"FileStore cannot create {path!r}: {e}") from e
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # removed between the two calls: try creating it again
        except OSError as e:
            raise DistStoreError(f"FileStore cannot stat {path!r}: {e}") from e
        check_file(path, st)
        try:
            fd = os.open(path, base | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise DistStoreError(f"FileStore cannot open {path!r}: {e}") from e
        try:
            st2 = os.fstat(fd)
            check_file(path, st2)
            if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
                raise DistStoreError(f"FileStore {path!r} was replaced while being opened")
            # O_NONBLOCK only guarded the open; clear it for the regular file.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd, False
    raise DistStoreError(f"FileStore cannot open {path!r}: it keeps being created and removed")


def check_file(path: str, st: os.stat_result) -> None:
    """Raise DistStoreError unless ``st`` is a regular file owned by this user."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        raise DistStoreError(f"FileStore refuses {path!r}: it is a symbolic link (give the real path)")
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise DistStoreError(f"FileStore refuses {path!r}: it is {kind}, not a regular file")
    if st.st_uid != os.geteuid():
        raise DistStoreError(f"FileStore refuses {path!r}: it is owned by uid {st.st_uid}, not by this "
                             f"user (uid {os.geteuid()}); another user could read and write its keys")


def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class FileLog:
    """One store's open log: its descriptor, replayed state and registration.

    Holds no reference to its FileStore, so a finalizer can close it after the store
    is garbage-collected.
    """

    def __init__(self, path: str, world_size: int | None, lock_timeout: float = 300.0) -> None:
        self.path = path
        self.lock_timeout = lock_timeout
        """Seconds to wait for the file lock before failing (the store's timeout)."""
        self.world_size = world_size
        self.kv = KVState()
        self.offset = 0
        self.fd = -1
        self.tlock = threading.RLock()
        self.header: Header | None = None
        self.pid = os.getpid()
        self.me = _fileusers.me()
        self.user_key = USER_PREFIX + os.urandom(8).hex().encode()
        self.fresh_start: str | None = None
        """Why the log was started afresh over a file left by an earlier job, or None."""
        for _ in range(10):
            fd, created = _open(path)
            self.fd = fd
            try:
                self._flock(fcntl.LOCK_EX)
                try:
                    if same_file(path, fd):
                        self._join(created)
                        return
                finally:
                    self._flock(fcntl.LOCK_UN)
            except BaseException:
                os.close(fd)
                self.fd = -1
                raise
            # The last store of the previous job removed it before we got the lock.
            os.close(fd)
            self.fd = -1
            self.kv, self.offset, self.header = KVState(), 0, None
        raise DistStoreError(f"FileStore cannot open {path!r}: it keeps being removed")

    # -- locking --------------------------------------------------------------------------

    def _flock(self, op: int) -> None:
        """Take (or, with LOCK_UN, release) the file lock, waiting at most lock_timeout:
        a process stopped or stuck while it holds the lock must not block every other
        one for good."""
        try:
            if op == fcntl.LOCK_UN:
                fcntl.flock(self.fd, op)
                return
            try:
                fcntl.flock(self.fd, op | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            # Busy: poll, starting fast (a holder keeps it for microseconds) and backing
            # off to a few milliseconds; every waiter polls the same way.
            wait = Backoff(self.lock_timeout, first=_LOCK_POLL_MIN, cap=_LOCK_POLL_MAX)
            while True:
                if not wait.sleep():
                    raise DistStoreError(
                        f"FileStore could not lock {self.path!r} within {self.lock_timeout:g} s: "
                        f"{_fileusers.lock_holders(self.fd)} holds it (stopped, stuck, or a very long "
                        f"operation); the store's timeout bounds this wait")
                try:
                    fcntl.flock(self.fd, op | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    continue
        except OSError as e:
            raise DistStoreError(f"FileStore cannot lock {self.path!r}: {e}") from e

    @contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the file lock, caught up with the log."""
        with self.tlock:
            if self.fd < 0:
                raise DistStoreError(f"FileStore {self.path!r} is closed")
            self._flock(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            _held.n = getattr(_held, "n", 0) + 1
            try:
                self.sync(exclusive)
                yield
            finally:
                _held.n -= 1
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    # -- header and users (under the exclusive lock) --------------------------------------

    def _join(self, created: bool) -> None:
        size = os.fstat(self.fd).st_size
        if size == 0:
            if not created:
                os.fchmod(self.fd, 0o600)  # an empty file of ours (mkstemp, touch): keep it private
            self._write_header()
        else:
            head = os.pread(self.fd, HEADER_LEN, 0)
            if len(head) < HEADER_LEN and LINE.startswith(head[:len(LINE)]) and (
                    len(head) <= len(LINE) or head.startswith(LINE)):
                self._start_fresh("its creator died while writing its header")
            else:
                self.header = self._parse_header(head)
                self.offset = HEADER_LEN
                self.sync(True)
                self._admit()
        self.write_set(self.user_key, "\n".join(
            (self.me.machine, str(self.me.pid), self.me.start, self.me.host)).encode())
        if self._joined_key() not in self.kv.data:
            self.write_set(self._joined_key(), b"")

    def _joined_key(self) -> bytes:
        me = self.me
        return JOINED_PREFIX + f"{me.machine}/{me.pid}/{me.start}/{me.host}".encode()

    def _parse_header(self, head: bytes) -> Header:
        if not head.startswith(MAGIC):
            raise DistStoreError(f"FileStore refuses {self.path!r}: it is not a gpucoll FileStore log "
                                 f"(it starts with {head[:24]!r}); it was left untouched")
        if not head.startswith(LINE):
            raise DistStoreError(f"FileStore {self.path!r} was written by another gpucoll version "
                                 f"(header {head[:len(LINE) + 2]!r}; this one reads {LINE!r})")
        cid, ws, pid, created = _FIELDS.unpack_from(head, len(LINE))
        return Header(cid, None if ws < 0 else ws, pid, created)

    def users(self) -> dict[bytes, User]:
        out = {}
        for key, value in self.kv.data.items():
            if key.startswith(USER_PREFIX):
                parts = value.decode(errors="replace").split("\n")
                if len(parts) == 4 and parts[1].isdigit():
                    out[key] = User(parts[0], int(parts[1]), parts[2], parts[3])
                else:
                    out[key] = User("", 0, "", "?")
        return out

    def _admit(self) -> None:
        """Decide, for an existing log, between joining it, starting fresh, and refusing."""
        assert self.header is not None
        hdr = self.header
        users = self.users()
        machine = self.me.machine
        dead = [u for u in users.values() if proven_dead(u, machine)]
        live = [u for u in users.values() if not proven_dead(u, machine)]
        closed = int(self.kv.data.get(CLOSED, b"0") or b"0")
        if not live:
            if dead:
                self._start_fresh("every process that had it open is gone without closing it ("
                                  + ", ".join(u.describe() for u in dead[:8]) + ")")
                return
            if hdr.world_size is None or closed >= hdr.world_size:
                # Every member closed it, yet the file is still here (its removal failed, or
                # it was copied back): reading on would hand this job the last one's keys.
                raise DistStoreError(
                    f"FileStore {self.path!r} holds the log of a job that has finished: "
                    + (f"its {closed} stores all closed it" if hdr.world_size is None else
                       f"{closed} stores of world_size={hdr.world_size} closed it")
                    + f" (created by pid {hdr.creator_pid}, {_ago(hdr.created)}). It was left "
                    "untouched: remove it, or use a fresh path per job")
        if self.world_size is not None and hdr.world_size is not None and hdr.world_size != self.world_size:
            raise DistStoreError(
                f"FileStore {self.path!r} belongs to another job: it was created with world_size="
                f"{hdr.world_size} (by pid {hdr.creator_pid}, {_ago(hdr.created)}) and is open in "
                f"{_fileusers.procs(live)}; this store has world_size={self.world_size}. Use a fresh path per job")
        procs = {(u.machine, u.host, u.pid) for u in live} | {(machine, self.me.host, self.me.pid)}
        if hdr.world_size is not None and len(procs) > hdr.world_size:
            raise DistStoreError(
                f"FileStore {self.path!r} is in use by another job: its world_size is {hdr.world_size} "
                f"and {_fileusers.procs(live)} already have it open (created by pid {hdr.creator_pid}, "
                f"{_ago(hdr.created)}). Use a fresh path per job")
        joined = sum(1 for k in self.kv.data if k.startswith(JOINED_PREFIX))
        if hdr.world_size is not None and joined >= hdr.world_size and self._joined_key() not in self.kv.data:
            # All world_size members have joined (some may have closed already): this
            # process is not one of them, and must not read their keys.
            raise DistStoreError(
                f"FileStore {self.path!r} is in use by another job: its world_size is {hdr.world_size} "
                f"and all {joined} of its processes have joined it ({_fileusers.procs(live)} still "
                f"{'has' if len(live) == 1 else 'have'} it open; created by pid {hdr.creator_pid}, "
                f"{_ago(hdr.created)}). Use a fresh path per job")

    def _start_fresh(self, why: str) -> None:
        """Empty a log nobody uses any more (ours: checked on open) and write a new header."""
        os.ftruncate(self.fd, 0)
        self.kv, self.offset = KVState(), 0
        self._write_header()
        self.fresh_start = f"FileStore {self.path!r} started afresh: {why}"

    def _write_header(self) -> None:
        ws = -1 if self.world_size is None else self.world_size
        self.header = Header(os.urandom(16), self.world_size, self.me.pid, time.time())
        data = LINE + _FIELDS.pack(self.header.creation_id, ws, self.me.pid, self.header.created)
        self.offset = 0
        self._write_records([data])

    # -- the log ---------------------------------------------------------------------------

    def sync(self, exclusive: bool) -> None:
        """Replay what other processes appended since the last read (under a lock)."""
        try:
            size = os.fstat(self.fd).st_size
            if size < self.offset:
                raise DistStoreError(
                    f"FileStore {self.path!r} shrank from {self.offset} to {size} bytes under this store: "
                    "another job started afresh on it or something else truncated it")
            if size == self.offset:
                return
            data = os.pread(self.fd, size - self.offset, self.offset)
        except OSError as e:
            raise DistStoreError(f"FileStore cannot read {self.path!r}: {e}") from e
        pos = self._replay(data)
        if pos < len(data) and exclusive:
            # A writer died mid-record: cut the torn tail so the log stays parseable.
            os.ftruncate(self.fd, self.offset + pos)
        self.offset += pos

    def _corrupt(self, pos: int, what: str) -> DistStoreError:
        return DistStoreError(f"FileStore {self.path!r} is corrupt at byte {self.offset + pos}: {what}; "
                              "the records after it cannot be read")

    def _replay(self, data: bytes) -> int:
        """Apply every complete record of ``data``; return how many bytes they took.

        Only the last record may be incomplete (a writer that died while appending),
        and only if its fields are a prefix of a record of its declared length;
        anything else is corruption, reported with its byte offset."""
        pos, n, kv = 0, len(data), self.kv
        unpack = w.U32.unpack_from
        while pos < n:
            if n - pos < 5:
                if n - pos >= 4 and unpack(data, pos)[0] == 0:
                    raise self._corrupt(pos, "a record of length 0")
                break
            (length,) = unpack(data, pos)
            if length == 0:
                raise self._corrupt(pos, "a record of length 0")
            code = data[pos + 4]
            arity = _ARITY.get(code)
            if arity is None:
                raise self._corrupt(pos, f"unknown record code {code} (record length {length})")
            end = pos + 4 + length
            if end > n:
                self._check_torn(data, pos, length, arity)
                break
            try:
                f = w.decode_fields(data, pos + 5, end)
            except w.ProtocolError as e:
                raise self._corrupt(pos, f"record of {length} bytes: {e}") from None
            if len(f) != arity:
                raise self._corrupt(pos, f"record of {length} bytes has {len(f)} fields, not {arity}")
            if code == w.SET:
                kv.set(f[0], f[1])
            elif code == w.APPEND:
                kv.append(f[0], f[1])
            elif code == w.QPUSH:
                kv.queue_push(f[0], f[1])
            elif code == w.REC_QPOP:
                kv.queue_pop_now(f[0])
            else:
                kv.delete(f[0])
            pos = end
        return pos

    def _check_torn(self, data: bytes, pos: int, length: int, arity: int) -> None:
        """Raise unless the record at ``pos`` (running past the end) is a cut-short one."""
        n = len(data)
        used, at = 1, pos + 5
        for _ in range(arity):
            if n - at < 4:
                return  # cut inside a field header
            (flen,) = w.U32.unpack_from(data, at)
            used += 4 + flen
            if used > length:
                raise self._corrupt(pos, f"a record declaring {length} bytes holds a field of {flen} "
                                         "bytes that runs past it")
            at += 4 + flen
            if at > n:
                return  # cut inside a field
        raise self._corrupt(pos, f"a record declaring {length} bytes (past the end of the file at byte "
                                 f"{self.offset + n}) whose fields take {used}")

    def _write_records(self, records: list[bytes]) -> None:
        data = b"".join(records)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            raise DistStoreError(f"FileStore cannot write {self.path!r}: {e}") from e
        # We hold the exclusive lock and were caught up, so the records landed at offset.
        self.offset += len(data)

    def append(self, records: list[bytes]) -> None:
        self._write_records(records)

    def write_set(self, key: bytes, value: bytes) -> None:
        self._write_records([w.encode_frame(w.SET, [key, value])])
        self.kv.set(key, value)

    def write_add(self, key: bytes, amount: int) -> int:
        current = self.kv.data.get(key)
        total = self.kv.add(key, amount)  # raises before anything is written
        try:
            self._write_records([w.encode_frame(w.SET, [key, str(total).encode()])])
        except BaseException:
            if current is None:
                self.kv.delete(key)
            else:
                self.kv.set(key, current)
            raise
        return total

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Count this store out; remove the file when it was the last one (see FileStore)."""
        with self.tlock:
            if self.fd < 0:
                return
            if os.getpid() != self.pid:
                # A forked child's copy: the parent's store is still open; only drop the fd.
                os.close(self.fd)
                self.fd = -1
                return
            try:
                self._flock(fcntl.LOCK_EX)
            except DistStoreError:
                os.close(self.fd)
                self.fd = -1
                raise
            try:
                self.sync(True)
                self._write_records([w.encode_frame(w.REC_DELETE, [self.user_key])])
                self.kv.delete(self.user_key)
                closed = self.write_add(CLOSED, 1)
                machine = self.me.machine
                users = sum(1 for u in self.users().values() if not proven_dead(u, machine))
                ws = self.world_size if self.world_size is not None else (
                    self.header.world_size if self.header else None)
                if users == 0 and (ws is None or closed >= ws) and same_file(self.path, self.fd):
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
                self.fd = -1


def finalize(log: FileLog) -> None:
    """Close ``log`` after its FileStore was garbage-collected (or at interpreter exit)."""
    try:
        if not getattr(_held, "n", 0):
            log.close()
        else:
            threading.Thread(target=_close_quietly, args=(log,), name="gpucoll-filestore-close",
                             daemon=True).start()
    except Exception:  # noqa: BLE001 - a finalizer has no caller to tell
        pass


def _close_quietly(log: FileLog) -> None:
    try:
        log.close()
    except Exception:  # noqa: BLE001
        pass


_LOCK_POLL_MIN = 50e-6
_LOCK_POLL_MAX = 5e-3


def _ago(t: float) -> str:
    return f"{max(0.0, time.time() - t):.0f} s ago"

