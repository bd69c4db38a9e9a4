"""ProcessGroup: a set of ranks that run collectives together.

A group owns its store namespace, its backends, its watchdog and its flight
recorder. Each call is dispatched by where its arrays live: host memory goes to
the group's CPU backend, device memory to its NCCL backend (created on first
device op unless ``device_id`` was given). Object collectives and barriers always
use the CPU backend, so a group made for NCCL still has one (DESIGN.md,
Multi-backend groups).

Methods here take *group* ranks; the module-level functions in
:mod:`gpucoll.collectives` take torch's global ``src``/``dst`` and translate.
Every check that can be made locally (ranks in range, shapes and dtypes of
outputs, split sizes, writability, op valid for the dtype) is made before the
backend sees the call, with the same rules on every rank.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from . import array as _array
from ._buffer import Buffer, DType
from .backends.base import Backend
from .errors import BackendUnavailableError, DistBackendError, DistError
from .flight_recorder import FlightRecorder, recorder_capacity
from .reduce_op import PremulSum, ReduceOp, ReduceOpLike, as_reduce_op
from .store import PrefixStore, Store
from .work import Work, WorkInfo
from ._watchdog import Watchdog
from ._debug import DEBUG_ENV, DebugLevel, call_site, get_debug_level

__all__ = ["ProcessGroup", "BACKENDS", "BackendFactory", "normalize_backend", "default_backend", "debug_level",
           "DEBUG_ENV"]

_FINGERPRINT_BYTES = 256
_SHAPES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single"})  # per-peer sizes differ by design


def debug_level() -> str:
    """The debug level's name: ``"OFF"``, ``"INFO"`` or ``"DETAIL"`` (see gpucoll._debug).

    Raises:
        ValueError: ``GPUCOLL_DEBUG`` (or ``TORCH_DISTRIBUTED_DEBUG``) holds another value.
    """
    return get_debug_level().name


def _op_name(red: Any) -> str:
    if red is None:
        return ""
    name = getattr(red, "name", None)
    return str(name) if name is not None else type(red).__name__

BackendFactory = Callable[..., Backend]


def _make_cpu(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
              device_id: int | None) -> Backend:
    from .backends.cpu import CPUBackend

    backend: Backend = CPUBackend(store, rank, size, timeout=timeout, group_name=group_name)
    return backend


def _make_nccl(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
               device_id: int | None) -> Backend:
    from .backends.nccl import NCCLBackend, nccl_unavailable_reason

    reason = nccl_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"group {group_name!r} needs the NCCL backend, which cannot run here: {reason}")
    backend: Backend = NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name,
                                   device_id=device_id)
    return backend


def _make_fake(store: Store, rank: int, size: int, *, timeout: float, group_name: str,
               device_id: int | None) -> Backend:
    from .backends.fake import FakeBackend

    return FakeBackend(store, rank, size, timeout=timeout, group_name=group_name)


BACKENDS: dict[str, BackendFactory] = {"cpu": _make_cpu, "nccl": _make_nccl, "fake": _make_fake}
"""Backend constructors by name, called as ``factory(store, rank, size, *, timeout,
group_name, device_id)``. ``cpu`` serves host arrays, objects and barriers in every
group; ``nccl`` serves device arrays in groups created with backend "nccl"; ``fake``
serves everything in groups created with backend "fake" (no communication)."""

_BACKEND_GRACE_S = 0.5
"""Backends get the group's timeout plus this, so that a stuck op is normally caught by
the group's own wait or watchdog, whose error names the op, its sequence number and
the flight-recorder dump. (An op the backend runs on the caller's thread can only
time out inside the backend; its error is then reworded the same way.) A dead peer
is still reported by the backend at once."""

_ALIASES = {"cpu": "cpu", "gloo": "cpu", "nccl": "nccl", "cuda": "nccl", "cpu:gloo,cuda:nccl": "nccl",
            "fake": "fake"}


def nccl_usable() -> bool:
    """True when the NCCL backend can run here (CuPy, NCCL and a GPU); may import CuPy."""
    try:
        from .backends.nccl import nccl_unavailable_reason
    except ImportError:
        return False
    return nccl_unavailable_reason() is None


def default_backend() -> str:
    """``"nccl"`` when a GPU and NCCL are usable, ``"cpu"`` otherwise."""
    return "nccl" if nccl_usable() else "cpu"


def normalize_backend(backend: str | None) -> str:
    """Map a backend spelling to ``"cpu"`` or ``"nccl"`` (``None`` picks :func:`default_backend`).

    ``"gloo"`` and torch's ``"cpu:gloo,cuda:nccl"`` are accepted so scripts port unchanged.

    Raises:
        ValueError: an unknown backend name.
    """
    if backend is None:
        return default_backend()
    if isinstance(backend, str):
        name = _ALIASES.get(backend.strip().lower())
        if name is not None:
            return name
    raise ValueError(f"backend must be one of 'cpu', 'nccl', 'fake' (or 'gloo', None); got {backend!r}")


# ----- local validation, same on every rank -----

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _check_op(op: Any, dtype: DType) -> ReduceOpLike:
    if op is ReduceOp.SUM:
        return op
    checked = as_reduce_op(op)
    base = checked.op if isinstance(checked, PremulSum) else checked
    kind = dtype.kind
    if base in _BITWISE and kind not in "biu":
        raise TypeError(f"op={base.name} needs integer or bool arrays; got dtype {dtype.name}")
    if base in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(f"op={base.name} is undefined for complex dtype {dtype.name} (no ordering)")
    if base is ReduceOp.AVG and kind == "b":
        raise TypeError("op=AVG is undefined for bool arrays")
    if base is ReduceOp.PREMUL_SUM and kind not in "fc":
        raise TypeError(f"op=PREMUL_SUM needs floating-point or complex arrays; got dtype {dtype.name}")
    return checked


def _same_layout(buf: Buffer, ref: Buffer, name: str, ref_name: str) -> None:
    if buf.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {buf.dtype.name} but {ref_name} has {ref.dtype.name}; they must match")
    if buf.nbytes != ref.nbytes:
        raise ValueError(f"{name} has shape {buf.shape} ({buf.numel} elements) but {ref_name} has shape "
                         f"{ref.shape} ({ref.numel} elements); they must match")


def _row_elems(buf: Buffer, name: str) -> int:
    if not buf.shape:
        raise ValueError(f"{name} must have at least one dimension to be split along dim 0; got a 0-d array")
    row = 1
    for s in buf.shape[1:]:
        row *= s
    return row


def _splits(sizes: Sequence[int] | None, dim0: int, n: int, name: str, tensor: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if dim0 % n:
            raise ValueError(f"{tensor} has {dim0} rows along dim 0, not divisible by the group size {n}; "
                             f"pass {name}")
        return [dim0 // n] * n
    out = list(sizes)
    if len(out) != n or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in out):
        raise ValueError(f"{name} must be {n} non-negative ints (one per rank); got {sizes!r}")
    if sum(out) != dim0:
        raise ValueError(f"{name}={out} sums to {sum(out)} but {tensor} has {dim0} rows along dim 0")
    return out


class ProcessGroup:
    """The ranks of one communicator, with torch's ``rank()``/``size()`` accessors.

    Made by :func:`gpucoll.init_process_group`, :func:`gpucoll.new_group` and
    friends; not meant to be constructed directly.

    Args:
        store: a store namespace private to this group.
        rank: this process's rank in the group.
        size: the group's size.
        group_name: a name unique in the job (same on every member).
        global_ranks: the members' ranks in the default group, in group-rank order.
        timeout: seconds an op may take before the group is aborted.
        backend: ``"cpu"`` or ``"nccl"``.
        device_id: for NCCL groups, the CUDA device to bind now (else on first device op).
        device_backend: for NCCL groups, a device backend already made for this group
            (by :meth:`_split_device_backend` of its parent); used instead of a new one.
    """

    def __init__(self, store: Store, rank: int, size: int, *, group_name: str,
                 global_ranks: Sequence[int], timeout: float, backend: str = "cpu",
                 device_id: int | None = None, device_backend: Backend | None = None,
                 group_desc: str = "") -> None:
        self._store = store
        self.group_desc = group_desc
        self._rank = rank
        self._size = size
        self.group_name = group_name
        self.global_ranks: tuple[int, ...] = tuple(global_ranks)
        self._to_group = {g: i for i, g in enumerate(self.global_ranks)}
        self.timeout = timeout
        self.backend_name = backend
        self._device_id = device_id
        self._seq = 0
        self._destroyed = False
        self._coalescing: Any = None  # a collectives.CoalescingManager while one is open
        self._split_count = 0
        self._last_release: str | None = None  # monitored_barrier's key still to delete
        self._abort_reason: str | None = None
        self._abort_lock = threading.Lock()
        self._hook_errors: list[tuple[Callable[[WorkInfo], None], BaseException]] = []
        level = get_debug_level()
        self._debug_detail = level >= DebugLevel.DETAIL
        self._debug_info = level >= DebugLevel.INFO
        capacity = recorder_capacity()
        self._recorder = FlightRecorder(group_name, rank, self.global_ranks[rank], size, capacity) \
            if capacity > 0 else None
        if self._recorder is not None:
            self._recorder.group_desc = group_desc
        self._watchdog = Watchdog(group_name, timeout, self._on_timeout, self._on_hook_error)
        self._hooks = self._watchdog.hooks
        # A "fake" group's one backend serves host and device arrays alike (backends/fake.py).
        self._cpu: Backend = BACKENDS["fake" if backend == "fake" else "cpu"](PrefixStore("cpu", store), rank, size,
                                             timeout=timeout + _BACKEND_GRACE_S, group_name=group_name,
                                             device_id=None)
        self._nccl: Backend | None = None
        # Bound to a device at creation on every rank: only then may new groups split
        # its communicator (one made by a first device op might exist on some ranks
        # and not yet on others when they create the next group).
        self._bound = backend == "nccl" and (device_id is not None or device_backend is not None)
        if device_backend is not None:
            if backend != "nccl":
                raise ValueError(f"group {group_name!r}: a device backend was given to a {backend} group")
            self._nccl = device_backend
            self._device_id = getattr(device_backend, "device", device_id)
        elif backend == "nccl" and device_id is not None:
            try:
                self._nccl = self._make_device_backend(device_id)
            except BaseException:
                self._cpu.shutdown()
                raise

    # ----- identity -----
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return self._size

    @property
    def store(self) -> Store:
        """The group's private store namespace."""
        return self._store

    def get_group_rank(self, global_rank: int, name: str = "global_rank") -> int:
        """The group rank of a default-group rank.

        Raises:
            ValueError: ``global_rank`` is not a member of this group.
        """
        try:
            return self._to_group[global_rank]
        except (KeyError, TypeError):
            raise ValueError(f"{name}={global_rank!r} is not a member of group {self.group_name!r} "
                             f"(its global ranks: {list(self.global_ranks)})") from None

    def get_global_rank(self, group_rank: int, name: str = "group_rank") -> int:
        """The default-group rank of a group rank.

        Raises:
            ValueError: ``group_rank`` is out of range.
        """
        self._check_rank(group_rank, name)
        return self.global_ranks[group_rank]

    def __repr__(self) -> str:
        state = " destroyed" if self._destroyed else ""
        desc = f" desc={self.group_desc!r}" if self.group_desc else ""
        return (f"<ProcessGroup {self.group_name!r}{desc} rank={self._rank}/{self._size} "
                f"backend={self.backend_name}{state}>")

    def _label(self) -> str:
        """The group's name (and description) as errors show it."""
        return f"{self.group_name!r} ({self.group_desc})" if self.group_desc else repr(self.group_name)

    def get_sequence_number(self) -> int:
        """The sequence number of the group's latest op (0 before any): every op a group
        issues takes the next number, the same on every rank, so ranks whose numbers
        differ have issued different numbers of ops. Also in errors, hooks' WorkInfo
        and the flight recorder."""
        return self._seq

    # ----- hooks, flight recorder -----
    def register_on_completion_hook(self, hook: Callable[[WorkInfo], None]) -> None:
        """Call ``hook(info)`` after each op of this group completes.

        Hooks run on the group's watchdog thread, never the caller's, in completion
        order, with a :class:`~gpucoll.work.WorkInfo` (``op_type``, ``seq``,
        ``time_started``, ``time_finished``, ``active_duration``, ...). A hook must
        not block for long. A hook that raises is kept running; its first error is
        raised by ``destroy_process_group`` (raising mid-job would desynchronise ranks).

        Example:
            >>> durations = []
            >>> group.register_on_completion_hook(lambda info: durations.append(info.active_duration))
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable; got {type(hook).__name__}")
        self._check_usable()
        self._hooks.append(hook)

    def dump_flight_recorder(self, path: str | None = None) -> str:
        """Return the flight recorder's JSON (the group's last ops); also write it to ``path`` if given.

        Raises:
            RuntimeError: recording is off (``GPUCOLL_FLIGHT_RECORDER_SIZE=0``).
        """
        if self._recorder is None:
            raise RuntimeError("the flight recorder is off (GPUCOLL_FLIGHT_RECORDER_SIZE=0)")
        if path is not None:
            self._recorder.dump(path, reason="on request")
        return self._recorder.to_json(reason="on request")

    # ----- dispatch and issue -----
    def _check_usable(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"process group {self.group_name!r} has been destroyed; "
                               "create a new one to run collectives")

    def _check_rank(self, r: Any, name: str) -> int:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._size:
            raise ValueError(f"{name}={r!r} is out of range for group {self.group_name!r} of size {self._size}")
        return r

    def _not_coalescable(self, op: str) -> None:
        raise RuntimeError(f"{op} cannot run inside gpucoll.coalescing(); only all_reduce, "
                           "all_gather_single, reduce_scatter_single, isend and irecv can")

    def _backend_for(self, buf: Buffer, name: str) -> Backend:
        if buf.device.type == "cpu" or self.backend_name == "fake":
            return self._cpu
        nccl = self._nccl
        if nccl is None:
            if self.backend_name != "nccl":
                raise TypeError(
                    f"{name} is a device array ({buf.device}) but group {self.group_name!r} uses the cpu "
                    "backend, which moves host arrays only; use init_process_group('nccl') or "
                    "new_group(backend='nccl') for device arrays")
            nccl = self._nccl = self._make_device_backend(buf.device.index)
        elif buf.device.index != self._device_id:
            raise ValueError(f"{name} is on {buf.device} but group {self.group_name!r} communicates "
                             f"on cuda:{self._device_id}")
        return nccl

    def _make_device_backend(self, device_id: int) -> Backend:
        self._device_id = device_id
        return BACKENDS["nccl"](PrefixStore("nccl", self._store), self._rank, self._size,
                                timeout=self.timeout + _BACKEND_GRACE_S, group_name=self.group_name,
                                device_id=device_id)

    def _split_device_backend(self, members: Sequence[int] | None, color: int, *, store: Store,
                              group_name: str, timeout: float) -> Backend | None:
        """The device backend of a new group carved out of this one with ``ncclCommSplit``.

        Every rank of this group must call it for each new group, in the same order,
        members or not, whenever this group's device backend can split (see
        ``NCCLBackend.can_split``): NCCL's split is a collective of the parent
        communicator.

        Args:
            members: the new group's members as ranks of this group, in its rank order;
                None on a rank that joins no new group in this call.
            color: tells apart the disjoint groups one call makes (split_group).
            store: the new group's store (the one its ProcessGroup gets).
            group_name, timeout: the new group's.

        Returns:
            The new group's device backend on members; None on non-members, and
            wherever no split is possible (a cpu group, a group not bound to a device
            at creation, an NCCL without ncclCommSplit): the new group then makes its
            own communicator.
        """
        nccl = self._nccl
        if not self._bound or nccl is None or not getattr(nccl, "can_split", False):
            return None
        backend: Backend | None = nccl.split(  # type: ignore[attr-defined]
            members, color=color, store=PrefixStore("nccl", store), group_name=group_name,
            timeout=timeout + _BACKEND_GRACE_S)
        return backend

    def _backend_for_all(self, bufs: Sequence[Buffer], names: Sequence[str]) -> Backend:
        first = bufs[0]
        for buf, name in zip(bufs[1:], names[1:]):
            if buf.device != first.device:
                raise TypeError(f"cannot mix memory kinds in one call: {names[0]} is on {first.device} "
                                f"but {name} is on {buf.device}")
        return self._backend_for(first, names[0])

    def _issue(self, backend: Backend, start: Callable[[], Work], buf: Buffer | None,
               outputs: list[Any], peer: int = -1, op: str = "", red: Any = None) -> Work:
        self._seq += 1
        seq = self._seq
        if self._debug_detail and op:
            self._check_across_ranks(op, seq, buf, peer, red)
        recorder = self._recorder
        entry = None
        if recorder is not None:
            # Recorded before it starts: a host op may run to its end inside start().
            entry = recorder.begin(seq, op or start.__name__.strip("<>"), backend.name, buf, peer)
            if self._debug_info:
                entry.where = call_site()
        work = start()
        work.seq = seq
        work.group_name = self.group_name
        if outputs:
            work._result[:] = outputs
        if entry is not None:
            recorder.attach(entry, work)  # type: ignore[union-attr]
        if self._hooks:
            work._add_done_callback(self._watchdog.completed)
        return work

    def _check_across_ranks(self, op: str, seq: int, buf: Buffer | None, peer: int, red: Any) -> None:
        """Debug level DETAIL: before a collective (any backend), compare what every rank
        is about to issue (through the CPU backend) and raise on every rank if they
        differ, naming the fields that differ and each rank's value: the backend itself
        would hang, fail obscurely, or quietly compute garbage."""
        shape = "" if buf is None or op in _SHAPES_MAY_DIFFER else str(tuple(buf.shape))
        fields = (op, f"(seq {seq})", buf.dtype.name if buf is not None else "", shape,
                  f"root={peer}" if peer >= 0 else "", _op_name(red))
        text = "\x1f".join(fields).encode()
        if len(text) > _FINGERPRINT_BYTES:
            text = text[:_FINGERPRINT_BYTES - 41] + b"#" + hashlib.sha1(text).hexdigest().encode()
        mine = np.zeros(_FINGERPRINT_BYTES, np.uint8)
        mine[:len(text)] = np.frombuffer(text, np.uint8)
        rows = [np.zeros(_FINGERPRINT_BYTES, np.uint8) for _ in range(self._size)]
        work = self._cpu.all_gather([_array.as_buffer(r, writable=True) for r in rows], _array.as_buffer(mine))
        try:
            work.wait(self.timeout)
        except DistError as exc:
            raise DistBackendError(f"GPUCOLL_DEBUG=DETAIL: checking {op} (seq {seq}) on group {self.group_name!r} "
                                   f"across ranks failed: {exc}") from exc
        seen = [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]
        if len(set(seen)) > 1:
            per_rank = [t.split("\x1f") for t in seen]
            names = ("op", "seq", "dtype", "shape", "root", "reduce op")
            differ = []
            for i, name in enumerate(names):
                values = [f[i] if i < len(f) else "?" for f in per_rank]
                if len(set(values)) > 1:
                    differ.append(f"{name} (" + ", ".join(f"rank {r}: {v or '-'}" for r, v in enumerate(values)) + ")")
            listing = "; ".join(f"rank {i}: {' '.join(x for x in f if x)}" for i, f in enumerate(per_rank))
            raise DistBackendError(f"GPUCOLL_DEBUG=DETAIL: the ranks of group {self._label()} are about to "
                                   f"issue different collectives, which the backend would hang on or compute "
                                   f"wrongly; they differ in {'; '.join(differ) or 'their fingerprints'}. "
                                   f"Each rank: {listing}")

    def _finish(self, backend: Backend, work: Work, async_op: bool) -> Work | None:
        """Return ``work`` (async) or wait for it as a synchronous op does."""
        device = backend is not self._cpu
        if async_op:
            if not work._done.is_set():
                self._watchdog.track(work, backend, device)
            return work
        if device:
            # Makes the caller's stream wait (DESIGN.md, Streams); the host goes on.
            work.wait()
            if not work._done.is_set():
                self._watchdog.track(work, backend, True)
            return None
        self._wait_host(work, backend)
        return None

    def _wait_host(self, work: Work, backend: Backend) -> None:
        if not work._done.is_set():
            left = self.timeout - (time.perf_counter() - work._t0)
            if left <= 0 or not work._done.wait(left):
                self._on_timeout(work, backend)
        exc = work._exc
        if exc is None:
            return
        if time.perf_counter() - work._t0 >= self.timeout:
            reason = self._on_timeout(work, backend)
            if reason not in str(exc):
                raise DistBackendError(f"{reason}. The backend reported: {exc}") from exc
        work.wait()  # raises the op's error as Work.wait() words it

    def _on_timeout(self, work: Work, backend: Backend) -> str:
        """Abort ``backend`` over ``work`` (once per group), dump the flight recorder; the reason."""
        with self._abort_lock:
            if self._abort_reason is None:
                where = "flight recorder off"
                if self._recorder is not None:
                    try:
                        where = f"flight recorder dumped to {self._recorder.dump(reason=work._name())}"
                    except OSError as exc:
                        where = f"flight recorder could not be written: {exc}"
                self._abort_reason = (
                    f"{work.op_type} (seq {work.seq}) on group {self._label()} (rank {self._rank} of "
                    f"{self._size}) did not complete within the group's timeout of {self.timeout:g} s; "
                    f"the group's {backend.name} backend was aborted ({where})")
            reason = self._abort_reason
        backend.abort(reason)
        work._set_exception(DistBackendError(reason))  # no-op if the op already failed
        return reason

    def _on_hook_error(self, hook: Callable[[WorkInfo], None], exc: BaseException) -> None:
        self._hook_errors.append((hook, exc))

    # ----- reductions -----
    def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across the group, in place on every rank."""
        self._check_usable()
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        red = _check_op(op, buf.dtype)
        if self._coalescing is not None:
            return self._coalescing._defer(self, "all_reduce", red, ("tensor", buf, tensor), async_op)  # type: ignore[no-any-return]
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.all_reduce(buf, red), buf, [tensor], op="all_reduce", red=red)
        return self._finish(backend, work, async_op)

    def _all_reduce_into(self, output: Any, input: Any, op: Any = ReduceOp.SUM,
                         async_op: bool = False) -> Work | None:
        """``output`` = the reduction of every rank's ``input`` (the functional API's
        all_reduce, gpucoll-bench's out-of-place all_reduce; ``input`` is left alone).
        A device backend that reduces out of place (NCCL) does it in one op; otherwise
        ``input`` is copied into ``output``, which is then reduced in place."""
        self._check_usable()
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        if out.dtype != inp.dtype or out.numel != inp.numel:
            raise ValueError(f"output ({out.dtype.name} x {out.numel}) must match input "
                             f"({inp.dtype.name} x {inp.numel})")
        red = _check_op(op, out.dtype)
        into = None
        if self._coalescing is None:
            backend = self._backend_for_all([out, inp], ["output", "input"])
            into = getattr(backend, "all_reduce_into", None)
        if into is None:
            _array.copy_buffer(out, inp)
            return self.all_reduce(out, op, async_op)
        work = self._issue(backend, lambda: into(out, inp, red), out, [output], op="all_reduce", red=red)
        return self._finish(backend, work, async_op)

    def all_reduce_coalesced(self, tensors: Sequence[Any], op: Any = ReduceOp.SUM,
                             async_op: bool = False) -> Work | None:
        """All-reduce several arrays as one op."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_reduce_coalesced")
        names = [f"tensors[{i}]" for i in range(len(tensors))]
        if not names:
            raise ValueError("tensors must contain at least one array")
        bufs = [_array.as_buffer(t, name=n, writable=True) for t, n in zip(tensors, names)]
        reds = [_check_op(op, b.dtype) for b in bufs]
        backend = self._backend_for_all(bufs, names)
        work = self._issue(backend, lambda: backend.all_reduce_coalesced(bufs, reds[0]), bufs[0], list(tensors),
                           op="all_reduce_coalesced", red=reds[0])
        return self._finish(backend, work, async_op)

    def reduce(self, tensor: Any, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` into rank ``dst``'s (group rank) copy."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("reduce")
        self._check_rank(dst, "group_dst")
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        red = _check_op(op, buf.dtype)
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.reduce(buf, dst, red), buf, [tensor], dst, op="reduce", red=red)
        return self._finish(backend, work, async_op)

    def reduce_scatter(self, output: Any, input_list: Sequence[Any], op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Work | None:
        """Reduce ``input_list[i]`` over ranks into rank i's ``output``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("reduce_scatter")
        out = _array.as_buffer(output, name="output", writable=True)
        ins = self._list_like(input_list, "input_list", out, "output", writable=False)
        red = _check_op(op, out.dtype)
        backend = self._backend_for_all([out, *ins], ["output"] + [f"input_list[{i}]" for i in range(len(ins))])
        work = self._issue(backend, lambda: backend.reduce_scatter(out, ins, red), out, [output], op="reduce_scatter",
                           red=red)
        return self._finish(backend, work, async_op)

    def reduce_scatter_single(self, output: Any, input: Any, op: Any = ReduceOp.SUM,
                              async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size`` consecutive chunks) over ranks; rank i gets chunk i in ``output``."""
        self._check_usable()
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        self._check_chunked(inp, out, "input", "output")
        red = _check_op(op, out.dtype)
        if self._coalescing is not None:
            return self._coalescing._defer(self, "reduce_scatter_single", red,  # type: ignore[no-any-return]
                                           ("output", out, output, inp), async_op)
        backend = self._backend_for_all([out, inp], ["output", "input"])
        work = self._issue(backend, lambda: backend.reduce_scatter_single(out, inp, red), out, [output],
                           op="reduce_scatter_single", red=red)
        return self._finish(backend, work, async_op)

    # ----- data movement -----
    def broadcast(self, tensor: Any, src: int, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from group rank ``src`` to every rank."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("broadcast")
        self._check_rank(src, "group_src")
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.broadcast(buf, src), buf, [tensor], src, op="broadcast")
        return self._finish(backend, work, async_op)

    def all_gather(self, tensor_list: Sequence[Any], tensor: Any, async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list`` (one array per rank) on every rank."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_gather")
        inp = _array.as_buffer(tensor, name="tensor")
        outs = self._list_like(tensor_list, "tensor_list", inp, "tensor", writable=True)
        backend = self._backend_for_all([inp, *outs], ["tensor"] + [f"tensor_list[{i}]" for i in range(len(outs))])
        work = self._issue(backend, lambda: backend.all_gather(outs, inp), inp, list(tensor_list), op="all_gather")
        return self._finish(backend, work, async_op)

    def all_gather_single(self, output: Any, input: Any, async_op: bool = False) -> Work | None:
        """Gather every rank's ``input`` into ``output`` (``size`` consecutive chunks, rank order)."""
        self._check_usable()
        out = _array.as_buffer(output, name="output_tensor", writable=True)
        inp = _array.as_buffer(input, name="input_tensor")
        self._check_chunked(out, inp, "output_tensor", "input_tensor")
        if self._coalescing is not None:
            return self._coalescing._defer(self, "all_gather_single", None,  # type: ignore[no-any-return]
                                           ("output_tensor", out, output, inp), async_op)
        backend = self._backend_for_all([out, inp], ["output_tensor", "input_tensor"])
        work = self._issue(backend, lambda: backend.all_gather_single(out, inp), inp, [output], op="all_gather_single")
        return self._finish(backend, work, async_op)

    def all_gather_coalesced(self, output_lists: Sequence[Sequence[Any]], input_list: Sequence[Any],
                             async_op: bool = False) -> Work | None:
        """Several all_gathers as one op: ``output_lists[k][r]`` gets rank r's ``input_list[k]``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_gather_coalesced")
        if len(output_lists) != len(input_list) or not input_list:
            raise ValueError(f"output_tensor_lists must have one list per input ({len(input_list)}); "
                             f"got {len(output_lists)}")
        ins = [_array.as_buffer(t, name=f"input_tensor_list[{k}]") for k, t in enumerate(input_list)]
        outs = [self._list_like(row, f"output_tensor_lists[{k}]", ins[k], f"input_tensor_list[{k}]", writable=True)
                for k, row in enumerate(output_lists)]
        flat = ins + [b for row in outs for b in row]
        names = [f"input_tensor_list[{k}]" for k in range(len(ins))] + \
            [f"output_tensor_lists[{k}][{r}]" for k, row in enumerate(outs) for r in range(len(row))]
        backend = self._backend_for_all(flat, names)
        work = self._issue(backend, lambda: backend.all_gather_coalesced(outs, ins), ins[0],
                           [list(row) for row in output_lists], op="all_gather_coalesced")
        return self._finish(backend, work, async_op)

    def gather(self, tensor: Any, gather_list: Sequence[Any] | None, dst: int,
               async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``gather_list`` on group rank ``dst``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("gather")
        self._check_rank(dst, "group_dst")
        inp = _array.as_buffer(tensor, name="tensor")
        outs: list[Buffer] | None = None
        if self._rank == dst:
            if not gather_list:
                raise ValueError(f"gather_list is required on the destination rank {dst} "
                                 f"({self._size} arrays shaped like tensor)")
            outs = self._list_like(gather_list, "gather_list", inp, "tensor", writable=True)
        elif gather_list:
            raise ValueError(f"gather_list must not be given on a non-destination rank (this is rank "
                             f"{self._rank}, dst is {dst})")
        backend = self._backend_for_all([inp, *(outs or ())], ["tensor"] + ["gather_list"] * len(outs or ()))
        work = self._issue(backend, lambda: backend.gather(outs, inp, dst), inp,
                           list(gather_list) if gather_list else [], dst, op="gather")
        return self._finish(backend, work, async_op)

    def scatter(self, tensor: Any, scatter_list: Sequence[Any] | None, src: int,
                async_op: bool = False) -> Work | None:
        """Send ``scatter_list[i]`` from group rank ``src`` into rank i's ``tensor``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("scatter")
        self._check_rank(src, "group_src")
        out = _array.as_buffer(tensor, name="tensor", writable=True)
        ins: list[Buffer] | None = None
        if self._rank == src:
            if not scatter_list:
                raise ValueError(f"scatter_list is required on the source rank {src} "
                                 f"({self._size} arrays shaped like tensor)")
            ins = self._list_like(scatter_list, "scatter_list", out, "tensor", writable=False)
        elif scatter_list:
            raise ValueError(f"scatter_list must not be given on a non-source rank (this is rank "
                             f"{self._rank}, src is {src})")
        backend = self._backend_for_all([out, *(ins or ())], ["tensor"] + ["scatter_list"] * len(ins or ()))
        work = self._issue(backend, lambda: backend.scatter(out, ins, src), out, [tensor], src, op="scatter")
        return self._finish(backend, work, async_op)

    def all_to_all(self, output_list: Sequence[Any], input_list: Sequence[Any],
                   async_op: bool = False) -> Work | None:
        """Rank i sends ``input_list[j]`` to rank j, which receives it in ``output_list[i]``."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_to_all")
        for lst, name in ((output_list, "output_tensor_list"), (input_list, "input_tensor_list")):
            if len(lst) != self._size:
                raise ValueError(f"{name} must have {self._size} arrays (one per rank); got {len(lst)}")
        outs = [_array.as_buffer(t, name=f"output_tensor_list[{i}]", writable=True) for i, t in enumerate(output_list)]
        ins = [_array.as_buffer(t, name=f"input_tensor_list[{i}]") for i, t in enumerate(input_list)]
        for i, b in enumerate(outs + ins):
            if b.dtype != ins[0].dtype:
                raise TypeError(f"all arrays of all_to_all must share one dtype; got {b.dtype.name} "
                                f"and {ins[0].dtype.name}")
        names = [f"output_tensor_list[{i}]" for i in range(len(outs))] + \
                [f"input_tensor_list[{i}]" for i in range(len(ins))]
        backend = self._backend_for_all(outs + ins, names)
        work = self._issue(backend, lambda: backend.all_to_all(outs, ins), ins[0], list(output_list),
                           op="all_to_all")
        return self._finish(backend, work, async_op)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """Split ``input`` along dim 0 (``input_split_sizes`` rows to each rank), exchange, and
        concatenate what arrives in ``output`` (``output_split_sizes`` rows from each rank)."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("all_to_all_single")
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        if out.dtype != inp.dtype:
            raise TypeError(f"output has dtype {out.dtype.name} but input has {inp.dtype.name}; they must match")
        row_out, row_in = _row_elems(out, "output"), _row_elems(inp, "input")
        if row_out != row_in:
            raise ValueError(f"output rows (shape {out.shape}) and input rows (shape {inp.shape}) must have "
                             "the same number of elements")
        out_rows = _splits(output_split_sizes, out.shape[0], self._size, "output_split_sizes", "output")
        in_rows = _splits(input_split_sizes, inp.shape[0], self._size, "input_split_sizes", "input")
        out_counts = [r * row_out for r in out_rows]
        in_counts = [r * row_in for r in in_rows]
        backend = self._backend_for_all([out, inp], ["output", "input"])
        work = self._issue(backend, lambda: backend.all_to_all_single(out, inp, out_counts, in_counts), inp,
                           [output], op="all_to_all_single")
        return self._finish(backend, work, async_op)

    # ----- point to point -----
    def send(self, tensor: Any, dst: int, tag: int = 0, async_op: bool = True) -> Work:
        """Send ``tensor`` to group rank ``dst``; returns its Work (completed unless ``async_op``)."""
        self._check_usable()
        buf = self._p2p_check(tensor, dst, tag, "group_dst", writable=False)
        if self._coalescing is not None:
            return self._coalescing._defer(self, "p2p", None, ("send", buf, tensor, dst, tag), True)  # type: ignore[no-any-return]
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.send(buf, dst, tag), buf, [], dst)
        self._finish(backend, work, async_op)
        return work

    def recv(self, tensor: Any, src: int | None, tag: int = 0, async_op: bool = True) -> Work:
        """Receive into ``tensor`` from group rank ``src`` (None: any rank); returns its Work
        (completed unless ``async_op``; ``work.source_rank()`` names the sender)."""
        self._check_usable()
        buf = self._p2p_check(tensor, src, tag, "group_src", writable=True)
        if self._coalescing is not None:
            if src is None:
                raise ValueError("recv from any source (src=None) cannot run inside gpucoll.coalescing()")
            return self._coalescing._defer(self, "p2p", None, ("recv", buf, tensor, src, tag), True)  # type: ignore[no-any-return]
        backend = self._backend_for(buf, "tensor")
        work = self._issue(backend, lambda: backend.recv(buf, src, tag), buf, [tensor],
                           -1 if src is None else src)
        self._finish(backend, work, async_op)
        return work

    def batch_p2p(self, ops: Sequence[tuple[str, Any, int, int]]) -> Work:
        """Post ``(kind, array, group peer, tag)`` sends/receives together; one Work for all."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("batch_isend_irecv")
        if not ops:
            raise ValueError("p2p_op_list must not be empty")
        bufs = [self._p2p_check(t, peer, tag, "peer", writable=(kind == "recv")) for kind, t, peer, tag in ops]
        backend = self._backend_for_all(bufs, [f"p2p_op_list[{i}].tensor" for i in range(len(bufs))])
        batch = [(kind, b, peer, tag) for (kind, _, peer, tag), b in zip(ops, bufs)]
        outputs = [t for kind, t, _, _ in ops if kind == "recv"]
        work = self._issue(backend, lambda: backend.batch_p2p(batch), bufs[0], outputs)
        self._finish(backend, work, True)
        return work

    def _p2p_check(self, tensor: Any, peer: int | None, tag: int, name: str, writable: bool) -> Buffer:
        if peer is not None:
            self._check_rank(peer, name)
            if peer == self._rank:
                raise ValueError(f"{name}={peer} is this rank itself; send/recv need another rank")
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"tag must be an int; got {tag!r}")
        return _array.as_buffer(tensor, name="tensor", writable=writable)

    # ----- control -----
    def barrier(self, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has called barrier (host-side; CPU backend)."""
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("barrier")
        backend = self._cpu
        work = self._issue(backend, backend.barrier, None, [])
        return self._finish(backend, work, async_op)

    def monitored_barrier(self, timeout: float, wait_all_ranks: bool = False) -> None:
        """A barrier through the store that names the ranks that did not arrive.

        Rank 0 waits up to ``timeout`` for every rank's arrival key, then releases
        the others with "ok" or with the list of missing ranks (so every rank that
        is still alive raises the same error).

        Raises:
            DistBackendError: some ranks did not arrive in time (named in the message).
        """
        self._check_usable()
        if self._coalescing is not None:
            self._not_coalescable("monitored_barrier")
        self._seq += 1
        seq = self._seq
        if self.backend_name == "fake":
            return  # no other rank exists to wait for
        prefix = f"monitored_barrier/{seq}"
        what = f"monitored_barrier (seq {seq}) on group {self.group_name!r}"
        store = self._store
        store.set(f"{prefix}/arrived/{self._rank}", b"1")
        if self._rank == 0:
            deadline = time.monotonic() + timeout
            missing: list[int] = []
            for r in range(1, self._size):
                key = f"{prefix}/arrived/{r}"
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        if not store.check([key]):
                            raise TimeoutError
                    else:
                        store.wait([key], left)
                except Exception:
                    missing.append(r)
                    if not wait_all_ranks:
                        break
            verdict = "ok" if not missing else ",".join(map(str, missing))
            store.set(f"{prefix}/released", verdict.encode())
            if not missing:
                # Everyone arrived, so everyone has read the previous barrier's release key.
                for r in range(self._size):
                    store.delete_key(f"{prefix}/arrived/{r}")
                if self._last_release is not None:
                    store.delete_key(self._last_release)
                self._last_release = f"{prefix}/released"
        else:
            try:
                verdict = store.get(f"{prefix}/released", timeout=timeout + 2.0).decode()
            except Exception as exc:
                raise DistBackendError(f"{what}: rank 0 did not release the barrier within {timeout:g} s "
                                       f"(rank 0 may be dead or stuck)") from exc
        if verdict != "ok":
            ranks = [int(r) for r in verdict.split(",")]
            scope = "ranks that did not arrive" if wait_all_ranks else "first rank that did not arrive"
            raise DistBackendError(f"{what}: {scope} within {timeout:g} s: {ranks}"
                                   f"{'' if wait_all_ranks else ' (pass wait_all_ranks=True to list all)'}")

    # ----- helpers -----
    def _list_like(self, arrays: Sequence[Any], name: str, ref: Buffer, ref_name: str,
                   writable: bool) -> list[Buffer]:
        if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__"):
            raise TypeError(f"{name} must be a list of {self._size} arrays; got {type(arrays).__name__}")
        if len(arrays) != self._size:
            raise ValueError(f"{name} must have {self._size} arrays (one per rank of group "
                             f"{self.group_name!r}); got {len(arrays)}")
        bufs = []
        for i, a in enumerate(arrays):
            b = _array.as_buffer(a, name=f"{name}[{i}]", writable=writable)
            _same_layout(b, ref, f"{name}[{i}]", ref_name)
            bufs.append(b)
        return bufs

    def _check_chunked(self, whole: Buffer, part: Buffer, whole_name: str, part_name: str) -> None:
        if whole.dtype != part.dtype:
            raise TypeError(f"{whole_name} has dtype {whole.dtype.name} but {part_name} has {part.dtype.name}; "
                            "they must match")
        if whole.nbytes != part.nbytes * self._size:
            raise ValueError(f"{whole_name} (shape {whole.shape}) must hold exactly group size x "
                             f"{part_name} = {self._size} x {part.numel} elements; got {whole.numel}")

    # ----- teardown -----
    def _destroy(self) -> None:
        """Shut down the group's backends and watchdog; later calls raise RuntimeError."""
        if self._destroyed:
            return
        self._destroyed = True
        errors: list[BaseException] = []
        for backend in (self._nccl, self._cpu):
            if backend is not None:
                try:
                    backend.shutdown()
                except Exception as exc:
                    errors.append(exc)
        self._watchdog.stop()
        if self._hook_errors:
            hook, hook_exc = self._hook_errors[0]
            raise RuntimeError(f"a completion hook of group {self.group_name!r} raised "
                               f"({len(self._hook_errors)} time(s)); first: {hook!r}: {hook_exc!r}") from hook_exc
        if errors:
            raise DistBackendError(f"shutting down group {self.group_name!r} failed: {errors[0]}") from errors[0]


