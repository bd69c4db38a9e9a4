"""Work, completion hooks, the watchdog and the flight recorder."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np
import pytest

import gpucoll
from gpucoll._group import registry as group_module
from gpucoll.errors import DistBackendError
from gpucoll.store import HashStore
from gpucoll.testing import run_spmd
from gpucoll._work import Work, WorkInfo

from _fake_arrays import FakeCudaArray


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ----- Work on its own -----

def test_work_success_surface() -> None:
    w = Work("all_reduce", keepalive=[np.zeros(1)], result=["out"])
    assert not w.is_completed() and w.exception() is None
    with pytest.raises(RuntimeError, match="has not completed"):
        w.is_success()
    with pytest.raises(DistBackendError, match=r"did not complete within 0.05 s"):
        w.wait(timeout=0.05)
    early: Future[list[Any]] = w.get_future()
    w._set_result(active_duration=0.25)
    w._set_exception(RuntimeError("ignored: a Work completes once"))
    assert w.is_completed() and w.is_success() and w.wait() and w.result() == ["out"]
    assert early.result(timeout=1) == ["out"] and w.get_future() is early
    info = w.info()
    assert isinstance(info, WorkInfo) and info.op_type == "all_reduce" and info.active_duration == 0.25
    assert info.time_finished >= info.time_started and info.success
    assert w._keepalive is None  # arrays released on completion
    with pytest.raises(RuntimeError, match="only defined for recv"):
        w.source_rank()


def test_work_failure_surface() -> None:
    w = Work("broadcast")
    w._set_exception(ValueError("boom"))
    assert w.is_completed() and not w.is_success() and isinstance(w.exception(), ValueError)
    with pytest.raises(DistBackendError, match=r"broadcast \(seq 0\) failed: boom"):
        w.wait()
    late = w.get_future()  # made after completion: already resolved, with the error wait() raises
    err = late.exception(timeout=1)
    assert isinstance(err, DistBackendError) and isinstance(err.__cause__, ValueError), err
    assert str(err) == "broadcast (seq 0) failed: boom"
    with pytest.raises(DistBackendError, match=r"broadcast \(seq 0\) failed: boom"):
        late.wait()  # torch's Future surface
    assert late.done()
    w2 = Work("send")
    err = DistBackendError("peer died")
    w2._set_exception(err)
    with pytest.raises(DistBackendError) as info:
        w2.wait()
    assert info.value is err
    assert not w2.info().success


def test_work_wait_from_another_thread_and_source_rank() -> None:
    w = Work("recv")
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(w.wait(timeout=10)))
    t.start()
    time.sleep(0.05)
    w._set_result(source_rank=3)
    t.join(5)
    assert seen == [True] and w.source_rank() == 3


def test_done_callbacks_run_once_even_if_added_late() -> None:
    w = Work("x")
    calls: list[str] = []
    w._add_done_callback(lambda _: calls.append("early"))
    w._set_result()
    w._add_done_callback(lambda _: calls.append("late"))
    assert calls == ["early", "late"]


# ----- groups with stand-in backends (one process) -----

class ScriptedBackend:
    """A backend whose ops complete only when the test says so (or on abort)."""

    name = "cpu"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.pending: list[Work] = []
        self.aborted: str | None = None

    def _op(self, op_type: str, complete: bool) -> Work:
        w = Work(op_type)
        if complete:
            w._set_result(active_duration=0.001)
        else:
            self.pending.append(w)
        return w

    def all_reduce(self, buf: Any, op: Any) -> Work:
        return self._op("all_reduce", complete=buf.numel != 13)  # 13 elements: hangs

    def broadcast(self, buf: Any, src: int) -> Work:
        return self._op("broadcast", complete=True)

    def barrier(self) -> Work:
        return self._op("barrier", complete=True)

    def abort(self, reason: str) -> None:
        self.aborted = reason
        for w in self.pending:
            w._set_exception(DistBackendError(reason))

    def shutdown(self) -> None:
        pass


class PolledWork(Work):
    """Device-style work: completes only when the watchdog polls it enough."""

    def __init__(self, polls: int) -> None:
        super().__init__("all_reduce", keepalive=[object()])
        self.polls = polls

    def _poll(self) -> bool:
        self.polls -= 1
        if self.polls <= 0:
            self._set_result(active_duration=0.002)
        return self.is_completed()

    def wait(self, timeout: Any = None) -> bool:  # stream-ordered: returns without blocking
        return True


class FakeDeviceBackend(ScriptedBackend):
    name = "nccl"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.device_id = kwargs.get("device_id")

    def all_reduce(self, buf: Any, op: Any) -> Work:
        w = PolledWork(polls=3)
        self.pending.append(w)
        return w


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    monkeypatch.setitem(group_module.BACKENDS, "cpu", ScriptedBackend)
    monkeypatch.setitem(group_module.BACKENDS, "nccl", FakeDeviceBackend)
    monkeypatch.setenv("GPUCOLL_FLIGHT_RECORDER_DIR", str(tmp_path))
    gpucoll.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=0.5)
    try:
        yield gpucoll._world.default_group()
    finally:
        if gpucoll.is_initialized():
            gpucoll.destroy_process_group()


def test_hooks_fire_off_the_callers_thread_with_workinfo(scripted: Any) -> None:
    seen: list[tuple[WorkInfo, int]] = []
    scripted.register_on_completion_hook(lambda info: seen.append((info, threading.get_ident())))
    gpucoll.all_reduce(np.zeros(4))
    gpucoll.broadcast(np.zeros(2), src=0)
    w = gpucoll.all_reduce(np.zeros(3), async_op=True)
    assert w is not None and w.wait()
    gpucoll.barrier()
    wait_for(lambda: len(seen) == 4)
    infos = [i for i, _ in seen]
    assert [i.op_type for i in infos] == ["all_reduce", "broadcast", "all_reduce", "barrier"]
    assert [i.seq for i in infos] == [1, 2, 3, 4]
    assert all(tid != threading.get_ident() for _, tid in seen)
    assert all(i.group_name == "default" and i.success and i.active_duration == 0.001 for i in infos)
    assert all(i.time_finished >= i.time_started for i in infos)
    with pytest.raises(TypeError, match="hook must be callable"):
        scripted.register_on_completion_hook(42)


def test_device_work_is_completed_by_the_watchdog(scripted: Any) -> None:
    seen: list[WorkInfo] = []
    scripted.register_on_completion_hook(seen.append)
    arr = FakeCudaArray(np.zeros(4, np.float32), stream=7)
    assert gpucoll.all_reduce(arr) is None  # ordered on the stream; the host goes on
    backend = scripted._nccl
    assert isinstance(backend, FakeDeviceBackend) and backend.device_id == 0
    work = backend.pending[0]
    wait_for(work.is_completed)
    assert work._keepalive is None
    wait_for(lambda: len(seen) == 1)
    assert seen[0].active_duration == 0.002 and seen[0].seq == 1
    with pytest.raises(ValueError, match="cuda:1 but group 'default' communicates on cuda:0"):
        gpucoll.all_reduce(FakeCudaArray(np.zeros(4, np.float32), stream=7, device=1))


def test_timeout_aborts_names_the_op_and_dumps_the_flight_recorder(scripted: Any, tmp_path: Any) -> None:
    gpucoll.all_reduce(np.zeros(4))
    t0 = time.monotonic()
    with pytest.raises(DistBackendError) as info:
        gpucoll.all_reduce(np.zeros(13))  # never completes
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert 0.4 < elapsed < 5
    assert "all_reduce (seq 2) on group 'default'" in msg and "timeout of 0.5 s" in msg
    assert "aborted" in msg and str(tmp_path) in msg
    backend = scripted._cpu
    assert backend.aborted == msg
    files = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert len(files) == 1 and files[0].startswith("default-rank0-")
    dump = json.loads((tmp_path / files[0]).read_text())
    assert dump["group"] == "default" and "seq 2" in dump["reason"]
    states = [(e["seq"], e["op_type"], e["state"]) for e in dump["entries"]]
    assert states == [(1, "all_reduce", "completed"), (2, "all_reduce", "scheduled")]
    assert dump["entries"][1]["shape"] == [13] and dump["entries"][1]["dtype"] == "float64"


def test_watchdog_times_out_async_work(scripted: Any, tmp_path: Any) -> None:
    w = gpucoll.all_reduce(np.zeros(13), async_op=True)
    assert w is not None
    wait_for(w.is_completed, timeout=5)
    assert not w.is_success() and "all_reduce (seq 1)" in str(w.exception())
    assert any(f.endswith(".json") for f in os.listdir(tmp_path))


def test_flight_recorder_on_request(scripted: Any, tmp_path: Any) -> None:
    gpucoll.all_reduce(np.zeros((2, 3), np.int32))
    gpucoll.barrier()
    path = tmp_path / "fr.json"
    text = scripted.dump_flight_recorder(str(path))
    dump = json.loads(text)
    assert json.loads(path.read_text())["entries"] == dump["entries"]
    first = dump["entries"][0]
    assert (first["seq"], first["op_type"], first["state"], first["shape"], first["dtype"], first["nbytes"]) == \
        (1, "all_reduce", "completed", [2, 3], "int32", 24)
    assert dump["entries"][1]["op_type"] == "barrier" and dump["rank"] == 0 and dump["size"] == 1


def test_flight_recorder_size_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._debug.flight_recorder import recorder_capacity

    monkeypatch.setenv("GPUCOLL_FLIGHT_RECORDER_SIZE", "3")
    assert recorder_capacity() == 3
    monkeypatch.setitem(group_module.BACKENDS, "cpu", ScriptedBackend)
    gpucoll.init_process_group("cpu", store=HashStore(), rank=0, world_size=1, timeout=5)
    try:
        for _ in range(5):
            gpucoll.barrier()
        seqs = [e["seq"] for e in json.loads(gpucoll._world.default_group().dump_flight_recorder())["entries"]]
        assert seqs == [3, 4, 5]
    finally:
        gpucoll.destroy_process_group()
    monkeypatch.setenv("GPUCOLL_FLIGHT_RECORDER_SIZE", "lots")
    with pytest.raises(ValueError, match="GPUCOLL_FLIGHT_RECORDER_SIZE"):
        recorder_capacity()


def test_a_raising_hook_surfaces_at_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(group_module.BACKENDS, "cpu", ScriptedBackend)
    gpucoll.init_process_group("cpu", store=HashStore(), rank=0, world_size=1, timeout=5)
    calls: list[int] = []

    def bad_hook(info: WorkInfo) -> None:
        calls.append(info.seq)
        raise KeyError("hook bug")

    gpucoll._world.default_group().register_on_completion_hook(bad_hook)
    gpucoll.barrier()
    gpucoll.barrier()  # the group keeps working
    wait_for(lambda: len(calls) == 2)
    with pytest.raises(RuntimeError, match="completion hook.*raised.*bad_hook.*hook bug"):
        gpucoll.destroy_process_group()
    assert not gpucoll.is_initialized()


# ----- real CPU backend, several ranks -----

def hooks_body() -> list[tuple[str, int]]:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pg = gpucoll._world.default_group()
    seen: list[tuple[str, int, int]] = []
    pg.register_on_completion_hook(lambda i: seen.append((i.op_type, i.seq, threading.get_ident())))
    x = np.ones(1000)
    gpucoll.all_reduce(x)
    works = [gpucoll.all_reduce(np.ones(10), async_op=True) for _ in range(3)]
    for w in works:
        assert w is not None
        w.wait()
    if r == 0:
        gpucoll.send(np.zeros(2), dst=n - 1)
    elif r == n - 1:
        gpucoll.recv(np.zeros(2), src=0)
    gpucoll.barrier()
    count = 6 if r in (0, n - 1) else 5
    wait_for(lambda: len(seen) == count)
    assert all(tid != threading.get_ident() for _, _, tid in seen)
    assert [s for _, s, _ in seen] == list(range(1, count + 1))
    entries = json.loads(pg.dump_flight_recorder())["entries"]
    assert [e["state"] for e in entries] == ["completed"] * count
    return [(op, seq) for op, seq, _ in seen]


def test_hooks_with_the_cpu_backend() -> None:
    out = run_spmd(hooks_body, 3, timeout=60)
    assert out[1] == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3), ("all_reduce", 4), ("barrier", 5)]
    assert out[0][4] == ("send", 5) and out[2][4] == ("recv", 5)


def test_flight_recorder_reuses_entries_and_a_late_finish_leaves_the_newer_op_alone() -> None:
    from gpucoll._debug.flight_recorder import FlightRecorder
    from gpucoll._work import Work

    fr = FlightRecorder("g", 0, 0, 1, capacity=2)
    works = []
    for seq in (1, 2, 3):
        w = Work("all_reduce" if seq != 2 else "broadcast")
        w.seq = seq
        fr.record(w, "cpu", None)
        works.append(w)
    works[1]._set_result()
    # Op 1 was still running when op 3 took its slot: its completion must not touch op 3's entry.
    works[0]._set_exception(RuntimeError("late"))
    entries = json.loads(fr.to_json())["entries"]
    assert [(e["seq"], e["op_type"], e["state"]) for e in entries] == [(2, "broadcast", "completed"),
                                                                        (3, "all_reduce", "scheduled")]
    works[2]._set_result()
    assert json.loads(fr.to_json())["entries"][1]["state"] == "completed"


def test_before_done_runs_before_the_work_is_seen_complete_and_only_on_success() -> None:
    seen: list[Any] = []
    work = Work("all_gather", result=["stand-in"])
    work._before_done(lambda res: seen.append(("first", work.is_completed(), list(res))))

    def second(res: list[Any]) -> None:
        seen.append(("second", work.is_completed()))
        res[0] = "caller's array"

    work._before_done(second)
    future = work.get_future()
    threading.Timer(0.05, work._set_result).start()
    assert work.wait(5) is True
    # both ran, in order, before completion was visible; the results name what they set
    assert seen == [("first", False, ["stand-in"]), ("second", False)]
    assert work.result() == ["caller's array"] and future.result(1) == ["caller's array"]
    late: list[Any] = []
    work._before_done(late.append)  # already complete: at once, on this thread
    assert late == [["caller's array"]]

    failed = Work("all_gather")
    ran: list[Any] = []
    failed._before_done(ran.append)
    failed._set_exception(DistBackendError("peer died"))
    with pytest.raises(DistBackendError, match="peer died"):
        failed.wait(1)
    failed._before_done(ran.append)
    assert ran == []  # never for a failed op

    broken = Work("gather")
    broken._before_done(lambda res: 1 / 0)
    broken._set_result()
    with pytest.raises(DistBackendError, match=r"gather \(seq 0\): writing its results into the output arrays "
                                               r"failed: ZeroDivisionError"):
        broken.wait(1)
