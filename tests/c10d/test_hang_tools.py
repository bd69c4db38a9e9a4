"""gpucoll-debug trace / status and the control-plane server, on real hung jobs.

A job where the last rank never issues the third all_reduce (it is stuck in
``slow_data_loader``): with a short group timeout the other ranks time out and dump
their flight recorders, and ``trace`` must name the missing rank. With
``GPUCOLL_CONTROL_PLANE=1`` the job is instead left hanging while ``status`` asks
every live rank through the job's store, then released.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
import urllib.error
import urllib.request
from contextlib import redirect_stdout
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._debug.cli import analyse, load_dumps, main
from gpucoll.testing import run_spmd


def slow_data_loader(release: str | None, seconds: float) -> None:
    """The guilty rank's stall: until ``release`` exists, or for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if release is not None and os.path.exists(release):
            return
        time.sleep(0.05)


def _hang_body(release: str | None, stall: float, info_dir: str | None) -> str:
    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    if info_dir is not None and rank == 0:
        with open(os.path.join(info_dir, "store.json.tmp"), "w") as f:
            json.dump({"addr": os.environ["MASTER_ADDR"], "port": os.environ["MASTER_PORT"],
                       "token": os.environ.get("GPUCOLL_STORE_TOKEN")}, f)
        os.replace(os.path.join(info_dir, "store.json.tmp"), os.path.join(info_dir, "store.json"))
    x = np.ones(4, np.float32)
    gpucoll.all_reduce(x)
    gpucoll.all_reduce(x)
    try:
        if rank == n - 1:
            slow_data_loader(release, stall)
            if release is not None:
                gpucoll.all_reduce(x)  # released: the job completes
        else:
            gpucoll.all_reduce(x)
    except gpucoll.DistBackendError as exc:
        return str(exc)
    return "completed"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_trace_names_the_rank_that_never_arrived(n: int, tmp_path: Any) -> None:
    dumps = tmp_path / "fr"
    results = run_spmd(_hang_body, n, args=(None, 3.5, None), pg_timeout=1.5, timeout=90,
                       env={"GPUCOLL_FLIGHT_RECORDER_DIR": str(dumps), "GPUCOLL_DEBUG": "INFO"})
    for r in range(n - 1):
        assert "all_reduce (seq 3)" in results[r] and "did not complete within" in results[r]
    assert results[n - 1] == "completed"
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["trace", str(dumps)]) == 0
    text = out.getvalue()
    waiting = list(range(n - 1))
    assert (f"first op not reached by every rank: all_reduce (seq 3) float32 (4,) -- ranks {waiting} wait in it, "
            f"MISSING on ranks [{n - 1}]") in text, text
    assert f"rank {n - 1}: no dump" in text
    assert "test_hang_tools.py" in text and "(_hang_body)" in text  # the call site (INFO)
    assert "main thread: in gpucoll <- _hang_body" in text


def _disagreeing_dumps(directory: str, n: int) -> None:
    """Real dumps from real recorders: ``n`` ranks played one after another on the fake
    backend; the last rank issues float64 where the others issue float32 at seq 2."""
    for rank in range(n):
        gpucoll.init_process_group("fake", rank=rank, world_size=n)
        try:
            gpucoll.all_reduce(np.ones(4, np.float32))
            gpucoll.all_reduce(np.ones(4, np.float64 if rank == n - 1 else np.float32))
            if rank != 0:
                gpucoll.barrier()  # rank 0 stops before the barrier
            gpucoll.GroupMember.WORLD.dump_flight_recorder(os.path.join(directory, f"r{rank}.json"))  # type: ignore[union-attr]
        finally:
            gpucoll.destroy_process_group()


def test_trace_reports_disagreements_and_ranks_behind(tmp_path: Any) -> None:
    _disagreeing_dumps(str(tmp_path), 3)
    text = analyse(load_dumps(str(tmp_path)))
    assert ("ranks DISAGREE at seq 2 (op/dtype/size): rank 0: all_reduce (seq 2) float32 (4,); "
            "rank 1: all_reduce (seq 2) float32 (4,); rank 2: all_reduce (seq 2) float64 (4,)") in text, text
    assert "first op not reached by every rank: barrier (seq 3) -- reached by ranks [1, 2], MISSING on ranks [0]" in text
    assert main(["trace", str(tmp_path / "nope")]) == 2


