"""The NCCL backend: collectives on CUDA device memory through CuPy's NCCL binding.

One :class:`NCCLBackend` per process group: one NCCL communicator, bound to one
device, and one communication stream on it. See docs/nccl-backend.md for the
design (streams, lifetimes, reductions NCCL lacks, abort) and
:mod:`gpucoll._backends.nccl.plan` for how each op becomes NCCL calls.

Importing this module imports no CuPy; constructing a backend does.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

from ..._buffer import DTYPES, Buffer, Device
from ...errors import BackendUnavailableError, DistBackendError
from ..._reduce_op import ReduceOp, ReduceOpLike
from ..._work import Work
from ...store.base import Store
from . import lib as _nccl_lib
from .config import usable_config
from .bootstrap import caller_stream_max, create_comm, refuse_nonblocking_env
from .bootstrap import is_nccl_available, nccl_unavailable_reason, nccl_version, rendezvous  # noqa: F401
from .lib import NCCL_DTYPES, OP_SUM
from .plan import Plan, Planner, calls_only, merge
from .runtime import CAPTURE_RELAXED, Comm, Runtime, enter_device, leave_device
from .comm import CommSlot
from .outstanding import Outstanding
from .connect import CheckIn
from .issuing import caller_streams, check_devices, first_device, new_work, prepare_kernels, refuse_in_capture
from .posting import Posted
from .ending import Ending
from .registration import Registrations, deregister as _deregister_buffer, register as _register_buffer
from .stream import CommStream
from . import hot as _hot, lifecycle as _lifecycle, phases as _phases, quiet as _quiet
from .shrink import check_shrunk, shrink_comm
from .split import check_split, split_comm
from .work import NCCLWork

__all__ = ["NCCLBackend", "nccl_unavailable_reason", "is_nccl_available", "nccl_version", "rendezvous"]

_PLANS_MAX = 256  # cached plans per backend (a plan names its buffers: bounded, cleared when full)


class NCCLBackend:
    """One process group's collectives on CUDA memory (the Backend protocol).

    Args:
        store: the group's private store (a PrefixStore): rank 0 publishes the NCCL
            unique id there.
        rank, size: this process's rank in the group and the group's size.
        timeout: seconds that communicator setup and :meth:`NCCLWork.synchronize`
            wait; the group's watchdog enforces it on running ops.
        group_name: the group's name, for errors.
        device_id: the CUDA device of this rank. Given: the communicator is created
            now (every rank must construct its backend). None: it is created by the
            first op, on the device of that op's arrays.
        config: ``ncclConfig_t`` fields by gpucoll name (``NCCLOptions.config``) for
            ``ncclCommInitRankConfig``; None or empty: NCCL's defaults.
        high_priority: make the communication stream at the device's highest priority.

    Raises:
        BackendUnavailableError: no CuPy, no NCCL library, or no CUDA device here.
        ValueError: ``rank``/``size``/``device_id`` out of range.
        DistBackendError: creating the communicator failed or timed out.

    Example:
        >>> backend = NCCLBackend(PrefixStore("g0/", store), rank, size, timeout=60.0,
        ...                       group_name="g0", device_id=rank % 8)
        >>> backend.all_reduce(as_buffer(cupy_array, writable=True), ReduceOp.SUM).wait()
    """

    name = "nccl"

    def __init__(self, store: Store, rank: int, size: int, *, timeout: float, group_name: str,
                 device_id: int | None, config: Mapping[str, Any] | None = None, high_priority: bool = False,
                 _runtime: Runtime | None = None, _comm: Comm | None = None) -> None:
        for arg, value in (("rank", rank), ("size", size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{arg} must be an int; got {type(value).__name__} {value!r}")
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size; got rank={rank}, size={size}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be positive seconds; got {timeout!r}")
        self.posted = Posted()  # sends and receives posted, not issued yet (posting.py); abort() may read it early
        # Read-only outside this class (the parts and function modules read them).
        self.rank = rank
        self.size = size
        self.store = store                  # the group's private store
        self.timeout = float(timeout)       # seconds: setup, synchronize, the watchdog
        self.group_name = group_name
        if _runtime is None:
            reason = _nccl_lib.unavailable_reason()
            if reason is not None:
                raise BackendUnavailableError(f"the NCCL backend cannot run here: {reason}")
            from .runtime import CudaRuntime

            _runtime = CudaRuntime(_nccl_lib.load())
        refuse_nonblocking_env()
        self.runtime: Runtime = _runtime
        self.features = _runtime.features   # what the loaded NCCL and runtime can do
        self.config: dict[str, Any] = self._checked_config(config)
        self.high_priority = bool(high_priority)
        self.issue_lock = threading.RLock()  # the issue path: one op at a time, in order
        # The communicator, with the lock every call on it holds (the issue path's NCCL calls, the async error query,
        # abort, destroy): NCCL forbids concurrent calls on one communicator; the watchdog never aborts one mid-call.
        self.comm_slot = CommSlot()
        self._eager = device_id is not None
        self.device_index = -1              # the communicator's CUDA device (-1 until it exists)
        self.comm_stream = CommStream(caller_stream_max())  # its events, what lives as long as the backend (stream.py)
        self.planner: Planner | None = None  # turns ops into plans (plan.py); made with the communicator
        self.scratch = 0                    # the barrier's int32 on the device (kept by comm_stream)
        self._temps: list[Any] = []         # temporaries of the op being planned
        self.check_ins = CheckIn()          # peers checked in before NCCL first connects to them
        self.outstanding = Outstanding()    # issued, not yet seen complete (Works, Quiets)
        self.ending = Ending(self.outstanding)  # aborted / shut down, and why (ending.py)
        self._splits = 0                    # ncclCommSplit calls so far (keys the check-in)
        self.registrations = Registrations()  # memory registered with the communicator (registration.py)
        self._plans: dict[tuple[Any, ...], Plan] = {}  # plans with no local steps, by op and buffers
        self._hot: dict[tuple[Any, ...], _hot.Hot] = {}  # those of them that are one NCCL call (hot.py)
        if device_id is not None:
            count = self.runtime.device_count()
            if not isinstance(device_id, int) or isinstance(device_id, bool) or not 0 <= device_id < count:
                raise ValueError(f"device_id must be a CUDA device index in [0, {count}); got {device_id!r}")
            self._adopt(_comm if _comm is not None else self._new_comm(device_id), device_id)

    def _new_comm(self, device: int) -> Comm:
        """A communicator for this group on ``device``, made through the group's store (bootstrap.py)."""
        return create_comm(self.runtime, self.features, self.store, self.rank, self.size, timeout=self.timeout,
                           group_name=self.group_name, config=self.config or None, device=device)

    def _adopt(self, comm: Comm, device: int) -> None:
        """Take ``comm`` on ``device``, with its stream, scratch word and op planner."""
        rt = self.runtime
        prev = enter_device(rt, device)
        try:
            stream = rt.new_stream(self.high_priority) if self.high_priority else rt.new_stream()
            cc = rt.compute_capability(device)
            scratch, owner = rt.alloc(4, stream)
        finally:
            leave_device(rt, prev)
        self.comm_stream.keep((owner,))
        self.scratch = scratch
        self.comm_stream.open(stream, rt, device)
        self.planner = Planner(self.rank, self.size, self.features, self.features.fp8 and cc >= (9, 0), self._alloc_temp)
        self.device_index = device
        self.comm_slot.put(comm)

    @property
    def _comm(self) -> Comm | None:
        """The communicator (None until created), for tests outside this package (as :attr:`_rt`)."""
        return self.comm_slot.comm

    @property
    def _rt(self) -> Runtime:
        return self.runtime

    def _child(self, store: Store, rank: int, size: int, *, timeout: float, group_name: str, device_id: int | None,
               comm: Comm | None, config: Mapping[str, Any] | None, high_priority: bool) -> NCCLBackend:
        """A new backend beside this one, on its runtime (split.py, shrink.py): on ``comm``
        when given, else one made through ``store``."""
        return type(self)(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                          config=config, high_priority=high_priority, _runtime=self.runtime, _comm=comm)

    def _checked_config(self, config: Mapping[str, Any] | None) -> dict[str, Any]:
        """``config``'s set fields, refused where the loaded NCCL or the runtime cannot apply them."""
        return usable_config(config, self.features.version, self.runtime.check_config)

    def __repr__(self) -> str:
        where = f"cuda:{self.device_index}" if self.comm_slot.comm is not None else "not yet created"
        return f"<NCCLBackend group={self.group_name!r} rank={self.rank}/{self.size} {where}>"

    @property
    def device(self) -> int | None:
        """The CUDA device of the communicator; None until it is created."""
        return self.device_index if self.comm_slot.comm is not None else None

    @property
    def can_split(self) -> bool:
        """True when :meth:`split` makes new communicators with ``ncclCommSplit``: the
        communicator was created eagerly (``device_id`` given), the loaded NCCL has
        ncclCommSplit (>= 2.18), and it is neither aborted nor shut down."""
        return (self._eager and self.comm_slot.comm is not None and self.features.comm_split
                and self.ending.over is None)

    # ----- the communicator -----

    def _alloc_temp(self, nbytes: int) -> int:
        ptr, owner = self.runtime.alloc(nbytes, self.comm_stream.stream)
        self._temps.append(owner)
        return ptr

    # ----- abort state, for NCCLWork -----

    def time_ops(self) -> None:
        """Record later ops' events with timing, so that active_duration is GPU time
        (the group calls this when a completion hook is registered)."""
        self.comm_stream.time_ops()

    def has_pending(self) -> bool:
        """For the group's watchdog: True while issued ops may still be running."""
        return bool(self.outstanding)

    def poll_pending(self) -> NCCLWork | None:
        """For the group's watchdog, on its timer: notice an asynchronous NCCL error
        (which aborts), complete the ops that finished, in issue order, and return the
        oldest one still running (None when none is; a Work standing for it when it has
        none). Never raises.

        The calling thread is set up once, the first time: the communicator's device made
        current if the thread has no CUDA context (a query would make one on device 0),
        and its capture mode set to thread-local, for good: its event queries then never
        break another thread's global-mode capture (the mode is per thread; torch's
        watchdog sets the same). Posted sends and receives are issued first."""
        self.posted.flush_quietly(self, self._issue)
        return _hot.poll(self)

    def complete_earlier(self, work: NCCLWork) -> None:
        """Complete, in issue order, the ops issued before ``work`` that finished (its
        stream ran them first), so that completions and hooks follow issue order."""
        self.complete_until(work)

    def complete_until(self, stop: _hot.Pending | None) -> _hot.Pending | None:
        """Complete and drop finished works from the head of the queue, up to ``stop``
        (not included); the first one still running, or None (:func:`.hot.complete_until`)."""
        return _hot.complete_until(self, stop)

    # ----- issuing -----

    def _issue(self, op_type: str, bufs: Sequence[Buffer], build: Callable[[Planner], Plan],
               *, host_wait: bool = False, key: tuple[Any, ...] | None = None,
               works: Sequence[NCCLWork] = (), readies: Sequence[Any] = ()) -> NCCLWork:
        """Plan and launch one op. ``key`` names what the plan depends on (op, buffers, dtype,
        reduction): a plan of NCCL calls only is made once per key and reused. ``works``,
        ``readies``: posted ops' Works, and events recorded on their callers' streams."""
        if self.posted.ops:
            self.flush_p2p()
        work = works[0] if works else new_work(self, op_type, bufs, self.timeout)
        work.host_wait = work.host_wait or host_wait
        with self.issue_lock:
            over = self.ending.over
            if over is not None:
                for w in works or (work,):
                    w.doom(over)
                return work
            if self.comm_slot.comm is None:
                refuse_in_capture(self.runtime, op_type, self.group_name, bufs)
                device = first_device(op_type, bufs)
                self._adopt(self._new_comm(device), device)
            check_devices(self.device_index, self.group_name, op_type, bufs)
            planner = self.planner
            assert planner is not None
            temps: list[Any] = []
            self._temps = temps
            # Planning allocates temporaries on the communication stream: the
            # communicator's device must be current from here on, not just at launch.
            rt, device = self.runtime, self.device_index
            prev = -1 if rt.get_device() == device else enter_device(rt, device)
            try:
                callers = caller_streams(rt, bufs) if not readies else ()
                captured = False
                for s in callers:
                    captured = captured or rt.is_capturing(s)
                # cudaMalloc (a temporary) and loading a kernel module are "potentially
                # unsafe" during a capture and would invalidate it: make them in relaxed
                # mode, as torch's allocator does. They stay outside the graph, and the
                # temporaries live as long as the backend (see _launch).
                mode = rt.exchange_capture_mode(CAPTURE_RELAXED) if captured else -1
                try:
                    plan = self._plans.get(key) if key is not None else None
                    if plan is None:
                        plan = build(planner)
                        prepare_kernels(rt, device, plan)
                        if key is not None and not temps and calls_only(plan):
                            if len(self._plans) >= _PLANS_MAX:
                                self._plans.clear()
                                self._hot.clear()
                            self._plans[key] = plan
                        else:
                            key = None
                finally:
                    self._temps = []
                    if mode >= 0:
                        rt.exchange_capture_mode(mode)
                self._launch(op_type, plan, works or [work], bufs, temps, callers, captured, readies)
                if key is not None and key not in self._hot:
                    # Issued once with every check: its later calls may take the hot path.
                    hot = _hot.make(self, op_type, plan)
                    if hot is not None:
                        self._hot[key] = hot
            finally:
                leave_device(rt, prev)
        return work

    def _launch(self, op_type: str, plan: Plan, works: Sequence[NCCLWork], bufs: Sequence[Buffer],
                temps: list[Any], callers: tuple[int, ...] | None = None, captured: bool = False,
                readies: Sequence[Any] = ()) -> None:
        rt, device, cs = self.runtime, self.device_index, self.comm_stream
        comm_stream = cs.ptr
        # From _issue (callers given) the device is current already.
        prev_device = enter_device(rt, device) if callers is None else -1
        issuing = False
        try:
            check_ins = self.check_ins
            if check_ins.needed(plan):
                check_ins.check_in(op_type, plan, store=self.store, rank=self.rank, size=self.size,
                                   timeout=self.timeout, group_name=self.group_name, abort=self.abort)
            if callers is None:
                callers = caller_streams(rt, bufs)
                for s in callers:
                    captured = captured or rt.is_capturing(s)
            timing = cs.timing and not captured
            ready = rt.event(pooled=not captured, timing=timing)
            for s in callers:
                rt.record(ready.ptr, s)
                rt.wait_event(comm_stream, ready.ptr)
            for posted in readies:
                rt.wait_event(comm_stream, posted.ptr)
            issuing = True
            for phase in plan:
                _phases.run_phase(self, phase)
            end = rt.event(pooled=not captured, timing=timing)
            rt.record(end.ptr, comm_stream)
            if captured:
                # A capture must end with every forked stream joined: join the
                # communication stream back into the callers' streams now.
                for s in callers:
                    rt.wait_event(s, end.ptr)
        except Exception as exc:
            failed = _hot.issue_failed(self, op_type, exc, issuing, bufs, temps)
            if failed is exc:
                raise
            raise failed from exc
        finally:
            leave_device(rt, prev_device)
        if captured:
            # The graph uses the temporaries whenever it is replayed: keep them as long
            # as the backend lives.
            cs.keep_for_graphs(temps)
        else:
            works[0].keep_also(temps)
        prev, cs.last_end = cs.last_end, (end if timing else None)
        if not captured:
            cs.tail = end
        start = ready if timing else None  # untimed: active_duration comes from the host clock
        for w in works:
            # wait() makes the current stream wait, and the producer streams the Work
            # holds alive; never a bare handle its owner may have destroyed since.
            w.issued(device, start, end, prev, captured)
        if not captured:
            if self.outstanding.add_all(works):  # no lock (outstanding.py says why)
                # The watchdog completes works on its timer; in between, completing them
                # here, in batches, releases their arrays.
                self.complete_earlier(works[0])
                self.outstanding.batch_done()

    def _hot_or_issue(self, key: tuple[Any, ...], buf: Buffer) -> NCCLWork | None:
        """The op under ``key``, issued by its hot path (hot.py) if it has one that can."""
        hot = None if self.posted.ops else self._hot.get(key)  # (_issue issues posted ops first)
        return _hot.issue(self, hot, buf) if hot is not None else None

    # ----- synchronous ops with no Work (the IssuesQuietly protocol; hot.py), a DeviceRun's runners (quiet.py) -----

    def all_reduce_quiet(self, buf: Buffer, op: ReduceOpLike, seq: int, entry: Any, group_name: str) -> bool:
        """:meth:`all_reduce` for a synchronous caller, with no Work: True once issued
        (the caller's stream waits for it); False, having done nothing, when it must go
        the usual way."""
        if type(op) is not ReduceOp or self.posted.ops:
            return False  # the usual way (which issues posted sends and receives first)
        hot = self._hot.get(("all_reduce", buf.ptr, buf.nbytes, buf.dtype.name, op._name_))
        return hot is not None and _hot.issue_quiet(self, hot, buf, seq, entry, group_name)

    def broadcast_quiet(self, buf: Buffer, src: int, seq: int, entry: Any, group_name: str) -> bool:
        """:meth:`broadcast` as :meth:`all_reduce_quiet`."""
        hot = None if self.posted.ops else self._hot.get(("broadcast", buf.ptr, buf.nbytes, buf.dtype.name, src))
        return hot is not None and _hot.issue_quiet(self, hot, buf, seq, entry, group_name)


    # ----- the Backend protocol: reductions -----

    def all_reduce(self, buf: Buffer, op: ReduceOpLike) -> Work:
        if type(op) is not ReduceOp:
            return self._issue("all_reduce", (buf,), lambda p: p.all_reduce(buf, op))
        key = ("all_reduce", buf.ptr, buf.nbytes, buf.dtype.name, op._name_)
        return self._hot_or_issue(key, buf) or self._issue("all_reduce", (buf,), lambda p: p.all_reduce(buf, op),
                                                           key=key)

    def all_reduce_into(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        """Out-of-place all_reduce: ``out`` = the reduction of every rank's ``inp`` (same
        dtype and size; ``inp`` is not written). NCCL does this natively: no copy."""
        return self._issue("all_reduce", (out, inp), lambda p: p.all_reduce(out, op, inp))

    def all_reduce_coalesced(self, bufs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        return self._issue("all_reduce_coalesced", bufs, lambda p: merge([p.all_reduce(b, op) for b in bufs]))

    def reduce(self, buf: Buffer, dst: int, op: ReduceOpLike) -> Work:
        return self._issue("reduce", (buf,), lambda p: p.reduce(buf, dst, op))

    def reduce_scatter(self, out: Buffer, inputs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        return self._issue("reduce_scatter", [out, *inputs], lambda p: p.reduce_scatter(out, inputs, op))

    def reduce_scatter_single(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        return self._issue("reduce_scatter_single", (out, inp), lambda p: p.reduce_scatter_single(out, inp, op))

    # ----- data movement -----

    def broadcast(self, buf: Buffer, src: int) -> Work:
        key = ("broadcast", buf.ptr, buf.nbytes, buf.dtype.name, src)
        return self._hot_or_issue(key, buf) or self._issue("broadcast", (buf,), lambda p: p.broadcast(buf, src),
                                                           key=key)

    def all_gather(self, outs: Sequence[Buffer], inp: Buffer) -> Work:
        return self._issue("all_gather", [inp, *outs], lambda p: p.all_gather(outs, inp))

    def all_gather_single(self, out: Buffer, inp: Buffer) -> Work:
        return self._issue("all_gather_single", (out, inp), lambda p: p.all_gather_single(out, inp))

    def all_gather_coalesced(self, outs: Sequence[Sequence[Buffer]], inps: Sequence[Buffer]) -> Work:
        bufs = [*inps, *(b for group in outs for b in group)]
        return self._issue("all_gather_coalesced", bufs,
                           lambda p: merge([p.all_gather(o, i) for o, i in zip(outs, inps)]))

    def gather(self, outs: Sequence[Buffer] | None, inp: Buffer, dst: int) -> Work:
        return self._issue("gather", [inp, *(outs or ())], lambda p: p.gather(outs, inp, dst))

    def scatter(self, out: Buffer, inputs: Sequence[Buffer] | None, src: int) -> Work:
        return self._issue("scatter", [out, *(inputs or ())], lambda p: p.scatter(out, inputs, src))

    def all_to_all(self, outs: Sequence[Buffer], inputs: Sequence[Buffer]) -> Work:
        return self._issue("all_to_all", [*inputs, *outs], lambda p: p.all_to_all(outs, inputs))

    def all_to_all_single(self, out: Buffer, inp: Buffer,
                          out_counts: Sequence[int], in_counts: Sequence[int]) -> Work:
        return self._issue("all_to_all_single", (out, inp),
                           lambda p: p.all_to_all_single(out, inp, out_counts, in_counts))

    # ----- point to point -----

    def send(self, buf: Buffer, dst: int, tag: int) -> Work:
        """Post a send to ``dst`` (posting.py: issued in one group with those posted with it),
        or issue it at once where it cannot be posted (a capture, no communicator yet)."""
        return self.posted.post(self, "send", buf, dst, self.flush_p2p) or \
            self._issue("send", (buf,), lambda p: p.p2p([("send", buf, dst)]))

    def recv(self, buf: Buffer, src: int | None, tag: int) -> Work:
        """Post a receive from ``src`` (as :meth:`send`)."""
        if src is None:
            raise ValueError("recv from any source (src=None) is not possible with NCCL: name the "
                             "source rank, or use host arrays (the CPU backend)")
        return self.posted.post(self, "recv", buf, src, self.flush_p2p) or \
            self._issue("recv", (buf,), lambda p: p.p2p([("recv", buf, src)]))

    def flush_p2p(self) -> None:
        """Issue the sends and receives posted and not issued yet, as one NCCL group."""
        self.posted.flush(self, self._issue)

    def batch_p2p(self, ops: Sequence[tuple[str, Buffer, int, int]]) -> Work:
        for kind, _, peer, _ in ops:
            if peer is None:
                raise ValueError(f"batch_p2p: a {kind} with peer=None is not possible with NCCL")
        return self._issue("batch_isend_irecv", [b for _, b, _, _ in ops],
                           lambda p: p.p2p([(k, b, peer) for k, b, peer, _ in ops]))

    # ----- control -----

    def barrier(self) -> Work:
        """An all_reduce of one int on every rank; its Work's wait() blocks the host."""
        with self.issue_lock:
            if self.comm_slot.comm is None and self.ending.over is None:
                refuse_in_capture(self.runtime, "barrier", self.group_name, ())
                device = self.runtime.get_device()
                self._adopt(self._new_comm(device), device)
        s = self.scratch
        plan: Plan = [([], [("all_reduce", s, s, 1, NCCL_DTYPES["int32"], OP_SUM)], [])]
        # stream=None: order after the caller's current stream, so that a completed
        # barrier also means this rank's earlier GPU work is done.
        scratch = Buffer(s, 4, DTYPES["int32"], (1,), Device("cuda", self.device_index), stream=None)
        return self._issue("barrier", (scratch,), lambda p: plan, host_wait=True)

    # ----- the end of the communicator (lifecycle.py), new groups (split.py, shrink.py) -----

    def abort(self, reason: str) -> None:
        """Abort the communicator: every pending and later op fails with DistBackendError
        naming itself and ``reason``; safe from any thread, more than once."""
        self.posted.fail(reason)
        _lifecycle.abort(self, reason)

    def shutdown(self) -> None:
        """Wait (up to the timeout) for queued ops, then destroy the communicator; abort
        it instead if they do not finish. Idempotent; later ops fail. Posted ops go first."""
        self.posted.flush_quietly(self, self._issue)
        _lifecycle.shutdown(self)

    def failure(self) -> str | None:
        """Why every pending op fails (abort, asynchronous NCCL error: asking NCCL for
        one aborts), or None while healthy. Never blocks on a call in flight."""
        return _lifecycle.failure(self)
    register_buffer, deregister_buffer = _register_buffer, _deregister_buffer  # registration.py (RegistersBuffers)
    all_reduce_runners = _quiet.all_reduce_runners  # quiet.py (a group's DeviceRun)

    def split(self, ranks: Sequence[int] | None, *, color: int = 0, store: Store, group_name: str,
              timeout: float, config: Mapping[str, Any] | None = None,
              high_priority: bool = False) -> NCCLBackend | None:
        """The backend of a new group carved out of this one. Every rank of this group
        must call it, at the same point of its op sequence, whether it joins a new group
        or not (that is how ``ncclCommSplit`` works).

        Args:
            ranks: the members of this rank's new group as ranks of this group, in the
                new group's rank order; None (or a list without this rank) for a rank
                that joins no new group.
            color: tells new groups apart when one call makes several disjoint groups
                (torch's ``split_group``): ranks passing the same ``ranks`` pass the same
                color >= 0, different groups different colors.
            store: the new group's private store (used when no split is possible).
            group_name: the new group's name.
            timeout: the new group's timeout, seconds.
            config: the new group's ncclConfig_t fields (NCCLOptions.config), passed to
                ncclCommSplit (or ncclCommInitRankConfig); None: NCCL's defaults.
            high_priority: the new group's stream priority (NCCLOptions).

        When :attr:`can_split`, ``ncclCommSplit`` (:func:`.split.split_comm`), after every
        rank counted itself in through this group's store (docs/nccl-backend.md, "New
        groups"); otherwise members build one through ``store``, non-members return.

        Returns:
            The new group's backend on members; None elsewhere.

        Raises:
            ValueError: ``color`` < 0.
            BackendUnavailableError: a config field the loaded NCCL or runtime cannot apply.
            DistBackendError: the split failed, or not every rank reached it in time.
        """
        if not isinstance(color, int) or color < 0:
            raise ValueError(f"color must be an int >= 0; got {color!r}")
        config = self._checked_config(config)
        members = list(ranks) if ranks is not None else []
        member = self.rank in members
        new_rank = members.index(self.rank) if member else -1
        self.flush_p2p()
        with self.issue_lock:
            if self.can_split:
                comm = self.comm_slot.comm
                assert comm is not None
                self._splits += 1
                device = self.device_index
                new = split_comm(comm, self.runtime, device, self.store, f"nccl/split{self._splits}", self.size,
                                 timeout=timeout, parent_timeout=self.timeout,
                                 drain=lambda t: _lifecycle.drain(self, t), parent_name=self.group_name,
                                 group_name=group_name, color=color if member else -1,
                                 new_rank=max(new_rank, 0), config=config, comm_lock=self.comm_slot.lock)
                if self.ending.aborted is not None:
                    _lifecycle.abort_comm(self, blocking=True)  # an abort that arrived during the split
                if new is None:
                    return None
                check_split(new, new_rank, len(members), group_name)
                return self._child(store, new_rank, len(members), timeout=timeout, group_name=group_name,
                                   device_id=device, comm=new, config=config, high_priority=high_priority)
        if not member:
            return None
        return self._child(store, new_rank, len(members), timeout=timeout, group_name=group_name,
                           device_id=self.device_index if self._eager else None, comm=None, config=config,
                           high_priority=high_priority)

    @property
    def can_shrink(self) -> bool:
        """True when :meth:`shrink` can run: the communicator was created eagerly, the
        loaded NCCL has ncclCommShrink (>= 2.27), and it is neither aborted nor shut down."""
        return (self._eager and self.comm_slot.comm is not None and self.features.comm_shrink
                and self.ending.over is None)

    def shrink(self, exclude: Sequence[int], *, store: Store, group_name: str, timeout: float,
               config: Mapping[str, Any] | None = None, high_priority: bool = False) -> NCCLBackend:
        """The backend of group ``group_name``: this communicator without the ranks in
        ``exclude``, made with ``ncclCommShrink(..., NCCL_SHRINK_ABORT)``
        (:func:`.shrink.shrink_comm`); every rank not excluded calls it with the same
        list. This backend is aborted afterwards (its pending ops fail); the caller shuts
        it down. ``config`` (ncclConfig_t fields, None: inherited) reaches
        ncclCommShrink; ``high_priority`` is the new stream's priority.

        Raises:
            DistBackendError: :attr:`can_shrink` is False, or NCCL's shrink failed.
        """
        gone = sorted(set(exclude))
        config = self._checked_config(config)
        self.posted.fail(f"group {self.group_name!r} was shrunk into {group_name!r}")
        with self.issue_lock:
            if not self.can_shrink:
                raise DistBackendError(f"group {self.group_name!r}: its NCCL communicator cannot be shrunk "
                                       f"({self.ending.over or 'ncclCommShrink unavailable'})")
            device = self.device_index
            new = shrink_comm(self.comm_slot, self.runtime, device, gone, parent_name=self.group_name,
                              group_name=group_name, config=config)
        if self.ending.aborted is not None:
            _lifecycle.abort_comm(self, blocking=True)  # an abort that arrived during the shrink
        _lifecycle.abort(self, f"group {self.group_name!r} was shrunk into {group_name!r}")
        check_shrunk(new, self.rank, self.size, gone, group_name)
        return self._child(store, new.rank, new.size, timeout=timeout, group_name=group_name,
                           device_id=device, comm=new, config=config, high_priority=high_priority)
