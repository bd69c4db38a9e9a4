"""The CUDA and NCCL calls the NCCL backend makes, behind two small Protocols.

:class:`Runtime` (streams, events, copies, temporaries, kernels, communicator
creation) and :class:`Comm` (one NCCL communicator), declared in the leaf module
:mod:`.protocols` and re-exported here, are all the backend touches;
:class:`CudaRuntime` and :class:`CupyComm` implement them over CuPy, binding CuPy's
Cython functions directly so that the issue path adds no Python layer of its own.
The CPU test suite drives the same backend through an in-process fake of these
Protocols. Importing this module imports no CuPy.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Mapping, Sequence

from ...errors import BackendUnavailableError

from .lib import NcclCallError, NcclLib, shim_of
from .values import comm_id_arg, normalise_unique_id
from .protocols import CAPTURE_GLOBAL, CAPTURE_RELAXED, CAPTURE_THREAD_LOCAL, Comm, Event, Runtime

__all__ = ["Event", "Comm", "Runtime", "CudaRuntime", "CupyComm", "NcclCallError", "enter_device", "leave_device",
           "CAPTURE_GLOBAL", "CAPTURE_THREAD_LOCAL", "CAPTURE_RELAXED"]

_CUDA_ERROR_NOT_READY = 600
# cudaEventDisableTiming: CUDA documents these as the events with the best performance
# for cudaStreamWaitEvent and cudaEventQuery; timing (cudaEventDefault, 0) only when asked.
_EVENT_DISABLE_TIMING = 2
_EVENT_DEFAULT = 0


class _PooledEvent:
    """A CUDA event that goes back to its pool, not to cudaEventDestroy, when dropped:
    creating events costs a driver call per op otherwise."""

    __slots__ = ("ptr", "_pool")

    def __init__(self, ptr: int, pool: _EventPool | None) -> None:
        self.ptr = ptr
        self._pool = pool

    def __del__(self) -> None:
        pool = self._pool
        if pool is not None:
            pool.release(self.ptr)
        else:
            _destroy_event(self.ptr)


def _destroy_event(ptr: int) -> None:
    try:
        from cupy.cuda import runtime

        runtime.eventDestroy(ptr)
    except Exception:
        pass  # interpreter shutdown or a dead context: nothing left to free


class _EventPool:
    def __init__(self, create: Callable[[int], int], limit: int = 1024, flags: int = _EVENT_DISABLE_TIMING) -> None:
        self._create = create
        self._flags = flags
        self._free: list[int] = []
        self._limit = limit
        self._lock = threading.Lock()

    def acquire(self) -> _PooledEvent:
        with self._lock:
            ptr = self._free.pop() if self._free else 0
        return _PooledEvent(ptr or self._create(self._flags), self)

    def release(self, ptr: int) -> None:
        with self._lock:
            if len(self._free) < self._limit:
                self._free.append(ptr)
                return
        _destroy_event(ptr)


class CudaRuntime:
    """:class:`Runtime` over CuPy.

    Args:
        lib: the loaded CuPy/NCCL (:func:`gpucoll._backends.nccl.lib.load`).
    """

    def __init__(self, lib: NcclLib) -> None:
        rt = lib.cupy.cuda.runtime
        self.lib = lib
        self.features = lib.features
        self._cupy = lib.cupy
        self._rt = rt
        self.get_device = rt.getDevice
        self.set_device = rt.setDevice
        self.record = rt.eventRecord
        self.wait_event = rt.streamWaitEvent
        self.elapsed_ms = rt.eventElapsedTime
        self.is_capturing = rt.streamIsCapturing
        shim = lib.shim
        if shim is not None and shim.has_group_calls:
            self.group_start, self.group_end = shim.group_start, shim.group_end
        else:
            self.group_start, self.group_end = lib.nccl.groupStart, lib.nccl.groupEnd
        self._event_query = rt.eventQuery
        self._memcpy = rt.memcpyAsync
        self._memcpy_kind = rt.memcpyDefault
        self._get_current_stream = lib.cupy.cuda.get_current_stream
        self._device_cls = lib.cupy.cuda.Device
        self._stream_cls = lib.cupy.cuda.Stream
        self._alloc = lib.cupy.cuda.alloc
        self._create_event = rt.eventCreateWithFlags
        self._device_count = rt.getDeviceCount
        self._error = rt.CUDARuntimeError
        self._pools: dict[tuple[int, bool], _EventPool] = {}
        self._ctx_current = lib.cupy.cuda.driver.ctxGetCurrent
        self._exchange_mode = _capture_mode_exchanger()
        self._destroy_event = rt.eventDestroy

    def has_context(self) -> bool:
        return bool(self._ctx_current())

    @property
    def can_exchange_capture_mode(self) -> bool:
        return self._exchange_mode is not None

    def exchange_capture_mode(self, mode: int) -> int:
        fn = self._exchange_mode
        if fn is None:
            return mode
        import ctypes

        value = ctypes.c_int(mode)
        status = fn(ctypes.byref(value))
        if status != 0:
            raise self._error(status)
        return int(value.value)

    def device_count(self) -> int:
        return int(self._device_count())

    def compute_capability(self, device: int) -> tuple[int, int]:
        cc = str(self._device_cls(device).compute_capability)  # "90" for 9.0, "100" for 10.0
        return int(cc[:-1]), int(cc[-1])

    def current_stream(self) -> int:
        return int(self._get_current_stream().ptr)

    def current_stream_of(self, device: int) -> int:
        # CuPy keeps a current stream per device and thread; given the device, it makes
        # no cudaGetDevice.
        return int(self._get_current_stream(device).ptr)

    # stream_of answers from the object's fields alone: a caller may keep its answer for
    # that object (a CuPy stream's ptr and device never change).
    stream_of_fixed = True

    def stream_of(self, stream: Any, device: int) -> int | None:
        # A CuPy stream (Python attributes): current_stream_of answers its ptr. CuPy's
        # null stream (ptr 0) says device -1: the legacy default stream, of the device
        # the op runs on (what current_stream_of(device) answers for it: 0).
        ptr = stream.ptr
        if not ptr:
            return 0
        return int(ptr) if stream.device_id == device else None

    def new_event(self, timing: bool = False) -> int:
        return int(self._create_event(_EVENT_DEFAULT if timing else _EVENT_DISABLE_TIMING))

    def destroy_event(self, event: int) -> None:
        try:
            self._destroy_event(event)
        except Exception:
            pass  # a dead context: nothing left to free

    def new_stream(self, high_priority: bool = False) -> Any:
        # Non-blocking: the communication stream must not serialise with the legacy
        # default stream, only with what the backend makes it wait for.
        if high_priority:
            # CUDA clamps a priority beyond cudaDeviceGetStreamPriorityRange (which CuPy
            # does not bind) to the greatest one.
            return self._stream_cls(non_blocking=True, priority=_HIGHEST_PRIORITY)
        return self._stream_cls(non_blocking=True)

    def event(self, pooled: bool = True, timing: bool = False, device: int = -1) -> Event:
        """An event of ``device`` (-1: the current one), with timing only when ``timing``
        (a completion hook reads active_duration). Events recorded during CUDA graph
        capture must not be reused outside it: ask for ``pooled=False`` then."""
        flags = _EVENT_DEFAULT if timing else _EVENT_DISABLE_TIMING
        if not pooled:
            return _PooledEvent(self._create_event(flags), None)
        key = (self.get_device() if device < 0 else device, timing)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools.setdefault(key, _EventPool(self._make_event(key[0]), flags=flags))
        return pool.acquire()

    def _make_event(self, device: int) -> Callable[[int], int]:
        """cudaEventCreateWithFlags on ``device`` (made current for the call if it is not)."""
        def create(flags: int) -> int:
            prev = enter_device(self, device)
            try:
                return int(self._create_event(flags))
            finally:
                leave_device(self, prev)
        return create

    def query(self, event: int) -> bool:
        status = self._event_query(event)
        if status == 0:
            return True
        if status == _CUDA_ERROR_NOT_READY:
            return False
        raise self._error(status)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._memcpy(dst, src, nbytes, self._memcpy_kind, stream)

    def mem_alloc(self, nbytes: int) -> int:
        return shim_of(self.lib, "ncclMemAlloc").mem_alloc(nbytes)

    def mem_free(self, ptr: int) -> None:
        shim_of(self.lib, "ncclMemFree").mem_free(ptr)

    def is_vmm(self, ptr: int, nbytes: int) -> bool | None:
        # The driver's answer, as NCCL's own window check asks it: cuMemRetainAllocationHandle
        # succeeds on cuMem (VMM) memory only; cudaMalloc memory gives CUDA_ERROR_INVALID_VALUE.
        cuda = _libcuda()
        if cuda is None:
            return None
        import ctypes

        handle = ctypes.c_ulonglong(0)
        if cuda.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)) != 0:
            return False
        cuda.cuMemRelease(handle)
        return True

    def alloc(self, nbytes: int, stream: Any) -> tuple[int, Any]:
        # Allocated while the communication stream is current, CuPy's pool hands this
        # block out again only in that stream's order.
        with stream:
            mem = self._alloc(max(nbytes, 1))
        return int(mem.ptr), mem

    def prepare(self, kernel: str, device: int) -> None:
        from . import kernel_loader as _kernels

        _kernels.get_kernel(kernel, device)

    def launch(self, kernel: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None:
        from . import kernel_loader as _kernels

        _kernels.launch(kernel, n, args, stream, device)

    def unique_id(self) -> bytes:
        return normalise_unique_id(self.lib.nccl.get_unique_id())

    def check_config(self, config: Mapping[str, Any]) -> None:
        cupy_config(self.lib, config)

    def new_comm(self, size: int, uid: bytes, rank: int, config: Mapping[str, Any] | None = None) -> Comm:
        cfg = cupy_config(self.lib, config)
        uid_arg = comm_id_arg(uid, self._cupy.__version__)
        if cfg is None:
            comm = self.lib.nccl.NcclCommunicator(size, uid_arg, rank)
        else:
            comm = self.lib.nccl.NcclCommunicator(size, uid_arg, rank, cfg)
        return CupyComm(self.lib, comm, rank, size)

    def new_comm_scalable(self, size: int, uids: Sequence[bytes], rank: int,
                          config: Mapping[str, Any] | None = None) -> Comm:
        import ctypes

        from .lib import UniqueId, config_pointer
        from .rawcomm import RawComm

        shim = self.lib.shim
        if shim is None or shim.init_rank_scalable_fn is None:
            raise BackendUnavailableError("ncclCommInitRankScalable is not in NCCL "
                                          f"{'.'.join(map(str, self.lib.version))} (needs >= 2.23)")
        ids = (UniqueId * len(uids))()
        for i, uid in enumerate(uids):
            ctypes.memmove(ctypes.addressof(ids[i]), normalise_unique_id(uid), ctypes.sizeof(UniqueId))
        handle = ctypes.c_void_p()
        code = shim.init_rank_scalable_fn(ctypes.byref(handle), size, rank, len(uids), ids,
                                          config_pointer(dict(config) if config else None, self.lib.version))
        if code != 0:
            raise NcclCallError("ncclCommInitRankScalable", code, shim.error_string(code))
        return RawComm(self.lib, int(handle.value or 0), rank, size)


_HIGHEST_PRIORITY = -1000


@functools.lru_cache(maxsize=1)
def _libcuda() -> Any:
    """The CUDA driver library through ctypes (the process has it loaded once CuPy runs), or None."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p]
    lib.cuMemRelease.argtypes = [ctypes.c_ulonglong]
    return lib


