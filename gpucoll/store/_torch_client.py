"""One client connection that speaks torch's TCPStore protocol (see _torch_wire).

Used when a gpucoll TCPStore finds a torch server (a torch master, or torchrun's agent
store). What torch's protocol lacks is done the way torch's own client does it: ``get``
is WAIT then GET (two round trips), a timed-out ``wait`` sends CANCEL_WAIT. Keys carry
torch's "/" prefix on the wire, so both kinds of client see the same keys.
"""

from __future__ import annotations

import os
import socket
import time

from ..errors import DistStoreError
from . import _torch_wire as tw
from ._torch_wire import Q

__all__ = ["TorchConnection", "TORCH_MAX_VALUE"]

TORCH_MAX_VALUE = 8 * 1024 * 1024
"""The largest value (and key) torch's libuv server accepts; it resets the connection on
a larger one, so the client refuses it before sending."""


class WaitTimedOut(Exception):
    """A WAIT ran out of time and was cancelled."""


class TorchConnection:
    """One socket to a torch server, validated and pinged; one request at a time."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def open(cls, sock: socket.socket, timeout: float) -> TorchConnection:
        """Send VALIDATE and PING on a connected socket and check the echo."""
        nonce = os.getpid() & 0xFFFFFFF
        sock.settimeout(timeout)
        sock.sendall(tw.PREFIX + bytes([Q.PING]) + tw.U32.pack(nonce))
        conn = cls(sock)
        got = conn._recv(4)
        if tw.U32.unpack(got)[0] != nonce:
            raise DistStoreError(f"the torch server answered PING with {got!r}, not the nonce")
        return conn

    # -- bytes --------------------------------------------------------------------------

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise ConnectionResetError("the torch server closed the connection")
            buf += got
        return bytes(buf)

    def _i64(self) -> int:
        return int(tw.I64.unpack(self._recv(8))[0])

    def _string(self) -> bytes:
        return self._recv(int(tw.U64.unpack(self._recv(8))[0]))

    def _send(self, q: int, *parts: bytes) -> None:
        self.sock.sendall(tw.request(q, *parts))

    @staticmethod
    def _keys(keys: list[bytes]) -> bytes:
        return tw.U64.pack(len(keys)) + b"".join(tw.string(tw.KEY_PREFIX + k) for k in keys)

    @staticmethod
    def _key(key: bytes) -> bytes:
        return tw.string(tw.KEY_PREFIX + key)

    # -- operations ---------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        self._send(Q.SET, self._key(key), tw.string(value))

    def wait(self, keys: list[bytes], timeout: float, request_timeout: float) -> None:
        """WAIT for ``keys``; raise WaitTimedOut after cancelling it at ``timeout``."""
        self._send(Q.WAIT, self._keys(keys))
        self.sock.settimeout(timeout)
        try:
            reply = self._recv(1)
        except TimeoutError:
            self.sock.settimeout(request_timeout)
            self._send(Q.CANCEL_WAIT)
            reply = self._recv(1)
            if reply == tw.STOP_WAITING:  # the keys came just before the cancel
                reply = self._recv(1)
            if reply != tw.WAIT_CANCELED:
                raise DistStoreError(f"torch server answered CANCEL_WAIT with {reply!r}") from None
            raise WaitTimedOut from None
        finally:
            self.sock.settimeout(request_timeout)
        if reply != tw.STOP_WAITING:
            raise DistStoreError(f"torch server answered WAIT with {reply!r}")

    def get(self, keys: list[bytes]) -> list[bytes]:
        """GET or MULTI_GET of keys known to exist (call :meth:`wait` first)."""
        if len(keys) == 1:
            self._send(Q.GET, self._key(keys[0]))
        else:
            self._send(Q.MULTI_GET, self._keys(keys))
        return [self._string() for _ in keys]

    def add(self, key: bytes, amount: int) -> int:
        self._send(Q.ADD, self._key(key), tw.I64.pack(amount))
        return self._i64()

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        self._send(Q.COMPARE_SET, self._key(key), tw.string(expected), tw.string(desired))
        return self._string()

    def check(self, keys: list[bytes]) -> bool:
        self._send(Q.CHECK, self._keys(keys))
        reply = self._recv(1)
        if reply not in (tw.READY, tw.NOT_READY):
            raise DistStoreError(f"torch server answered CHECK with {reply!r}")
        return reply == tw.READY

    def delete_key(self, key: bytes) -> bool:
        self._send(Q.DELETE_KEY, self._key(key))
        return self._i64() == 1

    def num_keys(self) -> int:
        self._send(Q.GETNUMKEYS)
        return self._i64()

    def append(self, key: bytes, value: bytes) -> None:
        self._send(Q.APPEND, self._key(key), tw.string(value))

    def multi_set(self, keys: list[bytes], values: list[bytes]) -> None:
        parts = [tw.U64.pack(len(keys))]
        for k, v in zip(keys, values):
            parts.append(self._key(k))
            parts.append(tw.string(v))
        self._send(Q.MULTI_SET, *parts)

    def queue_push(self, key: bytes, value: bytes) -> None:
        self._send(Q.QUEUE_PUSH, self._key(key), tw.string(value))

    def queue_pop_now(self, key: bytes) -> bytes | None:
        self._send(Q.QUEUE_POP, self._key(key))
        if self._i64() == 0:
            return None
        return self._string()

    def queue_len(self, key: bytes) -> int:
        self._send(Q.QUEUE_LEN, self._key(key))
        return self._i64()

    def list_keys(self) -> list[bytes]:
        self._send(Q.LIST_KEYS)
        n = int(tw.U64.unpack(self._recv(8))[0])
        keys = [self._string() for _ in range(n)]
        return [k[1:] if k[:1] == tw.KEY_PREFIX else k for k in keys]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def deadline_left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
