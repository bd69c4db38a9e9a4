"""An in-process fake of CUDA streams/events and NCCL communicators, for the NCCL
backend's CPU tests.

It implements gpucoll._backends.nccl.runtime's Runtime and Comm Protocols with the
semantics the backend relies on, so that NCCLBackend runs unchanged on a machine
without a GPU:

* device memory is NumPy byte arrays at fake addresses; an access to freed memory
  (an array released while the "GPU" still uses it) raises;
* each stream is a thread executing its queue in order, so work is asynchronous to
  the host exactly as on a GPU; ``wait_event`` blocks a stream, never the host;
* each rank is a thread with its own FakeRuntime; ranks meet in FakeWorld, which
  matches the k-th collective of every rank (and checks that kind, count, dtype,
  op and root agree, where real NCCL would hang or corrupt data) and pairs sends
  with receives in order;
* ncclGroupStart/End buffers calls and runs them as one unit; an aborted rank's
  pending NCCL work returns at once, as NCCL kernels do after ncclCommAbort;
* the gpucoll kernels are emulated with NumPy (their CUDA source is tested
  separately, compiled as host C++).

Anything the fake sees going wrong is kept in ``FakeFabric.errors`` and makes the
next event query raise, so a test cannot pass over it.
"""

from __future__ import annotations

import bisect
import itertools
import os
import queue
import re
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import numpy as np

from gpucoll._buffer import Buffer, Device, DType
from gpucoll._backends.nccl.lib import Features
from gpucoll.errors import BackendUnavailableError

from _reference import np_dtype

NP_OF_NCCL = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64",
              6: "float16", 7: "float32", 8: "float64", 9: "bfloat16", 10: "float8_e4m3fn", 11: "float8_e5m2"}


class FakeError(RuntimeError):
    pass


# ----- memory -----

class _Block:
    __slots__ = ("ptr", "data", "__weakref__")

    def __init__(self, ptr: int, data: np.ndarray) -> None:
        self.ptr = ptr
        self.data = data


class FakeMemory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._blocks: dict[int, np.ndarray] = {}
        self._next = 1 << 32
        self.allocations = 0

    def alloc(self, nbytes: int) -> _Block:
        with self._lock:
            ptr = self._next
            self._next += (max(nbytes, 1) + 4095) // 4096 * 4096 + 4096  # a guard gap after each block
            data = np.zeros(max(nbytes, 1), np.uint8)
            bisect.insort(self._bases, ptr)
            self._blocks[ptr] = data
            self.allocations += 1
        block = _Block(ptr, data)
        weakref.finalize(block, self._free, ptr)
        return block

    def _free(self, ptr: int) -> None:
        with self._lock:
            self._blocks.pop(ptr, None)
            i = bisect.bisect_left(self._bases, ptr)
            if i < len(self._bases) and self._bases[i] == ptr:
                self._bases.pop(i)

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i < 0:
                raise FakeError(f"address {ptr:#x} is not device memory")
            base = self._bases[i]
            data = self._blocks[base]
        off = ptr - base
        if off + nbytes > data.size:
            raise FakeError(f"[{ptr:#x}, +{nbytes}) runs past its block of {data.size} bytes at {base:#x} "
                            "(freed too early, or out of bounds)")
        return data[off:off + nbytes]


# ----- streams and events -----

class _Marker:
    __slots__ = ("done", "t")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.t = 0.0


class FakeEvent:
    def __init__(self, fabric: FakeFabric) -> None:
        self.ptr = next(fabric.handles)
        self.marker: _Marker | None = None
        fabric.events[self.ptr] = self


