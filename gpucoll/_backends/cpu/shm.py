"""A shared-memory segment for the ranks of one group on one host, and its flags.

Layout (all offsets 4096-aligned after the control block)::

    control   one 256-byte record per rank: progress counter, the peer it sleeps on,
              two op headers (sequence, signature) by parity, the CPU it last waited on,
              the address of its array in a single-copy op
    small     2 slots per rank (by op parity), ``small_bytes`` each
    bulk      2 buffers per rank (pipelined blocks), ``bulk_bytes`` each

Each rank writes only its own record, slots and buffers; peers only read them. A
rank publishes progress by raising its counter after writing data (plain stores,
which x86-64 keeps in order), and peers wait for ``counter >= target``: first by
spinning (the ~µs path when every rank has a core), then by sleeping on a futex on
the counter's word, which the writer wakes when a peer has said it sleeps there. The
spin adapts to a crowded machine (see :meth:`ShmSegment.wait`).

Life cycle: rank 0 publishes the segment's name, then creates the file under
/dev/shm (mode 0600); every rank maps it, checking first that this user owns it and
nobody else may open it. It is unlinked as soon as every rank has mapped it (by the
last to map it, and by rank 0), so nothing is left behind if every process is killed
later. A rank that fails during setup (rank 0 died half-way) unlinks the name it
learned; and rank 0 removes segments left by creators that died before they could
publish a name (the name holds the creator's pid namespace and pid).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from typing import Any, Callable

import numpy as np

from ...errors import DistBackendError, DistStoreTimeoutError
from .segments import PREFIX as _PREFIX, new_name, sweep_orphans, unlink_ours as _unlink

__all__ = ["ShmSegment", "ShmUnavailable", "REC_WORDS", "ADDR", "futex_wait", "futex_wake", "map_segment", "get_while_alive",
           "wait_policy"]

REC_WORDS = 32  # u64 words per rank record (256 bytes: no false sharing between ranks)
_CTR, _SLEEP, _HDR, _CPU = 0, 1, 2, 6  # word offsets in a record; headers at 2..5
ADDR = 7  # word offsets 7, 8: the address of the rank's array in a single-copy op (cma.py) and the op's number
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the word is shared between processes
_EAGAIN, _EINTR, _ETIMEDOUT = 11, 4, 110
SPIN_SECONDS = 20e-6  # a wait's spin on a busy machine (see ShmSegment.wait)
SPIN_REGAIN = 0.1e-6  # spin budget given back by each wait that ended while spinning
PREEMPTED_SECONDS = 30e-6  # a gap this long between two checks of a spin: it was preempted
YIELD_SECONDS = 1e-3  # the longest a crowded group's wait yields its CPU before it spins and sleeps
SPIN_CORE_EACH = 200e-6  # a wait's spin budget where each rank has a core (see wait_policy)
YIELDS = 32  # sched_yield()s a crowded group's wait tries first (see wait_policy)


def _running() -> int:
    """Runnable processes on the machine right now (/proc/loadavg's fourth field); 0 if unknown."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def wait_policy(store: Any, rank: int, size: int, timeout: float,
                gone: Callable[[int], str | None]) -> tuple[float, int]:
    """How the group's waits wait: ``(spin_seconds, yields)`` for :class:`ShmSegment`.

    The spin budget: ``SPIN_CORE_EACH``, or ``SPIN_SECONDS`` where this rank may run on
    fewer CPUs than the group has ranks. The yield phase: ``YIELDS`` only where the
    ranks together may run on fewer CPUs than there are ranks (each rank publishes its
    affinity under ``shm/cpus/`` in ``store``); not where each is bound to a CPU of its
    own, where a yield beside a busy process hands it the CPU for a whole time slice.
    """
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = list(range(os.cpu_count() or 1))
    store.set(f"shm/cpus/{rank}", ",".join(map(str, mine)).encode())
    deadline = time.monotonic() + timeout
    cpus = set(mine)
    for peer in range(size):
        if peer != rank:
            cpus.update(int(c) for c in get_while_alive(store, f"shm/cpus/{peer}", deadline, peer, gone).split(","))
    return (SPIN_CORE_EACH if size <= len(mine) else SPIN_SECONDS), (YIELDS if size > len(cpus) else 0)


