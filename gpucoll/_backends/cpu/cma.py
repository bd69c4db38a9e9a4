"""Single-copy reads of a peer process's memory: Linux cross-memory attach (``process_vm_readv``).

A large shared-memory all_reduce can read each peer's array where it lies, instead of
having every rank copy its data into the shared segment and the peers copy it out
again (Open MPI's shared-memory transport moves large messages the same way). The
kernel allows it between processes of the same user unless ptrace is restricted (Yama's
``ptrace_scope`` >= 1 without a ptracer relation, containers whose seccomp profile
refuses the call, a process that made itself non-dumpable): then the call fails with
EPERM (or ENOSYS) and the group keeps the copies through the segment. Whether every
rank may read every peer is decided once per group, by a probe (:func:`agree`), so all
ranks take the same algorithm.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..._env import CPU_CMA_ENV as ENV
from ...errors import DistBackendError
from .reduce import Array, Reducer
from .shm import ADDR, REC_WORDS, ShmSegment, get_while_alive
from .tcp_algos import Ctx, chunk_bounds

__all__ = ["CmaReader", "agree", "all_reduce", "readable", "read_error", "ENV", "MIN_BYTES", "CHUNK", "CHUNK_SET", "chunk_bytes"]

# The smallest all_reduce that reads the peers' arrays directly. Below it the pipeline
# through the segment's bulk buffers is faster (2 and 4 ranks, 2026-11-28, A/B in the same
# runs: 1 MiB took 1.2-1.6x its time single-copy, 2 MiB about the same, 4 MiB 0.88-0.93x,
# 16 MiB 0.6-0.8x, 64 MiB 0.8x).
MIN_BYTES = 4 << 20
CHUNK = 512 * 1024  # bytes of each peer read per fold at 2 ranks (256 KiB and 1 MiB were slower there)
# A chunk's working set (the n - 1 peers' scratch and this rank's own part) stays within
# this many bytes: half the 2 MiB L2 of a core here, which at more ranks than cores two
# ranks take turns on (4 ranks, 16 MiB: 13.3 ms of CPU an op with 256 KiB chunks, 14.1 with 512 KiB).
CHUNK_SET = 1 << 20



def chunk_bytes(size: int) -> int:
    """Bytes of each peer one fold step reads in a group of ``size`` ranks: ``CHUNK``, or
    less where ``size`` chunks would not fit ``CHUNK_SET`` (a multiple of 4 KiB)."""
    return max(4096, min(CHUNK, CHUNK_SET // max(size, 1) // 4096 * 4096))


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv: Any = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                       ctypes.c_ulong, ctypes.c_ulong]


class CmaReader:
    """Reads from the peers' address spaces (one thread at a time: the iovecs are reused).

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
        local, remote, pid = self._local, self._remote, self.pids[peer]
        while nbytes > 0:
            local.iov_base, local.iov_len = dst, nbytes
            remote.iov_base, remote.iov_len = src, nbytes
            got: int = _readv(pid, self._lp, 1, self._rp, 1, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else 0
                raise OSError(err, f"process_vm_readv of {nbytes} bytes from pid {pid}: "
                                   f"{os.strerror(err) if err else 'read nothing'}")
            dst += got
            src += got
            nbytes -= got


def _refused_here() -> str | None:
    """Why this rank will not use cross-memory attach, or None."""
    if _readv is None:
        return "process_vm_readv is not in this C library"
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return f"{ENV}={os.environ[ENV]}"
    return None


def agree(store: Any, rank: int, size: int, timeout: float,
          gone: Callable[[int], str | None]) -> tuple[CmaReader | None, str]:
    """Decide with every rank of the group whether every rank can read every peer.

    Each rank publishes its pid and the address of a random word it holds; each rank
    reads every peer's word with ``process_vm_readv`` and publishes whether it got the
    value; all use it only if all did. Keys go under ``cma/`` in the group's store.

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
    """Whether the kernel lets a peer read this process's array at ``addr`` (its first and
    last byte, read by this process itself): memory mapped from a device (``VM_IO`` or
    ``VM_PFNMAP`` mappings) cannot be read with process_vm_readv."""
    probe = ctypes.c_uint8(0)
    try:
        reader.read(rank, ctypes.addressof(probe), addr, 1)
        reader.read(rank, ctypes.addressof(probe), addr + nbytes - 1, 1)
    except OSError:
        return False
    return True


def all_reduce(coll: _Coll, ctx: Ctx, x: Array, red: Reducer, reader: CmaReader) -> bool:
    """A large all_reduce of ``coll``'s group that reads the peers' arrays where they lie.

    Step 1: every rank publishes its array's address (its record's ``ADDR`` word) and is
    inside the op; headers are checked before any foreign byte is read. Then each rank
    folds its own slice: it reads that slice of every peer's array in chunks into a
    scratch block that stays in cache, and folds them in rank order into its own array
    (one copy per byte read, against three through the bulk buffers). Step 2 says its
    slice is final and that it has read what it needed of the peers. Then it reads each
    peer's final slice straight into its own array, after that peer's step 2 (so that
    peer has also read this rank's copy of it, which this overwrites). Step 3 says it is
    done reading; nobody returns, and lets its caller write the array again, before
    every peer's step 3. Every rank raises its counter three times, as the protocol
    requires; each element is folded by one rank, so every rank gets the same bits.

    Returns:
        True when done; False (on every rank alike, after step 1 only) when some rank's
        array cannot be read (:func:`readable`): step 1 was the entry step of the
        pipeline through the bulk buffers, which the caller then runs.
    """
    seg, r, n = coll.seg, coll.rank, coll.size
    coll._begin(ctx)
    ctl = seg.ctl
    u = coll._u
    ctl[r * REC_WORDS + ADDR] = x.ctypes.data if readable(reader, r, x.ctypes.data, x.nbytes) else 0
    ctl[r * REC_WORDS + ADDR + 1] = u  # whose address it is: a peer on another path has not written it
    seg.post()
    coll._wait_all(ctx, 1)
    for j in coll._peers:
        if ctl[j * REC_WORDS + ADDR + 1] != u:
            raise DistBackendError(f"{ctx.name}: rank {j} did not publish its array for op #{u}: "
                                   "it runs this all_reduce another way (ranks disagree on the algorithm)")
    addrs = [int(ctl[j * REC_WORDS + ADDR]) for j in range(n)]
    if not all(addrs):
        return False
    isz = x.itemsize
    bounds = chunk_bounds(x.size, n)
    lo, hi = bounds[r]
    step = max(1, chunk_bytes(n) // isz)
    scratch = coll.cma_scratch
    for j in coll._peers:
        if scratch[j].nbytes < step * isz:
            scratch[j] = np.empty(step * isz, np.uint8)
    # Reducer.fold may write its output over parts[0] or parts[1] only: ranks from 2 fold
    # through rank 0's scratch (a plain ufunc: the last step writes the array; see _fold)
    # or, for the widening and scaling folds (which never write a part), a scratch block.
    ufunc = red.ufunc if r >= 2 and not red.low and red.factor is None else None
    tmp = None if r <= 1 or ufunc is not None else coll._scratch(step, x.dtype)

    def read(j: int, dst: int, src: int, nbytes: int) -> None:
        try:
            reader.read(j, dst, src, nbytes)
        except OSError as exc:
            raise read_error(ctx.name, j, exc, coll.mesh.gone) from exc

    for start in range(lo, hi, step):
        stop = min(start + step, hi)
        m = (stop - start) * isz
        parts: list[Array] = []
        for j in range(n):
            if j == r:
                parts.append(x[start:stop])
            else:
                buf = scratch[j]
                read(j, buf.ctypes.data, addrs[j] + start * isz, m)
                parts.append(buf[:m].view(x.dtype))
        if ufunc is not None:
            _fold(red, ufunc, x[start:stop], parts)
        elif tmp is None:
            red.fold(x[start:stop], parts)
        else:
            red.fold(tmp[:stop - start], parts)
            np.copyto(x[start:stop], tmp[:stop - start])
    seg.post()
    base = x.ctypes.data
    for j in coll._peers:
        coll._wait(ctx, j, 2)
        plo, phi = bounds[j]
        read(j, base + plo * isz, addrs[j] + plo * isz, (phi - plo) * isz)
    seg.post()
    coll._wait_all(ctx, 3)
    return True


def _fold(red: Reducer, ufunc: Callable[..., Any], out: Array, parts: list[Array]) -> None:
    """``red.fold(out, parts)`` for a plain ufunc where ``out`` is ``parts[k]``, k >= 2:
    accumulate in ``parts[0]`` (a scratch copy) in rank order and write the last step into
    ``out``, with no pass through a block of its own."""
    acc = parts[0]
    last = len(parts) - 1
    ufunc(acc, parts[1], out=acc)
    for i in range(2, last):
        ufunc(acc, parts[i], out=acc)
    ufunc(acc, parts[last], out=out)
    red.finish(out)


def read_error(name: str, peer: int, exc: OSError, gone: Callable[[int], str | None]) -> DistBackendError:
    """The error a failed read of rank ``peer``'s memory raises (its death named when known)."""
    why = gone(peer)
    if why is not None:
        return DistBackendError(f"{name}: rank {peer} {why}")
    return DistBackendError(f"{name}: could not read rank {peer}'s array: {exc}")
