"""Collectives captured into a CUDA graph through the ProcessGroup, on the strict fake
GPU in torch's default (global) capture mode: the capture records stream dependencies
only (an event query, an allocation or a communicator creation during it would
invalidate it), leaves nothing for the watchdog, and replaying the graph runs no
gpucoll Python at all."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._reduce_op import ReduceOp

from _nccl_fake import FakeRuntime, read, read_on_stream
from _fake_gpu_world import dev, run_groups

_GPUCOLL = os.path.dirname(gpucoll.__file__)
N_OPS = 1000


def test_a_captured_loop_of_1000_all_reduce_replays_with_no_gpucoll_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, int]:
        size = pg.size()
        x = dev(rt, np.ones(4, np.float32))
        y = dev(rt, np.array([1 << rank, 3], np.int16))
        pg.all_reduce(x, ReduceOp.SUM)  # connected, kernels loaded: warm before the capture
        pg.all_reduce(y, ReduceOp.BXOR)
        for w in list(pg._nccl.outstanding):
            w.synchronize()
        pg._nccl.poll_pending()
        x_before = read(rt, x, np.float32).tolist()
        rt.begin_capture(mode="global")
        for _ in range(N_OPS - 1):
            pg.all_reduce(x, ReduceOp.AVG)
        pg.all_reduce(y, ReduceOp.BXOR)  # a kernel-path op: temporaries, two phases
        graph = rt.end_capture()  # raises if anything invalidated the capture
        outstanding = pg._watchdog.outstanding() + len(pg._nccl.outstanding)
        assert read(rt, x, np.float32).tolist() == x_before  # nothing ran at capture
        world = pg._nccl._comm.world
        ran_before = world.executed
        calls = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            if event == "call" and frame.f_code.co_filename.startswith(_GPUCOLL):
                calls += 1
        sys.setprofile(profile)
        try:
            graph.replay_here()
        finally:
            sys.setprofile(None)
        assert read(rt, x, np.float32).tolist() == [float(size)] * 4 or size == 1
        assert read(rt, y, np.int16).tolist()[1] == (3 if size % 2 else 0)
        replayed = world.executed - ran_before  # collectives the replay ran (both ranks' share)
        return {"calls": calls, "outstanding": outstanding, "replayed": replayed >= N_OPS}

    for out in run_groups(2, body, monkeypatch):
        assert out == {"calls": 0, "outstanding": 0, "replayed": True}, out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_captured_premul_sum_replays_after_its_operator_is_destroyed(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/gpu's test_cuda_graph_capture on the fake GPU: a PREMUL_SUM all_reduce on a
    side stream, captured in CuPy's default (relaxed) mode after a warm-up, the graph
    launched three times. gpucoll destroys the PreMulSum operator once the captured call
    returned, which NCCL allows ("An operator may be destroyed as soon as the last NCCL
    function which is given that operator returns", ncclRedOpDestroy; enqueue.cc copies
    the operator's state into the call, scalar by value), so every replay must still
    reduce with the factor; no step of the capture waits on a peer (each rank's capture
    is made before any rank replays)."""
    from gpucoll._reduce_op import make_premul_sum

    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        x = dev(rt, np.ones(1024, np.float32))
        side = rt.new_stream()
        rt.set_current_stream(side.ptr)
        op = make_premul_sum(2.0)
        pg.all_reduce(x, op)  # warm-up outside the capture
        comm = pg._nccl._comm
        rt.begin_capture(side.ptr, mode="relaxed")
        pg.all_reduce(x, op)
        graph = rt.end_capture(side.ptr)
        live_ops = len(comm._ops)  # the operator made for the captured call is gone
        for _ in range(3):
            graph.launch(side.ptr)
        got = read_on_stream(rt, x, np.float32, side.ptr).get(timeout=10)[:4].tolist()
        return {"got": got, "live_ops": live_ops,
                "premul_calls": sum(1 for c in comm.calls if c[0] == "all_reduce" and c[5] >= 5)}

    for out in run_groups(size, body, monkeypatch):
        # warm-up, then three replays: each multiplies by 2 * size. On one rank gpucoll
        # scales by itself (NCCL's one-rank PreMulSum kernel is not used: nccl-backend.md)
        premul_calls = 2 if size > 1 else 0
        assert out == {"got": [float((2 * size) ** 4)] * 4, "live_ops": 0, "premul_calls": premul_calls}, out