def enter_device(rt: Runtime, device: int) -> int:
    """Make ``device`` current on this thread; return what :func:`leave_device` takes:
    the previous device, or -1 when there is nothing to go back to: the same device, or
    a thread with no CUDA context yet (a watchdog's), whose "previous" device is CUDA's
    0 without a context; going back would make one there, 300-500 MiB of GPU 0 in every
    process (torch's c10::cuda::MaybeSetDevice has the same rule)."""
    prev = rt.get_device()
    if prev == device:
        return -1
    had_context = rt.has_context()
    rt.set_device(device)
    return prev if had_context else -1


def leave_device(rt: Runtime, prev: int) -> None:
    """Undo :func:`enter_device`."""
    if prev >= 0:
        rt.set_device(prev)


def _capture_mode_exchanger() -> Any:
    """The call that exchanges this thread's stream-capture mode (CuPy binds none): the
    driver's ``cuThreadExchangeStreamCaptureMode`` from ``libcuda.so.1``, which is loaded
    wherever CUDA works (CuPy 14 for CUDA 13 loads no ``libcudart.so`` at all); the
    runtime's ``cudaThreadExchangeStreamCaptureMode`` where the driver lacks it. Both
    take the same modes (global 0, thread-local 1, relaxed 2) and act on the calling
    thread. None where neither is found, and then no exchange is made."""
    import ctypes

    from .lib import loaded_library_path

    candidates = [(loaded_library_path("libcuda.so") or "libcuda.so.1", "cuThreadExchangeStreamCaptureMode")]
    cudart = loaded_library_path("libcudart.so")
    if cudart is not None:
        candidates.append((cudart, "cudaThreadExchangeStreamCaptureMode"))
    for path, name in candidates:
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        return fn
    return None
