"""The core of a ProcessGroup: identity, backends, and the one issue path.

:class:`GroupCore` owns what every op goes through: the group's store and
backends (the CPU backend always; the device backend made on first device op, at
creation, or split from a parent), dispatch by where an array lives, ``_issue``
(sequence number, flight recorder, hooks) and ``_finish`` (wait, or hand the op to
the watchdog), the timeout that aborts the group, and teardown. The op methods
(:mod:`.group`) are thin: check locally, pick the backend, issue, finish.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from .. import array as _array
from .._buffer import Buffer
from .._backends.base import Backend, ReducesInto
from .._backends.mismatch import decode, describe, encode
from .._debug import DebugLevel, call_site, get_debug_level
from ..errors import DistBackendError, DistError
from .._flight_recorder import FlightRecorder, recorder_capacity
from ..store import PrefixStore, Store
from .._work import Work, WorkInfo
from .checks import _DTYPES_DIFFER, _op_name, _real_view, _same_layout, _size_error
from .coalescing import CoalescingManager, _not_coalescable
from .options import PGOptions
from .registry import _BACKEND_GRACE_S, BACKENDS, backend_kwargs, make_device_backend, split_device_backend
from .watchdog import Watchdog

__all__ = ["GroupCore"]

_FINGERPRINT_BYTES = 256
_SHAPES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single"})  # per-peer sizes differ by design


class GroupCore:
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
        pg_options: the group's :class:`~gpucoll.NCCLOptions` / :class:`~gpucoll.CPUOptions`
            (already coerced); kept as ``pg_options``.
    """

    def __init__(self, store: Store, rank: int, size: int, *, group_name: str,
                 global_ranks: Sequence[int], timeout: float, backend: str = "cpu",
                 device_id: int | None = None, device_backend: Backend | None = None,
                 group_desc: str = "", pg_options: PGOptions | None = None) -> None:
        self._store = store
        self.pg_options = pg_options
        self.group_desc = group_desc
        self._rank = rank
        self._size = size
        self.group_name = group_name
        self.global_ranks: tuple[int, ...] = tuple(global_ranks)
        self._to_group = {g: i for i, g in enumerate(self.global_ranks)}
        self.timeout = timeout
        self.backend_name = backend
        self._backend_spelling = backend  # what get_backend() returns ("gloo" when created so)
        self._device_id = device_id
        self.bound_device_id: int | None = device_id
        """The CUDA device the group was bound to when made (``device_id=``), or None (torch's
        ``ProcessGroup.bound_device_id``; a device chosen later by a first device array is not a binding)."""
        self._seq = 0
        self._destroyed = False
        self._coalescing: CoalescingManager | None = None  # while a coalescing() block is open
        self._split_count = 0
        self._last_release: str | None = None  # monitored_barrier's key still to delete
        self._monitored_seq = 0  # monitored barriers so far (p2p ops advance _seq unevenly across ranks)
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
        # A "fake" group's one backend serves host and device arrays alike (_backends/fake.py).
        self._cpu: Backend = BACKENDS["fake" if backend == "fake" else "cpu"](PrefixStore("cpu", store), rank, size,
                                             timeout=timeout + _BACKEND_GRACE_S, group_name=group_name,
                                             device_id=None, **backend_kwargs(pg_options, "cpu"))
        self._nccl: Backend | None = None
        self._nccl_into: ReducesInto | None = None  # the device backend, if it reduces out of place
        # Bound to a device at creation on every rank: only then may new groups split
        # its communicator (one made by a first device op might exist on some ranks
        # and not yet on others when they create the next group).
        self._bound = backend == "nccl" and (device_id is not None or device_backend is not None)
        if device_backend is not None:
            if backend != "nccl":
                raise ValueError(f"group {group_name!r}: a device backend was given to a {backend} group")
            self._set_device_backend(device_backend)
            self._device_id = getattr(device_backend, "device", device_id)
        elif backend == "nccl" and device_id is not None:
            try:
                self._set_device_backend(self._make_device_backend(device_id))
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
        order, with a :class:`~gpucoll._work.WorkInfo` (``op_type``, ``seq``,
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
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{name} must be an int (a rank of group {self.group_name!r}); "
                            f"got {type(r).__name__} {r!r}")
        if not 0 <= r < self._size:
            raise ValueError(f"{name}={r!r} is out of range for group {self.group_name!r} of size {self._size}")
        return r

    def _not_coalescable(self, op: str) -> None:
        _not_coalescable(op)

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
            nccl = self._set_device_backend(self._make_device_backend(buf.device.index))
        elif buf.device.index != self._device_id:
            raise ValueError(f"{name} is on {buf.device} but group {self.group_name!r} communicates "
                             f"on cuda:{self._device_id}")
        return nccl

    def _make_device_backend(self, device_id: int) -> Backend:
        self._device_id = device_id
        return make_device_backend(self._store, self._rank, self._size, timeout=self.timeout,
                                   group_name=self.group_name, device_id=device_id, pg_options=self.pg_options)

    def _set_device_backend(self, backend: Backend) -> Backend:
        self._nccl = backend
        self._nccl_into = backend if isinstance(backend, ReducesInto) else None
        return backend

    def _split_device_backend(self, members: Sequence[int] | None, color: int, *, store: Store,
                              group_name: str, timeout: float,
                              pg_options: PGOptions | None = None) -> Backend | None:
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
            group_name, timeout, pg_options: the new group's.

        Returns:
            The new group's device backend on members; None on non-members, and
            wherever no split is possible (a cpu group, a group not bound to a device
            at creation, an NCCL without ncclCommSplit): the new group then makes its
            own communicator.
        """
        if not self._bound:
            return None
        return split_device_backend(self._nccl, members, color, store=store, group_name=group_name,
                                    timeout=timeout, pg_options=pg_options)

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
        if recorder is not None and entry is not None:
            recorder.attach(entry, work)
        if self._hooks:
            work._add_done_callback(self._watchdog.completed)
        return work

    def _check_across_ranks(self, op: str, seq: int, buf: Buffer | None, peer: int, red: Any) -> None:
        """Debug level DETAIL: before a collective (any backend), compare what every rank
        is about to issue (through the CPU backend) and raise on every rank if they
        differ, naming the fields that differ and each rank's value: the backend itself
        would hang, fail obscurely, or quietly compute garbage."""
        fields = [("op", op), ("seq", str(seq))]
        if buf is not None:
            fields.append(("dtype", buf.dtype.name))
            if op not in _SHAPES_MAY_DIFFER:
                fields.append(("shape", str(tuple(buf.shape))))
        if peer >= 0:
            fields.append(("root", str(peer)))
        if red is not None:
            fields.append(("reduce op", _op_name(red)))
        text = encode(fields).encode()
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
            raise DistBackendError(f"GPUCOLL_DEBUG=DETAIL: the ranks of group {self._label()} are about to "
                                   f"issue different collectives, which the backend would hang on or compute "
                                   f"wrongly; " + describe({r: decode(t) for r, t in enumerate(seen)}))

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
                stalled = getattr(backend, "stalled", None)
                waiting = stalled() if stalled is not None else ""
                where = "flight recorder off"
                if self._recorder is not None:
                    try:
                        where = f"flight recorder dumped to {self._recorder.dump(reason=work._name())}"
                    except OSError as exc:
                        where = f"flight recorder could not be written: {exc}"
                self._abort_reason = (
                    f"{work.op_type} (seq {work.seq}) on group {self._label()} (rank {self._rank} of "
                    f"{self._size}) did not complete within the group's timeout of {self.timeout:g} s"
                    + (f" (still waiting for {waiting})" if waiting else "")
                    + f"; the group's {backend.name} backend was aborted ({where})")
            reason = self._abort_reason
        backend.abort(reason)
        work._set_exception(DistBackendError(reason))  # no-op if the op already failed
        return reason

    def _on_hook_error(self, hook: Callable[[WorkInfo], None], exc: BaseException) -> None:
        self._hook_errors.append((hook, exc))

    # ----- helpers -----
    def _list_like(self, arrays: Sequence[Any], name: str, ref: Buffer, ref_name: str,
                   writable: bool, views: bool = False) -> list[Buffer]:
        """``arrays`` as Buffers: one per rank, each laid out like ``ref``; with ``views``
        (data movement) complex arrays match, and are returned as, their real views."""
        if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__"):
            raise TypeError(f"{name} must be a list of {self._size} arrays; got {type(arrays).__name__}")
        if len(arrays) != self._size:
            raise _size_error(name, f"{name} must have {self._size} arrays (one per rank of group "
                              f"{self.group_name!r}); got {len(arrays)}")
        bufs = []
        for i, a in enumerate(arrays):
            b = _array.as_buffer(a, name=f"{name}[{i}]", writable=writable)
            _same_layout(b, ref, f"{name}[{i}]", ref_name, views)
            bufs.append(_real_view(b) if views else b)
        return bufs

    def _uneven_list(self, arrays: Sequence[Any], name: str, own: Buffer, own_name: str) -> list[Buffer]:
        """One array per rank, all of ``own``'s dtype; ``arrays[rank]`` laid out like ``own``,
        the others of any size (rank i's chunk: the same size on every rank, which the
        backend checks across ranks)."""
        if isinstance(arrays, (str, bytes)) or not hasattr(arrays, "__len__"):
            raise TypeError(f"{name} must be a list of {self._size} arrays; got {type(arrays).__name__}")
        if len(arrays) != self._size:
            raise _size_error(name, f"{name} must have {self._size} arrays (one per rank of group "
                              f"{self.group_name!r}); got {len(arrays)}")
        bufs = [_array.as_buffer(a, name=f"{name}[{i}]") for i, a in enumerate(arrays)]
        for i, b in enumerate(bufs):
            if b.dtype != own.dtype:
                raise ValueError(f"{_DTYPES_DIFFER}: {name}[{i}] has dtype {b.dtype.name} but {own_name} has {own.dtype.name}; "
                                 "they must match")
        _same_layout(bufs[self._rank], own, f"{name}[{self._rank}] (this rank's chunk)", own_name)
        return bufs

    def _check_chunked(self, whole: Buffer, part: Buffer, whole_name: str, part_name: str) -> None:
        if whole.dtype != part.dtype:
            raise ValueError(f"{_DTYPES_DIFFER}: {whole_name} has dtype {whole.dtype.name} but {part_name} has {part.dtype.name}; "
                            "they must match")
        if whole.nbytes != part.nbytes * self._size:
            raise _size_error(whole_name, f"{whole_name} (shape {whole.shape}) must hold exactly group size x "
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


