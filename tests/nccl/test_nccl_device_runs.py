"""The group's DeviceRun (gpucoll/_group/core.py): a repeated all_reduce on a CuPy
array goes straight to the NCCL backend's hot call, on the fake GPU with CuPy's own
ndarray over the fake's memory. Each test checks the values against NumPy and that
what the run caches never serves a wrong op: another dtype, shape or op at the same
address, a non-contiguous view, another current stream, a hook, async ops."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from gpucoll._reduce_op import ReduceOp
from gpucoll._work import WorkInfo

from _fake_cupy_costs import CupyOnFake, FakeCupyStream, cupy_or_none
from _nccl_fake import FakeRuntime, read_on_stream
from _fake_gpu_world import dev, run_groups

pytestmark = pytest.mark.skipif(cupy_or_none() is None, reason="CuPy is not installed")


class _RankRuntime:
    """CupyOnFake's runtime: the calling rank thread's (each rank of run_groups has its own)."""

    local = threading.local()

    def __getattr__(self, name: str) -> Any:
        rt = getattr(self.local, "rt", None)
        if rt is None:
            raise AttributeError(name)
        return getattr(rt, name)


@pytest.fixture
def cupy_fake() -> Iterator[CupyOnFake]:
    fake = CupyOnFake(_RankRuntime())
    fake.install()
    try:
        yield fake
    finally:
        fake.uninstall()


def _array(fake: CupyOnFake, rt: FakeRuntime, values: np.ndarray) -> tuple[Any, Any]:
    """A cupy.ndarray of ``values`` in the fake GPU's memory, and its Buffer."""
    buf = dev(rt, values)
    return fake.array(values.size, values.dtype.name, ptr=buf.ptr), buf


def _put(rt: FakeRuntime, buf: Any, values: np.ndarray) -> None:
    rt.fabric.mem.view(buf.ptr, values.nbytes)[:] = values.reshape(-1).view(np.uint8)


