"""The same-host transport: a Unix stream socket between two workers of one host.

Unless ``GPUCOLL_RPC_UNIX=0`` (see docs/rpc.md), each worker (on Linux) listens on a Unix
socket in the abstract namespace besides its TCP port, and publishes its name with a host identity:
the boot id and the network namespace (abstract names are per network namespace). A
dialer whose own identity is the same connects there; whenever in doubt (no identity on
either side, the variable set to ``0`` on either side, a name that cannot be connected or
a handshake that fails there) it dials the TCP port as before. The abstract namespace has
no file to create or remove, and no file permissions either: every process of the
namespace may connect, so both ends check the other's credentials (``SO_PEERCRED``: the
uid must be this process's) before anything else, and the job's token handshake follows,
as on TCP. Nothing is unpickled before both have passed.

A Unix socket has no keepalive: a peer that exits or is killed closes it (the kernel
does), which the connection's reader sees at once as a hang-up; the host vanishing takes
both ends with it.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import sys

from .._backends.cpu import auth
from .._env import RPC_UNIX_ENV

__all__ = ["ENV", "enabled", "host_identity", "listen", "connect", "check_peer", "tune", "family_name"]

ENV = RPC_UNIX_ENV
_PREFIX = "gpucoll-rpc-"
_BUFFER_BYTES = 4 << 20  # socket buffers: the default (~200 KiB) cuts large arrays into many wake-ups
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def enabled() -> bool:
    """Whether this process uses the same-host transport (Linux, unless ``GPUCOLL_RPC_UNIX=0``)."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1").strip() != "0" and hasattr(socket, "AF_UNIX")


def host_identity() -> str | None:
    """What two workers must share to reach each other's abstract Unix socket: the host's
    boot id and the network namespace (its device and inode). None when either cannot be
    read: the TCP path is then the only one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    if not boot:
        return None
    return f"{boot}/net:{ns.st_dev}:{ns.st_ino}"


def tune(sock: socket.socket) -> None:
    """A same-host connection's socket options: buffers large enough for an array in few writes."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _BUFFER_BYTES)
        except OSError:  # a lower system limit: the kernel's own size then
            pass


def listen() -> tuple[socket.socket, str] | None:
    """A listening Unix socket under a fresh random abstract name, and that name (without
    the leading NUL); None when the same-host transport is off or cannot be set up."""
    if not enabled():
        return None
    name = _PREFIX + secrets.token_hex(16)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(1024)
    except OSError:
        sock.close()
        return None
    return sock, name


def connect(name: str, timeout: float) -> socket.socket:
    """Connect to a worker's abstract name and check that its owner is this user.

    Raises:
        OSError: the name cannot be connected.
        auth.HandshakeError: the socket belongs to another user.
    """
    if not name.startswith(_PREFIX):
        raise auth.HandshakeError(f"{name!r} is not an RPC worker's Unix address")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
        check_peer(sock, f"the worker at Unix address {name!r}")
        tune(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def check_peer(sock: socket.socket, who: str) -> None:
    """Refuse a Unix connection whose other end is not a process of this user.

    Raises:
        auth.HandshakeError: another user, or credentials that cannot be read.
    """
    try:
        _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except (OSError, AttributeError, struct.error) as e:
        raise auth.HandshakeError(f"the credentials of {who} cannot be read ({e})") from e
    if uid != os.getuid():
        raise auth.HandshakeError(f"{who} comes from a process of uid {uid}, not this user (uid {os.getuid()})")


def family_name(sock: socket.socket) -> str:
    """``"unix"`` or ``"tcp"``: the transport a connection's socket uses."""
    return "unix" if sock.family == getattr(socket, "AF_UNIX", None) else "tcp"
