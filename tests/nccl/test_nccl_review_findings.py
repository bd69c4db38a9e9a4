"""The ten findings of the NCCL backend's desk review (docs/nccl-backend.md, "What
gpucoll guarantees on a GPU"), each checked on the strict fake GPU: streams and devices,
CUDA-graph capture, abort, timeouts of NCCL's first calls, NCCL_COMM_BLOCKING, event
flags and integer AVG. Each test fails on the code before its fix."""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._backends.nccl.lib import OP_AVG
from gpucoll._reduce_op import ReduceOp
from gpucoll.array import as_buffer
from gpucoll.errors import BackendUnavailableError, DistBackendError
from gpucoll.store import HashStore, PrefixStore

from _nccl_fake import FakeFabric, FakeFrameworkArray, FakeRuntime, FakeStreamArray, read, read_on_stream
from _reference import reference
from _fake_gpu_world import dev, run_groups, run_world


def _in_thread(fn: Any) -> Any:
    """Run ``fn`` on a fresh thread (as the group's watchdog does) and return its result."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)
    t = threading.Thread(target=run, name="watchdog-like")
    t.start()
    t.join(30)
    assert not t.is_alive(), "the thread hung"
    if errors:
        raise errors[0]
    return out[0]


# ---------------------------------------------------------------- 1. temporaries' device

def test_list_outputs_and_kernel_reductions_on_a_gpu_other_than_0() -> None:
    """The communicator is on cuda:1 while the calling thread's current device is 0:
    temporaries (list outputs, kernel-path reductions) must be made on cuda:1."""
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        size, n = be.size, 3
        rt.set_device(0)  # the script works on GPU 0 too; the group's communicator is on GPU 1
        mine = np.arange(n, dtype=np.float32) + 10 * rank
        outs = [dev(rt, np.zeros(n, np.float32), device=1) for _ in range(size)]
        be.all_gather(outs, dev(rt, mine, device=1)).synchronize()
        assert [read(rt, o, np.float32).tolist() for o in outs] == [
            (np.arange(n, dtype=np.float32) + 10 * r).tolist() for r in range(size)]
        out = dev(rt, np.zeros(n, np.float32), device=1)
        be.reduce_scatter(out, [dev(rt, np.full(n, rank + j, np.float32), device=1) for j in range(size)],
                          ReduceOp.SUM).synchronize()
        assert read(rt, out, np.float32).tolist() == [float(sum(r + rank for r in range(size)))] * n
        x = dev(rt, np.array([1 << rank, 3, 5], np.int16), device=1)
        be.all_reduce(x, ReduceOp.BXOR).synchronize()  # no 16-bit ints in NCCL: a gpucoll kernel
        assert read(rt, x, np.int16)[0] == np.bitwise_xor.reduce([1 << r for r in range(size)])
        assert rt.get_device() == 0  # the caller's device is left as it was
    run_world(3, body, devices=2, device_of=lambda r: 1)


# ---------------------------------------------------------------- 2. no context on GPU 0

def test_watchdog_threads_make_no_cuda_context_on_gpu_0() -> None:
    """Polling, completing, synchronising and aborting from a fresh thread (the group's
    watchdog) must not make a CUDA context on GPU 0 when no rank uses GPU 0."""
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        work = be.all_reduce(dev(rt, np.ones(4, np.float32)), ReduceOp.SUM)
        _in_thread(be.poll_pending)
        _in_thread(work.synchronize)
        assert _in_thread(work.is_completed)
        later = be.all_reduce(dev(rt, np.ones(4, np.float32)), ReduceOp.SUM)
        _in_thread(lambda: later.wait(timeout=10))
        assert 0 not in rt.fabric.contexts, rt.fabric.context_threads
    run_world(2, body, devices=2, device_of=lambda r: 1, use_device=True, strict_contexts=True)


# ---------------------------------------------------------------- 3. a framework's side stream

def test_in_place_op_on_another_frameworks_stream_is_ordered_before_its_next_kernel() -> None:
    """A torch/JAX-like array on its framework's own non-blocking stream, which gpucoll
    cannot see: after wait(), the framework's next kernel on that stream reads the
    result, with no device-wide synchronise."""
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        x = FakeFrameworkArray(rt, np.full(4, rank + 1.0, np.float32))
        work = be.all_reduce(as_buffer(x, writable=True), ReduceOp.SUM)
        work.wait()
        assert x.read_later().get(timeout=10).tolist() == [6.0] * 4
    run_world(3, body, op_delay=0.3)


# ---------------------------------------------------------------- 4. capture in global mode

def test_watchdog_polling_during_a_global_mode_capture_does_not_break_it() -> None:
    """torch's default capture mode is global: the watchdog's event queries from another
    thread must not invalidate the capture (nor abort the communicator), and what a
    capture issues first (a kernel compile, a temporary) must not either."""
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        be.all_reduce(dev(rt, np.ones(1, np.float32)), ReduceOp.SUM).synchronize()  # connected
        running = be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM)  # still running (op_delay)
        x = dev(rt, np.array([1 << rank, 0], np.int16))
        rt.begin_capture(mode="global")
        be.all_reduce(x, ReduceOp.BXOR)  # first use of this kernel: compiled, with a temporary
        stop = threading.Event()

        def watchdog() -> int:
            polls = 0
            while not stop.is_set():
                be.poll_pending()
                polls += 1
                time.sleep(0.01)
            return polls
        polled: list[int] = []
        t = threading.Thread(target=lambda: polled.append(watchdog()))
        t.start()
        time.sleep(0.1)
        stop.set()
        t.join(10)
        graph = rt.end_capture()  # raises cudaErrorStreamCaptureInvalidated if a query broke it
        assert polled and polled[0] > 0
        assert be.ending.aborted is None
        graph.launch(rt.current_stream())
        assert read_on_stream(rt, x, np.int16).get(timeout=10).tolist() == [7, 0]
        running.synchronize()
    run_world(3, body, op_delay=0.3)


def test_a_communicator_is_never_created_inside_a_capture() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        rt.begin_capture(mode="global")
        with pytest.raises(DistBackendError, match="capture"):
            be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM)
        rt.end_capture()  # not invalidated: nothing was attempted inside it
    run_world(2, body, eager=False)


# ---------------------------------------------------------------- 5. abort vs an issuing thread

def test_abort_from_another_thread_never_frees_a_communicator_under_a_call() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        be.all_reduce(dev(rt, np.ones(1, np.float32)), ReduceOp.SUM).synchronize()  # connected
        rt.call_delay = 0.3  # the next NCCL call stays on the host a while (enqueueing)
        t = threading.Timer(0.1, lambda: be.abort("the watchdog timed out"))
        t.start()
        with pytest.raises(DistBackendError, match="watchdog timed out"):
            # fails when issued (the abort landed during its NCCL call) or when waited on
            be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM).synchronize()
        t.join(10)
        assert be.comm_slot.gone  # the issuing thread aborted the communicator once its call returned
        with pytest.raises(DistBackendError, match="watchdog timed out"):
            be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM).wait()
    run_world(2, body)


def test_abort_during_a_split_is_carried_out_after_it() -> None:
    """ncclCommSplit is a call on the parent too: an abort from another thread during it
    waits for it (and the parent is aborted right after)."""
    shared = HashStore(timeout=10.0)

    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        rt.call_delay = 0.3  # the split stays inside NCCL a while
        t = threading.Timer(0.1, lambda: be.abort("the watchdog timed out"))
        t.start()
        sub = be.split([0, 1], store=PrefixStore("pg/sub", shared), group_name="sub", timeout=5.0)
        t.join(10)
        assert sub is not None and be.comm_slot.gone
        sub.shutdown()
    run_world(2, body)


# ---------------------------------------------------------------- 6. first calls time out

def test_first_collective_and_first_p2p_without_a_peer_time_out() -> None:
    """NCCL connects inside the first collective (and the first send/recv with each
    peer), blocking the host until the peers call in: a peer that never does must
    fail the call within the group's timeout, not hang it."""
    for first in ("all_reduce", "send"):
        done = threading.Event()

        def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
            if rank == 2:
                done.wait(30)  # never calls
                return
            t0 = time.monotonic()
            if first == "send" and rank == 1:  # p2p connects pairwise: rank 1 is not needed
                return
            with pytest.raises(DistBackendError, match=r"rank 2 .* within 1 s"):
                if first == "all_reduce":
                    be.all_reduce(dev(rt, np.ones(2, np.float32)), ReduceOp.SUM).wait()
                else:
                    be.send(dev(rt, np.ones(2, np.float32)), 2, 0).wait()
            took = time.monotonic() - t0
            with pytest.raises(DistBackendError, match=r"rank 2 .* within 1 s"):  # aborted since
                be.broadcast(dev(rt, np.ones(2, np.float32)), 0).wait()
            if rank == 0:
                done.set()
            assert took < 3.5, f"{first}: {took:.1f} s"
        run_world(3, body, timeout=1.0, hang=4.0, shutdown=False)


