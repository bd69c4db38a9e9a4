"""A host that vanishes without closing its connections is noticed by TCP keepalive and
TCP_USER_TIMEOUT, not only when the connection breaks.

What the test really shows: two workers in a fresh network namespace; worker0 waits on a
call to worker1 that has no RPC timeout when the namespace's loopback goes down. From
then on no segment is delivered either way: no reply, no ACK, no FIN, as when a host is
powered off or partitioned (a SIGSTOPped process would not do: its kernel still ACKs).
The pending call fails naming worker1 within about USER_TIMEOUT s, and a new call to it
fails at once. Without the socket options the call waits forever (checked by hand: the
script then runs into its own 60 s limit). Needs ``unshare -n`` and ``ip`` (root in a
container is enough); skipped where they are not allowed. The workers use TCP
(``GPUCOLL_RPC_UNIX=0``): keepalive is what is tested, between hosts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpucoll.rpc import _conn

HERE = os.path.dirname(os.path.abspath(__file__))


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    try:
        return subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -n` and `ip` (a network namespace of its own)")
def test_vanished_host_fails_pending_calls_by_keepalive() -> None:
    # TCP, as between two hosts: same-host peers would otherwise talk over a Unix socket,
    # which the namespace's loopback going down does not touch.
    env = dict(os.environ, GPUCOLL_RPC_UNIX="0", PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)),
                                                                              os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(["unshare", "-n", sys.executable, os.path.join(HERE, "_vanish_world.py")],
                         capture_output=True, text=True, timeout=90, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    kind, message = out["pending"]
    assert kind == "PeerLostError" and "worker1" in message, out
    assert out["pending_s"] < _conn.USER_TIMEOUT + _conn.KEEPALIVE_IDLE + 3, out
    assert out["new"][0] == "PeerLostError" and "worker1" in out["new"][1], out
