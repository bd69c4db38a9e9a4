"""``gpucoll.nccl_mem_pool()``: a CuPy memory pool whose blocks come from ``ncclMemAlloc``.

NCCL's allocator gives cuMem (VMM) memory that NCCL can register cheaply and map into
other GPUs' address spaces: what NVLink SHARP, the symmetric kernels of NCCL >= 2.27 and
``ncclCommWindowRegister`` need. torch offers it as ``torch.cuda.MemPool`` with NCCL's
allocator; CuPy users get it here. The pool is a ``cupy.cuda.MemoryPool`` over a
``PythonFunctionAllocator`` whose malloc is ``ncclMemAlloc`` and whose free is
``ncclMemFree``: use it with ``cupy.cuda.using_allocator(pool.malloc)``.

Each *segment* (one ``ncclMemAlloc``) is announced to the pool's watchers before it is
handed out and before it goes back to NCCL: ``ProcessGroup.register_mem_pool`` is such
a watcher and registers every segment, present and future, as torch's does, and
deregisters one before NCCL frees it (NCCL does not notice memory freed under a
registration; a later op on it reads freed memory).

CuPy is imported only when the CuPy pool is first used; :meth:`NcclMemPool.allocate`
and :meth:`NcclMemPool.free` give raw segments without it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import cupy

    from .protocols import Runtime

__all__ = ["NcclMemPool", "nccl_mem_pool", "SegmentWatcher"]

SegmentWatcher = Callable[[str, int, int, int], None]
"""``watcher(event, ptr, nbytes, device)``; ``event`` is ``"alloc"`` or ``"free"``."""


class NcclMemPool:
    """A pool of NCCL-allocated device memory (see the module docstring).

    Use :func:`gpucoll.nccl_mem_pool` to make one.

    Example:
        >>> pool = gpucoll.nccl_mem_pool()
        >>> with cupy.cuda.using_allocator(pool.malloc):
        ...     x = cupy.ones(1 << 20, cupy.float32)  # ncclMemAlloc memory
        >>> group.register_mem_pool(pool)             # every segment, present and future
    """

    def __init__(self, *, _runtime: Runtime | None = None) -> None:
        self._runtime = _runtime
        self._lock = threading.RLock()
        self._segments: dict[int, tuple[int, int]] = {}   # ptr -> (nbytes, device)
        self._watchers: list[SegmentWatcher] = []
        self._cupy_pool: Any = None

    def __repr__(self) -> str:
        return f"<NcclMemPool segments={len(self._segments)} bytes={self.total_bytes()}>"

    def _rt(self) -> Runtime:
        if self._runtime is None:
            from ...errors import BackendUnavailableError
            from . import lib as _lib
            from .runtime import CudaRuntime

            reason = _lib.unavailable_reason()
            if reason is not None:
                raise BackendUnavailableError(f"the NCCL memory pool needs CUDA and NCCL: {reason}")
            self._runtime = CudaRuntime(_lib.load())
        return self._runtime

    # ----- raw segments -----
    def allocate(self, nbytes: int, device: int | None = None) -> int:
        """One new segment of ``nbytes`` from ``ncclMemAlloc`` on ``device`` (the current
        one when None), announced to the watchers; its device pointer.

        Raises:
            ValueError: ``nbytes`` < 1.
            BackendUnavailableError: no CUDA or NCCL here, or NCCL lacks ncclMemAlloc (< 2.19).
            RuntimeError: ncclMemAlloc failed (out of memory, ...).
        """
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1; got {nbytes}")
        rt = self._rt()
        if not rt.features.register:
            from ...errors import BackendUnavailableError

            raise BackendUnavailableError("ncclMemAlloc needs NCCL >= 2.19; this is NCCL "
                                          + ".".join(map(str, rt.features.version)))
        prev = rt.get_device()
        dev = prev if device is None else device
        if dev != prev:
            rt.set_device(dev)
        try:
            ptr = rt.mem_alloc(nbytes)
        finally:
            if dev != prev:
                rt.set_device(prev)
        with self._lock:
            self._segments[ptr] = (nbytes, dev)
            watchers = list(self._watchers)
        try:
            for watch in watchers:
                watch("alloc", ptr, nbytes, dev)
        except BaseException:
            self.free(ptr)
            raise
        return ptr

    def free(self, ptr: int) -> None:
        """Return segment ``ptr`` to NCCL (``ncclMemFree``) after the watchers let go of it.

        Raises:
            ValueError: ``ptr`` is not a segment of this pool.
        """
        with self._lock:
            entry = self._segments.pop(ptr, None)
            watchers = list(self._watchers)
        if entry is None:
            raise ValueError(f"{ptr:#x} is not a segment of this NCCL memory pool")
        nbytes, dev = entry
        first: BaseException | None = None
        for watch in watchers:
            try:
                watch("free", ptr, nbytes, dev)
            except BaseException as exc:  # free the memory anyway; report the first failure
                first = first or exc
        self._rt().mem_free(ptr)
        if first is not None:
            raise first

    def segments(self) -> list[tuple[int, int, int]]:
        """Every live segment as ``(ptr, nbytes, device)``."""
        with self._lock:
            return [(p, n, d) for p, (n, d) in self._segments.items()]

    def total_bytes(self) -> int:
        """Bytes held from NCCL (every segment, in use or cached)."""
        with self._lock:
            return sum(n for n, _ in self._segments.values())

    # ----- CuPy's face -----
    def malloc(self, nbytes: int) -> "cupy.cuda.MemoryPointer":
        """CuPy's allocator signature: a ``cupy.cuda.MemoryPointer`` of ``nbytes`` from the
        pool; pass it to ``cupy.cuda.using_allocator`` or ``cupy.cuda.set_allocator``."""
        return self._pool().malloc(nbytes)

    def used_bytes(self) -> int:
        """Bytes CuPy arrays hold now (0 before the CuPy pool is used)."""
        return 0 if self._cupy_pool is None else int(self._cupy_pool.used_bytes())

    def free_all_blocks(self) -> None:
        """Give every cached (unused) block back to NCCL, as ``cupy.cuda.MemoryPool.free_all_blocks``."""
        if self._cupy_pool is not None:
            self._cupy_pool.free_all_blocks()

    def _pool(self) -> Any:
        with self._lock:
            if self._cupy_pool is None:
                import cupy

                allocator = cupy.cuda.PythonFunctionAllocator(
                    lambda nbytes, device: self.allocate(nbytes, device), lambda ptr, device: self.free(ptr))
                self._cupy_pool = cupy.cuda.MemoryPool(allocator.malloc)
            return self._cupy_pool

    # ----- watchers (ProcessGroup.register_mem_pool) -----
    def _watch(self, watcher: SegmentWatcher) -> None:
        """Announce every present segment to ``watcher`` now and every later one as it comes."""
        with self._lock:
            present = [(p, n, d) for p, (n, d) in self._segments.items()]
            self._watchers.append(watcher)
        done: list[tuple[int, int, int]] = []
        try:
            for ptr, nbytes, dev in present:
                watcher("alloc", ptr, nbytes, dev)
                done.append((ptr, nbytes, dev))
        except BaseException:
            self._unwatch(watcher, done)
            raise

    def _watching(self, match: Callable[[SegmentWatcher], bool]) -> SegmentWatcher | None:
        """The first watcher ``match`` accepts, or None."""
        with self._lock:
            return next((w for w in self._watchers if match(w)), None)

    def _unwatch(self, watcher: SegmentWatcher, present: list[tuple[int, int, int]] | None = None) -> None:
        """Stop announcing to ``watcher``; announce the release of the present segments
        (``present``: those it saw, by default all)."""
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
            segs = present if present is not None else [(p, n, d) for p, (n, d) in self._segments.items()]
        for ptr, nbytes, dev in segs:
            watcher("free", ptr, nbytes, dev)


def nccl_mem_pool() -> NcclMemPool:
    """A new memory pool on NCCL's allocator (``ncclMemAlloc``/``ncclMemFree``), for CuPy.

    Memory from it can be registered with a group's communicator
    (``ProcessGroup.register_buffer``, ``register_mem_pool``) and, on NCCL >= 2.27, as a
    symmetric window (``register_buffer(x, symmetric=True)``), which ordinary CuPy memory
    (``cudaMalloc``) cannot.

    Returns:
        An :class:`NcclMemPool`; ``pool.malloc`` is CuPy's allocator signature.

    Example:
        >>> pool = gpucoll.nccl_mem_pool()
        >>> with cupy.cuda.using_allocator(pool.malloc):
        ...     grads = cupy.zeros(1 << 24, cupy.float32)
        >>> handle = group.register_buffer(grads, symmetric=True)
    """
    return NcclMemPool()