# ---------------------------------------------------------------- 7. NCCL_COMM_BLOCKING=0

def test_nccl_comm_blocking_0_is_refused_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    fabric = FakeFabric(hang_limit=5.0)
    rt = FakeRuntime(fabric)
    try:
        with pytest.raises(BackendUnavailableError, match="NCCL_COMM_BLOCKING=0"):
            NCCLBackend(PrefixStore("pg/g", HashStore(timeout=5.0)), 0, 1, timeout=5.0, group_name="g",
                        device_id=0, _runtime=rt)
    finally:
        fabric.close()


def test_the_config_hint_does_not_suggest_nccl_comm_blocking() -> None:
    from gpucoll._backends.nccl.runtime import cupy_config

    lib = SimpleNamespace(nccl=SimpleNamespace(), cupy=SimpleNamespace(__version__="14.2.0"))
    with pytest.raises(BackendUnavailableError) as info:
        cupy_config(lib, {"max_ctas": 8})  # type: ignore[arg-type]
    assert "NCCL_MAX_CTAS" in str(info.value) and "NCCL_COMM_BLOCKING" not in str(info.value)


# ---------------------------------------------------------------- 8. a producer stream that is gone

def test_wait_after_the_producers_stream_was_destroyed() -> None:
    """An array published with its producer's stream (CAI v3), whose owner drops the
    stream before wait(): wait() must not touch the dead handle, and still order."""
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        x = FakeStreamArray(rt, np.full(3, rank + 1.0, np.float32))
        inp = FakeStreamArray(rt, np.full(3, 2.0 * rank, np.float32))
        work = be.all_reduce(as_buffer(x, writable=True), ReduceOp.SUM)
        out = dev(rt, np.zeros(3, np.float32))
        into = be.all_reduce_into(out, as_buffer(inp), ReduceOp.SUM)
        x.stream = inp.stream = None  # the producers destroy their streams
        gc.collect()
        with pytest.raises(Exception, match="does not exist"):
            rt.fabric.stream(x.stream_ptr)
        work.wait()
        into.wait()
        assert read_on_stream(rt, x.buf, np.float32).get(timeout=10).tolist() == [3.0] * 3
        assert read_on_stream(rt, out, np.float32).get(timeout=10).tolist() == [2.0] * 3
    run_world(2, body, op_delay=0.2)