class FakeStream:
    def __init__(self, fabric: FakeFabric, name: str) -> None:
        self.high_priority = False
        self.ptr = next(fabric.handles)
        self.name = name
        self._fabric = fabric
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        fabric.streams[self.ptr] = self
        self._thread = threading.Thread(target=self._run, name=f"fake-stream-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # keep executing: a GPU does too
                self._fabric.errors.append(f"stream {self.name}: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._q.put(None)

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


# ----- NCCL -----

class _Slot:
    def __init__(self, size: int) -> None:
        self.calls: dict[int, tuple[Any, ...]] = {}
        self.done = threading.Event()


class FakeWorld:
    """The ranks of one communicator (one unique id)."""

    def __init__(self, fabric: FakeFabric, uid: bytes, size: int) -> None:
        self.fabric = fabric
        self.uid = uid
        self.size = size
        self.cond = threading.Condition()
        self.joined: set[int] = set()
        self.slots: dict[int, _Slot] = {}
        self.mail: dict[tuple[int, int], deque[bytes]] = {}
        self.aborted: set[int] = set()
        self.splits: dict[int, dict[int, tuple[int, int]]] = {}

    def wait_until(self, rank: int, pred: Callable[[], bool], what: str) -> bool:
        """Wait for ``pred``; False if ``rank`` was aborted meanwhile (NCCL kernels exit)."""
        deadline = time.monotonic() + self.fabric.hang_limit
        with self.cond:
            while not pred():
                if rank in self.aborted:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FakeError(f"rank {rank} waited {self.fabric.hang_limit} s for {what}")
                self.cond.wait(min(left, 0.05))
        return True

    def collective(self, rank: int, seq: int, call: tuple[Any, ...], execute: Callable[[dict[int, tuple[Any, ...]]], None]) -> None:
        with self.cond:
            slot = self.slots.setdefault(seq, _Slot(self.size))
            slot.calls[rank] = call
            last = len(slot.calls) == self.size
            self.cond.notify_all()
        if last:
            try:
                self._check_match(seq, slot.calls)
                execute(slot.calls)
            finally:
                slot.done.set()
                with self.cond:
                    self.cond.notify_all()
        else:
            self.wait_until(rank, slot.done.is_set, f"collective #{seq} {call[0]}")

    def _check_match(self, seq: int, calls: dict[int, tuple[Any, ...]]) -> None:
        first = calls[0]
        for r, c in calls.items():
            if c[:2] != first[:2]:
                raise FakeError(f"collective #{seq} differs between ranks: rank 0 {first}, rank {r} {c}")

    def post(self, src: int, dst: int, payload: bytes) -> None:
        with self.cond:
            self.mail.setdefault((src, dst), deque()).append(payload)
            self.cond.notify_all()

    def take(self, src: int, dst: int, nbytes: int) -> bytes | None:
        box = self.mail.setdefault((src, dst), deque())
        if not self.wait_until(dst, lambda: bool(box), f"a message from rank {src}"):
            return None
        with self.cond:
            payload = box.popleft()
        if len(payload) != nbytes:
            raise FakeError(f"rank {dst} receives {nbytes} bytes from rank {src}, which sent {len(payload)}")
        return payload


def _reduce(arrays: list[np.ndarray], op: int, factors: list[float | None], n: int) -> np.ndarray:
    dt = arrays[0].dtype
    low = dt.itemsize <= 2 and dt.kind not in "iu" or dt.name in ("bfloat16",) or "float8" in dt.name
    work = [a.astype(np.float32) if low else a.copy() for a in arrays]
    if op >= 5:  # PreMulSum: each rank's own factor
        work = [(w * np.asarray(f).astype(w.dtype)).astype(w.dtype) for w, f in zip(work, factors)]
        op = 0
    acc = work[0].copy()
    for w in work[1:]:
        if op in (0, 4):
            acc = (acc + w).astype(acc.dtype)
        elif op == 1:
            acc = (acc * w).astype(acc.dtype)
        elif op == 2:
            acc = np.maximum(acc, w)
        elif op == 3:
            acc = np.minimum(acc, w)
        else:
            raise FakeError(f"unknown ncclRedOp {op}")
    if op == 4:
        if dt.kind in "iu":
            raise FakeError("ncclAvg on an integer type")
        acc = (acc / n).astype(acc.dtype)
    out: np.ndarray = acc.astype(dt)
    return out


_ITEMSIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


class FakeComm:
    def __init__(self, runtime: FakeRuntime, world: FakeWorld, rank: int,
                 config: dict[str, Any] | None = None) -> None:
        self._rt = runtime
        self.config = config  # the ncclConfig_t fields it was made with (None: NCCL's defaults)
        self.world = world
        self.rank = rank
        self.size = world.size
        self._seq = itertools.count()
        self._ops: dict[int, tuple[float, int]] = {}
        self._next_op = itertools.count(5)
        self.destroyed = False
        self.async_code = 0
        self.calls: list[tuple[Any, ...]] = []  # every call, for tests that check what was issued
        self.shrink_calls: list[tuple[tuple[int, ...], int]] = []

    # -- the calls: buffered into the runtime's group, or run at once --
    def _call(self, kind: str, args: tuple[Any, ...], stream: int) -> None:
        if self.destroyed or self.rank in self.world.aborted:
            raise FakeError(f"{kind} on a destroyed or aborted communicator")
        if kind in ("all_reduce", "reduce", "reduce_scatter"):
            op = args[4]
            if op >= 5 and op not in self._ops:
                raise FakeError(f"{kind} with PreMulSum op {op}, which does not exist (destroyed?)")
            # NCCL reads a host-immediate factor when the op is made; capture it now.
            args = args + ((self._ops[op][0] if op >= 5 else None),)
        self.calls.append((kind,) + args)
        self._rt._nccl_call(self, kind, args, stream)

    def all_reduce(self, s: int, r: int, n: int, dt: int, op: int, stream: int) -> None:
        self._call("all_reduce", (s, r, n, dt, op), stream)

    def reduce(self, s: int, r: int, n: int, dt: int, op: int, root: int, stream: int) -> None:
        self._call("reduce", (s, r, n, dt, op, root), stream)

    def broadcast(self, s: int, r: int, n: int, dt: int, root: int, stream: int) -> None:
        self._call("broadcast", (s, r, n, dt, root), stream)

    def all_gather(self, s: int, r: int, n: int, dt: int, stream: int) -> None:
        self._call("all_gather", (s, r, n, dt), stream)

    def reduce_scatter(self, s: int, r: int, n: int, dt: int, op: int, stream: int) -> None:
        self._call("reduce_scatter", (s, r, n, dt, op), stream)

    def all_to_all(self, s: int, r: int, n: int, dt: int, stream: int) -> None:
        if not self._rt.features.all_to_all:
            raise FakeError("ncclAlltoAll called but this NCCL lacks it")
        self._call("all_to_all", (s, r, n, dt), stream)

    def gather(self, s: int, r: int, n: int, dt: int, root: int, stream: int) -> None:
        if not self._rt.features.gather:
            raise FakeError("ncclGather called but this NCCL lacks it")
        self._call("gather", (s, r, n, dt, root), stream)

    def scatter(self, s: int, r: int, n: int, dt: int, root: int, stream: int) -> None:
        if not self._rt.features.scatter:
            raise FakeError("ncclScatter called but this NCCL lacks it")
        self._call("scatter", (s, r, n, dt, root), stream)

    def send(self, p: int, n: int, dt: int, peer: int, stream: int) -> None:
        self._call("send", (p, n, dt, peer), stream)

    def recv(self, p: int, n: int, dt: int, peer: int, stream: int) -> None:
        self._call("recv", (p, n, dt, peer), stream)

    def premul_sum(self, scalar: bytes, dtype: int) -> int:
        if not self._rt.features.premul_sum:
            raise FakeError("ncclRedOpCreatePreMulSum called but this NCCL lacks it")
        value = float(np.frombuffer(scalar, np_dtype(NP_OF_NCCL[dtype]))[0].astype(np.float64))
        op = next(self._next_op)
        self._ops[op] = (value, dtype)
        return op

    def op_destroy(self, op: int) -> None:
        if self._ops.pop(op, None) is None:
            raise FakeError(f"ncclRedOpDestroy of unknown op {op}")

    def async_error(self) -> int:
        return self.async_code

    def last_error(self) -> str:
        return "injected by the test" if self.async_code else ""

    def split(self, color: int, key: int, config: dict[str, Any] | None = None) -> FakeComm | None:
        self._rt.configs.append(("split", None if config is None else dict(config)))
        world, rank = self.world, self.rank
        seq = next(self._seq)
        with world.cond:
            entry = world.splits.setdefault(seq, {})
            entry[rank] = (color, key)
            world.cond.notify_all()
        world.wait_until(rank, lambda: len(entry) == world.size, "the other ranks to split")
        if color < 0:
            return None
        members = sorted((k, r) for r, (c, k) in entry.items() if c == color)
        new_rank = [r for _, r in members].index(rank)
        uid = world.uid + f"/split{seq}/{color}".encode()
        new_world = self._rt.fabric.world(uid, len(members))
        return FakeComm(self._rt, new_world, new_rank, config)

    def shrink(self, exclude: Sequence[int], flags: int, config: dict[str, Any] | None = None) -> FakeComm:
        """ncclCommShrink: a collective of the ranks not in ``exclude`` (the excluded
        ones are dead and never call); renumbered in order."""
        if not self._rt.features.comm_shrink:
            raise FakeError("ncclCommShrink called but this NCCL lacks it")
        world, rank = self.world, self.rank
        gone = tuple(sorted(exclude))
        if rank in gone:
            raise FakeError(f"rank {rank} called ncclCommShrink excluding itself")
        stay = [r for r in range(world.size) if r not in gone]
        seq = next(self._seq)
        with world.cond:
            entry = world.splits.setdefault(seq, {})
            entry[rank] = (hash(gone), flags)
            world.cond.notify_all()
        world.wait_until(rank, lambda: len(entry) == len(stay), "the other ranks to shrink")
        if len({c for c, _ in entry.values()}) != 1:
            raise FakeError(f"ranks passed different exclude lists to ncclCommShrink: {entry}")
        self.shrink_calls.append((gone, flags))
        self._rt.configs.append(("shrink", None if config is None else dict(config)))
        uid = world.uid + f"/shrink{seq}".encode()
        return FakeComm(self._rt, self._rt.fabric.world(uid, len(stay)), stay.index(rank), config)

    def abort(self) -> None:
        with self.world.cond:
            self.world.aborted.add(self.rank)
            self.world.cond.notify_all()

    def destroy(self) -> None:
        self.destroyed = True
        if self._ops:
            self._rt.fabric.errors.append(f"rank {self.rank}: PreMulSum ops {sorted(self._ops)} never destroyed")


# ----- the runtime -----

class FakeFabric:
    """What all rank threads share: memory, streams, events, worlds, and errors."""

    def __init__(self, hang_limit: float = 20.0) -> None:
        self.mem = FakeMemory()
        self.handles = itertools.count(0x1000)
        self.streams: dict[int, FakeStream] = {}
        self.events: dict[int, FakeEvent] = {}
        self.worlds: dict[bytes, FakeWorld] = {}
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.hang_limit = hang_limit

    def world(self, uid: bytes, size: int) -> FakeWorld:
        with self.lock:
            w = self.worlds.get(uid)
            if w is None:
                w = self.worlds[uid] = FakeWorld(self, uid, size)
            if w.size != size:
                raise FakeError(f"ranks disagree on the communicator size: {w.size} vs {size}")
            return w

    def close(self) -> None:
        for s in list(self.streams.values()):
            s.stop()


class FakeRuntime:
    """One rank's view of the fake GPU (a Runtime)."""

    def __init__(self, fabric: FakeFabric, *, features: Features | None = None, devices: int = 1,
                 cc: tuple[int, int] = (9, 0), op_delay: float = 0.0,
                 refuse_config: frozenset[str] = frozenset()) -> None:
        self.fabric = fabric
        # ncclConfig_t fields every communicator was made with: ("init"|"split"|"shrink", fields or None)
        self.configs: list[tuple[str, dict[str, Any] | None]] = []
        self.refuse_config = refuse_config  # fields this runtime cannot apply (as CuPy's cannot most)
        self.features = features or Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True)
        self._devices = devices
        self._cc = cc
        self._device = 0
        self.op_delay = op_delay
        self.default_stream = FakeStream(fabric, "default")
        self._current = self.default_stream.ptr
        self._group: list[tuple[FakeComm, str, tuple[Any, ...], int]] | None = None
        self._depth = 0
        self.capturing: set[int] = set()
        self.kernels_prepared: list[str] = []
        self.kernels_launched: list[str] = []
        self.allocations = 0
        self.unpooled_events = 0

    # -- devices and streams --
    def get_device(self) -> int:
        return self._device

    def set_device(self, device: int) -> None:
        if not 0 <= device < self._devices:
            raise FakeError(f"set_device({device}) with {self._devices} devices")
        self._device = device

    def device_count(self) -> int:
        return self._devices

    def compute_capability(self, device: int) -> tuple[int, int]:
        return self._cc

    def current_stream(self) -> int:
        return self._current

    def set_current_stream(self, ptr: int) -> None:
        self._current = ptr

    def new_stream(self, high_priority: bool = False) -> FakeStream:
        stream = FakeStream(self.fabric, "comm")
        stream.high_priority = high_priority
        return stream

    def _stream(self, ptr: int) -> FakeStream:
        try:
            return self.fabric.streams[ptr]
        except KeyError:
            raise FakeError(f"no stream {ptr:#x}") from None

    def is_capturing(self, stream: int) -> bool:
        return stream in self.capturing

    # -- events --
    def event(self, pooled: bool = True) -> FakeEvent:
        if not pooled:
            self.unpooled_events += 1
        return FakeEvent(self.fabric)

    def record(self, event: int, stream: int) -> None:
        ev = self.fabric.events[event]
        marker = ev.marker = _Marker()

        def fire() -> None:
            marker.t = time.perf_counter()
            marker.done.set()
        self._stream(stream).enqueue(fire)

    def wait_event(self, stream: int, event: int) -> None:
        marker = self.fabric.events[event].marker
        if marker is None:
            return
        limit = self.fabric.hang_limit

        def wait() -> None:
            if not marker.done.wait(limit):
                raise FakeError(f"a stream waited {limit} s for an event")
        self._stream(stream).enqueue(wait)

    def query(self, event: int) -> bool:
        if self.fabric.errors:
            raise FakeError("the fake GPU saw errors: " + "; ".join(self.fabric.errors))
        marker = self.fabric.events[event].marker
        return marker is None or marker.done.is_set()

    def elapsed_ms(self, start: int, end: int) -> float:
        a, b = self.fabric.events[start].marker, self.fabric.events[end].marker
        if a is None or b is None or not (a.done.is_set() and b.done.is_set()):
            raise FakeError("elapsed_ms on an event that has not completed")
        return (b.t - a.t) * 1000.0

    # -- memory and kernels --
    def alloc(self, nbytes: int, stream: Any) -> tuple[int, Any]:
        self.allocations += 1
        block = self.fabric.mem.alloc(nbytes)
        return block.ptr, block

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        mem = self.fabric.mem

        if _overlap(dst, nbytes, src, nbytes):
            raise FakeError(f"memcpy between overlapping ranges {dst:#x} and {src:#x} ({nbytes} bytes)")

        def copy() -> None:
            mem.view(dst, nbytes)[:] = mem.view(src, nbytes)
        self._stream(stream).enqueue(copy)

    def prepare(self, kernel: str, device: int) -> None:
        if not _KERNEL_RE.fullmatch(kernel):
            raise FakeError(f"no kernel named {kernel!r} in kernels/reduce.cu")
        self.kernels_prepared.append(kernel)

    def launch(self, kernel: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None:
        if kernel not in self.kernels_prepared:
            raise FakeError(f"kernel {kernel} launched without prepare()")
        self.kernels_launched.append(kernel)
        mem = self.fabric.mem
        stream.enqueue(lambda: emulate_kernel(mem, kernel, n, args))

    # -- NCCL --
    def unique_id(self) -> bytes:
        return os.urandom(128)

    def check_config(self, config: dict[str, Any]) -> None:
        refused = sorted(set(config) & self.refuse_config)
        if refused:
            raise BackendUnavailableError(f"NCCL config field(s) {', '.join(refused)} cannot be applied (fake)")

    def new_comm(self, size: int, uid: bytes, rank: int, config: dict[str, Any] | None = None) -> FakeComm:
        self.configs.append(("init", None if config is None else dict(config)))
        world = self.fabric.world(uid, size)
        with world.cond:
            world.joined.add(rank)
            world.cond.notify_all()
        world.wait_until(rank, lambda: len(world.joined) == size, "every rank to create the communicator")
        return FakeComm(self, world, rank, config)

    def group_start(self) -> None:
        if self._depth == 0:
            self._group = []
        self._depth += 1

    def group_end(self) -> None:
        if self._depth == 0:
            raise FakeError("ncclGroupEnd without ncclGroupStart")
        self._depth -= 1
        if self._depth == 0:
            calls, self._group = self._group or [], None
            if calls:
                streams = {c[3] for c in calls}
                if len(streams) != 1:
                    raise FakeError("one NCCL group on several streams")
                self._enqueue_nccl([c[:3] for c in calls], streams.pop())

    def _nccl_call(self, comm: FakeComm, kind: str, args: tuple[Any, ...], stream: int) -> None:
        if self._group is not None:
            self._group.append((comm, kind, args, stream))
        else:
            self._enqueue_nccl([(comm, kind, args)], stream)

    def _enqueue_nccl(self, calls: list[tuple[FakeComm, str, tuple[Any, ...]]], stream: int) -> None:
        seqs = [next(c[0]._seq) if c[1] in _COLLECTIVES else -1 for c in calls]
        delay = self.op_delay
        self._stream(stream).enqueue(lambda: run_nccl_group(self.fabric.mem, calls, seqs, delay))


_KERNEL_RE = re.compile(r"gpucoll_(reduce_(sum|prod|min|max|band|bor|bxor)_(i8|u8|i16|u16|i32|u32|i64|u64)"
                        r"|avg_trunc_(i8|u8|i16|u16|i32|u32|i64|u64)"
                        r"|scale_(i8|u8|i16|u16|i32|u32|i64|u64|f16|bf16|f32|f64))")


# ----- executing NCCL calls (on a stream thread) -----

def run_nccl_group(mem: FakeMemory, calls: list[tuple[FakeComm, str, tuple[Any, ...]]], seqs: list[int],
                   delay: float) -> None:
    if delay:
        time.sleep(delay)
    for comm, kind, args in calls:  # sends first: a group's receives may depend on them
        if kind == "send":
            p, n, dt, peer = args
            comm.world.post(comm.rank, peer, mem.view(p, n * _ITEMSIZE[dt]).tobytes())
    for (comm, kind, args), seq in zip(calls, seqs):
        if kind in _COLLECTIVES:
            _collective(mem, comm, kind, args, seq)
    for comm, kind, args in calls:
        if kind == "recv":
            p, n, dt, peer = args
            payload = comm.world.take(peer, comm.rank, n * _ITEMSIZE[dt])
            if payload is not None:
                mem.view(p, n * _ITEMSIZE[dt])[:] = np.frombuffer(payload, np.uint8)


def _collective(mem: FakeMemory, comm: FakeComm, kind: str, args: tuple[Any, ...], seq: int) -> None:
    world = comm.world
    # What must agree across ranks (pointers and PreMulSum factors may differ).
    shared: tuple[Any, ...]
    if kind in ("all_reduce", "reduce_scatter"):
        shared = (args[2], args[3], "premul" if args[4] >= 5 else args[4])
    elif kind == "reduce":
        shared = (args[2], args[3], "premul" if args[4] >= 5 else args[4], args[5])
    elif kind in ("broadcast", "gather", "scatter"):
        shared = (args[2], args[3], args[4])
    else:
        shared = (args[2], args[3])

    def execute(calls: dict[int, tuple[Any, ...]]) -> None:
        _execute(mem, kind, {r: c[-1] for r, c in calls.items()}, world.size)
    world.collective(comm.rank, seq, (kind, shared, args), execute)


def _overlap(a: int, na: int, b: int, nb: int) -> bool:
    return a < b + nb and b < a + na


def check_in_place(kind: str, rank: int, size: int, args: tuple[Any, ...], isz: int) -> None:
    """NCCL's contract: send and receive buffers are disjoint unless they are exactly
    the op's documented in-place layout."""
    send, recv, count = args[0], args[1], args[2]
    nb = count * isz
    if kind in ("all_reduce", "reduce", "broadcast"):
        ns, nr, inplace = nb, nb, recv
    elif kind == "all_gather":
        ns, nr, inplace = nb, nb * size, recv + rank * nb
    elif kind == "reduce_scatter":
        ns, nr, inplace = nb * size, nb, send + rank * nb
        send, inplace = recv, inplace  # in place: recv == send + rank * count
    elif kind == "all_to_all":
        ns, nr, inplace = nb * size, nb * size, -1
    elif kind == "gather":
        root = args[4]
        if rank != root:
            return
        ns, nr, inplace = nb, nb * size, recv + root * nb
    elif kind == "scatter":
        root = args[4]
        if rank != root:
            return
        ns, nr, inplace = nb * size, nb, send + root * nb
        send, inplace = recv, inplace
    else:
        return
    if kind in ("reduce_scatter", "scatter"):
        big, nbig = args[0], ns
        if _overlap(big, nbig, recv, nr) and recv != inplace:
            raise FakeError(f"{kind} on rank {rank}: receive buffer overlaps the send buffer but is not "
                            "its in-place slice")
        return
    if _overlap(send, ns, recv, nr) and send != inplace:
        raise FakeError(f"{kind} on rank {rank}: send buffer overlaps the receive buffer but is not the "
                        "in-place layout")


def _execute(mem: FakeMemory, kind: str, args: dict[int, tuple[Any, ...]], size: int) -> None:
    a0 = args[0]
    count, dt = a0[2], a0[3]
    dtype = np_dtype(NP_OF_NCCL[dt])
    isz = dtype.itemsize
    for r in range(size):
        check_in_place(kind, r, size, args[r], isz)

    def arr(ptr: int, n: int) -> np.ndarray:
        return mem.view(ptr, n * isz).view(dtype)
    if kind == "all_reduce":
        ins = [arr(args[r][0], count).copy() for r in range(size)]
        out = _reduce(ins, a0[4], [args[r][5] for r in range(size)], size)
        for r in range(size):
            arr(args[r][1], count)[:] = out
    elif kind == "reduce":
        ins = [arr(args[r][0], count).copy() for r in range(size)]
        root = a0[5]
        arr(args[root][1], count)[:] = _reduce(ins, a0[4], [args[r][6] for r in range(size)], size)
    elif kind == "broadcast":
        root = a0[4]
        data = arr(args[root][0], count).copy()
        for r in range(size):
            arr(args[r][1], count)[:] = data
    elif kind == "all_gather":
        data = np.concatenate([arr(args[r][0], count).copy() for r in range(size)])
        for r in range(size):
            arr(args[r][1], count * size)[:] = data
    elif kind == "reduce_scatter":
        ins = [arr(args[r][0], count * size).copy() for r in range(size)]
        out = _reduce(ins, a0[4], [args[r][5] for r in range(size)], size)
        for r in range(size):
            arr(args[r][1], count)[:] = out[r * count:(r + 1) * count]
    elif kind == "all_to_all":
        ins = [arr(args[r][0], count * size).copy() for r in range(size)]
        for r in range(size):
            arr(args[r][1], count * size)[:] = np.concatenate([ins[i][r * count:(r + 1) * count] for i in range(size)])
    elif kind == "gather":
        root = a0[4]
        data = np.concatenate([arr(args[r][0], count).copy() for r in range(size)])
        arr(args[root][1], count * size)[:] = data
    elif kind == "scatter":
        root = a0[4]
        data = arr(args[root][0], count * size).copy()
        for r in range(size):
            arr(args[r][1], count)[:] = data[r * count:(r + 1) * count]
    else:
        raise FakeError(f"unknown collective {kind}")


# ----- kernels -----

_KT = {"i8": "int8", "u8": "uint8", "i16": "int16", "u16": "uint16", "i32": "int32", "u32": "uint32",
       "i64": "int64", "u64": "uint64", "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


def _wrap(values: list[int], dtype: np.dtype) -> np.ndarray:
    bits = dtype.itemsize * 8
    return np.array([v % (1 << bits) for v in values], dtype=f"uint{bits}").view(dtype)


def emulate_kernel(mem: FakeMemory, name: str, n: int, args: tuple[Any, ...]) -> None:
    """What kernels/reduce.cu computes, in NumPy (exact integer semantics)."""
    parts = name.split("_")
    ktype = parts[-1]
    dtype = np_dtype(_KT[ktype])
    isz = dtype.itemsize
    if name.startswith("gpucoll_reduce_"):
        op = parts[2]
        rows, out, n_, nrows, stride = args
        for r in range(nrows):
            row = rows + r * stride * isz
            if _overlap(row, n_ * isz, out, n_ * isz) and row != out:
                raise FakeError(f"{name}: out overlaps row {r} without being it")
        data = [mem.view(rows + r * stride * isz, n_ * isz).view(dtype).copy() for r in range(nrows)]
        if op in ("sum", "prod"):
            acc = [int(v) for v in data[0]]
            for d in data[1:]:
                acc = [a + int(b) if op == "sum" else a * int(b) for a, b in zip(acc, d)]
            res = _wrap(acc, dtype)
        else:
            fn = {"min": np.minimum, "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
                  "bxor": np.bitwise_xor}[op]
            res = data[0]
            for d in data[1:]:
                res = fn(res, d)
        mem.view(out, n_ * isz).view(dtype)[:] = res
    elif name.startswith("gpucoll_avg_trunc_"):
        x, n_, divisor = args
        view = mem.view(x, n_ * isz).view(dtype)
        vals = [int(v) for v in view]
        view[:] = _wrap([(abs(v) // divisor) * (1 if v >= 0 else -1) for v in vals], dtype)
    elif name.startswith("gpucoll_scale_"):
        x, n_, factor = args
        view = mem.view(x, n_ * isz).view(dtype)
        if dtype.kind in "iu":
            view[:] = _wrap([int(v) * int(factor) for v in view], dtype)
        elif dtype.itemsize == 2:
            view[:] = (view.astype(np.float32) * np.float32(factor)).astype(dtype)
        else:
            view[:] = view * dtype.type(factor)
    else:
        raise FakeError(f"no emulation for kernel {name}")


# ----- helpers for tests -----

def device_array(rt: FakeRuntime, host: np.ndarray, dtype: DType, *, stream: int | None = None) -> Buffer:
    """A Buffer of fake device memory holding ``host``'s bytes; its ``owner`` keeps it alive."""
    host = np.ascontiguousarray(host)
    block = rt.fabric.mem.alloc(host.nbytes)
    if host.nbytes:
        rt.fabric.mem.view(block.ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)
    return Buffer(block.ptr, host.nbytes, dtype, tuple(host.shape), Device("cuda", rt.get_device()),
                  False, stream, block)


def read(rt: FakeRuntime, buf: Buffer, np_type: Any) -> np.ndarray:
    """The Buffer's bytes now, as ``np_type`` (call after the op completed)."""
    if not buf.nbytes:
        return np.empty(buf.shape, np_type)
    out: np.ndarray = rt.fabric.mem.view(buf.ptr, buf.nbytes).view(np_type).reshape(buf.shape).copy()
    return out


def read_on_stream(rt: FakeRuntime, buf: Buffer, np_type: Any, stream: int | None = None) -> "queue.Queue[np.ndarray]":
    """Read the Buffer from a task queued on ``stream`` (the current stream by default),
    as a later kernel of the caller would: ordered by the stream, not the host."""
    out: queue.Queue[np.ndarray] = queue.Queue()
    rt._stream(stream if stream is not None else rt.current_stream()).enqueue(
        lambda: out.put(read(rt, buf, np_type)))
    return out
