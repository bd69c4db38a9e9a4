"""Failures and attacks, in one RPC world of three: two ranks of the harness and a third
worker, "victim", that rank 0 starts as a plain subprocess so that it can be killed.

- A connection to a worker's port, or to its same-host Unix address, that does not pass
  the handshake gets nothing unpickled (a pickle that would create a file if it were
  loaded is sent, bare, after a garbage greeting, after a forged proof, and after a
  handshake run with the wrong token); the worker goes on serving. On the Unix address,
  a process of another user is cut off before its greeting is answered (when the test
  runs as root and can start one).
- A malformed or oversized frame from an authenticated peer closes that connection only.
- SIGKILL of a worker: the survivors' pending calls to it fail naming it within 2 s, new
  calls fail at once, and their graceful shutdown returns within its timeout (raising,
  naming the lost worker, as torch's does when a worker is gone).

The world runs twice: with the same-host transport (the default: every connection is a
Unix socket, which the test checks, so that it cannot fall back to TCP unnoticed) and
with ``GPUCOLL_RPC_UNIX=0`` (every connection TCP).
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
from gpucoll.rpc import _local
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


def _dialer(address: Any) -> Any:
    """A connect function for a TCP ``(host, port)`` or an abstract Unix name."""
    if isinstance(address, str):
        def unix() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect("\0" + address)
            return s
        return unix
    return lambda: socket.create_connection(address, timeout=5)


def attack(address: Any, mark: str) -> list[bool]:
    """Four unauthenticated attempts to get a pickle loaded (from a process of this user);
    whether each was cut off."""
    from gpucoll._backends.cpu import auth
    from gpucoll.rpc import _wire

    connect = _dialer(address)
    evil = pickle.dumps(_Evil(mark), protocol=5)
    frame = struct.pack("<4sBBHQQ", b"GRPC", 2, 0, 0, 1, len(evil)) + evil
    results = []
    # 1. a frame straight away (no greeting)
    with connect() as s:
        s.sendall(frame * 4)
        results.append(_closed_by_peer(s))
    # 2. a well-formed greeting, then a frame instead of the proof (no token: no valid MAC)
    with connect() as s:
        s.sendall(auth.HELLO.pack(b"GPCRPC01", 1, 0, os.urandom(32)))
        auth.recv_exact(s, auth.REPLY.size)
        s.sendall(frame)
        results.append(_closed_by_peer(s))
    # 3. a forged proof (32 bytes of a guessed MAC), then a frame
    with connect() as s:
        s.sendall(auth.HELLO.pack(b"GPCRPC01", 1, 0, os.urandom(32)))
        auth.recv_exact(s, auth.REPLY.size)
        s.sendall(os.urandom(32) + frame)
        results.append(_closed_by_peer(s))
    # 4. the whole handshake run with a wrong token's key, then a frame
    with connect() as s:
        try:
            _wire.dial_handshake(s, os.urandom(32), 1, 0)
            results.append(False)  # the listener must not accept a wrong key
        except auth.HandshakeError:  # the listener's proof does not check out under our key
            s.sendall(os.urandom(32) + frame)
            results.append(_closed_by_peer(s))
    return results


def other_user_attack(name: str) -> int | None:
    """Bytes a process of another user (nobody) got back for a well-formed greeting on a
    worker's Unix address (0: cut off unanswered); None where no such process can be made
    (not root). The child is a fork that drops to uid 65534 and only touches a socket."""
    from gpucoll._backends.cpu import auth

    if os.getuid() != 0:
        return None
    hello = auth.HELLO.pack(b"GPCRPC01", 1, 0, os.urandom(32))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect("\0" + name)
            try:  # refused before the greeting is read: the send itself may find the socket closed
                s.sendall(hello)
                got = s.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                got = b""
            os.write(w, str(len(got)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    _, status = os.waitpid(pid, 0)
    return int(answer) if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and answer else -1


def malformed(agent: Any, address: Any, target: int) -> list[bool]:
    """An authenticated connection that sends a bad frame, then one that declares too much."""
    from gpucoll.rpc import _wire

    connect = _dialer(address)
    out = []
    for frame in (b"XXXX" + bytes(20), struct.pack("<4sBBHQQ", b"GRPC", 2, 0, 0, 1, 1 << 62),
                  struct.pack("<4sBBHQQ", b"GRPC", 2, 0, 60000, 1, 8)):
        with connect() as s:
            _wire.dial_handshake(s, agent.key, agent.info.id, target)
            s.sendall(frame)
            out.append(_closed_by_peer(s))
    return out


def failure_checks(tmp: str, transport: str) -> dict[str, Any]:
    import gpucoll

    # Before init_rpc; the victim inherits it.
    os.environ["GPUCOLL_RPC_UNIX"] = "1" if transport == "unix" else "0"
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
            out["cut_off"] = attack(agent.addresses[0], mark)
            out["malformed_closed"] = malformed(agent, agent.addresses[0], 0)
            out["unix_address"] = agent.unix_addresses.get(0)
            if out["unix_address"] is not None:
                out["unix_cut_off"] = attack(out["unix_address"], mark)
                out["unix_malformed_closed"] = malformed(agent, out["unix_address"], 0)
                out["other_user_got"] = other_user_attack(out["unix_address"])
            time.sleep(0.2)
            out["unpickled"] = os.path.exists(mark)
            out["still_serves"] = rpc.rpc_sync("worker0", sum, args=([1, 2, 3],))
        gpucoll.barrier()

        # the victim answers, then is killed while calls to it are pending
        assert rpc.rpc_sync("victim", str.upper, args=("alive",)) == "ALIVE"
        assert rpc.rpc_sync(peer, str.lower, args=("A",)) == "a"
        out["transports"] = rpc._get_debug_info()["agent.connections"]
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


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_failures_and_attacks(tmp_path: Any, transport: str) -> None:
    if transport == "unix" and (not sys.platform.startswith("linux") or _local.host_identity() is None):
        pytest.skip("no same-host transport here (not Linux)")
    results = run_spmd(failure_checks, 2, init=False, timeout=120, args=(str(tmp_path), transport))
    attacker = results[1]
    assert attacker["cut_off"] == [True, True, True, True]
    assert attacker["malformed_closed"] == [True, True, True]
    if transport == "unix":
        assert attacker["unix_address"], attacker
        assert attacker["unix_cut_off"] == [True, True, True, True]
        assert attacker["unix_malformed_closed"] == [True, True, True]
        assert attacker["other_user_got"] in (0, None), attacker  # None: not root, not tried; -1: failed
    else:
        assert attacker["unix_address"] is None
    assert attacker["unpickled"] is False and not (tmp_path / "unpickled").exists()
    assert attacker["still_serves"] == 6
    for r, out in enumerate(results):
        # every connection a worker dialed (to the other rank, to the victim) uses the transport
        links = dict(item.split("=") for item in out["transports"].split(","))
        assert set(links) == {f"worker{1 - r}", "victim"} and set(links.values()) == {transport}, (r, out)
        assert out["pending_failed_s"] < 2.0, (r, out)
        assert out["new_call_failed_s"] < 0.5, (r, out)
        assert out["shutdown_s"] < 5.0 + 1.0, (r, out)
