"""A group's issuer: the one path every op goes through once the group has checked it.

:class:`Issuer` numbers each op (the group's sequence), records it in the flight
recorder, starts it on its backend, and then either waits for it as a synchronous op
does or hands it to the watchdog; it owns the timeout that aborts the group, the
completion hooks, the DETAIL cross-rank check, and the group's *plans*: what an op
needs that does not change from call to call (the checked reduction, the backend, ...),
decided once per distinct (op, dtype, shape, device, flags) and looked up afterwards
(docs/design.md, "The issue path"). A :class:`~gpucoll._group.group.ProcessGroup`
holds one issuer.
"""

from __future__ import annotations

import hashlib
import threading
import time
from time import perf_counter as _perf, time as _time
from typing import Any, Callable, cast
from weakref import ref as _weakref

import numpy as np

from .. import _buffer
from .. import array as _array
from .._buffer import Buffer
from .._backends.base import ISSUING_ASYNC, Backend, IssuesQuietly, RunsNow, TimesOps
from .._backends.mismatch import decode, describe, encode
from .._debug import DebugLevel, call_site, get_debug_level
from ..errors import DistBackendError, DistError
from .._debug.flight_recorder import FlightRecorder, Kind, _Entry, recorder_capacity
from .._work import Work, WorkInfo
from .checks import _op_name
from .device_run import DeviceRun, remember_device_run
from .watchdog import Watchdog

__all__ = ["Issuer", "Plan", "HostRun", "remember_host_run"]

_FINGERPRINT_BYTES = 256
_SHAPES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single"})  # per-peer sizes differ by design
_PLANS_MAX = 1024  # distinct plans kept per group; a job with more re-plans some (cleared, not evicted)


class Plan:
    """What a repeated op needs, decided by its first call: the backend it runs on, the
    reduction as checked for its dtype, whether the backend is the device one, and, for
    a host backend, its Work-less form of the op (``RunsNow``, named by ``now``) if it has one; for a device
    backend, its Work-less synchronous form of the op (``IssuesQuietly``) if it has one."""

    __slots__ = ("backend", "red", "device", "now", "quiet", "inline_max")

    def __init__(self, backend: Backend, red: Any, device: bool, quiet: str = "", now: str = "all_reduce_now") -> None:
        self.backend = backend
        self.red = red
        self.device = device
        # Host ops only: a device op's synchronous form orders the caller's stream, no host wait.
        runs_now = not device and isinstance(backend, RunsNow)
        self.now: Callable[..., bool | Work] | None = getattr(backend, now) if runs_now else None
        # An async op up to this size runs through ``now`` too (RunsNow.inline_max); -1: none.
        self.inline_max: int = cast(RunsNow, backend).inline_max if runs_now else -1
        self.quiet: Callable[..., bool] | None = (
            getattr(backend, quiet) if quiet and device and isinstance(backend, IssuesQuietly) else None)


class HostRun:
    """A planned host all_reduce on a NumPy array of one (dtype, shape, op), bound to the
    backend's Work-less runner (``RunsNow.all_reduce_runner``): a repeated call needs no
    Buffer and no look-up in the backend. ``desc`` describes the arrays for the flight
    recorder; ``start(flat, reducer)`` issues the op the usual way when the backend
    cannot run it now. ``ProcessGroup.all_reduce`` finds the kind it ran last
    (``Issuer.host_last``) by identity, else by its key in ``ProcessGroup._host_open``
    (the group's runs while no coalescing block, destruction, hook or DETAIL debug level
    asks for the general path, else empty: ``ProcessGroup._restate``, which also drops
    ``host_last`` then), and checks per call what the kind does not settle: a writable
    C-contiguous array; :meth:`Issuer.run_host` then numbers, records and runs the op."""

    __slots__ = ("backend", "run", "reducer", "desc", "start", "inline", "kind", "dtype", "shape", "op", "one_dim")

    def __init__(self, backend: Backend, run: Callable[..., bool | Work], reducer: Any, desc: Buffer,
                 start: Callable[..., Work], inline: bool, key: tuple[Any, Any, Any]) -> None:
        self.backend = backend
        # The kind (NumPy dtype, shape, ReduceOp member): the group's last-run check compares
        # them by identity (dtype, op) and equality (shape), cheaper than hashing a dict key.
        self.dtype, self.shape, self.op = key
        self.one_dim = len(self.shape) == 1  # (an array of the kind is its own 1-D view: no ndim look-up per call)
        self.run = run
        self.reducer = reducer
        self.desc = desc
        self.start = start
        self.inline = inline  # small enough that an async op of this kind runs here too (RunsNow.inline_max)
        self.kind = Kind(backend.name, desc)  # what the flight recorder shows of each op


