"""ProcessGroup: a set of ranks that run collectives together.

A group owns its store namespace, its backends and its issuer (:mod:`.core`). Each
call is dispatched by where its arrays live: host memory to the CPU backend, device
memory to the NCCL backend (made on first device op unless ``device_id`` was given);
object collectives and barriers always use the CPU backend (DESIGN.md, Multi-backend
groups). Methods take *group* ranks (:mod:`gpucoll._collectives` translates torch's
global ones). Every check that can be made locally is made before the backend sees
the call, with the same rules on every rank; a repeated op finds them made in its plan.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Sequence, Union

import numpy as np

from .. import array as _array
from ..array import ArrayLike
from .._backends.base import Backend, ReducesInto, RunsNow
from .._buffer import Buffer
from .._reduce_op import ReduceOp, ReduceOpLike
from .._timeouts import to_seconds
from .._work import Work, WorkInfo
from ..errors import DistBackendError
from ..store import PrefixStore, Store
from .arglists import TAG_MAX, _a2a_lists, _check_chunked, _check_rank, _coalesced_lists, _list_like, _p2p_check, _split_counts, _uneven_list
from .barrier import monitored_barrier
from .registration import METHODS as _MEMORY_METHODS
from .checks import _check_op, _list_dtypes, _one_dtype, _real_view
from .coalescing import CoalescingManager, _not_coalescable
from .dispatch import backend_for, backend_for_all, make_device_backend_for, set_device_backend
from .core import Issuer, remember_host_run, time_ops
from .device_run import restate
from .into import all_reduce_into as _all_reduce_into
from .options import PGOptions
from .registry import _BACKEND_GRACE_S, BACKENDS, backend_kwargs

__all__ = ["ProcessGroup", "TAG_MAX"]


ArrayOrBuffer = Union[ArrayLike, Buffer]
"""What a ProcessGroup method takes: an :data:`~gpucoll.array.ArrayLike`, or a Buffer the
library made already (functional passes those)."""


class ProcessGroup:
    """The ranks of one communicator, with torch's ``rank()``/``size()`` accessors.

    Made by :func:`gpucoll.init_process_group`, :func:`gpucoll.new_group` and
    friends; not meant to be constructed directly. A group holds its store, its
    backends and an :class:`~gpucoll._group.core.Issuer` (sequence numbers, flight
    recorder, hooks, watchdog, timeout, plans); each op method checks its arguments,
    picks the backend and hands the op to the issuer.

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
            (by :func:`~gpucoll._group.dispatch.split_device_backend_of` of its parent); used instead of a new one.
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
        self._destroyed = False
        self._coalescing: CoalescingManager | None = None  # while a coalescing() block is open
        self._split_count = 0
        self._last_release: str | None = None  # monitored_barrier's key still to delete
        self._monitored_seq = 0  # monitored barriers so far (p2p ops advance the sequence unevenly across ranks)
        # The object collectives' reusable arrays (gpucoll._objects: made on first use; a
        # list, so that a call takes them with one atomic pop and a concurrent call sees none).
        self._object_scratch: list[Any] | None = None
        # A "fake" group's one backend serves host and device arrays alike (_backends/fake.py).
        self._cpu: Backend = BACKENDS["fake" if backend == "fake" else "cpu"](PrefixStore("cpu", store), rank, size,
                                             timeout=timeout + _BACKEND_GRACE_S, group_name=group_name,
                                             device_id=None, **backend_kwargs(pg_options, "cpu"))
        self._nccl: Backend | None = None
        self._nccl_into: ReducesInto | None = None  # the device backend, if it reduces out of place
        self._issuer = Issuer(group_name, self._label(), rank, self.global_ranks[rank], size, timeout,
                              self._cpu, group_desc)
        self._plans = self._issuer.plans  # the issuer's plan cache, looked up by the hot ops
        self._host_runs = self._host_open = self._issuer.host_runs  # (_host_open: set by _restate)
        self._device_runs: dict[tuple[Any, ...], Any] = {}  # (both set by _restate)
        self._device_seen: dict[int, Any] = {}
        self._restate()
        self._barrier_now = self._cpu.barrier_now if isinstance(self._cpu, RunsNow) else None
        self._watchdog, self._recorder = self._issuer.watchdog, self._issuer.recorder  # (debug tools read them)
        # Bound at creation on every rank: only then may new groups split its communicator (one
        # made by a first device op may exist on some ranks and not yet on others).
        self._bound = backend == "nccl" and (device_id is not None or device_backend is not None)
        self.bound_device_id: int | None = device_id  # torch's: the device given at creation, else None
        if device_backend is not None:
            if backend != "nccl":
                raise ValueError(f"group {group_name!r}: a device backend was given to a {backend} group")
            set_device_backend(self, device_backend)
            self._device_id = getattr(device_backend, "device", device_id)
        elif backend == "nccl" and device_id is not None:
            try:
                set_device_backend(self, make_device_backend_for(self, device_id))
            except BaseException:
                self._issuer.stop()
                self._cpu.shutdown()
                raise

    _restate = restate  # device_run.py: the device path's dicts, kept in step by every writer

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
        return self._issuer.seq

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
        self._issuer.hooks.append(hook)
        self._restate()
        time_ops(self._nccl)  # a hook reads active_duration: the device backend times its ops

    def dump_flight_recorder(self, path: str | None = None) -> str:
        """Return the flight recorder's JSON (the group's last ops); also write it to ``path`` if given.

        Raises:
            RuntimeError: recording is off (``GPUCOLL_FLIGHT_RECORDER_SIZE=0``).
        """
        recorder = self._issuer.recorder
        if recorder is None:
            raise RuntimeError("the flight recorder is off (GPUCOLL_FLIGHT_RECORDER_SIZE=0)")
        if path is not None:
            recorder.dump(path, reason="on request")
        return recorder.to_json(reason="on request")

    # ----- dispatch and issue -----
    def _check_usable(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"process group {self.group_name!r} has been destroyed; "
                               "create a new one to run collectives")

    def _check_rank(self, r: Any, name: str) -> int:
        return _check_rank(self._size, self.group_name, r, name)

    def _backend_for_all(self, bufs: Sequence[Buffer], names: Sequence[str]) -> Backend:
        """For coalescing blocks (a CoalescingGroup): :func:`~gpucoll._group.dispatch.backend_for_all`."""
        return backend_for_all(self, bufs, names)

    def _issue(self, backend: Backend, start: Callable[[], Work], buf: Buffer | None,
               outputs: list[Any], peer: int = -1, op: str = "", red: Any = None, async_op: bool = False) -> Work:
        return self._issuer.issue(backend, start, buf, outputs, peer, op, red, async_op)

    def _collective(self, backend: Backend, start: Callable[[], Work], buf: Buffer | None, outputs: list[Any],
                    peer: int = -1, op: str = "", red: Any = None, *, async_op: bool) -> Work | None:
        """Issue a collective (started as async where asked: ISSUING_ASYNC) and finish it."""
        return self._finish(backend, self._issue(backend, start, buf, outputs, peer, op, red, async_op), async_op)

    def _finish(self, backend: Backend, work: Work, async_op: bool) -> Work | None:
        return self._issuer.finish(backend, work, async_op, backend is not self._cpu)

    # ----- reductions -----
    def all_reduce(self, tensor: ArrayOrBuffer, op: ReduceOpLike = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across the group, in place on every rank."""
        if type(tensor) is np.ndarray and type(op) is ReduceOp:  # a NumPy kind already run: its HostRun (see there)
            fast = (issuer := self._issuer).host_last  # the kind run last, checked without hashing a key
            if fast is None or fast.dtype is not tensor.dtype or fast.op is not op or fast.shape != tensor.shape:
                # (_host_open is empty while the general path is needed, _restate: no other check here)
                fast = issuer.host_last = self._host_open.get((tensor.dtype, tensor.shape, op._name_))
            if fast is not None and tensor.flags.carray:  # (C-contiguous, aligned and writable: one look-up)
                flat = tensor if fast.one_dim else tensor.reshape(-1)
                if not async_op:
                    return issuer.run_host(fast, flat, tensor)
                if fast.inline:
                    return issuer.run_now(fast.backend, fast.run, fast.start, (flat, fast.reducer), fast.desc,
                                          "all_reduce", [tensor], -1, True)
        elif type(tensor) is _array._cupy_ndarray:  # one already run: its DeviceRun
            cp: Any = tensor
            # This very array, last run with this op, by identity (device_run.py); both dicts
            # are empty while the general path is needed (_restate): no other check here.
            seen = self._device_seen.get(id(cp))
            if seen is not None and seen[0]() is cp and op is seen[1] and cp._c_contiguous:
                return self._issuer.run_device(seen[2], cp, async_op)
            if type(op) is ReduceOp:
                mem = cp.data
                run = self._device_runs.get((mem.ptr, mem.device_id, cp.dtype, cp.shape, op._name_))
                if run is not None and cp._c_contiguous:  # (what the run's key does not settle)
                    self._issuer.saw(cp, op, run)
                    return self._issuer.run_device(run, cp, async_op)
        if self._destroyed:
            self._check_usable()
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        # A repeated op's plan (its checks below passed); strs and ints in the key hash in C.
        key = ("all_reduce", buf.dtype.name, buf.shape, buf.device.type, buf.device.index, op._name_) if op.__class__ is ReduceOp else None
        plan = self._plans.get(key) if key is not None and self._coalescing is None else None
        if plan is None:
            red = _check_op(op, buf.dtype)
            if self._coalescing is not None:
                return self._coalescing._defer(self, "all_reduce", red, ("tensor", buf, tensor), async_op)
            backend = backend_for(self, buf, "tensor")
            plan = self._issuer.plan(key, backend, red, backend is not self._cpu, "all_reduce_quiet")
        backend, red, issuer, now = plan.backend, plan.red, self._issuer, plan.now
        if now is not None and (not async_op or buf.nbytes <= plan.inline_max) and not issuer.hooks \
                and not issuer.debug_detail:  # no Work (async: one complete from birth)
            if type(tensor) is np.ndarray and type(op) is ReduceOp and len(self._host_runs) < 1024:
                remember_host_run(self._host_runs, backend, tensor, buf, red, op)
            return issuer.run_now(backend, now, backend.all_reduce, (buf, red), buf, "all_reduce", [tensor], -1, async_op)
        if plan.quiet is not None and type(tensor) is _array._cupy_ndarray and type(op) is ReduceOp:
            return issuer.call_and_remember(backend, plan.quiet, buf, red, tensor, op, async_op)  # (a DeviceRun)
        if plan.quiet is not None and not async_op:  # a synchronous device op: no Work unless one is needed
            return issuer.call_quiet(backend, plan.quiet, buf, red, tensor, "all_reduce", red)
        return issuer.call(backend, backend.all_reduce, (buf, red), buf, [tensor], async_op, plan.device, "all_reduce", red)

    def _all_reduce_into(self, output: Any, input: Any, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """``output`` = the reduction of every rank's ``input`` (the functional API's
        all_reduce, gpucoll-bench's out-of-place all_reduce; ``input`` is left alone).
        A device backend that reduces out of place (NCCL) does it in one op; otherwise
        ``input`` is copied into ``output``, which is then reduced in place (into.py)."""
        return _all_reduce_into(self, output, input, op, async_op)

    def all_reduce_coalesced(self, tensors: Sequence[ArrayOrBuffer], op: ReduceOpLike = ReduceOp.SUM,
                             async_op: bool = False) -> Work | None:
        """All-reduce several arrays as one op."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("all_reduce_coalesced")
        names = [f"tensors[{i}]" for i in range(len(tensors))]
        if not names:
            raise ValueError("tensors must contain at least one array")
        bufs = [_array.as_buffer(t, name=n, writable=True) for t, n in zip(tensors, names)]
        bufs, names = _one_dtype(bufs, names, "all_reduce_coalesced")
        reds = [_check_op(op, b.dtype) for b in bufs]
        backend = backend_for_all(self, bufs, names)
        work = self._issue(backend, lambda: backend.all_reduce_coalesced(bufs, reds[0]), bufs[0], list(tensors),
                           op="all_reduce_coalesced", red=reds[0], async_op=async_op)
        work._wait_gives_result = True
        return self._finish(backend, work, async_op)

    def reduce(self, tensor: ArrayOrBuffer, dst: int, op: ReduceOpLike = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` into rank ``dst``'s (group rank) copy."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("reduce")
        self._check_rank(dst, "group_dst")
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        red = _check_op(op, buf.dtype)
        backend = backend_for(self, buf, "tensor")
        return self._collective(backend, lambda: backend.reduce(buf, dst, red), buf, [tensor], dst, op="reduce",
                                red=red, async_op=async_op)

    def reduce_scatter(self, output: ArrayOrBuffer, input_list: Sequence[ArrayOrBuffer], op: ReduceOpLike = ReduceOp.SUM,
                       async_op: bool = False) -> Work | None:
        """Reduce ``input_list[i]`` over ranks into rank i's ``output``.

        As torch's: ``input_list[i]`` may have rank i's own size (uneven chunks), the
        same on every rank; ``input_list[rank]`` must be laid out like ``output``."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("reduce_scatter")
        out = _array.as_buffer(output, name="output", writable=True)
        ins = _uneven_list(self, input_list, "input_list", out, "output")
        red = _check_op(op, out.dtype)
        backend = backend_for_all(self, [out, *ins], ["output"] + [f"input_list[{i}]" for i in range(len(ins))])
        return self._collective(backend, lambda: backend.reduce_scatter(out, ins, red), out, [output], op="reduce_scatter",
                                red=red, async_op=async_op)

    def reduce_scatter_single(self, output: ArrayOrBuffer, input: ArrayOrBuffer, op: ReduceOpLike = ReduceOp.SUM,
                              async_op: bool = False) -> Work | None:
        """Reduce ``input`` (``size`` consecutive chunks) over ranks; rank i gets chunk i in ``output``."""
        self._check_usable()
        out = _array.as_buffer(output, name="output", writable=True)
        inp = _array.as_buffer(input, name="input")
        _check_chunked(self, inp, out, "input", "output")
        red = _check_op(op, out.dtype)
        if self._coalescing is not None:
            return self._coalescing._defer(self, "reduce_scatter_single", red,
                                           ("output", out, output, inp), async_op)
        backend = backend_for_all(self, [out, inp], ["output", "input"])
        return self._collective(backend, lambda: backend.reduce_scatter_single(out, inp, red), out, [output],
                                op="reduce_scatter_single", red=red, async_op=async_op)

    # ----- data movement -----
    def broadcast(self, tensor: ArrayOrBuffer, src: int, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from group rank ``src`` to every rank."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("broadcast")
        self._check_rank(src, "group_src")
        buf = _array.as_buffer(tensor, name="tensor", writable=True)
        key = ("broadcast", buf.dtype.name, buf.shape, buf.device.type, buf.device.index, src)
        plan = self._plans.get(key)
        if plan is None:
            backend = backend_for(self, buf, "tensor")
            plan = self._issuer.plan(key, backend, None, backend is not self._cpu, "broadcast_quiet", "broadcast_now")
        backend, issuer = plan.backend, self._issuer
        if plan.now is not None and (not async_op or buf.nbytes <= plan.inline_max) and not issuer.hooks \
                and not issuer.debug_detail:  # no Work (async: one complete from birth)
            return issuer.run_now(backend, plan.now, backend.broadcast, (buf, src), buf, "broadcast", [tensor], src, async_op)
        return issuer.call(backend, backend.broadcast, (buf, src), buf, [tensor], async_op, plan.device,
                           "broadcast", None, src, plan.quiet)

    def all_gather(self, tensor_list: Sequence[ArrayOrBuffer], tensor: ArrayOrBuffer, async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list`` (one array per rank) on every rank."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("all_gather")
        inp = _array.as_buffer(tensor, name="tensor")
        outs = _list_like(self, tensor_list, "tensor_list", inp, "tensor", writable=True, views=True)
        inp = _real_view(inp)
        backend = backend_for_all(self, [inp, *outs], ["tensor"] + [f"tensor_list[{i}]" for i in range(len(outs))])
        return self._collective(backend, lambda: backend.all_gather(outs, inp), inp, list(tensor_list),
                                op="all_gather", async_op=async_op)

    def all_gather_single(self, output: ArrayOrBuffer, input: ArrayOrBuffer, async_op: bool = False) -> Work | None:
        """Gather every rank's ``input`` into ``output`` (``size`` consecutive chunks, rank order)."""
        self._check_usable()
        out = _array.as_buffer(output, name="output_tensor", writable=True)
        inp = _array.as_buffer(input, name="input_tensor")
        key = (op := "all_gather_single", out.dtype.name, out.nbytes, inp.dtype.name, inp.nbytes, out.device.type,
               out.device.index, inp.device.type, inp.device.index)  # what the checks below depend on
        plan = self._plans.get(key) if self._coalescing is None else None
        if plan is None:
            _check_chunked(self, out, inp, "output_tensor", "input_tensor")
            if self._coalescing is not None:
                return self._coalescing._defer(self, "all_gather_single", None,
                                               ("output_tensor", out, output, inp), async_op)
            backend = backend_for_all(self, [out, inp], ["output_tensor", "input_tensor"])
            plan = self._issuer.plan(key, backend, None, backend is not self._cpu, now="all_gather_single_now")
        backend, issuer = plan.backend, self._issuer
        if plan.now is not None and (not async_op or out.nbytes + inp.nbytes <= plan.inline_max) \
                and not issuer.hooks and not issuer.debug_detail:  # no Work (async: one complete from birth)
            return issuer.run_now(backend, plan.now, backend.all_gather_single, (out, inp), inp, op, [output], -1, async_op)
        return issuer.call(backend, backend.all_gather_single, (out, inp), inp, [output], async_op, plan.device, op)

    def all_gather_coalesced(self, output_lists: Sequence[Sequence[Any]], input_list: Sequence[ArrayOrBuffer],
                             async_op: bool = False) -> Work | None:
        """Several all_gathers as one op: ``output_lists[r][k]`` gets rank r's ``input_list[k]``
        (torch's layout: one list per rank, each with one array per input)."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("all_gather_coalesced")
        ins, outs = _coalesced_lists(self, output_lists, input_list)
        ins = [_real_view(b) for b in ins]
        flat = ins + [b for row in outs for b in row]
        names = [f"input_tensor_list[{k}]" for k in range(len(ins))] + \
            [f"output_tensor_lists[{r}][{k}]" for k in range(len(outs)) for r in range(self._size)]
        backend = backend_for_all(self, flat, names)
        return self._collective(backend, lambda: backend.all_gather_coalesced(outs, ins), ins[0],
                                [list(row) for row in output_lists], op="all_gather_coalesced", async_op=async_op)

    def gather(self, tensor: ArrayOrBuffer, gather_list: Sequence[ArrayOrBuffer] | None, dst: int,
               async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``gather_list`` on group rank ``dst``."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("gather")
        self._check_rank(dst, "group_dst")
        inp = _list_dtypes(gather_list, _array.as_buffer(tensor, name="tensor"), "gather_list", "tensor")
        outs: list[Buffer] | None = None
        if self._rank == dst:
            if not gather_list:
                raise ValueError(f"gather_list is required on the destination rank {dst} "
                                 f"({self._size} arrays shaped like tensor)")
            outs = _list_like(self, gather_list, "gather_list", inp, "tensor", writable=True, views=True)
        elif gather_list:
            raise ValueError(f"gather_list must not be given on a non-destination rank (this is rank "
                             f"{self._rank}, dst is {dst})")
        inp = _real_view(inp)
        backend = backend_for_all(self, [inp, *(outs or ())], ["tensor"] + ["gather_list"] * len(outs or ()))
        return self._collective(backend, lambda: backend.gather(outs, inp, dst), inp,
                                list(gather_list) if gather_list else [], dst, op="gather", async_op=async_op)

    def scatter(self, tensor: ArrayOrBuffer, scatter_list: Sequence[ArrayOrBuffer] | None, src: int,
                async_op: bool = False) -> Work | None:
        """Send ``scatter_list[i]`` from group rank ``src`` into rank i's ``tensor``."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("scatter")
        self._check_rank(src, "group_src")
        out = _list_dtypes(scatter_list, _array.as_buffer(tensor, name="tensor", writable=True), "scatter_list",
                           "tensor")
        ins: list[Buffer] | None = None
        if self._rank == src:
            if not scatter_list:
                raise ValueError(f"scatter_list is required on the source rank {src} "
                                 f"({self._size} arrays shaped like tensor)")
            ins = _list_like(self, scatter_list, "scatter_list", out, "tensor", writable=False, views=True)
        elif scatter_list:
            raise ValueError(f"scatter_list must not be given on a non-source rank (this is rank "
                             f"{self._rank}, src is {src})")
        out = _real_view(out)
        backend = backend_for_all(self, [out, *(ins or ())], ["tensor"] + ["scatter_list"] * len(ins or ()))
        return self._collective(backend, lambda: backend.scatter(out, ins, src), out, [tensor], src, op="scatter",
                                async_op=async_op)

    def all_to_all(self, output_list: Sequence[Any], input_list: Sequence[ArrayOrBuffer],
                   async_op: bool = False) -> Work | None:
        """Rank i sends ``input_list[j]`` to rank j, which receives it in ``output_list[i]``."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("all_to_all")
        outs, ins, names = _a2a_lists(self, output_list, input_list)
        backend = backend_for_all(self, outs + ins, names)
        return self._collective(backend, lambda: backend.all_to_all(outs, ins), ins[0], list(output_list),
                                op="all_to_all", async_op=async_op)

    def all_to_all_single(self, output: ArrayOrBuffer, input: ArrayOrBuffer, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """Split ``input`` along dim 0 (``input_split_sizes`` rows to each rank), exchange, and
        concatenate what arrives in ``output`` (``output_split_sizes`` rows from each rank)."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("all_to_all_single")
        out, inp, out_counts, in_counts = _split_counts(self, output, input, output_split_sizes, input_split_sizes)
        backend = backend_for_all(self, [out, inp], ["output", "input"])
        return self._collective(backend, lambda: backend.all_to_all_single(out, inp, out_counts, in_counts), inp,
                                [output], op="all_to_all_single", async_op=async_op)

    # ----- point to point -----
    def send(self, tensor: ArrayOrBuffer, dst: int, tag: int = 0, async_op: bool = True) -> Work:
        """Send ``tensor`` to group rank ``dst``; returns its Work (completed unless ``async_op``)."""
        self._check_usable()
        buf = _p2p_check(self, tensor, dst, tag, "group_dst", writable=False)
        if self._coalescing is not None:
            return self._coalescing._defer_p2p(self, ("send", buf, tensor, dst, tag))
        backend = backend_for(self, buf, "tensor")
        work = self._issue(backend, lambda: backend.send(buf, dst, tag), buf, [], dst)
        self._finish(backend, work, async_op)
        return work

    def recv(self, tensor: ArrayOrBuffer, src: int | None, tag: int = 0, async_op: bool = True) -> Work:
        """Receive into ``tensor`` from group rank ``src`` (None: any rank); returns its Work
        (completed unless ``async_op``; ``work.source_rank()`` names the sender)."""
        self._check_usable()
        buf = _p2p_check(self, tensor, src, tag, "group_src", writable=True)
        if self._coalescing is not None:
            if src is None:
                raise ValueError("recv from any source (src=None) cannot run inside gpucoll.coalescing()")
            return self._coalescing._defer_p2p(self, ("recv", buf, tensor, src, tag))
        backend = backend_for(self, buf, "tensor")
        work = self._issue(backend, lambda: backend.recv(buf, src, tag), buf, [tensor],
                           -1 if src is None else src)
        self._finish(backend, work, async_op)
        return work

    def batch_p2p(self, ops: Sequence[tuple[str, Any, int, int]]) -> Work:
        """Post ``(kind, array, group peer, tag)`` sends/receives together; one Work for all."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("batch_isend_irecv")
        if not ops:
            raise ValueError("p2p_op_list must not be empty")
        bufs = [_p2p_check(self, t, peer, tag, "peer", writable=(kind == "recv")) for kind, t, peer, tag in ops]
        backend = backend_for_all(self, bufs, [f"p2p_op_list[{i}].tensor" for i in range(len(bufs))])
        batch = [(kind, b, peer, tag) for (kind, _, peer, tag), b in zip(ops, bufs)]
        outputs = [t for kind, t, _, _ in ops if kind == "recv"]
        work = self._issue(backend, lambda: backend.batch_p2p(batch), bufs[0], outputs)
        self._finish(backend, work, True)
        return work

    # ----- control -----
    def barrier(self, async_op: bool = False) -> Work | None:
        """Block until every rank of the group has called barrier (host-side; CPU backend)."""
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("barrier")
        backend, issuer, now = self._cpu, self._issuer, self._barrier_now
        if now is not None and not async_op and not issuer.hooks and not issuer.debug_detail:
            return issuer.run_now(backend, now, backend.barrier, (), None, "barrier", [])
        work = issuer.issue(backend, backend.barrier, None, [], async_op=async_op)
        return issuer.finish(backend, work, async_op, False)

    def monitored_barrier(self, timeout: float | timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier through the store that names the ranks that did not arrive.

        Rank 0 waits up to ``timeout`` (seconds or ``timedelta``; default the group's
        timeout; 0: no waiting) for every rank's arrival key, then releases the others
        with "ok" or with the list of missing ranks (so every rank that is still alive
        raises the same error). Monitored barriers are numbered by a counter of their
        own, so other ops (point-to-point ones included) may differ between ranks.

        Raises:
            DistBackendError: some ranks did not arrive in time (named in the message).
        """
        self._check_usable()
        if self._coalescing is not None:
            _not_coalescable("monitored_barrier")
        seconds = to_seconds(timeout, default=self.timeout, allow_zero=True)
        self._issuer.seq += 1
        self._monitored_seq += 1
        if self.backend_name == "fake":
            return  # no other rank exists to wait for
        self._last_release = monitored_barrier(self._store, self._rank, self._size, self._monitored_seq,
                                               self.group_name, seconds, wait_all_ranks, self._last_release,
                                               getattr(self._cpu, "peer_gone", lambda peer: None))

    register_buffer, deregister_buffer, register_mem_pool, deregister_mem_pool = _MEMORY_METHODS  # registration.py
    # ----- teardown -----
    def _destroy(self) -> None:
        """Shut down the group's backends and watchdog; later calls raise RuntimeError."""
        if self._destroyed:
            return
        self._destroyed = True
        self._restate()
        errors: list[BaseException] = []
        for backend in (self._nccl, self._cpu):
            if backend is not None:
                try:
                    backend.shutdown()
                except Exception as exc:
                    errors.append(exc)
        hook_errors = self._issuer.stop()
        if hook_errors:
            hook, hook_exc = hook_errors[0]
            raise RuntimeError(f"a completion hook of group {self.group_name!r} raised "
                               f"({len(hook_errors)} time(s)); first: {hook!r}: {hook_exc!r}") from hook_exc
        if errors:
            raise DistBackendError(f"shutting down group {self.group_name!r} failed: {errors[0]}") from errors[0]