CUPY_CONFIG_FIELDS = frozenset({"split_share"})
"""The ncclConfig_t fields CuPy's ``NcclConfig`` can carry (CuPy 14)."""


def cupy_config(lib: NcclLib, config: Mapping[str, Any] | None) -> Any:
    """``config`` as CuPy's ``NcclConfig`` (None when nothing is set).

    CuPy's ``NcclCommunicator`` creates the communicator and owns it, and its
    ``NcclConfig`` carries ``split_share`` only: a raw communicator made through the
    shim's ``ncclCommInitRankConfig`` could not be handed to it.

    Raises:
        BackendUnavailableError: a set field CuPy cannot carry (naming it).
    """
    if not config:
        return None
    cls = getattr(lib.nccl, "NcclConfig", None)
    can = {name for name in CUPY_CONFIG_FIELDS if cls is not None and hasattr(cls, name)}
    refused = sorted(name for name in config if name not in can)
    if refused:
        raise BackendUnavailableError(
            f"NCCL config field(s) {', '.join(refused)} cannot be applied: CuPy {lib.cupy.__version__}'s "
            f"NcclCommunicator takes {'only ' + ', '.join(sorted(can)) if can else 'no config'} "
            "(cupy.cuda.nccl.NcclConfig); leave them unset, or set NCCL's environment variables "
            "(NCCL_CGA_CLUSTER_SIZE, NCCL_MIN_CTAS, NCCL_MAX_CTAS, NCCL_NET, ...)")
    assert cls is not None  # every field was refused otherwise
    # NcclConfig(split_share=...): its attributes are read-only.
    return cls(**{name: int(value) for name, value in config.items()})


