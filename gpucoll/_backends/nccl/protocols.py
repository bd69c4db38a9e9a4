"""The Protocols the NCCL backend's modules share: one CUDA event, one NCCL
communicator, the CUDA runtime. A leaf module (it imports nothing of the backend but
``lib``'s feature record), so that every module can name these types without an
import cycle; :mod:`.runtime` implements them over CuPy, tests/_nccl_fake.py in-process."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

from .lib import Features

__all__ = ["Event", "Comm", "Runtime", "CAPTURE_GLOBAL", "CAPTURE_THREAD_LOCAL", "CAPTURE_RELAXED"]

# cudaStreamCaptureMode (driver_types.h), the same values as the driver's CUstreamCaptureMode.
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2


class Event(Protocol):
    """A CUDA event owned by whoever holds this object."""

    ptr: int


class Comm(Protocol):
    """One NCCL communicator. Pointers and streams are raw integers; counts are in
    elements of ``dtype`` (an ncclDataType_t); the methods raise on NCCL errors."""

    rank: int
    size: int

    # (send, recv, count, dtype, [op], [root | peer], stream), as properties so that
    # CupyComm can bind CuPy's methods directly.
    @property
    def all_reduce(self) -> Callable[[int, int, int, int, int, int], None]: ...
    @property
    def reduce(self) -> Callable[[int, int, int, int, int, int, int], None]: ...
    @property
    def broadcast(self) -> Callable[[int, int, int, int, int, int], None]: ...
    @property
    def all_gather(self) -> Callable[[int, int, int, int, int], None]: ...
    @property
    def reduce_scatter(self) -> Callable[[int, int, int, int, int, int], None]: ...
    @property
    def send(self) -> Callable[[int, int, int, int, int], None]: ...
    @property
    def recv(self) -> Callable[[int, int, int, int, int], None]: ...

    def all_to_all(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None: ...
    def gather(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None: ...
    def scatter(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None: ...
    def premul_sum(self, scalar: bytes, dtype: int) -> int: ...
    def op_destroy(self, op: int) -> None: ...
    def async_error(self) -> int: ...
    def last_error(self) -> str: ...
    def split(self, color: int, key: int, config: Mapping[str, Any] | None = None) -> Comm | None:
        """``ncclCommSplit``; ``config``: the new communicator's ncclConfig_t fields by
        gpucoll name (None: NCCL's defaults, inherited from this one)."""
        ...
    def shrink(self, exclude: Sequence[int], flags: int, config: Mapping[str, Any] | None = None) -> Comm:
        """``ncclCommShrink``: this communicator without ``exclude`` (used only when
        ``features.comm_shrink``)."""
        ...
    def register(self, ptr: int, nbytes: int) -> int:
        """``ncclCommRegister``: a handle for :meth:`deregister` (0 when NCCL skipped it)."""
        ...
    def deregister(self, handle: int) -> None:
        """``ncclCommDeregister``."""
        ...
    def window_register(self, ptr: int, nbytes: int, flags: int) -> int:
        """``ncclCommWindowRegister`` (collective): the window (0 when the communicator has
        no symmetric support, as NCCL answers then)."""
        ...
    def window_deregister(self, window: int) -> None:
        """``ncclCommWindowDeregister`` (collective)."""
        ...
    def abort(self) -> None: ...
    def destroy(self) -> None: ...


class Runtime(Protocol):
    """The CUDA side: one per process (its methods act on the calling thread's device).

    The hot-path calls are read-only properties so that an implementation may bind
    them to C functions directly (as :class:`CudaRuntime` does) or define methods.
    """

    features: Features

    @property
    def get_device(self) -> Callable[[], int]: ...
    @property
    def set_device(self) -> Callable[[int], None]: ...

    def has_context(self) -> bool:
        """Whether this thread has a CUDA context current (``cuCtxGetCurrent``): a thread
        that never chose a device nor made a runtime call has none."""
        ...

    def exchange_capture_mode(self, mode: int) -> int:
        """``cuThreadExchangeStreamCaptureMode`` for this thread; returns the previous mode."""
        ...

    @property
    def can_exchange_capture_mode(self) -> bool:
        """False where no capture-mode exchange call was found (then
        :meth:`exchange_capture_mode` changes nothing)."""
        ...

    def current_stream_of(self, device: int) -> int:
        """The calling thread's current stream on ``device`` (CuPy's, per device), with no
        ``cudaGetDevice``: whatever device is current."""
        ...

    def stream_of(self, stream: Any, device: int) -> int | None:
        """The handle of ``stream``, a stream object as ``cupy.cuda.get_current_stream()``
        returns, if it is a stream of ``device`` (what :meth:`current_stream_of` would
        answer when it is that device's current stream); None when it is another
        device's (CuPy's null stream, ptr 0 and device -1, is the legacy default stream
        of whichever device: ``device``'s). Reads the object's fields only: no CUDA call. A runtime whose answer
        depends on nothing else sets a class attribute ``stream_of_fixed = True``: its
        callers may keep the answer for the object."""
        ...

    def new_event(self, timing: bool = False) -> int:
        """``cudaEventCreateWithFlags`` on the current device: a raw event handle that the
        caller owns (and pools); :meth:`destroy_event` frees it."""
        ...

    def destroy_event(self, event: int) -> None: ...
    @property
    def record(self) -> Callable[[int, int], None]:
        """(event, stream): record ``event`` on ``stream``."""
        ...
    @property
    def wait_event(self) -> Callable[[int, int], None]:
        """(stream, event): ``stream`` waits for ``event``."""
        ...
    @property
    def elapsed_ms(self) -> Callable[[int, int], float]: ...
    @property
    def is_capturing(self) -> Callable[[int], bool]:
        """True while the stream is being captured into a CUDA graph."""
        ...
    @property
    def group_start(self) -> Callable[[], None]: ...
    @property
    def group_end(self) -> Callable[[], None]: ...

    def device_count(self) -> int: ...
    def compute_capability(self, device: int) -> tuple[int, int]: ...
    def current_stream(self) -> int: ...
    def new_stream(self, high_priority: bool = False) -> Any: ...
    def event(self, pooled: bool = True, timing: bool = False, device: int = -1) -> Event:
        """An event of ``device`` (-1: the current one)."""
        ...
    def query(self, event: int) -> bool: ...
    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def alloc(self, nbytes: int, stream: Any) -> tuple[int, Any]: ...
    def prepare(self, kernel: str, device: int) -> None: ...
    def launch(self, kernel: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None: ...
    def unique_id(self) -> bytes: ...
    def new_comm(self, size: int, uid: bytes, rank: int, config: Mapping[str, Any] | None = None) -> Comm:
        """``ncclCommInitRank(Config)``; ``config``: ncclConfig_t fields by gpucoll name."""
        ...
    def new_comm_scalable(self, size: int, uids: Sequence[bytes], rank: int,
                          config: Mapping[str, Any] | None = None) -> Comm:
        """``ncclCommInitRankScalable``: one communicator from several roots' unique ids
        (the same ids, in the same order, on every rank); only when
        ``features.init_scalable``."""
        ...
    def mem_alloc(self, nbytes: int) -> int:
        """``ncclMemAlloc`` on the current device (cuMem memory NCCL can map for windows)."""
        ...
    def mem_free(self, ptr: int) -> None:
        """``ncclMemFree``."""
        ...
    def is_vmm(self, ptr: int, nbytes: int) -> bool | None:
        """Whether ``[ptr, ptr + nbytes)`` is cuMem (VMM) memory, as ncclMemAlloc gives and
        NCCL's windows need; None when the runtime cannot tell."""
        ...
    def check_config(self, config: Mapping[str, Any]) -> None:
        """Raise BackendUnavailableError naming the fields of ``config`` this runtime
        cannot apply (the loaded NCCL's version is checked apart)."""
        ...
