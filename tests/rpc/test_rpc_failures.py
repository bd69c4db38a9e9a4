"""Failures and attacks, in one RPC world of three: two ranks of the harness and a third
worker, "victim", that rank 0 starts as a plain subprocess so that it can be killed.

- A connection to a worker's port that does not pass the handshake gets nothing
  unpickled (a pickle that would create a file if it were loaded is sent, bare, after a
  garbage greeting, and after a forged one); the worker goes on serving.
- A malformed or oversized frame from an authenticated peer closes that connection only.
- SIGKILL of a worker: the survivors' pending calls to it fail naming it within 2 s, new
  calls fail at once, and their graceful shutdown returns within its timeout (raising,
  naming the lost worker, as torch's does when a worker is gone).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import pytest

import gpucoll.rpc as rpc
from gpucoll.testing import run_spmd

_VICTIM = """
import os, time
import gpucoll.rpc as rpc
rpc.init_rpc("victim", rank=2, world_size=3)
time.sleep(120)
"""


class _Evil:
    """Unpickling this creates ``path``: the mark that a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def attack(host: str, port: int, mark: str) -> list[bool]:
    """Three unauthenticated attempts to get a pickle loaded; whether each was cut off."""
    from gpucoll._backends.cpu import auth

    evil = pickle.dumps(_Evil(mark), protocol=5)
    frame = struct.pack("<4sBBHQQ", b"GRPC", 2, 0, 0, 1, len(evil)) + evil
    results = []
    # 1. a frame straight away (no greeting)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(frame * 4)
        results.append(_closed_by_peer(s))
    # 2. a well-formed greeting, then a frame instead of the proof (no token: no valid MAC)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(auth.HELLO.pack(b"GPCRPC01", 1, 0, os.urandom(32)))
        auth.recv_exact(s, auth.REPLY.size)
        s.sendall(frame)
        results.append(_closed_by_peer(s))
    # 3. a forged proof (32 bytes of a guessed MAC), then a frame
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(auth.HELLO.pack(b"GPCRPC01", 1, 0, os.urandom(32)))
        auth.recv_exact(s, auth.REPLY.size)
        s.sendall(os.urandom(32) + frame)
        results.append(_closed_by_peer(s))
    return results


def malformed(agent: Any, target: int) -> list[bool]:
    """An authenticated connection that sends a bad frame, then one that declares too much."""
    from gpucoll.rpc import _wire

    host, port = agent.addresses[target]
    out = []
    for frame in (b"XXXX" + bytes(20), struct.pack("<4sBBHQQ", b"GRPC", 2, 0, 0, 1, 1 << 62),
                  struct.pack("<4sBBHQQ", b"GRPC", 2, 0, 60000, 1, 8)):
        with socket.create_connection((host, port), timeout=5) as s:
            _wire.dial_handshake(s, agent.key, agent.info.id, target)
            s.sendall(frame)
            out.append(_closed_by_peer(s))
    return out


def failure_checks(tmp: str) -> dict[str, Any]:
    import gpucoll

    rank = int(os.environ["RANK"])
    gpucoll.init_process_group("cpu")
    victim = None
    if rank == 0:
        env = dict(os.environ, RANK="2", WORLD_SIZE="3")
        victim = subprocess.Popen([sys.executable, "-c", _VICTIM], env=env)
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
        agent = rpc._get_current_rpc_agent()
        peer = f"worker{1 - rank}"
        out: dict[str, Any] = {}

        # unauthenticated connections: nothing unpickled, the worker still serves
        if rank == 1:
            mark = os.path.join(tmp, "unpickled")
            host, port = agent.addresses[0]
            out["cut_off"] = attack(host, port, mark)
            out["malformed_closed"] = malformed(agent, 0)
            time.sleep(0.2)
            out["unpickled"] = os.path.exists(mark)
            out["still_serves"] = rpc.rpc_sync("worker0", sum, args=([1, 2, 3],))
        gpucoll.barrier()

        # the victim answers, then is killed while calls to it are pending
        assert rpc.rpc_sync("victim", str.upper, args=("alive",)) == "ALIVE"
        pending = [rpc.rpc_async("victim", time.sleep, args=(30,)) for _ in range(3)]
        gpucoll.barrier()
        t0 = time.monotonic()  # before the kill on every rank: the measured delay is an upper bound
        gpucoll.barrier()
        if rank == 0:
            assert victim is not None
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
        errors = []
        for f in pending:
            with pytest.raises(gpucoll.errors.DistError) as info:
                f.wait()
            errors.append(str(info.value))
        out["pending_failed_s"] = time.monotonic() - t0
        assert all("victim" in e for e in errors), errors
        t1 = time.monotonic()
        with pytest.raises(gpucoll.errors.DistError, match="victim"):
            rpc.rpc_sync("victim", str.upper, args=("x",))
        out["new_call_failed_s"] = time.monotonic() - t1
        # the survivors still talk to each other
        assert rpc.rpc_sync(peer, str.lower, args=("OK",)) == "ok"
        gpucoll.barrier()
        t2 = time.monotonic()
        with pytest.raises(gpucoll.errors.DistError, match="victim"):
            rpc.shutdown(graceful=True, timeout=5)
        out["shutdown_s"] = time.monotonic() - t2
        with pytest.raises(RuntimeError, match="not been initialized"):
            rpc.get_worker_info()
        return out
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
        gpucoll.destroy_process_group()


def test_failures_and_attacks(tmp_path: Any) -> None:
    results = run_spmd(failure_checks, 2, init=False, timeout=120, args=(str(tmp_path),))
    attacker = results[1]
    assert attacker["cut_off"] == [True, True, True]
    assert attacker["malformed_closed"] == [True, True, True]
    assert attacker["unpickled"] is False and not (tmp_path / "unpickled").exists()
    assert attacker["still_serves"] == 6
    for r, out in enumerate(results):
        assert out["pending_failed_s"] < 2.0, (r, out)
        assert out["new_call_failed_s"] < 0.5, (r, out)
        assert out["shutdown_s"] < 5.0 + 1.0, (r, out)
