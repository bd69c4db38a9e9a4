"""A group's DeviceRun: a repeated all_reduce on one CuPy array, bound to the device
backend's Work-less runners (``nccl/quiet.py``), and how the group finds it.

A group keeps its runs by (address, device, dtype, shape, op name) of the array
(``Issuer.device_runs``), and, in front of that key, the array it last ran with each
run (``Issuer.device_seen``, by ``id()``: a weak reference to the array, the op object,
the run; ``Issuer.saw``). The identity look-up builds no key; ``gpucoll.all_reduce`` on
the default group makes it itself (``_collectives.py``: the same test on the same
derived dict, one frame fewer). Why it stays right: for
one CuPy array object, ``data`` (hence the address and device), ``dtype`` and ``size``
cannot be set; its shape can (``x.shape = ...``: same memory, size and dtype, so the
same NCCL call; the flight recorder then shows the shape of the run's first op), and
contiguity is checked per call. A dead array whose id was reused fails the weak
reference (an entry holds no memory); another op object misses the entry. Both dicts
are dropped together (``Issuer.forget_plans``, past 1024 plans); ``device_seen`` also
when it holds 1024 entries.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _buffer
from .._backends.base import Backend
from .._buffer import Buffer
from .._debug.flight_recorder import Kind
from .._work import Work

__all__ = ["DeviceRun", "remember_device_run", "restate"]


def restate(pg: Any) -> None:
    """``ProcessGroup._restate`` (``pg``: a ProcessGroup): derive what the group's device
    path of ``all_reduce`` reads in place of four checks, ``pg._device_runs`` and
    ``pg._device_seen``, and its host path's ``pg._host_open`` (with the issuer's
    ``host_last`` dropped when it closes): the
    issuer's dicts while no completion hook, no DETAIL debug level, no coalescing block
    and no destruction asks for the general path, else empty dicts (the general path
    then makes every check). Called by every writer of the four: the group's creation,
    ``register_on_completion_hook`` (hooks are never removed), a coalescing block's start
    and end (coalescing.py), ``_destroy``. The debug level is read once, when the issuer
    is made (a later change of GPUCOLL_DEBUG applies to groups made afterwards, as for
    the rest of the issuer)."""
    issuer = pg._issuer
    fast = pg._coalescing is None and not pg._destroyed and not issuer.hooks and not issuer.debug_detail
    pg._device_runs = issuer.device_runs if fast else {}
    pg._device_seen = issuer.device_seen if fast else {}
    pg._host_open = issuer.host_runs if fast else {}  # (the host path's, read the same way)
    if not fast:
        issuer.host_last = None


class DeviceRun:
    """A planned synchronous all_reduce on a CuPy array of one (address, device, dtype,
    shape, op), bound to the device backend's Work-less runner
    (``all_reduce_quiet_runner``): a repeated call builds no Buffer and no key, and is
    looked up once. ``desc`` describes the array for the flight recorder (it holds no
    memory). What it caches and why each fact stays true: the array's device (an address
    names one device), dtype, size and shape (the key), the op as checked for the dtype
    (the key), the backend (the group drops its runs with its plans when its device
    backend changes, ``Issuer.forget_plans``, and past 1024 kinds; a destroyed group
    refuses before looking one up) and the backend's planned NCCL call (valid as long as
    the backend's communicator, which the runner checks has not ended, per call).
    Checked again per call: contiguity, the caller's current stream (its device, and a
    capture on it), posted sends; hooks, the debug level, a coalescing block and the
    group's destruction through the group's derived dicts (``ProcessGroup._restate``:
    empty while any of them asks for the general path)."""

    __slots__ = ("backend", "run", "start", "red", "kind", "posted", "stream_of", "device", "legacy",
                 "legacy_handle", "stream_of_fixed", "watched")

    def __init__(self, backend: Backend, runners: Any, red: Any, desc: Buffer) -> None:
        self.backend = backend
        # The backend's runners (NCCL's quiet.py): the synchronous form, run(stream handle, array,
        # seq, entry, group_name) -> issued, when posted.ops is empty; the stream's handle,
        # stream_of(CuPy stream, device) (None: another device's); the async form,
        # start(stream handle, array, seq, entry, group_name) -> its Work (numbered, recorded) or None.
        self.run: Callable[..., bool] = runners.run
        self.start: Callable[..., Work | None] | None = runners.start
        self.posted: Any = runners.posted
        self.stream_of: Callable[[Any, int], int | None] = runners.stream_of
        self.device: int = runners.device
        # CuPy's legacy default stream (ptr 0, one object per device) and its handle, once
        # stream_of answered it and may be kept (runners.stream_of_fixed): no call per op.
        # Only that stream is kept: holding a stream the caller made would keep it alive.
        self.legacy: Any = None
        self.legacy_handle: int | None = None
        self.stream_of_fixed: bool = runners.stream_of_fixed
        self.red = red
        self.kind = Kind(backend.name, desc)  # what the flight recorder shows of each op
        # Whether the group's watchdog watches the backend (``Issuer.watch_run_backend``):
        # once true it stays true, as the watchdog never drops a backend it watches.
        self.watched = False


    def handle(self, current: Any) -> int | None:
        """The handle of ``current``, CuPy's current stream of the run's device, for the
        runners (``stream_of``); None where the op must go the usual way: a stream of
        another device, CuPy's per-thread default stream (the usual way orders it), a
        stream object that cannot be read. CuPy's legacy default stream (ptr 0) and its
        handle are kept where ``stream_of``'s answer may be (``stream_of_fixed``): CuPy
        makes one such object per device, and its handle never changes."""
        try:
            ptr = current.ptr
        except Exception:  # noqa: BLE001  (the usual way words the error)
            return None
        if not ptr and _buffer._cupy_default_stream != 1:
            return None
        stream = self.stream_of(current, self.device)
        if not ptr and stream is not None and self.stream_of_fixed:
            self.legacy, self.legacy_handle = current, stream
        return stream


def remember_device_run(runs: dict[tuple[Any, ...], DeviceRun], backend: Backend, tensor: Any, buf: Buffer,
                        red: Any, op: Any) -> None:
    """Bind the next synchronous all_reduce on this CuPy array (its address, device,
    dtype, shape and op) to the device backend's Work-less runner, once the backend
    has a hot path for it (its first op makes one)."""
    maker = getattr(backend, "all_reduce_runners", None)  # (NCCLBackend's)
    both = maker(buf, op) if maker is not None and buf.nbytes else None
    if both is None:
        return
    mem = tensor.data
    desc = Buffer(0, buf.nbytes, buf.dtype, buf.shape, buf.device)  # what the flight recorder shows
    runs[(mem.ptr, mem.device_id, tensor.dtype, tensor.shape, op._name_)] = DeviceRun(backend, both, red, desc)
