"""The single-copy all_reduce writes each folded slice into the peers' arrays
(process_vm_writev, gpucoll/_backends/cpu/cma.py): what keeps those writes safe.

Checked at 2 ranks, the writes slowed or failed by hand on one rank:
- a rank whose op fails (its deadline passes) while a live peer is still writing into
  its array does not return before that peer is done: its array does not change after
  the error reaches the caller; the late peer writes at most the chunk it was writing,
  sees the withdrawal before its next one and raises, naming the rank that gave up;
- a rank that fails before it has written its slice into the peers (a failed read)
  says so, and the peer raises naming it instead of returning a result with that slice
  missing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from test_cpu_backend import buf, make_backend, reduce_op


def writes_body() -> dict[str, Any]:
    from gpucoll._backends.cpu.cma import CHUNK, MIN_BYTES
    from gpucoll.errors import DistBackendError

    r = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    numel = MIN_BYTES // 4

    # Rank 1's first write is 3 s late; rank 0 gives up after 1.5 s, but must not return
    # while rank 1 may still write into its array.
    be = make_backend("late", transport="shm", timeout=1.5 if r == 0 else 20.0)
    reader = be._coll._cma
    assert reader is not None, be._coll.cma_unavailable
    if r == 1:
        real = reader.write
        first = [True]

        def late(peer: int, *args: Any) -> None:
            if first[0] and peer != r:  # (not the probe of its own array)
                first[0] = False
                time.sleep(3.0)
            real(peer, *args)

        reader.write = late
    be.barrier().wait()
    x = np.full(numel, r + 1, np.float32)
    t0 = time.monotonic()
    if r == 0:
        # (A longer Work.wait: the op's own deadline fails it, on the thread that runs it.)
        with pytest.raises(DistBackendError, match="rank 1") as info:
            be.all_reduce(buf(x), reduce_op("SUM")).wait(timeout=30.0)
        assert "Work.wait timeout" not in str(info.value), info.value
        out["took"] = time.monotonic() - t0
        seen = x.copy()
        time.sleep(1.0)
        out["unchanged_after_error"] = bool(np.array_equal(seen, x))
        # Rank 1's slice is the upper half (4 chunks): after its late first chunk it sees
        # rank 0's withdrawal and writes no more.
        out["late_chunks_written"] = int((x[numel // 2:] == 3).sum()) / (CHUNK // 4)
    else:
        with pytest.raises(DistBackendError, match="rank 0 gave up"):
            be.all_reduce(buf(x), reduce_op("SUM")).wait()
        out["right"] = True
    be.shutdown()

    # Rank 1 fails before writing its slice (a read refused): rank 0 must not return its
    # array with that slice left unreduced.
    be = make_backend("failread", transport="shm", timeout=20.0)
    reader = be._coll._cma
    assert reader is not None
    if r == 1:
        own_read = reader.read

        def refused(peer: int, *args: Any) -> None:
            if peer == r:  # (the probe of its own array)
                own_read(peer, *args)
                return
            raise OSError(1, "refused (test)")

        reader.read = refused
    be.barrier().wait()
    x = np.full(numel, r + 1, np.float32)
    with pytest.raises(DistBackendError, match="rank 1 (failed|gave up)" if r == 0 else "rank 0"):
        be.all_reduce(buf(x), reduce_op("SUM")).wait()
    be.shutdown()
    out["failread"] = True
    return out


def test_no_write_into_an_array_after_its_op_returned_and_failures_are_named() -> None:
    res = run_spmd(writes_body, 2, init=False, timeout=120)
    assert res[0]["unchanged_after_error"], res[0]
    assert res[0]["late_chunks_written"] <= 1, res[0]  # no write after the withdrawal was seen
    assert res[0]["took"] >= 2.5, res[0]  # it waited for rank 1's late write
    assert res[1]["right"], res[1]
    assert res[0]["failread"] and res[1]["failread"]