def test_repeated_all_reduces_of_cupy_arrays_go_through_a_run_and_stay_right(
        cupy_fake: CupyOnFake, monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        size, bad = pg.size(), []
        base = np.arange(16, dtype=np.float32)
        x, buf = _array(cupy_fake, rt, base + rank)
        runs = pg._issuer.device_runs
        for i in range(4):  # the first plans the op; the others go through the run
            _put(rt, buf, base * (i + 1) + rank)
            assert pg.all_reduce(x) is None
            want = sum(base * (i + 1) + r for r in range(size))
            if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20), want):
                bad.append(f"SUM round {i}")
        if len(runs) != 1:
            bad.append(f"runs: {len(runs)}")
        # CuPy's current stream of another device (that device current): the run declines
        # (the synchronous form gets no handle for it, so the op goes the usual way).
        run = next(iter(runs.values()))
        other = FakeCupyStream(rt.new_stream().ptr, 1)
        if run.stream_of(other, run.device) is not None:
            bad.append("a stream of another device was taken")
        # Same address, another op, then another dtype: each its own run, right values.
        _put(rt, buf, base + rank)
        for _ in range(2):
            pg.all_reduce(x, op=ReduceOp.MAX)
        if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20), base + size - 1):
            bad.append("MAX")
        ints = x.view(cupy_fake.cupy.int32)
        _put(rt, buf, np.full(16, rank + 2, np.int32))
        for _ in range(2):
            pg.all_reduce(ints, op=ReduceOp.PRODUCT)
        want_i = int(np.prod([r + 2 for r in range(size)])) ** size  # twice reduced
        if read_on_stream(rt, buf, np.int32).get(timeout=20).tolist() != [want_i] * 16:
            bad.append("int32 PRODUCT")
        # Same address and dtype, fewer elements: the rest is left alone.
        _put(rt, buf, np.full(16, rank + 1.0, np.float32))
        half = x[:8]
        for _ in range(2):
            pg.all_reduce(half)
        total = float(sum(r + 1 for r in range(size)))
        if read_on_stream(rt, buf, np.float32).get(timeout=20).tolist() != [total * size] * 8 + [rank + 1.0] * 8:
            bad.append("half")
        # A non-contiguous view at the same address, shape and dtype as a run: not the
        # run (the general path asks CuPy's DLPack, which needs a driver here: nothing
        # is issued).
        square = x.reshape(4, 4)
        pg.all_reduce(square)
        pg.all_reduce(square)
        seq = pg._issuer.seq
        with pytest.raises(Exception):
            pg.all_reduce(square.T)
        if pg._issuer.seq != seq:
            bad.append("a transposed view was issued through the run")
        # Another current stream: the op is ordered on it (the default stream's ops done
        # first: the host writes the array next).
        read_on_stream(rt, buf, np.float32).get(timeout=20)
        other = rt.new_stream()
        rt.set_current_stream(other.ptr)
        _put(rt, buf, base + rank)
        pg.all_reduce(x)
        if not np.array_equal(read_on_stream(rt, buf, np.float32, other.ptr).get(timeout=20),
                              sum(base + r for r in range(size))):
            bad.append(f"another stream: {read_on_stream(rt, buf, np.float32, other.ptr).get(timeout=20)}")
        rt.set_current_stream(rt.default_stream.ptr)
        # Async through the run: the Work's wait() orders the result; is_completed() holds.
        for i in range(3):
            _put(rt, buf, base + rank + i)
            work = pg.all_reduce(x, async_op=True)
            work.wait()
            if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20),
                                  sum(base + r + i for r in range(size))):
                bad.append(f"async round {i}")
            work.synchronize()
            if not work.is_completed() or work.seq <= 0 or work.result() != [x]:
                bad.append(f"async work {i}: {work.is_completed()} {work.seq} {work.result()}")
        # A hook: the run steps aside, and the hook sees every op.
        seen: list[WorkInfo] = []
        pg.register_on_completion_hook(seen.append)
        _put(rt, buf, base + rank)
        pg.all_reduce(x)
        work = pg.all_reduce(x, async_op=True)
        work.wait()
        work.synchronize()
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        if len(seen) != 2:
            bad.append(f"hook saw {len(seen)} ops")
        if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20),
                              sum(base + r for r in range(size)) * size):
            bad.append("with a hook")
        return bad

    assert run_groups(2, body, monkeypatch) == [[], []]