class Issuer:
    """Issues the ops of one group.

    Args:
        group_name: the group's name; ``label``: the name (and description) as errors show it.
        rank, global_rank, size: this rank in the group and in the default group; the group's size.
        timeout: seconds an op may take before the group is aborted.
        cpu: the group's CPU backend (the DETAIL check's all-gather runs there).
        group_desc: the group's description (the flight recorder's dump shows it).
    """

    def __init__(self, group_name: str, label: str, rank: int, global_rank: int, size: int, timeout: float,
                 cpu: Backend | None, group_desc: str = "") -> None:
        self.group_name = group_name
        self.label = label
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.cpu = cpu
        self.seq = 0
        self.plans: dict[tuple[Any, ...], Plan] = {}
        self.host_runs: dict[tuple[Any, ...], HostRun] = {}  # by (NumPy dtype, shape, op name)
        self.host_last: HostRun | None = None  # the last one looked up (dropped with host_runs)
        self.device_runs: dict[tuple[Any, ...], DeviceRun] = {}  # by (address, device, dtype, shape, op name)
        # By id() of a CuPy array: (a weak reference to it, the op, its DeviceRun) of its last
        # run (saw()); what the group reads before building device_runs' key.
        self.device_seen: dict[int, tuple[Any, Any, DeviceRun]] = {}
        self.abort_reason: str | None = None
        self.abort_lock = threading.Lock()
        self.hook_errors: list[tuple[Callable[[WorkInfo], None], BaseException]] = []
        level = get_debug_level()
        self.debug_detail = level >= DebugLevel.DETAIL
        self.debug_info = level >= DebugLevel.INFO
        capacity = recorder_capacity()
        self.recorder = FlightRecorder(group_name, rank, global_rank, size, capacity) if capacity > 0 else None
        if self.recorder is not None:
            self.recorder.group_desc = group_desc
        self.watchdog = Watchdog(group_name, timeout, self.on_timeout, self.on_hook_error)
        self.hooks = self.watchdog.hooks

    # ----- plans -----
    def plan(self, key: tuple[Any, ...] | None, backend: Backend, red: Any, device: bool, quiet: str = "",
             now: str = "all_reduce_now") -> Plan:
        """The plan of an op's first call (after every check), kept under ``key`` (None:
        an op that is planned on every call, such as PREMUL_SUM with its factor);
        ``quiet`` names the device backend's Work-less form of the op (IssuesQuietly),
        ``now`` the host backend's (RunsNow)."""
        plan = Plan(backend, red, device, quiet, now)
        if key is not None:
            if len(self.plans) >= _PLANS_MAX:
                self.plans.clear()
                self.host_runs.clear()
                self.host_last = None
                self.device_runs.clear()
                self.device_seen.clear()
            self.plans[key] = plan
        return plan

    def forget_plans(self) -> None:
        """Drop every plan (the group's backends changed, or the group is destroyed)."""
        self.plans.clear()
        self.host_runs.clear()
        self.host_last = None
        self.device_runs.clear()
        self.device_seen.clear()

    def saw(self, array: Any, op: Any, run: DeviceRun) -> None:
        """Remember that CuPy ``array`` was last run with ``op`` through ``run``: its next
        call with the same op object finds ``run`` by the array's identity (device_run.py
        says why that stays right and what drops it)."""
        seen = self.device_seen
        if len(seen) >= 1024:
            seen.clear()
        seen[id(array)] = (_weakref(array), op, run)

    # ----- issue and finish -----
    def issue(self, backend: Backend, start: Callable[[], Work], buf: Buffer | None, outputs: list[Any],
              peer: int = -1, op: str = "", red: Any = None, async_op: bool = False) -> Work:
        """Number the op, record it, start it (``async_op``: as an async op, see
        ``ISSUING_ASYNC``); its Work (which may already be complete)."""
        self.seq += 1
        seq = self.seq
        if self.debug_detail and op:
            self.check_across_ranks(op, seq, buf, peer, red)
        entry = self._entry(seq, op or start.__name__.strip("<>"), backend, buf, peer)
        return self._start(seq, entry, start, (), outputs, peer, op, async_op)

    def call(self, backend: Backend, start: Callable[..., Work], args: tuple[Any, ...], buf: Buffer | None,
             outputs: list[Any], async_op: bool, device: bool, op: str, red: Any = None, peer: int = -1,
             quiet: Callable[..., bool] | None = None) -> Work | None:
        """:meth:`issue` and :meth:`finish` in one call, for a collective ``op`` started by
        ``start(*args)`` (arguments, not a closure: nothing is built per call). A
        synchronous op with no hook to feed goes through ``quiet(*args, seq, entry,
        group)`` first when given (a device backend's Work-less form, IssuesQuietly)."""
        seq = self.seq = self.seq + 1
        if self.debug_detail:
            self.check_across_ranks(op, seq, buf, peer, red)
        entry = self._entry(seq, op, backend, buf, peer)
        if quiet is not None and not async_op and not self.hooks and quiet(*args, seq, entry, self.group_name):
            # Issued, and the caller's stream waits for it; the watchdog watches the
            # backend's queue of outstanding ops, which holds its record.
            # A backend with a quiet form is PollsPending (typing.cast would be a call per op).
            self.watchdog.watch_backend(backend)  # type: ignore[arg-type]
            return None
        return self.finish(backend, self._start(seq, entry, start, args, outputs, peer, op, async_op), async_op,
                           device)

    def call_quiet(self, backend: Backend, quiet: Callable[..., bool], buf: Buffer, arg: Any, tensor: Any, op: str,
                   red: Any = None, peer: int = -1) -> Work | None:
        """A synchronous device op that has a Work-less form (``quiet``, IssuesQuietly):
        :meth:`call` with ``args = (buf, arg)``, ``start`` the backend's method named
        ``op`` and ``outputs = [tensor]``, built only where needed: with a hook
        registered (which needs the Work) or when ``quiet`` declines (then the op is
        issued the usual way under the number and flight-recorder entry it was given).
        The steady state builds no bound method, argument tuple or output list."""
        if self.hooks:
            return self.call(backend, getattr(backend, op), (buf, arg), buf, [tensor], False, True, op, red, peer)
        seq = self.seq = self.seq + 1
        if self.debug_detail:
            self.check_across_ranks(op, seq, buf, peer, red)
        recorder = self.recorder
        entry = None
        if recorder is not None:
            entry = recorder.begin(seq, op, backend.name, buf, peer)
            if self.debug_info:
                entry.where = call_site()
        if quiet(buf, arg, seq, entry, self.group_name):
            # Issued, and the caller's stream waits for it; the watchdog watches the
            # backend's queue of outstanding ops, which holds its record.
            # A backend with a quiet form is PollsPending (typing.cast would be a call per op).
            self.watchdog.watch_backend(backend)  # type: ignore[arg-type]
            return None
        return self.finish(backend, self._start(seq, entry, getattr(backend, op), (buf, arg), [tensor], peer, op),
                           False, True)

    def run_device(self, run: DeviceRun, tensor: Any, async_op: bool = False) -> Work | None:
        """An all_reduce on a CuPy array through its :class:`DeviceRun` (numbered and
        recorded as :meth:`call_quiet` does; ``async_op``: through its async form, whose
        Work is returned as :meth:`call` returns it); where the runner declines (a stream
        other than the caller's, a capture, posted sends, an ended backend, an async op
        too large for the caller's stream), the op is issued the usual way under the
        number and entry it was given.
        Callers use this only with no hook registered and the debug level below
        DETAIL, outside a coalescing block, on a C-contiguous array of the run's key."""
        seq = self.seq = self.seq + 1
        recorder = self.recorder
        if recorder is not None:
            # recorder.begin_kind(seq, "all_reduce", run.kind) without its frame.
            take = recorder.take  # (as in run_host)
            entry = take()
            entry.seq = seq
            entry.op_type = "all_reduce"
            entry.kind = run.kind
            entry.time_started = _time()
            entry.done = None
            if self.debug_info:
                entry.where = call_site()
        else:
            entry = None
        # The stream the array's producer names: CuPy's current stream of the array's
        # device (the run's: an address names one device; a kernel writing the array ran
        # with that device current), as torch's getCurrentCUDAStream(device) and the
        # backend's current_stream_of(device); the runner runs the op on it (the backend
        # asks no second time). Asked with the device, CuPy makes no cudaGetDevice.
        try:
            current: Any = _buffer._cupy_stream(run.device)
        except Exception:  # noqa: BLE001  (the usual way words the error)
            stream: int | None = None
        else:
            # CuPy's legacy default stream, seen before: its handle, kept (one object per
            # device; a stream of the caller's own is never kept: that would keep it alive).
            stream = run.legacy_handle if current is run.legacy else run.handle(current)
        if async_op:
            start = run.start
            work = start(stream, tensor, seq, entry, self.group_name) \
                if start is not None and stream is not None else None
            if work is not None:  # numbered and tied to its entry by the runner
                if not run.watched:  # (its queue holds the Work)
                    run.watched = self.watch_run_backend(run.backend)
                return work
        elif stream is not None and not run.posted.ops:  # (posted sends and receives: the usual way first)
            if run.run(stream, tensor, seq, entry, self.group_name):
                if not run.watched:  # (a quiet backend polls)
                    run.watched = self.watch_run_backend(run.backend)
                return None
        backend = run.backend
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        return self.finish(backend, self._start(seq, entry, backend.all_reduce, (buf, run.red), [tensor], -1,
                                                "all_reduce", async_op), async_op, True)

    def watch_run_backend(self, backend: Backend) -> bool:
        """Have the watchdog watch a DeviceRun's ``backend`` (its outstanding ops: their
        timeouts); True once it does for the watchdog's life (``DeviceRun.watched``): a
        backend, once watched with the thread started, is never dropped from the
        watchdog's list, and its thread is never replaced."""
        watchdog = self.watchdog
        watchdog.watch_backend(backend)  # type: ignore[arg-type]  # (NCCL's: PollsPending)
        return watchdog.watched is backend

    def call_and_remember(self, backend: Backend, quiet: Callable[..., bool], buf: Buffer, red: Any, tensor: Any,
                          op: Any, async_op: bool) -> Work | None:
        """A CuPy array's first all_reduce of its kind on a device backend with a Work-less
        form (or one its DeviceRun sent the usual way): :meth:`call_quiet`, or :meth:`call`
        for an async op, then the array's DeviceRun is made for the next one."""
        done = self.call_quiet(backend, quiet, buf, red, tensor, "all_reduce", red) if not async_op else \
            self.call(backend, backend.all_reduce, (buf, red), buf, [tensor], True, True, "all_reduce", red)
        if len(self.device_runs) < 1024:
            remember_device_run(self.device_runs, backend, tensor, buf, red, op)
        return done

    def _entry(self, seq: int, op: str, backend: Backend, buf: Buffer | None, peer: int) -> _Entry | None:
        """The op's flight-recorder entry, made before it starts: a host op may run to its
        end inside ``start()``, and a dump taken meanwhile must show it."""
        recorder = self.recorder
        if recorder is None:
            return None
        entry = recorder.begin(seq, op, backend.name, buf, peer)
        if self.debug_info:
            entry.where = call_site()
        return entry

    def _start(self, seq: int, entry: _Entry | None, start: Callable[..., Work], args: tuple[Any, ...],
               outputs: list[Any], peer: int, op: str, async_op: bool = False) -> Work:
        recorder = self.recorder
        if async_op:
            ISSUING_ASYNC.on = True
            try:
                work = start(*args)
            finally:
                ISSUING_ASYNC.on = False
        else:
            work = start(*args)
        work.seq = seq
        work.group_name = self.group_name
        if peer >= 0 and not op:
            work.peer = peer  # point to point (collectives pass op=; their peer is a root)
        if outputs:
            work._result[:] = outputs
        if entry is not None and recorder is not None:
            recorder.attach(entry, work)
        if self.hooks:
            work._add_done_callback(self.watchdog.completed)
        return work

    def run_now(self, backend: Backend, now: Callable[..., bool | Work], start: Callable[..., Work], args: tuple[Any, ...],
                buf: Buffer | None, op: str, outputs: list[Any], peer: int = -1,
                async_op: bool = False) -> Work | None:
        """A host op through the backend's Work-less path (``RunsNow``): ``now(*args)``,
        numbered and recorded as :meth:`issue` does, with no Work unless it fails; when the
        backend cannot run it now (ops queued ahead of it), ``start(*args)`` issues it as
        usual. (Arguments, not closures: nothing is built per call.)

        ``async_op``: the op ran to its end here, so the caller gets a Work complete from
        birth (``Work._completed``: ``wait()`` is a flag check), or, when it failed, a Work
        holding the error, which ``wait()`` raises (an async op's errors surface there).
        Callers pass it only for ops small enough to run inline (``RunsNow.inline_max``).
        The backend is told (``now(*args, async_op=True)``), and never makes the caller wait
        for peers: an op that would have to is finished by the backend, which returns its
        Work (returned here, as an async op's Work).
        Callers use this only when no hook is registered and the debug level is below DETAIL."""
        seq = self.seq = self.seq + 1
        recorder = self.recorder
        entry = None
        if recorder is not None:
            entry = recorder.begin(seq, op, backend.name, buf, peer)  # (a collective's peer: its root)
            if self.debug_info:
                entry.where = call_site()
        t0 = time.perf_counter()
        try:
            ran = now(*args, async_op=True) if async_op else now(*args)
        except DistError as exc:  # the op failed: the usual Work, for the usual timeout and error
            return self._failed_now(exc, backend, seq, entry, t0, op, outputs, async_op)
        if ran.__class__ is not bool:  # async, finishing in the backend: its Work
            return self.finish(backend, self._start(seq, entry, _given, (ran,), outputs, peer, op), True, False)
        if ran:
            dt = time.perf_counter() - t0
            if entry is not None:
                entry.complete(dt)
            if async_op:
                started = entry.time_started if entry is not None else time.time() - dt
                return Work._completed(op, seq, self.group_name, outputs, started, t0, dt)
            return None
        return self.finish(backend, self._start(seq, entry, start, args, outputs, peer, op), async_op, False)

    def run_host(self, fast: HostRun, flat: Any, tensor: Any) -> Work | None:
        """A synchronous all_reduce of a planned NumPy kind (``fast``) on ``flat``, a 1-D view
        of ``tensor``: :meth:`run_now` with nothing built per call (numbered, recorded,
        failed and issued behind queued ops alike)."""
        seq = self.seq = self.seq + 1
        recorder = self.recorder
        entry = None
        t0 = _perf()  # the duration's start, and the entry's (no wall-clock read: _Entry.t0)
        if recorder is not None:
            # recorder.begin_kind(seq, "all_reduce", fast.kind) without its frame (as
            # run_device: a small op's whole cost is a few such frames).
            take = recorder.take  # (an attribute, not a method: called apart, its look-up is specialized)
            entry = take()
            entry.seq = seq
            entry.op_type = "all_reduce"
            entry.kind = fast.kind
            entry.time_started = 0.0  # (the start is t0)
            entry.t0 = t0
            entry.done = None
            if self.debug_info:
                entry.where = call_site()
        run = fast.run  # (a slot holding a function: called apart, as ``take`` above)
        try:
            ran = run(flat, fast.reducer)
        except DistError as exc:
            return self._failed_now(exc, fast.backend, seq, entry, t0, "all_reduce", [tensor], False)
        if ran is True:
            if entry is not None:
                entry.done = _perf() - t0  # (entry.complete, inline)
            return None
        return self.finish(fast.backend, self._start(seq, entry, fast.start, (flat, fast.reducer), [tensor], -1,
                                                     "all_reduce"), False, False)

    def _failed_now(self, exc: DistError, backend: Backend, seq: int, entry: Any, t0: float, op: str,
                    outputs: list[Any], async_op: bool) -> Work | None:
        """:meth:`run_now`'s op failed with ``exc``: the usual Work, for the usual timeout and
        error (returned if ``async_op``, else raised as a synchronous op's)."""
        work = Work(op)
        work.seq, work.group_name, work._t0 = seq, self.group_name, t0
        work._set_exception(exc)
        if entry is not None:
            entry.op_type = op
            work._fr_entry = entry
            entry.finish(work)
        if async_op:
            work._result[:] = outputs
            return work
        self.wait_host(work, backend)
        raise exc  # wait_host raises for a failed op; kept for the type checker

    def finish(self, backend: Backend, work: Work, async_op: bool, device: bool) -> Work | None:
        """Return ``work`` (async) or wait for it as a synchronous op does."""
        if async_op:
            if not work._done._flag:
                self.watchdog.track(work, backend, device)
            return work
        if device:
            # Makes the caller's stream wait (DESIGN.md, Streams); the host goes on.
            work.wait()
            if not work._done._flag:
                self.watchdog.track(work, backend, True)
            return None
        if work._done._flag and work._exc is None:
            return None  # the common case: a host op that ran on this thread
        self.wait_host(work, backend)
        return None

    def wait_host(self, work: Work, backend: Backend) -> None:
        if not work._done.is_set():
            left = self.timeout - (time.perf_counter() - work._t0)
            if left <= 0 or not work._done.wait(left):
                self.on_timeout(work, backend)
        exc = work._exc
        if exc is None:
            return
        if time.perf_counter() - work._t0 >= self.timeout:
            reason = self.on_timeout(work, backend)
            if reason not in str(exc):
                raise DistBackendError(f"{reason}. The backend reported: {exc}") from exc
        if isinstance(exc, DistError):
            # Raised from here, not from the backend's thread or Work.wait: the user's
            # traceback ends a few frames below their call, the message right after.
            raise exc.with_traceback(None)
        work.wait()  # raises the op's error as Work.wait() words it

    def on_timeout(self, work: Work, backend: Backend) -> str:
        """Abort ``backend`` over ``work`` (once per group), dump the flight recorder; the reason."""
        with self.abort_lock:
            if self.abort_reason is None:
                stalled = getattr(backend, "stalled", None)
                waiting = stalled() if stalled is not None else ""
                if not waiting and work.peer >= 0:
                    # The transport has given up on it already (a send whose peer stopped
                    # reading): the op itself still says whom it waited for.
                    waiting = f"rank {work.peer}"
                where = "flight recorder off"
                if self.recorder is not None:
                    try:
                        where = f"flight recorder dumped to {self.recorder.dump(reason=work._name())}"
                    except OSError as exc:
                        where = f"flight recorder could not be written: {exc}"
                self.abort_reason = (
                    f"{work.op_type} (seq {work.seq}) on group {self.label} (rank {self.rank} of "
                    f"{self.size}) did not complete within the group's timeout of {self.timeout:g} s"
                    + (f" (still waiting for {waiting})" if waiting else "")
                    + f"; the group's {backend.name} backend was aborted ({where})")
            reason = self.abort_reason
        backend.abort(reason)
        work._set_exception(DistBackendError(reason))  # no-op if the op already failed
        return reason

    def on_hook_error(self, hook: Callable[[WorkInfo], None], exc: BaseException) -> None:
        self.hook_errors.append((hook, exc))

    def check_across_ranks(self, op: str, seq: int, buf: Buffer | None, peer: int, red: Any) -> None:
        """Debug level DETAIL: before a collective (any backend), compare what every rank
        is about to issue (through the CPU backend) and raise on every rank if they
        differ, naming the fields that differ and each rank's value: the backend itself
        would hang, fail obscurely, or quietly compute garbage."""
        assert self.cpu is not None
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
        rows = [np.zeros(_FINGERPRINT_BYTES, np.uint8) for _ in range(self.size)]
        work = self.cpu.all_gather([_array.as_buffer(r, writable=True) for r in rows], _array.as_buffer(mine))
        try:
            work.wait(self.timeout)
        except DistError as exc:
            raise DistBackendError(f"GPUCOLL_DEBUG=DETAIL: checking {op} (seq {seq}) on group {self.group_name!r} "
                                   f"across ranks failed: {exc}") from exc
        seen = [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]
        if len(set(seen)) > 1:
            raise DistBackendError(f"GPUCOLL_DEBUG=DETAIL: the ranks of group {self.label} are about to "
                                   f"issue different collectives, which the backend would hang on or compute "
                                   f"wrongly; " + describe({r: decode(t) for r, t in enumerate(seen)}))

    def stop(self) -> list[tuple[Callable[[WorkInfo], None], BaseException]]:
        """Stop the watchdog and forget the plans; the hook errors seen."""
        self.plans.clear()
        self.host_runs.clear()
        self.host_last = None
        self.watchdog.stop()
        return self.hook_errors


