"""What one op costs the host on the NCCL path, counted on the realistic fake GPU
(tests/_nccl_fake.py: ``CallCosts``, ``TimedRuntime``): the CUDA and NCCL calls the
issuing thread makes per op in steady state, the watchdog's wake-ups, its event
queries during another thread's CUDA graph capture, and a collective that one rank
never joins, bounded in time.

The counts are the calls a real GPU run pays for (0.7-1.5 µs each on an H200, more
when they hand the GIL to another thread); the timings are the bench's
(bench/nccl_python_overhead_bench.py --realistic), never a test's.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from gpucoll._backends.nccl import hot as _hot
from gpucoll._backends.nccl import runtime as _runtime
from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._group import ProcessGroup
from gpucoll._group import registry as _registry
from gpucoll._group.watchdog import Watchdog
from gpucoll._work import WorkInfo
from gpucoll.errors import DistBackendError
from gpucoll.store import HashStore, PrefixStore

from _nccl_fake import CallCosts, FakeRuntime, TimedRuntime
from _fake_gpu_world import FakeDeviceArray, run_groups

_OPS = 1000  # ops counted, after a warm-up


class _Array:
    """A 1 KiB float32 device array on the caller's stream (CAI v3, legacy default stream)."""

    class _Device:
        id = 0

    device = _Device()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (256,), "typestr": "<f4", "data": (0x200000, False), "version": 3,
                "strides": None, "stream": 1}


def _one_rank_group(monkeypatch: pytest.MonkeyPatch, rt: TimedRuntime, timeout: float) -> ProcessGroup:
    """A one-rank group whose NCCL backend runs on ``rt``."""
    def make(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
             device_id: int | None) -> NCCLBackend:
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=rt)
    monkeypatch.setitem(_registry.BACKENDS, "nccl", make)
    return ProcessGroup(PrefixStore("pg", HashStore()), 0, 1, group_name="g", global_ranks=[0], timeout=timeout,
                        backend="nccl", device_id=0)


@pytest.fixture
def timed_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ProcessGroup, TimedRuntime]]:
    """A one-rank group whose NCCL backend runs on the realistic fake GPU (calls counted,
    at no cost: the counts are what is checked)."""
    rt = TimedRuntime(CallCosts(0.0, op_us=5.0))

    pg = _one_rank_group(monkeypatch, rt, 60.0)
    try:
        yield pg, rt
    finally:
        rt.finish_all()
        pg._destroy()


def _steady(call: Any, rt: TimedRuntime) -> dict[str, int]:
    """The calling thread's calls over _OPS calls of ``call``, after a warm-up (long enough
    for the event pool to hold as many events as ops are ever outstanding)."""
    for _ in range(3 * _hot.PRUNE_AT):
        call()
    rt.costs.reset()
    for _ in range(_OPS):
        call()
    return rt.costs.of()


def test_a_synchronous_all_reduce_is_one_nccl_call_and_two_cuda_calls(
        timed_group: tuple[ProcessGroup, TimedRuntime]) -> None:
    pg, rt = timed_group
    x = _Array()
    mine = _steady(lambda: pg.all_reduce(x), rt)
    # The NCCL call itself, and no other NCCL call (no async-error query per op).
    assert mine.get("nccl", 0) == _OPS, mine
    assert mine.get("all_reduce", 0) == _OPS, mine
    # Per op: cudaStreamIsCapturing on the caller's stream and the end event's record;
    # no cudaGetDevice, no stream wait, no event made. Completing finished ops in
    # batches adds one event query (and the capture-mode exchange around it) per
    # PRUNE_AT ops, amortised.
    assert mine.get("is_capturing", 0) == _OPS, mine
    assert mine.get("record", 0) == _OPS, mine
    assert mine.get("get_device", 0) == 0 and mine.get("wait_event", 0) == 0, mine
    assert mine.get("event", 0) == 0, mine  # every event from the pool
    batches = _OPS // _hot.PRUNE_AT + 1
    assert mine.get("query", 0) <= 2 * batches, mine
    assert mine.get("cuda", 0) <= 2 * _OPS + 4 * batches, mine
    # The op's result is still ordered on the caller's stream: its end event was
    # recorded there, after the NCCL call on that stream.
    assert rt.comms[0].aborted is False