# ---------------------------------------------------------------- 9. events without timing

def test_ops_record_events_without_timing_unless_a_hook_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        x = dev(rt, np.ones(4, np.float32))
        be = pg._nccl
        for _ in range(3):
            be.all_reduce(x, ReduceOp.SUM).synchronize()
        assert rt.timing_events == 0, "events with timing on ops no hook times"
        infos: list[Any] = []
        pg.register_on_completion_hook(infos.append)
        be.all_reduce(x, ReduceOp.SUM).synchronize()
        assert rt.timing_events >= 1  # a hook reads active_duration: now the events time
    run_groups(2, body, monkeypatch)


# ---------------------------------------------------------------- 10. integer AVG

def test_integer_avg_is_ncclavg_truncating_toward_zero() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        size = be.size
        ins = [np.array([-7, 7, -1, 1, 2 ** 31 - 1 - r, -(2 ** 31) + r, 5 * r - 4], np.int32) for r in range(size)]
        x = dev(rt, ins[rank])
        before = list(rt.kernels_launched)
        be.all_reduce(x, ReduceOp.AVG).synchronize()
        got = read(rt, x, np.int32)
        assert got.tolist() == reference(ins, "int32", ReduceOp.AVG, size).tolist()
        assert rt.kernels_launched == before, "integer AVG ran a gpucoll kernel"
        assert be._comm.calls[-1][0] == "all_reduce" and be._comm.calls[-1][5] == OP_AVG
        u = dev(rt, np.array([5, 7, 255], np.uint8) + rank)
        be.all_reduce(u, ReduceOp.AVG).synchronize()
        assert read(rt, u, np.uint8).tolist() == reference(
            [np.array([5, 7, 255], np.uint8) + r for r in range(size)], "uint8", ReduceOp.AVG, size).tolist()
    run_world(3, body)