class ShmUnavailable(Exception):
    """The group's segment could not be created or mapped by some rank (every rank raises it)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _no_cpu() -> int:
    return -1


_getcpu: Callable[[], int] = getattr(_libc, "sched_getcpu", None) or _no_cpu  # -1: unknown
if _getcpu is not _no_cpu:
    _getcpu.restype = ctypes.c_int  # type: ignore[attr-defined]
    _getcpu.argtypes = []  # type: ignore[attr-defined]


def futex_wait(addr: int, expected: int, seconds: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected``, at most ``seconds``.

    Returns on a wake, a timeout, a signal, or when the word already differs.
    """
    ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the 32-bit word at ``addr``."""
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
             ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))


class ShmSegment:
    """The mapped segment and its progress flags, seen from one rank.

    Args:
        store: the group's store (segment name and "mapped" marks go through it).
        rank, size: this rank and the group size.
        small_bytes: bytes per small slot.
        bulk_bytes: bytes per bulk buffer.
        timeout: seconds to wait for every rank to map the segment.
        spin_seconds: how long a wait spins before it sleeps.
        yields: how many times a wait yields its CPU (``sched_yield``) before it spins, for
            at most ``YIELD_SECONDS``; 0 (none) unless the group has more ranks than CPUs.
    """

    def __init__(self, store: Any, rank: int, size: int, *, small_bytes: int, bulk_bytes: int,
                 timeout: float, spin_seconds: float, gone: Callable[[int], str | None] | None = None,
                 yields: int = 0) -> None:
        self.rank = rank
        self.size = size
        self.small_bytes = small_bytes
        self.bulk_bytes = bulk_bytes
        self.spin_seconds = spin_seconds
        self.spin_now = spin_seconds  # the adaptive budget (see wait)
        self._yields = range(yields)  # a wait's first phase (see wait)
        self._cpus = os.cpu_count() or 1
        self._my_cpu = rank * REC_WORDS + _CPU
        self._crowd_at, self._crowd = -1.0, False  # when /proc/loadavg was last read, what it said
        ctl = _round(size * REC_WORDS * 8)
        self._small_off = ctl
        self._bulk_off = ctl + 2 * size * small_bytes
        total = self._bulk_off + 2 * size * bulk_bytes
        self.waiting_for: int | None = None  # the peer a sleeping wait waits for (timeout messages)
        self.timed_out_on: int | None = None  # the peer a wait gave up on (it ran out of time)
        self._mm, self.path = map_segment(store, rank, size, total, timeout, gone or (lambda peer: None))
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self._base = ctypes.addressof(self._anchor)
        self._mv = memoryview(self._mm)
        self.ctl = self._mv[:ctl].cast("Q")
        self.raw = np.frombuffer(self._mm, dtype=np.uint8)
        self.count = 0  # this rank's counter value (the only writer)
        self._my_ctr = rank * REC_WORDS + _CTR
        self._my_addr = self._base + self._my_ctr * 8
        self._mark = rank + 1  # what a peer sleeping on this rank's counter writes in its record
        self._sleep_words = [w * REC_WORDS + _SLEEP for w in range(size) if w != rank]
        self._small = [[self.raw[o:o + small_bytes] for o in (self._small_off + (2 * r + p) * small_bytes
                                                             for p in (0, 1))] for r in range(size)]
        self._bulk = [[self.raw[o:o + bulk_bytes] for o in (self._bulk_off + (2 * r + b) * bulk_bytes
                                                           for b in (0, 1))] for r in range(size)]
        self._error: BaseException | None = None

    # ----- data areas -----
    def small(self, rank: int, parity: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Rank ``rank``'s small slot of this parity."""
        return self._small[rank][parity]

    def bulk(self, rank: int, buf: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Rank ``rank``'s bulk buffer ``buf`` (0 or 1)."""
        return self._bulk[rank][buf]

    # ----- headers -----
    def write_header(self, parity: int, op: int, sig: int) -> None:
        i = self.rank * REC_WORDS + _HDR + 2 * parity
        self.ctl[i] = op
        self.ctl[i + 1] = sig

    def header(self, rank: int, parity: int) -> tuple[int, int]:
        i = rank * REC_WORDS + _HDR + 2 * parity
        return self.ctl[i], self.ctl[i + 1]

    # ----- progress -----
    def counter(self, rank: int) -> int:
        v: int = self.ctl[rank * REC_WORDS + _CTR]
        return v

    def post(self) -> None:
        """Raise this rank's counter by one and wake peers sleeping on it."""
        count = self.count = self.count + 1
        ctl = self.ctl
        ctl[self._my_ctr] = count
        mark = self._mark
        for w in self._sleep_words:
            if ctl[w] == mark:
                futex_wake(self._my_addr)
                return

    def wait(self, peer: int, target: int, deadline: float, check: Callable[[], None],
             what: Callable[[], str]) -> None:
        """Block until ``peer``'s counter reaches ``target``.

        Raises:
            DistBackendError: aborted (``check`` raises), or past ``deadline`` (monotonic).
        """
        ctl = self.ctl
        idx = peer * REC_WORDS + _CTR
        if ctl[idx] >= target:
            return
        if self._yields:
            # More ranks than CPUs: the peer is likely waiting for a CPU, perhaps this
            # one. Hand it over (sched_yield) while the peer comes within moments,
            # before a spin (which would hold the CPU) or a sleep (whose wake-up costs
            # a system call on the peer and a scheduling delay here).
            end = time.perf_counter() + YIELD_SECONDS
            for _ in self._yields:
                os.sched_yield()
                if ctl[idx] >= target:
                    return
                if time.perf_counter() > end:
                    break
        # Spin, then sleep on the peer's counter (a futex). How long to spin adapts: with
        # more runnable processes than cores, every µs a waiter spins is a µs its peer
        # may not run, so a spin that was preempted (a gap between two checks: another
        # process wanted this core), or one that ran out while the machine is crowded,
        # cuts the budget to SPIN_SECONDS; each wait that ends while spinning gives back
        # a little of it, up to ``spin_seconds``. A peer that is merely slow (copying a
        # large block on an idle machine) costs a sleep, not the budget.
        now = time.perf_counter
        budget = self.spin_now
        # Where each rank last waited: a peer last seen on this very CPU cannot run while
        # this rank spins there (the scheduler keeps it queued behind us), so yield the
        # CPU to it once and then sleep, without spinning.
        cpu = _getcpu() + 1
        if cpu > 0:
            ctl[self._my_cpu] = cpu
            if ctl[peer * REC_WORDS + _CPU] == cpu:
                budget = 0.0
                os.sched_yield()
        prev = now()
        spin_until = prev + budget
        while ctl[idx] < target:
            t = now()
            if t - prev > PREEMPTED_SECONDS:
                self.spin_now = min(SPIN_SECONDS, self.spin_seconds)
                break
            if t > spin_until:
                break
            prev = t
        else:
            if self.spin_now < self.spin_seconds:  # (not ``budget``: 0 after a yield to the peer)
                self.spin_now += SPIN_REGAIN
            return
        if budget > SPIN_SECONDS and self._crowded():
            self.spin_now = min(SPIN_SECONDS, self.spin_seconds)
        me = self.rank * REC_WORDS + _SLEEP
        addr = self._base + idx * 8
        self.waiting_for = peer
        try:
            while True:
                ctl[me] = peer + 1
                cur = ctl[idx]
                if cur >= target:
                    return  # progress wins over errors: a peer may post and then leave
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timed_out_on = peer
                    raise DistBackendError(f"{what()}: timed out waiting for rank {peer} "
                                           f"(its progress {cur}, needed {target})")
                # Short sleeps bound the cost of a wake that raced with going to sleep.
                futex_wait(addr, cur, min(left, 0.02))
        finally:
            ctl[me] = 0
            self.waiting_for = None

    def _crowded(self) -> bool:
        """More runnable processes than CPUs (read at most every 10 ms): on such a machine a
        spinning waiter holds a core that others, its peer perhaps, need."""
        t = time.monotonic()
        if t - self._crowd_at >= 0.01:
            self._crowd_at = t
            self._crowd = _running() > self._cpus
        return self._crowd

    def wake_all(self) -> None:
        """Wake every sleeper on every counter (abort: sleepers then see the error)."""
        for r in range(self.size):
            futex_wake(self._base + r * REC_WORDS * 8)

    def close(self) -> None:
        """Unmap the segment (deferred to process exit if an array view is still alive)."""
        self.raw = np.empty(0, np.uint8)
        self._small = self._bulk = []
        del self._anchor
        for view in (self.ctl, self._mv):
            try:
                view.release()
            except (BufferError, ValueError):
                pass
        try:
            self._mm.close()
        except BufferError:
            pass


def _round(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


_SLICE = 0.2  # seconds between liveness checks while waiting on the store


def get_while_alive(store: Any, key: str, deadline: float, peer: int, gone: Callable[[int], str | None]) -> str:
    """``store.get(key)``, failing within moments once ``peer`` is known dead.

    A key already there wins over the peer's death: a fast peer may finish setting up,
    run an op, fail it and leave while a slow rank is still reading its last key (the key
    is looked for again once the peer is seen gone: it may have set it, finished and left
    between the first look and that news)."""
    while True:
        if store.check([key]):
            value: str = store.get(key).decode()
            return value
        why = gone(peer)
        if why is not None:
            try:
                if store.check([key]):
                    late: str = store.get(key).decode()
                    return late
            except Exception:  # the store left with the peer: its death is the error to name
                pass
            raise DistBackendError(f"rank {peer} {why} while the shared-memory segment was set up")
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistBackendError(f"rank {peer} did not take part in setting up the shared-memory segment "
                                   f"(no {key!r} in the store in time)")
        try:
            store.wait([key], min(_SLICE, left))
        except DistStoreTimeoutError:
            continue


def map_segment(store: Any, rank: int, size: int, total: int, timeout: float,
                gone: Callable[[int], str | None]) -> tuple[mmap.mmap, str]:
    """Create (rank 0) or open a zeroed segment of ``total`` bytes, through ``store``; every
    rank learns whether all of them mapped it (:class:`ShmSegment`'s, and the jit channel's).

    Raises:
        ShmUnavailable: some rank could not create or map it (on every rank alike).
        DistBackendError: a rank did not report within ``timeout``, or died.
    """
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm: mmap.mmap | None = None
    deadline = time.monotonic() + timeout
    if rank == 0:
        sweep_orphans()
        path = new_name()
        store.set("shm/name", path.encode())  # first: whoever learns the name can remove the file
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                os.ftruncate(fd, total)
                # Reserve the pages now: on a full tmpfs this fails here with ENOSPC,
                # instead of a SIGBUS at first touch in the middle of a collective.
                os.posix_fallocate(fd, 0, total)
                mm = mmap.mmap(fd, total, flags=flags)
            finally:
                os.close(fd)
        except OSError as exc:
            problems = [f"rank 0 could not create {total} bytes at {path}: {exc}"]
            store.set("shm/created", ("!" + problems[0]).encode())
        else:
            problems = []
            store.set("shm/created", b"1")
            _count_mapped(store, size, path)
        try:
            for peer in range(1, size):
                mark = get_while_alive(store, f"shm/mapped/{peer}", deadline, peer, gone)
                if mark not in ("1", "0"):  # "0": gave up because rank 0 failed
                    problems.append(mark)
        finally:
            _unlink(path)
        store.set("shm/ready", ("!" + "; ".join(problems)).encode() if problems else b"1")
    else:
        path = get_while_alive(store, "shm/name", deadline, 0, gone)
        try:
            created = get_while_alive(store, "shm/created", deadline, 0, gone)
            if created != "1":
                store.set(f"shm/mapped/{rank}", b"0")
            else:
                try:
                    mm = _open_ours(path, total, flags)
                    store.set(f"shm/mapped/{rank}", b"1")
                    _count_mapped(store, size, path)
                except OSError as exc:
                    store.set(f"shm/mapped/{rank}", f"rank {rank} could not map {path}: {exc}".encode())
            ready = get_while_alive(store, "shm/ready", deadline, 0, gone)
        except BaseException:
            _unlink(path)  # rank 0 died half-way: do not leave its segment behind
            if mm is not None:
                mm.close()
            raise
    if rank == 0:
        ready = store.get("shm/ready").decode()
    if ready != "1" or mm is None:
        if mm is not None:
            mm.close()
        raise ShmUnavailable(ready.lstrip("!") or "the segment could not be mapped")
    return mm, path


def _count_mapped(store: Any, size: int, path: str) -> None:
    if store.add("shm/mapped_count", 1) >= size:
        _unlink(path)  # the last rank to map it: nobody needs the name any more


def _open_ours(path: str, total: int, flags: int) -> mmap.mmap:
    """Map an existing segment, refusing one that is not this user's alone."""
    if not path.startswith(_PREFIX) or "/" in path[len(_PREFIX):]:
        raise OSError(f"{path!r} is not a gpucoll shared-memory segment name")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{path} belongs to uid {st.st_uid} with mode {st.st_mode & 0o777:o}; "
                          f"expected uid {os.getuid()} and mode 600")
        if st.st_size < total:
            raise OSError(f"{path} holds {st.st_size} bytes; expected {total}")
        return mmap.mmap(fd, total, flags=flags)
    finally:
        os.close(fd)
