"""Who a CPU-transport peer is: host identity, the group key, and the connection handshake.

Security model (docs/security.md): a connection between two ranks counts only after
a mutual challenge-response over fresh nonces, keyed by the job's store token (every
rank has it; a process without it cannot answer). A peer whose socket lives on this
host (same network namespace) must also belong to this user: its owner is read from
``/proc/net/tcp`` (TCP's counterpart of ``SO_PEERCRED``). Nothing published in the
store (addresses, ports) is trusted by itself: a forged address leads to a
connection that fails the handshake.

Without a token (torchrun, srun, mpirun without ``GPUCOLL_STORE_TOKEN``) the key is
a public constant: same-host peers are still checked by owner, peers on other hosts
are then trusted by their network address only (documented as the residual risk).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
from typing import Any, Container

from ..._env import STORE_TOKEN_ENV

__all__ = ["host_id", "group_key", "peer_uid", "is_local_peer", "HELLO", "REPLY", "PROOF", "MAGIC",
           "make_hello", "make_reply", "check_reply", "check_proof", "check_local_owner", "HandshakeError", "OK",
           "ListenerHandshake", "recv_exact"]

MAGIC = b"GPCCPU01"
HELLO = struct.Struct("<8sqq32s")  # magic, dialer's rank, listener's rank, dialer's nonce
REPLY = struct.Struct("<32s32s")  # listener's nonce, listener's MAC
PROOF = struct.Struct("<32s")  # dialer's MAC
OK = b"\x01"
_PUBLIC_KEY = hashlib.sha256(b"gpucoll cpu transport: no store token").digest()


class HandshakeError(Exception):
    """A connection failed authentication (it is dropped; setup goes on)."""


def host_id() -> str:
    """This host's identity: hostname, boot id and network-namespace inode.

    Two containers (or network namespaces) with the same hostname get different ids,
    so they are never taken for one host (no loopback, no shared memory between them).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "nonetns"
    return f"{socket.gethostname()}/{boot}/{netns}"


def _store_token(store: Any) -> bytes | None:
    """The job store's token: GPUCOLL_STORE_TOKEN, else the token of the store under the prefixes."""
    env = os.environ.get(STORE_TOKEN_ENV)
    if env:
        return env.encode()
    seen = 0
    while store is not None and seen < 32:
        token = getattr(store, "_token", None)
        if isinstance(token, (bytes, str)) and token:
            return token.encode() if isinstance(token, str) else token
        store = getattr(store, "_store", None)
        seen += 1
    return None


def group_key(store: Any) -> tuple[bytes, bool]:
    """The key of the transport handshake and whether it is secret (derived from a token)."""
    token = _store_token(store)
    if token is None:
        return _PUBLIC_KEY, False
    return hmac.new(token, b"gpucoll cpu transport v1", hashlib.sha256).digest(), True


def _mac(key: bytes, role: bytes, a: int, b: int, n1: bytes, n2: bytes) -> bytes:
    return hmac.new(key, role + struct.pack("<qq", a, b) + n1 + n2, hashlib.sha256).digest()


def make_hello(me: int, peer: int) -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(32)
    return HELLO.pack(MAGIC, me, peer, nonce), nonce


def make_reply(key: bytes, me: int, dialer: int, dialer_nonce: bytes) -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(32)
    return REPLY.pack(nonce, _mac(key, b"L", me, dialer, dialer_nonce, nonce)), nonce


def check_reply(key: bytes, me: int, peer: int, my_nonce: bytes, reply: bytes) -> bytes:
    """Verify the listener's reply; return the proof to send back."""
    nonce, mac = REPLY.unpack(reply)
    if not hmac.compare_digest(mac, _mac(key, b"L", peer, me, my_nonce, nonce)):
        raise HandshakeError(f"the process listening at rank {peer}'s published address failed "
                             "authentication (it does not hold the job's store token)")
    return PROOF.pack(_mac(key, b"D", me, peer, nonce, my_nonce))


def check_proof(key: bytes, me: int, dialer: int, my_nonce: bytes, dialer_nonce: bytes, proof: bytes) -> None:
    (mac,) = PROOF.unpack(proof)
    if not hmac.compare_digest(mac, _mac(key, b"D", dialer, me, my_nonce, dialer_nonce)):
        raise HandshakeError(f"a connection claiming to be rank {dialer} failed authentication")


def is_local_peer(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` is a socket of this network namespace."""
    try:
        peer_ip = sock.getpeername()[0]
        my_ip = sock.getsockname()[0]
    except OSError:
        return False
    return bool(peer_ip.startswith("127.") or peer_ip == "::1" or peer_ip == my_ip)


def _hex_addr(ip: str, port: int) -> str:
    return f"{struct.unpack('<I', socket.inet_aton(ip))[0]:08X}:{port:04X}"


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of a TCP connection within this host's namespace.

    Reads ``/proc/net/tcp``: the peer's socket is the entry whose local address is our
    remote one and whose remote address is our local one. None if it cannot be found.
    """
    try:
        mine = sock.getsockname()
        theirs = sock.getpeername()
        want_local, want_remote = _hex_addr(theirs[0], theirs[1]), _hex_addr(mine[0], mine[1])
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                cols = line.split()
                if len(cols) > 7 and cols[1] == want_local and cols[2] == want_remote:
                    return int(cols[7])
    except (OSError, ValueError, StopIteration):
        return None
    return None


def check_local_owner(sock: socket.socket, peer: int, *, strict: bool) -> None:
    """Refuse a same-host peer socket owned by another user (with ``strict``, also one
    whose owner cannot be found: then nothing else authenticates it)."""
    if not is_local_peer(sock):
        return
    uid = peer_uid(sock)
    if uid is None and not strict:
        return
    if uid != os.getuid():
        raise HandshakeError(f"the connection for rank {peer} comes from a process of uid {uid}, "
                             f"not this user (uid {os.getuid()})")


class ListenerHandshake:
    """The listener's side of one incoming connection's handshake (non-blocking)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.buf = bytearray()
        self.want = HELLO.size
        self.peer = -1
        self.dialer_nonce = b""
        self.nonce = b""

    def step(self, s: socket.socket, rank: int, size: int, connected: Container[int], key: bytes,
             secret: bool) -> int | None:
        """Read what arrived; the dialer's rank once it has proven itself, else None."""
        chunk = s.recv(self.want - len(self.buf))
        if not chunk:
            raise EOFError("closed during the handshake")
        self.buf += chunk
        if len(self.buf) < self.want:
            return None
        data, self.buf = bytes(self.buf), bytearray()
        if self.peer < 0:
            magic, peer, target, self.dialer_nonce = HELLO.unpack(data)
            if magic != MAGIC or target != rank or not rank < peer < size \
                    or peer in connected:
                raise HandshakeError(f"a connection with a bad greeting (rank {peer}, for rank {target})")
            check_local_owner(s, peer, strict=not secret)
            reply, self.nonce = make_reply(key, rank, peer, self.dialer_nonce)
            if s.send(reply) != len(reply):
                raise HandshakeError("could not answer the handshake at once")
            self.peer, self.want = peer, PROOF.size
            return None
        check_proof(key, rank, self.peer, self.nonce, self.dialer_nonce, data)
        if self.peer in connected:
            raise HandshakeError(f"rank {self.peer} connected twice")
        s.send(OK)
        return self.peer


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed during handshake")
        got += k
    return bytes(buf)
