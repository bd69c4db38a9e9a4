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

from _nccl_fake import FakeRuntime, read
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
        for w in list(pg._nccl._pending):
            w.synchronize()
        pg._nccl.poll_pending()
        x_before = read(rt, x, np.float32).tolist()
        rt.begin_capture(mode="global")
        for _ in range(N_OPS - 1):
            pg.all_reduce(x, ReduceOp.AVG)
        pg.all_reduce(y, ReduceOp.BXOR)  # a kernel-path op: temporaries, two phases
        graph = rt.end_capture()  # raises if anything invalidated the capture
        outstanding = pg._watchdog.outstanding() + len(pg._nccl._pending)
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