def _given(work: Work) -> Work:
    return work


def time_ops(backend: Backend | None) -> Backend | None:
    """A hook reads active_duration: ask a device backend to time its ops (CUDA events
    with timing cost more to record and query; they are made only when asked)."""
    if isinstance(backend, TimesOps):
        backend.time_ops()
    return backend


def remember_host_run(runs: dict[tuple[Any, ...], HostRun], backend: Backend, tensor: np.ndarray, buf: Buffer,
                       red: Any, op: Any) -> None:
    """Bind the next all_reduce of this NumPy kind to the backend's runner, once the
    backend planned the kind (its first op does)."""
    runner = backend.all_reduce_runner(buf.dtype.name, buf.nbytes, red) if isinstance(backend, RunsNow) else None
    if runner is None:
        return
    run, reducer = runner

    def start(flat: np.ndarray, _reducer: Any) -> Work:  # the backend cannot run it now: a Work
        return backend.all_reduce(_array.as_buffer(flat, name="tensor", writable=True), red)
    desc = Buffer(0, buf.nbytes, buf.dtype, buf.shape, buf.device)  # what the flight recorder shows
    runs[(tensor.dtype, tensor.shape, op._name_)] = HostRun(backend, run, reducer, desc, start,
                                                            buf.nbytes <= cast(RunsNow, backend).inline_max,
                                                            (tensor.dtype, tensor.shape, op))
