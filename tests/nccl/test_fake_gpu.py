"""The fake GPU itself (tests/_nccl_fake.py) is as strict as CUDA, CuPy and NCCL where
the NCCL backend's correctness depends on it: each rule below is one the real stack
enforces, and a fake that let it pass would hide a defect from the suite."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._reduce_op import ReduceOp

from _nccl_fake import (CAPTURE_INVALIDATED, CAPTURE_ISOLATION, CAPTURE_UNJOINED, CAPTURE_UNSUPPORTED,
                        FakeComm, FakeCudaError, FakeError, FakeFabric, FakeRuntime, read)
from _fake_gpu_world import dev, run_world


@pytest.fixture
def rt() -> FakeRuntime:
    fabric = FakeFabric(hang_limit=5.0)
    runtime = FakeRuntime(fabric, devices=2)
    yield runtime
    fabric.close()


def _other_thread(fn) -> BaseException | None:  # type: ignore[no-untyped-def]
    caught: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            caught.append(exc)
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return caught[0] if caught else None


def test_devices_contexts_and_stream_lifetimes(rt: FakeRuntime) -> None:
    fabric = rt.fabric
    assert _other_thread(lambda: None) is None and rt.get_device() == 0
    rt.set_device(1)
    s1 = rt.new_stream()
    rt.set_device(0)
    with pytest.raises(RuntimeError, match=r"stream is created on \(1\) does not match with the current device \(0\)"):
        with s1:
            pass
    ev = rt.event()  # on cuda:0
    with pytest.raises(FakeCudaError, match="same device|cuda:0 recorded on a stream of cuda:1"):
        rt.record(ev.ptr, s1.ptr)
    # a fresh thread's device is 0 without a context; its first runtime call makes one
    assert _other_thread(lambda: rt.get_device()) is None
    strict = FakeFabric(hang_limit=5.0, gpus={1})
    try:
        strict_rt = FakeRuntime(strict, devices=2)
        err = _other_thread(lambda: strict_rt.event())
        assert isinstance(err, FakeError) and "cuda:0, a device no rank uses" in str(err)
        assert _other_thread(lambda: (strict_rt.set_device(1), strict_rt.event())) is None
    finally:
        strict.close()
    # a stream handle dies with its owner
    ptr = s1.ptr
    del s1
    gc.collect()
    with pytest.raises(FakeCudaError, match="does not exist") as info:
        fabric.stream(ptr)
    assert info.value.status == 400


def test_capture_modes_error_900_and_graph_replay(rt: FakeRuntime) -> None:
    side = rt.new_stream()
    done = rt.event()
    rt.record(done.ptr, side.ptr)
    rt.begin_capture(mode="global")
    # another thread in global mode: a query is prohibited and invalidates the capture
    err = _other_thread(lambda: rt.query(done.ptr))
    assert isinstance(err, FakeCudaError) and err.status == CAPTURE_UNSUPPORTED
    with pytest.raises(FakeCudaError) as info:
        rt.end_capture()
    assert info.value.status == CAPTURE_INVALIDATED
    rt.fabric.errors.clear()
    # thread-local mode on the other thread: allowed; relaxed on the capturing one too
    rt.begin_capture(mode="global")

    def local_query() -> None:
        prev = rt.exchange_capture_mode(1)
        try:
            rt.query(done.ptr)
        finally:
            rt.exchange_capture_mode(prev)
    assert _other_thread(local_query) is None
    with pytest.raises(FakeCudaError):
        rt.alloc(16, rt.fabric.stream(rt.current_stream()))  # own capture, global mode
    rt.fabric.errors.clear()
    with pytest.raises(FakeCudaError):
        rt.end_capture()  # that alloc invalidated it
    rt.begin_capture(mode="thread_local")
    prev = rt.exchange_capture_mode(2)
    rt.alloc(16, rt.fabric.stream(rt.current_stream()))  # relaxed: allowed
    rt.exchange_capture_mode(prev)
    # a capturing stream may not wait on an event recorded outside the capture
    with pytest.raises(FakeCudaError) as info:
        rt.wait_event(rt.current_stream(), done.ptr)
    assert info.value.status == CAPTURE_ISOLATION
    with pytest.raises(FakeCudaError):
        rt.end_capture()
    # a fork must be joined back; captured work runs only at launch
    rt.begin_capture()
    fork = rt.event(pooled=False)
    rt.record(fork.ptr, rt.current_stream())
    rt.wait_event(side.ptr, fork.ptr)  # side joins the capture
    hits: list[int] = []
    side.enqueue(lambda: hits.append(1))
    with pytest.raises(FakeCudaError) as info:
        rt.end_capture()
    assert info.value.status == CAPTURE_UNJOINED
    rt.begin_capture()
    rt.record(fork.ptr, rt.current_stream())
    rt.wait_event(side.ptr, fork.ptr)
    side.enqueue(lambda: hits.append(2))
    join = rt.event(pooled=False)
    rt.record(join.ptr, side.ptr)
    rt.wait_event(rt.current_stream(), join.ptr)
    graph = rt.end_capture()
    assert not rt.is_capturing(side.ptr)
    marker = rt.event()
    rt.record(marker.ptr, rt.current_stream())
    while not rt.query(marker.ptr):
        pass
    assert hits == []  # nothing ran at capture
    graph.launch(rt.current_stream())
    graph.launch(rt.current_stream())
    rt.record(marker.ptr, rt.current_stream())
    while not rt.query(marker.ptr):
        pass
    assert hits == [2, 2]


def test_nccl_host_rules_rendezvous_threads_blocking_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        # fp16 rounds after every step, as NCCL's __hadd does: 2048 + 1 -> 2048, twice
        h = dev(rt, np.array([2048.0 if rank == 0 else 1.0], np.float16))
        be.all_reduce(h, ReduceOp.SUM).synchronize()
        assert read(rt, h, np.float16).tolist() == [2048.0]
    run_world(3, body)

    # a second thread inside a call on the same communicator is detected, and so is an
    # abort during a call
    fabric = FakeFabric(hang_limit=5.0)
    try:
        comm = FakeComm(FakeRuntime(fabric), fabric.world(b"w" * 128, 1), 0)
        comm.enter("ncclAllReduce")
        try:
            err = _other_thread(lambda: comm.enter("ncclBroadcast"))
            abort_err = _other_thread(comm.abort)
        finally:
            comm.leave()
        assert isinstance(err, FakeError) and "another thread is inside" in str(err)
        assert isinstance(abort_err, FakeError) and "ncclCommAbort while" in str(abort_err)
        assert len(fabric.errors) == 2
    finally:
        fabric.close()

    # head-to-head sends above the eager size deadlock (and are reported), below do not
    for n, stuck in ((16, False), (4096, True)):
        def p2p(be: NCCLBackend, rt: FakeRuntime, rank: int, n: int = n, stuck: bool = stuck) -> bool:
            peer = 1 - rank
            send = be.send(dev(rt, np.ones(n, np.float32)), peer, 0)
            be.flush_p2p()  # each its own NCCL call (the backend posts them to issue as one group)
            recv = be.recv(dev(rt, np.zeros(n, np.float32)), peer, 0)
            be.flush_p2p()
            try:
                recv.synchronize(timeout=3.0)
                send.synchronize(timeout=3.0)
                return True
            except Exception:
                return False
        if not stuck:
            assert run_world(2, p2p) == [True, True]
        else:
            with pytest.raises(AssertionError, match="rendezvous send"):
                run_world(2, p2p, hang=1.0, shutdown=False)

    monkeypatch.setenv("NCCL_COMM_BLOCKING", "0")
    fabric = FakeFabric(hang_limit=5.0)
    try:
        with pytest.raises(KeyError, match="7"):  # CuPy 14.2's NcclError has no name for ncclInProgress
            FakeRuntime(fabric).new_comm(1, b"u" * 128, 0)
    finally:
        fabric.close()
