"""A store load generator: thousands of store clients per process, for the benchmark.

A client here is a socket and a small script (a Python generator) of store requests,
driven by one epoll loop per process, so that 16,384 clients cost a few processes
rather than 16,384 threads and the server, not the generator, is what is measured.
Two wire protocols, byte for byte what the real clients send:

* ``gpucoll``: gpucoll's frames (HELLO, then length-prefixed requests; see
  gpucoll/store/_wire.py), as ``TCPStore(..., protocol="gpucoll")`` sends them over TCP;
* ``torch``: torch's c10d TCPStore protocol (VALIDATE, PING, then unframed requests;
  see gpucoll/store/_torch_wire.py), as torch's own client sends it, keys prefixed
  with "/". gpucoll's server speaks it too, so one generator drives both servers.

A script yields requests made by :class:`Ops` and receives each reply::

    def script(ops):
        n = yield ops.add("joined", 1)
        if n == total:
            yield ops.set("all", b"1")
        yield ops.wait(["go"])

:func:`drive` runs a list of scripts to the end (connect, greet, every request) and
returns when each finished; tests/store/test_store_loadgen.py checks that the store
state it leaves equals the real clients'.

Run as a script, it times one rendezvous directly against the same rendezvous through
node-local store relays (gpucoll/store/_relay.py), in the same sitting, taking turns::

    python bench/store_loadgen.py --relays 1024,4096 --per-node 256 --repeats 3

A "node" is a relay in a process of its own (as gpucoll-run's agent would run it) and
one generator process for its clients; the direct run uses the same generator
processes, each connecting to the server itself. The server is gpucoll's, in its own
process. Each line gives both times and the ratio relays / direct, with the number
of connections the server held while the clients were parked in ``wait``.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import sys
import time
from typing import Any, Callable, Generator, Optional

__all__ = ["Ops", "Request", "Script", "drive", "rendezvous_script", "relay_rendezvous"]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")

# gpucoll's opcodes and statuses (gpucoll/store/_wire.py), restated: the generator is
# an independent speaker of the protocol, not a user of the client's encoder.
_HELLO, _SET, _GET, _ADD, _WAIT, _CHECK = 1, 2, 3, 4, 6, 7
_OK = 0
_MAGIC = b"GPCS" + (1).to_bytes(2, "little")
# torch's query types (gpucoll/store/_torch_wire.py).
_T_VALIDATE, _T_SET, _T_GET, _T_ADD, _T_CHECK, _T_WAIT, _T_PING = 0, 1, 3, 4, 5, 6, 13
_T_MAGIC = 0x3C85F7CE

Parse = Callable[[bytearray], Optional[tuple[object, int]]]
"""Reads one reply from the front of a buffer: (value, bytes used), or None for "more"."""


class Request:
    __slots__ = ("data", "parse")

    def __init__(self, data: bytes, parse: Parse | None) -> None:
        self.data = data
        self.parse = parse
        """None: the request has no reply (torch's set)."""


Script = Callable[["Ops"], Generator[Request, object, None]]


def _frame(code: int, fields: list[bytes]) -> bytes:
    body = b"".join(_U32.pack(len(f)) + f for f in fields)
    return _U32.pack(1 + len(body)) + bytes([code]) + body


def _gp_reply(buf: bytearray) -> tuple[object, int] | None:
    """A gpucoll reply frame: (status, [fields])."""
    if len(buf) < 4:
        return None
    end = 4 + _U32.unpack_from(buf)[0]
    if len(buf) < end:
        return None
    fields, pos = [], 5
    while pos < end:
        n = _U32.unpack_from(buf, pos)[0]
        fields.append(bytes(buf[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return (buf[4], fields), end


def _fixed(size: int, conv: Callable[[bytes], object]) -> Parse:
    def parse(buf: bytearray) -> tuple[object, int] | None:
        return (conv(bytes(buf[:size])), size) if len(buf) >= size else None
    return parse


def _t_values(count: int) -> Parse:
    def parse(buf: bytearray) -> tuple[object, int] | None:
        out, pos = [], 0
        for _ in range(count):
            if len(buf) < pos + 8:
                return None
            n = _U64.unpack_from(buf, pos)[0]
            if len(buf) < pos + 8 + n:
                return None
            out.append(bytes(buf[pos + 8:pos + 8 + n]))
            pos += 8 + n
        return out, pos
    return parse


def _t_str(b: bytes) -> bytes:
    return _U64.pack(len(b)) + b


class _Failed(Exception):
    pass


class Ops:
    """Builds requests in one protocol; replies come back as Python values (add: int,
    get: bytes, check: bool, set and wait: None)."""

    def __init__(self, protocol: str, timeout: float = 120.0) -> None:
        if protocol not in ("gpucoll", "torch"):
            raise ValueError(f"protocol must be 'gpucoll' or 'torch'; got {protocol!r}")
        self.protocol = protocol
        self.timeout = timeout

    def greeting(self, nonce: int) -> Request:
        if self.protocol == "torch":
            data = bytes([_T_VALIDATE]) + _U32.pack(_T_MAGIC) + bytes([_T_PING]) + _U32.pack(nonce)
            return Request(data, _fixed(4, lambda b: _check(_U32.unpack(b)[0] == nonce, "ping", b)))
        # The same HELLO as the real client's (no token; the pad keeps the first byte
        # non-zero, see StoreLinks._hello).
        return Request(_frame(_HELLO, [_MAGIC, b"", b""]), self._ok("hello", lambda f: None))

    def _ok(self, what: str, conv: Callable[[list[bytes]], object]) -> Parse:
        def parse(buf: bytearray) -> tuple[object, int] | None:
            got = _gp_reply(buf)
            if got is None:
                return None
            (status, fields), used = got  # type: ignore[misc]
            if status != _OK:
                raise _Failed(f"{what}: status {status} {fields!r}")
            return conv(fields), used
        return parse

    def set(self, key: str, value: bytes) -> Request:
        k = key.encode()
        if self.protocol == "torch":
            return Request(bytes([_T_SET]) + _t_str(b"/" + k) + _t_str(value), None)
        return Request(_frame(_SET, [k, value]), self._ok("set", lambda f: None))

    def add(self, key: str, amount: int) -> Request:
        k = key.encode()
        if self.protocol == "torch":
            return Request(bytes([_T_ADD]) + _t_str(b"/" + k) + _I64.pack(amount),
                           _fixed(8, lambda b: _I64.unpack(b)[0]))
        return Request(_frame(_ADD, [k, b"%d" % amount]), self._ok("add", lambda f: int(f[0])))

    def wait(self, keys: list[str]) -> Request:
        ks = [k.encode() for k in keys]
        if self.protocol == "torch":
            data = bytes([_T_WAIT]) + _U64.pack(len(ks)) + b"".join(_t_str(b"/" + k) for k in ks)
            return Request(data, _fixed(1, lambda b: _check(b == b"\x00", "wait", b)))
        return Request(_frame(_WAIT, [_F64.pack(self.timeout)] + ks), self._ok("wait", lambda f: None))

    def get(self, key: str) -> Request:
        k = key.encode()
        if self.protocol == "torch":
            # torch's client: WAIT, then GET (two requests, two replies).
            data = (bytes([_T_WAIT]) + _U64.pack(1) + _t_str(b"/" + k)
                    + bytes([_T_GET]) + _t_str(b"/" + k))
            values = _t_values(1)

            def parse(buf: bytearray) -> tuple[object, int] | None:
                if not buf:
                    return None
                _check(buf[0] == 0, "get's wait", bytes(buf[:1]))
                got = values(buf[1:])
                return None if got is None else (got[0][0], got[1] + 1)  # type: ignore[index]
            return Request(data, parse)
        return Request(_frame(_GET, [_F64.pack(self.timeout), k]), self._ok("get", lambda f: f[0]))

    def check(self, keys: list[str]) -> Request:
        ks = [k.encode() for k in keys]
        if self.protocol == "torch":
            data = bytes([_T_CHECK]) + _U64.pack(len(ks)) + b"".join(_t_str(b"/" + k) for k in ks)
            return Request(data, _fixed(1, lambda b: b == b"\x00"))
        return Request(_frame(_CHECK, ks), self._ok("check", lambda f: f[0] == b"1"))


def _check(ok: bool, what: str, got: bytes) -> None:
    if not ok:
        raise _Failed(f"unexpected reply to {what}: {got!r}")


class _Client:
    __slots__ = ("i", "sock", "steps", "req", "buf", "done", "tries")

    def __init__(self, i: int) -> None:
        self.i = i
        self.sock: socket.socket | None = None
        self.steps: Generator[Request, object, None] | None = None
        self.req: Request | None = None
        self.buf = bytearray()
        self.done = 0.0
        self.tries = 0


def drive(host: str, port: int, protocol: str, scripts: list[Script], *,
          timeout: float = 120.0, connect_gap: int = 0, source: str | None = None,
          stats: dict[str, int] | None = None, unix: str | None = None) -> list[float]:
    """Run every script on its own connection to ``host:port``; return, per script, the
    ``time.monotonic()`` at which its last reply arrived.

    Connections are opened all at once (``connect_gap`` > 0: that many, then one poll
    round, and so on); a refused or reset connection is retried after 10-500 ms, as the
    real clients do. ``source``: the local address to connect from (another 127.x.y.z
    gives another 28,000 local ports on loopback, whose ports a 16k-client run and its
    TIME_WAITs otherwise use up). ``stats``, when given, gets "retries": connections
    that had to be made again. ``unix``: connect to this (abstract) Unix socket instead
    of ``host:port``, as a rank reaches a server or relay on its own host.

    Raises:
        RuntimeError: a client got an unexpected reply, or not every script finished
            within ``timeout`` seconds (naming how many did).
    """
    ops = Ops(protocol, timeout)
    ep = select.epoll()
    clients = [_Client(i) for i in range(len(scripts))]
    by_fd: dict[int, _Client] = {}
    retry: list[tuple[float, _Client]] = []
    left = len(clients)
    deadline = time.monotonic() + timeout
    addr = (host, port)

    def start(c: _Client) -> None:
        s = socket.socket(socket.AF_UNIX if unix is not None else socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if unix is None:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if source is not None:
                s.bind((source, 0))
        c.sock = s
        c.buf.clear()
        err = s.connect_ex(unix if unix is not None else addr)
        if unix is not None and err == errno.EAGAIN:
            # A Unix listener's backlog is full: no SYN to retransmit, so try again later.
            s.close()
            c.sock = None
            later(c)
            return
        if err not in (0, errno.EINPROGRESS):
            s.close()
            c.sock = None
            where = f"Unix socket {unix!r}" if unix is not None else f"{host}:{port}"
            raise RuntimeError(f"store load generator: connect to {where}: {errno.errorcode.get(err, err)}")
        by_fd[s.fileno()] = c
        ep.register(s.fileno(), select.EPOLLOUT)

    def lost(c: _Client) -> None:
        # Refused or reset before its greeting was answered: try again, like the client.
        assert c.sock is not None
        fd = c.sock.fileno()
        ep.unregister(fd)
        del by_fd[fd]
        c.sock.close()
        c.sock = None
        c.req = None
        if c.steps is not None:
            raise RuntimeError(f"store load generator: client {c.i} lost its connection mid-script")
        later(c)

    def later(c: _Client) -> None:
        """Connect ``c`` again after a back-off (10-500 ms, doubling), as the real client does."""
        c.tries += 1
        if stats is not None:
            stats["retries"] = stats.get("retries", 0) + 1
        retry.append((time.monotonic() + min(0.01 * 2 ** c.tries, 0.5), c))

    def advance(c: _Client, value: object) -> bool:
        """Send the script's next request, given the last reply; False at its end."""
        assert c.steps is not None and c.sock is not None
        while True:
            try:
                req = c.steps.send(value)
            except StopIteration:
                return False
            c.sock.sendall(req.data)  # small, on an empty socket buffer: never blocks
            if req.parse is not None:
                c.req = req
                return True
            value = None  # no reply to wait for (torch's set): straight on

    for k, c in enumerate(clients):
        start(c)
        if connect_gap and k % connect_gap == connect_gap - 1:
            ep.poll(0)
    while left:
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"store load generator: {len(clients) - left} of {len(clients)} "
                               f"clients finished within {timeout:g} s")
        if retry:
            due = [c for t, c in retry if t <= now]
            retry[:] = [(t, c) for t, c in retry if t > now]
            for c in due:
                start(c)
        for fd, ev in ep.poll(0.05 if retry else min(1.0, deadline - now)):
            c = by_fd[fd]
            s = c.sock
            assert s is not None
            if c.req is None and c.steps is None and ev & select.EPOLLOUT:
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    lost(c)
                    continue
                ep.modify(fd, select.EPOLLIN)
                nonce = 0x10000000 + c.i
                c.req = ops.greeting(nonce)
                s.sendall(c.req.data)
                continue
            try:
                data = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionError:
                data = b""
            if not data:
                lost(c)
                continue
            c.buf += data
            while c.req is not None:
                req = c.req
                assert req.parse is not None
                try:
                    got = req.parse(c.buf)
                except _Failed as e:
                    raise RuntimeError(f"store load generator: client {c.i}: {e}") from None
                if got is None:
                    break
                value, used = got
                del c.buf[:used]
                c.req = None
                if c.steps is None:  # the greeting's reply: the script starts
                    c.steps = scripts[c.i](ops)
                    value = None
                if not advance(c, value):
                    c.done = time.monotonic()
                    left -= 1
                    ep.unregister(fd)
                    del by_fd[fd]
                    s.close()
                    c.sock = None
                    break
    ep.close()
    return [c.done for c in clients]


def rendezvous_script(tag: str, n: int) -> Script:
    """One rank's part of the benchmark's rendezvous: join with ``add``, the last to
    join sets ``{tag}/all``, then every rank waits for ``{tag}/go`` (set by the master)."""
    def script(ops: Ops) -> Generator[Request, object, None]:
        joined = yield ops.add(f"{tag}/joined", 1)
        if joined == n:
            yield ops.set(f"{tag}/all", b"1")
        yield ops.wait([f"{tag}/go"])
    return script


# -- rendezvous through relays, against the same rendezvous direct ---------------------------

def _serve_store(conn: "Any") -> None:
    """A gpucoll store server in its own process; answers "count" with its connections."""
    from gpucoll.store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=300,
                     use_unix_socket=False)
    conn.send(store.port)
    while True:
        msg = conn.recv()
        if msg == "cpu":
            t = os.times()
            conn.send(t.user + t.system)
            continue
        if msg != "count":
            break
        server = store._server
        conn.send(server.connections if server is not None else -1)
    store.close()


def _serve_relay(port: int, conn: "Any") -> None:
    """One node's relay in its own process (as gpucoll-run's agent runs it)."""
    from gpucoll.store._relay import StoreRelay

    relay = StoreRelay("127.0.0.1", port, token=None, timeout=60)
    conn.send(relay.port)
    conn.recv()
    relay.close()


def start_relay(port: int) -> "tuple[Any, Any, int]":
    """One node's relay to the server on ``port``, in a process of its own (as gpucoll-run's
    agent runs it): (process, its pipe, the relay's port). :func:`stop_relay` ends it."""
    import multiprocessing as mp

    here, there = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_serve_relay, args=(port, there), daemon=True)
    proc.start()
    if not here.poll(60):
        proc.kill()
        raise RuntimeError("a store relay did not start within 60 s")
    return proc, here, int(here.recv())


def stop_relay(relay: "tuple[Any, Any, int]") -> None:
    proc, conn, _ = relay
    try:
        conn.send(None)
    except OSError:
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def _gen(port: int, n: int, k: int, tag: str, source: str, start: "Any", results: "Any",
         unix: "str | None" = None) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    script = rendezvous_script(tag, n)
    results.put("ready")
    start.wait()
    try:
        results.put(drive("127.0.0.1", port, "gpucoll", [script] * k, timeout=120.0, source=source,
                          unix=unix))
    except Exception as e:  # reported by the parent
        results.put(f"{type(e).__name__}: {e}")


def relay_rendezvous(server_port: int, count: "Callable[[], int]", n: int, ports: list[int],
                     tag: str, cpu: "Callable[[], float]",
                     unix: bool = False) -> tuple[float, int, float, float]:
    """One rendezvous of ``n`` clients split evenly over ``ports`` (a relay's each, or the
    server's own port repeated), one generator process per port; ``unix``: each connects
    to its port's abstract Unix socket, as a rank reaches the relay on its own node
    (gpucoll-run's ranks do: their client tries the relay's Unix socket first). Returns the time from
    the start signal to the last client woken, and the server's connections while the
    clients were parked, the server process's CPU seconds over the rendezvous, and the
    fan-out: from the master's ``set`` of the key they wait for to the last one woken."""
    import multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from gpucoll.store import TCPStore

    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    per = [n // len(ports) + (1 if i < n % len(ports) else 0) for i in range(len(ports))]
    from gpucoll.store._sockets import unix_socket_name

    procs = [ctx.Process(target=_gen, args=(p, n, k, tag, f"127.{1 + i // 250}.{i % 250}.1", start, results,
                                            unix_socket_name("127.0.0.1", p) if unix else None),
                         daemon=True) for i, (p, k) in enumerate(zip(ports, per))]
    for p in procs:
        p.start()
    master = TCPStore("127.0.0.1", server_port, timeout=120, use_unix_socket=False)
    for _ in procs:
        if results.get(timeout=120) != "ready":
            raise RuntimeError("generator out of step")
    cpu0 = cpu()
    t0 = time.monotonic()
    start.set()
    master.wait([f"{tag}/all"])
    held = count()
    t_set = time.monotonic()
    master.set(f"{tag}/go", b"1")
    ends: list[float] = []
    for _ in procs:
        got = results.get(timeout=120)
        if isinstance(got, str):
            raise RuntimeError(f"rendezvous of {n}: {got}")
        ends += got
    used = cpu() - cpu0
    for p in procs:
        p.join(10)
    master.close()
    return max(ends) - t0, held, used, max(ends) - t_set


def main(argv: "list[str] | None" = None) -> int:
    import argparse
    import multiprocessing as mp
    import statistics

    ap = argparse.ArgumentParser(description="rendezvous through node-local relays vs direct")
    ap.add_argument("--relays", default="1024,4096", help="client counts, comma-separated")
    ap.add_argument("--per-node", type=int, default=256, help="clients per node (per relay)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--relay-link", choices=("unix", "tcp"), default="unix",
                    help="how a node's clients reach its relay: its Unix socket, as gpucoll-run's ranks do "
                         "(default), or TCP on loopback")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_serve_store, args=(there,), daemon=True)
    server.start()
    port = here.recv()

    def count() -> int:
        here.send("count")
        return int(here.recv())

    def cpu() -> float:
        here.send("cpu")
        return float(here.recv())

    print("| clients | nodes | direct (s) | relays (s) | relays / direct | server CPU direct / relays (s) "
          "| fan-out direct / relays (s) | server connections direct / relays |")
    print("|---|---|---|---|---|---|---|---|")
    run = 0
    for n in (int(x) for x in args.relays.split(",")):
        nodes = max(1, n // args.per_node)
        relays = [start_relay(port) for _ in range(nodes)]
        times: dict[str, list[float]] = {"direct": [], "relays": []}
        cpus: dict[str, list[float]] = {"direct": [], "relays": []}
        fans: dict[str, list[float]] = {"direct": [], "relays": []}
        held: dict[str, int] = {}
        for rep in range(args.repeats):
            order = ("direct", "relays") if rep % 2 == 0 else ("relays", "direct")
            for kind in order:
                run += 1
                ports = [port] * nodes if kind == "direct" else [r[2] for r in relays]
                t, c, used, fan = relay_rendezvous(port, count, n, ports, f"rdv{n}-{run}", cpu,
                                                   unix=kind == "relays" and args.relay_link == "unix")
                times[kind].append(t)
                cpus[kind].append(used)
                fans[kind].append(fan)
                held[kind] = c
                time.sleep(0.5)  # TIME_WAITs and the previous run's closes settle
        for relay in relays:
            stop_relay(relay)
        d, r = statistics.median(times["direct"]), statistics.median(times["relays"])
        print(f"| {n:,} | {nodes} | {d:.3f} ({', '.join(f'{x:.2f}' for x in times['direct'])}) "
              f"| {r:.3f} ({', '.join(f'{x:.2f}' for x in times['relays'])}) | {r / d:.2f}x "
              f"| {statistics.median(cpus['direct']):.3f} / {statistics.median(cpus['relays']):.3f} "
              f"| {statistics.median(fans['direct']):.3f} / {statistics.median(fans['relays']):.3f} "
              f"| {held['direct']:,} / {held['relays']:,} |", flush=True)
    here.send(None)
    server.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
