"""Single-copy access to a peer process's memory: Linux cross-memory attach
(``process_vm_readv`` and ``process_vm_writev``).

A large shared-memory all_reduce can read each peer's array where it lies, and write the
folded result back into it, instead of having every rank copy its data into the shared
segment and the peers copy it out again (Open MPI's shared-memory transport moves large
messages the same way). The kernel allows it between processes of the same user unless
ptrace is restricted (Yama's ``ptrace_scope`` >= 1 without a ptracer relation, containers
whose seccomp profile refuses the calls, a process that made itself non-dumpable): then a
call fails with EPERM (or ENOSYS) and the group keeps the copies through the segment.
Whether every rank may read and write every peer is decided once per group, by a probe
(:func:`agree`), so all ranks take the same algorithm.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..._env import CPU_CMA_ENV as ENV
from ...errors import DistBackendError
from .reduce import Array, Reducer
from .shm import ADDR, REC_WORDS, ShmSegment, get_while_alive
from .tcp_algos import Ctx, chunk_bounds

__all__ = ["CmaReader", "agree", "all_reduce", "readable", "read_error", "ENV", "MIN_BYTES", "CHUNK", "GRACE"]

# The smallest all_reduce that reads the peers' arrays directly. Below it the pipeline
# through the segment's bulk buffers is faster (2 and 4 ranks, 2026-11-28, A/B in the same
# runs: 1 MiB took 1.2-1.6x its time single-copy, 2 MiB about the same, 4 MiB 0.88-0.93x,
# 16 MiB 0.6-0.8x, 64 MiB 0.8x).
MIN_BYTES = 4 << 20
CHUNK = 512 * 1024  # bytes of each peer read per fold (the scratch stays in L2; 256 KiB and 1 MiB were slower)



class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv: Any = getattr(_libc, "process_vm_readv", None)
_writev: Any = getattr(_libc, "process_vm_writev", None)
for _f in (_readv, _writev):
    if _f is not None:
        _f.restype = ctypes.c_ssize_t
        _f.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                       ctypes.c_ulong, ctypes.c_ulong]


class CmaReader:
    """Reads from and writes to the peers' address spaces (one thread at a time: the iovecs are reused).

    Args:
        pids: each rank's process id (this rank's own entry is unused).
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._local = _Iovec()
        self._remote = _Iovec()
        self._lp = ctypes.byref(self._local)
        self._rp = ctypes.byref(self._remote)

    def read(self, peer: int, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` of rank ``peer``'s process to ``dst`` here.

        Raises:
            OSError: the kernel refused or the process is gone (errno set: ESRCH, EPERM, EFAULT).
        """
        self._move(_readv, peer, dst, src, nbytes)

    def write(self, peer: int, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` here to address ``dst`` of rank ``peer``'s process.

        Raises:
            OSError: the kernel refused or the process is gone (errno set: ESRCH, EPERM, EFAULT).
        """
        self._move(_writev, peer, src, dst, nbytes)

    def _move(self, call: Any, peer: int, here: int, there: int, nbytes: int) -> None:
        """``call`` (process_vm_readv or _writev) between ``here`` and ``there`` in rank
        ``peer``'s process, until all ``nbytes`` have moved."""
        local, remote, pid = self._local, self._remote, self.pids[peer]
        while nbytes > 0:
            local.iov_base, local.iov_len = here, nbytes
            remote.iov_base, remote.iov_len = there, nbytes
            got: int = call(pid, self._lp, 1, self._rp, 1, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else 0
                what = "process_vm_readv" if call is _readv else "process_vm_writev"
                raise OSError(err, f"{what} of {nbytes} bytes with pid {pid}: "
                                   f"{os.strerror(err) if err else 'moved nothing'}")
            here += got
            there += got
            nbytes -= got


def _refused_here() -> str | None:
    """Why this rank will not use cross-memory attach, or None."""
    if _readv is None or _writev is None:
        return "process_vm_readv or process_vm_writev is not in this C library"
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return f"{ENV}={os.environ[ENV]}"
    return None


def agree(store: Any, rank: int, size: int, timeout: float,
          gone: Callable[[int], str | None]) -> tuple[CmaReader | None, str]:
    """Decide with every rank of the group whether every rank can read and write every peer.

    Each rank publishes its pid and the address of a random word it holds; each rank
    reads every peer's word with ``process_vm_readv``, writes the same value back with
    ``process_vm_writev`` and publishes whether both worked; all use it only if all did. Keys go under ``cma/`` in the group's store.

    Returns:
        ``(reader, "")`` when every rank can, else ``(None, why)`` (the same on every rank).

    Raises:
        DistBackendError: a peer died or did not take part within ``timeout``.
    """
    if size == 1:
        return None, "a group of one rank"
    deadline = time.monotonic() + timeout
    word = ctypes.c_uint64(secrets.randbits(64))
    store.set(f"cma/{rank}", f"{os.getpid()}:{ctypes.addressof(word)}:{word.value}".encode())
    pids = [os.getpid()] * size
    why = _refused_here()
    got = ctypes.c_uint64(0)
    reader = CmaReader(pids)
    for peer in range(size):
        if peer == rank:
            continue
        pid_s, addr_s, value_s = get_while_alive(store, f"cma/{peer}", deadline, peer, gone).split(":")
        pids[peer] = int(pid_s)
        if why is None:
            got.value = 0
            try:
                reader.read(peer, ctypes.addressof(got), int(addr_s), 8)
            except OSError as exc:
                why = f"rank {rank} could not read rank {peer}'s memory: {exc}"
            else:
                if got.value != int(value_s):
                    why = f"rank {rank} read another value from rank {peer}'s memory (pid {pid_s})"
                else:  # the single-copy op writes too: put the same value back
                    try:
                        reader.write(peer, int(addr_s), ctypes.addressof(got), 8)
                    except OSError as exc:
                        why = f"rank {rank} could not write rank {peer}'s memory: {exc}"
    # ``word`` must stay readable until every peer has probed it: the verdicts below are set
    # after each rank's probes, and every rank reads every verdict before it returns.
    store.set(f"cma_ok/{rank}", ("!" + why if why else "1").encode())
    verdicts = [get_while_alive(store, f"cma_ok/{peer}", deadline, peer, gone) if peer != rank
                else ("!" + why if why else "1") for peer in range(size)]
    bad = [v[1:] for v in verdicts if v != "1"]
    del word
    if bad:
        return None, bad[0]
    return reader, ""


class _Coll(Protocol):
    """What :func:`all_reduce` uses of the group's ``ShmCollectives`` (its protocol steps)."""

    seg: ShmSegment
    rank: int
    size: int
    mesh: Any
    cma_scratch: list[Array]
    _peers: list[int]
    _u: int

    def _begin(self, ctx: Ctx) -> None: ...
    def _wait(self, ctx: Ctx, j: int, step: int) -> None: ...
    def _wait_all(self, ctx: Ctx, step: int, ranks: Sequence[int] | None = None) -> None: ...
    def _scratch(self, count: int, dtype: np.dtype[Any]) -> Array: ...


def readable(reader: CmaReader, rank: int, addr: int, nbytes: int) -> bool:
    """Whether the kernel lets a peer read and write this process's array at ``addr`` (its
    first and last byte, read and written back unchanged by this process itself): memory
    mapped from a device (``VM_IO`` or ``VM_PFNMAP`` mappings) cannot be reached with
    process_vm_readv, nor a read-only mapping written."""
    probe = ctypes.c_uint8(0)
    try:
        for at in (addr, addr + nbytes - 1):
            reader.read(rank, ctypes.addressof(probe), at, 1)
            reader.write(rank, at, ctypes.addressof(probe), 1)
    except OSError:
        return False
    return True


# A rank's ``ADDR + 2`` word says where it stands in single-copy op ``u``: WRITING from
# the moment it may write into its peers' arrays, then DONE (it will not again in this
# op) or FAILED (it gave up on the op; its result is not to be trusted).
WRITING, DONE, FAILED = 1, 2, 3
GRACE = 30.0  # seconds a failing rank waits at most for a live peer still writing into its array
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: the lock's atomic read-modify-write (a locked instruction on
    x86-64) keeps this thread's earlier stores from passing its later loads (x86-64
    orders everything else)."""
    _fence_lock.acquire()
    _fence_lock.release()


def _state(u: int, what: int) -> int:
    return 4 * u + what


def all_reduce(coll: _Coll, ctx: Ctx, x: Array, red: Reducer, reader: CmaReader) -> bool:
    """A large all_reduce of ``coll``'s group that reads and writes the peers' arrays where they lie.

    Step 1: every rank publishes its array's address (its record's ``ADDR`` word) and is
    inside the op; headers are checked before any foreign byte is touched. Then each rank
    makes its own slice final, chunk by chunk: it reads that chunk of every peer's array
    into a scratch block that stays in cache, folds them in rank order into its own
    array, and writes the folded chunk, still in cache, into the same place of every
    peer's array (only this rank reads or writes that slice of a peer's array). Per byte,
    each rank reads a peer's slice once and writes it once: one copy each way, and the
    fold's result leaves from cache. Step 2 says it is done with the peers' arrays; no
    rank returns, and lets its caller write or free its array, before every peer's step 2.
    Each element is folded by one rank, so every rank gets the same bits.

    A rank that fails after step 1 (a dead peer, the deadline, an abort, a peer's failure)
    still keeps its array from being written after it returns: it withdraws its address
    and marks the op FAILED (so a peer that has not begun writing will not, and a peer
    that finishes raises too), then waits until no live peer that began writing into it
    is still at it (at most ``GRACE`` seconds), and only then raises.

    Returns:
        True when done; False (on every rank alike, after step 1 only) when some rank's
        array cannot be read (:func:`readable`): step 1 was the entry step of the
        pipeline through the bulk buffers, which the caller then runs.
    """
    seg, r, n = coll.seg, coll.rank, coll.size
    coll._begin(ctx)
    ctl = seg.ctl
    u = coll._u
    me = r * REC_WORDS + ADDR
    ctl[me] = x.ctypes.data if readable(reader, r, x.ctypes.data, x.nbytes) else 0
    ctl[me + 1] = u  # whose address it is: a peer on another path has not written it
    seg.post()
    posted = False
    try:
        coll._wait_all(ctx, 1)
        # Say "writing" before looking at the peers' addresses: a peer that gives up
        # withdraws its address before it looks whether this rank writes (both fenced),
        # so either this rank sees the withdrawal or that peer waits for this one.
        ctl[me + 2] = _state(u, WRITING)
        _fence()
        failed = None  # (a peer that withdrew is named only if none took the other algorithm)
        for j in coll._peers:
            if ctl[j * REC_WORDS + ADDR + 1] != u:
                if ctl[j * REC_WORDS + ADDR + 2] != _state(u, FAILED):
                    raise DistBackendError(f"{ctx.name}: rank {j} did not publish its array for op #{u}: "
                                           "it runs this all_reduce another way (ranks disagree on the algorithm)")
                failed = j if failed is None else failed
        if failed is not None:
            raise DistBackendError(f"{ctx.name}: rank {failed} failed during op #{u}")
        addrs = [int(ctl[j * REC_WORDS + ADDR]) for j in range(n)]
        if not all(addrs):
            ctl[me + 2] = _state(u, DONE)
            return False
        _fold_and_spread(coll, ctx, x, red, reader, addrs)
        ctl[me + 2] = _state(u, DONE)
        seg.post()
        posted = True
        coll._wait_all(ctx, 2)
        for j in coll._peers:
            if ctl[j * REC_WORDS + ADDR + 2] == _state(u, FAILED):
                raise DistBackendError(f"{ctx.name}: rank {j} failed during op #{u}: its slice of the result "
                                       "may not have been written")
    except BaseException:
        _withdraw(coll, u, posted)
        raise
    return True


def _fold_and_spread(coll: _Coll, ctx: Ctx, x: Array, red: Reducer, reader: CmaReader, addrs: list[int]) -> None:
    """Fold this rank's slice chunk by chunk from the peers' arrays and write each folded
    chunk back into every peer's array (:func:`all_reduce`)."""
    r, n, isz = coll.rank, coll.size, x.itemsize
    lo, hi = chunk_bounds(x.size, n)[r]
    step = max(1, CHUNK // isz)
    scratch = coll.cma_scratch
    for j in coll._peers:
        if scratch[j].nbytes < step * isz:
            scratch[j] = np.empty(step * isz, np.uint8)
    # The fold may write its output over parts[0] or parts[1] only (Reducer.fold); ranks
    # from 2 fold into a scratch block (the widening folds never write a part).
    tmp = None if r <= 1 or red.low or red.factor is not None else coll._scratch(step, x.dtype)
    peers, ctl, u = coll._peers, coll.seg.ctl, coll._u
    for start in range(lo, hi, step):
        stop = min(start + step, hi)
        m = (stop - start) * isz
        off = start * isz
        parts: list[Array] = []
        for j in range(n):
            if j == r:
                parts.append(x[start:stop])
            else:
                buf = scratch[j]
                try:
                    reader.read(j, buf.ctypes.data, addrs[j] + off, m)
                except OSError as exc:
                    raise read_error(ctx.name, j, exc, coll.mesh.gone) from exc
                parts.append(buf[:m].view(x.dtype))
        if tmp is None:
            out = x[start:stop]
            red.fold(out, parts)
        else:
            out = tmp[:stop - start]
            red.fold(out, parts)
            np.copyto(x[start:stop], out)
        src = out.ctypes.data
        for j in peers:
            # A peer that gave up on the op has withdrawn its address (_withdraw): write
            # nothing more into its array. This is read before every chunk, so a rank
            # stopped here (SIGSTOP, a debugger) and resumed after that peer gave up
            # writes at most the chunk it was about to write.
            if ctl[j * REC_WORDS + ADDR + 1] != u:
                raise DistBackendError(f"{ctx.name}: rank {j} gave up on op #{u} (withdrew its array)")
            try:
                reader.write(j, addrs[j] + off, src, m)
            except OSError as exc:
                raise read_error(ctx.name, j, exc, coll.mesh.gone) from exc


def _withdraw(coll: _Coll, u: int, posted: bool) -> None:
    """The way out of a failed single-copy op: withdraw this rank's address, say FAILED
    (unless it finished its part: then a peer's result is right), and wait until no live
    peer is still writing into this rank's array (at most ``GRACE`` seconds)."""
    seg, ctl = coll.seg, coll.seg.ctl
    me = coll.rank * REC_WORDS + ADDR
    if not posted:
        ctl[me + 2] = _state(u, FAILED)
    ctl[me + 1] = 0
    if not posted:
        seg.post()  # (step 2: the peers waiting for it see FAILED)
    _fence()
    end = time.monotonic() + GRACE
    for j in coll._peers:
        w = j * REC_WORDS + ADDR + 2
        while ctl[w] == _state(u, WRITING) and coll.mesh.gone(j) is None and time.monotonic() < end:
            time.sleep(1e-4)


def read_error(name: str, peer: int, exc: OSError, gone: Callable[[int], str | None]) -> DistBackendError:
    """The error a failed read or write of rank ``peer``'s memory raises (its death named when known)."""
    why = gone(peer)
    if why is not None:
        return DistBackendError(f"{name}: rank {peer} {why}")
    return DistBackendError(f"{name}: could not read or write rank {peer}'s array: {exc}")