class _NonGroupMember:
    """The value ``new_group`` returns on ranks that are not members (torch's sentinel)."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _GroupMember:
    """torch's ``GroupMember``: ``GroupMember.WORLD`` is the default group (None before
    ``init_process_group``); ``GroupMember.NON_GROUP_MEMBER`` is what ``new_group`` returns
    on ranks that are not members."""

    NON_GROUP_MEMBER: Any = _NonGroupMember()

    @property
    def WORLD(self) -> ProcessGroup | None:  # noqa: N802  (torch's name)
        from . import world

        return world.default_group() if world.is_initialized() else None

    def __repr__(self) -> str:
        return "GroupMember"


GroupMember = _GroupMember()


class CoalescingManager:
    """What ``with gpucoll.coalescing(group) as cm:`` yields: ops on ``group`` inside the
    block are collected and issued as one op when the block ends.

    Attributes:
        works: the Works issued at the end of the block (one per batch; one per op for
            reduce_scatter_single, which has no coalesced form).
    """

    def __init__(self, group: ProcessGroup, async_ops: bool) -> None:
        self.group = group
        self.async_ops = async_ops
        self.works: list[Work] = []
        self._kind: str | None = None
        self._op: Any = None
        self._items: list[tuple[Any, ...]] = []
        self._placeholders: list[Work] = []
        self._backend: Backend | None = None

    def _defer(self, group: ProcessGroup, kind: str, op: Any, item: tuple[Any, ...],
               async_op: bool) -> Work | None:
        if self._kind is None:
            self._kind, self._op = kind, op
        elif kind != self._kind or op != self._op:
            raise ValueError(f"a coalescing() block batches one kind of op with one ReduceOp; got {kind} "
                             f"(op={op}) after {self._kind} (op={self._op})")
        placeholder = Work(item[0] if kind == "p2p" else kind)
        placeholder.group_name = group.group_name
        placeholder._result[:] = [item[2]] if not (kind == "p2p" and item[0] == "send") else []
        self._items.append(item)
        self._placeholders.append(placeholder)
        return placeholder if async_op else None

    def _flush(self) -> None:
        g, kind, op, items = self.group, self._kind, self._op, self._items
        if kind is None:
            return
        bufs = [it[1] for it in items]
        backend = self._backend = g._backend_for_all(bufs, [f"op {i} of the coalescing block" for i in range(len(bufs))])
        if kind == "all_reduce":
            works = [g._issue(backend, lambda: backend.all_reduce_coalesced(bufs, op), bufs[0],
                              [it[2] for it in items])] * len(items)
        elif kind == "all_gather_single":
            outs = [_array.split_buffer(b, g.size()) for b in bufs]
            ins = [it[3] for it in items]
            works = [g._issue(backend, lambda: backend.all_gather_coalesced(outs, ins), ins[0],
                              [it[2] for it in items])] * len(items)
        elif kind == "reduce_scatter_single":
            works = [g._issue(backend, lambda it=it: backend.reduce_scatter_single(it[1], it[3], op),  # type: ignore[misc]
                              it[1], [it[2]]) for it in items]
        else:
            batch = [(it[0], it[1], it[3], it[4]) for it in items]
            works = [g._issue(backend, lambda: backend.batch_p2p(batch), bufs[0],
                              [it[2] for it in items if it[0] == "recv"])] * len(items)
        for placeholder, work in zip(self._placeholders, works):
            work._add_done_callback(lambda w, p=placeholder: _complete_from(p, w))  # type: ignore[misc]
        self.works = list({id(w): w for w in works}.values())
        for work in self.works:
            g._finish(backend, work, self.async_ops)

    def wait(self) -> None:
        """Wait for every Work of the block (as a synchronous op would)."""
        if self._backend is None:
            return
        for work in self.works:
            self.group._finish(self._backend, work, False)


def _complete_from(placeholder: Work, work: Work) -> None:
    placeholder.seq = work.seq
    exc = work.exception()
    if exc is not None:
        placeholder._set_exception(exc)
    else:
        placeholder._set_result(active_duration=work.active_duration, source_rank=work._source_rank)
