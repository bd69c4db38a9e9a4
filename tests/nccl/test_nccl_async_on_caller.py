"""A small async op on the caller's stream (hot.py, ``caller_stream_max``), on the fake
GPU: the op is queued on the caller's current stream itself, so ``wait()`` adds a
stream wait only for a caller that has moved to another stream since; its results are
ordered on either stream; ``is_completed()`` says what the GPU did; the watchdog fails
it at the group's timeout; larger ops, and every op with
``GPUCOLL_NCCL_CALLER_STREAM_MAX=0``, go on the communication stream as before."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._backends.nccl.bootstrap import DEFAULT_CALLER_STREAM_MAX, caller_stream_max
from gpucoll._env import NCCL_CALLER_STREAM_MAX_ENV
from gpucoll._reduce_op import ReduceOp
from gpucoll.errors import DistBackendError

from _nccl_fake import FakeRuntime, read, read_on_stream
from _fake_gpu_world import FakeDeviceArray, dev, run_groups, run_world

SUM = ReduceOp.SUM
LIMIT = 65536  # the opt-in these tests run with (the default, 0, is torch's scheduling)


@pytest.fixture(autouse=True)
def _opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NCCL_CALLER_STREAM_MAX_ENV, str(LIMIT))


def test_by_default_every_async_op_goes_on_the_communication_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NCCL_CALLER_STREAM_MAX_ENV)
    assert DEFAULT_CALLER_STREAM_MAX == 0 and caller_stream_max() == 0


def _fill(rt: FakeRuntime, buf: Any, value: float) -> None:
    rt.fabric.mem.view(buf.ptr, buf.nbytes)[:] = np.full(buf.nbytes // 4, value, np.float32).view(np.uint8)


def _waits(rt: FakeRuntime) -> list[int]:
    """The streams made to wait on an event from now on (each call's stream)."""
    seen: list[int] = []
    real = rt.wait_event

    def counted(stream: int, event: int) -> None:
        seen.append(stream)
        real(stream, event)
    rt.wait_event = counted  # type: ignore[method-assign]
    return seen


def test_a_small_async_op_is_ordered_on_the_callers_stream_and_on_the_stream_that_waits() -> None:
    go = threading.Event()

    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        size, bad = be.size, []
        total = float(sum(r + 1 for r in range(size)))
        buf = dev(rt, np.full(256, rank + 1.0, np.float32))
        be.all_reduce(buf, SUM).synchronize()  # planned: the next ones take the hot path
        be.all_reduce(buf, SUM).synchronize()  # (the first of them waits for the planned one's stream)
        caller = rt.current_stream()
        waits = _waits(rt)
        # 1. On the caller's stream: no event for a communication stream to wait on, and
        #    wait() has nothing to add; a later task on that stream sees the result.
        _fill(rt, buf, rank + 1.0)
        work = be.all_reduce(buf, SUM)
        work.wait()
        if waits:
            bad.append(f"stream waits on the caller's own stream: {waits}")
        if read_on_stream(rt, buf, np.float32).get(timeout=20).tolist() != [total] * 256:
            bad.append("not ordered on the caller's stream")
        work.synchronize()
        # 2. The caller moved to another stream before wait(): that stream waits for the op.
        other = rt.new_stream()
        _fill(rt, buf, rank + 1.0)
        work = be.all_reduce(buf, SUM)
        rt.set_current_stream(other.ptr)
        work.wait()
        if waits != [other.ptr]:
            bad.append(f"wait() from another stream made {waits} wait, not {[other.ptr]}")
        if read_on_stream(rt, buf, np.float32, other.ptr).get(timeout=20).tolist() != [total] * 256:
            bad.append("not ordered on the stream that waited")
        rt.set_current_stream(caller)
        work.synchronize()
        # 3. is_completed() says what the GPU did: not done while the peer has not joined.
        _fill(rt, buf, rank + 1.0)
        if rank == 0:
            work = be.all_reduce(buf, SUM)
            time.sleep(0.05)
            if work.is_completed():
                bad.append("complete before the peer joined")
            go.set()
        else:
            go.wait(20)
            work = be.all_reduce(buf, SUM)
        work.synchronize(20)
        if not work.is_completed() or read(rt, buf, np.float32).tolist() != [total] * 256:
            bad.append("not complete, or wrong, after synchronize()")
        # 4. A larger op: the communication stream waits for the caller's, the caller's
        #    for the op (wait()), as before.
        del waits[:]
        big = dev(rt, np.full(LIMIT // 4 + 1, rank + 1.0, np.float32))
        be.all_reduce(big, SUM).synchronize()
        del waits[:]
        _fill(rt, big, rank + 1.0)
        be.all_reduce(big, SUM).wait()
        if waits != [be.comm_stream.ptr, caller]:
            bad.append(f"a large op's waits: {waits}")
        if read_on_stream(rt, big, np.float32).get(timeout=20)[-1] != total:
            bad.append("large op not ordered")
        return bad

    assert run_world(2, body) == [[], []]


def test_with_the_limit_at_zero_every_async_op_goes_on_the_communication_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCOLL_NCCL_CALLER_STREAM_MAX", "0")
    assert caller_stream_max() == 0

    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[int]:
        buf = dev(rt, np.ones(16, np.float32))
        be.all_reduce(buf, SUM).synchronize()
        waits = _waits(rt)
        be.all_reduce(buf, SUM).wait()
        assert read_on_stream(rt, buf, np.float32).get(timeout=20).tolist() == [1.0] * 16  # (one rank)
        return [w == be.comm_stream.ptr for w in waits]  # type: ignore[misc]
    assert run_world(1, body) == [[True, False]]
    for text in ("-1", "lots"):
        monkeypatch.setenv("GPUCOLL_NCCL_CALLER_STREAM_MAX", text)
        with pytest.raises(ValueError, match="GPUCOLL_NCCL_CALLER_STREAM_MAX must be a number of bytes"):
            caller_stream_max()


def test_the_watchdog_fails_a_small_async_op_nobody_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's small async all_reduce is never joined and never waited for:
    is_completed() turns True when the watchdog fails it at the group's timeout, and
    wait() raises the error naming the op."""
    timeout = 1.0
    done = threading.Event()

    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        x = FakeDeviceArray(rt, np.ones(256, np.float32))
        pg.all_reduce(x)
        out: dict[str, Any] = {}
        if rank == 0:
            work = pg.all_reduce(x, async_op=True)
            t0 = time.monotonic()
            out["at_once"] = work.is_completed()
            while not work.is_completed() and time.monotonic() - t0 < timeout + 5:
                time.sleep(0.02)
            out["after_s"] = time.monotonic() - t0
            with pytest.raises(DistBackendError) as err:
                work.wait()
            out["error"] = str(err.value)
            done.set()
        else:
            done.wait(30)
        pg._destroy()
        return out
    outs = run_groups(2, body, monkeypatch, timeout=timeout)
    first = outs[0]
    assert first["at_once"] is False, first
    assert timeout * 0.9 <= first["after_s"] < timeout + 2.0, first
    assert "all_reduce" in first["error"] and "did not complete within the group's timeout" in first["error"], first