def test_a_run_is_dropped_with_the_groups_plans(cupy_fake: CupyOnFake, monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[int]:
        _RankRuntime.local.rt = rt
        x, buf = _array(cupy_fake, rt, np.ones(8, np.float32))
        pg.all_reduce(x)
        pg.all_reduce(x)
        read_on_stream(rt, buf, np.float32).get(timeout=20)  # (the fake's memory is buf's, not x's)
        counts = [len(pg._issuer.device_runs)]
        pg._issuer.forget_plans()
        counts.append(len(pg._issuer.device_runs))
        return counts
    assert run_groups(1, body, monkeypatch) == [[1, 0]]


def test_the_watchdog_fails_an_async_op_issued_through_a_run(cupy_fake: CupyOnFake,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's async all_reduce through its run is never joined: the watchdog fails it at
    the group's timeout (is_completed() turns True, wait() names the op)."""
    timeout = 1.0
    done = threading.Event()

    def body(pg: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        _RankRuntime.local.rt = rt
        x, buf = _array(cupy_fake, rt, np.ones(64, np.float32))
        pg.all_reduce(x, async_op=True).wait()
        pg.all_reduce(x, async_op=True).wait()
        read_on_stream(rt, buf, np.float32).get(timeout=20)
        out: dict[str, Any] = {"runs": len(pg._issuer.device_runs)}
        if rank == 0:
            work = pg.all_reduce(x, async_op=True)
            t0 = time.monotonic()
            while not work.is_completed() and time.monotonic() - t0 < timeout + 5:
                time.sleep(0.02)
            out["after_s"] = time.monotonic() - t0
            with pytest.raises(Exception) as err:
                work.wait()
            out["error"] = f"{type(err.value).__name__}: {err.value}"
            done.set()
        else:
            done.wait(30)
        pg._destroy()
        return out
    first = run_groups(2, body, monkeypatch, timeout=timeout)[0]
    assert first["runs"] == 1, first
    assert timeout * 0.9 <= first["after_s"] < timeout + 2.0, first
    assert first["error"].startswith("DistBackendError") and "all_reduce" in first["error"] \
        and "did not complete within the group's timeout" in first["error"], first


def test_cupys_null_stream_is_the_legacy_stream_of_any_device() -> None:
    """CuPy's null stream says device -1 (CuPy's own object, no driver needed): the CUDA
    runtime's ``stream_of`` answers the legacy stream's handle (0) for it on every device,
    so a default-stream all_reduce on a GPU goes through its DeviceRun, and the fake's
    null stream says the same as CuPy's. A stream of another device is declined."""
    cupy = cupy_or_none()
    if cupy is None:
        pytest.skip("CuPy is not installed")
    from gpucoll._backends.nccl.runtime import CudaRuntime

    null = cupy.cuda.Stream.null
    assert (null.ptr, null.device_id) == (0, -1)
    rt = object.__new__(CudaRuntime)  # stream_of reads the object's fields only
    assert rt.stream_of(null, 0) == 0 and rt.stream_of(null, 3) == 0
    assert rt.stream_of(FakeCupyStream(0x5000, 1), 0) is None
    assert rt.stream_of(FakeCupyStream(0x5000, 1), 1) == 0x5000
    assert CudaRuntime.stream_of_fixed
    from _nccl_fake import FakeFabric

    fake = CupyOnFake(FakeRuntime(FakeFabric(hang_limit=5.0)))
    assert (fake.get_current_stream(0).ptr, fake.get_current_stream(0).device_id) == (0, -1)


def test_async_ops_through_a_run_reuse_their_end_events_and_stay_right(cupy_fake: CupyOnFake,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """More async all_reduces through a run than the backend's sweep batches, so their end
    events (pooled Handles) go back to the pool and record later ops again, some Works held
    across those later ops: each result is right once its ``wait()`` ordered the caller's
    stream, the held Works read complete with their results, and the ends are reused (a
    Handle never given back makes every op's end a new event)."""
    from gpucoll._backends.nccl import hot

    n = 3 * hot.PRUNE_WORKS_AT + 8

    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        size, bad = pg.size(), []
        base = np.arange(16, dtype=np.float32)
        x, buf = _array(cupy_fake, rt, base + rank)
        pg.all_reduce(x)  # the first plans the op and makes the run
        read_on_stream(rt, buf, np.float32).get(timeout=20)
        held: list[Any] = []
        ends: set[int] = set()
        for i in range(n):
            k = i % 7 + 1
            _put(rt, buf, base * k + rank)
            work = pg.all_reduce(x, async_op=True)
            ends.add(work._end.ptr)
            if i % 16 == 0:
                held.append(work)
            work.wait()
            got = read_on_stream(rt, buf, np.float32).get(timeout=20)
            if not np.array_equal(got, sum(base * k + r for r in range(size))):
                bad.append(f"op {i}: {got}")
        if len(pg._issuer.device_runs) != 1:
            bad.append(f"runs: {len(pg._issuer.device_runs)}")
        if len(ends) > 2 * hot.PRUNE_WORKS_AT + 2:
            bad.append(f"{len(ends)} end events for {n} ops: not reused")
        for w in held:
            if not (w.wait() and w.is_completed() and w.result() == [x]):
                bad.append(f"held work {w.seq}: {w.is_completed()}")
        return bad

    assert run_groups(2, body, monkeypatch) == [[], []]