def test_status_asks_every_live_rank_of_a_hung_job(tmp_path: Any) -> None:
    release = str(tmp_path / "release")
    info = tmp_path / "info"
    info.mkdir()
    n = 3
    seen: dict[str, Any] = {}

    def probe() -> None:
        try:
            deadline = time.monotonic() + 60
            while not (info / "store.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            store = json.loads((info / "store.json").read_text())
            address = f"{store['addr']}:{store['port']}"
            text = ""
            while time.monotonic() < deadline:  # until ranks 0..n-2 are inside seq 3
                out = io.StringIO()
                with redirect_stdout(out):
                    seen["rc"] = main(["status", address, "--token", store["token"], "--timeout", "5"])
                text = out.getvalue()
                # (each rank answers at its own moment: one that answered while the job was
                # still starting can make an earlier op look MISSING; wait for the hang itself)
                if f"(seq 3) float32 (4,) -- reached by ranks {list(range(n - 1))}, MISSING on ranks [{n - 1}]" in text:
                    break
                time.sleep(0.2)
            seen["text"] = text
            # the server wants its token
            from gpucoll._debug.control_plane import STORE_PREFIX
            client = gpucoll.TCPStore(store["addr"], int(store["port"]), is_master=False, timeout=5,
                                      token=store["token"])
            rank0 = json.loads(client.get(f"{STORE_PREFIX}/0").decode())
            client.close()
            url = f"http://{rank0['host']}:{rank0['port']}/ping"
            try:
                urllib.request.urlopen(url, timeout=5)
            except urllib.error.HTTPError as exc:
                seen["no_token"] = exc.code
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {rank0['token']}"})
            with urllib.request.urlopen(request, timeout=5) as reply:
                seen["ping"] = json.loads(reply.read())
            seen["host"] = rank0["host"]
        finally:
            open(release, "w").close()

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    results = run_spmd(_hang_body, n, args=(release, 60.0, str(info)), pg_timeout=60.0, timeout=120,
                       env={"GPUCOLL_CONTROL_PLANE": "1", "GPUCOLL_DEBUG": "INFO"})
    thread.join(10)
    assert results == ["completed"] * n  # status did not disturb the job
    text = seen["text"]
    assert seen["rc"] == 0 and f"asked {n} rank(s)" in text and f"{n} answered" in text, text
    assert (f"first op not reached by every rank: all_reduce (seq 3) float32 (4,) -- reached by ranks [0, 1], "
            f"MISSING on ranks [2]") in text, text
    assert "rank 2 (global 2" in text and "last op all_reduce (seq 2) float32 (4,) [completed]" in text
    assert "main thread: slow_data_loader (test_hang_tools.py:" in text, text
    assert seen["no_token"] == 401 and seen["ping"] == "pong" and seen["host"] == "127.0.0.1"


def test_the_control_plane_is_off_by_default_and_status_says_so() -> None:
    server = gpucoll.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    try:
        err = io.StringIO()
        from contextlib import redirect_stderr
        with redirect_stderr(err):
            assert main(["status", f"127.0.0.1:{server.port}", "--timeout", "2"]) == 2
        assert "GPUCOLL_CONTROL_PLANE=1" in err.getvalue()
    finally:
        server.close()
    with pytest.raises(ValueError, match="GPUCOLL_CONTROL_PLANE must be 1, HOST or HOST:PORT"):
        from gpucoll._debug.control_plane import maybe_start
        os.environ["GPUCOLL_CONTROL_PLANE"] = "a:b"
        try:
            maybe_start(gpucoll.HashStore(), 0, 1, lambda: [])
        finally:
            del os.environ["GPUCOLL_CONTROL_PLANE"]


def _dump_with_stack(frames: list[tuple[str, int, str]], package: str | None) -> dict[str, Any]:
    text = "".join(f'  File "{path}", line {line}, in {func}\n    pass\n' for path, line, func in frames)
    dump: dict[str, Any] = {"group": "default_pg", "rank": 0, "global_rank": 0, "size": 1, "entries": [],
                            "stacks": {"MainThread (1)": text}}
    if package is not None:
        dump["package_dir"] = package
    return dump


@pytest.mark.parametrize("recorded", [True, False])
def test_user_frames_in_a_folder_named_gpucoll_are_shown(recorded: bool) -> None:
    """A library frame is one under the package's real directory, not any path with 'gpucoll' in it."""
    from gpucoll._debug import package_dir
    from gpucoll._debug.cli import _main_stack

    lib = package_dir()
    frames = [("/home/user/gpucoll/train.py", 40, "main"),
              ("/home/user/gpucoll/gpucoll_utils/steps.py", 12, "step"),
              (os.path.join(lib, "_collectives.py"), 99, "all_reduce")]
    line = _main_stack(_dump_with_stack(frames, lib if recorded else None))
    assert line == "in gpucoll <- step (steps.py:12) <- main (train.py:40)", line


def test_the_dumping_ranks_package_decides_not_the_readers() -> None:
    """A dump read on another machine: the rank's recorded package directory is used."""
    from gpucoll._debug.cli import _main_stack

    frames = [("/opt/job/gpucoll/run.py", 7, "main"),
              ("/site/packages/gpucoll/_collectives.py", 99, "all_reduce")]
    line = _main_stack(_dump_with_stack(frames, "/site/packages/gpucoll/"))
    assert line == "in gpucoll <- main (run.py:7)", line


def test_a_flight_recorder_dump_records_its_package_directory(tmp_path: Any) -> None:
    from gpucoll._debug import package_dir
    from gpucoll._debug.flight_recorder import FlightRecorder

    rec = FlightRecorder("g", rank=0, global_rank=0, size=1, capacity=4)
    path = rec.dump(str(tmp_path / "d.json"))
    data = json.loads(open(path, encoding="utf-8").read())
    assert data["package_dir"] == package_dir()
    assert os.path.isfile(os.path.join(data["package_dir"], "__init__.py"))
