"""The same-host transport's choices, in one process: which peers are dialed over a Unix
socket, and the fallback to TCP whenever something is in doubt (no identity, another
host or network namespace, the variable set to 0, a name nobody listens on, a listener
that does not hold the job's key). The worlds that use it are in test_rpc_failures.py."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any

import pytest

from gpucoll._backends.cpu import auth
from gpucoll.rpc import _conn, _local, _wire
from gpucoll.rpc._peers import unix_address

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or _local.host_identity() is None,
                                reason="no same-host transport here (not Linux)")


@pytest.fixture(autouse=True)
def _unix_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_local.ENV, "1")  # as by default, whatever the environment running the tests says


def _record(**extra: Any) -> dict[str, Any]:
    return {"name": "w", "host": "127.0.0.1", "port": 1, **extra}


def test_a_peer_is_dialed_over_unix_only_with_the_same_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    me = _local.host_identity()
    assert me is not None
    boot, _, ns = me.partition("/net:")
    assert boot and ns  # the boot id and the network namespace both take part
    assert unix_address(_record(unix="gpucoll-rpc-ab", local=me)) == "gpucoll-rpc-ab"
    assert unix_address(_record(unix="gpucoll-rpc-ab", local=f"{boot}/net:1:2")) is None  # another namespace
    assert unix_address(_record(unix="gpucoll-rpc-ab", local=f"other-boot/net:{ns}")) is None  # another host
    assert unix_address(_record(unix="gpucoll-rpc-ab")) is None  # no identity published
    assert unix_address(_record(local=me)) is None  # no name published (its worker has it off)
    assert unix_address(_record(unix=7, local=me)) is None
    monkeypatch.setenv(_local.ENV, "0")  # off here: not dialed even when the peer publishes one
    assert not _local.enabled()
    assert unix_address(_record(unix="gpucoll-rpc-ab", local=me)) is None
    assert _local.listen() is None


def test_the_transport_is_on_by_default_and_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_local.ENV, raising=False)
    assert _local.enabled()
    listening = _local.listen()
    assert listening is not None
    listening[0].close()
    for value, on in (("1", True), (" 1 ", True), ("0", False), (" 0", False)):
        monkeypatch.setenv(_local.ENV, value)
        assert _local.enabled() is on, value


def test_a_name_nobody_listens_on_falls_back_at_once() -> None:
    t = time.monotonic()
    assert _conn.dial_unix("gpucoll-rpc-" + os.urandom(16).hex(), b"k" * 32, 1, 0) is None
    assert time.monotonic() - t < 1.0
    with pytest.raises(auth.HandshakeError, match="not an RPC worker's Unix address"):
        _local.connect("someone-elses-name", 1.0)


def _serve_one(listener: socket.socket, key: bytes, got: list[Any]) -> None:
    sock, _ = listener.accept()
    with sock:
        sock.settimeout(5)
        try:
            got.append(_wire.listen_handshake(sock, key, 0, True, lambda p: p == 1))
        except Exception as e:  # noqa: BLE001 -- what the listener refused, for the test to see
            got.append(e)


def test_the_handshake_runs_on_the_unix_socket_and_a_wrong_key_falls_back() -> None:
    made = _local.listen()
    assert made is not None
    listener, name = made
    with listener:
        assert listener.family == socket.AF_UNIX and listener.getsockname() == b"\0" + name.encode()
        assert not os.path.exists(name)  # abstract: nothing on the file system
        for listener_key, dialer_key, ok in ((b"a" * 32, b"a" * 32, True), (b"a" * 32, b"b" * 32, False)):
            got: list[Any] = []
            t = threading.Thread(target=_serve_one, args=(listener, listener_key, got))
            t.start()
            sock = _conn.dial_unix(name, dialer_key, 1, 0)
            t.join(10)
            if ok:
                assert sock is not None and _local.family_name(sock) == "unix" and got == [1]
                sock.close()
            else:  # the listener's proof fails under our key: no connection, the caller dials TCP
                assert sock is None and len(got) == 1 and isinstance(got[0], Exception), got


def test_the_peer_check_reads_the_uid() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        _local.check_peer(a, "the other end")  # our own process: passes
    tcp = socket.socket()
    with tcp:
        with pytest.raises(auth.HandshakeError, match="a TCP socket"):
            _local.check_peer(tcp, "a TCP socket")  # no peer process (uid -1): refused, not waved through
