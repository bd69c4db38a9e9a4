"""bench/store_floor.c in Python: the least a store server written in Python can take.

It answers exactly what the C floor answers (HELLO with the server's limits, every other
complete frame at once with OK and one field, "1"), keeps nothing, and listens on the
same addresses (127.0.0.1, and the abstract Unix socket that gpucoll's clients on this
host try first), with one epoll loop on the main thread and one reused receive buffer:
no store, no parsing beyond each frame's length. store_bench.py's ``--impl floor-py``
drives it with gpucoll's own client beside ``floor``: what separates the two rows is
what the interpreter costs per request (a call into the socket module per recv and per
send, the GIL released and taken around each), which no server in Python avoids.

Usage: python bench/store_floor.py  (prints the port it listens on, then serves until killed)
"""

from __future__ import annotations

import select
import socket
import struct

_REPLY = struct.pack("<IBI", 6, 0, 1) + b"1"
_HELLO_CODE = 1
_HELLO_REPLY = struct.pack("<IB", 40, 0) + b"".join(
    struct.pack("<I", len(f)) + f for f in (b"4096", b"1048576", b"3145728", b"floor"))


def main() -> int:
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(65535)
    port = tcp.getsockname()[1]
    listeners = [tcp]
    ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ux.bind(f"\0gpucoll-store/127.0.0.1:{port}")
        ux.listen(65535)
        listeners.append(ux)
    except OSError:
        ux.close()  # the name is taken: clients use TCP
    ep = select.epoll()
    by_fd = {}
    for ls in listeners:
        ls.setblocking(False)
        ep.register(ls.fileno(), select.EPOLLIN)
        by_fd[ls.fileno()] = ls
    print(port, flush=True)
    socks: dict[int, socket.socket] = {}
    buf = bytearray(65536)
    unpack = struct.Struct("<I").unpack_from
    while True:
        for fd, _ in ep.poll():
            sock = socks.get(fd)
            if sock is None:
                ls = by_fd[fd]
                while True:
                    try:
                        sock, _ = ls.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    if ls is tcp:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setblocking(False)
                    socks[sock.fileno()] = sock
                    ep.register(sock.fileno(), select.EPOLLIN)
                continue
            try:
                n = sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                n = 0
            if not n:
                del socks[fd]
                sock.close()  # also leaves the epoll set
                continue
            if n == unpack(buf, 0)[0] + 4:  # one whole frame: the usual case
                sock.send(_HELLO_REPLY if buf[4] == _HELLO_CODE else _REPLY)
                continue
            # As the C floor: count the frames in this read and answer each.
            out = []
            pos = 0
            while pos + 5 <= n:
                out.append(_HELLO_REPLY if buf[pos + 4] == _HELLO_CODE else _REPLY)
                pos += 4 + unpack(buf, pos)[0]
            if out:
                sock.send(b"".join(out))


if __name__ == "__main__":
    raise SystemExit(main())