def _async_and_wait_calls(monkeypatch: pytest.MonkeyPatch, caller_stream_max: str | None) -> dict[str, int]:
    """Calls per steady-state ``all_reduce(x, async_op=True).wait()`` of a one-rank group made
    with GPUCOLL_NCCL_CALLER_STREAM_MAX set to ``caller_stream_max`` (None: unset, the default)."""
    if caller_stream_max is None:
        monkeypatch.delenv("GPUCOLL_NCCL_CALLER_STREAM_MAX", raising=False)
    else:
        monkeypatch.setenv("GPUCOLL_NCCL_CALLER_STREAM_MAX", caller_stream_max)
    rt = TimedRuntime(CallCosts(0.0, op_us=5.0))
    pg = _one_rank_group(monkeypatch, rt, 60.0)
    try:
        x = _Array()

        def op() -> None:
            work = pg.all_reduce(x, async_op=True)
            assert work is not None
            work.wait()
        return _steady(op, rt)
    finally:
        rt.finish_all()
        pg._destroy()


def test_a_small_async_all_reduce_and_its_wait_make_one_nccl_call_and_two_cuda_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _async_and_wait_calls(monkeypatch, "65536")  # the opt-in (default 0)
    assert mine.get("nccl", 0) == _OPS, mine
    # 1 KiB, up to GPUCOLL_NCCL_CALLER_STREAM_MAX: issued on the caller's stream, so the
    # capture check and end's record; wait() on that same stream adds nothing. No
    # cudaGetDevice, no event made.
    assert mine.get("get_device", 0) == 0 and mine.get("event", 0) == 0, mine
    assert mine.get("record", 0) == _OPS and mine.get("wait_event", 0) == 0, mine
    # Works are completed in batches of PRUNE_WORKS_AT: one query, and the mode
    # exchange around it, per batch.
    batches = _OPS // _hot.PRUNE_WORKS_AT + 1
    assert mine.get("cuda", 0) <= 2 * _OPS + 4 * batches, mine


def test_an_async_all_reduce_on_the_communication_stream_makes_five_cuda_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _async_and_wait_calls(monkeypatch, None)  # the default: torch's scheduling
    assert mine.get("nccl", 0) == _OPS, mine
    # The capture check, ready's record, the communication stream's wait on it, end's
    # record, and wait(): the caller's stream waits on end. No cudaGetDevice.
    assert mine.get("get_device", 0) == 0, mine
    assert mine.get("record", 0) == 2 * _OPS and mine.get("wait_event", 0) == 2 * _OPS, mine
    batches = _OPS // _hot.PRUNE_WORKS_AT + 1
    assert mine.get("cuda", 0) <= 5 * _OPS + 4 * batches, mine


