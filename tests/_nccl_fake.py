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
import ctypes
import itertools
import os
import queue
import re
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from gpucoll._buffer import Buffer, Device, DType
from gpucoll._backends.nccl import runtime as _runtime_mod
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


# ----- CUDA errors, contexts, capture -----

class FakeCudaError(FakeError):
    """A CUDA runtime error as CuPy raises it (``CUDARuntimeError`` carries ``status``)."""

    def __init__(self, status: int, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.status = status


# cudaError_t values (driver_types.h) the fake returns.
INVALID_RESOURCE_HANDLE = 400
CAPTURE_UNSUPPORTED = 900   # cudaErrorStreamCaptureUnsupported: a prohibited call during capture
CAPTURE_INVALIDATED = 901   # cudaErrorStreamCaptureInvalidated: what cudaStreamEndCapture returns after it
CAPTURE_UNJOINED = 904      # cudaErrorStreamCaptureUnjoined: a forked stream was not joined back
CAPTURE_ISOLATION = 906     # cudaErrorStreamCaptureIsolation: a dependency crosses the capture boundary


class _Capture:
    """One stream capture sequence (cudaStreamBeginCapture .. cudaStreamEndCapture)."""

    def __init__(self, origin: int, mode: str) -> None:
        self.origin = origin
        self.mode = mode
        self.thread = threading.get_ident()
        self.ops: list[Callable[[], None]] = []
        self.counts: dict[int, int] = {origin: 0}   # captured ops per stream
        self.joined: dict[int, int] = {}            # stream -> its op count the origin waited for
        self.invalidated: str | None = None
        self.comms: list[FakeComm] = []              # communicators whose calls were captured


class FakeGraph:
    """An instantiated CUDA graph: its captured work runs, in capture order, each time
    it is launched (capture order is a topological order of the captured dependencies)."""

    def __init__(self, fabric: FakeFabric, ops: list[Callable[[], None]]) -> None:
        self._fabric = fabric
        self._ops = ops
        self.launches = 0

    def replay_here(self) -> None:
        """Run the captured work on the calling thread, now (a launch whose work can be
        watched from this thread, e.g. with sys.setprofile)."""
        self.launches += 1
        for fn in self._ops:
            fn()

    def launch(self, stream: int) -> None:
        self.launches += 1
        ops = self._ops

        def replay() -> None:
            for fn in ops:
                fn()
        self._fabric.stream(stream).enqueue(replay)


# ----- streams and events -----

class _Marker:
    __slots__ = ("done", "t")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.t = 0.0


class FakeEvent:
    """A CUDA event of one device. ``timing=False`` models cudaEventDisableTiming:
    cudaEventElapsedTime on it fails, as CUDA's does."""

    def __init__(self, fabric: FakeFabric, device: int = 0, timing: bool = True) -> None:
        self.ptr = next(fabric.handles)
        self.device = device
        self.timing = timing
        self.marker: _Marker | None = None
        self.capture: _Capture | None = None   # recorded during this capture (a graph node)
        self.capture_pos = (0, 0)              # (stream, its captured op count) when recorded
        fabric.events[self.ptr] = self


def _stream_loop(q: "queue.Queue[Callable[[], None] | None]", fabric: FakeFabric, name: str) -> None:
    # A function of its own, holding no reference to the FakeStream: the stream (its
    # handle) dies with its owner, as cudaStreamDestroy on a CuPy Stream's collection.
    while True:
        fn = q.get()
        if fn is None:
            return
        try:
            fn()
        except BaseException as exc:  # keep executing: a GPU does too
            fabric.errors.append(f"stream {name}: {type(exc).__name__}: {exc}")


class FakeStream:
    """A CUDA stream of one device: a thread running its queue in order. Its handle is
    valid while this object lives (FakeFabric.streams holds it weakly)."""

    def __init__(self, fabric: FakeFabric, name: str, device: int | None = None) -> None:
        self.high_priority = False
        self.ptr = next(fabric.handles)
        self.name = name
        self.device = fabric.current_device() if device is None else device
        self._fabric = fabric
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        fabric.streams[self.ptr] = self
        weakref.finalize(self, self._q.put, None)
        self._thread = threading.Thread(target=_stream_loop, args=(self._q, fabric, name),
                                        name=f"fake-stream-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, fn: Callable[[], None]) -> None:
        cap = self._fabric.captures.get(self.ptr)
        if cap is not None:  # captured work runs only when the graph is launched
            cap.ops.append(fn)
            cap.counts[self.ptr] = cap.counts.get(self.ptr, 0) + 1
            return
        self._q.put(fn)

    def stop(self) -> None:
        self._q.put(None)

    def __enter__(self) -> FakeStream:
        # CuPy's Stream.__enter__ (cupy/cuda/stream.pyx, check_stream_device_match).
        current = self._fabric.current_device()
        if current != self.device:
            raise RuntimeError(f"The device that the stream is created on ({self.device}) does not match "
                               f"with the current device ({current})")
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
        self.executed = 0                             # collectives run so far
        self.connected: set[int] = set()              # ranks that entered their first collective
        self.p2p_connected: set[tuple[int, int]] = set()  # (rank, peer) that entered a first p2p
        self.host_calls: dict[Any, dict[int, Any]] = {}  # collective host calls (windows): key -> rank -> value

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
            # An aborted rank's kernels exit (ncclCommAbort), so a collective one of them
            # is part of never completes, and once its abort returned, that rank may free
            # its memory: the data moves under the lock abort takes, or not at all.
            with self.cond:
                run = not self.aborted.intersection(slot.calls)
                if run:
                    self.executed += 1
                    try:
                        self._check_match(seq, slot.calls)
                        execute(slot.calls)
                    finally:
                        slot.done.set()
                        self.cond.notify_all()
            if not run:
                self.wait_until(rank, lambda: False, f"collective #{seq} {call[0]} with an aborted rank")
        else:
            self.wait_until(rank, slot.done.is_set, f"collective #{seq} {call[0]}")

    def host_all_gather(self, rank: int, key: Any, value: Any) -> dict[int, Any]:
        """Every rank's ``value`` for the collective host call ``key`` (NCCL's bootstrap
        all-gather inside ncclCommWindowRegister and its deregistration)."""
        with self.cond:
            box = self.host_calls.setdefault(key, {})
            box[rank] = value
            self.cond.notify_all()
        if not self.wait_until(rank, lambda: len(box) == self.size, f"every rank's {key[0]} #{key[1]}"):
            raise FakeError(f"rank {rank}: the communicator was aborted during {key[0]}")
        return dict(box)

    def _check_match(self, seq: int, calls: dict[int, tuple[Any, ...]]) -> None:
        first = calls[0]
        for r, c in calls.items():
            if c[:2] != first[:2]:
                raise FakeError(f"collective #{seq} differs between ranks: rank 0 {first}, rank {r} {c}")

    def connect(self, rank: int, peers: Sequence[int] | None) -> None:
        """The host side of a first call: NCCL connects inside the first collective
        (``peers`` None: every rank) and the first p2p with each peer, and the calling
        thread blocks until the peers have called in too (bounded here by hang_limit)."""
        with self.cond:
            if peers is None:
                self.connected.add(rank)
            else:
                self.p2p_connected.update((rank, p) for p in peers)
            self.cond.notify_all()
        if peers is None:
            ok = self.wait_until(rank, lambda: len(self.connected) == self.size,
                                 "every rank to enter its first collective (NCCL connects there)")
        else:
            ok = self.wait_until(rank, lambda: all((p, rank) in self.p2p_connected for p in peers),
                                 f"ranks {sorted(peers)} to enter their first send/recv with rank {rank}")
        if not ok:
            raise FakeError(f"rank {rank}: the communicator was aborted while connecting")

    def post(self, src: int, dst: int, payload: bytes) -> threading.Event:
        taken = threading.Event()
        with self.cond:
            self.mail.setdefault((src, dst), deque()).append((payload, taken))
            self.cond.notify_all()
        return taken

    def take(self, src: int, dst: int, nbytes: int) -> bytes | None:
        box = self.mail.setdefault((src, dst), deque())
        if not self.wait_until(dst, lambda: bool(box), f"a message from rank {src}"):
            return None
        with self.cond:
            payload, taken = box.popleft()
            taken.set()
            self.cond.notify_all()
        if len(payload) != nbytes:
            raise FakeError(f"rank {dst} receives {nbytes} bytes from rank {src}, which sent {len(payload)}")
        return payload


def _reduce(arrays: list[np.ndarray], op: int, factors: list[float | None], n: int) -> np.ndarray:
    """What NCCL's reduction computes (src/device/reduce_kernel.h): each step in the
    element type, so fp16/bf16/fp8 round after every addition (``__hadd``) as NCCL's
    do, integers wrap; ncclAvg is a PreMulSum by 1/n on floats and, on integers, a
    wrapping sum divided by n truncating toward zero (FuncSumPostDiv::divide)."""
    dt = arrays[0].dtype
    low = dt.kind == "f" and dt.itemsize <= 2 or dt.name == "bfloat16" or "float8" in dt.name

    def step(a: np.ndarray, b: np.ndarray, fn: Callable[[Any, Any], Any]) -> np.ndarray:
        if low:  # computed in float32, rounded to the element type at each step
            return np.asarray(fn(a.astype(np.float32), b.astype(np.float32))).astype(dt)
        with np.errstate(over="ignore"):
            return np.asarray(fn(a, b)).astype(dt)
    work = [a.copy() for a in arrays]
    if op == 4 and (dt.kind == "f" or low):
        factors = [1.0 / n] * len(work)
        op = 5
    if op >= 5:  # PreMulSum: each rank's own factor, rounded to the element type, applied first
        work = [step(w, np.asarray(f).astype(dt), np.multiply) for w, f in zip(work, factors)]
        op = 0
    acc = work[0]
    for w in work[1:]:
        if op in (0, 4):
            acc = step(acc, w, np.add)
        elif op == 1:
            acc = step(acc, w, np.multiply)
        elif op == 2:
            acc = np.maximum(acc, w)
        elif op == 3:
            acc = np.minimum(acc, w)
        else:
            raise FakeError(f"unknown ncclRedOp {op}")
    if op == 4:  # integers: FuncSumPostDiv, |x| / n negated back (truncation toward zero)
        vals = [int(v) for v in acc]
        acc = _wrap([(abs(v) // n) * (1 if v >= 0 else -1) for v in vals], dt) if vals else acc
    out: np.ndarray = np.asarray(acc).astype(dt)
    return out


class FakeNcclError(FakeError):
    """An ncclResult_t other than ncclSuccess, as CuPy's NcclError carries it (``status``)."""

    def __init__(self, status: int, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.status = status


NCCL_INVALID_ARGUMENT = 4  # ncclInvalidArgument


_FLOAT_DTYPES = (6, 7, 8, 9, 10, 11)  # ncclFloat16, Float32, Float64, Bfloat16, Float8e4m3, Float8e5m2


def refuse_one_rank_premul(kind: str, size: int, dtype: int, op: int) -> None:
    """What NCCL's one-rank path does with a PreMulSum, which gpucoll must not rely on.

    ``ncclLaunchOneRank`` (src/device/onerank.cu) runs every reduction of a one-rank
    communicator: a copy, except for a PreMulSum (any PreMulSum op, and ncclAvg on
    floating types, which hostToDevRedOp turns into a PreMulSum by 1/n), which runs its
    ``oneRankReduce`` kernel. Seen on an H200:
    * float8 (NCCL 2.28.9 and 2.32.3): the fp8 cases sit under ``__CUDA_ARCH__ >= 900``,
      false in the host pass, so it returns ncclInvalidArgument;
    * float64 and complex64 (as float32 pairs) of 4,099 elements (NCCL 2.28.9): the
      kernel left the last element unscaled or unwritten, a wrong result and no error.
    The first is modelled as NCCL does it; the second, which no fake can reproduce
    faithfully, as a detected misuse."""
    if size != 1 or not (op >= 5 or (op == 4 and dtype in _FLOAT_DTYPES)):
        return
    what = f"{kind} of ncclDataType_t {dtype} with {'ncclAvg' if op == 4 else 'a PreMulSum op'} on a one-rank communicator"
    if dtype in (10, 11):
        raise FakeNcclError(NCCL_INVALID_ARGUMENT, "NCCL_ERROR_INVALID_ARGUMENT", what)
    raise FakeError(f"{what}: NCCL's one-rank PreMulSum kernel (oneRankReduce) gave wrong results on an H200; "
                    "a one-rank reduction must copy and scale by itself")


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
        self.device = runtime.fabric.current_device()
        self._inside: set[int] = set()  # threads inside a call on this communicator now
        self._inside_lock = threading.Lock()
        self.connected = False
        self.p2p_peers: set[int] = set()
        # Graphs that captured calls on this communicator (NCCL's persistent plans): NCCL's
        # teardown (commDestroySync, src/init.cc, reached by ncclCommDestroy and
        # ncclCommAbort alike) keeps polling "until all graphs referencing us die". Only a
        # communicator of several ranks makes persistent plans: a one-rank one copies.
        self.graphs: weakref.WeakSet[FakeGraph] = weakref.WeakSet()
        self.registered: dict[int, tuple[int, int]] = {}  # ncclCommRegister handle -> (ptr, nbytes)
        self.windows: dict[int, tuple[int, int]] = {}     # window -> (ptr, nbytes)
        self.windows_made = self.windows_freed = 0        # keys of the collective calls
        runtime.comms.add(self)

    def _wait_for_graphs(self, what: str) -> None:
        deadline = time.monotonic() + self._rt.fabric.hang_limit
        while len(self.graphs):
            if time.monotonic() > deadline:
                msg = (f"rank {self.rank}: {what} blocked for {self._rt.fabric.hang_limit} s: NCCL waits until "
                       f"every CUDA graph that captured this communicator's calls is destroyed")
                self._rt.fabric.errors.append(msg)
                raise FakeError(msg)
            time.sleep(0.01)

    # -- NCCL's host-side rules --
    def enter(self, what: str) -> None:
        """A host call on this communicator begins. NCCL communicators are not
        thread-safe ("multiple threads should use separate communicator objects",
        NCCL's thread-safety notes): a second thread inside a call is a detected error."""
        me = threading.get_ident()
        with self._inside_lock:
            others = self._inside - {me}
            self._inside.add(me)
        if others:
            msg = f"rank {self.rank}: {what} while another thread is inside an NCCL call on the same communicator"
            self._rt.fabric.errors.append(msg)
            raise FakeError(msg)

    def leave(self) -> None:
        with self._inside_lock:
            self._inside.discard(threading.get_ident())

    def first_calls(self, kinds: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
        """Block the host as NCCL's first collective / first p2p per peer do."""
        if any(k in _COLLECTIVES for k, _ in kinds) and not self.connected:
            self.world.connect(self.rank, None)
            self.connected = True
        peers = {a[3] for k, a in kinds if k in ("send", "recv")} - self.p2p_peers
        if peers:
            self.world.connect(self.rank, sorted(peers))
            self.p2p_peers |= peers

    # -- the calls: buffered into the runtime's group, or run at once --
    def _call(self, kind: str, args: tuple[Any, ...], stream: int) -> None:
        if self.destroyed or self.rank in self.world.aborted:
            raise FakeError(f"{kind} on a destroyed or aborted communicator")
        self._rt._check_blocking()
        st = self._rt.fabric.stream(stream)
        if st.device != self.device:
            raise FakeCudaError(INVALID_RESOURCE_HANDLE, "ncclInvalidArgument",
                                f"{kind} on a stream of cuda:{st.device}; the communicator is on cuda:{self.device}")
        if kind in ("all_reduce", "reduce", "reduce_scatter"):
            op = args[4]
            if op >= 5 and op not in self._ops:
                raise FakeError(f"{kind} with PreMulSum op {op}, which does not exist (destroyed?)")
            refuse_one_rank_premul(kind, self.size, args[3], op)
            # NCCL reads a host-immediate factor when the op is made; capture it now.
            args = args + ((self._ops[op][0] if op >= 5 else None),)
        self.calls.append((kind,) + args)
        self.enter(kind)
        try:
            if self._rt.call_delay:
                time.sleep(self._rt.call_delay)
            self._rt._nccl_call(self, kind, args, stream)
        finally:
            self.leave()

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
        self.enter("ncclCommSplit")
        try:
            if self._rt.call_delay:
                time.sleep(self._rt.call_delay)
            return self._split(color, key, config)
        finally:
            self.leave()

    def _split(self, color: int, key: int, config: dict[str, Any] | None) -> FakeComm | None:
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
        self.enter("ncclCommShrink")
        try:
            return self._shrink(exclude, flags, config)
        finally:
            self.leave()

    def _shrink(self, exclude: Sequence[int], flags: int, config: dict[str, Any] | None) -> FakeComm:
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

    # -- buffer registration (NCCL's rules: src/register/register.cc, src/dev_runtime.cc) --
    def _registrable(self, what: str, ptr: int, nbytes: int) -> None:
        if self.destroyed or self.rank in self.world.aborted:
            raise FakeError(f"{what} on a destroyed or aborted communicator")
        if not ptr or nbytes <= 0:
            raise FakeNcclError(NCCL_INVALID_ARGUMENT, "ncclInvalidArgument", f"invalid pointer {ptr:#x} / size {nbytes}")
        try:
            self._rt.fabric.mem.view(ptr, nbytes)
        except FakeError as exc:
            raise FakeNcclError(1, "ncclUnhandledCudaError", f"{what}: {exc}") from None

    def register(self, ptr: int, nbytes: int) -> int:
        """ncclCommRegister: any device memory of the communicator's GPU; a handle."""
        if self._rt.features.version < (2, 19, 0):
            raise FakeError("ncclCommRegister called on NCCL < 2.19, which has none")
        self._registrable("ncclCommRegister", ptr, nbytes)
        handle = next(self._rt.fabric.handles)
        self.registered[handle] = (ptr, nbytes)
        return handle

    def deregister(self, handle: int) -> None:
        if self.registered.pop(handle, None) is None:
            raise FakeNcclError(5, "ncclInvalidUsage", "Deregister: Could not find handle")

    def window_register(self, ptr: int, nbytes: int, flags: int) -> int:
        """ncclCommWindowRegister: collective; cuMem memory (ncclMemAlloc) only, at an offset
        that is a multiple of 4096 into its allocation; symmetric windows the same size on
        every rank (NCCL 2.27's symmetric kernels). A rank that fails a local check returns
        before NCCL's bootstrap all-gather, where its peers then hang (here: for hang_limit)."""
        if self._rt.features.version < (2, 27, 0):
            raise FakeError("ncclCommWindowRegister called on NCCL < 2.27, which has none")
        self._registrable("ncclCommWindowRegister", ptr, nbytes)
        base = self._rt.fabric.nccl_base(ptr, nbytes)
        if base is None:
            raise FakeNcclError(1, "ncclUnhandledCudaError",
                                f"cuMemRetainAllocationHandle({ptr:#x}) failed: not cuMem memory (not from ncclMemAlloc)")
        if (ptr - base) % 4096:
            raise FakeNcclError(NCCL_INVALID_ARGUMENT, "ncclInvalidArgument", "Window address must be suitably aligned.")
        n = self.windows_made = self.windows_made + 1
        sizes = self.world.host_all_gather(self.rank, ("ncclCommWindowRegister", n), nbytes)
        if flags & 1 and len(set(sizes.values())) > 1:
            raise FakeNcclError(NCCL_INVALID_ARGUMENT, "ncclInvalidArgument",
                                f"symmetric window sizes differ between ranks: {sorted(sizes.items())}")
        handle = next(self._rt.fabric.handles)
        self.windows[handle] = (ptr, nbytes)
        return handle

    def window_deregister(self, handle: int) -> None:
        if handle not in self.windows:
            raise FakeNcclError(5, "ncclInvalidUsage", f"window {handle:#x} is not a window of this communicator")
        n = self.windows_freed = self.windows_freed + 1
        self.world.host_all_gather(self.rank, ("ncclCommWindowDeregister", n), handle)
        del self.windows[handle]

    def holds(self, ptr: int) -> bool:
        """Whether a registration or window of this communicator covers ``ptr``."""
        return any(p <= ptr < p + n for p, n in (*self.registered.values(), *self.windows.values()))

    def abort(self) -> None:
        with self._inside_lock:
            inside = set(self._inside)
        if inside:
            # ncclCommAbort frees the communicator under the call in flight.
            msg = f"rank {self.rank}: ncclCommAbort while another thread is inside an NCCL call on it"
            self._rt.fabric.errors.append(msg)
            raise FakeError(msg)
        with self.world.cond:
            self.world.aborted.add(self.rank)
            self.world.cond.notify_all()
        self._wait_for_graphs("ncclCommAbort")

    def destroy(self) -> None:
        self._wait_for_graphs("ncclCommDestroy")
        self.destroyed = True
        if self._ops:
            self._rt.fabric.errors.append(f"rank {self.rank}: PreMulSum ops {sorted(self._ops)} never destroyed")


# ----- the runtime -----

class FakeFabric:
    """What all rank threads share: memory, streams, events, worlds, contexts, captures,
    the per-thread CUDA state, and errors.

    Args:
        hang_limit: seconds any fake wait lasts before it reports a hang.
        gpus: the devices the job's ranks use; a CUDA context made on any other device
            (the CUDA runtime makes one on the thread's current device, 0 when never
            set, at a thread's first call) is an error. None: any.
        eager_bytes: sends up to this size complete without the receiver (NCCL's
            buffered eager protocol); larger ones are a rendezvous.
    """

    def __init__(self, hang_limit: float = 20.0, *, gpus: set[int] | None = None, eager_bytes: int = 4096) -> None:
        self.mem = FakeMemory()
        self.handles = itertools.count(0x1000)
        self.streams: weakref.WeakValueDictionary[int, FakeStream] = weakref.WeakValueDictionary()
        self._keep_streams: list[FakeStream] = []
        self.events: dict[int, FakeEvent] = {}
        self.worlds: dict[bytes, FakeWorld] = {}
        self.scalable_ids: dict[bytes, tuple[bytes, ...]] = {}  # each id -> the id list it came in
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.hang_limit = hang_limit
        self.gpus = gpus
        self.eager_bytes = eager_bytes
        self.contexts: set[int] = set()
        self.context_threads: list[tuple[int, str]] = []  # (device, thread) that made each context
        self.captures: dict[int, _Capture] = {}  # capturing stream -> its capture sequence
        self.nccl_mem: dict[int, _Block] = {}     # ncclMemAlloc'ed blocks (cuMem memory), by pointer
        self._tls = threading.local()

    # -- the calling thread's CUDA state --
    def current_device(self) -> int:
        """cudaGetDevice: 0 on a thread that never set one (no context is made)."""
        d: int | None = getattr(self._tls, "device", None)
        return 0 if d is None else d

    def use_device(self, device: int) -> None:
        """cudaSetDevice: since CUDA 12.0 it initialises the device's primary context."""
        self._tls.device = device
        self._tls.bound = True
        self.context(device)

    def has_context(self) -> bool:
        """cuCtxGetCurrent != NULL: the thread has set a device or made a runtime call."""
        return bool(getattr(self._tls, "bound", False))

    def context(self, device: int | None = None) -> None:
        """A runtime call needs the thread's current device's primary context: make it."""
        d = self.current_device() if device is None else device
        if device is None:
            self._tls.bound = True  # the runtime binds the primary context to the thread
        if d in self.contexts:
            return
        with self.lock:
            if d in self.contexts:
                return
            self.contexts.add(d)
            self.context_threads.append((d, threading.current_thread().name))
        if self.gpus is not None and d not in self.gpus:
            msg = (f"thread {threading.current_thread().name!r} made a CUDA context on cuda:{d}, a device no rank "
                   f"uses (the job's devices: {sorted(self.gpus)}): 300-500 MiB of that GPU's memory")
            self.errors.append(msg)
            raise FakeError(msg)

    def capture_mode(self) -> str:
        return getattr(self._tls, "mode", "global")

    def exchange_capture_mode(self, mode: str) -> str:
        """cudaThreadExchangeStreamCaptureMode."""
        if mode not in ("global", "thread_local", "relaxed"):
            raise FakeError(f"unknown capture mode {mode!r}")
        prev = self.capture_mode()
        self._tls.mode = mode
        return prev

    def unsafe(self, what: str) -> None:
        """A "potentially unsafe API call" (cudaStreamBeginCapture's modes): prohibited,
        returning error 900 and invalidating the capture, when this thread has its own
        non-relaxed capture under way (modes global and thread_local), or when another
        thread has a global-mode capture under way and this thread's mode is global."""
        mine = self.capture_mode()
        if mine == "relaxed" or not self.captures:
            return
        me = threading.get_ident()
        for cap in list(self.captures.values()):
            if (cap.thread == me and cap.mode != "relaxed") or (cap.thread != me and cap.mode == "global"
                                                                 and mine == "global"):
                why = (f"{what} from thread {threading.current_thread().name!r} (capture mode {mine}) during a "
                       f"{cap.mode}-mode capture")
                cap.invalidated = cap.invalidated or why
                self.errors.append(f"cudaErrorStreamCaptureUnsupported: {why}")
                raise FakeCudaError(CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported", why)

    def stream(self, ptr: int) -> FakeStream:
        try:
            return self.streams[ptr]
        except KeyError:
            raise FakeCudaError(INVALID_RESOURCE_HANDLE, "cudaErrorInvalidResourceHandle",
                                f"stream {ptr:#x} does not exist (destroyed with its owner?)") from None

    def nccl_base(self, ptr: int, nbytes: int) -> int | None:
        """The ncclMemAlloc block holding ``[ptr, ptr + nbytes)``, or None (not cuMem memory)."""
        with self.lock:
            for base, block in self.nccl_mem.items():
                if base <= ptr and ptr + nbytes <= base + block.data.size:
                    return base
        return None

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
    """One rank's view of the fake GPU (a Runtime). The current device is per thread,
    as CUDA's is; ``devices`` is how many this rank's machine has."""

    def __init__(self, fabric: FakeFabric, *, features: Features | None = None, devices: int = 1,
                 cc: tuple[int, int] = (9, 0), op_delay: float = 0.0,
                 refuse_config: frozenset[str] = frozenset()) -> None:
        self.fabric = fabric
        # ncclConfig_t fields every communicator was made with: ("init"|"split"|"shrink", fields or None)
        self.configs: list[tuple[str, dict[str, Any] | None]] = []
        self.scalable_inits: list[int] = []  # ids passed to each ncclCommInitRankScalable
        self.refuse_config = refuse_config  # fields this runtime cannot apply (as CuPy's cannot most)
        self.features = features or Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True,
                                             register=True, window=True)
        self.comms: weakref.WeakSet[FakeComm] = weakref.WeakSet()  # communicators made here (registrations)
        self._devices = devices
        self._cc = cc
        self.op_delay = op_delay
        self.default_stream = FakeStream(fabric, "default", fabric.current_device())
        self._current: dict[int, int] = {}  # device -> this rank's current stream there (CuPy's is per device)
        self._group: list[tuple[FakeComm, str, tuple[Any, ...], int]] | None = None
        self._depth = 0
        self.kernels_prepared: list[str] = []
        self.kernels_launched: list[str] = []
        self.allocations = 0
        self.unpooled_events = 0
        self.timing_events = 0
        self.call_delay = 0.0  # seconds each NCCL call stays on the host (NCCL's enqueue work)

    # -- devices and streams --
    def get_device(self) -> int:
        return self.fabric.current_device()

    def set_device(self, device: int) -> None:
        if not 0 <= device < self._devices:
            raise FakeError(f"set_device({device}) with {self._devices} devices")
        self.fabric.use_device(device)

    def device_count(self) -> int:
        return self._devices

    def compute_capability(self, device: int) -> tuple[int, int]:
        return self._cc

    def current_stream(self) -> int:
        d = self.fabric.current_device()
        ptr = self._current.get(d)
        if ptr is None:
            if d == self.default_stream.device:
                return self.default_stream.ptr
            stream = FakeStream(self.fabric, f"default-{d}", d)
            self.fabric._keep_streams.append(stream)
            ptr = self._current[d] = stream.ptr
        return ptr

    def current_stream_of(self, device: int) -> int:
        """CuPy's ``get_current_stream(device)``: the current stream of ``device``, whatever is current."""
        ptr = self._current.get(device)
        if ptr is None:
            if device == self.default_stream.device:
                return self.default_stream.ptr
            stream = FakeStream(self.fabric, f"default-{device}", device)
            self.fabric._keep_streams.append(stream)
            ptr = self._current[device] = stream.ptr
        return ptr

    def set_current_stream(self, ptr: int) -> None:
        self._current[self.fabric.stream(ptr).device] = ptr

    def stream_of(self, stream: Any, device: int) -> int | None:
        """The handle of a CuPy stream object (tests/_fake_cupy_costs.py's, whose ptr 0,
        device -1, is CuPy's null stream: here ``device``'s default stream) if it is
        ``device``'s."""
        if stream.ptr == 0:
            return self.default_stream.ptr if device == self.default_stream.device else self.current_stream_of(device)
        return int(stream.ptr) if stream.device_id == device else None

    def new_stream(self, high_priority: bool = False) -> FakeStream:
        self.fabric.context()
        stream = FakeStream(self.fabric, "comm")
        stream.high_priority = high_priority
        return stream

    def _stream(self, ptr: int) -> FakeStream:
        return self.fabric.stream(ptr)

    def is_capturing(self, stream: int) -> bool:
        return stream in self.fabric.captures

    # -- capture (the test drives it, as torch.cuda.graph or cupy's stream capture would) --
    def begin_capture(self, stream: int | None = None, mode: str = "global") -> None:
        ptr = self.current_stream() if stream is None else stream
        if ptr in self.fabric.captures:
            raise FakeError(f"stream {ptr:#x} is already capturing")
        self.fabric.captures[ptr] = _Capture(ptr, mode)

    def end_capture(self, stream: int | None = None) -> FakeGraph:
        ptr = self.current_stream() if stream is None else stream
        cap = self.fabric.captures.get(ptr)
        if cap is None or cap.origin != ptr:
            raise FakeError(f"end_capture on stream {ptr:#x}, which did not begin a capture")
        for s in [s for s, c in self.fabric.captures.items() if c is cap]:
            del self.fabric.captures[s]
        if cap.invalidated:
            raise FakeCudaError(CAPTURE_INVALIDATED, "cudaErrorStreamCaptureInvalidated", cap.invalidated)
        unjoined = [s for s, n in cap.counts.items() if s != ptr and n > cap.joined.get(s, 0)]
        if unjoined:
            raise FakeCudaError(CAPTURE_UNJOINED, "cudaErrorStreamCaptureUnjoined",
                                f"streams {[hex(s) for s in unjoined]} forked into the capture were not joined back")
        graph = FakeGraph(self.fabric, cap.ops)
        for comm in cap.comms:
            comm.graphs.add(graph)
        return graph

    # False: as CudaRuntime where no exchange call is found (exchanges change nothing)
    can_exchange_capture_mode = True

    def exchange_capture_mode(self, mode: int) -> int:
        if not self.can_exchange_capture_mode:
            return mode
        names = ("global", "thread_local", "relaxed")
        return names.index(self.fabric.exchange_capture_mode(names[mode]))

    def has_context(self) -> bool:
        return self.fabric.has_context()

    # -- events --
    def event(self, pooled: bool = True, timing: bool = True, device: int = -1) -> FakeEvent:
        self.fabric.context()
        if not pooled:
            self.unpooled_events += 1
        if timing:
            self.timing_events += 1
        return FakeEvent(self.fabric, self.fabric.current_device() if device < 0 else device, timing)

    def new_event(self, timing: bool = False) -> int:
        """cudaEventCreateWithFlags: an event of the current device."""
        self.fabric.context()
        if timing:
            self.timing_events += 1
        return FakeEvent(self.fabric, self.fabric.current_device(), timing).ptr

    def destroy_event(self, event: int) -> None:
        self.fabric.events.pop(event, None)

    def record(self, event: int, stream: int) -> None:
        self.fabric.context()
        ev = self.fabric.events[event]
        st = self._stream(stream)
        if ev.device != st.device:  # cudaEventRecord: "event and stream must be on the same device"
            raise FakeCudaError(INVALID_RESOURCE_HANDLE, "cudaErrorInvalidResourceHandle",
                                f"event of cuda:{ev.device} recorded on a stream of cuda:{st.device}")
        cap = self.fabric.captures.get(stream)
        if cap is not None:
            st.enqueue(lambda: None)
            ev.marker, ev.capture, ev.capture_pos = None, cap, (stream, cap.counts.get(stream, 0))
            return
        ev.capture = None
        marker = ev.marker = _Marker()

        def fire() -> None:
            marker.t = time.perf_counter()
            marker.done.set()
        st.enqueue(fire)

    def wait_event(self, stream: int, event: int) -> None:
        self.fabric.context()
        ev = self.fabric.events[event]
        st = self._stream(stream)
        cap = self.fabric.captures.get(stream)
        if ev.capture is not None:
            if cap is None:  # a fork: the stream joins the capture
                cap = self.fabric.captures[stream] = ev.capture
                cap.counts.setdefault(stream, 0)
            elif cap is not ev.capture:
                raise FakeCudaError(CAPTURE_ISOLATION, "cudaErrorStreamCaptureIsolation",
                                    "a stream waits on an event of another capture")
            src, pos = ev.capture_pos
            if stream == cap.origin and src != stream:
                cap.joined[src] = max(cap.joined.get(src, 0), pos)
            st.enqueue(lambda: None)
            return
        if cap is not None and ev.marker is not None:
            why = "a capturing stream waits on an event recorded outside the capture"
            cap.invalidated = cap.invalidated or why
            raise FakeCudaError(CAPTURE_ISOLATION, "cudaErrorStreamCaptureIsolation", why)
        marker = ev.marker
        if marker is None:
            return
        limit = self.fabric.hang_limit

        def wait() -> None:
            if not marker.done.wait(limit):
                raise FakeError(f"a stream waited {limit} s for an event")
        st.enqueue(wait)

    def query(self, event: int) -> bool:
        self.fabric.context()
        self.fabric.unsafe("cudaEventQuery")
        if self.fabric.errors:
            raise FakeError("the fake GPU saw errors: " + "; ".join(self.fabric.errors))
        ev = self.fabric.events[event]
        if ev.capture is not None:
            raise FakeCudaError(CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
                                "cudaEventQuery on an event recorded during stream capture")
        marker = ev.marker
        return marker is None or marker.done.is_set()

    def elapsed_ms(self, start: int, end: int) -> float:
        ea, eb = self.fabric.events[start], self.fabric.events[end]
        if not (ea.timing and eb.timing):
            raise FakeCudaError(INVALID_RESOURCE_HANDLE, "cudaErrorInvalidResourceHandle",
                                "cudaEventElapsedTime on an event made with cudaEventDisableTiming")
        a, b = ea.marker, eb.marker
        if a is None or b is None or not (a.done.is_set() and b.done.is_set()):
            raise FakeError("elapsed_ms on an event that has not completed")
        return (b.t - a.t) * 1000.0

    # -- memory and kernels --
    def alloc(self, nbytes: int, stream: Any) -> tuple[int, Any]:
        # CudaRuntime.alloc allocates from CuPy's pool under ``with stream``, which
        # checks the stream's device against the current one; cudaMalloc is unsafe in capture.
        with stream:
            self.fabric.context()
            self.fabric.unsafe("cudaMalloc")
        self.allocations += 1
        block = self.fabric.mem.alloc(nbytes)
        return block.ptr, block

    def mem_alloc(self, nbytes: int) -> int:
        """ncclMemAlloc: cuMem memory on the current device, rounded up to the granularity (2 MiB)."""
        if not self.features.register:
            raise FakeError("ncclMemAlloc called on an NCCL without it (< 2.19)")
        self.fabric.context()
        block = self.fabric.mem.alloc((nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20))
        with self.fabric.lock:
            self.fabric.nccl_mem[block.ptr] = block
        return block.ptr

    def mem_free(self, ptr: int) -> None:
        """ncclMemFree: only what ncclMemAlloc gave; memory still registered with a live
        communicator is a detected misuse (NCCL does not notice: a later op reads freed memory)."""
        held = [c for c in list(self.comms) if not c.destroyed and c.rank not in c.world.aborted and c.holds(ptr)]
        if held:
            msg = (f"ncclMemFree({ptr:#x}) while registered with communicator(s) of rank(s) "
                   f"{sorted(c.rank for c in held)}: deregister first")
            self.fabric.errors.append(msg)
            raise FakeError(msg)
        with self.fabric.lock:
            block = self.fabric.nccl_mem.pop(ptr, None)
        if block is None:
            raise FakeNcclError(1, "ncclUnhandledCudaError", f"ncclMemFree({ptr:#x}): not from ncclMemAlloc")
        self.fabric.mem._free(ptr)

    def is_vmm(self, ptr: int, nbytes: int) -> bool | None:
        return self.fabric.nccl_base(ptr, nbytes) is not None

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
        if kernel not in self.kernels_prepared:
            self.fabric.unsafe("NVRTC compile and cuModuleLoadData")  # loading a module: unsafe in capture
            self.kernels_prepared.append(kernel)

    def launch(self, kernel: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None:
        if kernel not in self.kernels_prepared:
            raise FakeError(f"kernel {kernel} launched without prepare()")
        if stream.device != device or self.fabric.current_device() != device:
            raise RuntimeError(f"kernel {kernel} for cuda:{device} launched on a stream of cuda:{stream.device} "
                               f"with cuda:{self.fabric.current_device()} current")
        self.kernels_launched.append(kernel)
        mem = self.fabric.mem
        stream.enqueue(lambda: emulate_kernel(mem, kernel, n, args))

    # -- NCCL --
    def _check_blocking(self) -> None:
        # NCCL_COMM_BLOCKING=0 makes every communicator non-blocking: calls return
        # ncclInProgress (7), and CuPy 14.2's NcclError looks the code up in a table
        # without it, raising KeyError: 7 from its error path.
        if os.environ.get("NCCL_COMM_BLOCKING") == "0":
            raise KeyError(7)

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def check_config(self, config: dict[str, Any]) -> None:
        refused = sorted(set(config) & self.refuse_config)
        if refused:
            raise BackendUnavailableError(f"NCCL config field(s) {', '.join(refused)} cannot be applied (fake)")

    def new_comm(self, size: int, uid: bytes, rank: int, config: dict[str, Any] | None = None) -> FakeComm:
        self.fabric.context()
        self.fabric.unsafe("ncclCommInitRank")  # allocates device memory and launches setup work
        self._check_blocking()
        self.configs.append(("init", None if config is None else dict(config)))
        world = self.fabric.world(uid, size)
        with world.cond:
            world.joined.add(rank)
            world.cond.notify_all()
        world.wait_until(rank, lambda: len(world.joined) == size, "every rank to create the communicator")
        return FakeComm(self, world, rank, config)

    def new_comm_scalable(self, size: int, uids: Any, rank: int,
                          config: dict[str, Any] | None = None) -> FakeComm:
        """ncclCommInitRankScalable, as strict as NCCL's contract: 1 <= nId <= nranks, and
        every rank passes the same ids in the same order (real NCCL would hang or fail in
        its bootstrap: here the mismatch is an error naming it)."""
        if not self.features.init_scalable:
            raise FakeError("ncclCommInitRankScalable is not in this NCCL (features.init_scalable)")
        self.fabric.context()
        self.fabric.unsafe("ncclCommInitRankScalable")
        self._check_blocking()
        ids = tuple(bytes(u) for u in uids)
        if not 1 <= len(ids) <= size:
            raise FakeError(f"ncclCommInitRankScalable: nId={len(ids)} for nranks={size} (needs 1 <= nId <= nranks)")
        if any(len(u) != 128 for u in ids) or len(set(ids)) != len(ids):
            raise FakeError("ncclCommInitRankScalable: the ids are not distinct 128-byte ncclUniqueIds")
        with self.fabric.lock:
            for u in ids:
                seen = self.fabric.scalable_ids.setdefault(u, ids)
                if seen != ids:
                    raise FakeError(f"ncclCommInitRankScalable: rank {rank} passed {len(ids)} ids that differ "
                                    f"from (or are ordered unlike) another rank's {len(seen)}: every rank must "
                                    "pass the same ids in the same order")
        self.configs.append(("init_scalable", None if config is None else dict(config)))
        self.scalable_inits.append(len(ids))
        world = self.fabric.world(b"scalable:" + ids[0], size)
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
                comms = {id(c[0]): c[0] for c in calls}
                for comm in comms.values():
                    comm.enter("ncclGroupEnd")
                try:
                    for comm in comms.values():
                        comm.first_calls([(k, a) for c, k, a, _ in calls if c is comm])
                    self._enqueue_nccl([c[:3] for c in calls], streams.pop())
                finally:
                    for comm in comms.values():
                        comm.leave()

    def _nccl_call(self, comm: FakeComm, kind: str, args: tuple[Any, ...], stream: int) -> None:
        if self._group is not None:
            self._group.append((comm, kind, args, stream))
        else:
            comm.first_calls([(kind, args)])
            self._enqueue_nccl([(comm, kind, args)], stream)

    def _enqueue_nccl(self, calls: list[tuple[FakeComm, str, tuple[Any, ...]]], stream: int) -> None:
        delay, mem, eager = self.op_delay, self.fabric.mem, self.fabric.eager_bytes
        if stream in self.fabric.captures:
            # A captured call runs at each graph launch, as the next collective of its
            # communicator then.
            cap = self.fabric.captures[stream]
            cap.comms.extend(c[0] for c in calls if c[0].size > 1 and c[0] not in cap.comms)
            def replay() -> None:
                run_nccl_group(mem, calls, [next(c[0]._seq) if c[1] in _COLLECTIVES else -1 for c in calls],
                               delay, eager)
            self._stream(stream).enqueue(replay)
            return
        seqs = [next(c[0]._seq) if c[1] in _COLLECTIVES else -1 for c in calls]
        self._stream(stream).enqueue(lambda: run_nccl_group(mem, calls, seqs, delay, eager))


_KERNEL_RE = re.compile(r"gpucoll_(reduce_(sum|prod|min|max|band|bor|bxor)_(i8|u8|i16|u16|i32|u32|i64|u64)"
                        r"|avg_trunc_(i8|u8|i16|u16|i32|u32|i64|u64)"
                        r"|scale_(i8|u8|i16|u16|i32|u32|i64|u64|f16|bf16|f32|f64|f8e4m3|f8e5m2))")


# ----- executing NCCL calls (on a stream thread) -----

def run_nccl_group(mem: FakeMemory, calls: list[tuple[FakeComm, str, tuple[Any, ...]]], seqs: list[int],
                   delay: float, eager: int = 1 << 62) -> None:
    if delay:
        time.sleep(delay)
    rendezvous: list[tuple[FakeComm, int, threading.Event]] = []
    for comm, kind, args in calls:  # sends first: a group's receives may depend on them
        if kind == "send":
            p, n, dt, peer = args
            nbytes = n * _ITEMSIZE[dt]
            taken = comm.world.post(comm.rank, peer, mem.view(p, nbytes).tobytes())
            if nbytes > eager:
                rendezvous.append((comm, peer, taken))
    for (comm, kind, args), seq in zip(calls, seqs):
        if kind in _COLLECTIVES:
            _collective(mem, comm, kind, args, seq)
    for comm, kind, args in calls:
        if kind == "recv":
            p, n, dt, peer = args
            payload = comm.world.take(peer, comm.rank, n * _ITEMSIZE[dt])
            if payload is not None:
                mem.view(p, n * _ITEMSIZE[dt])[:] = np.frombuffer(payload, np.uint8)
    for comm, peer, taken in rendezvous:
        # Above the eager size a send completes only once its receive is running: two
        # ranks that each send first, ungrouped, wait for each other as on real NCCL.
        comm.world.wait_until(comm.rank, taken.is_set, f"rank {peer} to receive a rendezvous send")


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
       "i64": "int64", "u64": "uint64", "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
       "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


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
        elif dtype.itemsize == 1:
            view[:] = _f8_scale(view, dtype, factor)
        elif dtype.itemsize == 2:
            view[:] = (view.astype(np.float32) * np.float32(factor)).astype(dtype)
        else:
            view[:] = view * dtype.type(factor)
    else:
        raise FakeError(f"no emulation for kernel {name}")


def _f8_scale(x: np.ndarray, dtype: np.dtype, factor: float) -> np.ndarray:
    """gpucoll_scale_f8*: the factor rounded to the element type, the product rounded
    once, saturating to the largest finite value (NCCL's __NV_SATFINITE); nan stays."""
    import ml_dtypes

    big = float(ml_dtypes.finfo(dtype).max)

    def sat(v: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(v), v, np.clip(v, -big, big)).astype(np.float32)
    k = sat(np.asarray([factor], np.float32)).astype(dtype).astype(np.float32)
    with np.errstate(all="ignore"):
        out: np.ndarray = sat(x.astype(np.float32) * k).astype(dtype)
    return out


# ----- helpers for tests -----

def device_array(rt: FakeRuntime, host: np.ndarray, dtype: DType, *, stream: int | None = None,
                 device: int | None = None) -> Buffer:
    """A Buffer of fake device memory (on ``device``, the current one by default) holding
    ``host``'s bytes; its ``owner`` keeps it alive."""
    host = np.ascontiguousarray(host)
    block = rt.fabric.mem.alloc(host.nbytes)
    if host.nbytes:
        rt.fabric.mem.view(block.ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)
    return Buffer(block.ptr, host.nbytes, dtype, tuple(host.shape),
                  Device("cuda", rt.get_device() if device is None else device),
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


# ----- arrays from other frameworks -----

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DL_CODES = {"i": 0, "u": 1, "f": 2}


class FakeFrameworkArray:
    """A device array of "another framework" (torch- or JAX-like) in fake memory: it
    exports DLPack (legacy ``dltensor`` capsules) and works on its own non-blocking
    current stream, which gpucoll cannot see. ``__dlpack__(stream=s)`` makes its
    pending work ready on ``s`` as the DLPack standard asks of a producer."""

    def __init__(self, rt: FakeRuntime, host: np.ndarray) -> None:
        self.rt = rt
        self.device = rt.get_device()
        self.stream = FakeStream(rt.fabric, "framework", self.device)  # the framework's current stream
        host = np.ascontiguousarray(host)
        self.dtype = host.dtype
        self.shape = host.shape
        self.block = rt.fabric.mem.alloc(host.nbytes)
        self.ptr = self.block.ptr
        self.nbytes = host.nbytes
        rt.fabric.mem.view(self.ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)
        self._keep: list[Any] = []
        self.handshakes: list[int | None] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None) -> Any:
        if max_version is not None:
            raise TypeError("this producer speaks DLPack 0.8 (no max_version)")
        self.handshakes.append(stream)
        if stream is not None and int(stream) not in (0, 1, 2) and int(stream) in self.rt.fabric.streams:
            ev = self.rt.event(pooled=False, timing=False)
            self.rt.record(ev.ptr, self.stream.ptr)
            self.rt.wait_event(int(stream), ev.ptr)
        shape = (ctypes.c_int64 * len(self.shape))(*self.shape)
        managed = _DLManagedTensor()
        t = managed.dl_tensor
        t.data, t.ndim, t.shape, t.strides, t.byte_offset = self.ptr, len(self.shape), shape, None, 0
        t.device = _DLDevice(2, self.device)
        t.dtype = _DLDataType(_DL_CODES[self.dtype.kind], self.dtype.itemsize * 8, 1)
        self._keep += [shape, managed]
        return _capsule_new(ctypes.addressof(managed), b"dltensor", None)

    def read_later(self) -> "queue.Queue[np.ndarray]":
        """What the framework's next kernel on its own stream reads (no device-wide sync)."""
        out: queue.Queue[np.ndarray] = queue.Queue()
        mem = self.rt.fabric.mem
        self.stream.enqueue(lambda: out.put(mem.view(self.ptr, self.nbytes).view(self.dtype).reshape(self.shape).copy()))
        return out


class FakeStreamArray:
    """A device array published through ``__cuda_array_interface__`` v3 with its own
    producer stream, which it owns: dropping ``stream`` destroys the handle."""

    def __init__(self, rt: FakeRuntime, host: np.ndarray) -> None:
        self.rt = rt
        self.stream: FakeStream | None = FakeStream(rt.fabric, "producer", rt.get_device())
        self.stream_ptr = self.stream.ptr
        self.buf = device_array(rt, host, _dtype_of(host))
        self.dtype = host.dtype

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.buf.shape, "typestr": self.dtype.str, "data": (self.buf.ptr, False),
                "version": 3, "strides": None, "stream": self.stream_ptr}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.buf.device.index)


def _dtype_of(host: np.ndarray) -> DType:
    from gpucoll._buffer import DTYPES
    return DTYPES[host.dtype.name]


# ----- the realistic fake: what each call costs, and device work that takes time -----

_LIBC = ctypes.CDLL(None)
# A C call that takes time with the GIL released, as CuPy's calls into CUDA do: libc's
# memset over a scratch buffer (ctypes releases the GIL around a CDLL call). A thread
# waiting for the GIL takes it meanwhile, and the caller waits to get it back: the
# trade the GPU run showed. The length per microsecond is calibrated once.
_memset = _LIBC.memset
_memset.restype = ctypes.c_void_p
_memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_SCRATCH = ctypes.create_string_buffer(1 << 20)
_SCRATCH_PTR = ctypes.addressof(_SCRATCH)
_lengths: dict[float, int] = {}


def _memset_length(seconds: float) -> int:
    """The memset length whose call takes ``seconds`` more than a 64-byte one here:
    that long in C with the GIL released (calibrated once per value, by bisection on
    the best of several timings: a memset's time is not linear in its length over the
    cache sizes, so no one rate can be extrapolated from)."""
    n = _lengths.get(seconds)
    if n is None:
        def per_call(length: int) -> float:
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    _memset(_SCRATCH_PTR, 0, length)
                best = min(best, (time.perf_counter() - t0) / 200)
            return best
        floor = per_call(64)
        lo, hi = 64, 1 << 20
        while hi - lo > 64:
            mid = (lo + hi) // 2
            if per_call(mid) - floor < seconds:
                lo = mid
            else:
                hi = mid
        n = _lengths[seconds] = lo
    return n


# The Runtime calls that are CUDA runtime or driver calls (cudaGetDevice, cudaEventRecord,
# cudaStreamWaitEvent, cudaEventQuery, cudaStreamIsCapturing, cuCtxGetCurrent, ...): the
# ones the count tests count. current_stream is CuPy's thread-local lookup (its
# cudaGetDevice is made in C, inside it): it costs, and is counted apart ("cupy").
CUDA_CALLS = ("get_device", "set_device", "record", "wait_event", "elapsed_ms", "is_capturing", "query",
              "exchange_capture_mode", "has_context", "memcpy", "alloc", "launch")
NCCL_CALLS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "all_to_all",
              "gather", "scatter", "async_error", "last_error", "premul_sum", "op_destroy")


# Host µs per call measured on an H200 (docs/gpu-verification.md: the first run's
# profile, the diagnosis run's per-call figures, the bare-NCCL rows). A call not named
# here costs ``call_us``. "current_stream" is CuPy's get_current_stream (its cudaGetDevice
# made in C, inside it); "event_create" cudaEventCreate through cupy.cuda.Event.
H200_CALL_US: dict[str, float] = {
    "record": 0.79, "wait_event": 0.79, "query": 0.24, "get_device": 0.07, "is_capturing": 0.17,
    "exchange_capture_mode": 0.50, "event_create": 1.49, "current_stream": 0.13,
}


def _loop_turn() -> float:
    """Seconds of one turn of an empty Python loop here (best of five)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200_000):
            pass
        best = min(best, (time.perf_counter() - t0) / 200_000)
    return best


_REF_TURNS = 2000  # the fit's reference loop, timed next to each round (about 25 µs here)


def _ctypes_floor() -> float:
    """Seconds of a ctypes call of libc's memset over 64 bytes here: the least a call
    that lets the GIL go can cost (0.5-0.6 µs on the 2-core development machine)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(2000):
            _memset(_SCRATCH_PTR, 0, 64)
        best = min(best, (time.perf_counter() - t0) / 2000)
    return best


class CallCosts:
    """The realistic fake's cost model and call counter.

    Every CUDA and NCCL call the backend makes takes its own host time, the H200's
    (``H200_CALL_US``; any other call ``call_us``), and a call long enough to be one
    (longer than a ctypes call here) lets other threads run meanwhile, as a C call
    that releases the GIL does: part of it in a ctypes call to libc's memset (ctypes
    releases the GIL around it: a thread waiting for the GIL takes it there, and the
    caller waits to get it back), the rest in a Python loop of so many turns. Both are
    sized once per call (:meth:`fit`, on the fake's own function of that name) so that
    the call costs its figure in all, the fake's own Python included; no clock is read
    per call (a clock read costs 0.1-0.5 µs here, and a wait on one overshoots). So a
    call costs about its H200 figure here, not more: the layers above the backend,
    Python and CuPy attribute reads, weigh against the calls below as they do on the
    GPU. The fake's own Python per call is kept to a log append and the device clock's
    book-keeping (:meth:`meter`: 0.15-0.25 µs here, where counting into dictionaries
    cost 0.35-0.5 µs), so a call shorter than that (``cudaGetDevice``, CuPy's
    current-stream look-up, ``cudaStreamIsCapturing``, ``cudaEventQuery``: 0.07-0.24 µs
    on the H200) costs at most about 0.1 µs over its figure. Device work takes ``op_us``
    plus its bytes over ``gbps``: an event recorded after it fires only then
    (:class:`TimedRuntime`).

    ``counts[thread ident][kind]`` counts each call by kind ("cuda", "nccl", "cupy",
    "event" for an event made by cudaEventCreate) and by name, per calling thread.

    Args:
        call_us: host microseconds per CUDA or NCCL call not in ``H200_CALL_US`` (0.7:
            an H200's bare ncclAllReduce from Python measured 0.61-0.74 µs). 0 makes
            every call free (count only).
        release_us: of a call, at most this many microseconds in C with the GIL released.
        cupy_us: host microseconds of CuPy's current-stream look-up.
        create_us: host microseconds of cudaEventCreate.
        per_call_us: figures that replace ``H200_CALL_US``'s, by call name.
        op_us: device microseconds of any NCCL op, before its bytes.
        gbps: device bandwidth, GB/s, for an op's bytes.
    """

    def __init__(self, call_us: float = 0.7, *, release_us: float = 0.5, cupy_us: float | None = None,
                 create_us: float | None = None, per_call_us: dict[str, float] | None = None,
                 op_us: float = 5.0, gbps: float = 100.0) -> None:
        table = dict(H200_CALL_US)
        if cupy_us is not None:
            table["current_stream"] = cupy_us
        if create_us is not None:
            table["event_create"] = create_us
        table.update(per_call_us or {})
        free = call_us <= 0
        self.call_s = call_us * 1e-6
        self.seconds: dict[str, float] = {k: 0.0 if free else v * 1e-6 for k, v in table.items()}
        self.cupy_s = self.seconds["current_stream"]
        self.create_s = self.seconds["event_create"]
        self.op_s = op_us * 1e-6
        self.bytes_per_s = gbps * 1e9
        # Calls are counted as names appended to the calling thread's log (a list append
        # costs less than the calls' shortest figures), folded into counts when read.
        self._tls = threading.local()
        self._logs: dict[int, list[str]] = {}
        self._folded: dict[int, dict[str, int]] = {}
        self._kinds: dict[str, str] = {}
        self._cells: dict[str, list[int]] = {}  # by call name: [memset length, loop turns]
        self._release_s = release_us * 1e-6
        self._floor_s = 0.0 if free else _ctypes_floor()
        self._c_lens: dict[int, int] = {}
        # The clock the device's time and the calibration below are read by: the wall
        # clock, or (``use_cpu_clock``) the calling thread's CPU time, so that on a loaded
        # machine a ratio of two rows is the ratio of CPU spent.
        self.now: Callable[[], float] = time.perf_counter
        # A call's time is work, not a wait on a clock: a clock read costs 0.1 µs here
        # (``time.thread_time`` 0.4-0.5 µs), more than the shortest calls' figures, and a
        # wait's last turn overshoots by one read. So each figure gets a plan, made once:
        # a memset with the GIL let go (calls longer than a ctypes call), then a Python
        # loop of so many turns, both shortened by what the call costs around them (the
        # counting, the runtime's own Python), measured on a call of that figure.
        self._turn_s = 0.0 if free else _loop_turn()
        # The fit's reference: an empty loop of ``_REF_TURNS`` turns, the fastest seen.
        self._ref_s = self._turn_s * _REF_TURNS if self._turn_s else float("inf")
        self._fitting: set[str] = set()
        self._fitted: set[str] = set()
        self._meters: dict[str, Callable[[], None]] = {}  # by call name: spend's

    def use_cpu_clock(self) -> None:
        """Read the calling thread's CPU time (``time.thread_time``) from now on."""
        self.now = time.thread_time

    def cost(self, name: str) -> float:
        """Seconds a call named ``name`` takes."""
        return self.seconds.get(name, self.call_s)

    def _split(self, seconds: float) -> tuple[int, int]:
        """A plan for ``seconds`` of work: (memset length or 0, loop turns). The memset
        takes a ctypes call's floor plus up to ``release_us`` more, in steps of 0.05 µs
        (each length calibrated once); the loop the rest."""
        c_len = 0
        if seconds >= self._floor_s + 0.05e-6:
            step = round(min(seconds - self._floor_s, self._release_s) * 2e7)
            c_len = self._c_lens.get(step, 0)
            if not c_len:
                c_len = self._c_lens[step] = _memset_length(step / 2e7) if step > 0 else 64
            seconds -= self._floor_s + step / 2e7
        return c_len, max(int(seconds / self._turn_s), 0) if self._turn_s else 0

    def fit(self, name: str, call: Callable[[], Any], same: tuple[str, ...] = ()) -> None:
        """Make the call named ``name`` cost its figure in all, as ``call()`` (the fake's
        own function of that name, with arguments that change nothing that is measured)
        makes it: the plan's shape is chosen first (a memset, shortened to none while
        the memset alone costs more than the figure), then its loop turns by bisection,
        each plan timed on ``call`` (median of nine rounds), to the turn whose call is
        nearest its figure (a call shorter than its own Python costs that, 0.15-0.25 µs
        here). Its calls are not counted.
        ``same``: calls of the same shape and figure that get the same plan. Once per name."""
        seconds = self.cost(name)
        if not seconds or name in self._fitting or name in self._fitted:
            return
        self._fitting.add(name)
        me = threading.get_ident()
        kept = self.of(me)
        try:
            now = self.now

            def total(plan: tuple[int, int]) -> float:  # a plan's call, all in (median of nine rounds)
                self._set_plan(name, plan)
                for _ in range(100):
                    call()
                rounds, refs = [], []
                for _ in range(9):
                    t0 = now()
                    for _ in range(100):
                        call()
                    t1 = now()
                    for _ in range(_REF_TURNS):
                        pass
                    refs.append(now() - t1)
                    rounds.append((t1 - t0) / 100)
                # Each round at the machine's speed of its moment, read off the reference
                # loop timed next to it, against the fastest the process has seen it.
                self._ref_s = min(self._ref_s, *refs)
                return sorted(t * self._ref_s / r if r > self._ref_s > 0 else t for t, r in zip(rounds, refs))[4]
            # The plan's shape is chosen first, then only its loop turns are fitted. A
            # call's cost jumps by a ctypes call (0.5 µs here) where a plan gains its
            # memset, and by more than the floor timed at start-up (the call in context,
            # its memset's bytes not in cache): a bisection over one "work" spanning both
            # shapes ended at that jump, and the plan it left cost 0.2-0.3 µs under or
            # over the figure depending on the side it landed (the async op, three such
            # calls more than the synchronous one, then measured ~1.4x or ~1.7x of it
            # from one process to the next). Within a shape the cost grows by one loop
            # turn (0.01 µs) per step, so the fit lands within a turn of the figure.
            c_len = 0
            if seconds >= self._floor_s + 0.05e-6:
                c_len = self._split(seconds)[0]
                # the memset's share shrinks (to none) until the memset alone is under the figure
                while c_len and total((c_len, 0)) > seconds:
                    c_len = 64 if c_len > 64 else 0
            turns, hi = 0, max(int(seconds / self._turn_s), 1) if self._turn_s else 0
            if hi and total((c_len, 0)) < seconds:
                lo = 0  # total(lo) < seconds <= total(hi), as far as the timings go
                while total((c_len, hi)) < seconds and hi < 1 << 16:
                    lo, hi = hi, hi * 2
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if total((c_len, mid)) < seconds:
                        lo = mid
                    else:
                        hi = mid
                turns = hi if total((c_len, hi)) - seconds < seconds - total((c_len, lo)) else lo
            plan = (c_len, turns)
            for each in (name, *same):
                self._set_plan(each, plan)
            self._fitted.update((name, *same))
        finally:
            self._fitting.discard(name)
            self._logs.get(me, []).clear()
            self._folded[me] = kept

    def _set_plan(self, name: str, plan: tuple[int, int]) -> None:
        self._cells.setdefault(name, [0, 0])[:] = plan  # (the meters of ``name`` read it per call)

    def _log(self) -> list[str]:
        """The calling thread's log of calls, made on its first call."""
        log: list[str] = []
        self._tls.log = log
        self._logs[threading.get_ident()] = log
        return log

    def meter(self, kind: str, name: str, seconds: float | None = None) -> Callable[[], None]:
        """A function that makes one call of ``kind``/``name``: count it, then take its
        time (``seconds``, default its figure), as its plan says (:meth:`fit` may change
        the plan later). The runtime's functions call it first thing: it costs a log
        append and the plan's work, so the fake's own Python stays under the shortest
        figures' (0.13-0.24 µs) as far as Python allows."""
        self._kinds[name] = kind
        cell = self._cells.get(name)
        if cell is None:  # a call not fitted (yet): its work alone
            seconds = self.cost(name) if seconds is None else seconds
            cell = self._cells[name] = list(self._split(seconds)) if seconds else [0, 0]
        tls, new_log, memset, scratch = self._tls, self._log, _memset, _SCRATCH_PTR

        def charge() -> None:
            try:
                log = tls.log
            except AttributeError:
                log = new_log()
            log.append(name)
            c_len, turns = cell
            if c_len:
                memset(scratch, 0, c_len)
            if turns:
                for _ in range(turns):
                    pass
        return charge

    def spend(self, kind: str, name: str, seconds: float) -> None:
        """One call of ``kind``/``name`` (the calls not made often, through a meter made
        on the name's first call): count it, then take ``seconds`` in all, as the call's
        plan says."""
        charge = self._meters.get(name)
        if charge is None:
            charge = self._meters[name] = self.meter(kind, name, seconds)
        charge()

    @property
    def counts(self) -> dict[int, dict[str, int]]:
        """Calls so far by thread ident, then by kind and by name."""
        for thread, log in list(self._logs.items()):
            n = len(log)
            if not n:
                continue
            names = log[:n]
            del log[:n]  # (one step under the GIL: the owner's later appends stay)
            mine = self._folded.setdefault(thread, {})
            kinds = self._kinds
            for name in names:
                mine[name] = mine.get(name, 0) + 1
                kind = kinds[name]
                mine[kind] = mine.get(kind, 0) + 1
        return self._folded

    def of(self, thread: int | None = None) -> dict[str, int]:
        """The counts of one thread (default: the calling one)."""
        return dict(self.counts.get(threading.get_ident() if thread is None else thread, {}))

    def reset(self) -> None:
        for log in list(self._logs.values()):
            del log[:]
        self._folded.clear()


class _TimedEvent:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _TimedStream:
    def __init__(self, ptr: int, device: int = 0) -> None:
        self.ptr = ptr
        self.device = device

    def __enter__(self) -> _TimedStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _TimedComm:
    """A communicator of one rank whose calls cost ``costs`` and whose ops keep their
    stream busy for the modeled time (data is not moved: the count tests and the bench
    need the costs, the semantic tests use :class:`FakeComm`)."""

    def __init__(self, rt: TimedRuntime, rank: int, size: int) -> None:
        self._rt = rt
        self.rank = rank
        self.size = size
        self.aborted = False
        self.async_code = 0
        scratch = next(rt._handles)  # a stream nothing waits on: the fit's ops keep it busy
        costs = rt.costs
        self._charges = {name: costs.meter("nccl", name, costs.call_s) for name in (
            "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "all_to_all",
            "gather", "scatter")}
        # Fitted on the function gpucoll calls (its frame inside the figure, as the H200's
        # allReduce was timed from a caller's call of CuPy's method), not on ``_op`` below
        # it: fitted there, each NCCL call cost its figure plus this frame, 0.06-0.15 µs.
        rt.costs.fit("all_reduce", lambda: self.all_reduce(0, 0, 0, 7, 0, scratch), same=(
            "reduce", "broadcast", "all_gather", "reduce_scatter", "send", "recv", "all_to_all", "gather", "scatter"))

    def _op(self, name: str, nbytes: int, stream: int) -> None:
        self._charges[name]()
        rt = self._rt
        if not self.aborted:
            rt.busy(stream, rt.costs.op_s + nbytes / rt.costs.bytes_per_s)
        if self.aborted:
            raise FakeError(f"{name} on an aborted communicator")

    def all_reduce(self, s: int, r: int, n: int, dt: int, op: int, stream: int) -> None:
        self._op("all_reduce", n * _ITEMSIZE.get(dt, 4), stream)

    def reduce(self, s: int, r: int, n: int, dt: int, op: int, root: int, stream: int) -> None:
        self._op("reduce", n * _ITEMSIZE.get(dt, 4), stream)

    def broadcast(self, s: int, r: int, n: int, dt: int, root: int, stream: int) -> None:
        self._op("broadcast", n * _ITEMSIZE.get(dt, 4), stream)

    def all_gather(self, s: int, r: int, n: int, dt: int, stream: int) -> None:
        self._op("all_gather", n * _ITEMSIZE.get(dt, 4) * self.size, stream)

    def reduce_scatter(self, s: int, r: int, n: int, dt: int, op: int, stream: int) -> None:
        self._op("reduce_scatter", n * _ITEMSIZE.get(dt, 4) * self.size, stream)

    def send(self, p: int, n: int, dt: int, peer: int, stream: int) -> None:
        self._op("send", n * _ITEMSIZE.get(dt, 4), stream)

    def recv(self, p: int, n: int, dt: int, peer: int, stream: int) -> None:
        self._op("recv", n * _ITEMSIZE.get(dt, 4), stream)

    def async_error(self) -> int:
        self._rt.costs.spend("nccl", "async_error", self._rt.costs.call_s)
        return self.async_code

    def last_error(self) -> str:
        return ""

    def abort(self) -> None:
        self._rt.costs.spend("nccl", "abort", self._rt.costs.call_s)
        self.aborted = True

    def destroy(self) -> None:
        self._rt.costs.spend("nccl", "destroy", self._rt.costs.call_s)
        self.aborted = True


class TimedRuntime:
    """A one-rank Runtime whose every CUDA call costs what ``costs`` says and whose
    device work takes time: each stream is busy until a modeled instant, an event
    recorded on it fires then (``query`` says not ready until that instant), and
    ``wait_event`` makes a stream busy until the event fires. It moves no data.

    The capture state is modeled too (``begin_capture``/``end_capture`` on a stream,
    ``capturing`` the set), and so is the per-thread capture mode: a query from another
    thread in global mode during a global-mode capture invalidates that capture
    (``invalidated`` names why), as on a GPU.
    """

    def __init__(self, costs: CallCosts | None = None, *, features: Features | None = None,
                 exchange_works: bool = True) -> None:
        self.costs = costs or CallCosts()
        self.features = features or Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True)
        self.can_exchange_capture_mode = exchange_works
        self._handles = itertools.count(0x1000)
        self._busy: dict[int, float] = {}
        self._fires: dict[int, float] = {}
        self.capturing: dict[int, tuple[int, str]] = {}   # stream -> (thread, mode)
        self.invalidated: list[str] = []
        self._tls = threading.local()
        self._default = 0x7000
        self._current = self._default
        self.comms: list[_TimedComm] = []
        self._pools: dict[tuple[int, bool], Any] = {}
        c = self.costs
        call = c.call_s
        charge_get_device, charge_set_device, charge_record, charge_wait_event, charge_elapsed_ms, \
            charge_is_capturing, charge_query = (c.meter("cuda", n) for n in (
                "get_device", "set_device", "record", "wait_event", "elapsed_ms", "is_capturing", "query"))
        self._charge_query = charge_query
        self._charge_stream = c.meter("cupy", "current_stream", c.cupy_s)
        busy, fires, perf_counter = self._busy, self._fires, time.perf_counter

        # Bound per instance, as CudaRuntime binds CuPy's functions; each charges its call
        # first thing (CallCosts.meter), then keeps the device's clock.
        def get_device() -> int:
            charge_get_device()
            return 0

        def set_device(device: int) -> None:
            charge_set_device()

        def record(event: int, stream: int) -> None:
            charge_record()
            t = perf_counter()
            b = busy.get(stream, 0.0)
            fires[event] = b if b > t else t

        def wait_event(stream: int, event: int) -> None:
            charge_wait_event()
            f = fires.get(event, 0.0)
            if f > busy.get(stream, 0.0):
                busy[stream] = f

        def elapsed_ms(a: int, b: int) -> float:
            charge_elapsed_ms()
            return max(fires.get(b, 0.0) - fires.get(a, 0.0), 0.0) * 1e3

        def is_capturing(stream: int) -> bool:
            charge_is_capturing()
            return stream in self.capturing

        self.get_device = get_device
        self.set_device = set_device
        self.record = record
        self.wait_event = wait_event
        self.elapsed_ms = elapsed_ms
        self.is_capturing = is_capturing
        self.group_start = lambda: c.spend("nccl", "group_start", call)
        self.group_end = lambda: c.spend("nccl", "group_end", call)
        # Each call's cost fitted to its own Python (CallCosts.fit), on a scratch stream
        # and event nothing else uses.
        stream, event = next(self._handles), next(self._handles)
        for name, fn in (("record", lambda: record(event, stream)), ("wait_event", lambda: wait_event(stream, event)),
                         ("is_capturing", lambda: is_capturing(stream)), ("get_device", get_device),
                         ("query", lambda: self.query(event)), ("current_stream", lambda: self.current_stream_of(0))):
            c.fit(name, fn)

    # -- the device's clock --
    def busy(self, stream: int, seconds: float) -> None:
        """Queue ``seconds`` of device work on ``stream``."""
        self._busy[stream] = max(self._busy.get(stream, 0.0), time.perf_counter()) + seconds

    def stall(self, stream: int) -> None:
        """Work on ``stream`` never finishes (a peer that never joins)."""
        self._busy[stream] = float("inf")

    def finish_all(self) -> None:
        """The device catches up: every event recorded so far has fired."""
        now = time.perf_counter()
        for table in (self._busy, self._fires):  # (in place: the runtime's functions hold them)
            for k, t in list(table.items()):
                if t > now:
                    table[k] = now

    # -- capture --
    def begin_capture(self, stream: int, mode: str = "global") -> None:
        self.capturing[stream] = (threading.get_ident(), mode)

    def end_capture(self, stream: int) -> None:
        del self.capturing[stream]

    def _mode(self) -> int:
        return int(getattr(self._tls, "mode", 0))

    # -- the Runtime protocol --
    def device_count(self) -> int:
        return 1

    def compute_capability(self, device: int) -> tuple[int, int]:
        return (9, 0)

    def has_context(self) -> bool:
        self.costs.spend("cuda", "has_context", self.costs.cost("has_context"))
        return True

    def exchange_capture_mode(self, mode: int) -> int:
        self.costs.spend("cuda", "exchange_capture_mode", self.costs.cost("exchange_capture_mode"))
        if not self.can_exchange_capture_mode:
            return mode  # as CudaRuntime where no exchange call was found
        prev = self._mode()
        self._tls.mode = mode
        return prev

    def current_stream(self) -> int:
        self._charge_stream()
        return self._current

    def current_stream_of(self, device: int) -> int:
        self._charge_stream()
        return self._current

    def set_current_stream(self, ptr: int) -> None:
        self._current = ptr

    stream_of_fixed = True  # (stream_of reads the object's fields and the fixed default stream)

    def stream_of(self, stream: Any, device: int) -> int | None:
        """A CuPy stream object's handle (ptr 0, CuPy's legacy stream: the default one);
        free, as reading a CuPy stream's fields is."""
        if stream.ptr == 0:  # CuPy's null stream (device -1): any device's legacy stream
            return self._default
        return int(stream.ptr) if stream.device_id == device else None

    def new_stream(self, high_priority: bool = False) -> Any:
        return _TimedStream(next(self._handles))

    def event(self, pooled: bool = True, timing: bool = False, device: int = -1) -> Any:
        if not pooled:
            self.costs.spend("event", "event_create", self.costs.create_s)
            return _TimedEvent(next(self._handles))
        # A pooled event through the real runtime's pool (CudaRuntime.event: a dict look-up,
        # the pool's lock, an object that gives the event back when dropped), so that it
        # costs here the Python it costs on a GPU; a new one costs cudaEventCreate's time.
        key = (0 if device < 0 else device, timing)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools.setdefault(key, _runtime_mod._EventPool(self._create_event))
        return pool.acquire()

    def _create_event(self, flags: int) -> int:
        self.costs.spend("event", "event_create", self.costs.create_s)
        return next(self._handles)

    def new_event(self, timing: bool = False) -> int:
        self.costs.spend("event", "event_create", self.costs.create_s)
        return next(self._handles)

    def destroy_event(self, event: int) -> None:
        self._fires.pop(event, None)

    def query(self, event: int) -> bool:
        self._charge_query()
        if self.capturing:
            me = threading.get_ident()
            for thread, mode in self.capturing.values():
                if thread != me and mode == "global" and self._mode() == 0:
                    why = "cudaEventQuery from another thread in global mode during a global-mode capture"
                    self.invalidated.append(why)
                    raise FakeCudaError(CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported", why)
        return time.perf_counter() >= self._fires.get(event, 0.0)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.costs.spend("cuda", "memcpy", self.costs.cost("memcpy"))
        self.busy(stream, nbytes / self.costs.bytes_per_s)

    def alloc(self, nbytes: int, stream: Any) -> tuple[int, Any]:
        self.costs.spend("cuda", "alloc", self.costs.cost("alloc"))
        return 0x100000, object()

    def prepare(self, kernel: str, device: int) -> None:
        pass

    def launch(self, kernel: str, n: int, args: tuple[Any, ...], stream: Any, device: int) -> None:
        self.costs.spend("cuda", "launch", self.costs.cost("launch"))
        self.busy(stream.ptr, self.costs.op_s)

    def unique_id(self) -> bytes:
        return bytes(128)

    def new_comm(self, size: int, uid: bytes, rank: int, config: Any = None) -> Any:
        comm = _TimedComm(self, rank, size)
        self.comms.append(comm)
        return comm

    def check_config(self, config: Any) -> None:
        pass
