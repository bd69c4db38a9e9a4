"""Tearing a group down must not hang on NCCL's own waits.

On an H200 (docs/gpu-verification.md, "What the GPU found", item 4) a two-rank group that
had captured an all_reduce into a CUDA graph hung in ``destroy_process_group``:
ncclCommDestroy (and ncclCommAbort, the same path in NCCL's src/init.cc) keeps polling
until every graph that captured the communicator is destroyed, and the caller still
held its graph. The fake's communicators wait the same way (tests/_nccl_fake.py,
``FakeComm._wait_for_graphs``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll._reduce_op import ReduceOp

from _nccl_fake import FakeRuntime, read
from _fake_gpu_world import dev, run_groups


@pytest.mark.parametrize("size", [1, 2, 3])
def test_destroy_returns_while_a_graph_that_captured_the_group_lives(size: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        x = dev(rt, np.ones(8, np.float32))
        pg.all_reduce(x, ReduceOp.SUM)  # warm: connected before the capture
        for w in list(pg._nccl.outstanding):
            w.synchronize()
        rt.begin_capture(mode="relaxed")
        pg.all_reduce(x, ReduceOp.SUM)
        graph = rt.end_capture()
        graph.replay_here()
        got = read(rt, x, np.float32).tolist()
        t0 = time.monotonic()
        pg._destroy()  # the graph is still alive here, as in the GPU test
        took = time.monotonic() - t0
        del graph  # NCCL may free the communicator now
        return {"got": got, "took": took}

    for out in run_groups(size, body, monkeypatch):
        assert out["got"] == [float(size * size)] * 8, out  # warm-up (x size), one replay (x size)
        assert out["took"] < 5.0, out


def test_a_destroy_that_does_not_return_is_a_named_error_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for an NCCL teardown that never returns (NCCL's own waits have no
    # timeout): shutdown waits lifecycle.DESTROY_WAIT_S for it, then names it.
    from gpucoll._backends.nccl import lifecycle
    from gpucoll.errors import DistBackendError

    monkeypatch.setattr(lifecycle, "DESTROY_WAIT_S", 0.5)
    release = threading.Event()

    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        x = dev(rt, np.ones(8, np.float32))
        pg.all_reduce(x, ReduceOp.SUM)
        comm = pg._nccl._comm
        real = comm.destroy
        blocked = threading.Event()

        def stuck() -> None:
            blocked.set()
            release.wait(30)
            real()
        comm.destroy = stuck
        t0 = time.monotonic()
        try:
            pg._destroy()
            err = ""
        except DistBackendError as exc:
            err = str(exc)
        took = time.monotonic() - t0
        return {"err": err, "took": took, "blocked": blocked.is_set()}

    try:
        outs = run_groups(2, body, monkeypatch)
    finally:
        release.set()
    for out in outs:
        assert out["blocked"], out
        assert "ncclCommDestroy did not return within 0.5 s" in out["err"], out
        assert out["took"] < 5.0, out