def test_the_watchdog_is_not_woken_per_op(timed_group: tuple[ProcessGroup, TimedRuntime],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pg, rt = timed_group
    looks: list[float] = []
    poll = Watchdog._poll

    def counted(self: Watchdog) -> None:
        looks.append(time.perf_counter())
        poll(self)
    monkeypatch.setattr(Watchdog, "_poll", counted)
    x = _Array()
    for _ in range(300):
        pg.all_reduce(x)
    time.sleep(0.05)
    looks.clear()
    rt.costs.reset()
    t0 = time.perf_counter()
    for _ in range(_OPS):
        pg.all_reduce(x)
    took = time.perf_counter() - t0
    during = [t for t in looks if t <= t0 + took]
    # At most one look per 1,000 ops, and only if the loop outlasted the watchdog's tick
    # (a second per minute of timeout, at most: this group's is 60 s).
    assert len(during) <= max(1, int(took / 1.0) + 1), (len(during), took)
    # Nor does it query NCCL or CUDA per op.
    others = {t: c for t, c in rt.costs.counts.items() if t != threading.get_ident()}
    assert sum(c.get("nccl", 0) + c.get("cuda", 0) for c in others.values()) <= 10, others


def test_the_watchdogs_queries_never_break_another_threads_global_mode_capture(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, another thread's cudaEventQuery during a global-mode capture invalidates
    that capture, unless the querying thread is in thread-local (or relaxed) mode. The
    watchdog's thread sets its mode once, at its first look, and queries freely after."""
    rt = TimedRuntime(CallCosts(0.0, op_us=200_000.0))  # each op keeps the "GPU" busy 0.2 s

    pg = _one_rank_group(monkeypatch, rt, 1.0)
    looks: list[int] = []
    poll = Watchdog._poll

    def counted(self: Watchdog) -> None:
        looks.append(1)
        poll(self)
    monkeypatch.setattr(Watchdog, "_poll", counted)
    try:
        x = _Array()
        pg.all_reduce(x)
        pg.all_reduce(x)  # outstanding for a while: the watchdog queries their events
        capture_stream = 0x9999
        captured = threading.Event()
        done = threading.Event()

        def capture() -> None:
            rt.begin_capture(capture_stream, "global")
            captured.set()
            done.wait(10.0)
            rt.end_capture(capture_stream)
        t = threading.Thread(target=capture)
        t.start()
        captured.wait(5.0)
        seen = len(looks)
        deadline = time.monotonic() + 5.0
        while len(looks) < seen + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        done.set()
        t.join(10.0)
        assert len(looks) >= seen + 3, "the watchdog did not look during the capture"
        assert rt.invalidated == [], rt.invalidated
    finally:
        rt.finish_all()
        pg._destroy()


def test_the_capture_mode_exchange_is_found_where_no_cuda_runtime_library_is_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy 14 for CUDA 13 loads no libcudart.so: the exchange must come from the driver
    (libcuda.so.1, cuThreadExchangeStreamCaptureMode), which is loaded wherever CUDA works."""
    from gpucoll._backends.nccl import lib as _lib

    modes = {"mode": 0}
    opened: list[str] = []

    class DriverCall:
        argtypes: Any = None
        restype: Any = None

        def __call__(self, ptr: Any) -> int:
            value = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int)).contents
            modes["mode"], value.value = value.value, modes["mode"]
            return 0

    class Library:
        def __init__(self, path: str) -> None:
            opened.append(path)
            if "libcuda.so" not in path:
                raise OSError(f"{path}: cannot open shared object file")
            self.cuThreadExchangeStreamCaptureMode = DriverCall()

    monkeypatch.setattr(_lib, "loaded_library_path",
                        lambda fragment="libnccl.so": "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
                        if fragment == "libcuda.so" else None)
    monkeypatch.setattr(ctypes, "CDLL", Library)
    fn = _runtime._capture_mode_exchanger()
    assert fn is not None, f"no exchange found (libraries tried: {opened})"
    rt = _runtime.CudaRuntime.__new__(_runtime.CudaRuntime)
    rt._exchange_mode = fn
    rt._error = RuntimeError
    assert rt.can_exchange_capture_mode
    assert rt.exchange_capture_mode(_runtime.CAPTURE_THREAD_LOCAL) == _runtime.CAPTURE_GLOBAL
    assert modes["mode"] == _runtime.CAPTURE_THREAD_LOCAL


def test_a_collective_one_rank_never_joins_fails_and_every_rank_finishes_in_bounded_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/gpu/test_nccl_gpu.py::test_watchdog_aborts_a_collective_that_one_rank_never_joins
    on the fake GPU: rank 0's async all_reduce is never joined by rank 1; the watchdog
    times it out (group timeout 1 s), aborts, later ops fail at once, and both ranks
    destroy their group without waiting for anything more."""
    shared = HashStore()
    timeout = 1.0

    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        x = FakeDeviceArray(rt, np.ones(1 << 10, np.float32))
        pg.all_reduce(x)
        out: dict[str, Any] = {}
        if rank == 0:
            work = pg.all_reduce(x, async_op=True)  # rank 1 never joins this one
            t0 = time.monotonic()
            with pytest.raises(DistBackendError) as first:
                work.wait(timeout=60.0)
            out["after_s"] = time.monotonic() - t0
            out["first"] = str(first.value)
            t1 = time.monotonic()
            with pytest.raises(DistBackendError) as later:
                pg.all_reduce(x)
            out["later_s"] = time.monotonic() - t1
            out["later"] = str(later.value)
            shared.set("done", "1")
        else:
            shared.wait(["done"], 30.0)
        t2 = time.monotonic()
        pg._destroy()
        out["destroy_s"] = time.monotonic() - t2
        return out
    t0 = time.monotonic()
    outs = run_groups(2, body, monkeypatch, timeout=timeout)
    total = time.monotonic() - t0
    first = outs[0]
    assert "did not complete within the group's timeout" in first["first"], first
    assert timeout * 0.9 <= first["after_s"] < timeout + 2.0, first
    assert first["later_s"] < 1.0 and "did not complete" in first["later"], first
    assert all(o["destroy_s"] < 2.0 for o in outs), outs
    assert total < 10.0, (total, outs)


def test_a_hook_still_fires_soon_after_its_op_completes(timed_group: tuple[ProcessGroup, TimedRuntime]) -> None:
    """The watchdog's tick is a second here (a 60 s timeout), but an op a hook waits for
    switches it to 5 ms polling: the hook fires within a fraction of the tick."""
    pg, rt = timed_group
    x = _Array()
    pg.all_reduce(x)
    fired: list[float] = []

    def hook(info: WorkInfo) -> None:
        fired.append(time.perf_counter())
    pg.register_on_completion_hook(hook)
    time.sleep(1.2)  # the thread is asleep for a whole tick now
    t0 = time.perf_counter()
    work = pg.all_reduce(x, async_op=True)
    assert work is not None
    work.wait()
    deadline = time.monotonic() + 5.0
    while not fired and time.monotonic() < deadline:
        time.sleep(0.005)
    assert fired, "the hook never fired"
    assert fired[0] - t0 < 0.5, fired[0] - t0


@pytest.mark.parametrize("name", ["record", "event_create"])
def test_the_fit_lands_within_a_loop_turn_of_the_figure_while_the_machine_changes_speed(name: str) -> None:
    """``CallCosts.fit`` on a modelled call: 0.2 µs of its own Python, a memset plan
    0.8 µs more (a ctypes call, above the 0.5 µs floor timed at start-up) plus its
    bytes, 0.012 µs a loop turn; the machine runs at full speed during one timing and
    at half speed during the next. The fitted plan must cost its figure at full speed
    within about a loop turn. A fit across both plan shapes at once ends at the jump
    where the memset comes in (0.04 µs under or 0.21 µs over for a record), and a fit
    that takes a half-speed timing at face value keeps too few turns."""
    turn, floor, ref_turns = 0.012e-6, 0.5e-6, 2000
    costs = CallCosts(0.7)
    costs._floor_s, costs._turn_s, costs._ref_s = floor, turn, ref_turns * turn
    costs._c_lens.update({step: 1000 * step if step else 64 for step in range(11)})  # no memset timed

    def modelled(plan: list[int]) -> float:
        c_len, turns = plan
        return 0.2e-6 + (0.8e-6 + c_len * 1e-11 if c_len else 0.0) + turns * turn

    state = {"t": 0.0, "reads": 0, "slow": 1.0}

    def now() -> float:
        state["reads"] += 1
        if state["reads"] % 3 == 0:  # the read after the reference loop: its turns at this speed
            state["t"] += ref_turns * turn * state["slow"]
            if state["reads"] % 27 == 0:  # a timing (nine rounds) done: the next runs at the other speed
                state["slow"] = 3.0 - state["slow"]
        return state["t"]

    def call() -> None:
        state["t"] += modelled(costs._cells[name]) * state["slow"]

    costs.now = now
    costs.fit(name, call)
    figure = costs.cost(name)
    assert abs(modelled(costs._cells[name]) - figure) <= 1.5 * turn, (name, costs._cells[name], figure)
