"""CPU transport under faults and hostile peers: re-init generations, dead senders mid-frame,
stalled peers named, authenticated connections, host identity, /dev/shm cleanup, object size limit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd

PG_TIMEOUT = 3.0
MiB = 1 << 20


def _quiet_destroy() -> None:
    import gpucoll
    from gpucoll._world import default_group

    try:
        if gpucoll.is_initialized():
            gpucoll.destroy_process_group()
    except Exception:
        pass  # broken on purpose


def _as_victim(act: Any) -> int:
    """Run ``act`` in a forked child that takes this rank's place and dies; return its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            act()
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(3)
    os.waitpid(pid, 0)
    return pid


# ----- 1. re-init: every init gets its own generation -----

def reinit_body(cycles: int) -> int:
    import gpucoll
    from gpucoll._world import default_group

    r = int(os.environ["RANK"])
    n = int(os.environ["WORLD_SIZE"])
    for c in range(cycles):
        gpucoll.init_process_group("cpu", timeout=10.0)
        x = np.full(4, float(r + 10 * c))
        gpucoll.all_reduce(x)
        want = sum(q + 10 * c for q in range(n))
        assert (x == want).all(), f"cycle {c}: all_reduce gave {x[0]}, expected {want}"
        out: list[Any] = [None] * n
        gpucoll.all_gather_object(out, (r, c))
        assert out == [(q, c) for q in range(n)], f"cycle {c}: all_gather_object gave {out}"
        gpucoll.destroy_process_group()
    return cycles


@pytest.mark.parametrize("world,cycles", [(2, 50), (3, 4)])
def test_reinit_cycles_never_read_another_cycle(world: int, cycles: int) -> None:
    assert run_spmd(reinit_body, world, args=(cycles,), init=False, timeout=120) == [cycles] * world


# ----- 2. dead sender mid-frame, send to an aborted peer, stalled peers, monitored_barrier -----

def recv_mid_frame_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group
    from gpucoll._backends.cpu.tcp import _HDR, KIND_P2P

    r = int(os.environ["RANK"])
    if r == 0:
        def act() -> None:
            gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT, )
            ready = np.zeros(1)
            gpucoll.recv(ready, src=1)  # rank 1 has posted its receive
            mesh = default_group()._cpu._mesh
            # A 64 MiB frame whose payload stops after 1 MiB: the sender dies mid-stream.
            mesh._socks[1].sendall(_HDR.pack(KIND_P2P, 0, 64 * MiB, 0) + bytes(MiB))
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        _as_victim(act)
        return None
    gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    buf = np.empty(64 * MiB, np.uint8)
    work = gpucoll.irecv(buf, src=0)
    gpucoll.send(np.ones(1), dst=0)
    t0 = time.monotonic()
    try:
        work.wait()
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    finally:
        _quiet_destroy()
    raise AssertionError("recv from a dead sender did not fail")


def test_recv_with_payload_in_flight_fails_fast_naming_the_dead_sender() -> None:
    elapsed, msg = run_spmd(recv_mid_frame_body, 2, init=False, timeout=60,
                            env={"GPUCOLL_CPU_TRANSPORT": "tcp"})[1]
    assert elapsed < 1.5, f"the receive failed after {elapsed:.2f} s (group timeout {PG_TIMEOUT} s): {msg}"
    assert "rank 0" in msg, msg


def send_to_aborted_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group
    from gpucoll._backends.cpu import tcp

    r = gpucoll.get_rank()
    if r == 0:
        mesh = default_group()._cpu._mesh
        orig = tcp.TcpMesh._deliver

        def stalled_reader(self: Any, peer: int, s: Any, kind: int, tag: int, nbytes: int, meta: int) -> None:
            if nbytes > MiB:  # stop reading big frames: the sender blocks mid-send
                while not self._closed:
                    time.sleep(0.01)
                raise EOFError("closed")
            orig(self, peer, s, kind, tag, nbytes, meta)

        tcp.TcpMesh._deliver = stalled_reader  # type: ignore[method-assign]
        assert mesh is not None
    gpucoll.barrier()
    if r == 0:
        time.sleep(0.5)
        default_group()._cpu.abort("rank 0 gave up: injected fault 4711")
        return None
    t0 = time.monotonic()
    try:
        gpucoll.send(np.zeros(64 * MiB, np.uint8), dst=0)
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    raise AssertionError("the send to an aborted peer did not fail")


def test_send_to_a_peer_that_aborted_names_its_reason() -> None:
    res = run_spmd(send_to_aborted_body, 2, pg_timeout=PG_TIMEOUT, timeout=60,
                   env={"GPUCOLL_CPU_TRANSPORT": "tcp"})
    elapsed, msg = res[1]
    assert "injected fault 4711" in msg and "rank 0" in msg, msg
    assert "Broken pipe" not in msg and "Bad file descriptor" not in msg, msg
    assert elapsed < 0.5 + 1.5, elapsed


def stalled_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group

    r = gpucoll.get_rank()
    pids: list[Any] = [None, None]
    gpucoll.all_gather_object(pids, os.getpid())
    os.environ["GPUCOLL_CPU_TRANSPORT"] = "tcp"
    g_tcp = gpucoll.new_group([0, 1])
    g_p2p = gpucoll.new_group([0, 1])
    gpucoll.barrier()
    if r == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None  # resumed by rank 0 when it is done; every group is broken by then
    time.sleep(0.3)
    msgs = []
    for what in ("all_reduce shm", "all_reduce tcp", "recv"):
        t0 = time.monotonic()
        try:
            if what == "recv":
                gpucoll.recv(np.empty(64 * MiB, np.uint8), src=1, group=g_p2p)
            else:
                gpucoll.all_reduce(np.ones(8 * MiB), group=None if what.endswith("shm") else g_tcp)
        except gpucoll.DistError as exc:
            msgs.append((what, time.monotonic() - t0, str(exc)))
    os.kill(pids[1], signal.SIGCONT)
    return msgs


def test_timeouts_with_a_stopped_peer_name_it() -> None:
    msgs = run_spmd(stalled_body, 2, pg_timeout=2.0, timeout=60)[0]
    assert [m[0] for m in msgs] == ["all_reduce shm", "all_reduce tcp", "recv"], msgs
    for what, elapsed, msg in msgs:
        assert "rank 1" in msg, (what, msg)
        assert elapsed < 2.0 + 5.0, (what, elapsed)


def barrier_dead_peer_body() -> Any:
    import gpucoll
    from gpucoll._world import default_group

    r = int(os.environ["RANK"])
    if r == 2:
        def act() -> None:
            gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
            os.kill(os.getpid(), signal.SIGKILL)
        _as_victim(act)
        return None
    gpucoll.init_process_group("cpu", timeout=PG_TIMEOUT)
    time.sleep(0.5)  # rank 2 is dead and the transport knows it
    t0 = time.monotonic()
    try:
        gpucoll.monitored_barrier(timeout=30.0)
    except gpucoll.DistError as exc:
        return time.monotonic() - t0, str(exc)
    finally:
        _quiet_destroy()
    raise AssertionError("monitored_barrier passed with a dead rank")


def test_monitored_barrier_stops_at_a_known_dead_peer() -> None:
    res = run_spmd(barrier_dead_peer_body, 3, init=False, timeout=60)
    for elapsed, msg in res[:2]:
        assert elapsed < 2.0, (elapsed, msg)
        assert "[2]" in msg, msg
