"""The CPU backend: every collective on host (NumPy-addressable) memory.

Gloo-like. Peers connect once over TCP (addresses through the group's store, port
0); ranks on one host move collective data through a shared-memory segment
(:mod:`.shm`, :mod:`.shm_algos`), ranks on several hosts through the TCP mesh
(:mod:`.tcp`, :mod:`.tcp_algos`). Reductions are NumPy ufuncs with ``out=``
(:mod:`.reduce`); op signatures for the cross-rank check live in :mod:`.signatures`. Point-to-point messages always use the TCP mesh.

Execution: ops run one at a time, in issue order. A small op issued while nothing
is queued runs at once on the caller's thread (no thread hand-off, which is most of
a small op's cost); anything else goes to the backend's worker thread. An
``async_op=True`` op of the Work-less path never waits for its peers on the caller's
thread: when a peer is not there after a short spin, the transport defers the rest of
it (:class:`~.tcp_algos.Deferred`) to the worker. See docs/cpu-backend.md.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from ..._buffer import Buffer
from ..._debug import DebugLevel, get_debug_level
from ...errors import DistBackendError, DistError
from ..._reduce_op import PremulSum, ReduceOp, ReduceOpLike
from ..._work import Work
from ...store.base import Store
from .reduce import Array, Reducer, as_array, division, make_reducer, op_key, sig_op, split_counts
from .auth import host_id
from .p2p import run_batch
from .tcp import TcpMesh, local_address
from ..mismatch import find_mismatch
from .segments import supported as shm_supported
from .signatures import Signatures
from . import issue as _issue
from .issue import INLINE_MAX
from .shm_small import small_all_reduce
from .tcp_algos import Ctx, Fill, TcpCollectives, op_label

__all__ = ["CPUBackend", "host_id"]

from ..._env import CPU_TRANSPORT_ENV as TRANSPORT_ENV


class CPUBackend:
    """The collectives of one process group on host memory.

    Args:
        store: a store private to this group (a PrefixStore), used to exchange
            addresses and shared-memory segment names.
        rank: this process's rank in the group.
        size: the group's size.
        timeout: seconds; bounds connecting and every op (a dead or stuck peer
            surfaces as DistBackendError within it).
        group_name: the group's name, used in errors.
        transport: ``"auto"``, ``"shm"`` or ``"tcp"`` (``CPUOptions.transport``); None
            reads ``GPUCOLL_CPU_TRANSPORT`` (default auto).

    Attributes:
        transport: how collective data moves: ``"shm"`` (one host), ``"tcp"`` or
            ``"local"`` (a group of one).
        shm_unavailable: why a one-host group could not use shared memory ("" otherwise).
        closers: called with the reason when the backend aborts or shuts down (a side channel's close).

    Raises:
        ValueError: rank/size/timeout out of range.
        DistNetworkError: peers did not connect within ``timeout``.
    """

    name = "cpu"
    inline_max = INLINE_MAX  # RunsNow: an async op this small runs on the caller's thread (_submit's rule)

    def __init__(self, store: Store, rank: int, size: int, *, timeout: float, group_name: str,
                 transport: str | None = None) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1; got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be an int in [0, {size}); got {rank!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self.rank = rank
        self.size = size
        self.timeout = float(timeout)
        self.group_name = group_name
        self._seq = 0
        self._p2p_seq = 0
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        # (work, body, op number, signature, deadline or 0.0: timeout from when it starts)
        self._queue: deque[tuple[Work, Callable[[Ctx], None], int, int, float]] = deque()
        self._busy = False
        # Queued ops the issuing thread may run itself (with patience, in order) while the
        # worker has not taken them: deferred rests and async ops queued behind them.
        self._resumable: set[Work] = set()
        self._lazy: set[Work] = set()  # async ops the worker leaves to their caller for now (issue.py)
        self._worker_idle = False
        self._worker_lazy = False  # the worker is waiting for a lazy op's time to come
        self._lazy_touch = 0.0  # when the issuing side last queued or ran a lazy op
        self._waiters = 0  # threads in shutdown() waiting for the queue to drain
        self._worker: threading.Thread | None = None
        self._reducers: dict[tuple[str, str], Reducer] = {}
        self._views: dict[tuple[int, int, str], Array] = {}
        self._error: DistBackendError | None = None
        self._closed = False
        self.closers: list[Callable[[str], None]] = []
        self._store = store
        self._detail = get_debug_level() >= DebugLevel.DETAIL
        self._signatures = Signatures(store, rank, size, self.timeout)  # readable mismatch errors
        self._sig = self._signatures.of
        self._plans: dict[Any, tuple[Any, Any, int]] = {}  # all_reduce: (dtype, nbytes, op) -> its plan
        self._now_ctx = Ctx(0, 0.0, 0, self._check, "", group_name)  # the Work-less path's (see _now)
        self._help = functools.partial(_issue.help_until, self)  # every Work's helper (Work._helper)
        self._barrier_sig = 0
        source = "transport" if transport is not None else TRANSPORT_ENV
        mode = (transport if transport is not None else os.environ.get(TRANSPORT_ENV, "auto")).strip().lower()
        mode = mode or "auto"
        if mode not in ("auto", "shm", "tcp"):
            raise ValueError(f"{source} must be auto, shm or tcp; got {mode!r}")
        me = host_id()
        self._mesh = TcpMesh(store, rank, size, timeout=self.timeout, host_id=me,
                             advertise=local_address(os.environ.get("MASTER_ADDR")),
                             on_broken=self._on_broken)
        self._coll: Any = TcpCollectives(self._mesh)
        self.transport = "tcp" if size > 1 else "local"  # "shm" below when every rank shares a host
        self.shm_unavailable = ""
        try:
            self._choose_transport(store, mode, me, source)
        except BaseException as exc:
            self._mesh.close(f"rank {rank} failed to set up group {group_name!r}: {exc}")
            raise

    def _choose_transport(self, store: Store, mode: str, me: str, source: str) -> None:
        rank, size, group_name = self.rank, self.size, self.group_name
        if size > 1 and mode != "tcp" and shm_supported():
            same_host = all(store.get(f"tcp/{p}").decode().split("|")[0] == me for p in range(size))
            if same_host:
                from .shm import ShmUnavailable
                from .shm_algos import ShmCollectives

                try:
                    self._coll = ShmCollectives(store, rank, size, timeout=self.timeout, mesh=self._mesh)
                    self.transport = "shm"
                except ShmUnavailable as exc:
                    if mode == "shm":
                        raise DistBackendError(f"{source}=shm but group {group_name!r} cannot use "
                                               f"shared memory: {exc}") from exc
                    self.shm_unavailable = str(exc)  # every rank falls back to TCP alike
            elif mode == "shm":
                raise ValueError(f"{source}=shm but the ranks of group {group_name!r} are on several hosts")

    # ----- issuing and running ops (issue.py: the queue, the worker, the caller's-thread paths) -----
    _submit = _issue.submit
    _enqueue = _issue.enqueue
    _start_worker = _issue.start_worker
    _work_loop = _issue.work_loop
    _run = _issue.run
    _now = _issue.now
    _resume = _issue.resume

    def _work(self, op_type: str, keep: Sequence[Any], *, p2p: bool = False) -> Work:
        w = Work(op_type, keepalive=keep, default_timeout=self.timeout)
        w._helper = self._help
        if p2p:
            self._p2p_seq += 1
            w.seq = self._p2p_seq
        else:
            self._seq += 1
            w.seq = self._seq
        w.group_name = self.group_name
        return w

    def all_reduce_now(self, buf: Buffer, op: ReduceOpLike, *, async_op: bool = False) -> bool | Work:
        """:meth:`all_reduce` on this thread now, with no Work (see ``RunsNow``); ``async_op``:
        as ``_now`` (True when it completed here, else its Work; never False)."""
        plan = self._plans.get((buf.dtype.name, buf.nbytes, op._name_)) if op.__class__ is ReduceOp else None
        if plan is None or plan[1] is not None:
            # First of its kind, or PREMUL_SUM: the Work path.
            return self._all_reduce(buf, op, True) if async_op else False
        # Any size: a synchronous op has nothing to return early for, and a hand-off to the
        # worker thread costs two thread wakes, which on a busy machine wait for a core.
        return self._now("all_reduce", self._coll.all_reduce, plan[2], self._arr(buf), plan[0], async_op=async_op,
                         keep=(buf,))

    def all_reduce_runner(self, dtype: str, nbytes: int, op: ReduceOpLike) -> tuple[Callable[..., bool | Work], Any] | None:
        """``all_reduce_now`` of one planned kind, bound: ``(run, reducer)``, where
        ``run(flat_array, reducer)`` is that op on a 1-D view of the caller's array; None
        before the kind's first op planned it (or for PREMUL_SUM)."""
        plan = self._plans.get((dtype, nbytes, op._name_)) if op.__class__ is ReduceOp else None
        if plan is None or plan[1] is not None:
            return None
        run = small_all_reduce(self, self._coll, nbytes, dtype, plan[0], plan[2])  # (shared memory, a slot's worth)
        return run or _issue.bound(self, "all_reduce", self._coll.all_reduce, plan[2]), plan[0]

    def broadcast_now(self, buf: Buffer, src: int, *, async_op: bool = False) -> bool | Work:
        """:meth:`broadcast` on this thread now, with no Work (as ``all_reduce_now``; False
        past ``inline_max``)."""
        sig = self._sig("broadcast", {"dtype": buf.dtype.name, "count": buf.numel, "root": src})
        return buf.nbytes <= INLINE_MAX and self._now("broadcast", self._coll.broadcast, sig, self._arr(buf), src,
                                                      async_op=async_op, keep=(buf,))

    def all_gather_single_now(self, out: Buffer, inp: Buffer, *, async_op: bool = False) -> bool | Work:
        """:meth:`all_gather_single` on this thread now, with no Work (as :meth:`broadcast_now`)."""
        return out.nbytes <= INLINE_MAX and self._now(*self._gather_call(self._arr(out), self._arr(inp),
                                                                         inp.dtype.name), async_op=async_op,
                                                      keep=(out, inp))

    def all_gather_runner(self, out: Array, inp: Array) -> Callable[..., bool | Work]:
        """:meth:`all_gather_single_now` bound to two 1-D host arrays the caller reuses (their
        rows and the signature made once); ``run()`` is True when it ran. One thread at a time."""
        return functools.partial(self._now, *self._gather_call(out, inp, inp.dtype.name))

    def _gather_call(self, out: Array, inp: Array, dtype: str) -> tuple[Any, ...]:
        """``_now``'s arguments for an all_gather_single of 1-D arrays, as :meth:`all_gather_single`
        issues it. ``dtype``: the name (a Buffer holds it; NumPy builds it per read, ~1.3 µs)."""
        n = inp.size
        sig = self._sig("all_gather_single", {"dtype": dtype, "count": n})
        return "all_gather_single", self._coll.all_gather, sig, [out[k * n:(k + 1) * n] for k in range(self.size)], inp

    def barrier_now(self) -> bool:
        """:meth:`barrier` on this thread now, with no Work (see ``RunsNow``)."""
        return self._barrier_sig != 0 and self._now("barrier", self._coll.barrier, self._barrier_sig) is True

    def _failed(self, exc: BaseException, name: str) -> DistBackendError:
        """The error an op that raised ``exc`` fails with; the backend is aborted."""
        err = exc if isinstance(exc, DistError) else DistBackendError(f"{type(exc).__name__}: {exc}")
        mismatch = find_mismatch(exc)
        if mismatch is not None:
            err = self._signatures.reworded(mismatch)
        wrapped = DistBackendError(f"{name} failed: {err}")
        # Our own errors say everything in their message; their frames are the
        # transport's. Chain them only under GPUCOLL_DEBUG=DETAIL; a foreign error
        # (a bug, an OSError) is always chained, as at every boundary.
        if self._detail or not isinstance(exc, DistError):
            wrapped.__cause__ = exc
        else:
            wrapped.__suppress_context__ = True
        # A collective that failed half-way leaves peers at different points of the
        # protocol: the group cannot be trusted with another op.
        self.abort(f"group {self.group_name!r} is unusable: {name} failed: {err}")
        return wrapped

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _on_broken(self, err: BaseException) -> None:
        self.abort(str(err))

    def peer_gone(self, peer: int) -> str | None:
        """Why group rank ``peer`` died (its connection broke without a goodbye), or None.

        A peer that only left after an error (its goodbye said why) may still be alive
        and take part in store-based steps such as monitored_barrier."""
        return self._mesh.dead(peer)

    def stalled(self) -> str:
        """What the op in progress is waiting for (named peers), for timeout messages."""
        waits = list(self._mesh.stalled())
        seg = getattr(self._coll, "seg", None)
        peer = getattr(seg, "waiting_for", None)
        if peer is None:
            peer = getattr(seg, "timed_out_on", None)  # an op on this thread ran out of time on it
        if peer is not None:
            waits.insert(0, f"rank {peer} (shared-memory progress)")
        return "; ".join(dict.fromkeys(waits))

    def _collective(self, op_type: str, bufs: Sequence[Buffer], body: Callable[[Ctx], None],
                    **fields: object) -> Work:
        """Submit a collective; ``fields`` (dtype, count, root, reduce op, sizes...) are what
        every rank must agree on: their digest is compared across ranks by the transport."""
        sig = self._sig(op_type, fields)
        return self._submit(self._work(op_type, bufs), body, sum(b.nbytes for b in bufs), sig)

    def _reducer(self, op: ReduceOpLike, buf: Buffer) -> Reducer:
        key = (op_key(op), buf.dtype.name)
        red = self._reducers.get(key)
        if red is None:
            red = self._reducers[key] = make_reducer(op, buf.dtype, self.size)
        return red

    def _arr(self, buf: Buffer) -> Array:
        # A view only describes memory (the Buffer's owner keeps it alive), so a view made
        # for an earlier Buffer at the same address, size and dtype is the same view.
        key = (buf.ptr, buf.nbytes, buf.dtype.name)
        a = self._views.get(key)
        if a is None:
            if len(self._views) >= 256:
                self._views.clear()
            a = self._views[key] = as_array(buf)  # the only call: everything else uses _arr
        return a

    # ----- reductions -----
    # PREMUL_SUM: each rank scales its own contribution by its own factor (factors may
    # differ per rank, NCCL's per-rank scaling), then the ranks SUM; the factor is not
    # part of the cross-rank signature.
    def _sum_of(self, op: ReduceOpLike, buf: Buffer) -> tuple[Reducer, Callable[[Array], Array] | None]:
        """The reducer to run and, for PREMUL_SUM, what scales this rank's contribution."""
        if not isinstance(op, PremulSum):
            return self._reducer(op, buf), None
        scaler = self._reducer(op, buf)

        def scaled(a: Array) -> Array:
            out = np.empty_like(a)
            np.copyto(out, scaler.contribution(a), casting="unsafe")
            return out

        return self._reducer(ReduceOp.SUM, buf), scaled

    def all_reduce(self, buf: Buffer, op: ReduceOpLike) -> Work:
        return self._all_reduce(buf, op, False)

    def _all_reduce(self, buf: Buffer, op: ReduceOpLike, patient: bool) -> Work:
        # A repeated all_reduce: its reducer and signature in one look-up (PREMUL_SUM,
        # whose factor may change per call, is planned every time).
        # (The op by name: an enum member's own hash is a Python-level call.)
        key = (buf.dtype.name, buf.nbytes, op._name_) if op.__class__ is ReduceOp else None
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            red, scale = self._sum_of(op, buf)
            plan = (red, scale, self._sig("all_reduce", {"dtype": buf.dtype.name, "count": buf.numel,
                                                         "reduce_op": sig_op(op)}))
            if key is not None:
                if len(self._plans) >= 4096:
                    self._plans.clear()
                self._plans[key] = plan
        red, scale, sig = plan
        x = self._arr(buf)
        coll = self._coll
        if scale is None:
            def body(c: Ctx) -> None:
                coll.all_reduce(c, x, red)
        else:
            def body(c: Ctx) -> None:
                np.copyto(x, scale(x))
                coll.all_reduce(c, x, red)
        return self._submit(self._work("all_reduce", (buf,)), body, buf.nbytes, sig, patient)

    def all_reduce_gathered(self, out: Buffer, parts: Sequence[Array], divisor: int, op: ReduceOpLike) -> Work:
        """``all_reduce(out, op)`` of the concatenation of ``parts``, each divided by
        ``divisor`` on the way in (``ReducesGathered``): over shared memory the parts
        go straight into the staging buffers, so ``out`` is written once, by the result.
        An async op's Work: it never waits for its peers on the caller's thread."""
        fn, sig, args = self._gathered(out, parts, divisor, op)
        return self._submit(self._work("all_reduce", (out, *parts)), lambda c: fn(c, *args), out.nbytes, sig, True)

    def all_reduce_gathered_now(self, out: Buffer, parts: Sequence[Array], divisor: int, op: ReduceOpLike, *,
                                async_op: bool = False) -> bool | Work:
        """:meth:`all_reduce_gathered` on this thread now, with no Work (as
        :meth:`all_reduce_now`: False when ops are queued ahead of a synchronous one; an
        async one never waits for its peers here)."""
        fn, sig, args = self._gathered(out, parts, divisor, op)
        return self._now("all_reduce", fn, sig, *args, async_op=async_op, keep=(out, *parts))

    def _gathered(self, out: Buffer, parts: Sequence[Array], divisor: int,
                  op: ReduceOpLike) -> tuple[Callable[..., None], int, tuple[Any, ...]]:
        if isinstance(op, PremulSum):
            raise ValueError("all_reduce_gathered: PREMUL_SUM is not supported; the parts are divided instead")
        sig = self._sig("all_reduce", {"dtype": out.dtype.name, "count": out.numel, "reduce_op": sig_op(op)})
        fill = gathered_fill(parts, divisor)
        filled = getattr(self._coll, "all_reduce_filled", None)
        if filled is not None:
            return filled, sig, (self._arr(out), self._reducer(op, out), fill)
        coll = self._coll

        def body(c: Ctx, x: Array, red: Reducer) -> None:
            fill(0, x.size, x)
            coll.all_reduce(c, x, red)
        return body, sig, (self._arr(out), self._reducer(op, out))

    def all_reduce_coalesced(self, bufs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        plans = [self._sum_of(op, b) for b in bufs]
        xs = [self._arr(b) for b in bufs]

        def body(c: Ctx) -> None:
            for x, (red, scale) in zip(xs, plans):
                if scale is not None:
                    np.copyto(x, scale(x))
                self._coll.all_reduce(c, x, red)

        return self._collective("all_reduce_coalesced", list(bufs), body,
                                arrays=tuple(f"{b.dtype.name} x {b.numel}" for b in bufs), reduce_op=sig_op(op))

    def reduce(self, buf: Buffer, dst: int, op: ReduceOpLike) -> Work:
        red, scale = self._sum_of(op, buf)
        x = self._arr(buf)

        def body(c: Ctx) -> None:
            if scale is None:
                self._coll.reduce(c, x, dst, red)
                return
            t = scale(x)  # a copy: a non-destination rank's array is left alone
            self._coll.reduce(c, t, dst, red)
            if self.rank == dst:
                np.copyto(x, t)

        return self._collective("reduce", [buf], body, dtype=buf.dtype.name, count=buf.numel, root=dst,
                                reduce_op=sig_op(op))

    def reduce_scatter(self, out: Buffer, inputs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        red, scale = self._sum_of(op, out)
        o, ins = self._arr(out), [self._arr(b) for b in inputs]
        sizes = [b.nbytes for b in inputs]  # rank k's chunk size: the same list on every rank
        even = all(n == out.nbytes for n in sizes)

        def body(c: Ctx) -> None:
            mine = ins if scale is None else [scale(a) for a in ins]
            if even:
                self._coll.reduce_scatter(c, o, mine, red)
                return
            # Uneven chunks: every rank sends chunk k to rank k, which folds what it got in
            # rank order (the order of the even algorithms).
            parts = [np.empty_like(o) for _ in range(self.size)]
            parts[self.rank] = mine[self.rank].copy()
            self._coll.all_to_all(c, parts, mine)
            red.fold(o, parts)

        return self._collective("reduce_scatter", [out, *inputs], body, dtype=out.dtype.name,
                                counts=tuple(n // out.dtype.itemsize for n in sizes), reduce_op=sig_op(op))

    def reduce_scatter_single(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        red, scale = self._sum_of(op, out)
        o, i = self._arr(out), self._arr(inp)

        def body(c: Ctx) -> None:
            src = i if scale is None else scale(i)
            self._coll.reduce_scatter(c, o, [src[k * o.size:(k + 1) * o.size] for k in range(self.size)], red)

        return self._collective("reduce_scatter_single", [out, inp], body, dtype=out.dtype.name,
                                count=out.numel, reduce_op=sig_op(op))

    # ----- data movement -----
    def broadcast(self, buf: Buffer, src: int) -> Work:
        x = self._arr(buf)
        return self._collective("broadcast", [buf], lambda c: self._coll.broadcast(c, x, src),
                                dtype=buf.dtype.name, count=buf.numel, root=src)

    def all_gather(self, outs: Sequence[Buffer], inp: Buffer) -> Work:
        os_, i = [self._arr(b) for b in outs], self._arr(inp)
        return self._collective("all_gather", [*outs, inp], lambda c: self._coll.all_gather(c, os_, i),
                                dtype=inp.dtype.name, count=inp.numel)

    def all_gather_single(self, out: Buffer, inp: Buffer) -> Work:
        o, i = self._arr(out), self._arr(inp)
        os_ = [o[k * i.size:(k + 1) * i.size] for k in range(self.size)]
        return self._collective("all_gather_single", [out, inp], lambda c: self._coll.all_gather(c, os_, i),
                                dtype=inp.dtype.name, count=inp.numel)

    def all_gather_coalesced(self, outs: Sequence[Sequence[Buffer]], inps: Sequence[Buffer]) -> Work:
        oss = [[self._arr(b) for b in row] for row in outs]
        ins = [self._arr(b) for b in inps]

        def body(c: Ctx) -> None:
            for row, i in zip(oss, ins):
                self._coll.all_gather(c, row, i)

        keep = [b for row in outs for b in row] + list(inps)
        return self._collective("all_gather_coalesced", keep, body,
                                arrays=tuple(f"{b.dtype.name} x {b.numel}" for b in inps))

    def gather(self, outs: Sequence[Buffer] | None, inp: Buffer, dst: int) -> Work:
        os_ = [self._arr(b) for b in outs] if outs is not None else None
        i = self._arr(inp)
        return self._collective("gather", [*(outs or ()), inp], lambda c: self._coll.gather(c, os_, i, dst),
                                dtype=inp.dtype.name, count=inp.numel, root=dst)

    def scatter(self, out: Buffer, inputs: Sequence[Buffer] | None, src: int) -> Work:
        o = self._arr(out)
        ins = [self._arr(b) for b in inputs] if inputs is not None else None
        return self._collective("scatter", [out, *(inputs or ())], lambda c: self._coll.scatter(c, o, ins, src),
                                dtype=out.dtype.name, count=out.numel, root=src)

    def all_to_all(self, outs: Sequence[Buffer], inputs: Sequence[Buffer]) -> Work:
        os_, ins = [self._arr(b) for b in outs], [self._arr(b) for b in inputs]
        return self._collective("all_to_all", [*outs, *inputs], lambda c: self._coll.all_to_all(c, os_, ins),
                                dtype=inputs[0].dtype.name if inputs else "")

    def all_to_all_single(self, out: Buffer, inp: Buffer, out_counts: Sequence[int],
                          in_counts: Sequence[int]) -> Work:
        o, i = self._arr(out), self._arr(inp)
        os_ = split_counts(o, out_counts)
        ins = split_counts(i, in_counts)
        return self._collective("all_to_all_single", [out, inp], lambda c: self._coll.all_to_all(c, os_, ins),
                                dtype=inp.dtype.name)

    # ----- point to point -----
    def send(self, buf: Buffer, dst: int, tag: int) -> Work:
        return self.batch_p2p([("send", buf, dst, tag)], op_type="send")

    def recv(self, buf: Buffer, src: int | None, tag: int) -> Work:
        return self.batch_p2p([("recv", buf, src, tag)], op_type="recv")

    def batch_p2p(self, ops: Sequence[tuple[str, Buffer, Any, int]], *, op_type: str = "batch_isend_irecv") -> Work:
        """Post every receive, then send everything; one Work completes when all are done."""
        return run_batch(self, self._mesh, ops, op_type)

    # ----- control -----
    def barrier(self) -> Work:
        sig = self._barrier_sig or self._sig("barrier", {})
        self._barrier_sig = sig
        return self._submit(self._work("barrier", ()), self._coll.barrier, 0, sig)

    def abort(self, reason: str) -> None:
        """Fail every pending and later op with ``DistBackendError(reason)``; returns at once."""
        with self._cv:
            first = self._error is None
            if first:
                self._error = DistBackendError(reason)
            err = self._error
            queued = list(self._queue)
            self._queue.clear()
            self._resumable.clear()
            self._lazy.clear()
            self._cv.notify_all()
        assert err is not None
        mesh = getattr(self, "_mesh", None)  # None: a reader thread aborts while the mesh is being made
        if first and mesh is not None:
            mesh.fail_all(err)
            # Leaving the mesh tells every peer why at once (instead of after their timeout);
            # on a thread, because a send may wait for a peer that stopped reading.
            threading.Thread(target=mesh.close, args=(str(err),), daemon=True,
                             name=f"gpucoll-cpu-abort-r{self.rank}").start()
            abort = getattr(self._coll, "abort", None)
            if abort is not None:
                abort(err)
        for work, _, seq, _, _ in queued:
            work._set_exception(DistBackendError(f"{op_label(work.op_type, seq, self.group_name)}: {err}"))
        if first:
            for fn in self.closers:
                fn(reason)

    def shutdown(self) -> None:
        """Finish queued ops (up to the timeout), say goodbye to peers and release everything."""
        with self._cv:
            if self._closed:
                return
            deadline = time.monotonic() + self.timeout
            self._waiters += 1
            while (self._queue or self._busy) and self._error is None and time.monotonic() < deadline:
                self._cv.wait(0.1)
            self._closed = True
            self._cv.notify_all()
        if self._queue or self._busy:
            self.abort(f"group {self.group_name!r}: the CPU backend was shut down with ops still running")
        with self._cv:
            # An aborted op unwinds within one sleep slice; only then may its memory go.
            deadline = time.monotonic() + 5.0
            while self._busy and time.monotonic() < deadline:
                self._cv.wait(0.05)
            self._waiters -= 1
            idle = not self._busy
        close = getattr(self._coll, "close", None)
        if close is not None and idle:
            close()
        self._mesh.close(reason=str(self._error) if self._error is not None else "")
        for fn in self.closers:
            fn(str(self._error) if self._error is not None else "the group was destroyed")
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(1.0)

    def gone(self, peer: int) -> str | None:
        """Why ``peer`` is known to be gone (it closed its connections), or None."""
        return self._mesh.gone(peer)

    def __repr__(self) -> str:
        return f"<CPUBackend group={self.group_name!r} rank={self.rank}/{self.size} transport={self.transport}>"


def gathered_fill(parts: Sequence[Array], divisor: int) -> Fill:
    """The ``Fill`` of the concatenation of the 1-D arrays ``parts``, each element divided
    by ``divisor``, bit for bit as ``np.divide(part, divisor, out=...)`` (a gradient
    divided by the world size; a power of two as a multiplication: ``reduce.division``)."""
    ops = [division(divisor, p.dtype) for p in parts]
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + int(p.size))
    ends = starts[1:]

    def fill(lo: int, hi: int, out: Array) -> None:
        i = bisect.bisect_right(ends, lo)  # the first part that ends after lo
        at = 0
        while lo < hi:
            p, s = parts[i], starts[i]
            a, b = lo - s, min(hi, ends[i]) - s
            if b > a:
                scale, factor = ops[i]
                scale(p[a:b], factor, out=out[at:at + b - a])
                at += b - a
                lo = s + b
            i += 1
    return fill