class CupyComm:
    """:class:`Comm` over ``cupy.cuda.nccl.NcclCommunicator`` plus the ctypes shim."""

    def __init__(self, lib: NcclLib, comm: Any, rank: int, size: int) -> None:
        self._lib = lib
        self._comm = comm
        self.rank = rank
        self.size = size
        # CuPy's methods take (buffers, count, datatype, [op], [root|peer], stream),
        # the order of the plan steps: bind them as they are.
        self.all_reduce = comm.allReduce
        self.reduce = comm.reduce
        self.broadcast = comm.broadcast
        self.all_gather = comm.allGather
        self.reduce_scatter = comm.reduceScatter
        self.send = comm.send
        self.recv = comm.recv

    @property
    def handle(self) -> int:
        """The raw ``ncclComm_t`` (0 once destroyed or aborted)."""
        return int(self._comm.comm)

    def _shim_call(self, fn: Any, what: str, *args: Any) -> None:
        if fn is None:
            raise NcclCallError(what, 5, f"not in NCCL {'.'.join(map(str, self._lib.version))}")
        code = fn(*args)
        if code != 0:
            shim = self._lib.shim
            assert shim is not None
            raise NcclCallError(what, code, shim.last_error(self.handle) or shim.error_string(code))

    def all_to_all(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        shim = self._lib.shim
        self._shim_call(shim and shim.all_to_all_fn, "ncclAlltoAll", send, recv, count, dtype,
                        self.handle, stream)

    def gather(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        shim = self._lib.shim
        self._shim_call(shim and shim.gather_fn, "ncclGather", send, recv, count, dtype, root,
                        self.handle, stream)

    def scatter(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        shim = self._lib.shim
        self._shim_call(shim and shim.scatter_fn, "ncclScatter", send, recv, count, dtype, root,
                        self.handle, stream)

    def premul_sum(self, scalar: bytes, dtype: int) -> int:
        shim = self._lib.shim
        if shim is None:
            raise NcclCallError("ncclRedOpCreatePreMulSum", 5, self._lib.shim_error)
        return shim.premul_sum(self.handle, scalar, dtype)

    def op_destroy(self, op: int) -> None:
        shim = self._lib.shim
        if shim is not None:
            shim.op_destroy(self.handle, op)

    def async_error(self) -> int:
        shim = self._lib.shim
        handle = self.handle
        if shim is None or not handle:
            return 0
        return shim.async_error(handle)

    def last_error(self) -> str:
        shim = self._lib.shim
        return shim.last_error(self.handle) if shim is not None else ""

    def split(self, color: int, key: int, config: Mapping[str, Any] | None = None) -> Comm | None:
        cfg = cupy_config(self._lib, config)
        new = self._comm.commSplit(color, key) if cfg is None else self._comm.commSplit(color, key, cfg)
        if new is None:
            return None
        return CupyComm(self._lib, new, int(new.rank_id()), int(new.size()))

    def shrink(self, exclude: Sequence[int], flags: int, config: Mapping[str, Any] | None = None) -> Comm:
        raise NcclCallError("ncclCommShrink", 5, "CuPy cannot adopt the raw communicator ncclCommShrink returns")

    # Buffer registration (the shim's calls on this communicator; see registration.py)
    def register(self, ptr: int, nbytes: int) -> int:
        return shim_of(self._lib, "ncclCommRegister").comm_register(self.handle, ptr, nbytes)

    def deregister(self, handle: int) -> None:
        shim_of(self._lib, "ncclCommDeregister").comm_deregister(self.handle, handle)

    def window_register(self, ptr: int, nbytes: int, flags: int) -> int:
        return shim_of(self._lib, "ncclCommWindowRegister").window_register(self.handle, ptr, nbytes, flags)

    def window_deregister(self, window: int) -> None:
        shim_of(self._lib, "ncclCommWindowDeregister").window_deregister(self.handle, window)

    def abort(self) -> None:
        self._comm.abort()

    def destroy(self) -> None:
        self._comm.destroy()
